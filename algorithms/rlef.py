# docs: docs/rlef.md
"""RLEF: reinforcement learning from execution feedback (Gehring et al. 2024; seed 000 eq. 12.13; seed 001).

The loop of seed 000 ("RLEF：从执行反馈中做 RL"): sample a programming task with hidden unit tests, let
the policy write a function, run the tests in a sandbox, reward r = tests passed / total (eq. 12.13),
update with GRPO/PPO, repeat. The episode is multi-turn, as in RLEF: a failed attempt is answered with
the execution feedback (which tests failed, how) and the policy may submit again, up to
`--max-attempts`. The whole conversation is one record; only the tokens the policy sampled enter the
loss, the feedback tokens (source mask 0) never do (seed 001, the masked policy loss).

Advantages are GRPO's group-relative ones by default (eq. 12.18; a group = G attempts at the same task);
`--advantage ppo` switches to PPO-style multi-epoch clipped updates with a batch-mean baseline. Tasks
follow a curriculum over the environment's three difficulty levels, and groups that carry no signal
(every attempt equally good: all solved or all equally failed, Var[R] = 0) are filtered and their task
replaced by a fresh one (seed 001, solvability filtering). Evaluation reports pass@1 and pass@k with the
unbiased estimator of Chen et al. (2021) on the held-out codegen split and on HumanEval.

Usage:
    python algorithms/rlef.py                                      # smollm2-135m, codegen level 1, GRPO, CPU
    python algorithms/rlef.py --model tiny --total-iterations 2 --max-turn-tokens 8   # seconds, a smoke test
    python algorithms/rlef.py --advantage ppo                      # batch baseline, 4 clipped epochs per batch
    python algorithms/rlef.py --sft-steps 20                       # cold start on reference solutions first
    python algorithms/rlef.py --device cuda --group-size 16 --num-groups 4 --humaneval-tasks 164
    torchrun --nproc_per_node 2 algorithms/rlef.py --model tiny   # data parallel (gloo on CPU, NCCL on GPU)
    torchrun --nproc_per_node 8 algorithms/rlef.py --fsdp --model <path>   # layers sharded over the ranks (FSDP2)
    python algorithms/rlef.py --lora-r 16 --trainable-layers 0     # LoRA adapters on every layer, base frozen
    python algorithms/rlef.py --checkpoint-every 2                 # then, after a crash or Ctrl-C:
    python algorithms/rlef.py --resume runs/<run> [--total-iterations 12]

Timings (decode is ~90% of an iteration on a CPU): docs/rlef.md, Results.

Copying this file out: it needs `common/` and `envs/` (the codegen environment and its sandbox).

Where this departs from the paper / seed:
- RLEF (Gehring et al.) trains with PPO, a learned value head and a KL-penalised turn-level reward; here
  the default is GRPO (seed 000: "GRPO/PPO"), and `--advantage ppo` is a simplified PPO: no value model,
  the baseline is the batch-mean return, the batch std normalises, and the batch is reused for several
  clipped epochs. There is no KL term.
- The reward is the environment's episode return: the last attempt's pass fraction (eq. 12.13, which
  telescopes from the per-attempt `task` components) plus the `format` penalty (-0.1 per attempt without a
  ```python block). Every sampled token of the episode gets the episode's advantage (outcome supervision).
- Solvability filtering drops zero-variance groups (in both advantage modes) and spends at most
  `--resample-budget` extra groups per iteration replacing them; the filtered fraction is logged. An iteration
  left without a group makes no update and logs no loss (`--no-filter-zero-variance` keeps such groups).
- The curriculum moves up a level when the rolling solve rate of training episodes passes a threshold; it
  never moves down. Training tasks come from the `train` split, evaluation from the disjoint `test` split.
- CPU bf16 by flag: `--rollout-dtype bfloat16` (pi_old from a bf16 sampling copy), `--update-dtype bfloat16`.
- pass@k is over one-attempt episodes (`--eval-attempts 1`), as in HumanEval; `eval/pass@1` is the
  unbiased estimate from the same n samples (mean of c/n), not greedy decoding.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import numpy as np
import torch
import torch.distributed as dist
import tyro

import envs
from common.chat import ChatFormat
from common.checkpoint import Checkpointer, GracefulInterrupt, cli_with_resume
from common.distributed import (all_reduce_mean, clip_grad_norm, dist_info, finish_distributed, full_tensors, gathered,
                                global_loss_denominator, init_distributed, is_sharded, print0, seed_everything, shard_layers)
from common.models import (autocast, load_model, refresh_sampling_copy, resolve_device, sampling_copy, save_model,
                           train_top_layers)
from common.records import Trajectory
from common.rollout import RolloutConfig, RolloutEngine, behavior_units, policy_logprobs, sft_cold_start
from common.tracking import Tracker, make_run_name


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of the experiment (model init for `tiny`, sampling, task seeds)"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms, so the same seed gives the same numbers on CPU"""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N` or `auto`"""
    save_model: bool = False
    """save the final policy (Hugging Face format) to `runs/{run_name}/model`"""
    model: str = "smollm2-135m"
    """`tiny` (random, for tests), `smollm2-135m` (embedded default) or a local model path"""
    env_id: str = "codegen"
    """training environment: `codegen` or a `package.module:Factory` taking split / level / max_attempts"""
    output_dir: str = "runs"
    """where run directories are created"""
    checkpoint_every: int = 0
    """save a checkpoint (trained weights, optimizer, RNG states, counters, curriculum) every N iterations and at the end;
    0: never. Ctrl-C (or SIGTERM) always finishes the iteration and saves one before exiting"""
    resume: str = ""
    """a run directory to continue from its checkpoint, with its saved arguments and TensorBoard run"""

    # Algorithm specific arguments
    total_iterations: int = 6
    """number of iterations (rollout + update)"""
    num_groups: int = 1
    """tasks per iteration, per process (after solvability filtering)"""
    group_size: int = 8
    """attempts (episodes) per task: the G of eq. 12.18"""
    max_attempts: int = 2
    """submissions per training episode; after a failed one the policy sees the execution feedback"""
    advantage: Literal["grpo", "ppo"] = "grpo"
    """`grpo`: group-normalised returns (eq. 12.18); `ppo`: batch-mean baseline, several clipped epochs"""
    update_epochs: int | None = None
    """optimisation epochs per batch; default 1 for grpo (on-policy) and 4 for ppo"""
    learning_rate: float = 2e-5
    """AdamW learning rate"""
    trainable_layers: int = 6
    """train only the top N transformer layers and the final norm (0, or at least the layer count: the whole model)"""
    lora_r: int = 0
    """LoRA rank (peft) on the trained layers' attention and MLP projections, base frozen; 0: train the weights"""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / r) B A"""
    gradient_checkpointing: bool = False
    """recompute layer activations in the backward (less memory, ~30% more compute)"""
    fsdp: bool = False
    """torchrun: shard the decoder layers' weights, gradients and AdamW state over the ranks (PyTorch FSDP2); the
    weights are gathered whole for rollouts and evaluation (as in grpo_agent.py; see docs/rlef.md)"""
    micro_batch_size: int = 1
    """episodes per forward/backward (gradient accumulation: the update is the same; 1 pads nothing, see docs item 5)"""
    clip_eps: float = 0.2
    """ratio clip: [1 - eps, 1 + eps]"""
    adv_eps: float = 1e-4
    """epsilon in the advantage denominator (std + eps)"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    temperature: float = 0.8
    """sampling temperature of training rollouts"""
    top_p: float = 1.0
    """nucleus sampling during training rollouts"""
    rollout_dtype: Literal["float32", "bfloat16"] = "float32"
    """the precision the policy samples (and is evaluated) in; `bfloat16`: a bf16 copy of it, refreshed after every
    update (faster decoding on a CPU with AVX512-BF16; pi_old is then the copy's, as in grpo_agent.py)"""
    update_dtype: Literal["float32", "bfloat16"] = "float32"
    """CPU: `bfloat16` runs the update's forward/backward under bf16 autocast (fp32 weights and AdamW)"""
    max_turn_tokens: int = 160
    """cap on generated tokens per attempt (a cut-off code block is unclosed: an invalid attempt)"""
    max_total_tokens: int = 2048
    """cap on an episode's whole token sequence (prompt, attempts and feedback)"""
    level: int = 1
    """difficulty level (1-3) training starts at"""
    curriculum: bool = True
    """move to the next level when the rolling solve rate of training episodes reaches --promote-threshold"""
    promote_threshold: float = 0.5
    """solve rate (episodes that pass every test) over the last --curriculum-window episodes that promotes"""
    curriculum_window: int = 32
    """training episodes in the rolling solve rate (it restarts at each promotion)"""
    resample_budget: int = 2
    """solvability filtering: extra groups per iteration that may replace zero-variance groups (0: only drop them)"""
    filter_zero_variance: bool = True
    """solvability filtering: drop groups whose returns are all equal; off, they stay in the loss with advantage 0"""
    sft_steps: int = 0
    """cold start: SFT steps on reference solutions of training-split tasks (at --level) before RL"""
    sft_batch_size: int = 4
    """demonstrations per SFT step"""
    sft_learning_rate: float = 5e-5
    """learning rate of the cold start"""
    eval_every: int = 0
    """evaluate every N iterations as well; before the first and after the last iteration always (0: only those)"""
    eval_tasks: int = 8
    """held-out codegen tasks (test split) per evaluation; 0 skips it"""
    eval_level: int = 1
    """level of the held-out evaluation tasks (0: levels mixed)"""
    humaneval_tasks: int = 8
    """HumanEval problems (the first N of 164) per evaluation; 0 skips it"""
    eval_samples: int = 4
    """samples per evaluation task: the n of the pass@k estimator"""
    eval_k: int = 4
    """the k of the logged eval/pass@k (at most --eval-samples)"""
    eval_temperature: float = 0.8
    """sampling temperature of evaluation samples"""
    eval_attempts: int = 1
    """submissions per evaluation episode (1: pass@k in HumanEval's sense)"""

    # filled in at runtime
    world_size: tyro.conf.Suppress[int] = 1
    """number of processes (torchrun)"""
    batch_size: tyro.conf.Suppress[int] = 0
    """episodes per iteration over all processes: num_groups * group_size * world_size"""


# the flags --resume lets differ from the saved run (none of them changes what the training samples)
RESUMABLE = {"total_iterations", "checkpoint_every", "eval_every", "eval_tasks", "eval_level", "eval_samples", "eval_k",
             "eval_temperature", "eval_attempts", "humaneval_tasks", "save_model", "resume", "output_dir"}
# read by tests/test_conformance.py: a few-second `--model tiny` run, and the shared tags it writes
SMOKE_TEST_ARGS = ["--total-iterations", "1", "--group-size", "4", "--max-turn-tokens", "8", "--no-filter-zero-variance",
                   "--sft-steps", "1", "--sft-batch-size", "2", "--eval-tasks", "1", "--humaneval-tasks", "1",
                   "--eval-samples", "2", "--eval-k", "2"]
LOGGED_TAGS = ("charts/episodic_return", "charts/success_rate", "charts/episode_length", "charts/invalid_action_rate",
               "charts/pass_fraction", "charts/curriculum_level", "losses/sft_loss", "losses/policy_loss",
               "losses/entropy", "diagnostics/clip_fraction", "diagnostics/ratio_mean", "diagnostics/advantage_std",
               "diagnostics/zero_variance_groups", "diagnostics/logprob_mismatch", "diagnostics/logprob_mismatch_mean",
               "diagnostics/policy_lag", "perf/rollout_s", "perf/decode_s", "perf/sandbox_s", "perf/update_s",
               "perf/iteration_s", "perf/rollout_tokens_per_s", "eval/pass@1", "eval/pass@k", "eval/mean_reward",
               "eval/humaneval_pass@1", "eval/humaneval_pass@k")


def validate_args(args: Args):
    problems = []
    for name in ("total_iterations", "num_groups", "max_attempts", "micro_batch_size", "max_turn_tokens",
                 "curriculum_window", "sft_batch_size", "eval_samples", "eval_k", "eval_attempts"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("checkpoint_every", "lora_r", "resample_budget", "sft_steps", "eval_every", "eval_tasks",
                 "humaneval_tasks", "trainable_layers"):
        if getattr(args, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0")
    if args.group_size < 2:
        problems.append("--group-size must be >= 2: a group of one has no variance to normalise by")
    if args.update_epochs is not None and args.update_epochs < 1:
        problems.append("--update-epochs must be >= 1")
    if args.level not in (1, 2, 3) or args.eval_level not in (0, 1, 2, 3):
        problems.append("--level must be 1, 2 or 3 and --eval-level 0 (mixed), 1, 2 or 3")
    if args.eval_k > args.eval_samples:
        problems.append("--eval-k must be <= --eval-samples (pass@k needs n >= k samples)")
    if args.humaneval_tasks > 164:  # more would wrap around and count problems twice
        problems.append("--humaneval-tasks must be <= 164 (HumanEval has 164 problems)")
    if not 0 <= args.clip_eps < 1 or not 0 <= args.promote_threshold <= 1:
        problems.append("--clip-eps must be in [0, 1) and --promote-threshold in [0, 1]")
    if args.temperature < 0 or args.eval_temperature < 0 or not 0 < args.top_p <= 1:
        problems.append("--temperature / --eval-temperature must be >= 0 and --top-p in (0, 1]")
    if args.fsdp and args.rollout_dtype != "float32":
        problems.append("--rollout-dtype bfloat16 is a copy of whole weights: not with --fsdp")
    if args.fsdp and dist_info()[2] < 2:
        problems.append("--fsdp shards over torchrun processes: run it with torchrun --nproc_per_node N (N >= 2)")
    if problems:
        raise SystemExit("rlef.py: " + "; ".join(problems))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. (2021): 1 - C(n-c, k) / C(n, k), from n samples of which c pass."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def advantages(returns: torch.Tensor, mode: str, eps: float) -> torch.Tensor:
    """Per-episode advantages. returns: [num_groups, G].

    grpo (eq. 12.18): A_i = (r_i - mean_group(r)) / (std_group(r) + eps), population std within each group.
    ppo: A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps): one baseline for the whole batch (no critic).
    """
    dims = (1,) if mode == "grpo" else (0, 1)
    mean, std = returns.mean(dim=dims, keepdim=True), returns.std(dim=dims, keepdim=True, unbiased=False)
    return (returns - mean) / (std + eps)


def clipped_loss(logp, old_logp, adv, unit_mask, clip_eps, num_units):
    """PPO/GRPO clipped surrogate (eq. 12.19 with beta = 0) over policy tokens, token-mean, to minimise.

    logp / old_logp / unit_mask: [B, U] (policy tokens only: feedback tokens are not units); adv: [B].
    `num_units` counts the whole batch's tokens, so micro-batches accumulate to the full-batch loss.
    """
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    surrogate = torch.min(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a)
    loss = -(surrogate * unit_mask).sum() / max(num_units, 1e-8)
    with torch.no_grad():
        m = unit_mask.bool()
        stats = {"clipped": ((ratio - 1).abs() > clip_eps)[m].float().sum().item(), "ratio_sum": ratio[m].sum().item()}
    return loss, stats


def update_policy(model, optimizer, params, trajs, adv, args, layer_inputs=None, from_layer=None, reduce_grads=None,
                  pad=None):
    """`args.update_epochs` epochs of the clipped surrogate over `trajs` (advantages `adv`, one per episode).

    pi_old is the behaviour log-prob recorded by the sampler (no extra forward). With frozen lower layers,
    `layer_inputs` (recorded at layer `from_layer` by the rollout) let the trainer start there. Under FSDP a
    sharded layer's forward and backward are collective, so every rank runs as many micro-batches as the
    busiest one: `pad` = (an episode, its layer input) for zero-weight passes.
    Returns first-epoch statistics (loss, entropy, sampler/trainer log-prob gap) and last-epoch clipping.
    """
    device = adv.device
    old_logp, unit_mask = behavior_units(trajs, "free") if trajs else (torch.zeros(0, 1),) * 2
    old_logp, unit_mask = old_logp.to(device), unit_mask.to(device)
    num_seqs = len(trajs)
    num_units = global_loss_denominator(unit_mask.sum().item())  # torchrun: averaged grads = the whole batch's mean
    chunks = [range(i, min(i + args.micro_batch_size, num_seqs)) for i in range(0, num_seqs, args.micro_batch_size)]
    if pad is not None:
        most = torch.tensor(len(chunks), device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        chunks += [None] * (int(most) - len(chunks))  # None: a zero-weight pass over `pad`
    stats = dict.fromkeys(("clipped", "ratio_sum", "entropy_sum", "policy_loss", "mismatch", "gap_sum", "grad_norm"), 0.0)
    stats["num_units"] = num_units
    model.train()
    for epoch in range(args.update_epochs):
        optimizer.zero_grad(set_to_none=False)
        for c in chunks:
            if c is None:
                with autocast(device, args.update_dtype):
                    units = policy_logprobs(model, [pad[0]], "free", args.temperature, False,
                                            *(([pad[1]], from_layer) if pad[1] is not None else (None, 0)))
                (units.logprobs.sum() * 0).backward()
                continue
            trunk = ([layer_inputs[i] for i in c], from_layer) if layer_inputs else (None, 0)
            with autocast(device, args.update_dtype):  # bf16 on CUDA, on CPU by flag; the backward runs outside
                units = policy_logprobs(model, [trajs[i] for i in c], "free", args.temperature, False, *trunk)
            sl = (slice(c.start, c.stop), slice(0, units.logprobs.shape[1]))
            loss, s = clipped_loss(units.logprobs, old_logp[sl], adv[c.start:c.stop], unit_mask[sl], args.clip_eps, num_units)
            loss.backward()
            if epoch == 0:  # the sampler's weights: equal log-probs in fp32, bf16 rounding with the bf16 flags
                gap = (units.logprobs.detach() - old_logp[sl]).abs() * unit_mask[sl]
                stats["mismatch"] = max(stats["mismatch"], gap.max().item())
                stats["gap_sum"] += gap.sum().item()  # / units: diagnostics/logprob_mismatch_mean
                stats["entropy_sum"] += (units.entropy.detach() * unit_mask[sl]).sum().item()
                stats["policy_loss"] += loss.item()
            if epoch == args.update_epochs - 1:  # how far the last epoch has moved from the sampler
                stats["clipped"] += s["clipped"]
                stats["ratio_sum"] += s["ratio_sum"]
        if reduce_grads is not None:
            reduce_grads()
        stats["grad_norm"] = clip_grad_norm(params, args.max_grad_norm)  # FSDP: the norm over every rank's slices
        optimizer.step()
    model.eval()
    return stats


def reference_demonstration(chat: ChatFormat, env, seed: int) -> Trajectory:
    """Cold-start example: the task's prompt and its reference solution in a ```python block, one attempt
    (not run in the sandbox: the reference passes by construction)."""
    prompt = chat.prompt_ids(env.system_prompt, env.reset(seed=seed)[0])
    answer = chat.encode(f"```python\n{env.task.reference}```") + [chat.eos_id]
    return Trajectory(token_ids=prompt + answer, source_mask=[0] * len(prompt) + [1] * len(answer),
                      behavior_logprobs=[0.0] * (len(prompt) + len(answer)), policy_version=0, turns=[], rewards={},
                      return_=1.0, termination="success", env_version=env.env_version, task_id=env.task_id, seed=seed)


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    steps = sum(t.num_steps for t in trajs)
    return {
        "episodic_return": float(np.mean([t.return_ for t in trajs])),
        "success_rate": float(np.mean([t.success for t in trajs])),
        "episode_length": float(np.mean([t.num_steps for t in trajs])),
        "invalid_action_rate": sum(t.invalid_actions for t in trajs) / max(steps, 1),
        "pass_fraction": float(np.mean([t.rewards.get("task", 0.0) for t in trajs])),  # eq. 12.13, last attempt
    }


def evaluate(engine: RolloutEngine, make_env, num_tasks: int, n: int, k: int, temperature: float, seed_base: int):
    """n samples per task at `temperature`; pass@1 and pass@k averaged over tasks (Chen et al. 2021)."""
    sampling = engine.config
    engine.config = RolloutConfig(**{**vars(sampling), "temperature": temperature})
    seeds = [seed_base + task for task in range(num_tasks) for _ in range(n)]
    with autocast(dev := engine.model.device):  # an RNG of its own, on the sampling device (cuda: a CPU one fails)
        trajs = engine.run([make_env() for _ in seeds], seeds, "eval", generator=torch.Generator(dev).manual_seed(seed_base))
    engine.config = sampling
    solved = np.array([t.success for t in trajs]).reshape(num_tasks, n).sum(1)
    return {"pass@1": float(np.mean([pass_at_k(n, int(c), 1) for c in solved])),
            "pass@k": float(np.mean([pass_at_k(n, int(c), k) for c in solved])),
            "mean_reward": float(np.mean([t.rewards.get("task", 0.0) for t in trajs]))}


if __name__ == "__main__":
    args = cli_with_resume(Args, RESUMABLE, "rlef.py")
    validate_args(args)
    device = resolve_device(args.device)
    rank, _, args.world_size = init_distributed(device)
    args.batch_size = args.num_groups * args.group_size * args.world_size
    if args.update_epochs is None:
        args.update_epochs = 1 if args.advantage == "grpo" else 4
    run_dir = args.resume or os.path.join(args.output_dir, make_run_name(args.env_id, args.exp_name, args.seed))
    ckpt = Checkpointer(run_dir, args.checkpoint_every, rank, args.world_size)
    resumed = ckpt.read() if args.resume else None  # a bad checkpoint fails here, before loading a model
    if resumed and args.total_iterations < resumed["counters"]["iteration"]:
        raise SystemExit(f"--total-iterations {args.total_iterations}: the checkpoint is at iteration "
                         f"{resumed['counters']['iteration']} already")
    make_train_env = lambda level: envs.make(args.env_id, split="train", level=level, max_attempts=args.max_attempts)
    try:
        make_train_env(args.level)  # fail fast on a bad --env-id, before loading a model
        if args.humaneval_tasks:
            envs.make("codegen-humaneval")
    except (ValueError, TypeError, ModuleNotFoundError) as e:
        raise SystemExit(f"--env-id: {e}")

    seed_everything(args.seed, args.torch_deterministic)
    dtype = torch.float32 if args.lora_r == 0 else None  # trained weights in fp32 (bf16 rounds a 1e-5 step away)
    model, tokenizer = load_model(args.model, device, dtype, seed=args.seed)
    rank_seed = args.seed + 1000 * rank
    sample_gen = torch.Generator(device=device).manual_seed(rank_seed)
    py_rng = random.Random(rank_seed)

    num_layers = len(model.get_decoder().layers)
    # the top --trainable-layers layers and the final norm, or LoRA adapters on them (every base weight frozen)
    model = train_top_layers(model, args.trainable_layers, args.lora_r, args.lora_alpha, args.gradient_checkpointing)
    if args.world_size > 1:  # start from identical weights on every rank
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    fsdp_layers = shard_layers(model) if args.fsdp else []  # (FSDP replaces the layers' parameters by their shards)
    params = [p for p in model.parameters() if p.requires_grad]

    tracker = Tracker(run_dir, vars(args), enabled=rank == 0, resume_state=resumed and resumed["tracker"])
    print0(f"run {os.path.basename(run_dir)}: {args.model} on {args.env_id}, {args.advantage}, {args.batch_size} episodes/iteration")
    # the frozen lower layers' output is computed once, by the rollout, and reused by the trainer
    frozen_below = num_layers - args.trainable_layers if 0 < args.trainable_layers < num_layers else None
    engine = RolloutEngine(sampling_copy(model, args.rollout_dtype), tokenizer, RolloutConfig(  # or a bf16 copy
        action_mode="free", temperature=args.temperature, top_p=args.top_p, max_turn_tokens=args.max_turn_tokens,
        max_total_tokens=args.max_total_tokens), record_layer_inputs=frozen_below)

    def all_reduce_grads():  # FSDP has already reduced the sharded layers' gradients (a reduce-scatter in the backward)
        if args.world_size > 1:
            for p in (p for p in params if not is_sharded(p)):
                if p.grad is None:  # this rank had nothing to train on: it still joins the all-reduce
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= args.world_size

    # ---- cold start: SFT on reference solutions of training tasks (never the test split) ----
    if args.sft_steps > 0 and not resumed:  # a checkpoint's weights already went through it
        demo_env = make_train_env(args.level)
        sft_cold_start(model, params, lambda: [reference_demonstration(engine.chat, demo_env, py_rng.randrange(1 << 30))
                                               for _ in range(args.sft_batch_size)],
                       args.sft_steps, args.sft_learning_rate, args.max_grad_norm, all_reduce_grads, tracker, device, 5)
        refresh_sampling_copy(engine.model, model)  # the first rollout samples from the cold-started weights

    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=0.0)
    episodes_seen, task_counter, level, first_iteration, start = 0, 0, args.level, 1, time.time()
    solved_window: deque[float] = deque(maxlen=args.curriculum_window)
    generators = {"sample": sample_gen, "python": py_rng}
    if resumed:  # weights, optimizer, every RNG, the counters and the curriculum, as after the checkpoint's iteration
        ckpt.restore(resumed, model, optimizer, generators=generators)
        mine = resumed["rank_extra"][rank] if "rank_extra" in resumed else {**resumed["counters"], **resumed["extra"]}
        episodes_seen, task_counter = resumed["counters"]["episodes_seen"], mine["task_counter"]  # ranks resample apart
        first_iteration, level = resumed["counters"]["iteration"] + 1, resumed["extra"]["level"]
        solved_window = deque(mine["solved_window"], maxlen=args.curriculum_window)
        print0(f"resumed from {run_dir} at iteration {first_iteration - 1} ({episodes_seen} episodes, level {level})")
        refresh_sampling_copy(engine.model, model)  # a bf16 sampler gets the restored weights

    def run_eval(iteration: int):
        with gathered(fsdp_layers):  # FSDP: every rank gathers the whole weights (collective), rank 0 evaluates
            if rank == 0:
                evaluate_and_log(iteration)

    def evaluate_and_log(iteration: int):
        t0, metrics, eval_level = time.time(), {}, args.eval_level or None
        if args.eval_tasks:
            m = evaluate(engine, lambda: envs.make("codegen", split="test", level=eval_level, max_attempts=args.eval_attempts),
                         args.eval_tasks, args.eval_samples, args.eval_k, args.eval_temperature, 1 << 40)
            metrics.update({f"eval/{k}": v for k, v in m.items()})
        if args.humaneval_tasks:
            m = evaluate(engine, lambda: envs.make("codegen-humaneval", max_attempts=args.eval_attempts),
                         args.humaneval_tasks, args.eval_samples, args.eval_k, args.eval_temperature, 0)
            metrics.update({f"eval/humaneval_{k}": v for k, v in m.items()})
        metrics["perf/eval_s"] = time.time() - t0
        tracker.scalars(metrics, episodes_seen)
        print0(f"eval @ iter {iteration} | " + " | ".join(f"{k[5:]} {v:.3f}" for k, v in metrics.items()
                                                          if k.startswith("eval/")) + f" | {metrics['perf/eval_s']:.0f}s")

    if not resumed:
        run_eval(0)
    interrupt = GracefulInterrupt().start()  # Ctrl-C / SIGTERM: finish this iteration, save a checkpoint, exit
    for iteration in range(first_iteration, args.total_iterations + 1):
        # ---- rollout with solvability filtering: G attempts per task; a group whose returns have zero
        # variance (all solved, or all equally failed) is dropped and, budget permitting, its task replaced ----
        t0 = time.time()
        kept, kept_inputs, all_trajs, budget = [], [], [], args.resample_budget
        filtered_solved = filtered_unsolved = groups_sampled = sandbox_errors = 0
        wanted = args.num_groups
        # FSDP: whole weights (rollouts differ in length), gathered once: ranks resample different numbers of times
        with autocast(device), gathered(fsdp_layers):
            while wanted > 0:
                # task seeds are unique per (seed, rank, draw): never the eval seeds
                task_seeds = [(args.seed * 1000 + rank) * 1_000_000 + task_counter + j for j in range(wanted)]
                task_counter += wanted
                seeds = [s for s in task_seeds for _ in range(args.group_size)]
                trajs = engine.run([make_train_env(level) for _ in seeds], seeds, args.env_id,
                                   policy_version=iteration - 1, generator=sample_gen)
                all_trajs += trajs
                groups_sampled += wanted
                for g in range(wanted):
                    group = trajs[g * args.group_size:(g + 1) * args.group_size]
                    if any(t.termination == "error" for t in group):  # the sandbox failed, not the agent: drop it
                        sandbox_errors += 1
                        continue
                    if np.std([t.return_ for t in group]) < 1e-8:
                        filtered_solved += all(t.success for t in group)
                        filtered_unsolved += not all(t.success for t in group)
                        if args.filter_zero_variance:
                            continue
                    kept.append(group)
                    if frozen_below is not None:
                        kept_inputs.append(engine.layer_inputs[g * args.group_size:(g + 1) * args.group_size])
                wanted = min(args.num_groups - len(kept), budget)
                budget -= wanted
        rollout_s = time.time() - t0
        sandbox_s = sum(turn.env_s for t in all_trajs for turn in t.turns)  # envs are stepped one after another
        episodes_seen += len(all_trajs) * args.world_size

        # ---- curriculum: promote when the rolling solve rate at this level reaches the threshold ----
        solved_window.extend(float(t.success) for t in all_trajs)
        promoted = (args.curriculum and level < 3 and len(solved_window) == solved_window.maxlen
                    and np.mean(solved_window) >= args.promote_threshold)
        if args.world_size > 1:  # one level for all ranks: promote when most ranks would
            promoted = all_reduce_mean({"p": float(promoted)})["p"] >= 0.5

        # ---- advantages: group-normalised (grpo, eq. 12.18) or batch baseline (ppo) ----
        train_trajs = [t for group in kept for t in group]
        train_inputs = [x for group in kept_inputs for x in group] if frozen_below is not None else None
        train_adv = torch.zeros(0, device=device)
        if kept:
            returns = torch.tensor([[t.return_ for t in group] for group in kept], dtype=torch.float32)
            train_adv = advantages(returns, args.advantage, args.adv_eps).flatten().to(device)

        # ---- update: clipped surrogate over the policy's own tokens, micro-batched ----
        t1 = time.time()
        ranks_with_data = float(bool(train_trajs))
        if args.world_size > 1:  # under torchrun every rank joins the same all-reduces, even with nothing to train
            ranks_with_data = all_reduce_mean({"n": ranks_with_data})["n"] * args.world_size
        stats = {"num_units": 0.0}  # no update anywhere: nothing else of it is logged
        if ranks_with_data > 0:
            pad = (trajs[0], engine.layer_inputs[0] if frozen_below is not None else None) if fsdp_layers else None
            stats = update_policy(model, optimizer, params, train_trajs, train_adv, args, train_inputs, frozen_below,
                                  all_reduce_grads, pad)
        update_s = time.time() - t1
        sync_s = refresh_sampling_copy(engine.model, model)  # --rollout-dtype bfloat16: the next rollout's weights

        # ---- logging ----
        ep = episode_metrics(all_trajs)
        scalars = {
            **{f"charts/{k}": v for k, v in ep.items()}, "charts/curriculum_level": float(level),
            "diagnostics/advantage_std": float(train_adv.std(unbiased=False)) if len(train_adv) else 0.0,
            "diagnostics/zero_variance_groups": (filtered_solved + filtered_unsolved) / groups_sampled,
            "diagnostics/filtered_solved_groups": filtered_solved / groups_sampled,
            "diagnostics/filtered_unsolved_groups": filtered_unsolved / groups_sampled,
            "diagnostics/kept_groups": float(len(kept)), "diagnostics/sandbox_error_groups": sandbox_errors / groups_sampled,
            "diagnostics/policy_lag": 0.0,  # synchronous: every episode was sampled by the weights being updated
            "diagnostics/truncated_turn_rate": float(np.mean([turn.truncated_tokens for t in all_trajs for turn in t.turns])),
            "perf/rollout_s": rollout_s,
            "perf/decode_s": rollout_s - sandbox_s,  # prefill + sampling (the engine's forward passes)
            "perf/sandbox_s": sandbox_s, "perf/update_s": update_s, "perf/weight_sync_s": sync_s,
            "perf/iteration_s": rollout_s + update_s,
            "perf/rollout_tokens_per_s": sum(len(t.token_ids) for t in all_trajs) / rollout_s,
            "perf/generated_tokens_per_s": sum(t.num_policy_tokens for t in all_trajs) / rollout_s,
        }
        if num_units := stats["num_units"]:  # global count: an iteration without an update logs no loss, not a 0
            scalars.update({"losses/policy_loss": stats["policy_loss"], "losses/entropy": stats["entropy_sum"] / num_units,
                            "diagnostics/clip_fraction": stats["clipped"] / num_units,
                            "diagnostics/ratio_mean": stats["ratio_sum"] / num_units,
                            "diagnostics/logprob_mismatch": stats["mismatch"], "diagnostics/grad_norm": stats["grad_norm"],
                            "diagnostics/logprob_mismatch_mean": stats["gap_sum"] / num_units})
        scalars = all_reduce_mean(scalars)
        tracker.scalars(scalars, episodes_seen)
        if iteration == 1 or iteration % 10 == 0:
            tracker.trajectories(all_trajs, episodes_seen)
        print0(f"iter {iteration}/{args.total_iterations} | level {level} | episodes {episodes_seen} | pass "
               f"{scalars['charts/pass_fraction']:.2f} | solved {scalars['charts/success_rate']:.2f} | invalid "
               f"{scalars['charts/invalid_action_rate']:.2f} | zero-var {scalars['diagnostics/zero_variance_groups']:.2f} "
               f"| loss {scalars.get('losses/policy_loss', float('nan')):+.4f} | {rollout_s + update_s:.1f}s "
               f"(decode {rollout_s - sandbox_s:.1f}, sandbox {sandbox_s:.1f}, update {update_s:.1f})")
        if promoted:
            level += 1
            solved_window.clear()
            print0(f"curriculum: solve rate reached {args.promote_threshold}, moving to level {level}")
        if args.eval_every > 0 and iteration % args.eval_every == 0 and iteration != args.total_iterations:
            run_eval(iteration)
        stop = interrupt.should_stop()  # agreed across ranks
        if ckpt.due(iteration, last=iteration == args.total_iterations) or stop:
            ckpt.save({"iteration": iteration, "episodes_seen": episodes_seen}, model, optimizer, generators=generators,
                      tracker=tracker, extra={"level": level},
                      rank_extra={"task_counter": task_counter, "solved_window": list(solved_window)})
            print0(f"checkpoint saved in {run_dir} (iteration {iteration})")
        if stop:
            print0(f"interrupted: resume with  python {sys.argv[0]} --resume {run_dir}")
            tracker.close()
            raise SystemExit(130)
    interrupt.stop()
    run_eval(args.total_iterations)

    weights = full_tensors(model.state_dict()) if args.save_model and fsdp_layers else None  # FSDP: collective
    if args.save_model and rank == 0:
        save_model(model, tokenizer, path := os.path.join(run_dir, "model"), weights)  # with LoRA: the adapter only
        print0(f"model saved to {path}")
    print0(f"done in {time.time() - start:.0f}s; logs in {run_dir}")
    tracker.close()
    if args.world_size > 1:
        finish_distributed()  # barrier, destroy the group, exit 0 skipping the interpreter's shutdown (gloo abort)
