"""Decision Transformer: returns-to-go by hand, the action-only loss mask token by token, the loss itself,
train/inference prompt agreement, R̂ decremented by the rewards received, `--model tiny` runs on CPU (learning,
resume, LoRA), and torchrun (2 gloo ranks == 1 process on the same global minibatch)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.offline import collect, write_dataset
from common.records import Trajectory, Turn
from common.tracking import read_scalars

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("decision_transformer", ROOT / "algorithms" / "decision_transformer.py")
dt = importlib.util.module_from_spec(spec)
sys.modules["decision_transformer"] = dt
spec.loader.exec_module(dt)


def _traj(rewards, actions=("right", "up", "left", "down")):
    """A hand-made dataset record: observations o0 (reset), o1, ... and the given rewards."""
    turns = [Turn(action_text=actions[k % len(actions)], observation=f"o{k + 1}", reward=r, action_valid=True,
                  num_action_tokens=0) for k, r in enumerate(rewards)]
    return Trajectory(token_ids=[], source_mask=[], behavior_logprobs=[], policy_version=0, turns=turns, rewards={},
                      return_=sum(rewards), termination="success", env_version="", task_id="t", seed=0,
                      extra={"initial_observation": "o0", "actions": [0] * len(rewards)})


def test_returns_to_go_hand_computed():
    # GridWorld-like episode: step, resource, step, goal -> R̂_t = sum of rewards from t on
    rewards = [-0.05, 0.95, -0.05, 2.95]
    assert dt.returns_to_go(rewards) == pytest.approx([3.8, 3.85, 2.9, 2.95])
    assert dt.returns_to_go([1.0]) == [1.0]
    assert dt.returns_to_go([]) == []
    assert dt.returns_to_go([-0.05] * 3) == pytest.approx([-0.15, -0.10, -0.05])


def test_rtg_text_rounding_and_scale():
    assert dt.format_rtg(3.8, 1.0, 2) == "3.80"
    assert dt.format_rtg(4.449999, 1.0, 2) == "4.45"
    assert dt.format_rtg(-0.001, 1.0, 2) == "0.00"  # never "-0.00"
    assert dt.format_rtg(4.45, 5.0, 1) == "0.9"


def test_episode_steps_pairs_each_action_with_the_state_before_it():
    obs, acts, rews = dt.episode_steps(_traj([0.5, -1.0, 2.0]))
    assert obs == ["o0", "o1", "o2"] and acts == ["right", "up", "left"] and rews == [0.5, -1.0, 2.0]


def test_loss_mask_is_one_exactly_on_action_tokens_token_by_token(tiny):
    """The tiny tokenizer is byte-level (one token per character): the mask can be checked per character."""
    _, tok = tiny
    fmt = dt.StepFormat(tok, rtg_scale=1.0, rtg_decimals=2)
    traj = _traj([-0.05, 0.95, -0.05, 2.95])
    ids, mask = dt.training_window(fmt, traj, end=3, context_len=3)  # steps 1..3 (0-based)
    expected_text, expected_mask = "", []
    for rtg, obs, act in [(3.85, "o1", "up"), (2.90, "o2", "left"), (2.95, "o3", "down")]:
        context = f"return-to-go: {rtg:.2f}\n{obs}\naction: "
        expected_text += context + act + "\n"
        expected_mask += [0] * len(context) + [1] * len(act) + [0]
    assert len(ids) == len(mask) == len(expected_text)
    for i, (token, m) in enumerate(zip(ids, mask)):
        assert tok.decode([token]) == expected_text[i], i
        assert m == expected_mask[i], f"token {i} {expected_text[i]!r}: mask {m}"
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "upleftdown"
    # a window at the start of the episode is shorter (no padding steps), and its first R̂ is the full return
    ids0, mask0 = dt.training_window(fmt, traj, end=0, context_len=3)
    assert tok.decode(ids0) == "return-to-go: 3.80\no0\naction: right\n"
    assert tok.decode([t for t, m in zip(ids0, mask0) if m]) == "right"


def test_loss_mask_with_a_bpe_tokenizer():
    """SmolLM2's BPE: the masked ids are exactly the encoded action names, everything else is context."""
    from common.models import cache_dir, load_tokenizer

    if not (cache_dir() / "smollm2-135m-instruct" / "tokenizer.json").exists():
        pytest.skip("smollm2-135m not cached")
    tok = load_tokenizer("smollm2-135m")
    fmt = dt.StepFormat(tok)
    traj = collect("gridworld", "suboptimal", 1, seed=0, epsilon=0.5)[0]
    ids, mask = dt.training_window(fmt, traj, end=traj.num_steps - 1, context_len=4)
    obs, acts, rews = dt.episode_steps(traj)
    rtg, start = dt.returns_to_go(rews), max(0, traj.num_steps - 4)
    expected_ids, expected_mask = [], []
    for t in range(start, traj.num_steps):
        context = tok(f"return-to-go: {rtg[t]:.2f}\n{obs[t]}\naction: ", add_special_tokens=False)["input_ids"]
        action = tok(acts[t], add_special_tokens=False)["input_ids"]
        newline = tok("\n", add_special_tokens=False)["input_ids"]
        expected_ids += context + action + newline
        expected_mask += [0] * len(context) + [1] * len(action) + [0] * len(newline)
    assert ids == expected_ids
    for i, (m, e) in enumerate(zip(mask, expected_mask)):
        assert m == e, f"token {i} {tok.decode([ids[i]])!r}: mask {m}"
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "".join(acts[start:])


