"""GRPO's pure pieces against hand-computed values, the cold start, and a learning check on `tiny`."""

import importlib.util
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import envs
from common.exploration import NoveltyBonus, SelfImitationMemory
from common.records import Trajectory, Turn
from common.models import load_model, refresh_sampling_copy, sampling_copy
from common.rollout import RolloutConfig, RolloutEngine, behavior_units, format_demonstrations, policy_logprobs
from common.tracking import read_scalars
from tests.distributed_runs import torchrun_command

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("grpo_agent", ROOT / "algorithms" / "grpo_agent.py")
grpo = importlib.util.module_from_spec(spec)
sys.modules["grpo_agent"] = grpo
spec.loader.exec_module(grpo)


def test_group_advantages_hand_computed():
    returns = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    adv = grpo.group_advantages(returns, eps=1e-4)
    # group 0: mean 0.5, population std 0.5
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (0.5 + 1e-4))
    # group 1: zero variance -> exactly zero advantage, no NaN
    assert torch.equal(adv[1], torch.zeros(4))
    # group 2: mean 0.75, std sqrt(((2.25)^2 + 3 * 0.75^2) / 4) = 1.299...
    std = math.sqrt((2.25**2 + 3 * 0.75**2) / 4)
    assert adv[2, 0].item() == pytest.approx(2.25 / (std + 1e-4), rel=1e-6)
    assert not torch.isnan(adv).any()


def _episode(*observations):
    turns = [Turn(action_text="up", observation=o, reward=0.0, action_valid=True, num_action_tokens=1) for o in observations]
    return Trajectory([], [], [], 0, turns, {}, 0.0, "truncated", "", "", 0)


def test_novelty_bonus_hand_computed():
    bonus = NoveltyBonus(coef=0.5)
    # the step counter is not part of the state: "Step 1/20. at a" and "Step 3/20. at a" are one state, and an
    # episode is credited once per distinct state (its loop back to a earns nothing)
    first = bonus([_episode("Step 1/20. at a", "Step 2/20. at b", "Step 3/20. at a"), _episode("Step 1/20. at a")])
    # counts after this batch: a 2, b 1 -> 0.5 (1/sqrt 2 + 1) and 0.5 / sqrt 2
    assert first == pytest.approx([0.5 * (1 / math.sqrt(2) + 1), 0.5 / math.sqrt(2)])
    second = bonus([_episode("Step 1/20. at a", "Step 2/20. at c")])  # a 3, c 1
    assert second == pytest.approx([0.5 * (1 / math.sqrt(3) + 1)])
    restored = NoveltyBonus(coef=0.5)
    restored.load_state_dict(bonus.state_dict())
    assert restored([_episode("Step 9/20. at b")]) == pytest.approx([0.5 / math.sqrt(2)])


def _stepped(rewards, observations):
    turns = [Turn(action_text="up", observation=o, reward=r, action_valid=True, num_action_tokens=2)
             for r, o in zip(rewards, observations)]
    return Trajectory([], [], [], 0, turns, {}, sum(rewards), "truncated", "", "task", 0)


def test_gigpo_step_advantages_hand_computed():
    """Turns from the same state are compared by return-to-go (gamma 0.5): the first turns share the task's initial
    state; "at b" is one state whatever the step counter and the move report say; "at d" is reached once (0)."""
    first = _stepped([1.0, 0.0], ["Step 1/5. at b", "Step 2/5. at c"])
    second = _stepped([0.0, 2.0, 1.0], ["You moved up.\nStep 1/5. at b", "Step 2/5. at d", "Step 3/5. at e"])
    a, b = grpo.step_advantages([first, second], group_size=2, gamma=0.5, eps=1e-4)
    # initial state: R = 1 (first) and 0 + 0.5 * 2 + 0.25 * 1 = 1.25 (second): mean 1.125, std 0.125
    # "at b": R = 0 and 2 + 0.5 * 1 = 2.5: mean 1.25, std 1.25
    assert a.tolist() == pytest.approx([-0.125 / (0.125 + 1e-4), -1.25 / (1.25 + 1e-4)])
    assert b.tolist() == pytest.approx([0.125 / (0.125 + 1e-4), 1.25 / (1.25 + 1e-4), 0.0])
    # two groups are never mixed, and a group whose turns tie gets zeros, not NaN
    same = [_stepped([1.0], ["Step 1/5. at b"]) for _ in range(2)]
    out = grpo.step_advantages(same + [first, second], group_size=2, gamma=0.5, eps=1e-4)
    assert [x.tolist() for x in out[:2]] == [[0.0], [0.0]] and out[2].tolist() == pytest.approx(a.tolist())


