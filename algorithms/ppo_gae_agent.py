# docs: docs/ppo_gae_agent.md
"""Multi-turn PPO with a learned value head and GAE for LLM agents (Schulman et al. 2017; GAE: Schulman et
al. 2016; seed 000 "用于交互式 Agent 的 PPO"; seed 003 §2.3-2.4; in choice mode GLAM, Carta et al. 2023, and
TWOSOME, Tan et al. 2024).

A value head (a linear layer on the LM's last hidden state, or on a separate critic LM by flag) predicts,
at the position where each agent turn's action is predicted, the return from that state (seed 000: "the
value head learns how likely this trajectory is to succeed from here"). Advantages come from GAE over the
episode's turns, one value per turn and the environment's per-step rewards, and every policy unit of the
turn (each sampled token in free mode, the action in choice mode) gets its turn's advantage. The loss is
PPO's clipped surrogate over policy units only, a clipped value loss, an entropy bonus and a k3 KL penalty
to the frozen initial policy; advantages are whitened; the batch is reused for epochs of minibatches.

Usage:
    python algorithms/ppo_gae_agent.py                                    # smollm2-135m, GridWorld, choice mode, CPU
    python algorithms/ppo_gae_agent.py --model tiny --total-iterations 5  # a random tiny model: a smoke test
    python algorithms/ppo_gae_agent.py --env-id babyai-gotoredball --max-episode-steps 24  # GLAM's setting
    python algorithms/ppo_gae_agent.py --action-mode free --gae-level token # free text, token-level GAE
    python algorithms/ppo_gae_agent.py --critic separate                  # a second LM as critic
    python algorithms/ppo_gae_agent.py --lora-r 16 --trainable-layers 0   # LoRA adapters on every layer
    python algorithms/ppo_gae_agent.py --device cuda                      # one GPU
    python algorithms/ppo_gae_agent.py --checkpoint-every 5               # then, after a crash or Ctrl-C:
    python algorithms/ppo_gae_agent.py --resume runs/<run> [--total-iterations 50]
    torchrun --nproc_per_node 2 algorithms/ppo_gae_agent.py --model tiny  # data parallel (gloo on CPU, NCCL on GPU)
    torchrun --nproc_per_node 8 algorithms/ppo_gae_agent.py --fsdp --model <path>  # layers sharded (FSDP2)

Copying this file out: it needs `common/` (and `envs/` for the built-in environments, or any
`package.module:Factory` passed as --env-id).

Where this departs from the paper / seed:
- GAE runs over agent turns, not tokens: the MDP's steps are the environment's steps, and the turn's
  advantage is given to all of its tokens (`--gae-level token` runs GAE over policy tokens instead, with
  the turn's reward on its last token and gamma applied only between turns).
- Truncated episodes bootstrap with V(s_T) of the final observation, read in the V_old pass (with a frozen trunk the
  rollout feeds that observation into its KV cache for the purpose); `--no-bootstrap-truncated`: V = 0.
- The KL penalty to the reference is a loss term (k3 estimator, as in GRPO), not a reward-shaping term.
- pi_old is the behaviour log-prob recorded by the sampler (no extra forward; the trainer/sampler gap is
  logged before the first optimizer step); V_old comes from one no-grad pass before the update.
- `--lora-r R`: LoRA adapters (Hu et al. 2021) on the top --trainable-layers layers; the reference is the
  policy with adapters off. CUDA: trained weights fp32, forwards under bf16 autocast (a LoRA base in bf16).
- `--rollout-dtype bfloat16` (CPU): pi_old is the bf16 sampling copy's log-prob; the trainer/sampler gap is logged.
- Defaults follow seed 003 §2.4 where it gives ranges (lr 1e-5, KL 0.01, clip 0.2, lambda 0.95); its
  "rollout batch 128-1024" is read as environment steps: 16 episodes of up to 20 steps.
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass, replace
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import numpy as np
import torch
import torch.distributed as dist
import tyro

import envs
from common.checkpoint import Checkpointer, GracefulInterrupt, cli_with_resume
from common.distributed import (all_reduce_mean, clip_grad_norm, dist_info, finish_distributed, full_tensors, gathered,
                                global_loss_denominator, init_distributed, is_sharded, print0, rank_param_divergence,
                                seed_everything, shard_layers)
from common.models import (adapter_disabled, autocast, load_model, parameter_counts, refresh_sampling_copy, resolve_device,
                           sampling_copy, save_model, train_top_layers)
from common.records import Trajectory
from common.rollout import (RolloutConfig, RolloutEngine, behavior_units, check_env, episode_metrics, evaluate_episodes,
                            policy_logprobs)
from common.tracking import Tracker, make_run_name


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of the experiment (model init for `tiny`, sampling, environment seeds)"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms, so the same seed gives the same numbers on CPU"""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N` or `auto`"""
    save_model: bool = False
    """save the final policy to `runs/{run_name}/model` (with LoRA: the adapter only) and the value head next to it"""
    model: str = "smollm2-135m"
    """`tiny` (random, for tests), `smollm2-135m` (embedded default) or a local model path"""
    env_id: str = "gridworld"
    """environment id (`gridworld`, `workspace`, `babyai-gotolocal`, ...) or `package.module:Factory`"""
    output_dir: str = "runs"
    """where run directories are created"""
    checkpoint_every: int = 0
    """save a checkpoint (trained weights and value head, optimizer, RNG states, counters) every N iterations and at the
    end; 0: never. Ctrl-C (or SIGTERM) always finishes the iteration and saves one before exiting"""
    resume: str = ""
    """a run directory to continue from its checkpoint, with its saved arguments and TensorBoard run"""

    # Algorithm specific arguments
    total_iterations: int = 25
    """number of PPO iterations (rollout + update)"""
    num_episodes: int = 16
    """episodes per iteration, per process (each on its own environment seed)"""
    max_episode_steps: int = 0
    """passed to the environment as `max_steps` (0: the environment's default); BabyAI's 64 steps are long for CPU"""
    action_mode: Literal["free", "choice"] = "choice"
    """`choice`: a distribution over the environment's action names (GLAM/TWOSOME); `free`: generated text"""
    choice_token_norm: bool = True
    """TWOSOME normalisation: divide an action's log-prob by its token count (matters for multi-token names)"""
    mask_illegal_actions: bool = False
    """choice mode: sample and train only over the environment's legal_actions() (Huang & Ontañón 2022's invalid-action
    masking; GridWorld: the moves no wall or edge blocks)"""
    critic: Literal["shared", "separate"] = "shared"
    """`shared`: the value head sits on the policy LM; `separate`: on a second LM (2x memory; with LoRA, its own adapter)"""
    learning_rate: float = 1e-5
    """AdamW learning rate of the LM(s) (seed 003 §2.4: 1e-6 to 1e-5)"""
    value_learning_rate: float = 1e-3
    """AdamW learning rate of the value head (zero-initialised)"""
    anneal_lr: bool = False
    """decay both learning rates linearly to 0 at --total-iterations (CleanRL's ppo.py; a resume may move the end)"""
    trainable_layers: int = 6
    """train the top N layers and the final norm (0 or >= layer count: all); with LoRA, the layers given adapters"""
    lora_r: int = 0
    """LoRA rank (peft): adapters on the attention and MLP projections, base frozen; 0: train the weights"""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / r) B A"""
    gradient_checkpointing: bool = False
    """recompute layer activations in the backward (less memory, ~30% more compute)"""
    fsdp: bool = False
    """torchrun: shard the policy's (and a separate critic's) decoder layers over the ranks (PyTorch FSDP2), gathered
    whole for rollouts, V_old / reference passes and evaluation (as in grpo_agent.py)"""
    gamma: float = 0.99
    """discount per environment step"""
    gae_lambda: float = 0.95
    """GAE lambda (seed 003 §2.4: 0.95)"""
    gae_level: Literal["turn", "token"] = "turn"
    """`turn`: one value per agent turn, advantage spread to the turn's tokens; `token`: GAE over policy tokens (free mode)"""
    bootstrap_truncated: bool = True
    """bootstrap truncated episodes with V(final observation); off: truncation is treated as termination"""
    update_epochs: int = 2
    """optimisation epochs over each batch"""
    num_minibatches: int = 2
    """optimizer steps per epoch (the batch's episodes are shuffled and split)"""
    micro_batch_size: int = 1
    """episodes per forward/backward (gradient accumulation; memory only, the update is the same). On CPU 1 was no
    slower than 4 and lowest in memory (GridWorld 2.5 vs 3.3 GB peak RSS, BabyAI 7.0 vs 11.8 GB); raise it on a GPU"""
    clip_eps: float = 0.2
    """policy ratio clip: [1 - eps, 1 + eps] (seed 003 §2.4: 0.1 to 0.2)"""
    value_clip: float = 0.5
    """clip V - V_old to [-c, c] in the value loss (PPO2's clipped value loss, in return units); 0 disables"""
    vf_coef: float = 0.5
    """weight of the value loss"""
    ent_coef: float = 0.01
    """weight of the entropy bonus"""
    beta: float = 0.01
    """k3 KL coefficient to the frozen initial policy (seed 003 §2.4: 0.01 to 0.1); 0 skips the reference model"""
    norm_adv: bool = True
    """whiten advantages over the batch's policy units"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    temperature: float = 2.0
    """sampling temperature of training rollouts (and of the policy being optimised)"""
    top_p: float = 1.0
    """nucleus sampling during training rollouts"""
    rollout_dtype: Literal["float32", "bfloat16"] = "float32"
    """the precision the policy samples (and is evaluated) in; `bfloat16`: a bf16 copy of it, refreshed after every
    update (faster on a CPU with AVX512-BF16; pi_old is then the copy's, as in grpo_agent.py)"""
    update_dtype: Literal["float32", "bfloat16"] = "float32"
    """CPU: `bfloat16` runs the V_old / reference passes and the update's forward/backward under bf16 autocast (fp32
    weights, value head and AdamW; measured 1.6-2x faster on this AMX CPU)"""
    max_turn_tokens: int = 8
    """free mode: cap on generated tokens per turn"""
    max_total_tokens: int = 4096
    """cap on an episode's whole token sequence (hitting it ends the episode as truncated)"""
    eval_every: int = 5
    """evaluation every N iterations (and before the first and after the last); 0 disables"""
    eval_episodes: int = 8
    """episodes per evaluation, on seeds never trained on"""
    eval_temperature: float = 0.0
    """temperature of the evaluation episodes: 0 is greedy; the training --temperature tests the sampled policy"""

    # filled in at runtime
    world_size: tyro.conf.Suppress[int] = 1
    """number of processes (torchrun)"""
    batch_size: tyro.conf.Suppress[int] = 0
    """episodes per iteration over all processes: num_episodes * world_size"""


# the flags --resume lets differ from the saved run (none of them changes what the training samples)
RESUMABLE = {"total_iterations", "checkpoint_every", "eval_every", "eval_episodes", "eval_temperature", "save_model",
             "resume", "output_dir"}
# read by tests/test_conformance.py: a few-second `--model tiny` run, and the shared tags it writes
SMOKE_TEST_ARGS = ["--total-iterations", "1", "--num-episodes", "4", "--eval-every", "1", "--eval-episodes", "2"]
LOGGED_TAGS = ("charts/episodic_return", "charts/success_rate", "charts/episode_length", "charts/invalid_action_rate",
               "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/kl", "diagnostics/clip_fraction",
               "diagnostics/value_clip_fraction", "diagnostics/approx_kl", "diagnostics/ratio_mean",
               "diagnostics/advantage_std", "diagnostics/explained_variance", "diagnostics/value_mean",
               "diagnostics/bootstrap_fraction", "diagnostics/logprob_mismatch", "diagnostics/policy_lag",
               "perf/rollout_tokens_per_s", "perf/env_steps_per_s", "perf/rollout_s", "perf/update_s",
               "eval/success_rate", "eval/episodic_return")


def validate_args(args: Args):
    problems = []
    for name in ("total_iterations", "num_episodes", "update_epochs", "num_minibatches", "micro_batch_size",
                 "max_turn_tokens", "eval_episodes"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_minibatches > args.num_episodes:
        problems.append("--num-minibatches must be <= --num-episodes (a minibatch holds whole episodes)")
    if not 0 <= args.gamma <= 1 or not 0 <= args.gae_lambda <= 1:
        problems.append("--gamma and --gae-lambda must be in [0, 1]")
    if not 0 < args.clip_eps < 1 or args.value_clip < 0:
        problems.append("--clip-eps must be in (0, 1) and --value-clip >= 0")
    if min(args.temperature, args.eval_temperature) < 0 or not 0 < args.top_p <= 1:
        problems.append("--temperature / --eval-temperature must be >= 0 and --top-p in (0, 1]")
    if min(args.max_episode_steps, args.lora_r, args.checkpoint_every, args.eval_every) < 0:
        problems.append("--max-episode-steps, --lora-r, --checkpoint-every and --eval-every must be >= 0")
    if args.num_episodes * dist_info()[2] > 1000:  # episode seeds are 1,000 per iteration (see the rollout)
        problems.append("--num-episodes x torchrun processes must be <= 1000: more would replay the next iteration's seeds")
    if args.fsdp and args.rollout_dtype != "float32":
        problems.append("--rollout-dtype bfloat16 is a copy of whole weights: not with --fsdp")
    if args.fsdp and dist_info()[2] < 2:
        problems.append("--fsdp shards over torchrun processes: run it with torchrun --nproc_per_node N (N >= 2)")
    if problems:
        raise SystemExit("ppo_gae_agent.py: " + "; ".join(problems))


def gae(rewards: torch.Tensor, values: torch.Tensor, next_value: float, gammas: torch.Tensor, lam: float):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16) over one episode's K steps.

    delta_k = r_k + gamma_k V_{k+1} - V_k,  A_k = delta_k + gamma_k lambda A_{k+1},  with V_K = `next_value`:
    V(s_T) when the episode was cut short (bootstrap), 0 after a true termination. Returns (A, A + V),
    the second being the lambda-return that is the value target.
    """
    adv, last = torch.zeros_like(values), 0.0
    for k in reversed(range(len(rewards))):
        v_next = next_value if k == len(rewards) - 1 else values[k + 1]
        delta = rewards[k] + gammas[k] * v_next - values[k]
        last = delta + gammas[k] * lam * last
        adv[k] = last
    return adv, adv + values


def episode_gae(traj: Trajectory, plan, values: torch.Tensor, final_value: float, lam: float, bootstrap_truncated: bool):
    """GAE for one episode: bootstrap from V(s_T) only when it was cut short (`truncated`); success, failure
    and an invalid-action ending are terminal (V = 0). Returns (step advantages, step returns, unit advantages)."""
    _, unit_step, rewards, gammas = plan
    next_value = final_value if bootstrap_truncated and traj.termination == "truncated" else 0.0
    adv, ret = gae(rewards, values, next_value, gammas, lam)
    return adv, ret, adv[unit_step]


def episode_steps(traj: Trajectory, action_mode: str, level: str, gamma: float):
    """The GAE steps of one record: where each step's value is read, and each step's reward and discount.

    Returns (positions, unit_step, rewards, gammas): `positions[k]` is the index of the token after which step
    k's action is predicted (the last context token before it); `unit_step[u]` the step of policy unit u.
    Turn level: one step per agent turn. Token level (free mode): one step per policy token, the turn's
    reward on its last token, and gamma only between turns (within a turn the environment does not move).
    """
    rewards_t = [turn.reward for turn in traj.turns]
    if action_mode == "choice":
        positions = [s.position - 1 for s in traj.choice_steps]
        return positions, list(range(len(positions))), torch.tensor(rewards_t), torch.full((len(positions),), gamma)
    spans = traj.policy_token_spans()  # one span of sampled tokens per turn
    if level == "turn":
        unit_step = [k for k, (s, e) in enumerate(spans) for _ in range(e - s)]
        return [s - 1 for s, _ in spans], unit_step, torch.tensor(rewards_t), torch.full((len(spans),), gamma)
    positions, rewards, gammas = [], [], []
    for k, (s, e) in enumerate(spans):
        positions += range(s - 1, e - 1)
        rewards += [0.0] * (e - s - 1) + [rewards_t[k]]
        gammas += [1.0] * (e - s - 1) + [gamma]
    return positions, list(range(len(positions))), torch.tensor(rewards), torch.tensor(gammas)


def units_and_values(model, value_head, trajs, positions, action_mode, temperature, token_norm, trunk=(None, 0)):
    """One packed forward (common.rollout.policy_logprobs) giving the policy units *and* V at `positions`.

    The values are read from the same final hidden states the LM head uses (`units.hidden`, which starts at
    record position `units.hidden_start` when the records' common prompt ran apart), so the shared-trunk critic
    costs one linear layer. Returns (UnitBatch, values [B, S], step mask [B, S]).
    """
    units = policy_logprobs(model, trajs, action_mode, temperature, token_norm, *trunk)
    hidden = units.hidden
    width = max(1, max(len(p) for p in positions))
    index, mask = torch.zeros((len(trajs), width), dtype=torch.long), torch.zeros((len(trajs), width))
    for i, p in enumerate(positions):  # positions read are after the prompt, so never inside a shared prefix
        index[i, : len(p)], mask[i, : len(p)] = torch.tensor(p, dtype=torch.long) - units.hidden_start, 1.0
    index, mask = index.to(hidden.device), mask.to(hidden.device)
    h = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
    return units, value_head(h.float()).squeeze(-1) * mask, mask


def ppo_loss(logp, old_logp, ref_logp, adv, unit_mask, entropy, values, old_values, returns, step_mask,
             clip_eps, value_clip, vf_coef, ent_coef, beta, num_units, num_steps):
    """PPO's objective (Schulman et al. 2017, eq. 9: L^CLIP - c1 L^VF + c2 S) plus beta * KL, to minimise.

    Policy terms are over policy units ([B, U], `adv` already per unit), value terms over GAE steps ([B, S]).
    `num_units` / `num_steps` are the counts of the whole minibatch, so micro-batches accumulate to it.
    Value loss: 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) (PPO2's clipped value loss).
    """
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)  # eq. 7
    kl = torch.zeros_like(logp)
    if beta > 0:  # k3 estimator of KL(pi || pi_ref), >= 0 (Schulman 2020)
        log_r = ref_logp - logp
        kl = torch.exp(log_r) - log_r - 1
    policy_loss = ((-surrogate + beta * kl) * unit_mask).sum() / max(num_units, 1e-8)
    entropy_mean = (entropy * unit_mask).sum() / max(num_units, 1e-8)
    v_loss = (values - returns) ** 2
    if value_clip > 0:
        v_clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
        v_loss = torch.max(v_loss, (v_clipped - returns) ** 2)
    value_loss = 0.5 * (v_loss * step_mask).sum() / max(num_steps, 1e-8)
    loss = policy_loss + vf_coef * value_loss - ent_coef * entropy_mean
    with torch.no_grad():
        m, sm = unit_mask.bool(), step_mask.bool()
        log_ratio = logp - old_logp
        stats = {
            "policy_loss": policy_loss.item(), "value_loss": value_loss.item(), "entropy": entropy_mean.item(),
            "kl": (kl[m].sum() / max(num_units, 1e-8)).item(),
            "clip": ((ratio - 1).abs() > clip_eps)[m].float().sum().item() / max(num_units, 1e-8),
            "value_clip": ((values - old_values).abs() > value_clip)[sm].float().sum().item() / max(num_steps, 1e-8)
            if value_clip > 0 else 0.0,
            "approx_kl": ((ratio - 1) - log_ratio)[m].sum().item() / max(num_units, 1e-8),  # k3 of KL(old || new)
            "ratio": ratio[m].sum().item() / max(num_units, 1e-8)}
    return loss, stats


if __name__ == "__main__":
    args = cli_with_resume(Args, RESUMABLE, "ppo_gae_agent.py")
    validate_args(args)
    device = resolve_device(args.device)
    rank, _, args.world_size = init_distributed(device)
    args.batch_size = args.num_episodes * args.world_size
    run_dir = args.resume or os.path.join(args.output_dir, make_run_name(args.env_id, args.exp_name, args.seed))
    ckpt = Checkpointer(run_dir, args.checkpoint_every, rank, args.world_size)
    resumed = ckpt.read() if args.resume else None  # a bad checkpoint fails here, before loading a model
    if resumed and args.total_iterations < (done := resumed["counters"]["iteration"]):
        raise SystemExit(f"--total-iterations {args.total_iterations}: the checkpoint is at iteration {done} already")
    env_kwargs = {"max_steps": args.max_episode_steps} if args.max_episode_steps else {}
    make_env = lambda: envs.make(args.env_id, **env_kwargs)  # noqa: E731
    try:  # fail fast on a bad --env-id (or --max-episode-steps), or one the engine cannot act on, before loading a model
        check_env(make_env(), args.action_mode, args.mask_illegal_actions)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"{'--max-episode-steps' if env_kwargs and isinstance(e, TypeError) else '--env-id'}: {e}")

    seed_everything(args.seed, args.torch_deterministic)
    dtype = torch.float32 if args.lora_r == 0 else None  # trained weights fp32 (bf16 rounds a 1e-5 step away)
    model, tokenizer = load_model(args.model, device, dtype, seed=args.seed)
    rank_seed = args.seed + 1000 * rank
    sample_gen, py_rng = torch.Generator(device=device).manual_seed(rank_seed), random.Random(rank_seed)
    num_layers = len(model.get_decoder().layers)
    model = train_top_layers(model, args.trainable_layers, args.lora_r, args.lora_alpha, args.gradient_checkpointing)
    value_head = torch.nn.Linear(model.config.hidden_size, 1, device=device, dtype=torch.float32)
    for p in value_head.parameters():  # V(s) = w . h(s) + b on the final hidden state, zero-initialised: V starts at 0
        torch.nn.init.zeros_(p)
    critic = model
    if args.critic == "separate":
        critic = train_top_layers(load_model(args.model, device, dtype, seed=args.seed)[0], args.trainable_layers,
                                args.lora_r, args.lora_alpha, args.gradient_checkpointing)
    ref_model = None  # the frozen initial policy; with LoRA, the policy itself with its adapters switched off
    if args.beta > 0:
        ref_model = model if args.lora_r else load_model(args.model, device, dtype, seed=args.seed)[0].requires_grad_(False)
    # everything trained, as one module for the checkpoint (a shared critic is the policy: its parameters count once)
    trained = torch.nn.ModuleDict({"policy": model, "critic": critic, "value_head": value_head})
    if args.world_size > 1:  # start from identical weights on every rank: broadcast, not seeding alone
        for m in {id(x): x for x in (model, critic, ref_model) if x is not None}.values():
            for p in m.parameters():
                dist.broadcast(p.data, src=0)
    # FSDP replaces the layers' parameters by their shards (a separate reference copy stays whole)
    fsdp_layers = [x for lm in {id(m): m for m in (model, critic)}.values() for x in shard_layers(lm)] if args.fsdp else []
    lm_params = [p for n, p in trained.named_parameters() if p.requires_grad and not n.startswith("value_head.")]
    params = lm_params + list(value_head.parameters())
    optimizer = torch.optim.AdamW([{"params": lm_params, "lr": args.learning_rate}, {"params": list(
        value_head.parameters()), "lr": args.value_learning_rate}], weight_decay=0.0)  # two groups: LM(s), value head

    tracker = Tracker(run_dir, vars(args), enabled=rank == 0, resume_state=resumed and resumed["tracker"])
    print0(f"run {os.path.basename(run_dir)}: {args.model} on {args.env_id}, {args.action_mode} mode, {args.critic} critic, "
           f"{args.batch_size} episodes/iteration, {sum(p.numel() for p in params):,} trainable parameters of "
           f"{sum(parameter_counts(m)[1] for m in {id(m): m for m in (model, critic, value_head)}.values()):,}")
    # the frozen lower layers' output, computed once by the rollout, is reused by trainer, reference and separate critic
    frozen_below = num_layers - args.trainable_layers if 0 < args.trainable_layers < num_layers else None
    engine = RolloutEngine(sampling_copy(model, args.rollout_dtype), tokenizer, RolloutConfig(  # or a bf16 copy
        action_mode=args.action_mode, temperature=args.temperature, top_p=args.top_p, max_turn_tokens=args.max_turn_tokens,
        max_total_tokens=args.max_total_tokens, choice_token_norm=args.choice_token_norm,
        mask_illegal_actions=args.mask_illegal_actions), record_layer_inputs=frozen_below,
        record_final_observation=frozen_below is not None and args.bootstrap_truncated)  # V(s_T) without a full forward
    level = "turn" if args.action_mode == "choice" else args.gae_level  # choice mode: one unit per turn anyway

    def all_reduce_grads():  # FSDP has already reduce-scattered the sharded layers' gradients
        for p in (p for p in params if not is_sharded(p)) if args.world_size > 1 else ():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad  # a rank with nothing to train still joins
            dist.all_reduce(p.grad)
            p.grad /= args.world_size

    def critic_values(sub, pos, trunk_args):  # V at `pos` only: scored as free mode (no per-candidate tree)
        return units_and_values(critic, value_head, sub, pos, "free", 1.0, False, trunk_args)[1]

    episodes_seen, first_iteration, start = 0, 1, time.time()
    generators = {"sample": sample_gen, "python": py_rng}
    if resumed:  # trained weights (value head, critic), optimizer, every RNG, counters: as after the checkpoint's iteration
        ckpt.restore(resumed, trained, optimizer, generators=generators)
        episodes_seen, first_iteration = resumed["counters"]["episodes_seen"], resumed["counters"]["iteration"] + 1
        print0(f"resumed from {run_dir} at iteration {first_iteration - 1} ({episodes_seen} episodes)")
        refresh_sampling_copy(engine.model, model)  # a bf16 sampler gets the restored weights

    def run_eval(iteration: int):
        with gathered(fsdp_layers if args.eval_every > 0 else []), autocast(device):  # FSDP: all gather, rank 0 evaluates
            m = evaluate_episodes(engine, make_env, args.env_id, args.eval_episodes, args.seed, args.eval_temperature,
                                  device) if args.eval_every and rank == 0 else {}
        if m:
            tracker.scalars({f"eval/{k}": v for k, v in m.items()}, episodes_seen)
            print0(f"eval @ iter {iteration} | success {m['success_rate']:.2f} | return {m['episodic_return']:.2f}")

    if not resumed:
        run_eval(0)
    interrupt = GracefulInterrupt().start()  # Ctrl-C / SIGTERM: finish this iteration, save a checkpoint, exit
    for iteration in range(first_iteration, args.total_iterations + 1):
        for group, lr in zip(optimizer.param_groups, (args.learning_rate, args.value_learning_rate)):  # --anneal-lr
            group["lr"] = lr * (1.0 - (iteration - 1) / args.total_iterations if args.anneal_lr else 1.0)
        # ---- rollout: one episode per environment seed ----
        t0 = time.time()
        seeds = [(args.seed * 100_000 + iteration) * 1_000 + rank * args.num_episodes + i for i in range(args.num_episodes)]
        with autocast(device), gathered(fsdp_layers):  # bf16 on CUDA; FSDP: whole weights, rollouts differ in length
            trajs = engine.run([make_env() for _ in seeds], seeds, args.env_id, policy_version=iteration - 1,
                               generator=sample_gen)
        rollout_s, n = time.time() - t0, len(trajs)
        episodes_seen += n * args.world_size
        trunk_inputs = engine.layer_inputs if frozen_below is not None else None
        branch_inputs = engine.branch_inputs
        trunk = lambda c: ([trunk_inputs[i] for i in c], frozen_below,  # noqa: E731 (and the multi-token candidates')
                           [branch_inputs[i] for i in c]) if trunk_inputs else (None, 0)
        micro = lambda idx: [idx[i: i + args.micro_batch_size] for i in range(0, len(idx), args.micro_batch_size)]  # noqa: E731

        # ---- V_old at every step (and pi_ref) from no-grad passes with the sampler's weights ----
        t1, plans = time.time(), [episode_steps(t, args.action_mode, level, args.gamma) for t in trajs]
        old_logp, unit_mask = (x.to(device) for x in behavior_units(trajs, args.action_mode))
        old_values = torch.zeros(n, max(1, max(len(p[0]) for p in plans)), device=device)
        ref_logp = torch.zeros_like(old_logp)
        # episodes cut short (time limit or token cap) bootstrap from V(s_T), read in the same pass at the end of the
        # final observation (never part of the record): the rollout fed it and kept its trunk inputs (`final_tails`)
        cut = [i for i, t in enumerate(trajs) if args.bootstrap_truncated and t.termination == "truncated"]
        tails = {i: engine.final_tails[i][0] if trunk_inputs else engine.chat.next_turn_ids(
            trajs[i].turns[-1].observation, action_ended_with_eos=args.action_mode == "free" and
            trajs[i].token_ids[-1] == engine.chat.eos_id) for i in cut}
        value_trunk = lambda c: ([torch.cat([trunk_inputs[i], engine.final_tails[i][1]]) if i in tails  # noqa: E731
                                  else trunk_inputs[i] for i in c], frozen_below) if trunk_inputs else (None, 0)
        next_values = torch.zeros(n)
        with torch.no_grad(), autocast(device, args.update_dtype), gathered(fsdp_layers):
            for c in micro(list(range(n))):
                sub = [replace(trajs[i], token_ids=trajs[i].token_ids + tails[i],
                               source_mask=trajs[i].source_mask + [0] * len(tails[i])) if i in tails else trajs[i]
                       for i in c]
                pos = [plans[i][0] + ([len(t.token_ids) - 1] if i in tails else []) for i, t in zip(c, sub)]
                vals = critic_values(sub, pos, value_trunk(c))
                for j, i in enumerate(c):
                    k = len(plans[i][0])
                    old_values[i, :k] = vals[j, :k]
                    if i in tails:
                        next_values[i] = vals[j, k].item()
                if ref_model is not None:
                    with adapter_disabled(ref_model) as ref:
                        ref = policy_logprobs(ref, [trajs[i] for i in c], args.action_mode, args.temperature,
                                              args.choice_token_norm, *trunk(c)).logprobs
                    ref_logp[c[0]: c[-1] + 1, : ref.shape[1]] = ref
        value_s = time.time() - t1

        # ---- GAE per episode (turn level by default), spread to the units of each step; whitening ----
        advantages = torch.zeros_like(old_logp)
        returns, step_mask = torch.zeros_like(old_values), torch.zeros_like(old_values)
        for i, plan in enumerate(plans):
            k = len(plan[0])
            _, ret, unit_adv = episode_gae(trajs[i], plan, old_values[i, :k].cpu(), float(next_values[i]),
                                           args.gae_lambda, args.bootstrap_truncated)
            returns[i, :k], step_mask[i, :k] = ret.to(device), 1.0
            advantages[i, : len(unit_adv)] = unit_adv.to(device)
        m = unit_mask.bool()
        raw_adv_std = float(advantages[m].std(unbiased=False)) if m.any() else 0.0
        if args.norm_adv and m.sum() > 1:
            advantages = (advantages - advantages[m].mean()) / (advantages[m].std(unbiased=False) + 1e-8) * unit_mask
        v_true, v_pred = returns[step_mask.bool()], old_values[step_mask.bool()]
        var_true = float(v_true.var(unbiased=False)) if v_true.numel() else 0.0  # 1 - Var[R - V] / Var[R]
        explained_var = 1 - float((v_true - v_pred).var(unbiased=False)) / var_true if var_true > 1e-8 else 0.0

        # ---- update: epochs x shuffled minibatches x micro-batches ----
        t2, sums, count, grad_norm, stepped = time.time(), {}, 0, 0.0, False
        mismatch, mismatch_sum, mismatch_units = 0.0, 0.0, 0.0  # sampler vs trainer log-probs, before the first step
        trained.train()
        for epoch in range(args.update_epochs):
            order = list(range(n))
            py_rng.shuffle(order)
            for mb in np.array_split(np.array(order), args.num_minibatches):
                mb = sorted(int(i) for i in mb)
                # under torchrun: global counts / world, so averaged gradients = one process on the whole minibatch
                num_units = global_loss_denominator(unit_mask[mb].sum().item())
                num_steps = global_loss_denominator(step_mask[mb].sum().item())
                optimizer.zero_grad(set_to_none=False)
                mb_stats = {}
                for c in micro(mb):
                    sub, pos = [trajs[i] for i in c], [plans[i][0] for i in c]
                    with autocast(device, args.update_dtype):  # the backward runs outside, in the dtypes the forward chose
                        units, vals, smask = units_and_values(model, value_head, sub, pos, args.action_mode,
                                                              args.temperature, args.choice_token_norm, trunk(c))
                        if critic is not model:
                            vals = critic_values(sub, pos, trunk(c))
                    w, s = units.logprobs.shape[1], vals.shape[1]
                    if not stepped:  # the sampler's weights: equal log-probs in fp32, bf16 rounding with the flags
                        gap = (units.logprobs.detach() - old_logp[c, :w]).abs() * unit_mask[c, :w]
                        mismatch, mismatch_sum = max(mismatch, gap.max().item()), mismatch_sum + gap.sum().item()
                        mismatch_units += unit_mask[c, :w].sum().item()
                    loss, st = ppo_loss(units.logprobs, old_logp[c, :w], ref_logp[c, :w], advantages[c, :w],
                                        unit_mask[c, :w], units.entropy, vals, old_values[c, :s], returns[c, :s],
                                        smask, args.clip_eps, args.value_clip, args.vf_coef, args.ent_coef, args.beta,
                                        num_units, num_steps)
                    loss.backward()
                    mb_stats = {k: mb_stats.get(k, 0.0) + v for k, v in st.items()}  # each is already / the minibatch counts
                all_reduce_grads()
                grad_norm = clip_grad_norm(params, args.max_grad_norm)  # FSDP: the norm over every rank's slices
                optimizer.step()
                stepped = True
                sums = {k: sums.get(k, 0.0) + v for k, v in mb_stats.items()}
                count += 1
        trained.eval()
        update_s = time.time() - t2
        sync_s = refresh_sampling_copy(engine.model, model)  # --rollout-dtype bfloat16: the next rollout's weights
        stats = {key: v / max(count, 1) for key, v in sums.items()}

        # ---- logging ----
        scalars = {
            **{f"charts/{k}": v for k, v in episode_metrics(trajs).items()},
            **{f"losses/{k}": stats[k] for k in ("policy_loss", "value_loss", "entropy", "kl")},
            "diagnostics/clip_fraction": stats["clip"], "diagnostics/value_clip_fraction": stats["value_clip"],
            "diagnostics/approx_kl": stats["approx_kl"], "diagnostics/ratio_mean": stats["ratio"],
            "diagnostics/advantage_std": raw_adv_std, "diagnostics/explained_variance": explained_var,
            "diagnostics/value_mean": float(v_pred.mean()) if v_pred.numel() else 0.0,
            "diagnostics/return_target_mean": float(v_true.mean()) if v_true.numel() else 0.0,
            "diagnostics/bootstrap_fraction": len(cut) / n, "diagnostics/logprob_mismatch": mismatch,
            "diagnostics/logprob_mismatch_mean": mismatch_sum / max(mismatch_units, 1.0),
            "diagnostics/policy_lag": 0.0,  # synchronous: every episode was sampled by the weights being updated
            "diagnostics/grad_norm": grad_norm, "charts/learning_rate": optimizer.param_groups[0]["lr"],
            "perf/rollout_s": rollout_s, "perf/value_s": value_s, "perf/update_s": update_s, "perf/weight_sync_s": sync_s,
            "perf/rollout_tokens_per_s": sum(len(t.token_ids) for t in trajs) / rollout_s,
            "perf/env_steps_per_s": sum(t.num_steps for t in trajs) / rollout_s,
        }
        if args.world_size > 1:  # every rank applied the same averaged update: their weights must agree exactly
            scalars["diagnostics/rank_param_divergence"] = rank_param_divergence(params)
        scalars = all_reduce_mean(scalars)
        tracker.scalars(scalars, episodes_seen)
        if iteration == 1 or iteration % 10 == 0:
            tracker.trajectories(trajs, episodes_seen)
        print0(f"iter {iteration}/{args.total_iterations} | episodes {episodes_seen} "
               f"| return {scalars['charts/episodic_return']:.2f} | success {scalars['charts/success_rate']:.2f} "
               f"| pg {scalars['losses/policy_loss']:+.4f} | vf {scalars['losses/value_loss']:.4f} "
               f"| ev {scalars['diagnostics/explained_variance']:+.2f} | entropy {scalars['losses/entropy']:.3f} "
               f"| {rollout_s + value_s + update_s:.1f}s (rollout {rollout_s:.1f}, values {value_s:.1f}, "
               f"update {update_s:.1f})")
        if args.eval_every > 0 and (iteration % args.eval_every == 0 or iteration == args.total_iterations):
            run_eval(iteration)
        stop = interrupt.should_stop()  # agreed across ranks
        if ckpt.due(iteration, last=iteration == args.total_iterations) or stop:
            ckpt.save({"iteration": iteration, "episodes_seen": episodes_seen}, trained, optimizer, generators=generators,
                      tracker=tracker)
            print0(f"checkpoint saved in {run_dir} (iteration {iteration})")
        if stop:
            print0(f"interrupted: resume with  python {sys.argv[0]} --resume {run_dir}")
            tracker.close()
            raise SystemExit(130)
    interrupt.stop()

    whole = [full_tensors(lm.state_dict()) if args.save_model and fsdp_layers else None for lm in (model, critic)]  # FSDP
    if args.save_model and rank == 0:
        save_model(model, tokenizer, os.path.join(run_dir, "model"), whole[0])  # with LoRA: the adapter and its base's name
        torch.save(value_head.state_dict(), os.path.join(run_dir, "value_head.pt"))
        if critic is not model:
            save_model(critic, tokenizer, os.path.join(run_dir, "critic"), whole[1])
        print0(f"model saved to {os.path.join(run_dir, 'model')}")
    print0(f"done in {time.time() - start:.0f}s; logs in {run_dir}")
    tracker.close()
    if args.world_size > 1:
        finish_distributed()  # barrier, destroy the group, exit 0 skipping the interpreter's shutdown (gloo abort)
