"""PPO + GAE: turn-level GAE against hand-computed values, the clipped losses, the value head, a learning check."""

import importlib.util
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import envs
from common.checkpoint import load_checkpoint
from common.records import Trajectory, Turn
from common.rollout import RolloutConfig, RolloutEngine
from common.tracking import read_scalars
from tests.distributed_runs import assert_fsdp_matches_data_parallel, only_run_dir

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ppo_gae_agent", ROOT / "algorithms" / "ppo_gae_agent.py")
ppo = importlib.util.module_from_spec(spec)
sys.modules["ppo_gae_agent"] = ppo
spec.loader.exec_module(ppo)


def three_turn_record(termination: str) -> Trajectory:
    """Free mode: prompt (3 ids), then turns of 2, 1 and 3 sampled tokens separated by observations."""
    mask = [0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1, 1]
    turns = [Turn(action_text=a, observation="o", reward=r, action_valid=True, num_action_tokens=n)
             for a, r, n in (("a", 0.5, 2), ("b", -0.1, 1), ("c", 1.0, 3))]
    return Trajectory(token_ids=list(range(len(mask))), source_mask=mask, behavior_logprobs=[0.0] * len(mask),
                      policy_version=0, turns=turns, rewards={}, return_=1.4, termination=termination,
                      env_version="", task_id="", seed=0)


def test_turn_level_gae_bootstraps_at_truncation_not_at_termination():
    gamma, lam = 0.9, 0.8
    values, v_final = torch.tensor([1.0, 2.0, 0.5]), 2.0
    # by hand, truncated (V(s_3) = 2.0):
    #   d2 = 1.0 + 0.9 * 2.0 - 0.5 = 2.3            A2 = 2.3
    #   d1 = -0.1 + 0.9 * 0.5 - 2.0 = -1.65         A1 = -1.65 + 0.72 * 2.3 = 0.006
    #   d0 = 0.5 + 0.9 * 2.0 - 1.0 = 1.3            A0 = 1.3 + 0.72 * 0.006 = 1.30432
    # terminated (V(s_3) = 0): d2 = 0.5, A2 = 0.5; A1 = -1.65 + 0.36 = -1.29; A0 = 1.3 - 0.9288 = 0.3712
    expected = {"truncated": [1.30432, 0.006, 2.3], "success": [0.3712, -1.29, 0.5], "failure": [0.3712, -1.29, 0.5]}
    for termination, adv_hand in expected.items():
        traj = three_turn_record(termination)
        plan = ppo.episode_steps(traj, "free", "turn", gamma)
        positions, unit_step, _, _ = plan
        assert positions == [2, 6, 10]  # the last context token before each turn's action
        assert unit_step == [0, 0, 1, 2, 2, 2]
        adv, ret, unit_adv = ppo.episode_gae(traj, plan, values, v_final, lam, bootstrap_truncated=True)
        assert adv.tolist() == pytest.approx(adv_hand, abs=1e-6), termination
        assert ret.tolist() == pytest.approx([a + v for a, v in zip(adv_hand, values.tolist())], abs=1e-6)
        # each turn's advantage is spread to that turn's tokens
        a0, a1, a2 = adv_hand
        assert unit_adv.tolist() == pytest.approx([a0, a0, a1, a2, a2, a2], abs=1e-6)
    # with bootstrapping off, truncation is treated as termination
    traj = three_turn_record("truncated")
    adv, _, _ = ppo.episode_gae(traj, ppo.episode_steps(traj, "free", "turn", gamma), values, v_final, lam, False)
    assert adv.tolist() == pytest.approx(expected["success"], abs=1e-6)


def test_token_level_gae_discounts_only_between_turns():
    traj = three_turn_record("success")
    positions, unit_step, rewards, gammas = ppo.episode_steps(traj, "free", "token", 0.9)
    assert positions == [2, 3, 6, 10, 11, 12] and unit_step == list(range(6))
    assert rewards.tolist() == pytest.approx([0.0, 0.5, -0.1, 0.0, 0.0, 1.0])
    assert gammas.tolist() == pytest.approx([1.0, 0.9, 0.9, 1.0, 1.0, 0.9])
    # lambda = 1, V = 0: the advantage is the discounted return counted in environment steps
    adv, _ = ppo.gae(rewards, torch.zeros(6), 0.0, gammas, 1.0)
    assert adv.tolist() == pytest.approx([0.5 - 0.09 + 0.81, 0.5 - 0.09 + 0.81, -0.1 + 0.9, 1.0, 1.0, 1.0], abs=1e-6)