def test_grpo_loss_takes_per_unit_advantages():
    logp, old, ref, adv, mask = _batch()
    per_episode, _ = grpo.grpo_loss(logp, old, ref, adv, mask, 0.2, 0.2, 0.0, "token-mean", 5, 2)
    per_unit, _ = grpo.grpo_loss(logp, old, ref, adv[:, None].repeat(1, 4), mask, 0.2, 0.2, 0.0, "token-mean", 5, 2)
    assert per_unit.item() == pytest.approx(per_episode.item(), abs=1e-7)  # a wider advantage row is cut to U
    # ep0 ratios [2.0, 1.0, 1.8] with A = [1, 0, -1] -> min(rA, clip(r)A) = [1.2, 0, -1.8]; ep1 [0.5, 1.0], A = [2, -2]
    loss, stats = grpo.grpo_loss(logp, old, ref, torch.tensor([[1.0, 0.0, -1.0], [2.0, -2.0, 5.0]]), mask, 0.2, 0.2,
                                 0.0, "token-mean", 5, 2)
    assert loss.item() == pytest.approx(-(1.2 + 0.0 - 1.8 + 1.0 - 2.0) / 5, abs=1e-6)
    # per unit: 2.0 (A > 0) clips high; 1.8 (A < 0) and 0.5 (now A > 0) are not clips of their sign
    assert stats["clip_high"] == 1 and stats["clip_low"] == 0


def _scored(task, ret, *actions):
    turns = [Turn(action_text=a, observation="", reward=0.0, action_valid=True, num_action_tokens=1) for a in actions]
    return Trajectory([], [], [], 0, turns, {}, ret, "truncated", "", task, 0)


def test_self_imitation_memory_keeps_the_best_distinct_episodes_and_weights_them_by_the_margin(tmp_path):
    memory = SelfImitationMemory(per_task=2, max_tasks=2)
    a1, a3, a2, a3_again = (_scored("A", 1.0, "up"), _scored("A", 3.0, "up", "left"), _scored("A", 2.0, "down"),
                            _scored("A", 3.0, "up", "left"))
    memory.add([a1, a3, a2, a3_again], layer_inputs=[torch.full((2, 3), float(i)) for i in range(4)])
    # kept: the two best, the repeat of a3's actions dropped; weights are R - baseline, only above it
    assert [(t.return_, float(x[0, 0]), w) for t, x, w in memory.replay("A", 1.5)] == [(3.0, 1.0, 1.5), (2.0, 2.0, 0.5)]
    assert [w for *_, w in memory.replay("A", 2.5)] == [0.5]
    assert memory.replay("A", 3.0) == [] and memory.replay("B", -9.0) == []
    memory.add([_scored("A", 3.0, "right")])  # ties with the best: the earlier episode stays ahead, 2.0 drops out
    assert [t.turns[-1].action_text for t, _, _ in memory.replay("A", 0.0)] == ["left", "right"]
    memory.add([_scored("B", 0.5, "up")])
    memory.add([_scored("C", 0.5, "up")])  # a third task: the least recently seen (A) goes
    assert memory.replay("A", 0.0) == [] and len(memory.replay("C", 0.0)) == 1 and memory.best_return == 0.5
    torch.save(memory.state_dict(), tmp_path / "memory.pt")  # what a checkpoint does: weights_only loadable
    restored = SelfImitationMemory(per_task=2, max_tasks=2)
    restored.load_state_dict(torch.load(tmp_path / "memory.pt", weights_only=True))
    assert [(t.task_id, t.return_, w) for t, _, w in restored.replay("B", 0.0)] == [("B", 0.5, 0.5)]


def _batch():
    # two episodes; the second has only 2 policy units (third is padding)
    logp = torch.log(torch.tensor([[0.5, 0.4, 0.9], [0.3, 0.2, 1.0]]))
    old = torch.log(torch.tensor([[0.25, 0.4, 0.5], [0.6, 0.2, 1.0]]))
    ref = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.4, 1.0]]))
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logp, old, ref, adv, mask


