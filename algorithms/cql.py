# docs: docs/cql.md
"""Discrete-action Conservative Q-Learning on an LM's state encoding (Kumar et al. 2020; seed 003 §4.3),
with behaviour cloning and filtered behaviour cloning baselines on the same network and data.

Q(s, .) is a head (linear or MLP) over the environment's `action_names`, on top of the LM's final hidden
state at the last prompt position of the state text: system prompt + the last K (observation, action)
turns + the current observation, in the model's chat template. The loss (`--mode cql`) is CQL(H), eq. 4
of the paper, with a double-DQN TD target and a target network:

    L(theta) = alpha * E_{s~D}[ logsumexp_a Q(s, a) - Q(s, a_D) ]  +  1/2 E_{(s,a,r,s')~D}[ (Q(s, a) - y)^2 ]
    y = r + gamma * (1 - done) * Q_target(s', argmax_a' Q(s', a'))            (van Hasselt et al. 2016)

The first term pushes Q down on every action (soft-max) and up on the data's action, so actions the data
never took cannot look better than those it did (the OOD problem of seed 003 §4.2). `--mode bc` trains the
same network with cross-entropy on the data's actions (softmax over Q as logits); `--mode filtered-bc` does
that on seed 003 §4's filtered demonstrations only (success, no hesitant runs, none over-long).
Every `--eval-every` updates the greedy policy argmax_a Q(s, a) plays the environment online.

Under torchrun every rank draws the same global minibatch of `--minibatch-size` transitions (same seed) and
takes a disjoint 1/world slice of it; the gradients are averaged over ranks, so N processes make the updates
of one. The frozen LM's state encoding is split over the ranks and gathered; evaluation runs on rank 0 only.

Usage:
    python algorithms/cql.py                                        # smollm2-135m (frozen), GridWorld, 200 suboptimal episodes
                                                                    # (encoding ~800 states: ~7 CPU-min; updates + evals: minutes)
    python algorithms/cql.py --mode bc                              # the behaviour-cloning baseline, same data
    python algorithms/cql.py --mode filtered-bc                     # BC on seed 003's filtered demonstrations
    python algorithms/cql.py --mode bc --feature-cache runs/features   # frozen features kept across runs (seeds, modes)
    python algorithms/cql.py --dataset datasets/gridworld_suboptimal.jsonl   # a dataset from benchmarks/collect_offline.py
    python algorithms/cql.py --model tiny --total-updates 50 --dataset-episodes 8   # seconds, for a smoke test
    python algorithms/cql.py --train-backbone --device cuda         # fine-tune the LM too (one forward per batch)
    python algorithms/cql.py --train-backbone --lora-r 16 --device cuda   # ... or LoRA adapters on it
    torchrun --nproc_per_node 2 algorithms/cql.py --model tiny --total-updates 50 --dataset-episodes 8  # data parallel
    torchrun --nproc_per_node 8 algorithms/cql.py --train-backbone --fsdp --model <path>   # LM layers sharded (FSDP2)
    python algorithms/cql.py --checkpoint-every 500                 # then, after a crash or Ctrl-C:
    python algorithms/cql.py --resume runs/<run> [--total-updates 6000]

Copying this file out: it needs `common/` (offline.py for datasets) and `envs/` for the built-in
environments (or any `package.module:Factory` with `action_names` passed as --env-id).

Where this departs from the paper / seed:
- The paper's discrete-action CQL sits on QR-DQN for Atari; here it is plain double DQN (online argmax, target
  evaluation) with a Polyak-averaged target network (`--tau 1 --target-update-every N` is a hard copy).
- Seed 003 writes the penalty as `Q(s,a) - log(1/|D| sum exp Q(s,a_i))`; we use the paper's CQL(H),
  `logsumexp_a Q(s,a) - Q(s,a_D)` (seed 003's text garbles the sign/terms; the intent, penalise values of
  actions the data does not support, is the same).
- With the backbone frozen (default) every distinct state text is encoded once and its feature vector cached,
  so an update costs milliseconds; `--train-backbone` forwards the LM for every batch (online, and the target
  network keeps its own copy of the LM).
- `done` is 1 when the episode terminated (success / failure) and at a time limit the observation shows ("Step 20/20.":
  time is in the state, so nothing follows); a truncation the observation does not show bootstraps (Pardo et al. 2018).
- A checkpoint holds the Q head (and the trained LM weights or LoRA adapter), the target network, Adam and the
  minibatch generator; the dataset and its encoding are rebuilt (deterministically) on `--resume`.
"""