def test_ppo_loss_hand_computed():
    logp = torch.log(torch.tensor([[0.5, 0.4], [0.3, 0.2]]))
    old = torch.log(torch.tensor([[0.25, 0.4], [0.6, 0.2]]))
    adv = torch.tensor([[1.0, 1.0], [-2.0, 0.0]])
    unit_mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    entropy = torch.tensor([[1.0, 0.5], [0.3, 9.0]])
    values, old_v = torch.tensor([[1.0, 0.0], [3.0, 0.0]]), torch.tensor([[0.5, 0.0], [2.9, 0.0]])
    returns, step_mask = torch.tensor([[2.0, 0.0], [2.0, 0.0]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    loss, st = ppo.ppo_loss(logp, old, old, adv, unit_mask, entropy, values, old_v, returns, step_mask,
                            clip_eps=0.2, value_clip=0.2, vf_coef=0.5, ent_coef=0.1, beta=0.0, num_units=3, num_steps=2)
    # ratios 2.0 (A=1 -> 1.2), 1.0 (A=1 -> 1.0), 0.5 (A=-2 -> min(-1.0, -1.6) = -1.6)
    policy = -(1.2 + 1.0 - 1.6) / 3
    # value: ep0 V=1.0, clipped to 0.5+0.2=0.7: max(1.0, 1.69) = 1.69; ep1 V=3.0 clipped 3.0 -> max(1.0, 1.0) = 1.0
    value = 0.5 * (1.69 + 1.0) / 2
    ent = (1.0 + 0.5 + 0.3) / 3
    assert st["policy_loss"] == pytest.approx(policy, abs=1e-6)
    assert st["value_loss"] == pytest.approx(value, abs=1e-6)
    assert loss.item() == pytest.approx(policy + 0.5 * value - 0.1 * ent, abs=1e-6)
    assert st["clip"] == pytest.approx(2 / 3) and st["value_clip"] == pytest.approx(1 / 2)


def test_value_loss_falls_on_a_fixed_batch(tiny):
    """The value head on the policy's hidden states fits fixed GAE targets (V read before each action)."""
    model, tok = tiny
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode="choice", choice_token_norm=True))
    trajs = engine.run([envs.make("gridworld", max_steps=4) for _ in range(3)], [0, 1, 2],
                       generator=torch.Generator().manual_seed(0))
    plans = [ppo.episode_steps(t, "choice", "turn", 0.99) for t in trajs]
    positions = [p[0] for p in plans]
    assert all(pos == [s.position - 1 for s in t.choice_steps] for pos, t in zip(positions, trajs))
    head = torch.nn.Linear(model.config.hidden_size, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    with torch.no_grad():
        _, old_v, _ = ppo.units_and_values(model, head, trajs, positions, "choice", 1.0, True)
    assert torch.equal(old_v, torch.zeros_like(old_v))  # zero-initialised head: V = 0 everywhere
    returns = torch.zeros_like(old_v)
    for i, (t, plan) in enumerate(zip(trajs, plans)):
        returns[i, : len(plan[0])] = ppo.episode_gae(t, plan, old_v[i, : len(plan[0])], 0.5, 0.95, True)[1]
    head_before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    losses = []
    for _ in range(40):
        units, values, smask = ppo.units_and_values(model, head, trajs, positions, "choice", 1.0, True)
        loss, st = ppo.ppo_loss(units.logprobs, units.logprobs.detach(), units.logprobs.detach(),
                                torch.zeros_like(units.logprobs), units.mask, units.entropy, values, old_v, returns,
                                smask, 0.2, 0.0, 1.0, 0.0, 0.0, int(units.mask.sum()), int(smask.sum()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(st["value_loss"])
    model.zero_grad()
    print(f"value loss on a fixed batch: {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < 0.3 * losses[0], losses
    assert all(torch.equal(a, b) for a, b in zip(head_before, model.parameters()))  # only the head was stepped


def run_ppo(tmp_path, *flags, timeout=1800):
    cmd = [sys.executable, str(ROOT / "algorithms" / "ppo_gae_agent.py"), "--output-dir", str(tmp_path), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return run_dir, proc.stdout


def test_ppo_learns_gridworld_on_tiny(tmp_path):
    """The learning check: on a fixed seed, the success rate of sampled episodes rises clearly."""
    run_dir, _ = run_ppo(tmp_path, *LEARNING_FLAGS)
    success = [v for _, v in read_scalars(run_dir)["charts/success_rate"]]
    before, after = sum(success[:3]) / 3, sum(success[-3:]) / 3
    print(f"tiny PPO on gridworld, seed 1: success {before:.2f} (first 3 iterations) -> {after:.2f} (last 3); {success}")
    assert after >= before + 0.3, success


# 10 iterations x 8 episodes: about 75 s of CPU on 2 cores (measured here: success 0.04 -> 0.42)
LEARNING_FLAGS = ["--model", "tiny", "--seed", "1", "--total-iterations", "10", "--num-episodes", "8",
                  "--update-epochs", "1", "--num-minibatches", "2", "--micro-batch-size", "4", "--learning-rate", "1e-3",
                  "--value-learning-rate", "1e-2", "--trainable-layers", "0", "--beta", "0", "--temperature", "1.0",
                  "--eval-every", "0"]


def test_torchrun_two_ranks_stay_in_sync_with_a_separate_critic(tmp_path):
    """torchrun, 2 gloo ranks, each with its own episodes: the policy, the separate critic LM and the value head
    are broadcast at the start and their gradients averaged, so every weight is identical on both ranks after
    each update; rank 0 alone writes the run."""
    with socket.socket() as s:  # a free port: other tests may run torchrun at the same time
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(ROOT / "algorithms" / "ppo_gae_agent.py"), "--model", "tiny", "--critic", "separate", "--total-iterations",
           "2", "--num-episodes", "2", "--eval-every", "0", "--output-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]  # only rank 0 writes
    assert proc.stdout.count("iter 2/2") == 1 and "4 episodes/iteration" in proc.stdout  # print0; 2 x 2 episodes
    scalars = read_scalars(run_dir)
    assert [value for _, value in scalars["diagnostics/rank_param_divergence"]] == [0.0, 0.0]
    assert all(value > 0 for _, value in scalars["diagnostics/grad_norm"])  # and the weights did move


def test_fsdp_takes_the_data_parallel_steps_with_a_separate_critic(tmp_path):
    """torchrun, 2 gloo ranks, separate critic LM, the KL reference, greedy evaluation, the top layer trained over a
    frozen trunk (so the V_old pass reads truncated episodes' V(s_T) off the final observations the rollout fed): --fsdp (the
    policy's and the critic's decoder layers sharded) logs the same losses, gradient norms, returns and evaluation
    as plain data parallel, and saves the same policy, critic and value head, up to float noise."""
    flags = ["--model", "tiny", "--critic", "separate", "--trainable-layers", "1", "--total-iterations", "2",
             "--num-episodes", "2", "--max-episode-steps", "6", "--eval-every", "2", "--eval-episodes", "1",
             "--learning-rate", "1e-3", "--save-model"]
    _, expected = assert_fsdp_matches_data_parallel(
        "ppo_gae_agent.py", tmp_path, flags, ("losses/policy_loss", "losses/value_loss", "losses/kl",
                                              "diagnostics/grad_norm", "charts/episodic_return",
                                              "diagnostics/logprob_mismatch", "diagnostics/value_mean",
                                              "eval/episodic_return"), saved=("model", "critic"), cwd=tmp_path)
    assert all(v > 0 for _, v in expected["diagnostics/bootstrap_fraction"])  # the V(s_T) forwards ran
    heads = [torch.load(tmp_path / name / only_run_dir(tmp_path / name).name / "value_head.pt") for name in ("fsdp", "ddp")]
    for key, value in heads[1].items():
        torch.testing.assert_close(heads[0][key], value, rtol=1e-4, atol=1e-5)


def test_fsdp_needs_torchrun():
    with pytest.raises(SystemExit, match="--fsdp shards over torchrun processes"):
        ppo.validate_args(ppo.Args(fsdp=True))


def test_bad_flags_fail_fast_with_the_flag_names(monkeypatch):
    for bad, message in ((dict(eval_episodes=0), "--eval-episodes must be >= 1"), (dict(eval_every=-1), "--eval-every"),
                         (dict(num_episodes=1001, num_minibatches=1), "--num-episodes x torchrun processes")):
        with pytest.raises(SystemExit, match=message):
            ppo.validate_args(ppo.Args(**bad))
    monkeypatch.setattr(ppo, "dist_info", lambda: (0, 0, 8))  # 8 ranks x 128 episodes would reuse seeds
    with pytest.raises(SystemExit, match="--num-episodes x torchrun processes must be <= 1000"):
        ppo.validate_args(ppo.Args(num_episodes=128))
    ppo.validate_args(ppo.Args(num_episodes=125))


def test_bf16_sampler_and_update_log_the_gap_and_keep_fp32_weights(tmp_path):
    """`--rollout-dtype bfloat16 --update-dtype bfloat16` on `tiny` over a frozen trunk, episodes cut at 6 steps: a bf16
    copy samples (refreshed after every update and after a resume), V_old / pi_ref / the update run under bf16 autocast,
    V(s_T) is read off the copy's recorded final observations; the sampler -> trainer gap is bf16 rounding (not 0, not
    large) and the saved policy and value head are fp32. A resumed run logs the uninterrupted run's numbers."""
    from safetensors.torch import load_file

    (tmp_path / "whole").mkdir(), (tmp_path / "part").mkdir()
    flags = ["--model", "tiny", "--rollout-dtype", "bfloat16", "--update-dtype", "bfloat16", "--trainable-layers", "1",
             "--num-episodes", "4", "--max-episode-steps", "6", "--eval-every", "3", "--eval-episodes", "2",
             "--learning-rate", "1e-3", "--checkpoint-every", "1"]
    run_dir, _ = run_ppo(tmp_path / "whole", *flags, "--total-iterations", "3", "--save-model")
    scalars = read_scalars(run_dir)
    gaps, means = ([v for _, v in scalars[f"diagnostics/logprob_mismatch{k}"]] for k in ("", "_mean"))
    assert all(0 < m <= g < 0.1 for g, m in zip(gaps, means)), (gaps, means)
    assert all(v > 0 for _, v in scalars["perf/weight_sync_s"]) and len(scalars["eval/success_rate"]) == 2
    assert any(v > 0 for _, v in scalars["diagnostics/bootstrap_fraction"])  # V(s_T) from the bf16 copy's tails
    weights = load_file(str(run_dir / "model" / "model.safetensors"))
    assert weights and all(w.dtype == torch.float32 for w in weights.values())
    assert all(v.dtype == torch.float32 for v in torch.load(run_dir / "value_head.pt").values())

    part, _ = run_ppo(tmp_path / "part", *flags, "--total-iterations", "1")
    run_ppo(tmp_path / "part", "--resume", str(part), "--total-iterations", "3")
    resumed = read_scalars(part)
    for tag in ("losses/policy_loss", "losses/value_loss", "charts/episodic_return", "diagnostics/logprob_mismatch"):
        assert [v for _, v in resumed[tag]] == pytest.approx([v for _, v in scalars[tag]], rel=1e-5, abs=1e-7), tag


def test_anneal_lr_decays_the_rate_linearly_to_zero(tmp_path):
    """`--anneal-lr`: iteration i of T steps at lr * (1 - (i - 1) / T), as read back from the optimizer and logged;
    without the flag the rate stays where it was set. The value head's group (not logged) follows the same schedule
    from its own rate: its last-iteration value is read from the checkpoint's optimizer state."""
    flags = ["--model", "tiny", "--total-iterations", "4", "--num-episodes", "2", "--eval-every", "0",
             "--learning-rate", "2e-3", "--value-learning-rate", "4e-3", "--checkpoint-every", "4"]
    (tmp_path / "annealed").mkdir(), (tmp_path / "constant").mkdir()
    annealed, _ = run_ppo(tmp_path / "annealed", *flags, "--anneal-lr")
    constant, _ = run_ppo(tmp_path / "constant", *flags)
    rates = {name: [v for _, v in read_scalars(d)["charts/learning_rate"]] for name, d in
             (("annealed", annealed), ("constant", constant))}
    assert rates["annealed"] == pytest.approx([2e-3, 1.5e-3, 1e-3, 0.5e-3]), rates
    assert rates["constant"] == pytest.approx([2e-3] * 4), rates
    last = {name: [g["lr"] for g in load_checkpoint(d)["optimizer"]["param_groups"]] for name, d in
            (("annealed", annealed), ("constant", constant))}
    assert last["annealed"] == pytest.approx([0.5e-3, 1e-3]), last  # (LM group, value head group) at iteration 4
    assert last["constant"] == pytest.approx([2e-3, 4e-3]), last


def test_mask_illegal_actions_trains_on_the_mask_it_sampled_with(tmp_path):
    """`--mask-illegal-actions` on the procedural GridWorld: the trainer's log-probs equal the sampler's before the
    first step (both apply each step's recorded legal moves; scored unmasked they would differ by ~0.3 nats wherever
    a move is blocked, as tests/test_rollout.py shows), and the update runs through the masked softmax."""
    run_dir, _ = run_ppo(tmp_path, "--model", "tiny", "--env-id", "gridworld-procedural-relative-shaped",
                         "--mask-illegal-actions", "--total-iterations", "2", "--num-episodes", "4", "--eval-every", "0")
    scalars = read_scalars(run_dir)
    assert max(v for _, v in scalars["diagnostics/logprob_mismatch"]) < 1e-3, scalars["diagnostics/logprob_mismatch"]
    assert all(torch.isfinite(torch.tensor(v)) for _, v in scalars["losses/policy_loss"])
    # the flag reached the sampler: tiny is near-uniform over the four moves (entropy ~ log 4 unmasked), so only the
    # mask (two or three legal moves where walls or edges block) brings the policy's entropy well below it
    assert scalars["losses/entropy"][0][1] < math.log(4) - 0.1, scalars["losses/entropy"]


def test_bf16_sampler_is_not_for_fsdp():
    with pytest.raises(SystemExit, match="--rollout-dtype bfloat16 is a copy of whole weights"):
        ppo.validate_args(ppo.Args(fsdp=True, rollout_dtype="bfloat16"))