def test_grpo_loss_token_mean_hand_computed():
    logp, old, ref, adv, mask = _batch()
    loss, stats = grpo.grpo_loss(logp, old, ref, adv, mask, 0.2, 0.2, 0.0, "token-mean", num_units=5, num_seqs=2)
    # ratios: ep0 = [2.0, 1.0, 1.8] with A = +1 -> min(r, clip(r)) = [1.2, 1.0, 1.2]
    #         ep1 = [0.5, 1.0]      with A = -2 -> min(-2r, -2 clip(r)) = [-1.6, -2.0]
    expected = -(1.2 + 1.0 + 1.2 - 1.6 - 2.0) / 5
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clip_high"] == 2 and stats["clip_low"] == 1  # ratios 2.0, 1.8 (A>0) and 0.5 (A<0)
    assert stats["ratio_sum"] == pytest.approx(2.0 + 1.0 + 1.8 + 0.5 + 1.0, abs=1e-5)


def test_grpo_loss_sequence_mean_and_kl_hand_computed():
    logp, old, ref, adv, mask = _batch()
    beta = 0.1
    loss, stats = grpo.grpo_loss(logp, old, ref, adv, mask, 0.2, 0.28, beta, "sequence-mean", num_units=5, num_seqs=2)
    k3 = lambda p, r: r / p - math.log(r / p) - 1  # noqa: E731  exp(log r - log p) - (log r - log p) - 1
    kl0 = [k3(0.5, 0.5), k3(0.4, 0.2), k3(0.9, 0.9)]
    kl1 = [k3(0.3, 0.3), k3(0.2, 0.4)]
    # clip-higher 0.28: ep0 ratios [2.0, 1.0, 1.8] -> [1.28, 1.0, 1.28]
    seq0 = (-(1.28 + 1.0 + 1.28) + beta * sum(kl0)) / 3
    seq1 = (-(-1.6 - 2.0) + beta * sum(kl1)) / 2
    assert loss.item() == pytest.approx((seq0 + seq1) / 2, abs=1e-6)
    assert stats["kl_sum"] == pytest.approx(sum(kl0) + sum(kl1), abs=1e-5)


def test_micro_batches_accumulate_to_the_full_batch_loss():
    logp, old, ref, adv, mask = _batch()
    full, _ = grpo.grpo_loss(logp, old, ref, adv, mask, 0.2, 0.2, 0.05, "token-mean", 5, 2)
    parts = [grpo.grpo_loss(logp[i:i + 1], old[i:i + 1], ref[i:i + 1], adv[i:i + 1], mask[i:i + 1], 0.2, 0.2, 0.05,
                            "token-mean", 5, 2)[0] for i in range(2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)


def test_zero_advantage_gives_zero_policy_gradient(tiny):
    model, tok = tiny
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode="choice", choice_token_norm=True))
    trajs = engine.run([envs.make("gridworld") for _ in range(2)], [0, 0], generator=torch.Generator().manual_seed(0))
    units = policy_logprobs(model, trajs, "choice", choice_token_norm=True)
    old = units.logprobs.detach()
    loss, _ = grpo.grpo_loss(units.logprobs, old, old, torch.zeros(2), units.mask, 0.2, 0.2, 0.0, "token-mean",
                             int(units.mask.sum()), 2)
    model.zero_grad()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and g.abs().max() == 0 for g in grads)
    model.zero_grad()


def test_format_demonstrations_train_only_valid_action_names(tiny):
    model, tok = tiny
    engine = RolloutEngine(model, tok, RolloutConfig())
    env = envs.make("gridworld")
    demos = format_demonstrations(engine.chat, env, random.Random(0), n=20)
    names = {tuple(engine.chat.encode(n) + [engine.chat.eos_id]) for n in env.action_names}
    for d in demos:
        d.validate()
        spans = d.policy_token_spans()
        assert 1 <= len(spans) <= 3
        assert all(tuple(d.token_ids[s:e]) in names for s, e in spans)