def test_dt_loss_is_cross_entropy_on_masked_tokens_only():
    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 11, requires_grad=True)
    head = torch.nn.Identity()  # hidden states are the logits here, so the loss can be written out by hand
    ids = torch.randint(0, 11, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 0, 0, 0, 1]])
    loss, accuracy = dt.dt_loss(hidden, head, ids, mask)
    # by hand: the token at position j is predicted by the logits at j - 1
    terms = [-F.log_softmax(hidden[b, j - 1], -1)[ids[b, j]] for b in range(2) for j in range(6) if mask[b, j]]
    assert len(terms) == 4 and loss.item() == pytest.approx(torch.stack(terms).mean().item(), abs=1e-6)
    hits = [hidden[b, j - 1].argmax() == ids[b, j] for b in range(2) for j in range(6) if mask[b, j]]
    assert accuracy.item() == pytest.approx(sum(map(float, hits)) / 4)
    loss.backward()
    # no gradient reaches a position whose next token is not an action token
    for b in range(2):
        for j in range(6):
            predicts_action = j + 1 < 6 and mask[b, j + 1] == 1
            assert bool(hidden.grad[b, j].abs().sum() > 0) == predicts_action, (b, j)


def test_dt_loss_matches_the_full_lm_forward(tiny):
    """The head-only-where-needed path equals cross-entropy over the model's ordinary full logits."""
    model, tok = tiny
    fmt = dt.StepFormat(tok)
    ids, mask = dt.training_window(fmt, _traj([-0.05, 0.95, -0.05, 2.95]), end=3, context_len=2)
    ids, mask = torch.tensor([ids]), torch.tensor([mask])
    with torch.no_grad():
        loss, _ = dt.dt_loss(model.get_decoder()(input_ids=ids).last_hidden_state, model.get_output_embeddings(), ids, mask)
        logp = F.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    by_hand = [-logp[j - 1, ids[0, j]] for j in range(1, ids.shape[1]) if mask[0, j]]
    assert loss.item() == pytest.approx(torch.stack(by_hand).mean().item(), abs=1e-5)


def test_inference_prompt_is_the_training_window_up_to_the_action(tiny):
    _, tok = tiny
    fmt = dt.StepFormat(tok)
    traj = _traj([-0.05, 0.95, -0.05, 2.95])
    obs, acts, rews = dt.episode_steps(traj)
    rtg = dt.returns_to_go(rews)
    ids, mask = dt.training_window(fmt, traj, end=2, context_len=2)
    prompt = fmt.prompt([(rtg[1], obs[1], acts[1])], rtg[2], obs[2])
    first_action_of_last_step = len(ids) - len(fmt.encode(acts[2])) - len(fmt.newline)
    assert ids[:first_action_of_last_step] == prompt
    assert ids[len(prompt):len(prompt) + len(fmt.encode(acts[2]))] == fmt.encode(acts[2])


