"""STaR's pieces: the hint never reaches a training example (token ids), only correct rationales are kept,
the SFT loss is the masked NLL of eq. 12.5, and a `--model tiny` run does >= 2 outer iterations."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import envs
from common.rollout import RolloutConfig, RolloutEngine
from common.tracking import read_scalars
from tests.distributed_runs import assert_fsdp_matches_data_parallel
from envs.reasoning import ArithmeticEnv

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("star", ROOT / "algorithms" / "star.py")
star = importlib.util.module_from_spec(spec)
sys.modules["star"] = star
spec.loader.exec_module(star)


class CoinFlipArithmetic(ArithmeticEnv):
    """Arithmetic whose verifier a random model passes about half the time (used by SMOKE_TEST_ARGS and the tiny
    run below): a reply counts as the correct answer when its first character has an even code point. Everything
    else (problems, hint, reference solutions, splits, info) is ArithmeticEnv's."""

    env_version = "coinflip-arithmetic-test"

    def step(self, action):
        lucky = isinstance(action, str) and action[:1] and ord(action[0]) % 2 == 0
        return super().step(f"Answer: {self.answer}" if lucky else "no answer")


class RankZeroSolvesAll(CoinFlipArithmetic):
    """CoinFlipArithmetic, except that on torchrun rank 0 every reply is the correct answer: rank 0 has no failure
    to rationalise while rank 1 has some."""

    def step(self, action):
        return super().step("0" if os.environ.get("RANK", "0") == "0" else action)


def _engine(tiny, temperature=1.0, max_new_tokens=6):
    model, tok = tiny
    return RolloutEngine(model, tok, RolloutConfig(action_mode="free", temperature=temperature,
                                                   max_turn_tokens=max_new_tokens))


def _sample(engine, seeds, hint, shots="", env_cls=CoinFlipArithmetic, seed=0):
    system = "Add the two numbers."
    wrapped = [star.PromptedEnv(env_cls(level=1), system, shots, hint) for _ in seeds]
    return engine.run(wrapped, seeds, "arithmetic", generator=torch.Generator().manual_seed(seed)), system