def test_bf16_sampling_copy_follows_the_trained_weights_and_its_trunk_feeds_the_fp32_trainer():
    """--rollout-dtype bfloat16: a frozen bf16 copy samples; a refresh gives it the trained weights (rounded); the
    fp32 trainer starts from the layer inputs the copy recorded, and its log-probs are the copy's up to bf16
    rounding (the sampler -> trainer gap the ratio absorbs), as a full fp32 forward's are."""
    model, tok = load_model("tiny", "cpu", seed=0)  # not the session fixture: this test changes the weights
    assert sampling_copy(model, "float32") is model and refresh_sampling_copy(model, model) == 0.0
    sampler = sampling_copy(model, "bfloat16")
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in sampler.parameters())
    with torch.no_grad():
        for p in model.parameters():  # an update
            p.add_(torch.randn_like(p) * 0.01)
    assert not all(torch.equal(d, s.to(torch.bfloat16)) for d, s in zip(sampler.parameters(), model.parameters()))
    assert refresh_sampling_copy(sampler, model) > 0
    assert all(torch.equal(d, s.to(torch.bfloat16)) for d, s in zip(sampler.parameters(), model.parameters()))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the trainer's weights stay fp32

    engine = RolloutEngine(sampler, tok, RolloutConfig(action_mode="choice", choice_token_norm=True), record_layer_inputs=1)
    trajs = engine.run([envs.make("gridworld") for _ in range(2)], [0, 1], generator=torch.Generator().manual_seed(0))
    assert engine.layer_inputs[0].dtype == torch.bfloat16
    recorded, mask = behavior_units(trajs, "choice")
    from_trunk = policy_logprobs(model, trajs, "choice", 1.0, True, engine.layer_inputs, 1, engine.branch_inputs)
    full = policy_logprobs(model, trajs, "choice", 1.0, True)
    assert from_trunk.logprobs.dtype == torch.float32
    trunk_gap = ((from_trunk.logprobs - recorded).abs() * mask).max().item()
    full_gap = ((full.logprobs - recorded).abs() * mask).max().item()
    print(f"bf16 sampler vs fp32 trainer, max |log-prob gap| over {int(mask.sum())} actions: from the recorded trunk "
          f"{trunk_gap:.4f}, full fp32 forward {full_gap:.4f}")
    assert 0 < trunk_gap < 0.05 and 0 < full_gap < 0.05


def test_bf16_flags_warn_once_on_a_cpu_that_emulates_bf16(monkeypatch, tiny):
    """On an AVX2-only CPU torch emulates bf16 matmuls (a decode step 25-28x slower than fp32): both bf16 flags say so,
    once each; on a CPU with native bf16 (or for fp32) they stay quiet."""
    import warnings
    from common import models
    model, _ = tiny
    for native, expected in ((True, []), (False, ["--rollout-dtype bfloat16", "--update-dtype bfloat16"])):
        monkeypatch.setattr(models, "cpu_bf16_is_native", lambda: native)
        monkeypatch.setattr(models, "_warned_bf16", set())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # a run calls both many times; each warns once
                models.sampling_copy(model, "float32")
                models.sampling_copy(model, "bfloat16")
                with models.autocast("cpu", "float32"), models.autocast("cpu", "bfloat16"):
                    pass
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert [m.split(":")[0] for m in messages] == expected, messages
        assert all("no native bf16" in m for m in messages)