def test_evaluation_subtracts_each_reward_from_the_target(tiny):
    """R̂_{t+1} = R̂_t − r_t: record the R̂ and state each prompt was built with, replay the env to get r_t."""
    model, tok = tiny
    seen = []

    class Recording(dt.StepFormat):
        def context(self, rtg, observation):
            seen.append((rtg, observation))
            return super().context(rtg, observation)

    res = dt.evaluate(model, Recording(tok), "gridworld", [2.5], episodes=1, seed=0, context_len=1,
                      pad_id=tok.pad_token_id)
    assert seen[0][0] == 2.5 and len(seen) == res[0]["episode_length"]
    # rewards from the observation that followed each step (GridWorld: -0.05 per step, +1 resource, +3 goal)
    for (rtg, _), (next_rtg, next_obs) in zip(seen, seen[1:]):
        reward = -0.05 + 1.0 * ("collected a resource" in next_obs) + 3.0 * ("reached the goal" in next_obs)
        assert next_rtg == pytest.approx(rtg - reward)


def test_evaluation_plays_the_datasets_environment_settings(tiny):
    """The dataset's env_kwargs (its meta file) reach the evaluation episodes: a 3-step limit shows in every prompt's
    state and ends every episode by step 3 (GridWorld's default limit is 20)."""
    model, tok = tiny
    seen = []

    class Recording(dt.StepFormat):
        def context(self, rtg, observation):
            seen.append(observation)
            return super().context(rtg, observation)

    res = dt.evaluate(model, Recording(tok), "gridworld", [0.0, 4.0], episodes=2, seed=0, context_len=1,
                      pad_id=tok.pad_token_id, env_kwargs={"max_steps": 3})
    assert seen and all("/3." in obs for obs in seen)
    assert all(r["episode_length"] <= 3 for r in res)