def _contains(seq, sub):
    return any(seq[i: i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_hint_is_in_the_sampling_prompt_but_never_in_a_training_example(tiny):
    engine = _engine(tiny)
    chat = engine.chat
    seeds = list(range(8))
    shots = star.few_shot_prompt(ArithmeticEnv(level=1), 2, chat)[1]
    hint_shots = star.few_shot_prompt(ArithmeticEnv(level=1), 2, chat, hint=True)[1]  # exemplars with their hints
    hinted, system = _sample(engine, seeds, hint=True, shots=hint_shots)
    plain, _ = _sample(engine, seeds, hint=False, shots=shots)
    for h, p in zip(hinted, plain):
        env = ArithmeticEnv(level=1)
        obs, _ = env.reset(seed=h.seed)
        hint_ids = chat.encode(env.hint_prompt(env.answer))
        # the rationalisation was sampled under the hint ...
        assert _contains(h.token_ids[: h.prompt_length], hint_ids)
        hint_prompt = chat.prompt_ids(system, hint_shots + obs + "\n" + env.hint_prompt(env.answer))
        assert h.token_ids[: h.prompt_length] == hint_prompt
        # ... and is trained on without it: the no-hint prompt's ids + exactly the ids that were sampled
        ex = star.sft_example(p.token_ids[: p.prompt_length], h)
        ex.validate()
        assert ex.token_ids[: ex.prompt_length] == chat.prompt_ids(system, shots + obs)
        assert ex.token_ids[ex.prompt_length:] == h.token_ids[h.prompt_length:]
        assert ex.source_mask == [0] * ex.prompt_length + [1] * (len(ex.token_ids) - ex.prompt_length)
        assert not _contains(ex.token_ids, hint_ids)
        assert not _contains(ex.token_ids, chat.encode("The correct answer is"))  # nor an exemplar's hint
        assert "correct answer is" not in engine.tokenizer.decode(ex.token_ids[: ex.prompt_length])


def _traj(tiny, reply: str, answer_env=ArithmeticEnv, seed=5):
    """A hand-made single-attempt record: the env's prompt, then `reply` (+ EOS) as the sampled tokens."""
    engine = _engine(tiny)
    env = answer_env(level=1)
    obs, _ = env.reset(seed=seed)
    prompt = engine.chat.prompt_ids("sys", obs)
    reply_ids = engine.chat.encode(reply) + [engine.chat.eos_id]
    _, reward, _, _, info = env.step(reply)
    from common.records import Trajectory, Turn
    return Trajectory(token_ids=prompt + reply_ids, source_mask=[0] * len(prompt) + [1] * len(reply_ids),
                      behavior_logprobs=[0.0] * len(prompt) + [-1.0] * len(reply_ids), policy_version=0,
                      turns=[Turn(reply, "", reward, info["action_valid"], len(reply_ids))], rewards={},
                      return_=reward, termination=info["termination"], env_version="", task_id="", seed=seed,
                      prompt_length=len(prompt)), env.answer, engine.chat.eos_id


def test_only_correct_rationales_are_kept(tiny):
    env = ArithmeticEnv(level=1)
    env.reset(seed=5)
    answer = env.answer
    right, _, eos = _traj(tiny, f"<scratch>...</scratch>\nAnswer: {answer}")
    assert right.success
    wrong, _, _ = _traj(tiny, f"Answer: {int(answer) + 1}")
    unparsable, _, _ = _traj(tiny, f"it is {answer}")
    assert star.keep(right, eos, require_eos=True) == (True, "")
    assert star.keep(wrong, eos, require_eos=True) == (False, "wrong")
    assert star.keep(unparsable, eos, require_eos=True) == (False, "wrong")
    # right answer but cut by the token cap (no EOS): dropped only when --require-eos
    cut = star.sft_example(right.token_ids[: right.prompt_length], right)
    cut.token_ids, cut.source_mask = cut.token_ids[:-1], cut.source_mask[:-1]
    cut.behavior_logprobs = cut.behavior_logprobs[:-1]
    assert star.keep(cut, eos, require_eos=True) == (False, "cut")
    assert star.keep(cut, eos, require_eos=False) == (True, "")
    # a rationalisation that repeats the hint is dropped when the leak filter is on
    leak, _, _ = _traj(tiny, f"The correct answer is {answer}.\nAnswer: {answer}")
    assert star.keep(leak, eos, True, star.HINT_LEAK) == (False, "leak")
    assert star.keep(leak, eos, True, None) == (True, "")


def test_sft_loss_is_the_masked_token_mean_nll(tiny):
    model, _ = tiny
    right, _, _ = _traj(tiny, "Answer: 3", seed=1)
    other, _, _ = _traj(tiny, "<scratch>x</scratch>\nAnswer: 9", seed=2)
    batch = [right, other]
    n = sum(t.num_policy_tokens for t in batch)
    with torch.no_grad():
        loss = star.sft_loss(model, batch, n)
        # by hand: -log p(token_j | tokens_<j) summed over the rationale tokens only, / their count
        total = 0.0
        for t in batch:
            logits = model(input_ids=torch.tensor([t.token_ids])).logits[0].float()
            logp = F.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(t.token_ids[1:])[:, None]).squeeze(-1)
            total -= (logp * torch.tensor(t.source_mask[1:], dtype=torch.float32)).sum().item()
        # micro-batches add up to the full step
        parts = sum(star.sft_loss(model, [t], n).item() for t in batch)
    assert loss.item() == pytest.approx(total / n, rel=1e-5)
    assert parts == pytest.approx(loss.item(), rel=1e-5)


def test_bad_env_for_star_fails_fast(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "algorithms" / "star.py"), "--model", "tiny", "--env-id", "gridworld",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "--env-id" in proc.stderr, proc.stderr[-1500:]


def test_tiny_run_two_outer_iterations_keeps_and_trains(tmp_path):
    """STaR end to end on `tiny`: the coin-flip verifier lets a random model keep examples, so every phase runs."""
    cmd = [sys.executable, str(ROOT / "algorithms" / "star.py"), "--model", "tiny", "--output-dir", str(tmp_path),
           *star.SMOKE_TEST_ARGS, "--outer-iterations", "3", "--num-problems", "8", "--sft-steps", "3",
           "--learning-rate", "1e-3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    s = {tag: [v for _, v in values] for tag, values in read_scalars(run_dir).items()}
    assert len(s["charts/success_rate"]) == 3 and [st for st, _ in read_scalars(run_dir)["charts/success_rate"]] == [1, 2, 3]
    assert len(s["eval/success_rate"]) == 4  # p_0 before training, then after each iteration
    for k in range(3):
        direct = s["charts/kept_direct"][k]
        assert direct == round(s["charts/success_rate"][k] * 8)  # --require-eos False: every success is kept
        assert 0 <= s["charts/kept_rationalized"][k] <= 8 - direct
        assert s["charts/train_set_size"][k] == direct + s["charts/kept_rationalized"][k]
    assert sum(s["charts/train_set_size"]) > 0 and all(v > 0 for v in s["losses/sft_loss"])
    assert s["diagnostics/sft_steps"] == [3, 4, 4]  # 3 * 1.2 = 3.6 -> 4, 3 * 1.44 = 4.32 -> 4
    assert "iter 3/3" in proc.stdout


@pytest.mark.parametrize("env_id", ["arithmetic", "wordproblems"])
def test_few_shot_prompt_uses_the_envs_reference_rationales(tiny, env_id):
    engine = _engine(tiny, max_new_tokens=3)
    chat = engine.chat
    env = envs.make(env_id, level=1)
    system, shots = star.few_shot_prompt(env, 2, chat)
    assert "Example:" not in system and "Answer: <integer>" in system
    for i in range(2):  # each exemplar: the problem as a user turn, its reference rationale as the assistant turn
        obs, _ = env.reset(seed=star.EXEMPLAR_SEED + i)
        assert f"{obs}{chat.after_user}{env.reference_solution}{chat.after_action}" in shots
    # a batch of this family runs through the wrapper; the prompt is the chat of the exemplars, then the problem
    trajs = engine.run([star.PromptedEnv(envs.make(env_id, level=1), system, shots) for _ in range(2)], [0, 1], env_id,
                       generator=torch.Generator().manual_seed(0))
    assert all(t.termination in ("failure", "invalid_action", "success") for t in trajs)
    ids = trajs[0].token_ids[: trajs[0].prompt_length]
    assert ids[-len(chat.encode(chat.after_user)):] == chat.encode(chat.after_user)  # the model answers the last turn
    # turns closed by the end-of-turn token: the system message, 2 x (exemplar question, exemplar answer), the problem
    assert ids.count(chat.eos_id) == 1 + 2 * 2 + 1


def test_torchrun_two_ranks_share_the_problems_and_stay_in_sync(tmp_path):
    """2 gloo ranks: each samples half of the problems, the counts add up over ranks, and the SFT steps
    (averaged gradients, global token mean) leave both ranks with identical weights."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29547",
           str(ROOT / "algorithms" / "star.py"), "--model", "tiny", "--output-dir", str(tmp_path),
           *star.SMOKE_TEST_ARGS, "--num-problems", "8", "--learning-rate", "1e-3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]  # rank 0 alone writes
    s = {tag: [v for _, v in values] for tag, values in read_scalars(run_dir).items()}
    for k in range(2):
        assert s["charts/kept_direct"][k] == round(s["charts/success_rate"][k] * 8)  # both ranks' 4 problems
    assert s["diagnostics/rank_param_divergence"] == [0.0, 0.0]
    assert sum(s["losses/sft_loss"]) > 0 and proc.stdout.count("iter 2/2") == 1


def test_lora_saves_only_the_adapter(tmp_path):
    from common.models import load_model

    cmd = [sys.executable, str(ROOT / "algorithms" / "star.py"), "--model", "tiny", "--output-dir", str(tmp_path),
           *star.SMOKE_TEST_ARGS, "--lora-r", "4", "--trainable-layers", "0", "--learning-rate", "1e-2", "--save-model"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    saved = run_dir / "model"
    assert (saved / "adapter_config.json").exists() and not (saved / "model.safetensors").exists()
    trained, _ = load_model(str(saved), "cpu")
    assert any(p.abs().sum() > 0 for n, p in trained.named_parameters() if "lora_B" in n)  # the adapter was trained


def test_fsdp_takes_the_data_parallel_steps(tmp_path):
    """2 gloo ranks: --fsdp (decoder layers sharded) against plain data parallel on the same seeds. The ranks keep
    different numbers of examples, so under FSDP the one with fewer micro-batches runs zero-weight passes to join the
    sharded collectives; rank 0 solves every problem, so it has nothing to rationalise while rank 1 does, and it
    joins rank 1's weight gather anyway (without either the run hangs). Same SFT losses, kept counts, held-out solve
    rates and saved weights, up to float noise."""
    smoke = [a if a != "tests.test_star:CoinFlipArithmetic" else "tests.test_star:RankZeroSolvesAll"
             for a in star.SMOKE_TEST_ARGS]
    flags = ["--model", "tiny", *smoke, "--num-problems", "8", "--learning-rate", "1e-3", "--micro-batch-size", "1",
             "--save-model"]
    _, expected = assert_fsdp_matches_data_parallel(
        "star.py", tmp_path, flags, ("losses/sft_loss", "losses/sft_loss_last", "charts/kept_direct",
                                     "charts/kept_rationalized", "charts/success_rate", "eval/success_rate"),
        cwd=tmp_path)
    assert sum(v for _, v in expected["losses/sft_loss"]) > 0
    assert all(0 < v < 1 for _, v in expected["charts/success_rate"])  # rank 0 solves all, rank 1 not


def test_fsdp_needs_torchrun():
    with pytest.raises(SystemExit, match="--fsdp shards over torchrun processes"):
        star.validate_args(star.Args(fsdp=True))