def run_grpo(tmp_path, *flags, timeout=1500):
    cmd = [sys.executable, str(ROOT / "algorithms" / "grpo_agent.py"), "--output-dir", str(tmp_path), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return run_dir, proc.stdout


def test_cold_start_sft_teaches_the_format(tmp_path):
    """A random `tiny` model emits no valid move in free mode; after the SFT cold start it mostly does."""
    run_dir, out = run_grpo(tmp_path, "--model", "tiny", "--action-mode", "free", "--sft-steps", "60",
                            "--sft-learning-rate", "3e-3", "--total-iterations", "1", "--num-groups", "1",
                            "--group-size", "4", "--eval-every", "0", "--max-turn-tokens", "8",
                            "--temperature", "1.0")
    scalars = read_scalars(run_dir)
    sft = scalars["losses/sft_loss"]
    assert sft[-1][1] < 0.2 * sft[0][1], sft
    invalid = scalars["charts/invalid_action_rate"][0][1]
    print(f"free-mode invalid-action rate after cold start: {invalid:.2f}; sft loss {sft[0][1]:.2f} -> {sft[-1][1]:.3f}")
    assert invalid < 0.3


def test_grpo_learns_gridworld_on_tiny(tmp_path):
    """The learning check: on a fixed seed, the success rate of sampled episodes rises clearly."""
    # --max-total-tokens 1600 (~8 turns of tiny's byte-level tokens) halves the update's cost, which grows with
    # sequence length; measured here: success 0.02 (iterations 1-3) -> 0.42 (10-12) in 85 s (uncapped: 185 s in a suite)
    run_dir, out = run_grpo(tmp_path, "--model", "tiny", "--seed", "1", "--total-iterations", "12", "--num-groups", "2",
                            "--update-epochs", "2", "--learning-rate", "1e-3", "--trainable-layers", "0", "--temperature", "1.0",
                            "--micro-batch-size", "8", "--eval-every", "0", "--max-total-tokens", "1600")
    scalars = read_scalars(run_dir)
    success = [v for _, v in scalars["charts/success_rate"]]
    before, after = sum(success[:3]) / 3, sum(success[-3:]) / 3
    print(f"tiny GRPO on gridworld, seed 1: success {before:.2f} (iterations 1-3) -> {after:.2f} (iterations 10-12)")
    assert after >= before + 0.3, success
    # the clip statistics are the last epoch's, where the update has moved the ratio (before it, fp32 ratios are 1)
    clipped = [lo + hi for (_, lo), (_, hi) in zip(scalars["diagnostics/clip_fraction_low"],
                                                   scalars["diagnostics/clip_fraction_high"])]
    assert max(clipped) > 0 and max(abs(v - 1) for _, v in scalars["diagnostics/ratio_mean"]) > 1e-3
    assert max(v for _, v in scalars["diagnostics/first_epoch_clip_fraction"]) == 0


def test_multi_token_action_names_train_from_the_frozen_trunk(tmp_path, monkeypatch):
    """BabyAI's action names are several tokens ("turn left"): the update runs the tree-shaped scoring forward from
    the frozen layer on the rollout's recorded trunk and branch inputs (not all layers from the embeddings), and its
    log-probs are the sampler's. (With self-imitation on, the memory stores both inputs per episode.)"""
    import runpy

    from common import rollout

    calls = []
    real = rollout._forward_from_layer

    def counting(body, layer_inputs, from_layer, *args, **kwargs):
        calls.append((from_layer, len(layer_inputs), (args[2] if len(args) > 2 else kwargs.get("branches")) is not None))
        return real(body, layer_inputs, from_layer, *args, **kwargs)

    monkeypatch.setattr(rollout, "_forward_from_layer", counting)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "algorithms" / "grpo_agent.py"), "--output-dir", str(tmp_path),
                                      "--model", "tiny", "--env-id", "babyai-gotoredball", "--trainable-layers", "1",
                                      "--total-iterations", "2", "--group-size", "2", "--eval-every", "0",
                                      "--max-total-tokens", "1400", "--sil-coef", "1.0", "--no-filter-zero-variance",
                                      "--micro-batch-size", "4"])
    runpy.run_path(str(ROOT / "algorithms" / "grpo_agent.py"), run_name="__main__")
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    scalars = read_scalars(run_dir)
    assert calls and all(from_layer == 1 and with_branches for from_layer, _, with_branches in calls), calls
    assert len(calls) == 2 * 2  # 2 iterations x 2 epochs, one micro-batch each
    assert max(v for _, v in scalars["diagnostics/logprob_mismatch"]) < 1e-4


def test_bad_flags_fail_fast_with_the_flag_names():
    for bad, flag in ((dict(eval_episodes=0), "--eval-episodes must be >= 1"), (dict(sft_batch_size=0), "--sft-batch-size"),
                      (dict(max_grad_norm=0.0), "--max-grad-norm > 0"), (dict(step_adv_coef=-1.0), "--step-adv-coef"),
                      (dict(step_gamma=0.0), "--step-gamma")):
        with pytest.raises(SystemExit, match=flag):
            grpo.validate_args(grpo.Args(**bad))


def test_bf16_update_autocasts_the_trainer_only(tmp_path):
    """`--update-dtype bfloat16` on CPU: the update's forward runs under bf16 autocast, so its log-probs leave the
    fp32 sampler's by bf16 rounding (> 0, where fp32 against fp32 is exact), and the trained weights stay fp32."""
    from safetensors.torch import load_file

    from common.models import autocast

    with autocast("cpu"):  # the default: a no-op on CPU
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with autocast("cpu", "bfloat16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    run_dir, _ = run_grpo(tmp_path, "--model", "tiny", "--update-dtype", "bfloat16", "--trainable-layers", "1",
                          "--total-iterations", "2", "--group-size", "4", "--eval-every", "0", "--max-total-tokens", "1200",
                          "--no-filter-zero-variance", "--save-model")
    gaps = [v for _, v in read_scalars(run_dir)["diagnostics/logprob_mismatch"]]
    assert all(0 < g < 0.1 for g in gaps), gaps
    weights = load_file(str(run_dir / "model" / "model.safetensors"))
    assert weights and all(w.dtype == torch.float32 for w in weights.values())