from __future__ import annotations

import copy
import json
import os
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
from torch import nn

import envs
from common.chat import ChatFormat
from common.checkpoint import Checkpointer, GracefulInterrupt, cli_with_resume
from common.distributed import (all_reduce_mean, clip_grad_norm, dist_info, finish_distributed, full_tensors, gathered,
                                init_distributed, is_sharded, print0, rank_param_divergence, seed_everything, shard_layers,
                                shard_like)
from common.models import apply_lora, load_model, resolve_device, save_model
from common.offline import (FeatureCache, collect, dataset_stats, encode_states, filter_demonstrations, load_dataset,
                            transitions, write_dataset)
from common.records import Trajectory, Turn
from common.tracking import Tracker, make_run_name


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of the experiment (model init for `tiny`, the Q head, minibatch sampling, collected dataset)"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms, so the same seed gives the same numbers on CPU"""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N` or `auto`"""
    save_model: bool = False
    """save the LM (HF format; LoRA: the adapter only) and the Q head (`q_head.pt`) to `runs/{run_name}/model`"""
    model: str = "smollm2-135m"
    """`tiny` (random, for tests), `smollm2-135m` (embedded default) or a local model path"""
    env_id: str = "gridworld"
    """a discrete-action environment (with `action_names`): gridworld, gridworld-procedural, frozenlake, taxi, ..."""
    output_dir: str = "runs"
    """where run directories are created"""
    checkpoint_every: int = 0
    """checkpoint (trained weights, target network, optimizer, RNGs, counters) every N updates and at the end; 0: never"""
    resume: str = ""
    """a run directory to continue from its checkpoint, with its saved arguments and TensorBoard run"""

    # Algorithm specific arguments
    mode: Literal["cql", "bc", "filtered-bc"] = "cql"
    """`cql`: CQL(H) + double-DQN TD loss; `bc`: cross-entropy on every action of the data; `filtered-bc`: on seed 003's filtered demonstrations"""
    dataset: str = ""
    """a dataset written by benchmarks/collect_offline.py (JSONL + .meta.json); empty: collect one (next flags)"""
    dataset_quality: Literal["expert", "suboptimal", "noisy", "llm"] = "suboptimal"
    """without --dataset: the behaviour policy of the collected data (`llm`: this script's --model, zero-shot)"""
    dataset_episodes: int = 200
    """without --dataset: number of episodes to collect"""
    dataset_epsilon: float = 0.4
    """without --dataset, quality `suboptimal`: probability of a random action instead of the expert's (0.4: ~70% success on GridWorld, seed 003's annotator data)"""
    history_len: int = 0
    """K: previous (observation, action) turns included in the state text (0: the current observation only, Markov for our grid games)"""
    train_backbone: bool = False
    """train the LM with the head (one forward per batch) instead of caching frozen features"""
    lora_r: int = 0
    """with --train-backbone: LoRA rank (peft) on the LM's attention/MLP projections, base frozen; 0: train the weights"""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / r) B A"""
    fsdp: bool = False
    """torchrun, with --train-backbone: shard the LM's decoder layers and the target LM's alike over the ranks (PyTorch
    FSDP2: weights, gradients and Adam state), so the Polyak update is shard by shard; whole for evaluation"""
    head: Literal["mlp", "linear"] = "mlp"
    """the Q head on the LM's final hidden state"""
    head_hidden: int = 256
    """width of the MLP head's hidden layer"""
    total_updates: int = 3000
    """gradient updates"""
    minibatch_size: int = 128
    """transitions per update, over all processes (torchrun: each rank takes minibatch_size / world_size of them)"""
    learning_rate: float = 3e-4
    """Adam learning rate of the Q head"""
    backbone_learning_rate: float = 1e-5
    """Adam learning rate of the LM when --train-backbone"""
    gamma: float = 0.99
    """discount"""
    cql_alpha: float = 1.0
    """alpha: weight of the CQL(H) regulariser (0: plain double DQN on the data)"""
    tau: float = 0.005
    """target network update: theta' <- tau * theta + (1 - tau) * theta' (1.0: hard copy)"""
    target_update_every: int = 1
    """update the target network every N updates"""
    max_grad_norm: float = 10.0
    """gradient clipping"""
    filter_max_repeat_fraction: float = 0.4
    """filtered-bc: drop runs whose repeated states exceed this fraction (seed 003: unique < 0.6 x states)"""
    filter_max_steps: int = 0
    """filtered-bc: drop runs longer than this (seed 003: 3 x the optimal length; 0: no length rule)"""
    encode_batch_size: int = 32
    """states per LM forward when encoding (memory only)"""
    feature_cache: str = ""
    """frozen backbone: a directory that keeps state features across runs (keyed by the LM's weights and each
    state's token ids), so other seeds and modes on the same data skip the encoding; empty: off"""
    eval_every: int = 500
    """greedy online evaluation every N updates (and before the first and after the last); 0: only after the last"""
    eval_episodes: int = 4
    """episodes per evaluation (the fixed GridWorld layout is deterministic: 1 suffices there); 0: no evaluation"""
    log_every: int = 50
    """log losses every N updates"""

    # filled in at runtime
    num_transitions: tyro.conf.Suppress[int] = 0
    """transitions in the training data (after filtering)"""
    num_states: tyro.conf.Suppress[int] = 0
    """distinct state texts in the training data"""
    world_size: tyro.conf.Suppress[int] = 1
    """number of processes (torchrun)"""


# read by tests/test_conformance.py: a few-second `--model tiny` run, and the shared tags it writes
SMOKE_TEST_ARGS = ["--dataset-episodes", "6", "--total-updates", "10", "--minibatch-size", "16", "--log-every", "5",
                   "--eval-every", "10", "--eval-episodes", "1"]
LOGGED_TAGS = ("losses/loss", "losses/td_loss", "losses/cql_regulariser", "diagnostics/q_data", "diagnostics/q_logsumexp",
               "diagnostics/td_target", "diagnostics/action_agreement", "diagnostics/grad_norm", "perf/encode_s",
               "perf/updates_per_s", "perf/eval_s", "eval/episodic_return", "eval/success_rate", "eval/episode_length")
# the flags --resume lets differ from the saved run (none of them changes what the training samples)
RESUMABLE = {"total_updates", "checkpoint_every", "eval_every", "eval_episodes", "log_every", "save_model", "resume",
             "output_dir", "feature_cache"}


def validate_args(args: Args):
    problems = []
    for name in ("dataset_episodes", "total_updates", "minibatch_size", "encode_batch_size", "log_every",
                 "target_update_every", "head_hidden"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("history_len", "eval_every", "eval_episodes", "filter_max_steps", "cql_alpha", "checkpoint_every",
                 "lora_r"):
        if getattr(args, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 <= args.gamma <= 1 or not 0 < args.tau <= 1 or not 0 <= args.dataset_epsilon <= 1:
        problems.append("--gamma and --dataset-epsilon must be in [0, 1], --tau in (0, 1]")
    if not 0 <= args.filter_max_repeat_fraction < 1:
        problems.append("--filter-max-repeat-fraction must be in [0, 1)")
    if args.dataset and not os.path.exists(args.dataset):
        problems.append(f"--dataset {args.dataset} does not exist")
    if (args.lora_r > 0 or args.fsdp) and not args.train_backbone:
        problems.append("--lora-r and --fsdp need --train-backbone (the frozen LM has nothing to adapt or shard)")
    if args.fsdp and dist_info()[2] < 2:
        problems.append("--fsdp shards over torchrun processes: run it with torchrun --nproc_per_node N (N >= 2)")
    if args.minibatch_size % dist_info()[2]:  # torchrun: equal slices of the global minibatch
        problems.append(f"--minibatch-size {args.minibatch_size} must be divisible by the {dist_info()[2]} processes")
    if problems:
        raise SystemExit("cql.py: " + "; ".join(problems))


# ---- the losses: pure functions of Q-values -------------------------------------------------------------
def td_target(q_next_online: torch.Tensor, q_next_target: torch.Tensor, rewards, dones, gamma: float):
    """Double DQN (van Hasselt et al. 2016): y = r + gamma (1 - done) Q_target(s', argmax_a' Q_online(s', a')).
    q_next_*: [B, A]; rewards, dones: [B] (common.offline.transitions: 1 at termination and at a shown time limit)."""
    best = q_next_online.argmax(-1, keepdim=True)
    return rewards + gamma * (1.0 - dones) * q_next_target.gather(-1, best).squeeze(-1)


def cql_regulariser(q: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """CQL(H), Kumar et al. 2020 eq. 4: E_s[ logsumexp_a Q(s, a) - Q(s, a_D) ]. q: [B, A], actions: [B]."""
    return (torch.logsumexp(q, -1) - q.gather(-1, actions[:, None]).squeeze(-1)).mean()


def cql_loss(q: torch.Tensor, actions: torch.Tensor, target: torch.Tensor, alpha: float):
    """alpha * CQL(H) + 1/2 E[(Q(s, a_D) - y)^2] (eq. 4; the 1/2 is the paper's). Returns (loss, td, reg)."""
    td = 0.5 * (q.gather(-1, actions[:, None]).squeeze(-1) - target.detach()).pow(2).mean()
    reg = cql_regulariser(q, actions)
    return td + alpha * reg, td, reg


def bc_loss(q: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Behaviour cloning: -E log softmax(Q(s, .))[a_D], the same network read as policy logits."""
    return F.cross_entropy(q, actions)


# ---- the state encoder: the LM's last hidden state of the chat-formatted state text ---------------------
def state_texts(history: list[str], observation: str, k: int) -> tuple[str, ...]:
    """[obs_{t-K}, a_{t-K}, ..., obs_{t-1}, a_{t-1}, obs_t]: the last K turns and the current observation."""
    return tuple((history[max(0, len(history) - 2 * k):] if k else []) + [observation])  # (fewer turns early on)


def state_ids(chat: ChatFormat, system: str, texts: tuple[str, ...]) -> list[int]:
    """System + first observation as the opening prompt, then each (action, observation) as an appended turn,
    ending at the assistant header: the position where the policy would answer."""
    ids = chat.prompt_ids(system, texts[0])
    for action, obs in zip(texts[1::2], texts[2::2]):
        ids += chat.encode(action) + chat.next_turn_ids(obs, action_ended_with_eos=False)
    return ids


class QHead(nn.Module):
    """Q(s, .) from an LM feature vector: a fixed standardisation (per-dimension mean and std of the training
    states' features, so the small differences between similar states' hidden states are not lost under
    their large shared component), then a linear layer or a one-hidden-layer MLP."""

    def __init__(self, kind: str, hidden_size: int, width: int, num_actions: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(hidden_size))
        self.register_buffer("std", torch.ones(hidden_size))
        self.net = (nn.Linear(hidden_size, num_actions) if kind == "linear" else
                    nn.Sequential(nn.Linear(hidden_size, width), nn.ReLU(), nn.Linear(width, num_actions)))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net((features - self.mean) / self.std)


def soft_update(target: nn.Module, online: nn.Module, tau: float):
    with torch.no_grad():
        for t, o in zip(target.parameters(), online.parameters()):
            t.lerp_(o, tau)


if __name__ == "__main__":
    args = cli_with_resume(Args, RESUMABLE, "cql.py")
    validate_args(args)
    device = resolve_device(args.device)
    rank, _, world = init_distributed(device)  # torchrun: data parallel over each minibatch
    args.world_size = world
    if args.feature_cache and world > 1:  # ranks reading a file another run writes could disagree on what to encode
        raise SystemExit("--feature-cache works in one process only; drop it under torchrun (the encoding is split over ranks)")
    run_dir = args.resume or os.path.join(args.output_dir, make_run_name(args.env_id, args.exp_name, args.seed))
    run_name = os.path.basename(run_dir)
    ckpt = Checkpointer(run_dir, args.checkpoint_every, rank, world)
    resumed = ckpt.read() if args.resume else None  # a bad checkpoint fails here, before loading a model
    if resumed and args.total_updates < resumed["counters"]["iteration"]:
        raise SystemExit(f"--total-updates {args.total_updates}: the checkpoint is at update "
                         f"{resumed['counters']['iteration']} already")
    try:  # fail fast on a bad --env-id, before loading a model
        probe = envs.make(args.env_id)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--env-id: {e}")
    if not getattr(probe, "action_names", None):
        raise SystemExit(f"--env-id {args.env_id}: CQL needs a discrete-action environment (with action_names)")
    meta = {}
    if args.dataset:
        try:
            trajs, meta = load_dataset(args.dataset)
        except (ValueError, OSError) as e:
            raise SystemExit(f"--dataset: {e}")
        if meta.get("env_id", args.env_id) != args.env_id:
            raise SystemExit(f"--dataset {args.dataset} was collected on {meta['env_id']}; pass --env-id {meta['env_id']}")
    env_kwargs = meta.get("env_kwargs") or {}
    action_names = list(envs.make(args.env_id, **env_kwargs).action_names)

    seed_everything(args.seed, args.torch_deterministic)
    model, tokenizer = load_model(args.model, device, seed=args.seed)
    if args.lora_r > 0:  # adapters on every layer (B = 0: the same LM at the start), base weights frozen
        model = apply_lora(model, args.lora_r, args.lora_alpha)
    chat = ChatFormat(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else chat.eos_id
    body = model.get_decoder()

    # ---- the data: a dataset file, or one collected now (and written into the run directory) ----
    if not args.dataset:
        t0 = time.time()
        trajs = collect(args.env_id, args.dataset_quality, args.dataset_episodes, args.seed, args.dataset_epsilon,
                        model=(model, tokenizer), device=str(device))
        meta = {"env_id": args.env_id, "env_kwargs": {}, "quality": args.dataset_quality, "seed": args.seed,
                "epsilon": args.dataset_epsilon if args.dataset_quality == "suboptimal" else None}
        if rank == 0:  # every rank collected the same (seeded) episodes; one writes them
            write_dataset(os.path.join(run_dir, "dataset.jsonl"), trajs, meta)
        print0(f"collected {len(trajs)} {args.dataset_quality} episodes in {time.time() - t0:.1f}s")
    stats = dataset_stats(trajs)
    print0(f"dataset: {stats['episodes']} episodes, {stats['num_steps']} transitions, success {stats['success_rate']:.2f}, "
           f"mean return {stats['mean_return']:.2f}")
    if args.mode == "filtered-bc":
        trajs = filter_demonstrations(trajs, args.filter_max_repeat_fraction, args.filter_max_steps or None)
        print0(f"filtered-bc: {len(trajs)} of {stats['episodes']} episodes kept (seed 003 §4 filter)")
        if not trajs:
            raise SystemExit("--mode filtered-bc: the demonstration filter kept no episode (no successes in the data?)")

    # ---- transitions -> state indices; each distinct state text is encoded once ----
    state_index: dict[tuple[str, ...], int] = {}
    s_idx, actions, rewards, s2_idx, dones = [], [], [], [], []
    for traj in trajs:
        for tr in transitions(traj):
            if not 0 <= tr.action < len(action_names):
                raise SystemExit(f"--dataset: action {tr.action} out of range for {args.env_id}'s {action_names}")
            s = state_texts(tr.history, tr.observation, args.history_len)
            s2 = state_texts(tr.history + [tr.observation, tr.action_name], tr.next_observation, args.history_len)
            s_idx.append(state_index.setdefault(s, len(state_index)))
            s2_idx.append(state_index.setdefault(s2, len(state_index)) if args.mode == "cql" else 0)  # BC needs no s'
            actions.append(tr.action)
            rewards.append(tr.reward)
            dones.append(float(tr.done))
    system = trajs[0].extra["system_prompt"]
    all_ids = [state_ids(chat, system, s) for s in state_index]
    S, A, R, S2, D = (torch.tensor(x, device=device) for x in (s_idx, actions, rewards, s2_idx, dones))
    R, D = R.float(), D.float()
    args.num_transitions, args.num_states = len(s_idx), len(state_index)
    tracker = Tracker(run_dir, vars(args), enabled=rank == 0, resume_state=resumed and resumed["tracker"])

    head = QHead(args.head, model.config.hidden_size, args.head_hidden, len(action_names)).to(device)
    if world > 1:  # identical starting weights on every rank (the head's and LoRA's inits draw random numbers)
        for p in [*head.parameters(), *(body.parameters() if args.train_backbone else ())]:
            dist.broadcast(p.data, src=0)
    if args.train_backbone:
        body.train()
        target_body = copy.deepcopy(body).requires_grad_(False).eval()
        # FSDP: both LMs' layers sharded the same way, so t.lerp_(o) pairs up matching slices
        fsdp_layers, target_layers = (shard_layers(body), shard_layers(target_body)) if args.fsdp else ([], [])
        params = [{"params": head.parameters(), "lr": args.learning_rate},
                  {"params": [p for p in body.parameters() if p.requires_grad], "lr": args.backbone_learning_rate}]
    else:
        body.requires_grad_(False)
        fsdp_layers, target_layers = [], []
        params = [{"params": head.parameters(), "lr": args.learning_rate}]
    optimizer = torch.optim.Adam(params)
    trainable = [p for g in optimizer.param_groups for p in g["params"]]

    def encode(ids_list: list[list[int]], encoder=body) -> torch.Tensor:
        order = sorted(range(len(ids_list)), key=lambda i: len(ids_list[i]))  # similar lengths: little padding
        out = [None] * len(ids_list)
        for c in range(0, len(order), args.encode_batch_size):
            chunk = order[c:c + args.encode_batch_size]
            for i, f in zip(chunk, encode_states(encoder, [ids_list[i] for i in chunk], pad_id, device)):
                out[i] = f
        return torch.stack(out)

    def encode_split(ids_list: list[list[int]]) -> torch.Tensor:
        """torchrun: each rank encodes every world-th state (shares padded to one size), then all gather them."""
        if world == 1:
            return encode(ids_list)
        size, share = -(-len(ids_list) // world), ids_list[rank::world]
        mine = encode(share + [ids_list[0]] * (size - len(share)))
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine.contiguous())
        return torch.stack(parts, 1).flatten(0, 1)[:len(ids_list)]  # row i * world + r: rank r's i-th state

    t0 = time.time()
    features = None
    if not args.train_backbone:  # the speed-up: the frozen LM sees each distinct state exactly once
        cache = FeatureCache(args.feature_cache, body, args.model) if args.feature_cache else None
        known = [cache.get(ids) for ids in all_ids] if cache else [None] * len(all_ids)
        missing = [i for i, f in enumerate(known) if f is None]
        if missing:
            with torch.no_grad():
                for i, f in zip(missing, encode_split([all_ids[i] for i in missing])):
                    known[i] = f
                    if cache:
                        cache.put(all_ids[i], f)
        if cache:
            print0(f"feature cache {cache.path}: {len(all_ids) - len(missing)} of {len(all_ids)} states found")
            cache.save()
        features = torch.stack([f.to(device) for f in known])  # cached ones are on the CPU
        sample = features
    else:  # the standardisation comes from the initial LM's features of (up to 1024 of) the training states
        with torch.no_grad():
            sample = encode_split([all_ids[i] for i in torch.randperm(len(all_ids), generator=torch.Generator().manual_seed(
                args.seed))[:1024].tolist()])
    head.mean.copy_(sample.mean(0))
    std = sample.std(0, unbiased=False)
    head.std.copy_(std.clamp(min=0.1 * float(std.mean())) + 1e-6)  # a floor: near-constant dims must not explode
    target_head = copy.deepcopy(head).requires_grad_(False)
    encode_s = time.time() - t0
    print0(f"run {run_name}: {args.mode} on {args.num_transitions} transitions, {args.num_states} distinct states "
           f"({sum(map(len, all_ids)) / len(all_ids):.0f} tokens each), encoded in {encode_s:.1f}s")
    if not resumed:
        tracker.scalars({"perf/encode_s": encode_s}, 0)
    eval_cache: dict[tuple[str, ...], torch.Tensor] = dict(zip(state_index, features)) if features is not None else {}

    def q_values(idx: torch.Tensor, hd=head, bd=None, one_forward=False) -> torch.Tensor:
        if features is not None:
            return hd(features[idx])
        if one_forward:  # FSDP2 runs one forward of each sharded layer per backward: no shared prefix, no chunks
            return hd(encode_states(body, [all_ids[i] for i in idx.tolist()], pad_id, device, share_prefix=False))
        return hd(encode([all_ids[i] for i in idx.tolist()], body if bd is None else bd))

    def evaluate(step: int) -> None:
        """Greedy episodes (argmax_a Q) in lockstep, online in the environment, on fresh seeds (rank 0 only: the
        other ranks go on to the next update's all-reduce and wait there; under FSDP first to the gathering)."""
        with gathered(fsdp_layers):  # FSDP: whole weights (collective), then rank 0 alone plays
            if rank == 0:
                play_greedy(step)

    def play_greedy(step: int) -> None:
        t_eval = time.time()
        env_list = [envs.make(args.env_id, **env_kwargs) for _ in range(args.eval_episodes)]
        seeds = [(1 << 40) + args.seed * 1000 + i for i in range(args.eval_episodes)]
        obs = [e.reset(seed=s)[0] for e, s in zip(env_list, seeds)]
        hist, turns, term = [[] for _ in env_list], [[] for _ in env_list], [None] * len(env_list)
        body.eval()
        while any(t is None for t in term):
            live = [i for i, t in enumerate(term) if t is None]
            texts = [state_texts(hist[i], obs[i], args.history_len) for i in live]
            with torch.no_grad():
                new = [t for t in dict.fromkeys(texts) if t not in eval_cache]
                if new:
                    feats = encode([state_ids(chat, env_list[0].system_prompt, t) for t in new])
                    if features is not None:  # the frozen LM's features never change: keep them
                        eval_cache.update(zip(new, feats))
                    else:
                        fresh = dict(zip(new, feats))
                q = head(torch.stack([eval_cache[t] if t in eval_cache else fresh[t] for t in texts]))
            for i, a in zip(live, q.argmax(-1).tolist()):
                o, r, terminated, truncated, info = env_list[i].step(a)
                turns[i].append(Turn(action_text=action_names[a], observation=o, reward=float(r), action_valid=True,
                                     num_action_tokens=0))
                hist[i] += [obs[i], action_names[a]]
                obs[i] = o
                if terminated or truncated:
                    term[i] = info.get("termination", "truncated" if truncated else "failure")
        if args.train_backbone:
            body.train()
        ep = [Trajectory([], [], [], step, t, {}, sum(u.reward for u in t), term[i], "", "", seeds[i], args.env_id)
              for i, t in enumerate(turns)]
        m = {"eval/episodic_return": float(np.mean([t.return_ for t in ep])),
             "eval/success_rate": float(np.mean([t.success for t in ep])),
             "eval/episode_length": float(np.mean([t.num_steps for t in ep])), "perf/eval_s": time.time() - t_eval}
        tracker.scalars(m, step)
        tracker.trajectories(ep, step)
        print0(f"eval @ update {step} | success {m['eval/success_rate']:.2f} | return {m['eval/episodic_return']:.2f} "
               f"| length {m['eval/episode_length']:.1f}")

    # ---- training: minibatches of transitions ----
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    # what a checkpoint stores as weights: the head's parameters and the LM's trained ones (none when frozen)
    trained = nn.ModuleDict({"head": head, "body": body})
    sums, first_update = {}, 1  # sums: the running log window (with its count "n"), so a resume continues it
    if resumed:  # after the standardisation above, which the initial LM's features define
        ckpt.restore(resumed, trained, optimizer, generators={"minibatch": gen})
        target_head.load_state_dict(resumed["extra"]["target_head"])
        if args.train_backbone:
            target_params = dict(target_body.named_parameters())  # FSDP: keep this rank's slice of each
            with torch.no_grad():
                for n, v in resumed["extra"]["target_body"].items():
                    target_params[n].copy_(shard_like(v, target_params[n]) if is_sharded(target_params[n]) else v)
        sums, first_update = resumed["extra"]["log_sums"], resumed["counters"]["iteration"] + 1
        print0(f"resumed from {run_dir} at update {first_update - 1}")
    elif args.eval_every and args.eval_episodes:
        evaluate(0)
    start, t_log = time.time(), time.time()
    interrupt = GracefulInterrupt().start()  # Ctrl-C / SIGTERM: finish this update, save a checkpoint, exit
    for update in range(first_update, args.total_updates + 1):
        batch = torch.randint(len(s_idx), (args.minibatch_size,), generator=gen)  # the same on every rank
        batch = batch.view(world, -1)[rank].to(device)  # torchrun: this rank's disjoint slice of it
        s, a = S[batch], A[batch]
        if args.mode == "cql":
            with torch.no_grad():  # before q's forward, so that under FSDP q's forward is followed directly by its backward
                q_next_online = q_values(S2[batch])
                q_next_target = q_values(S2[batch], target_head, target_body if args.train_backbone else None)
                y = td_target(q_next_online, q_next_target, R[batch], D[batch], args.gamma)
            q = q_values(s, one_forward=args.fsdp)
            loss, td, reg = cql_loss(q, a, y, args.cql_alpha)
            logs = {"losses/td_loss": td.item(), "losses/cql_regulariser": reg.item(), "diagnostics/td_target": y.mean().item()}
        else:
            q = q_values(s, one_forward=args.fsdp)
            loss = bc_loss(q, a)
            logs = {"losses/bc_loss": loss.item()}
        optimizer.zero_grad()
        loss.backward()
        if world > 1:  # equal slices: each rank's mean is its sum / (B / world), the global denominator, and the
            for p in trainable:  # average of the ranks' gradients is one process's gradient on the whole minibatch
                if not is_sharded(p):  # FSDP reduce-scattered (averaged) the sharded ones in the backward
                    dist.all_reduce(p.grad)
                    p.grad /= world
        grad_norm = clip_grad_norm(trainable, args.max_grad_norm)
        optimizer.step()
        if args.mode == "cql" and update % args.target_update_every == 0:
            soft_update(target_head, head, args.tau)
            if args.train_backbone:
                soft_update(target_body, body, args.tau)
        with torch.no_grad():
            logs.update({"losses/loss": loss.item(), "diagnostics/grad_norm": grad_norm,
                         "diagnostics/q_data": q.gather(-1, a[:, None]).mean().item(),
                         "diagnostics/q_logsumexp": torch.logsumexp(q, -1).mean().item(),
                         "diagnostics/action_agreement": (q.argmax(-1) == a).float().mean().item()})
        for k, v in {**logs, "n": 1}.items():
            sums[k] = sums.get(k, 0.0) + v
        if update % args.log_every == 0 or update == args.total_updates:
            n = sums.pop("n")
            means = all_reduce_mean({k: v / n for k, v in sums.items()})  # equal slices: the global minibatch's
            means["perf/updates_per_s"] = n / (time.time() - t_log)
            if world > 1:  # every rank applied the same averaged update: their weights must agree exactly
                means["diagnostics/rank_param_divergence"] = rank_param_divergence([*trainable, *target_head.parameters()])
            tracker.scalars(means, update)
            print0(f"update {update}/{args.total_updates} | loss {means['losses/loss']:.4f} "
                   + (f"| td {means['losses/td_loss']:.4f} | cql {means['losses/cql_regulariser']:.4f} "
                      if args.mode == "cql" else "")
                   + f"| Q(s,a_D) {means['diagnostics/q_data']:.3f} | agree {means['diagnostics/action_agreement']:.2f} "
                   f"| {means['perf/updates_per_s']:.0f} upd/s")
            sums, t_log = {}, time.time()
        if args.eval_episodes and ((args.eval_every and update % args.eval_every == 0) or update == args.total_updates):
            evaluate(update)
        stop = interrupt.should_stop()
        if ckpt.due(update, last=update == args.total_updates) or stop:
            trained_names = {n for n, p in body.named_parameters() if p.requires_grad}  # the target LM: that part
            with gathered(target_layers):  # FSDP: whole tensors
                target_lm = {n: p.detach().cpu().clone() for n, p in target_body.named_parameters()
                             if n in trained_names} if args.train_backbone else {}
            sums = all_reduce_mean(sums) if sums else sums  # the ranks' log windows as one (the logged means agree)
            ckpt.save({"iteration": update}, trained, optimizer, generators={"minibatch": gen}, tracker=tracker,
                      extra={"target_head": target_head.state_dict(), "target_body": target_lm, "log_sums": dict(sums)})
            print0(f"checkpoint saved in {run_dir} (update {update})")
        if stop:
            print0(f"interrupted: resume with  python {sys.argv[0]} --resume {run_dir}")
            tracker.close()
            raise SystemExit(130)
    interrupt.stop()

    weights = full_tensors(model.state_dict()) if args.save_model and fsdp_layers else None  # FSDP: collective
    if args.save_model and rank == 0:
        path = os.path.join(run_dir, "model")
        save_model(model, tokenizer, path, weights)  # with LoRA: the adapter only
        torch.save(head.state_dict(), os.path.join(path, "q_head.pt"))
        with open(os.path.join(path, "q_head.json"), "w") as f:  # how to rebuild the head and its state text
            json.dump({"head": args.head, "head_hidden": args.head_hidden, "action_names": action_names,
                       "history_len": args.history_len, "system_prompt": system}, f, indent=2)
        print0(f"model and Q head saved to {path}")
    print0(f"done in {time.time() - start:.0f}s; logs in {tracker.run_dir}")
    tracker.close()
    if world > 1:
        finish_distributed()  # barrier, destroy the group, exit 0 skipping the interpreter's shutdown (gloo abort)
