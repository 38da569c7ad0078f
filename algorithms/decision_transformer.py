# docs: docs/decision_transformer.md
"""Decision Transformer for LLM agents (Chen et al. 2021, "Decision Transformer: Reinforcement Learning via
Sequence Modeling"; seed 003 offline RL).

Offline RL as conditional sequence modelling: a trajectory is written as the sequence
(R̂_1, s_1, a_1, R̂_2, s_2, a_2, ...) where the return-to-go R̂_t = Σ_{t'≥t} r_{t'} (DT eq. 1) is the
reward still to be collected from step t on. A causal LM is trained to predict each action given the last
K steps (return-to-go, state, action) before it, with cross-entropy on the action tokens only (the source
mask m_j of seed 001: return-to-go, observation and separator tokens are context, mask 0):

    L(θ) = − Σ_j m_j log π_θ(x_j | x_<j) / Σ_j m_j.

At evaluation the first return-to-go is a target R* chosen by the user and each reward received is
subtracted from it (R̂_{t+1} = R̂_t − r_t), so asking for a higher return should produce a better episode;
the script sweeps R* and logs the achieved return per target to show that it does.

Here the "tokens" of the paper are text: each step is written as
    "return-to-go: 3.45\\n<observation>\\naction: " + <action name> + "\\n"
in plain text (no chat template), and the action is chosen by scoring every name in env.action_names
(argmax of the joint log-prob of its tokens, one batched forward over a KV cache), so it is always valid.

Under torchrun every rank draws the same global minibatch of `--minibatch-size` windows (same seed) and trains
on a disjoint 1/world slice of it; the loss divides by the global action-token count / world and the gradients
are averaged over ranks, so N processes make the updates of one. Evaluation (and the sweep) runs on rank 0 only.

Usage:
    python algorithms/decision_transformer.py                                # smollm2-135m, GridWorld, suboptimal data, CPU
                                                                             # (46-55 s per update on the shared 2-core CPU; see docs)
    python algorithms/decision_transformer.py --model tiny --train-steps 20  # seconds, a smoke test
    python benchmarks/collect_offline.py --env-id gridworld --quality suboptimal --episodes 500 --seed 0 \\
        --output datasets/gridworld_suboptimal.jsonl
    python algorithms/decision_transformer.py --dataset datasets/gridworld_suboptimal.jsonl
    python algorithms/decision_transformer.py --trainable-layers 0           # train the whole model
    python algorithms/decision_transformer.py --device cuda                  # one GPU
    torchrun --nproc_per_node 2 algorithms/decision_transformer.py --model tiny --train-steps 20  # data parallel
    torchrun --nproc_per_node 8 algorithms/decision_transformer.py --fsdp --model <path>  # layers sharded (FSDP2)
    python algorithms/decision_transformer.py --lora-r 8 --save-model       # LoRA adapters; saves the adapter only
    python algorithms/decision_transformer.py --checkpoint-every 50          # then, after a crash or Ctrl-C:
    python algorithms/decision_transformer.py --resume runs/<run> [--train-steps 400]

Copying this file out: it needs `common/` (models, records, rollout, tracking, distributed, offline, checkpoint) and
`envs/` for the built-in environments (or any `package.module:Factory` with `action_names` as --env-id).

Where this departs from the paper / seed:
- One sequence per window of the last K steps, each step rendered as text; the LM's own positional encoding
  replaces DT's timestep embedding (the GridWorld observation carries "Step t/20" anyway).
- Returns-to-go are written as decimal text, divided by `--rtg-scale` and rounded to `--rtg-decimals`
  (the paper feeds a scaled scalar through a linear embedding).
- Actions are discrete names scored in choice mode (argmax), not regressed or sampled.
- The LM head is applied only where an action token is predicted (the loss is the same; a test holds it).
- The return-to-go is text, not a separate embedding: every trained weight is in the LM, so a checkpoint
  (`--checkpoint-every`, `--resume`) and `--save-model` (the adapter only with `--lora-r`) hold just the LM's.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro

import envs
from common.checkpoint import Checkpointer, GracefulInterrupt, cli_with_resume
from common.distributed import (all_reduce_mean, clip_grad_norm, dist_info, finish_distributed, full_tensors, gathered,
                                global_loss_denominator, init_distributed, is_sharded, print0, rank_param_divergence,
                                seed_everything, shard_layers)
from common.models import autocast, load_model, resolve_device, save_model, train_top_layers
from common.records import Trajectory
from common.rollout import score_candidates
from common.tracking import Tracker, make_run_name


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of the experiment (model init for `tiny`, window sampling, evaluation seeds)"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms, so the same seed gives the same numbers on CPU"""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N` or `auto`"""
    save_model: bool = False
    """save the final model (Hugging Face format; with --lora-r the adapter only) to `runs/{run_name}/model`"""
    model: str = "smollm2-135m"
    """`tiny` (random, for tests), `smollm2-135m` (embedded default) or a local model path"""
    env_id: str = "gridworld"
    """environment id (needs `action_names`: `gridworld`, `gridworld-procedural`, `frozenlake`, ...) or `package.module:Factory`"""
    output_dir: str = "runs"
    """where run directories are created"""
    checkpoint_every: int = 0
    """save a checkpoint (trained weights, optimizer, RNG states, step) every N training steps and at the end; 0: never.
    Ctrl-C (or SIGTERM) always finishes the step and saves one before exiting"""
    resume: str = ""
    """a run directory to continue from its checkpoint, with its saved arguments and TensorBoard run"""

    # Algorithm specific arguments
    dataset: str = ""
    """offline dataset (JSONL from benchmarks/collect_offline.py / common.offline.write_dataset); empty: collect one in-process"""
    dataset_quality: Literal["expert", "suboptimal", "noisy"] = "suboptimal"
    """when --dataset is empty: the behaviour policy of the collected data (see common/offline.py)"""
    dataset_episodes: int = 300
    """when --dataset is empty: episodes to collect"""
    dataset_epsilon: float = 0.5
    """when --dataset is empty: probability of a random action in `suboptimal` data (0.5: about half the episodes fail, a wide spread of returns to condition on)"""
    context_len: int = 2
    """K: the last K steps (return-to-go, observation, action) in each sequence, in training and at inference"""
    train_steps: int = 200
    """gradient steps"""
    minibatch_size: int = 8
    """windows per gradient step, over all processes (torchrun: each rank takes minibatch_size / world_size of them)"""
    learning_rate: float = 1e-4
    """AdamW learning rate"""
    weight_decay: float = 1e-4
    """AdamW weight decay (the paper uses 1e-4)"""
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
    weights are gathered whole for evaluation (as in grpo_agent.py)"""
    max_grad_norm: float = 0.25
    """gradient clipping (the paper uses 0.25)"""
    rtg_scale: float = 1.0
    """returns-to-go are divided by this before being written as text"""
    rtg_decimals: int = 2
    """decimals of the return-to-go text"""
    target_return: float | None = None
    """R*: the return-to-go the periodic evaluation conditions on (default: the dataset's best return)"""
    sweep_targets: tuple[float, ...] = ()
    """R* values of the final sweep (default: `--sweep-points` values evenly spaced from the dataset's worst to best return)"""
    sweep_points: int = 5
    """number of R* values in the default sweep"""
    eval_every: int = 50
    """evaluate at R* = --target-return every N steps (and before the first and after the last); 0: only the final sweep"""
    eval_episodes: int = 1
    """episodes per R* value (the seed-003 GridWorld and a greedy policy are deterministic: one is exact there; raise it for gridworld-procedural or stochastic environments)"""

    # filled in at runtime
    dataset_steps: tyro.conf.Suppress[int] = 0
    """training windows (= steps) in the dataset"""
    world_size: tyro.conf.Suppress[int] = 1
    """number of processes (torchrun)"""


# read by tests/test_conformance.py: a few-second `--model tiny` run, and the shared tags it writes
SMOKE_TEST_ARGS = ["--dataset-episodes", "4", "--dataset-quality", "suboptimal", "--train-steps", "2",
                   "--minibatch-size", "2", "--context-len", "2", "--eval-every", "0", "--eval-episodes", "1",
                   "--sweep-points", "2"]
LOGGED_TAGS = ("losses/action_loss", "diagnostics/action_token_accuracy", "diagnostics/grad_norm",
               "diagnostics/dataset_mean_return", "diagnostics/dataset_success_rate", "perf/train_tokens_per_s",
               "perf/update_s", "perf/eval_s", "eval/episodic_return", "eval/success_rate", "eval/episode_length",
               "eval/rtg_sweep_target", "eval/rtg_sweep_return", "eval/rtg_correlation")
# the flags --resume lets differ from the saved run (none of them changes what the training samples)
RESUMABLE = {"train_steps", "checkpoint_every", "eval_every", "eval_episodes", "save_model", "resume", "output_dir"}


def validate_args(args: Args):
    problems = []
    for name in ("dataset_episodes", "context_len", "train_steps", "minibatch_size", "eval_episodes", "sweep_points"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.eval_every < 0 or args.trainable_layers < 0 or args.rtg_decimals < 0:
        problems.append("--eval-every, --trainable-layers and --rtg-decimals must be >= 0")
    if args.checkpoint_every < 0:
        problems.append("--checkpoint-every must be >= 0 (0: no periodic checkpoints)")
    if args.lora_r < 0:
        problems.append("--lora-r must be >= 0 (0: no LoRA)")
    if args.rtg_scale <= 0:
        problems.append("--rtg-scale must be > 0")
    if not 0 <= args.dataset_epsilon <= 1:
        problems.append("--dataset-epsilon must be in [0, 1]")
    if args.dataset and not os.path.isfile(args.dataset):
        problems.append(f"--dataset {args.dataset!r} is not a file")
    if args.minibatch_size % dist_info()[2]:  # torchrun: equal slices of the global minibatch
        problems.append(f"--minibatch-size {args.minibatch_size} must be divisible by the {dist_info()[2]} processes")
    if args.fsdp and dist_info()[2] < 2:
        problems.append("--fsdp shards over torchrun processes: run it with torchrun --nproc_per_node N (N >= 2)")
    if problems:
        raise SystemExit("decision_transformer.py: " + "; ".join(problems))


# ---- the sequence: returns-to-go, text format, masks ------------------------------------------------------
def returns_to_go(rewards: list[float]) -> list[float]:
    """DT eq. 1: R̂_t = Σ_{t'=t}^{T} r_{t'}, computed backwards (R̂_T = r_T, R̂_t = r_t + R̂_{t+1})."""
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running += rewards[t]
        out[t] = running
    return out


def format_rtg(value: float, scale: float, decimals: int) -> str:
    """The return-to-go as text: value / scale, rounded; `+ 0.0` turns -0.00 into 0.00."""
    return f"{round(value / scale, decimals) + 0.0:.{decimals}f}"


def episode_steps(traj: Trajectory) -> tuple[list[str], list[str], list[float]]:
    """(observations s_1..s_T, action names a_1..a_T, rewards r_1..r_T) of a collected trajectory.

    common.offline records `turns[k].observation` as the observation *after* action k, and the reset
    observation in `extra["initial_observation"]`, so s_1 = initial and s_{k+1} = turns[k].observation.
    """
    observations = [traj.extra["initial_observation"]] + [t.observation for t in traj.turns[:-1]]
    return observations, [t.action_text for t in traj.turns], [t.reward for t in traj.turns]


class StepFormat:
    """Token ids of one step: "return-to-go: R\\n" + observation + "\\naction: " (context), the action name
    (policy tokens), "\\n" (context). Pieces are encoded separately and concatenated, in training and at
    inference alike, so the ids the model is trained on are exactly the ids it later scores."""

    def __init__(self, tokenizer, rtg_scale: float = 1.0, rtg_decimals: int = 2):
        self.tok, self.scale, self.decimals = tokenizer, rtg_scale, rtg_decimals
        self.newline = self.encode("\n")

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def context(self, rtg: float, observation: str) -> list[int]:
        return self.encode(f"return-to-go: {format_rtg(rtg, self.scale, self.decimals)}\n{observation}\naction: ")

    def window(self, steps: list[tuple[float, str, str]]) -> tuple[list[int], list[int]]:
        """(ids, mask) of the steps (rtg, observation, action name); mask 1 exactly on action-name tokens."""
        ids, mask = [], []
        for rtg, observation, action in steps:
            ctx, act = self.context(rtg, observation), self.encode(action)
            ids += ctx + act + self.newline
            mask += [0] * len(ctx) + [1] * len(act) + [0] * len(self.newline)
        return ids, mask

    def prompt(self, history: list[tuple[float, str, str]], rtg: float, observation: str) -> list[int]:
        """Inference prefix: the completed steps in the context window, then the current R̂ and state."""
        return self.window(history)[0] + self.context(rtg, observation)


def training_window(fmt: StepFormat, traj: Trajectory, end: int, context_len: int) -> tuple[list[int], list[int]]:
    """The K steps ending at step `end` (fewer at the start of an episode), as in DT's training batches."""
    observations, actions, rewards = episode_steps(traj)
    rtg = returns_to_go(rewards)
    start = max(0, end - context_len + 1)
    return fmt.window([(rtg[t], observations[t], actions[t]) for t in range(start, end + 1)])


def dt_loss(hidden: torch.Tensor, head, input_ids: torch.Tensor, loss_mask: torch.Tensor, denominator: float = 0.0):
    """Cross-entropy on action tokens only: −Σ_j m_j log p(x_j | x_<j) / Σ_j m_j (seed 001 source mask).

    hidden [B, T, H]: the LM body's last hidden states; head: the LM head; input_ids, loss_mask [B, T] (mask 1
    on action-name tokens, 0 on everything else, padding included). Token j is predicted from position j − 1,
    and the head is applied only where m_j = 1: the 49152-wide vocabulary projection of every context token
    would cost more than the top layers' backward. `denominator` (default Σ_j m_j) divides the sum; under
    torchrun it is the global Σ_j m_j / world, so the averaged gradients are those of the whole minibatch
    (common.distributed.global_loss_denominator). Returns (loss, accuracy of the masked tokens).
    """
    predicts_action = loss_mask[:, 1:].bool()
    logits = head(hidden[:, :-1][predicts_action]).float()  # [N, V], N = Σ m_j
    targets = input_ids[:, 1:][predicts_action]
    denominator = denominator or max(len(targets), 1)
    loss = F.cross_entropy(logits, targets, reduction="sum") / denominator
    with torch.no_grad():
        accuracy = (logits.argmax(-1) == targets).float().sum() / denominator
    return loss, accuracy


def pad_right(seqs: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs], dtype=torch.long)


# ---- evaluation: condition on R*, subtract rewards, choose by scoring action names -----------------------
@torch.no_grad()
def evaluate(model, fmt: StepFormat, env_id: str, targets: list[float], episodes: int, seed: int,
             context_len: int, pad_id: int, env_kwargs: dict | None = None) -> list[dict]:
    """Greedy episodes for every target R* (episodes × targets run in lockstep, one batched forward per step).

    Each step the prompt is the last K−1 completed steps plus (R̂_t, s_t); every action name is scored
    after it (joint log-prob of its tokens, `common.rollout.score_candidates`) and the argmax is taken.
    After the step R̂_{t+1} = R̂_t − r_t (DT, Algorithm 1). `env_kwargs`: the dataset's (its meta file), so the
    episodes are played in the environment the data came from. Returns one dict per target.
    """
    device = next(model.parameters()).device
    runs = [(r, e) for r in targets for e in range(episodes)]
    env_list = [envs.make(env_id, **(env_kwargs or {})) for _ in runs]
    candidates = [fmt.encode(name) for name in env_list[0].action_names]
    obs = [env.reset(seed=(1 << 40) + seed * 1000 + e)[0] for env, (_, e) in zip(env_list, runs)]
    rtg = [float(r) for r, _ in runs]
    history: list[list[tuple[float, str, str]]] = [[] for _ in runs]
    ret, length, success, live = [0.0] * len(runs), [0] * len(runs), [False] * len(runs), list(range(len(runs)))
    while live:
        prompts = [fmt.prompt(history[i][-(context_len - 1):] if context_len > 1 else [], rtg[i], obs[i]) for i in live]
        width = max(len(p) for p in prompts)  # left-pad so every row's last token is the last column
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        with autocast(device):
            out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
            scores = score_candidates(model, out.past_key_values, attn, out.logits[:, -1].float(), candidates, False)
        still = []
        for row, i in enumerate(live):
            a = int(scores[row].argmax())
            next_obs, reward, terminated, truncated, info = env_list[i].step(a)
            history[i].append((rtg[i], obs[i], env_list[i].action_names[a]))
            rtg[i] -= reward  # R̂_{t+1} = R̂_t − r_t
            ret[i] += reward
            length[i] += 1
            obs[i] = next_obs
            if terminated or truncated:
                success[i] = info.get("termination") == "success"
            else:
                still.append(i)
        live = still
    results = []
    for target in targets:
        idx = [i for i, (r, _) in enumerate(runs) if r == target]
        results.append({"target": target, "episodic_return": float(np.mean([ret[i] for i in idx])),
                        "success_rate": float(np.mean([success[i] for i in idx])),
                        "episode_length": float(np.mean([length[i] for i in idx]))})
    return results


def load_or_collect(args: Args) -> tuple[list[Trajectory], dict]:
    from common import offline  # the dataset contract shared with cql.py and the benchmarks

    if args.dataset:
        trajs, meta = offline.load_dataset(args.dataset)
        if meta.get("env_id") not in (None, args.env_id):
            raise SystemExit(f"--dataset was collected on {meta['env_id']!r}, not --env-id {args.env_id!r}")
        if lacking := sum("initial_observation" not in t.extra for t in trajs):  # agent logs lack s_1 (see below)
            raise SystemExit(f"--dataset {args.dataset}: {lacking} trajectories lack extra['initial_observation']: not an "
                             "offline dataset (convert agent logs with common.offline.from_agent_records)")
        return trajs, meta
    trajs = offline.collect(args.env_id, args.dataset_quality, args.dataset_episodes, args.seed, args.dataset_epsilon)
    return trajs, {"env_id": args.env_id, "quality": args.dataset_quality, "episodes": args.dataset_episodes}


if __name__ == "__main__":
    args = cli_with_resume(Args, RESUMABLE, "decision_transformer.py")
    validate_args(args)
    device = resolve_device(args.device)
    rank, _, world = init_distributed(device)  # torchrun: data parallel over each minibatch
    args.world_size = world
    run_dir = args.resume or os.path.join(args.output_dir, make_run_name(args.env_id, args.exp_name, args.seed))
    ckpt = Checkpointer(run_dir, args.checkpoint_every, rank, world)
    resumed = ckpt.read() if args.resume else None  # a bad checkpoint fails here, before loading a model
    if resumed and args.train_steps < resumed["counters"]["iteration"]:
        raise SystemExit(f"--train-steps {args.train_steps}: the checkpoint is at step {resumed['counters']['iteration']} already")
    try:
        probe = envs.make(args.env_id)  # fail fast on a bad --env-id, before loading data or a model
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--env-id: {e}")
    if not getattr(probe, "action_names", None):
        raise SystemExit(f"--env-id {args.env_id}: the Decision Transformer needs an environment with action_names")

    seed_everything(args.seed, args.torch_deterministic)
    t0 = time.time()
    dataset, meta = load_or_collect(args)
    dataset = [t for t in dataset if t.turns]
    if not dataset:
        raise SystemExit("--dataset: no trajectory with at least one step")
    windows = [(i, t) for i, traj in enumerate(dataset) for t in range(traj.num_steps)]  # one per step, DT-style
    args.dataset_steps = len(windows)
    returns = [traj.return_ for traj in dataset]
    best, worst = max(returns), min(returns)
    target = args.target_return if args.target_return is not None else best
    sweep = list(args.sweep_targets) or [round(float(v), 2) for v in np.linspace(worst, best, args.sweep_points)]
    sweep = list(dict.fromkeys(sweep))  # a dataset with a single return value gives a one-point sweep
    print0(f"dataset: {len(dataset)} episodes, {len(windows)} steps, return mean {np.mean(returns):.2f} "
           f"[{worst:.2f}, {best:.2f}], success {np.mean([t.success for t in dataset]):.2f} ({time.time() - t0:.1f}s)")

    dtype = torch.float32 if args.lora_r == 0 else None  # trained weights in fp32 (bf16 rounds a 1e-5 step away)
    model, tokenizer = load_model(args.model, device, dtype, seed=args.seed)
    # the return-to-go and the state are text read by the LM's own embeddings: every trained weight is in
    # the LM (no separate DT embeddings or heads), so the checkpoint and --save-model need only the LM. It trains
    # the top --trainable-layers layers and the final norm, or LoRA adapters on them (every base weight frozen)
    model = train_top_layers(model, args.trainable_layers, args.lora_r, args.lora_alpha, args.gradient_checkpointing)
    if world > 1:  # identical starting weights on every rank (LoRA's initialisation draws random numbers)
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    fsdp_layers = shard_layers(model) if args.fsdp else []  # (FSDP replaces the layers' parameters by their shards)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    fmt = StepFormat(tokenizer, args.rtg_scale, args.rtg_decimals)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rng = random.Random(args.seed)  # window sampling: the only generator the training loop draws from
    generators = {"windows": rng}

    tracker = Tracker(run_dir, vars(args), enabled=rank == 0, resume_state=resumed and resumed["tracker"])
    first_step = 1
    if resumed:  # weights (trained part), AdamW moments, every RNG and the step, as after the checkpoint's step
        ckpt.restore(resumed, model, optimizer, generators=generators)
        first_step = resumed["counters"]["iteration"] + 1
        print0(f"resumed from {run_dir} at step {first_step - 1}")
    else:
        tracker.scalars({"diagnostics/dataset_mean_return": float(np.mean(returns)),
                         "diagnostics/dataset_success_rate": float(np.mean([t.success for t in dataset]))}, 0)
        tracker.trajectories(dataset, 0)
    print0(f"run {os.path.basename(run_dir)}: {args.model}, K={args.context_len}, {args.train_steps} steps x {args.minibatch_size} windows, "
           f"R*={target:.2f}, sweep {sweep}")

    def run_eval(step: int, targets: list[float]) -> list[dict]:
        """Rank 0 evaluates (the others get []); under FSDP every rank first gathers the whole weights (collective)."""
        te = time.time()
        model.eval()
        with gathered(fsdp_layers):
            results = evaluate(model, fmt, args.env_id, targets, args.eval_episodes, args.seed, args.context_len,
                               pad_id, meta.get("env_kwargs")) if rank == 0 else []
        tracker.scalars({"perf/eval_s": time.time() - te}, step)
        return results

    def log_main(step: int, res: dict | None = None):
        if res is None:  # not rank 0: nothing was evaluated here
            return
        tracker.scalars({f"eval/{k}": v for k, v in res.items() if k != "target"}, step)
        print0(f"eval @ step {step} | R*={res['target']:.2f} | return {res['episodic_return']:.2f} "
               f"| success {res['success_rate']:.2f} | length {res['episode_length']:.1f}")

    if args.eval_every > 0 and not resumed:  # evaluation: rank 0 alone (the others wait at an all-reduce)
        log_main(0, *run_eval(0, [target]))
    start = time.time()
    interrupt = GracefulInterrupt().start()  # Ctrl-C / SIGTERM: finish this step, save a checkpoint, exit
    for step in range(first_step, args.train_steps + 1):
        # ---- a batch of K-step windows, uniform over the dataset's steps ----
        t1 = time.time()
        picks = rng.choices(windows, k=args.minibatch_size)  # the global minibatch: the same on every rank
        local = args.minibatch_size // world  # torchrun: this rank's disjoint slice of it
        batch = [training_window(fmt, dataset[i], t, args.context_len) for i, t in picks[rank * local:(rank + 1) * local]]
        input_ids = pad_right([ids for ids, _ in batch], pad_id).to(device)
        loss_mask = pad_right([m for _, m in batch], 0).to(device)
        attention = pad_right([[1] * len(ids) for ids, _ in batch], 0).to(device)
        # ---- cross-entropy on action tokens only ----
        model.train()
        with autocast(device):  # bf16 on CUDA, nothing on CPU; the backward runs outside
            hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention).last_hidden_state
            denominator = global_loss_denominator(loss_mask[:, 1:].sum().item())  # action tokens, all ranks / world
            loss, accuracy = dt_loss(hidden, model.get_output_embeddings(), input_ids, loss_mask, denominator)
        optimizer.zero_grad()
        loss.backward()
        if world > 1:  # the average of the ranks' gradients: one process's on the whole minibatch
            for p in (p for p in params if not is_sharded(p)):  # FSDP reduce-scattered the sharded ones
                dist.all_reduce(p.grad)
                p.grad /= world
        grad_norm = clip_grad_norm(params, args.max_grad_norm)  # FSDP: the norm over every rank's slices
        optimizer.step()
        update_s = time.time() - t1
        m = all_reduce_mean({"losses/action_loss": loss.item(), "diagnostics/action_token_accuracy": accuracy.item(),
                             "perf/update_s": update_s, "tokens": attention.sum().item()})  # sums / global count
        m.update({"diagnostics/grad_norm": grad_norm, "perf/train_tokens_per_s": m.pop("tokens") * world / update_s})
        if world > 1:  # every rank applied the same averaged update: their weights must agree exactly
            m["diagnostics/rank_param_divergence"] = rank_param_divergence(params)
        tracker.scalars(m, step)
        if step == 1 or step % 25 == 0 or step == args.train_steps:
            print0(f"step {step}/{args.train_steps} | loss {m['losses/action_loss']:.4f} | action-token acc "
                   f"{m['diagnostics/action_token_accuracy']:.2f} | {update_s:.2f}s/step | {time.time() - start:.0f}s")
        if args.eval_every > 0 and step % args.eval_every == 0 and step != args.train_steps:
            log_main(step, *run_eval(step, [target]))
        stop = interrupt.should_stop()
        if ckpt.due(step, last=step == args.train_steps) or stop:  # before the final sweep: --resume extends
            ckpt.save({"iteration": step}, model, optimizer, generators=generators, tracker=tracker)
            print0(f"checkpoint saved in {run_dir} (step {step})")
        if stop:
            print0(f"interrupted: resume with  python {sys.argv[0]} --resume {run_dir}")
            tracker.close()
            raise SystemExit(130)
    interrupt.stop()

    # ---- final evaluation (rank 0): R* = target, then the sweep over R* (return conditioning) ----
    final = run_eval(args.train_steps, list(dict.fromkeys([target] + sweep)))
    weights = full_tensors(model.state_dict()) if args.save_model and fsdp_layers else None  # FSDP: collective
    if rank == 0:
        log_main(args.train_steps, final[0])
        by_target = {r["target"]: r for r in final}
        achieved = [by_target[v]["episodic_return"] for v in sweep]
        for index, value in enumerate(sweep):
            res = by_target[value]
            # x = sweep index: TensorBoard draws achieved return against the (increasing) R* it was asked for
            tracker.scalars({"eval/rtg_sweep_target": value, "eval/rtg_sweep_return": res["episodic_return"],
                             "eval/rtg_sweep_success_rate": res["success_rate"]}, index)
            tracker.scalars({f"eval/episodic_return_rtg_{value:g}": res["episodic_return"]}, args.train_steps)
            print0(f"sweep R*={value:6.2f} -> return {res['episodic_return']:6.2f} | success {res['success_rate']:.2f} "
                   f"| length {res['episode_length']:.1f}")
        # Pearson correlation between asked and achieved return (0 when either side is constant)
        corr = float(np.corrcoef(sweep, achieved)[0, 1]) if len(sweep) > 1 and np.std(achieved) > 0 else 0.0
        tracker.scalars({"eval/rtg_correlation": corr if math.isfinite(corr) else 0.0}, args.train_steps)
        print0(f"return conditioning: corr(R*, achieved return) = {corr:.2f}")

        if args.save_model:
            path = os.path.join(run_dir, "model")
            save_model(model, tokenizer, path, weights)  # with LoRA: the adapter only (+ the base's name for load_model)
            print0(f"model saved to {path}")
    print0(f"done in {time.time() - t0:.0f}s; logs in {run_dir}")
    tracker.close()
    if world > 1:
        finish_distributed()  # barrier, destroy the group, exit 0 skipping the interpreter's shutdown (gloo abort)