def test_bf16_rollouts_run_and_log_the_sampler_trainer_gap(tmp_path):
    """`--rollout-dtype bfloat16` end to end on `tiny` from the frozen trunk: the copy is refreshed after every
    update (perf/weight_sync_s > 0) and the recorded-vs-recomputed gap is bf16 rounding, not zero and not large."""
    run_dir, _ = run_grpo(tmp_path, "--model", "tiny", "--rollout-dtype", "bfloat16", "--trainable-layers", "1",
                            "--total-iterations", "2", "--group-size", "4", "--eval-every", "2", "--eval-episodes", "2",
                            "--max-total-tokens", "1200", "--no-filter-zero-variance")
    scalars = read_scalars(run_dir)
    gaps = [v for _, v in scalars["diagnostics/logprob_mismatch"]]
    assert all(0 < g < 0.1 for g in gaps), gaps
    assert all(v > 0 for _, v in scalars["perf/weight_sync_s"]) and "eval/success_rate" in scalars
    with pytest.raises(SystemExit, match="--rollout-dtype applies to --rollout-backend hf"):
        grpo.validate_args(grpo.Args(rollout_dtype="bfloat16", rollout_backend="vllm", action_mode="free"))


def test_gigpo_run_spreads_step_advantages_over_free_mode_tokens(tmp_path):
    """--step-adv-coef end to end in free mode: each turn's step advantage is spread over its sampled tokens (a size
    mismatch with the policy units would raise), most turns get one, and the update runs on them."""
    run_dir, _ = run_grpo(tmp_path, "--model", "tiny", "--action-mode", "free", "--total-iterations", "1",
                          "--group-size", "4", "--step-adv-coef", "1", "--eval-every", "0", "--max-turn-tokens", "6",
                          "--max-total-tokens", "1200", "--no-filter-zero-variance")
    scalars = read_scalars(run_dir)
    assert scalars["diagnostics/step_advantage_nonzero"][0][1] > 0.5 and "losses/policy_loss" in scalars


def test_mask_illegal_actions_with_gigpo_trains_on_the_mask_it_sampled_with(tmp_path):
    """`--mask-illegal-actions` (with GiGPO's step advantages) on the procedural GridWorld: the trainer's log-probs
    equal the sampler's before the first step (both apply each step's recorded legal moves; scored unmasked they
    differ wherever a wall blocks a move), and the update runs through the masked softmax."""
    run_dir, _ = run_grpo(tmp_path, "--model", "tiny", "--env-id", "gridworld-procedural-relative-shaped",
                          "--mask-illegal-actions", "--step-adv-coef", "1", "--total-iterations", "1", "--group-size", "4",
                          "--eval-every", "0", "--no-filter-zero-variance")
    scalars = read_scalars(run_dir)
    assert scalars["diagnostics/logprob_mismatch"][0][1] < 1e-3, scalars["diagnostics/logprob_mismatch"]
    assert torch.isfinite(torch.tensor(scalars["losses/policy_loss"][0][1]))
    # the flag reached the sampler: tiny is uniform over the four moves (entropy log 4 = 1.386 unmasked, measured),
    # so only the mask (two or three legal moves where walls or edges block) brings the policy's entropy below it
    assert scalars["losses/entropy"][0][1] < math.log(4) - 0.1, scalars["losses/entropy"]


def test_an_iteration_without_an_update_logs_no_loss(tmp_path):
    """On this seed tiny's only group has zero variance and is dropped: nothing is trained, so no loss, entropy or
    ratio is logged (not a placeholder 0); with the group kept (advantages all 0) they are written."""
    flags = ["--model", "tiny", "--seed", "3", "--total-iterations", "1", "--group-size", "4", "--eval-every", "0"]
    (tmp_path / "dropped").mkdir(), (tmp_path / "kept").mkdir()
    dropped, out = run_grpo(tmp_path / "dropped", *flags)
    kept, _ = run_grpo(tmp_path / "kept", *flags, "--no-filter-zero-variance")
    dropped, kept = read_scalars(dropped), read_scalars(kept)
    assert dropped["diagnostics/zero_variance_groups"][0][1] == 1.0 and "charts/episodic_return" in dropped
    loss_tags = ("losses/policy_loss", "losses/entropy", "diagnostics/ratio_mean", "diagnostics/logprob_mismatch")
    assert not any(t in dropped for t in loss_tags) and all(t in kept for t in loss_tags)
    assert "| loss +nan | entropy nan |" in out


