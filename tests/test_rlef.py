"""RLEF's pieces: the execution reward, pass@k, advantages and loss by hand, feedback masking, an update, a tiny run."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from common.chat import ChatFormat
from common.records import Trajectory
from common.rollout import behavior_units, policy_logprobs
from common.tracking import read_scalars
from tests.distributed_runs import assert_fsdp_matches_data_parallel
from envs.codegen import REWARD_INVALID, CodegenEnv, generate_task
from envs.sandbox import same_value

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("rlef", ROOT / "algorithms" / "rlef.py")
rlef = importlib.util.module_from_spec(spec)
sys.modules["rlef"] = rlef
spec.loader.exec_module(rlef)


def scripted_episode(chat: ChatFormat, env, seed: int, actions: list[str]) -> Trajectory:
    """The record of an episode whose attempts are given texts.

    Built exactly like the rollout engine builds one: prompt, then each action followed by EOS (policy
    tokens, mask 1), then the environment's execution feedback wrapped as the next user turn (mask 0).
    """
    obs, info = env.reset(seed=seed)
    ids = chat.prompt_ids(env.system_prompt, obs)
    mask, turn_rewards, components, termination = [0] * len(ids), [], {}, "truncated"
    for action in actions:
        action_ids = chat.encode(action) + [chat.eos_id]
        ids, mask = ids + action_ids, mask + [1] * len(action_ids)
        obs, reward, terminated, truncated, info = env.step(action)
        turn_rewards.append(reward)
        for name, value in info.get("reward_components", {}).items():
            components[name] = components.get(name, 0.0) + value
        if terminated or truncated:
            termination = info.get("termination", "truncated")
            break
        segment = chat.next_turn_ids(obs, action_ended_with_eos=True)
        ids, mask = ids + segment, mask + [0] * len(segment)
    return Trajectory(token_ids=ids, source_mask=mask, behavior_logprobs=[0.0] * len(ids), policy_version=0, turns=[],
                      rewards=components, return_=float(sum(turn_rewards)), termination=termination,
                      env_version=env.env_version, task_id=env.task_id, seed=seed)


def fenced(code: str) -> str:
    return f"Here is the function.\n```python\n{code}```"


def affine_task():
    """The first level-1 training task from the `affine` template (f(x) = a * x + b), and its seed."""
    seed = next(s for s in range(200) if "/affine/" in generate_task(s, "train", 1).task_id)
    return seed, generate_task(seed, "train", 1)


def partial_solution(task) -> str:
    """The reference on x >= 0, a wrong constant below: passes some tests, fails others."""
    return task.reference.replace("return ", "return 0 if x < 0 else ", 1)


def expected_fraction(task, code: str) -> float:
    """Pass fraction computed here, outside the sandbox, by running the (trusted) code on every test."""
    namespace = {}
    exec(code, namespace)
    fn = namespace[task.entry_point]
    return sum(same_value(fn(*t.args), t.expected) for t in task.tests) / len(task.tests)


# --- the reward: fraction of passing tests (eq. 12.13) ----------------------------------------------------


def test_reward_is_the_fraction_of_passing_tests(tiny):
    _, tok = tiny
    chat = ChatFormat(tok)
    seed, task = affine_task()
    env = CodegenEnv("train", 1, max_attempts=1)
    partial = partial_solution(task)
    frac = expected_fraction(task, partial)
    assert 0 < frac < 1  # really partially correct
    cases = {"known-good": (task.reference, 1.0, "success"), "partial": (partial, frac, "failure"),
             "broken (syntax)": (f"def {task.entry_point}(x:\n    return x\n", 0.0, "failure"),
             "broken (raises)": (f"def {task.entry_point}(x):\n    raise ValueError(x)\n", 0.0, "failure")}
    for name, (code, fraction, termination) in cases.items():
        traj = scripted_episode(chat, env, seed, [fenced(code)])
        assert traj.return_ == pytest.approx(fraction), name
        assert traj.rewards["task"] == pytest.approx(fraction) and traj.rewards["format"] == 0.0, name
        assert traj.termination == termination, name
    # no code block: nothing runs, the format penalty is the whole reward
    traj = scripted_episode(chat, env, seed, ["def f(x): return x"])
    assert traj.return_ == pytest.approx(REWARD_INVALID) and traj.rewards["task"] == 0.0
    assert traj.termination == "invalid_action"


def test_multi_turn_reward_is_the_last_attempts_fraction(tiny):
    _, tok = tiny
    chat = ChatFormat(tok)
    seed, task = affine_task()
    env = CodegenEnv("train", 1, max_attempts=3)
    partial = partial_solution(task)
    fixed = scripted_episode(chat, env, seed, [fenced(partial), fenced(task.reference)])
    assert fixed.return_ == pytest.approx(1.0) and fixed.termination == "success"
    worse = scripted_episode(chat, env, seed, [fenced(partial), "no code", fenced(partial)])
    # task components telescope to the last attempt's fraction; one format penalty for the attempt without code
    assert worse.rewards["task"] == pytest.approx(expected_fraction(task, partial))
    assert worse.return_ == pytest.approx(expected_fraction(task, partial) + REWARD_INVALID)
    assert worse.termination == "failure"


def test_reference_demonstration_trains_only_the_code_answer(tiny):
    _, tok = tiny
    chat = ChatFormat(tok)
    seed, task = affine_task()
    demo = rlef.reference_demonstration(chat, CodegenEnv("train", 1), seed)
    demo.validate()
    ((start, end),) = demo.policy_token_spans()
    assert end == len(demo.token_ids)
    assert demo.token_ids[start:end] == chat.encode(f"```python\n{task.reference}```") + [chat.eos_id]
    # and that answer, run through the environment, is a correct submission
    env = CodegenEnv("train", 1, max_attempts=1)
    assert scripted_episode(chat, env, seed, [tok.decode(demo.token_ids[start:end - 1])]).return_ == 1.0


# --- pass@k, advantages, loss: hand-computed ----------------------------------------------------------------


def test_pass_at_k_unbiased_estimator_hand_computed():
    assert rlef.pass_at_k(5, 2, 1) == pytest.approx(0.4)  # c / n
    assert rlef.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert rlef.pass_at_k(10, 1, 4) == pytest.approx(1 - math.comb(9, 4) / math.comb(10, 4))  # = 0.4
    assert rlef.pass_at_k(4, 0, 4) == 0.0
    assert rlef.pass_at_k(4, 1, 4) == 1.0 and rlef.pass_at_k(5, 3, 3) == 1.0  # n - c < k: some draw passes


def test_advantages_grpo_per_group_and_ppo_per_batch():
    returns = torch.tensor([[1.0, 0.0, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]])
    grpo = rlef.advantages(returns, "grpo", 1e-4)
    std0 = math.sqrt((0.25 + 0.25 + 0 + 0) / 4)  # group 0: mean 0.5
    assert torch.allclose(grpo[0], torch.tensor([0.5, -0.5, 0.0, 0.0]) / (std0 + 1e-4))
    assert torch.equal(grpo[1], torch.zeros(4))  # zero variance: no signal
    ppo = rlef.advantages(returns, "ppo", 1e-4)
    mean = returns.mean().item()  # 0.35 over the whole batch
    std = math.sqrt(((returns - mean) ** 2).mean().item())
    assert torch.allclose(ppo, (returns - mean) / (std + 1e-4), atol=1e-6)
    assert ppo[1, 0].item() < 0  # a zero-variance group still gets a (batch-relative) advantage


def test_clipped_loss_hand_computed_and_micro_batches_add_up():
    logp = torch.log(torch.tensor([[0.5, 0.4, 0.9], [0.3, 0.2, 1.0]]))
    old = torch.log(torch.tensor([[0.25, 0.4, 0.5], [0.6, 0.2, 1.0]]))
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, stats = rlef.clipped_loss(logp, old, adv, mask, 0.2, num_units=5)
    # ratios [2, 1, 1.8] with A=+1 -> [1.2, 1, 1.2]; [0.5, 1] with A=-2 -> min(-1, -1.6) = -1.6, and -2
    assert loss.item() == pytest.approx(-(1.2 + 1.0 + 1.2 - 1.6 - 2.0) / 5, abs=1e-6)
    assert stats["clipped"] == 3 and stats["ratio_sum"] == pytest.approx(6.3, abs=1e-5)
    parts = sum(rlef.clipped_loss(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], 0.2, 5)[0] for i in range(2))
    assert parts.item() == pytest.approx(loss.item(), abs=1e-6)


# --- the loss ignores execution-feedback tokens -------------------------------------------------------------


def test_loss_ignores_execution_feedback_tokens(tiny):
    model, tok = tiny
    chat = ChatFormat(tok)
    seed, task = affine_task()
    env = CodegenEnv("train", 1, max_attempts=2)
    traj = scripted_episode(chat, env, seed, [fenced(partial_solution(task)), fenced(task.reference)])
    traj.validate()
    # the execution feedback after attempt 1 is in the record, and every one of its tokens has mask 0
    env.reset(seed=seed)
    feedback, *_ = env.step(fenced(partial_solution(task)))
    assert "tests passed" in feedback and "Public test" in feedback
    segment = chat.next_turn_ids(feedback, action_ended_with_eos=True)
    n = len(segment)
    (at,) = [i for i in range(len(traj.token_ids) - n) if traj.token_ids[i:i + n] == segment]
    assert not any(traj.source_mask[at:at + n])
    spans = traj.policy_token_spans()
    assert len(spans) == 2 and spans[0][1] == at and spans[1][0] == at + n  # attempt, feedback, attempt
    # the loss, as the trainer computes it, equals the surrogate over the two attempts' tokens only
    units = policy_logprobs(model, [traj], "free")
    old = units.logprobs.detach() - 0.1  # ratio e^0.1, inside no clip with eps 0.3
    adv = torch.tensor([0.7])
    loss, _ = rlef.clipped_loss(units.logprobs, old, adv, units.mask, 0.3, int(units.mask.sum()))
    with torch.no_grad():
        logp_all = F.log_softmax(model(input_ids=torch.tensor([traj.token_ids])).logits[0].float(), -1)
    ids = torch.tensor(traj.token_ids)
    next_logp = logp_all[:-1].gather(-1, ids[1:, None]).squeeze(-1)  # log p(token j | tokens < j), j >= 1
    policy = torch.tensor(traj.source_mask[1:], dtype=torch.bool)
    expected = -(0.7 * math.exp(0.1) * policy.sum()) / policy.sum()  # ratio is e^0.1 on every policy token
    assert int(units.mask.sum()) == sum(traj.source_mask) == int(policy.sum())
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.allclose(units.logprobs[0], next_logp[policy], atol=1e-4)
    # behaviour log-probs of feedback tokens (nonzero only by a bug) never reach the loss
    traj.behavior_logprobs = [lp if m else 5.0 for lp, m in zip(traj.behavior_logprobs, traj.source_mask)]
    old_units, mask = behavior_units([traj], "free")
    assert mask.sum() == sum(traj.source_mask) and (old_units == 0).all()


# --- one update moves probability towards the passing submission --------------------------------------------


def test_update_raises_the_passing_submission_and_lowers_the_failing_one(tiny):
    model, tok = tiny
    chat = ChatFormat(tok)
    seed, task = affine_task()
    env = CodegenEnv("train", 1, max_attempts=1)
    good = fenced(task.reference)
    bad = fenced(f"def {task.entry_point}(x):\n    return x\n")
    group = [scripted_episode(chat, env, seed, [text]) for text in (good, bad, good, bad)]
    returns = torch.tensor([[t.return_ for t in group]])
    assert returns[0, 0] == 1.0 and returns[0, 1] < 1.0
    with torch.no_grad():  # the behaviour log-probs a sampler would have recorded
        before = policy_logprobs(model, group, "free")
    for t, row in zip(group, before.logprobs):
        lps = iter(row.tolist())
        t.behavior_logprobs = [next(lps) if m else 0.0 for m in t.source_mask]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        args = SimpleNamespace(update_epochs=3, micro_batch_size=2, temperature=1.0, clip_eps=0.2, max_grad_norm=1.0,
                               update_dtype="float32")
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        stats = rlef.update_policy(model, opt, params, group, rlef.advantages(returns, "grpo", 1e-4).flatten(), args)
        assert stats["mismatch"] < 1e-4 and stats["num_units"] == sum(sum(t.source_mask) for t in group)
        with torch.no_grad():
            after = policy_logprobs(model, group, "free")
        gain = ((after.logprobs - before.logprobs) * before.mask).sum(1) / before.mask.sum(1)
        assert gain[0] > 0 and gain[2] > 0 and gain[1] < 0 and gain[3] < 0
    finally:
        model.load_state_dict(state)


# --- validation and a short tiny run -------------------------------------------------------------------------


def test_bad_values_fail_with_the_flag_name():
    for changes, flag in (({"eval_k": 5, "eval_samples": 2}, "--eval-k"), ({"group_size": 1}, "--group-size"),
                          ({"level": 4}, "--level"), ({"update_epochs": 0}, "--update-epochs"),
                          ({"humaneval_tasks": 165}, "--humaneval-tasks")):
        with pytest.raises(SystemExit, match=flag):
            rlef.validate_args(rlef.Args(**changes))


def test_tiny_run_completes_with_ppo_curriculum_and_filtering(tmp_path):
    cmd = [sys.executable, str(ROOT / "algorithms" / "rlef.py"), "--model", "tiny", "--output-dir", str(tmp_path),
           "--advantage", "ppo", "--total-iterations", "2", "--group-size", "2", "--max-turn-tokens", "6",
           "--resample-budget", "1", "--promote-threshold", "0", "--curriculum-window", "2",
           "--eval-tasks", "1", "--humaneval-tasks", "1", "--eval-samples", "2", "--eval-k", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    scalars = read_scalars(run_dir)
    # threshold 0: the level goes up after the first full window
    assert [v for _, v in scalars["charts/curriculum_level"]] == [1.0, 2.0]
    # a random model writes no code: every group is all-invalid (zero variance), filtered and resampled once
    assert [v for _, v in scalars["diagnostics/zero_variance_groups"]] == [1.0, 1.0]
    assert [v for _, v in scalars["charts/invalid_action_rate"]] == [1.0, 1.0]
    assert [v for _, v in scalars["eval/pass@1"]] == [0.0, 0.0]  # before and after training
    assert "moving to level 2" in proc.stdout
    # no group left, no update: no loss is logged (a placeholder 0 would read as a measured one)
    assert not [t for t in scalars if t.startswith("losses/") or t in ("diagnostics/grad_norm", "diagnostics/ratio_mean")]
    assert "| loss +nan |" in proc.stdout


def test_resume_may_change_the_evaluation_but_not_the_training(tmp_path, monkeypatch):
    """Evaluating a finished run at another level (`--resume RUN --eval-level 2`) is allowed; the evaluation draws from
    its own generator, so the training stays the saved one. A training flag (here the start level) is refused."""
    import json

    from common.checkpoint import cli_with_resume
    (tmp_path / "args.json").write_text(json.dumps({**vars(rlef.Args()), "sft_steps": 40, "world_size": 1}))
    monkeypatch.setattr(sys, "argv", ["rlef.py", "--resume", str(tmp_path), "--eval-level", "2", "--eval-samples", "8",
                                      "--eval-k", "8", "--eval-temperature", "0.2", "--eval-attempts", "2"])
    args = cli_with_resume(rlef.Args, rlef.RESUMABLE, "rlef.py")
    assert (args.eval_level, args.eval_samples, args.eval_k, args.eval_attempts, args.sft_steps) == (2, 8, 8, 2, 40)
    monkeypatch.setattr(sys, "argv", ["rlef.py", "--resume", str(tmp_path), "--eval-level", "2", "--level", "2"])
    with pytest.raises(SystemExit, match=r"not --level \(saved 1, given 2\)"):
        cli_with_resume(rlef.Args, rlef.RESUMABLE, "rlef.py")


def test_lora_run_saves_an_adapter_that_load_model_loads(tmp_path):
    from common.models import load_model

    cmd = [sys.executable, str(ROOT / "algorithms" / "rlef.py"), "--model", "tiny", "--output-dir", str(tmp_path),
           "--lora-r", "4", "--save-model", "--total-iterations", "1", "--group-size", "2", "--max-turn-tokens", "6",
           "--sft-steps", "1", "--sft-batch-size", "2", "--eval-tasks", "0", "--humaneval-tasks", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    saved = run_dir / "model"
    assert (saved / "adapter_config.json").exists() and not (saved / "model.safetensors").exists()  # adapter only
    model, _ = load_model(str(saved))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # B starts at 0: the cold start trained the adapter


# a codegen environment whose rank-0 episodes earn a checksum bonus a random `tiny` model collects (reward variance:
# trained) while rank 1's earn only the real reward, which tiny never does (zero variance: dropped, nothing to train)
RANK_SHAPED_CODEGEN = '''
import os
from envs.codegen import CodegenEnv


class RankShapedCodegen(CodegenEnv):
    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        bonus = sum(map(ord, str(action))) % 10 / 10 if os.environ.get("RANK", "0") == "0" else 0.0
        return obs, reward + bonus, terminated, truncated, info
'''


def test_fsdp_takes_the_data_parallel_steps(tmp_path):
    """2 gloo ranks, every layer trained: --fsdp (decoder layers sharded) against plain data parallel on the same
    seeds, with the SFT cold start, evaluation on rank 0 and a rank whose group is dropped and resampled twice (the
    default --resample-budget) while the other rank's is kept: ranks resample different numbers of times, and it joins
    the sharded collectives with zero-weight passes; a gather per resampling pass, or no such passes, would hang the
    run. Same losses, gradient norms, returns, evaluation and saved weights, up to float noise."""
    import os

    (tmp_path / "rank_shaped.py").write_text(RANK_SHAPED_CODEGEN)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    flags = ["--model", "tiny", "--env-id", "rank_shaped:RankShapedCodegen", "--group-size", "4", "--max-turn-tokens", "8",
             "--micro-batch-size", "2", "--trainable-layers", "0", "--learning-rate", "1e-2", "--sft-steps", "1",
             "--sft-batch-size", "2", "--eval-tasks", "1", "--eval-samples", "2", "--eval-k", "2",
             "--humaneval-tasks", "0", "--total-iterations", "2", "--save-model"]
    _, expected = assert_fsdp_matches_data_parallel(
        "rlef.py", tmp_path, flags, ("losses/sft_loss", "losses/policy_loss", "diagnostics/grad_norm",
                                     "charts/episodic_return", "diagnostics/logprob_mismatch", "eval/mean_reward"),
        weight_atol=5e-4, cwd=tmp_path, env=env)  # 5% of one AdamW step at lr 1e-2 (seen: 1.1e-4 on 3 of 16,576)
    assert [v for _, v in expected["diagnostics/zero_variance_groups"]] == [0.5, 0.5]  # rank 1's group, dropped
    assert all(v > 0 for _, v in expected["diagnostics/grad_norm"])


def test_fsdp_needs_torchrun():
    with pytest.raises(SystemExit, match="--fsdp shards over torchrun processes"):
        rlef.validate_args(rlef.Args(fsdp=True))


def test_bf16_sampler_is_refreshed_after_the_cold_start_and_every_update(tmp_path):
    """`--rollout-dtype bfloat16 --update-dtype bfloat16` on `tiny` over a frozen trunk: a bf16 copy samples and is
    refreshed after the (large-step) SFT cold start and after every update, so the sampler -> trainer log-prob gap is
    bf16 rounding (> 0, < 0.1; a copy left at the initial weights is far off), its mean over policy tokens no larger
    than its maximum; the saved weights stay fp32."""
    from safetensors.torch import load_file

    cmd = [sys.executable, str(ROOT / "algorithms" / "rlef.py"), "--model", "tiny", "--output-dir", str(tmp_path),
           "--rollout-dtype", "bfloat16", "--update-dtype", "bfloat16", "--trainable-layers", "1", "--save-model",
           "--total-iterations", "2", "--group-size", "2", "--max-turn-tokens", "8", "--no-filter-zero-variance",
           "--learning-rate", "1e-2", "--sft-steps", "2", "--sft-batch-size", "2", "--sft-learning-rate", "1e-2",
           "--eval-tasks", "1", "--humaneval-tasks", "0", "--eval-samples", "2", "--eval-k", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    scalars = read_scalars(run_dir)
    gaps = [v for _, v in scalars["diagnostics/logprob_mismatch"]]
    assert len(gaps) == 2 and all(0 < g < 0.1 for g in gaps), gaps
    means = [v for _, v in scalars["diagnostics/logprob_mismatch_mean"]]  # per policy token, so at most the largest gap
    assert len(means) == 2 and all(0 < m <= g for m, g in zip(means, gaps)), (means, gaps)
    assert all(v > 0 for _, v in scalars["perf/weight_sync_s"]) and len(scalars["eval/pass@1"]) == 2
    weights = load_file(str(run_dir / "model" / "model.safetensors"))
    assert weights and all(w.dtype == torch.float32 for w in weights.values())


def test_bf16_sampler_is_not_for_fsdp():
    with pytest.raises(SystemExit, match="--rollout-dtype bfloat16 is a copy of whole weights"):
        rlef.validate_args(rlef.Args(fsdp=True, rollout_dtype="bfloat16"))
