# docs: docs/grpo_agent.md
"""Multi-turn GRPO for LLM agents (Shao et al. 2024, DeepSeekMath; seed 000 eq. 12.18-12.19; seed 001).

For each task (an environment seed), G episodes are played with the current policy; each episode's
return is normalised within its group (eq. 12.18) and that advantage is given to every policy token
(free mode) or every action (choice mode) of the episode. The policy is updated with a clipped
importance ratio against the behaviour log-probs recorded at sampling time, plus an optional k3 KL
penalty to a frozen reference (eq. 12.19). Only policy units enter the loss: prompt, system,
observation and template tokens are masked out (seed 001, the source mask m_j).

Usage:
    python algorithms/grpo_agent.py                                   # smollm2-135m, GridWorld, choice mode, CPU
    python algorithms/grpo_agent.py --model tiny --total-iterations 5 # seconds, for a smoke test
    python algorithms/grpo_agent.py --action-mode free --sft-steps 30 # free text, with a format cold start
    python algorithms/grpo_agent.py --device cuda                     # one GPU
    python algorithms/grpo_agent.py --device cuda --action-mode free --sft-steps 30 --rollout-backend vllm  # vLLM samples
    # full fine-tune with the KL reference in 3.7 GiB of RAM (docs/grpo_agent.md, Memory):
    python algorithms/grpo_agent.py --trainable-layers 0 --beta 0.04 --gradient-checkpointing --malloc-mmap-threshold-kib 1024
    torchrun --nproc_per_node 2 algorithms/grpo_agent.py --model tiny # data parallel (gloo on CPU, NCCL on GPU)
    torchrun --nproc_per_node 8 algorithms/grpo_agent.py --fsdp --model <path>  # layers sharded over the ranks (FSDP2)
    python algorithms/grpo_agent.py --checkpoint-every 5              # then, after a crash or Ctrl-C:
    python algorithms/grpo_agent.py --resume runs/<run> [--total-iterations 50]

Copying this file out: it needs `common/` (and `envs/` for the built-in environments, or any
`package.module:Factory` passed as --env-id).

Where this departs from the paper / seed:
- The advantage is episode-level (outcome supervision, seed 001) unless `--step-adv-coef w` > 0 adds GiGPO's
  step-level advantage (Feng et al. 2025): within a group, turns taken from the same state are compared by their
  discounted return-to-go (`step_advantages`), so each move gets credit of its own; not in GRPO.
- Groups whose returns have zero variance carry no signal (Var[R] = p(1 - p) = 0) and are dropped from
  the loss rather than resampled (seed 001, "solvability filtering"); their fraction is logged.
- The ratio uses the log-probs recorded by the sampler as pi_old: no extra forward (exact on CPU fp32;
  the recomputed-vs-recorded gap is logged as diagnostics/logprob_mismatch). With `--rollout-backend vllm` pi_old is
  vLLM's (other kernels, bf16), with `--rollout-dtype bfloat16` a bf16 copy's: diagnostics/logprob_mismatch_mean
  and first_epoch_* show the gap.
- Clipping is asymmetric by flag (eps_low / eps_high, the "clip-higher" of DAPO); the default is symmetric.
- `--novelty-coef c` (off by default) adds a count-based novelty bonus to the advantage; not in GRPO.
- `--sil-coef c` (off by default) replays the best past episodes of a task that beat its group's mean
  return, with advantage c * (R - mean), as self-imitation learning (Oh et al. 2018); not in GRPO.
- `--loss-agg token-mean` (default) divides by the batch's policy-unit count, `sequence-mean` averages
  per-episode means, as in the original GRPO.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import numpy as np
import torch
import torch.distributed as dist
import tyro

import envs
from common.checkpoint import Checkpointer, GracefulInterrupt, cli_with_resume
from common.distributed import (all_reduce_mean, average_gradients, clip_grad_norm, dist_info, finish_distributed,
                                full_tensors, gathered, global_loss_denominator, init_distributed, print0,
                                rank_param_divergence, seed_everything, shard_layers)
from common.exploration import NoveltyBonus, SelfImitationMemory
from common.memory import cap_mmap_threshold
from common.models import (adapter_disabled, autocast, load_model, refresh_sampling_copy, resolve_device, sampling_copy,
                           save_model, train_top_layers)
from common.offline import place_key
from common.records import Trajectory
from common.rollout import (RolloutConfig, RolloutEngine, behavior_units, check_env, episode_metrics, evaluate_episodes,
                            format_demonstrations, policy_logprobs, sft_cold_start)
from common.tracking import Tracker, make_run_name
from common.vllm_backend import BackendUnavailable, TokenRolloutEngine, VLLMGenerator, require_vllm, sync_weights


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
    """save the final policy (Hugging Face format) to `runs/{run_name}/model`"""
    model: str = "smollm2-135m"
    """`tiny` (random, for tests), `smollm2-135m` (embedded default) or a local model path"""
    env_id: str = "gridworld"
    """environment id (`gridworld`, `gridworld-procedural`, ...) or `package.module:Factory`"""
    output_dir: str = "runs"
    """where run directories are created"""
    checkpoint_every: int = 0
    """save a checkpoint (trained weights, optimizer, RNG states, counters) every N iterations and at the end; 0: never.
    Ctrl-C (or SIGTERM) always finishes the iteration and saves one before exiting"""
    resume: str = ""
    """a run directory to continue from its checkpoint, with its saved arguments and TensorBoard run"""

    # Algorithm specific arguments
    total_iterations: int = 25
    """number of GRPO iterations (rollout + update)"""
    num_groups: int = 1
    """tasks (environment seeds) per iteration, per process"""
    group_size: int = 8
    """episodes per task: the G of eq. 12.18"""
    action_mode: Literal["free", "choice"] = "choice"
    """`choice`: a distribution over the environment's action names; `free`: generated text the environment parses"""
    choice_token_norm: bool = True
    """TWOSOME normalisation: divide an action's log-prob by its token count (matters for multi-token names)"""
    mask_illegal_actions: bool = False
    """choice mode: sample and train only over the environment's legal_actions() (Huang & Ontañón 2022's invalid-action
    masking; GridWorld: the moves no wall or edge blocks)"""
    learning_rate: float = 1e-4
    """AdamW learning rate"""
    trainable_layers: int = 6
    """train only the top N transformer layers and the final norm (0, or at least the layer count: the whole model)"""
    lora_r: int = 0
    """LoRA rank (peft) on the trained layers' attention and MLP projections, base frozen; 0: train the weights"""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / r) B A"""
    gradient_checkpointing: bool = False
    """recompute layer activations in the backward (full fine-tuning under 4 GB RSS needs it; see docs, "Memory")"""
    fsdp: bool = False
    """torchrun: shard the decoder layers' weights, gradients and AdamW state over the ranks (PyTorch FSDP2); the
    weights are gathered whole for rollouts (see docs, "FSDP")"""
    update_epochs: int = 2
    """optimisation epochs over each batch (1: on-policy, ratio = 1, as DeepSeekMath; >1 reuses the batch under the clip)"""
    micro_batch_size: int = 1
    """episodes per forward/backward (gradient accumulation: the update is the same; 1 pads nothing, see docs item 13)"""
    malloc_mmap_threshold_kib: int = 0
    """glibc only: blocks above this many KiB are mmap-ed and returned to the OS when freed; 1024 cuts the peak RSS
    up to 3x for full fine-tunes, for <= ~20% more time (0: glibc's own threshold, which grows to 32 MiB)"""
    clip_eps_low: float = 0.2
    """ratio clip below: 1 - eps_low"""
    clip_eps_high: float = 0.2
    """ratio clip above: 1 + eps_high (0.28 is DAPO's clip-higher)"""
    beta: float = 0.0
    """k3 KL coefficient to the frozen initial policy (the base model, before any --sft-steps); 0: no reference model"""
    adv_eps: float = 1e-4
    """epsilon in the advantage denominator (std + eps)"""
    loss_agg: Literal["token-mean", "sequence-mean"] = "token-mean"
    """how policy-unit losses are averaged"""
    filter_zero_variance: bool = True
    """drop groups whose returns (and novelty bonuses) are all equal (no learning signal) from the loss"""
    novelty_coef: float = 0.0
    """count-based exploration: add coef * sum of 1/sqrt(visits) over the episode's distinct states to its advantage,
    centred in its group but not whitened (common/exploration.py; see docs, "Exploration"); 0: plain GRPO"""
    step_adv_coef: float = 0.0
    """GiGPO (Feng et al. 2025): add coef * the step-level advantage, each turn's discounted return-to-go normalised
    among the group's turns from the same state (see docs, "Step-level advantages"); 0: plain GRPO"""
    step_gamma: float = 0.95
    """GiGPO: the discount of the step-level return-to-go"""
    sil_coef: float = 0.0
    """self-imitation: replay each task's best past episodes that beat its group's mean return, with advantage
    coef * (R - mean) (Oh et al. 2018; see docs, "Self-imitation"); 0: off"""
    sil_episodes: int = 2
    """self-imitation: distinct episodes kept per task (the highest returns seen)"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    temperature: float = 2.0
    """sampling temperature of training rollouts (SmolLM2 tends to repeat its previous answer; T = 2 keeps it exploring)"""
    top_p: float = 1.0
    """free mode: nucleus sampling during training rollouts (choice mode samples the whole action distribution)"""
    top_k: int = 0
    """free mode: the policy samples each token among the k most likely only, and is trained as that (0: off; item 17)"""
    rollout_backend: Literal["hf", "vllm"] = "hf"
    """`hf`: the trained model samples (CPU or GPU); `vllm`: a vLLM engine on the GPU samples (free mode only) and
    gets the trained weights after every update (pip install -r requirements-gpu.txt)"""
    rollout_dtype: Literal["float32", "bfloat16"] = "float32"
    """`hf` backend: the precision the policy samples (and is evaluated) in; `bfloat16`: a bf16 copy of it, refreshed
    after every update (1.2-2x the decode tokens/s on a CPU with AVX512-BF16; pi_old is then the copy's, item 20)"""
    update_dtype: Literal["float32", "bfloat16"] = "float32"
    """CPU: `bfloat16` runs the update's forward/backward under bf16 autocast (fp32 weights and AdamW; item 21)"""
    vllm_gpu_memory_utilization: float = 0.3
    """`--rollout-backend vllm`: share of GPU memory vLLM may take (weights + KV cache); the trainer gets the rest"""
    max_turn_tokens: int = 8
    """free mode: cap on generated tokens per turn (hitting it is recorded on the turn)"""
    max_total_tokens: int = 4096
    """cap on an episode's whole token sequence (hitting it ends the episode as truncated)"""
    sft_steps: int = 0
    """cold start: SFT steps on format demonstrations (random *valid* actions) before RL; free mode needs ~30"""
    sft_batch_size: int = 8
    """demonstrations per SFT step"""
    sft_learning_rate: float = 1e-4
    """learning rate of the cold start"""
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
    """episodes per iteration over all processes: num_groups * group_size * world_size"""


# the flags --resume lets differ from the saved run (none of them changes what the training samples)
RESUMABLE = {"total_iterations", "checkpoint_every", "eval_every", "eval_episodes", "eval_temperature", "save_model",
             "resume", "output_dir", "malloc_mmap_threshold_kib"}
# read by tests/test_conformance.py: a few-second `--model tiny` run, and the shared tags it writes
SMOKE_TEST_ARGS = ["--total-iterations", "1", "--group-size", "4", "--eval-every", "1", "--eval-episodes", "2",
                   "--no-filter-zero-variance"]  # tiny's group has zero variance there: kept, so losses are logged
LOGGED_TAGS = ("charts/episodic_return", "charts/success_rate", "charts/episode_length", "charts/invalid_action_rate",
               "losses/policy_loss", "losses/entropy", "losses/kl", "diagnostics/clip_fraction_low",
               "diagnostics/clip_fraction_high", "diagnostics/ratio_mean", "diagnostics/advantage_std",
               "diagnostics/zero_variance_groups", "diagnostics/logprob_mismatch", "diagnostics/policy_lag",
               "diagnostics/first_epoch_ratio_mean", "diagnostics/first_epoch_clip_fraction", "perf/weight_sync_s",
               "perf/rollout_tokens_per_s", "perf/env_steps_per_s", "perf/rollout_s", "perf/update_s",
               "eval/success_rate", "eval/episodic_return")


def validate_args(args: Args):
    problems = []
    if args.checkpoint_every < 0:
        problems.append("--checkpoint-every must be >= 0 (0: no periodic checkpoints)")
    if args.malloc_mmap_threshold_kib < 0 or args.lora_r < 0:
        problems.append("--malloc-mmap-threshold-kib (0: glibc's default) and --lora-r (0: no LoRA) must be >= 0")
    for name in ("total_iterations", "num_groups", "group_size", "update_epochs", "micro_batch_size", "max_turn_tokens",
                 "eval_episodes", "sft_batch_size"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.group_size < 2:
        problems.append("--group-size must be >= 2: a group of one has no variance to normalise by")
    if not 0 <= args.clip_eps_low < 1 or args.clip_eps_high < 0 or args.max_grad_norm <= 0:
        problems.append("--clip-eps-low must be in [0, 1), --clip-eps-high >= 0 and --max-grad-norm > 0")
    if min(args.novelty_coef, args.sil_coef, args.step_adv_coef) < 0 or args.sil_episodes < 1:
        problems.append("--novelty-coef, --sil-coef and --step-adv-coef must be >= 0 (0: off), --sil-episodes >= 1")
    if not 0 < args.step_gamma <= 1:
        problems.append("--step-gamma must be in (0, 1]")
    if min(args.temperature, args.eval_temperature) < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        problems.append("--temperature / --eval-temperature must be >= 0, --top-p in (0, 1] and --top-k >= 0")
    if args.rollout_dtype != "float32" and (args.rollout_backend == "vllm" or args.fsdp):
        problems.append("--rollout-dtype applies to --rollout-backend hf without --fsdp (vLLM samples in bf16 already)")
    if args.rollout_backend == "vllm" and (args.action_mode != "free" or args.top_k):
        problems.append("--rollout-backend vllm needs --action-mode free (choice mode scores action names on the "
                        "trainer's KV cache, which vLLM does not expose) and no --top-k (not passed to vLLM yet)")
    if args.fsdp and dist_info()[2] < 2:
        problems.append("--fsdp shards over torchrun processes: run it with torchrun --nproc_per_node N (N >= 2)")
    if problems:
        raise SystemExit("grpo_agent.py: " + "; ".join(problems))


def group_advantages(returns: torch.Tensor, eps: float) -> torch.Tensor:
    """Eq. 12.18: A_i = (r_i - mean(r)) / (std(r) + eps) within each group. returns: [num_groups, G]."""
    mean, std = returns.mean(dim=1, keepdim=True), returns.std(dim=1, keepdim=True, unbiased=False)
    return (returns - mean) / (std + eps)


def step_advantages(trajs: list[Trajectory], group_size: int, gamma: float, eps: float) -> list[torch.Tensor]:
    """GiGPO's step-level advantage (Feng et al. 2025), one value per turn. In a group (`group_size` consecutive
    episodes of one task, all starting from its initial state) the turns taken from one state (`place_key` of the
    observation before them) form a step group; a turn's return-to-go R_t = sum_k gamma^k r_(t+k) is normalised in
    it as eq. 12.18 normalises returns (a state reached once, or with equal R_t, gives 0)."""
    out = []
    for start in range(0, len(trajs), group_size):
        keys, returns_to_go, buckets = [], [], defaultdict(list)
        for traj in trajs[start:start + group_size]:
            running, backwards = 0.0, []
            for turn in reversed(traj.turns):
                running = turn.reward + gamma * running
                backwards.append(running)
            keys.append([None] + [place_key(turn.observation) for turn in traj.turns[:-1]])
            returns_to_go.append(backwards[::-1])
            for key, value in zip(keys[-1], returns_to_go[-1]):
                buckets[key].append(value)
        stats = {key: (np.mean(values), np.std(values)) for key, values in buckets.items()}
        out += [torch.tensor([(r - stats[k][0]) / (stats[k][1] + eps) for k, r in zip(ks, rs)], dtype=torch.float32)
                for ks, rs in zip(keys, returns_to_go)]
    return out


def grpo_loss(logp, old_logp, ref_logp, advantages, unit_mask, eps_low, eps_high, beta, loss_agg, num_units, num_seqs):
    """Eq. 12.19 over policy units, as a quantity to minimise.

    logp / old_logp / ref_logp / unit_mask: [B, U]; advantages: [B], or per unit [B, >=U] (GiGPO). `num_units` and
    `num_seqs` are the counts over the *whole* batch, so micro-batches accumulate to exactly the full-batch loss
    (under torchrun: the global counts / world size, so the averaged gradients are the global batch's).
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages[:, : logp.shape[1]]
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
    per_unit = -surrogate
    kl = torch.zeros_like(logp)
    if beta > 0:
        # k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0 (Schulman 2020)
        log_r = ref_logp - logp
        kl = torch.exp(log_r) - log_r - 1
        per_unit = per_unit + beta * kl
    if loss_agg == "token-mean":
        loss = (per_unit * unit_mask).sum() / max(num_units, 1e-8)
    else:
        per_seq = (per_unit * unit_mask).sum(1) / unit_mask.sum(1).clamp(min=1)
        loss = per_seq.sum() / max(num_seqs, 1e-8)
    with torch.no_grad():
        m = unit_mask.bool()
        stats = {
            "clip_low": ((ratio < 1 - eps_low) & (adv < 0))[m].float().sum().item(),
            "clip_high": ((ratio > 1 + eps_high) & (adv > 0))[m].float().sum().item(),
            "ratio_sum": ratio[m].sum().item(), "kl_sum": kl[m].sum().item(),
        }
    return loss, stats


if __name__ == "__main__":
    args = cli_with_resume(Args, RESUMABLE, "grpo_agent.py")
    validate_args(args)
    cap_mmap_threshold(args.malloc_mmap_threshold_kib)  # before the first large allocation (see its docstring)
    device = resolve_device(args.device)
    rank, _, args.world_size = init_distributed(device)
    args.batch_size = args.num_groups * args.group_size * args.world_size
    run_dir = args.resume or os.path.join(args.output_dir, make_run_name(args.env_id, args.exp_name, args.seed))
    ckpt = Checkpointer(run_dir, args.checkpoint_every, rank, args.world_size)
    resumed = ckpt.read() if args.resume else None  # a bad checkpoint fails here, before loading a model
    if resumed and args.total_iterations < (done := resumed["counters"]["iteration"]):
        raise SystemExit(f"--total-iterations {args.total_iterations}: the checkpoint is at iteration {done} already")
    try:  # fail fast on a bad --env-id, or one the engine cannot act on as asked, before loading a model
        check_env(envs.make(args.env_id), args.action_mode, args.mask_illegal_actions)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--env-id: {e}")
    if args.rollout_backend == "vllm":  # fail fast, before loading a model
        try:
            require_vllm()
        except BackendUnavailable as e:
            raise SystemExit(f"--rollout-backend vllm: {e}")
        if args.world_size > 1:
            raise SystemExit("--rollout-backend vllm: one process only for now (not under torchrun)")

    # seeding: each rank samples its own episodes; the model init (tiny) is the same on every rank
    seed_everything(args.seed, args.torch_deterministic)
    dtype = torch.float32 if args.lora_r == 0 else None  # trained weights in fp32 (bf16 rounds a 1e-5 step away)
    model, tokenizer = load_model(args.model, device, dtype, seed=args.seed)
    rank_seed = args.seed + 1000 * rank
    sample_gen = torch.Generator(device=device).manual_seed(rank_seed)
    vllm_gen = None
    if args.rollout_backend == "vllm":  # vLLM starts from the initial weights, saved once (before any adapter)
        save_model(model, tokenizer, os.path.join(run_dir, "vllm_init"))
        vllm_gen = VLLMGenerator(os.path.join(run_dir, "vllm_init"), dtype="bfloat16", seed=rank_seed,
                                 max_model_len=args.max_total_tokens,
                                 gpu_memory_utilization=args.vllm_gpu_memory_utilization)
    py_rng = random.Random(rank_seed)

    num_layers = len(model.get_decoder().layers)
    # the top --trainable-layers layers and the final norm, or LoRA adapters on them (every base weight frozen)
    model = train_top_layers(model, args.trainable_layers, args.lora_r, args.lora_alpha, args.gradient_checkpointing)
    # the frozen reference of eq. 12.19; with LoRA, the policy with its adapters switched off (no second copy)
    ref_model = None if args.beta == 0 else model if args.lora_r else \
        load_model(args.model, device, dtype, seed=args.seed)[0].requires_grad_(False)
    if args.world_size > 1:  # start from identical weights on every rank: broadcast, not seeding alone
        for p in (p for m in {id(m): m for m in (model, ref_model) if m is not None}.values() for p in m.parameters()):
            dist.broadcast(p.data, src=0)
    fsdp_layers = shard_layers(model) if args.fsdp else []  # (FSDP replaces the layers' parameters by their shards)
    params = [p for p in model.parameters() if p.requires_grad]

    tracker = Tracker(run_dir, vars(args), enabled=rank == 0, resume_state=resumed and resumed["tracker"])
    print0(f"run {os.path.basename(run_dir)}: {args.model} on {args.env_id}, {args.action_mode} mode, "
           f"{args.batch_size} episodes/iteration")
    # the frozen lower layers' output is computed once, by the rollout, and reused by the trainer (and the
    # reference model, whose lower layers are the same frozen weights)
    frozen_below = num_layers - args.trainable_layers if 0 < args.trainable_layers < num_layers else None
    rollout_config = RolloutConfig(action_mode=args.action_mode, temperature=args.temperature, top_p=args.top_p,
                                   top_k=args.top_k, max_turn_tokens=args.max_turn_tokens,
                                   max_total_tokens=args.max_total_tokens, choice_token_norm=args.choice_token_norm,
                                   mask_illegal_actions=args.mask_illegal_actions)
    if vllm_gen is not None:  # vLLM samples; it computes no activations the trainer could reuse
        frozen_below, engine = None, TokenRolloutEngine(vllm_gen, tokenizer, rollout_config)
    else:  # the policy samples, or a bf16 copy of it (--rollout-dtype)
        engine = RolloutEngine(sampling_copy(model, args.rollout_dtype), tokenizer, rollout_config,
                               record_layer_inputs=frozen_below)

    def push_weights(version: int) -> float:  # the sampler gets the trained weights: seconds it took
        return sync_weights(model, vllm_gen, version) if vllm_gen is not None else refresh_sampling_copy(engine.model, model)

    all_reduce_grads = lambda: average_gradients(params, args.world_size)  # noqa: E731  (torchrun; FSDP's are done)

    # ---- cold start: SFT on format demonstrations (seed 001) ----
    if args.sft_steps > 0 and not resumed:  # a checkpoint's weights already went through it
        demo_env = envs.make(args.env_id)
        sft_cold_start(model, params, lambda: format_demonstrations(engine.chat, demo_env, py_rng, args.sft_batch_size),
                       args.sft_steps, args.sft_learning_rate, args.max_grad_norm, all_reduce_grads, tracker, device)
        push_weights(0)  # the first rollout samples from the cold-started weights (still version 0)

    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=0.0)
    episodes_seen, generated_tokens, first_iteration, start = 0, 0, 1, time.time()
    generators = {"sample": sample_gen, "python": py_rng}
    novelty = NoveltyBonus(args.novelty_coef) if args.novelty_coef > 0 else None  # visit counts are per rank
    memory = SelfImitationMemory(args.sil_episodes) if args.sil_coef > 0 else None  # so is the memory
    if resumed:  # weights, optimizer, every RNG and the counters, as they were after the checkpoint's iteration
        ckpt.restore(resumed, model, optimizer, generators=generators, rank_extra={"novelty": novelty, "memory": memory})
        episodes_seen, generated_tokens = resumed["counters"]["episodes_seen"], resumed["counters"]["generated_tokens"]
        first_iteration = resumed["counters"]["iteration"] + 1
        print0(f"resumed from {run_dir} at iteration {first_iteration - 1} ({episodes_seen} episodes)")
        push_weights(first_iteration - 1)

    def run_eval(iteration: int):
        with gathered(fsdp_layers if args.eval_every > 0 else []), autocast(device):  # FSDP: all gather, rank 0 evaluates
            m = evaluate_episodes(engine, lambda: envs.make(args.env_id), args.env_id, args.eval_episodes, args.seed,
                                  args.eval_temperature, device) if args.eval_every and rank == 0 else {}
        if m:
            tracker.scalars({f"eval/{k}": v for k, v in m.items()}, episodes_seen)
            print0(f"eval @ iter {iteration} | success {m['success_rate']:.2f} | return {m['episodic_return']:.2f}")

    if not resumed:
        run_eval(0)
    interrupt = GracefulInterrupt().start()  # Ctrl-C / SIGTERM: finish this iteration, save a checkpoint, exit
    for iteration in range(first_iteration, args.total_iterations + 1):
        # ---- rollout: G episodes per task, tasks seeded by (seed, rank, iteration, group) ----
        t0 = time.time()
        task_seeds = [(args.seed * 100_000 + iteration) * 1_000 + rank * args.num_groups + g for g in range(args.num_groups)]
        seeds = [s for s in task_seeds for _ in range(args.group_size)]
        with autocast(device), gathered(fsdp_layers):  # FSDP: whole weights, so ranks' rollouts may differ in length
            trajs = engine.run([envs.make(args.env_id) for _ in seeds], seeds, args.env_id, policy_version=iteration - 1,
                               generator=sample_gen)
        rollout_s = time.time() - t0
        episodes_seen += len(trajs) * args.world_size

        # ---- advantages (eq. 12.18) and zero-variance filtering ----
        returns = torch.tensor([t.return_ for t in trajs], dtype=torch.float32).view(args.num_groups, args.group_size)
        advantages, spread = group_advantages(returns, args.adv_eps).flatten(), returns.std(dim=1, unbiased=False)
        if novelty is not None:  # not whitened with the return: a small bonus stays small next to it
            bonus = torch.tensor(novelty(trajs), dtype=torch.float32).view(args.num_groups, args.group_size)
            advantages = advantages + (bonus - bonus.mean(dim=1, keepdim=True)).flatten()
            spread = spread + bonus.std(dim=1, unbiased=False)
        step_adv = step_advantages(trajs, args.group_size, args.step_gamma, args.adv_eps) if args.step_adv_coef else None
        if step_adv is not None:  # GiGPO: a group whose returns tie may still rank its moves
            spread = spread + torch.tensor([max(float(a.abs().sum()) for a in step_adv[g:g + args.group_size])
                                            for g in range(0, len(trajs), args.group_size)])
        zero_var = (spread < 1e-8).repeat_interleave(args.group_size)
        keep = [i for i in range(len(trajs)) if not (args.filter_zero_variance and zero_var[i])]
        train_trajs, train_adv = [trajs[i] for i in keep], advantages[keep].to(device)
        # the frozen trunk's output per episode, and its candidate-scoring inputs (multi-token action names) or None
        trunk_inputs = list(zip(engine.layer_inputs, engine.branch_inputs)) if frozen_below is not None else None
        train_inputs = [trunk_inputs[i] for i in keep] if trunk_inputs is not None else None
        replay = []  # self-imitation: past episodes of a task that beat its group's mean return, weight (R - mean)_+
        if memory is not None:
            for g in range(args.num_groups):
                replay += memory.replay(trajs[g * args.group_size].task_id, float(returns[g].mean()))
            memory.add(trajs, trunk_inputs)
            train_trajs = train_trajs + [t for t, _, _ in replay]
            train_adv = torch.cat([train_adv, args.sil_coef * torch.tensor([w for *_, w in replay], device=device)])
            train_inputs = train_inputs + [x if isinstance(x, tuple) else (x, None) for _, x, _ in replay] \
                if train_inputs is not None else None  # (a bare tensor: a memory saved before branch inputs were kept)
        replayed = torch.arange(len(train_trajs), device=device) >= len(train_trajs) - len(replay)

        # ---- update: clipped surrogate over policy units (eq. 12.19), micro-batched ----
        t1 = time.time()
        stats = {"clip_low": 0.0, "clip_high": 0.0, "ratio_sum": 0.0, "kl_sum": 0.0}
        entropy_sum, policy_loss_sum, mismatch_max, mismatch_sum, ref_s, grad_norm, ratio0_sum, clipped0 = (0.0,) * 8
        num_units = num_seqs = 0
        # torchrun: every rank joins the same all-reduces (zero gradients if its groups were all dropped)
        ranks_with_data = float(bool(train_trajs))
        if args.world_size > 1:
            ranks_with_data = all_reduce_mean({"n": ranks_with_data})["n"] * args.world_size
        if ranks_with_data > 0:
            old_logp, unit_mask = behavior_units(train_trajs, args.action_mode) if train_trajs else (torch.zeros(0, 1),) * 2
            old_logp, unit_mask = old_logp.to(device), unit_mask.to(device)
            if step_adv is not None:  # GiGPO: A = A^E + w A^S per policy unit (replays keep their A^E alone)
                train_adv = train_adv[:, None].repeat(1, unit_mask.shape[1])
                for row, i in enumerate(keep):  # a turn's value on its action (choice) or each of its tokens (free)
                    sizes = [1 if trajs[i].choice_steps else turn.num_action_tokens for turn in trajs[i].turns]
                    units = step_adv[i].repeat_interleave(torch.tensor(sizes, dtype=torch.long))
                    train_adv[row, : len(units)] += args.step_adv_coef * units.to(device)
            # torchrun: global counts / world size, so averaged gradients = one process's on the whole batch
            num_units, num_seqs = global_loss_denominator(unit_mask.sum().item()), len(train_trajs)
            seq_denominator = global_loss_denominator(num_seqs)
            chunks = [range(i, min(i + args.micro_batch_size, num_seqs)) for i in range(0, num_seqs, args.micro_batch_size)]
            if fsdp_layers:  # a sharded layer's forward and backward are collective: every rank runs as many micro-batches
                most = torch.tensor(len(chunks), device=device)
                dist.all_reduce(most, op=dist.ReduceOp.MAX)
                chunks += [None] * (int(most) - len(chunks))  # None: a zero-weight pass over this rank's first episode
            trunk = lambda c: ([train_inputs[i][0] for i in c], frozen_below,  # noqa: E731
                               [train_inputs[i][1] for i in c]) if train_inputs else (None, 0, None)
            ref_logp = torch.zeros_like(old_logp)
            if ref_model is not None:
                tr = time.time()
                with torch.no_grad(), autocast(device, args.update_dtype), adapter_disabled(ref_model) as reference, \
                        gathered(fsdp_layers if reference is model else []):
                    for c in (c for c in chunks if c is not None):
                        ref = policy_logprobs(reference, [train_trajs[i] for i in c], args.action_mode, args.temperature,
                                              args.choice_token_norm, *trunk(c), top_k=args.top_k).logprobs
                        ref_logp[c.start:c.stop, : ref.shape[1]] = ref
                ref_s = time.time() - tr
            model.train()
            for epoch in range(args.update_epochs):
                optimizer.zero_grad(set_to_none=False)
                for c in chunks:
                    if c is None:
                        pad = policy_logprobs(model, trajs[:1], args.action_mode, args.temperature, args.choice_token_norm,
                                              *(([trunk_inputs[0][0]], frozen_below, [trunk_inputs[0][1]])
                                                if train_inputs is not None else (None, 0, None)), top_k=args.top_k)
                        (pad.logprobs.sum() * 0).backward()
                        continue
                    with autocast(device, args.update_dtype):  # bf16 on CUDA, on CPU by flag; the backward runs outside
                        units = policy_logprobs(model, [train_trajs[i] for i in c], args.action_mode, args.temperature,
                                                args.choice_token_norm, *trunk(c), top_k=args.top_k)
                    width = units.logprobs.shape[1]
                    sl = (slice(c.start, c.stop), slice(0, width))
                    if epoch == 0 and replayed[c].any():  # a replayed episode's sampler is long gone: its pi_old is
                        old_logp[sl][replayed[c]] = units.logprobs.detach()[replayed[c]]  # the weights before this update
                    loss, s = grpo_loss(units.logprobs, old_logp[sl], ref_logp[sl], train_adv[c.start:c.stop], unit_mask[sl],
                                        args.clip_eps_low, args.clip_eps_high, args.beta, args.loss_agg, num_units, seq_denominator)
                    loss.backward()
                    if epoch == 0:  # same weights as the sampler: the recorded log-probs must match
                        gap = ((units.logprobs.detach() - old_logp[sl]).abs() * unit_mask[sl])
                        mismatch_max = max(mismatch_max, gap.max().item())
                        mismatch_sum += gap.sum().item()
                        ratio0 = torch.exp(units.logprobs.detach() - old_logp[sl])[unit_mask[sl].bool()]
                        ratio0_sum += ratio0.sum().item()
                        clipped0 += ((ratio0 < 1 - args.clip_eps_low) | (ratio0 > 1 + args.clip_eps_high)).sum().item()
                        entropy_sum += (units.entropy.detach() * unit_mask[sl]).sum().item()
                        policy_loss_sum += loss.item()
                        stats["kl_sum"] += s["kl_sum"]
                    if epoch == args.update_epochs - 1:  # how far the last epoch has moved from the sampler (the clip binds)
                        stats.update({k: stats[k] + s[k] for k in ("clip_low", "clip_high", "ratio_sum")})
                all_reduce_grads()
                grad_norm = clip_grad_norm(params, args.max_grad_norm)
                optimizer.step()
            model.eval()
        sync_s = push_weights(iteration)  # the next rollout samples from the updated weights
        update_s = time.time() - t1

        # ---- logging ----
        ep = episode_metrics(trajs)
        total_tokens = sum(len(t.token_ids) for t in trajs)
        env_s = sum(turn.env_s for t in trajs for turn in t.turns)
        scalars = {
            **{f"charts/{k}": v for k, v in ep.items()},
            "charts/episodic_return_max": max(t.return_ for t in trajs),  # a rare best episode shows here first
            "diagnostics/advantage_std": float(advantages.std(unbiased=False)),
            "diagnostics/step_advantage_nonzero": float(torch.cat(step_adv).ne(0).float().mean()) if step_adv else 0.0,
            "diagnostics/zero_variance_groups": float(zero_var.view(args.num_groups, -1)[:, 0].float().mean()),
            # 0 but for --sil-coef's replays: the policy versions between an episode's sampler and this update
            "diagnostics/policy_lag": float(np.mean([iteration - 1 - t.policy_version for t in train_trajs] or [0])),
            "diagnostics/truncated_turn_rate": float(np.mean([turn.truncated_tokens for t in trajs for turn in t.turns])),
            "perf/rollout_s": rollout_s, "perf/update_s": update_s, "perf/reference_s": ref_s,
            "perf/weight_sync_s": sync_s, "perf/env_s": env_s, "perf/rollout_tokens_per_s": total_tokens / rollout_s,
            "perf/generated_tokens_per_s": sum(t.num_policy_tokens for t in trajs) / rollout_s,
            "perf/iteration_generated_tokens": sum(t.num_policy_tokens for t in trajs),
            "perf/env_steps_per_s": sum(t.num_steps for t in trajs) / rollout_s,
        }
        if num_units:  # an iteration without an update (every group zero-variance) logs no loss, not a placeholder 0
            scalars.update({
                "losses/policy_loss": policy_loss_sum, "losses/kl": stats["kl_sum"] / num_units,
                "losses/entropy": entropy_sum / num_units, "diagnostics/clip_fraction_low": stats["clip_low"] / num_units,
                "diagnostics/clip_fraction_high": stats["clip_high"] / num_units,
                "diagnostics/ratio_mean": stats["ratio_sum"] / num_units, "diagnostics/logprob_mismatch": mismatch_max,
                "diagnostics/logprob_mismatch_mean": mismatch_sum / num_units,
                "diagnostics/first_epoch_ratio_mean": ratio0_sum / num_units,
                "diagnostics/first_epoch_clip_fraction": clipped0 / num_units,  # outside the clip before any step
                "diagnostics/grad_norm": grad_norm})
        if args.world_size > 1:  # every rank applied the same averaged update: their weights must agree exactly
            scalars["diagnostics/rank_param_divergence"] = rank_param_divergence(params)
        if novelty is not None:  # the bonus is not in charts/episodic_return, which stays the environment's alone
            scalars.update({"diagnostics/novelty_bonus": float(bonus.mean()),
                            "diagnostics/distinct_states": len(novelty.counts)})
        if memory is not None:
            scalars.update({"diagnostics/replayed_episodes": len(replay),
                            "diagnostics/memory_best_return": memory.best_return})
        scalars = all_reduce_mean(scalars)
        generated_tokens += round(scalars["perf/iteration_generated_tokens"] * args.world_size)
        scalars["perf/generated_tokens"] = generated_tokens  # cumulative, all ranks: the x-axis of benchmarks/plot.py
        tracker.scalars(scalars, episodes_seen)
        if iteration == 1 or iteration % 10 == 0:
            tracker.trajectories(trajs, episodes_seen)
        print0(f"iter {iteration}/{args.total_iterations} | episodes {episodes_seen} "
               f"| return {scalars['charts/episodic_return']:.2f} "
               f"| success {scalars['charts/success_rate']:.2f} | invalid {scalars['charts/invalid_action_rate']:.2f} "
               f"| loss {scalars.get('losses/policy_loss', float('nan')):+.4f} "
               f"| entropy {scalars.get('losses/entropy', float('nan')):.3f} "
               f"| zero-var {scalars['diagnostics/zero_variance_groups']:.2f} | {rollout_s + update_s:.1f}s "
               f"(rollout {rollout_s:.1f}, update {update_s:.1f}) | {scalars['perf/rollout_tokens_per_s']:.0f} tok/s")
        if args.eval_every > 0 and (iteration % args.eval_every == 0 or iteration == args.total_iterations):
            run_eval(iteration)
        stop = interrupt.should_stop()  # agreed across ranks
        if ckpt.due(iteration, last=iteration == args.total_iterations) or stop:
            ckpt.save({"iteration": iteration, "episodes_seen": episodes_seen, "generated_tokens": generated_tokens},
                      model, optimizer, generators=generators, tracker=tracker,
                      rank_extra={k: v.state_dict() for k, v in (("novelty", novelty), ("memory", memory)) if v is not None})
            print0(f"checkpoint saved in {run_dir} (iteration {iteration})")
        if stop:
            print0(f"interrupted: resume with  python {sys.argv[0]} --resume {run_dir}")
            tracker.close()
            raise SystemExit(130)
    interrupt.stop()

    weights = full_tensors(model.state_dict()) if args.save_model and fsdp_layers else None  # FSDP: collective
    if args.save_model and rank == 0:
        save_model(model, tokenizer, path := os.path.join(run_dir, "model"), weights)  # with LoRA: the adapter only
        print0(f"model saved to {path}")
    print0(f"done in {time.time() - start:.0f}s; logs in {run_dir}")
    tracker.close()
    if args.world_size > 1:
        finish_distributed()  # barrier, destroy the group, exit 0 skipping the interpreter's shutdown (gloo abort)