def test_smoke_one_iteration_with_smollm2(tmp_path, smollm2):
    """The embedded default model: one GRPO iteration on CPU completes and writes TensorBoard scalars."""
    run_dir, out = run_grpo(tmp_path, "--model", "smollm2-135m", "--total-iterations", "1", "--group-size", "2",
                            "--eval-every", "0", "--temperature", "2.0")
    scalars = read_scalars(run_dir)
    for tag in ("charts/episodic_return", "charts/success_rate", "perf/rollout_tokens_per_s", "diagnostics/logprob_mismatch"):
        assert tag in scalars, tag
    assert scalars["diagnostics/logprob_mismatch"][0][1] < 1e-3  # SmolLM2, fp32 CPU: sampler == trainer
    assert "iter 1/1" in out


def test_torchrun_two_processes_on_cpu(tmp_path):
    """torchrun awareness: 2 ranks (gloo), each with its own episodes; rank 0 alone logs, metrics averaged."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           str(ROOT / "algorithms" / "grpo_agent.py"), "--model", "tiny", "--total-iterations", "2", "--group-size", "4",
           "--eval-every", "0", "--output-dir", str(tmp_path), "--save-model"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    runs = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(runs) == 1  # only rank 0 writes
    assert proc.stdout.count("iter 2/2") == 1  # print0: one progress line per iteration
    assert "8 episodes/iteration" in proc.stdout  # global batch = group size x world size
    scalars = read_scalars(runs[0])
    assert [step for step, _ in scalars["charts/success_rate"]] == [8, 16]
    # weights broadcast at the start and averaged gradients after: both ranks hold identical weights
    assert [value for _, value in scalars["diagnostics/rank_param_divergence"]] == [0.0, 0.0]
    assert any(value > 0 for _, value in scalars["diagnostics/grad_norm"])  # and they did change


def test_lora_trains_only_the_adapter_and_the_reference_is_the_base(tmp_path):
    """--lora-r: KL to the adapter-disabled policy (no second copy); --save-model writes the adapter alone."""
    from common.models import load_model

    run_dir, out = run_grpo(tmp_path, "--model", "tiny", "--seed", "5", "--total-iterations", "2", "--group-size", "4",
                            "--lora-r", "4", "--beta", "0.1", "--learning-rate", "1e-2", "--trainable-layers", "0",
                            "--eval-every", "0", "--save-model")
    saved = run_dir / "model"
    assert (saved / "adapter_config.json").exists() and not (saved / "model.safetensors").exists()
    scalars = read_scalars(run_dir)
    assert scalars["diagnostics/logprob_mismatch"][0][1] < 1e-4  # the sampler's weights are the trainer's
    kl = [v for _, v in scalars["losses/kl"]]
    trained, _ = load_model(str(saved), "cpu")
    base, _ = load_model("tiny", "cpu", seed=5)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert not torch.allclose(trained(ids).logits, base(ids).logits)  # the adapter moved the policy
    assert kl[-1] > 0  # the reference (adapters off) is not the trained policy (adapters on)


# the allocator test runs in a fresh interpreter: malloc's thresholds are per process and pytest's heap is already used
_HOARD = """
import sys, torch
sys.path.insert(0, {root!r})
from common.memory import cap_mmap_threshold
applied = cap_mmap_threshold(int(sys.argv[1]))
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
x = torch.ones(16 << 18); del x  # a 16 MiB block freed: glibc's default now serves blocks up to 16 MiB from the heap
base = rss()
big, small = [], []
for _ in range(40):  # activation-like 4 MiB buffers interleaved with small survivors (as a forward leaves them)
    big.append(torch.ones(1 << 20))
    small.append(torch.ones(1 << 15))