def test_tiny_run_completes_on_cpu_learns_and_logs_the_sweep(tmp_path):
    data = tmp_path / "gw.jsonl"
    write_dataset(data, collect("gridworld", "suboptimal", 8, seed=0, epsilon=0.5), {"env_id": "gridworld"})
    cmd = [sys.executable, str(ROOT / "algorithms" / "decision_transformer.py"), "--model", "tiny", "--dataset", str(data),
           "--output-dir", str(tmp_path / "runs"), "--train-steps", "40", "--minibatch-size", "4", "--context-len", "2",
           "--learning-rate", "3e-3", "--eval-every", "0", "--eval-episodes", "1", "--sweep-targets", "0", "2", "4.45"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    s = read_scalars(run)
    losses = [v for _, v in s["losses/action_loss"]]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < 0.5 * losses[0]  # the action tokens are being learnt
    assert [step for step, _ in s["eval/rtg_sweep_target"]] == [0, 1, 2]
    assert [v for _, v in s["eval/rtg_sweep_target"]] == pytest.approx([0.0, 2.0, 4.45])
    for value in ("0", "2", "4.45"):
        assert f"eval/episodic_return_rtg_{value}" in s
    # the main eval/episodic_return is at R* = the dataset's best return (default --target-return)
    assert "R*=" in proc.stdout and "eval/episodic_return" in s and -1.01 <= s["eval/episodic_return"][-1][1] <= 4.46


def test_bad_dataset_path_fails_with_the_flag_name(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "algorithms" / "decision_transformer.py"), "--model", "tiny",
                           "--dataset", str(tmp_path / "missing.jsonl")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--dataset" in proc.stderr and "Traceback" not in proc.stderr


def test_agent_records_as_dataset_fail_with_a_clear_message(tmp_path):
    """An agent's own log (no extra["initial_observation"]) is refused on loading, not minutes later in training."""
    trajs = collect("gridworld", "suboptimal", 2, seed=0, epsilon=0.5)
    for t in trajs:
        t.extra.pop("initial_observation")
    write_dataset(tmp_path / "log.jsonl", trajs, {"env_id": "gridworld"})
    with pytest.raises(SystemExit, match="2 trajectories lack extra.*from_agent_records"):
        dt.load_or_collect(dt.Args(dataset=str(tmp_path / "log.jsonl"), env_id="gridworld"))


@pytest.mark.slow
def test_return_conditioning_on_tiny(tmp_path):
    """Measured (docs/decision_transformer.md): trained on ε=0.5 data, the tiny model reaches the goal when asked
    for a high return and does not when asked for a low one (about 5 min on 2 idle cores, 30 under load)."""
    cmd = [sys.executable, str(ROOT / "algorithms" / "decision_transformer.py"), "--model", "tiny", "--train-steps", "600",
           "--learning-rate", "1e-3", "--minibatch-size", "16", "--eval-every", "0", "--output-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    s = read_scalars(run)
    achieved = [v for _, v in s["eval/rtg_sweep_return"]]
    assert [v for _, v in s["eval/rtg_sweep_target"]] == sorted(v for _, v in s["eval/rtg_sweep_target"])
    assert achieved[-1] > achieved[0] + 1.0 and s["eval/rtg_correlation"][-1][1] > 0.5


def _dt_cmd(*flags):
    return [sys.executable, str(ROOT / "algorithms" / "decision_transformer.py"), "--model", "tiny", "--seed", "3",
            "--dataset-episodes", "4", "--minibatch-size", "2", "--context-len", "2", "--learning-rate", "3e-3",
            "--eval-episodes", "1", "--sweep-points", "2", *flags]


def test_resume_from_a_checkpoint_logs_the_same_scalars_as_an_uninterrupted_run(tmp_path):
    """N steps in one go vs. a run stopped at its checkpoint at step k (its final sweep, logged after the
    checkpoint, is purged) and continued with --resume to N: weights, AdamW moments, the window-sampling
    generator and the step come back, so every scalar but the wall-clock ones is identical (CPU)."""
    n, k = 6, 3
    flags = ["--eval-every", "2"]  # periodic evals before and after k are compared too
    reference = subprocess.Popen(_dt_cmd(*flags, "--train-steps", str(n), "--output-dir", str(tmp_path / "ref")),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # both at once: start-up dominates
    first = subprocess.run(_dt_cmd(*flags, "--train-steps", str(k), "--checkpoint-every", str(k),
                                   "--output-dir", str(tmp_path / "cut")), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (tmp_path / "cut").iterdir()
    assert f"checkpoint saved in {run_dir} (step {k})" in first.stdout
    resumed = subprocess.run([sys.executable, str(ROOT / "algorithms" / "decision_transformer.py"), "--resume",
                              str(run_dir), "--train-steps", str(n)], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run_dir} at step {k}" in resumed.stdout and "eval @ step 0 " not in resumed.stdout
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err[-3000:]

    got, expected = read_scalars(run_dir), read_scalars(next((tmp_path / "ref").iterdir()))
    wall_clock = lambda tag: tag.startswith("perf/") and (tag.endswith("_s") or tag.endswith("_per_s"))
    compared = sorted(t for t in expected if not wall_clock(t))
    assert set(got) == set(expected) and "losses/action_loss" in compared and "eval/rtg_sweep_return" in compared
    for tag in compared:
        assert got[tag] == expected[tag], tag  # same steps, bit-identical values
    assert [s for s, _ in got["losses/action_loss"]] == list(range(1, n + 1))


def test_lora_trains_only_the_adapter_and_saves_an_adapter_load_model_reads(tmp_path):
    """--lora-r 4: the base weights stay those of `tiny` (seed 3), the adapter moves, the checkpoint holds only
    the adapter, and --save-model writes the adapter alone, which common.models.load_model rebuilds."""
    from common.models import is_peft, load_model

    proc = subprocess.run(_dt_cmd("--lora-r", "4", "--save-model", "--train-steps", "3", "--eval-every", "0",
                                  "--checkpoint-every", "3", "--output-dir", str(tmp_path)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    path = run_dir / "model"
    assert (path / "adapter_config.json").exists() and not (path / "model.safetensors").exists()
    ckpt = torch.load(next(run_dir.glob("checkpoint-*.pt")), weights_only=True)
    assert ckpt["model"] and all("lora_" in name for name in ckpt["model"])

    model, _ = load_model(str(path))
    base_sd = load_model("tiny", seed=3)[0].state_dict()
    assert is_peft(model)
    checked, moved = 0, 0
    for name, p in model.named_parameters():
        if "lora_" in name:
            moved += "lora_B" in name and p.abs().sum().item() > 0  # B starts at 0: nonzero means it trained
            continue
        original = name.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(p, base_sd[original]), name  # base weights unchanged
        checked += 1
    assert checked >= len(base_sd) - 1 and moved > 0


def test_minibatch_must_split_evenly_over_torchrun_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets; validate_args reads it before any process group
    with pytest.raises(SystemExit, match="--minibatch-size 3 must be divisible by the 2 processes"):
        dt.validate_args(dt.Args(minibatch_size=3))
    dt.validate_args(dt.Args(minibatch_size=4))


def test_dt_loss_with_the_global_denominator_sums_to_the_whole_batch_loss():
    """Two ranks' slices with unequal action-token counts (3 and 1): each divides its sum by the global count / 2,
    and the mean of the two losses (what averaged gradients follow) is the whole batch's token mean."""
    torch.manual_seed(1)
    hidden, ids = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 0, 1, 0]])
    whole, _ = dt.dt_loss(hidden, torch.nn.Identity(), ids, mask)
    halves = [dt.dt_loss(hidden[r:r + 1], torch.nn.Identity(), ids[r:r + 1], mask[r:r + 1], 4 / 2)[0] for r in (0, 1)]
    assert ((halves[0] + halves[1]) / 2).item() == pytest.approx(whole.item(), abs=1e-6)
    local = [dt.dt_loss(hidden[r:r + 1], torch.nn.Identity(), ids[r:r + 1], mask[r:r + 1])[0] for r in (0, 1)]
    assert ((local[0] + local[1]) / 2).item() != pytest.approx(whole.item(), abs=1e-3)  # local means: not the same


@pytest.mark.parametrize("resume, fsdp", [(False, False), pytest.param(True, False, marks=pytest.mark.slow), (False, True)],
                         ids=["straight", "resumed", "fsdp"])
def test_torchrun_two_ranks_equal_one_process_and_stay_in_sync(tmp_path, resume, fsdp):
    """1 process x minibatch 4 vs 2 gloo ranks x 2 windows (the same global minibatch, split), 4 steps (resumed: 2
    with a checkpoint, then --resume under torchrun; fsdp: the decoder layers sharded over the 2 ranks, gathered
    whole for rank 0's evaluations). Losses, gradient norms, evaluations and the saved weights match the 1-process
    run up to float noise (other padding widths), and the ranks' replicated weights agree at every step."""
    import socket

    from safetensors.torch import load_file

    def torchrun(*args):
        with socket.socket() as s:  # a free port: other tests may run torchrun at the same time
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                               str(port), *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc

    flags = ["--minibatch-size", "4", "--eval-every", "3"]  # evaluations at 0, 3 and the final one at 4
    one = subprocess.Popen(_dt_cmd(*flags, "--train-steps", "4", "--save-model", "--output-dir", str(tmp_path / "one")),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    steps = ["--train-steps", "2", "--checkpoint-every", "2"] if resume else ["--train-steps", "4", "--save-model"]
    proc = torchrun(*_dt_cmd(*flags, *steps, *(["--fsdp"] if fsdp else []), "--output-dir", str(tmp_path / "two"))[1:])
    (run_dir,) = (tmp_path / "two").iterdir()  # rank 0 alone writes
    assert proc.stdout.count(f"step {steps[1]}/{steps[1]} ") == 1  # print0: the last step's line, once
    if resume:
        proc = torchrun(str(ROOT / "algorithms" / "decision_transformer.py"), "--resume", str(run_dir), "--train-steps",
                        "4", "--save-model")
        assert f"resumed from {run_dir} at step 2" in proc.stdout
    _, err = one.communicate(timeout=300)
    assert one.returncode == 0, err[-3000:]
    got, expected = read_scalars(run_dir), read_scalars(next((tmp_path / "one").iterdir()))
    assert got["diagnostics/rank_param_divergence"] == [(step, 0.0) for step in range(1, 5)]
    for tag in ("losses/action_loss", "diagnostics/action_token_accuracy", "diagnostics/grad_norm", "eval/episodic_return",
                "eval/rtg_sweep_return"):
        assert [s for s, _ in got[tag]] == [s for s, _ in expected[tag]], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in expected[tag]], rel=1e-4, abs=1e-5), tag
    weights = [load_file(d / "model" / "model.safetensors") for d in (run_dir, next((tmp_path / "one").iterdir()))]
    for name, value in weights[1].items():
        torch.testing.assert_close(weights[0][name], value, rtol=1e-4, atol=1e-5)
    assert all(v > 0 for _, v in got["diagnostics/grad_norm"])


def test_fsdp_needs_torchrun():
    with pytest.raises(SystemExit, match="--fsdp shards over torchrun processes"):
        dt.validate_args(dt.Args(fsdp=True))