del big
print(applied, rss() - base)
"""


def test_fixed_mmap_threshold_returns_freed_activation_buffers_to_the_os():
    """The cause of the high peak RSS (benchmarks/results/memory.md): with glibc's dynamic threshold, freed
    4 MiB buffers stay in the heap behind small live ones (160 MiB kept here); with the threshold fixed at
    1 MiB each is its own mapping, handed back on free."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    script = _HOARD.format(root=str(ROOT))
    kept = {}
    for kib in (0, 1024):
        proc = subprocess.run([sys.executable, "-c", script, str(kib)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        applied, mib = proc.stdout.split()[-2:]
        kept[kib] = (applied, float(mib))
    if kept[1024][0] != "True":
        pytest.skip("not glibc: mallopt unavailable")
    assert kept[0][0] == "False"  # 0 leaves glibc's default
    assert kept[0][1] > 100, kept  # the hoard: the freed buffers still count in RSS
    assert kept[1024][1] < 20, kept  # only the small survivors (40 x 128 KiB = 5 MiB) remain


def test_mmap_threshold_changes_no_number(tmp_path):
    """The allocator setting changes where memory comes from, never a result: same seed, same losses (two SFT
    steps, so the second loss comes after an update, then one GRPO iteration)."""
    losses = {}
    for kib in ("0", "1024"):
        (tmp_path / kib).mkdir()
        run_dir, _ = run_grpo(tmp_path / kib, "--model", "tiny", "--total-iterations", "1", "--group-size", "2",
                              "--eval-every", "0", "--beta", "0.1", "--update-epochs", "1", "--max-total-tokens", "700",
                              "--no-filter-zero-variance", "--sft-steps", "2", "--sft-batch-size", "2",
                              "--sft-learning-rate", "1e-2", "--malloc-mmap-threshold-kib", kib)
        scalars = read_scalars(run_dir)
        losses[kib] = [v for t in ("losses/sft_loss", "losses/policy_loss", "losses/kl") for _, v in scalars[t]]
    assert losses["0"] == losses["1024"]
    assert losses["0"][0] != losses["0"][1]  # the second SFT loss is after a step: the update path ran


def torchrun_grpo(out_dir, *flags):
    proc = subprocess.run(torchrun_command("grpo_agent.py", out_dir, *flags), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_fsdp_takes_the_data_parallel_steps_and_resumes(tmp_path):
    """--fsdp (2 gloo ranks, every decoder layer sharded) vs plain data parallel on the same seeds: a full fine-tune
    with the KL reference, 3 iterations. The sharded run stops after 2 with a checkpoint (whole weights and AdamW
    moments gathered from the slices), resumes to 3, and must log the same losses, KL and gradient norms and save
    the same weights as the unsharded run, up to float noise."""
    from safetensors.torch import load_file

    flags = ["--model", "tiny", "--group-size", "4", "--eval-every", "0", "--beta", "0.1", "--trainable-layers", "0",
             "--learning-rate", "1e-3"]
    # the data-parallel reference runs beside the first sharded leg (start-up is mostly importing torch)
    ddp = subprocess.Popen(torchrun_command("grpo_agent.py", tmp_path / "ddp", *flags, "--total-iterations", "3",
                                            "--save-model"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    torchrun_grpo(tmp_path / "fsdp", *flags, "--fsdp", "--total-iterations", "2", "--checkpoint-every", "2")
    (run_dir,) = [p for p in (tmp_path / "fsdp").iterdir() if p.is_dir()]
    proc = torchrun_grpo(tmp_path / "fsdp", "--resume", str(run_dir), "--total-iterations", "3", "--save-model")
    assert "resumed from" in proc.stdout and proc.stdout.count("iter 3/3") == 1
    out, err = ddp.communicate(timeout=600)
    assert ddp.returncode == 0, out[-2000:] + err[-4000:]
    (ddp_dir,) = [p for p in (tmp_path / "ddp").iterdir() if p.is_dir()]
    got, expected = read_scalars(run_dir), read_scalars(ddp_dir)
    for tag in ("losses/policy_loss", "losses/kl", "diagnostics/grad_norm", "charts/episodic_return",
                "diagnostics/logprob_mismatch"):
        assert [s for s, _ in got[tag]] == [s for s, _ in expected[tag]], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in expected[tag]], rel=1e-4, abs=1e-6), tag
    assert all(v > 0 for _, v in expected["losses/kl"][1:])  # teeth: the policy moved away from the reference
    # in iteration 1 one rank's only group had zero variance (dropped): under FSDP that rank ran a zero-weight pass
    # to join the other's collectives (without it the run would hang, not finish)
    assert got["diagnostics/zero_variance_groups"][0][1] == 0.5
    sharded, whole = (load_file(str(d / "model" / "model.safetensors")) for d in (run_dir, ddp_dir))
    assert set(sharded) == set(whole)
    for name, value in whole.items():
        torch.testing.assert_close(sharded[name], value, rtol=1e-4, atol=1e-5)


def test_fsdp_needs_torchrun():
    with pytest.raises(SystemExit, match="--fsdp shards over torchrun processes"):
        grpo.validate_args(grpo.Args(fsdp=True))
