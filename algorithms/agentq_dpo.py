# docs: docs/agentq_dpo.md
"""AgentQ: MCTS-guided rollouts and step-level DPO for LLM agents (Putta et al. 2024; seed 000 eq. 12.8-12.10).

Each iteration: for N tasks (environment seeds) a search tree is grown by S simulations. A simulation
starts at the task's first observation and walks down: at a node with fewer than k children it expands
a new one (choice mode: the next of the policy's k most probable / k sampled action names; free mode: a
fresh sample at temperature > 0), otherwise it picks the child with the highest UCB1 (eq. 12.8). A new
child's action is executed from the parent's `env.snapshot()` (`env.restore`), and the walk goes on
until the episode ends or `--max-depth`; the return observed after each node is backed up as its
Q-value. Preference pairs are then read off the trees: at every node with two or more children, the
child with the highest Q is chosen and the one with the lowest rejected, if their gap reaches
`--min-q-gap` (step-level DPO: same prefix, different action); with `--pair-level trajectory|both`
also the best vs the worst simulation of a tree (eq. 12.9). The policy is trained with the DPO loss
(Rafailov et al. 2023; eq. 12.10) against a frozen copy of the initial policy, and the next iteration
searches with the new policy (self-improvement loop).

Usage:
    python algorithms/agentq_dpo.py                                       # smollm2-135m, GridWorld, choice mode, CPU
    python algorithms/agentq_dpo.py --model tiny --total-iterations 2     # seconds, for a smoke test
    python algorithms/agentq_dpo.py --env-id workspace                     # JSON tool calls, free mode
    python algorithms/agentq_dpo.py --pair-level both                      # step- and trajectory-level pairs
    python algorithms/agentq_dpo.py --lora-r 8                             # LoRA adapters; reference = adapters off
    python algorithms/agentq_dpo.py --device cuda                          # one GPU
    torchrun --nproc_per_node 2 algorithms/agentq_dpo.py --model tiny     # data parallel: each rank searches its trees
    torchrun --nproc_per_node 8 algorithms/agentq_dpo.py --fsdp --model <path>  # layers sharded over the ranks (FSDP2)
    python algorithms/agentq_dpo.py --checkpoint-every 1                   # then, after a crash or Ctrl-C:
    python algorithms/agentq_dpo.py --resume runs/<run> --total-iterations 5  # continue (and extend) that run

Copying this file out: it needs `common/` (and `envs/` for the built-in environments, or any
`package.module:Factory` passed as --env-id with snapshot()/restore()).

Where this departs from the paper / seed:
- AgentQ mixes the MCTS Q with an AI-critic's ranking of the proposed actions; there is no critic here
  (the mixing weight on Q is 1): pairs are ranked by the environment's outcome alone.
- Expansion and rollout are merged: every node a simulation passes through is kept in the tree (the
  tree policy picks unvisited candidates in the policy's order, which is a policy rollout), so each
  simulation adds one branch point and the tree's Q-values are Monte Carlo returns, undiscounted by default.
- The seed's eq. 12.9-12.10 pair whole trajectories; AgentQ (and the default here) pairs steps.
  Log-probs of a choice-mode action are normalised over the action names (the choice policy); the
  normaliser cancels in a step pair's log-ratio difference.
- Under torchrun each rank searches a contiguous block of the --num-tasks trees (batched: one simulation
  per tree in lockstep, one KV cache) and all ranks then train on every rank's pairs: pair j is rank
  j mod N's, and the ranks' gradients on their pairs of a minibatch add up (2 ranks == 1 process).
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro

import envs
from common.chat import ChatFormat
from common.checkpoint import Checkpointer, GracefulInterrupt, cli_with_resume
from common.distributed import (clip_grad_norm, dist_info, finish_distributed, full_tensors, gather_lists, gathered,
                                init_distributed, is_sharded, print0, rank_param_divergence, seed_everything, shard_layers)
from common.models import adapter_disabled, load_model, resolve_device, save_model, train_top_layers
from common.records import ChoiceStep, Trajectory
from common.rollout import (KVBatch, RolloutConfig, RolloutEngine, decode_attention_backend, decode_weight_layout,
                            policy_logprobs, sample_from_logits, score_candidates)
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
    """save the final policy (Hugging Face format; with LoRA the adapter only) to `runs/{run_name}/model`"""
    model: str = "smollm2-135m"
    """`tiny` (random, for tests), `smollm2-135m` (embedded default) or a local model path"""
    env_id: str = "gridworld"
    """environment id (`gridworld`, `workspace`, ...) or `package.module:Factory`; needs snapshot()/restore()"""
    output_dir: str = "runs"
    """where run directories are created"""
    checkpoint_every: int = 0
    """save a checkpoint (trained weights, optimizer, RNG states, counters) every N iterations and at the end; 0: never.
    Ctrl-C (or SIGTERM) always finishes the iteration and saves one before exiting"""
    resume: str = ""
    """a run directory to continue from its checkpoint, with its saved arguments and TensorBoard run"""

    # Algorithm specific arguments
    total_iterations: int = 3
    """AgentQ iterations (search -> pairs -> DPO -> evaluation)"""
    num_tasks: int = 4
    """search trees (environment seeds) per iteration, searched in one batch"""
    num_simulations: int = 6
    """MCTS simulations per tree (each one is an episode from the task's start)"""
    num_candidates: int = 2
    """k: children a node may get (choice: the k most probable or k sampled action names; free: k samples)"""
    action_mode: Literal["auto", "free", "choice"] = "auto"
    """`choice` for environments with action_names, `free` text otherwise (`auto` picks)"""
    expansion: Literal["top", "sample"] = "sample"
    """choice mode: expand the k most probable action names, or k sampled without replacement at --temperature"""
    ucb_c: float = 1.0
    """exploration constant c of UCB1 (eq. 12.8); Q is in the environment's return units"""
    gamma: float = 1.0
    """discount of the returns backed up as Q-values"""
    max_depth: int = 20
    """cap on a simulation's steps (the environment's own step limit also applies)"""
    temperature: float = 2.0
    """temperature of new actions (free: the samples, > 0; choice: the `sample` expansion draw); T = 2 keeps SmolLM2 exploring"""
    top_p: float = 1.0
    """free mode: nucleus sampling of new actions"""
    max_turn_tokens: int = 48
    """free mode: cap on generated tokens per action (a workspace JSON call needs ~30)"""
    choice_token_norm: bool = True
    """TWOSOME normalisation: divide an action's log-prob by its token count (matters for multi-token names)"""
    pair_level: Literal["step", "trajectory", "both"] = "step"
    """step: sibling actions after the same prefix (AgentQ); trajectory: best vs worst simulation of a tree (eq. 12.9)"""
    min_q_gap: float = 0.1
    """a pair is kept only if Q(chosen) - Q(rejected) (or the return gap) is at least this"""
    beta: float = 0.1
    """DPO temperature beta (eq. 12.10)"""
    learning_rate: float = 1e-4
    """AdamW learning rate"""
    dpo_epochs: int = 4
    """passes over an iteration's pairs"""
    pairs_per_step: int = 8
    """pairs per optimizer step (one packed forward of 2x this many sequences)"""
    trainable_layers: int = 6
    """train only the top N transformer layers and the final norm (0, or at least the layer count: the whole model)"""
    lora_r: int = 0
    """LoRA rank (peft) on the trained layers' attention and MLP projections, base frozen; 0: train the weights"""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / r) B A"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    fsdp: bool = False
    """torchrun: shard the decoder layers over the ranks (PyTorch FSDP2), gathered whole for the search, the reference
    pass and evaluation (as in grpo_agent.py)"""
    eval_episodes: int = 4
    """greedy episodes on held-out seeds before training and after every iteration; 0 disables"""

    # filled in at runtime
    world_size: tyro.conf.Suppress[int] = 1
    """number of processes (torchrun)"""


# the flags --resume lets differ from the saved run (none of them changes what the search samples or trains on)
RESUMABLE = {"total_iterations", "checkpoint_every", "eval_episodes", "save_model", "resume", "output_dir"}
# read by tests/test_conformance.py: a few-second `--model tiny` run, and the shared tags it writes
SMOKE_TEST_ARGS = ["--total-iterations", "1", "--num-tasks", "2", "--num-simulations", "3", "--max-depth", "4",
                   "--min-q-gap", "0.0", "--eval-episodes", "1"]
LOGGED_TAGS = ("charts/episodic_return", "charts/success_rate", "charts/episode_length", "charts/num_pairs",
               "losses/dpo_loss", "diagnostics/chosen_reward", "diagnostics/rejected_reward",
               "diagnostics/reward_margin", "diagnostics/reward_accuracy", "diagnostics/q_gap_mean",
               "diagnostics/tree_nodes", "diagnostics/grad_norm", "perf/search_s", "perf/update_s",
               "perf/search_tokens_per_s", "eval/success_rate", "eval/episodic_return")


def validate_args(args: Args):
    problems = []
    for name in ("total_iterations", "num_tasks", "max_depth", "dpo_epochs", "pairs_per_step", "max_turn_tokens"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_simulations < 2 or args.num_candidates < 2:
        problems.append("--num-simulations and --num-candidates must be >= 2: a pair needs two branches")
    if args.beta <= 0:
        problems.append("--beta must be > 0")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.ucb_c < 0 or not 0 < args.gamma <= 1:
        problems.append("--temperature and --ucb-c must be >= 0, --top-p and --gamma in (0, 1]")
    for name in ("min_q_gap", "eval_episodes", "trainable_layers", "checkpoint_every", "lora_r"):
        if getattr(args, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0")
    if args.num_tasks % dist_info()[2]:  # torchrun: each rank searches an equal block of the trees
        problems.append(f"--num-tasks {args.num_tasks} must be divisible by the {dist_info()[2]} processes")
    if args.fsdp and dist_info()[2] < 2:
        problems.append("--fsdp shards over torchrun processes: run it with torchrun --nproc_per_node N (N >= 2)")
    if args.fsdp and args.pair_level == "both" and args.action_mode != "free":  # a sharded forward is collective
        problems.append("--fsdp takes --pair-level step or trajectory in choice/auto mode (both: unequal forwards per rank)")
    if problems:
        raise SystemExit("agentq_dpo.py: " + "; ".join(problems))


# ---- the search tree ------------------------------------------------------------------------------
@dataclass(eq=False)
class Node:
    """A state of one task: the exact token ids the policy reads there, and the environment's snapshot."""

    prefix: list[int]  # system prompt + history + assistant header: token-in/token-out, never re-tokenised
    snapshot: dict | None  # env.snapshot() at this state (None when the episode is over)
    depth: int = 0
    action_ids: list[int] = field(default_factory=list)  # the policy tokens of the action that led here
    action_text: str = ""
    choice_index: int = -1  # choice mode: the action's index in action_names
    reward: float = 0.0  # reward of that action
    done: bool = False
    termination: str = ""
    children: list[Node] = field(default_factory=list)
    visits: int = 0  # N(s, a) of the edge into this node
    value_sum: float = 0.0  # sum of returns observed after taking the action (reward included)
    expansions: int = 0  # candidates drawn here so far (free-mode duplicates count)
    order: list[int] | None = None  # choice mode: action indices to expand, in order

    @property
    def q(self) -> float:
        return self.value_sum / max(self.visits, 1)


def ucb1(parent: Node, child: Node, c: float) -> float:
    """Eq. 12.8: UCB(s, a) = Q(s, a) + c sqrt(ln N(s) / N(s, a)); an unvisited child comes first."""
    return math.inf if child.visits == 0 else child.q + c * math.sqrt(math.log(max(parent.visits, 1)) / child.visits)


def count_nodes(node: Node) -> int:
    return 1 + sum(count_nodes(c) for c in node.children)


def backup(path: list[Node], gamma: float) -> float:
    """Back the simulation's return up the path: each edge's Q sample is its reward plus what followed."""
    ret = 0.0
    for node in reversed(path[1:]):
        ret = node.reward + gamma * ret
        node.visits += 1
        node.value_sum += ret
    path[0].visits += 1
    return ret


@torch.no_grad()
def search(model, chat: ChatFormat, env_list: list, seeds: list[int], args: Args, mode: str, gen: torch.Generator):
    """Grow one tree per (env, seed) with `args.num_simulations` simulations, the trees batched in lockstep.
    Returns (roots, simulations, tokens fed) where simulations[i] is a list of (path, return) per tree."""
    pad_id = chat.tokenizer.pad_token_id if chat.tokenizer.pad_token_id is not None else chat.eos_id
    candidates = [chat.encode(n) for n in env_list[0].action_names] if mode == "choice" else None
    roots = []
    for env, seed in zip(env_list, seeds):
        obs, _ = env.reset(seed=seed)
        roots.append(Node(prefix=chat.prompt_ids(env.system_prompt, obs), snapshot=env.snapshot()))
    sims, tokens = [[] for _ in roots], 0
    for _ in range(args.num_simulations):
        paths = [[root] for root in roots]
        live = list(range(len(roots)))  # trees whose simulation is still walking
        unfed = {i: roots[i].prefix for i in live}
        batch = KVBatch(model, pad_id)  # one cache over the simulations in flight (common/rollout.py)
        while live:
            ended = [i for i in live if paths[i][-1].done or paths[i][-1].depth >= args.max_depth]
            for i in ended:
                sims[i].append((paths[i], backup(paths[i], args.gamma)))
            if ended:
                live_rows = [r for r, i in enumerate(live) if i not in ended]
                live = [live[r] for r in live_rows]
                if not live:
                    break
                batch.keep(live_rows)  # (never on the first step: a root is neither done nor at --max-depth >= 1)
            logits = batch.feed([unfed[i] for i in live])
            nodes = [paths[i][-1] for i in live]
            expand = [n.expansions < args.num_candidates and (mode == "free" or n.expansions < len(candidates)) for n in nodes]
            new_actions: dict[int, tuple[list[int], str, int, list[int]]] = {}  # row -> (ids, text, choice idx, unfed)
            if mode == "choice":
                scores = score_candidates(model, batch.cache, batch.attn, logits, candidates, args.choice_token_norm)
                for r, node in enumerate(nodes):
                    if not expand[r]:
                        continue
                    if node.order is None:  # expansion: the k most probable names, or k drawn without replacement
                        s = scores[r] / (args.temperature or 1.0)
                        if args.expansion == "sample" and args.temperature > 0:
                            s = s - torch.log(-torch.log(torch.rand(s.shape, generator=gen, device=s.device)))  # Gumbel
                        node.order = s.argsort(descending=True)[: args.num_candidates].tolist()
                    k = node.order[node.expansions]
                    new_actions[r] = (candidates[k], env_list[live[r]].action_names[k], k, candidates[k])
            elif any(expand):
                new_actions = generate(batch, logits, expand, chat, args, gen)
            for r, i in enumerate(live):
                node, env = nodes[r], env_list[i]
                if r in new_actions:
                    ids, text, k, to_feed = new_actions[r]
                    node.expansions += 1
                    child = next((c for c in node.children if c.action_ids == ids), None)  # free-mode duplicate
                    if child is None:  # execute the new action from the node's state
                        env.restore(node.snapshot)
                        obs, reward, terminated, truncated, info = env.step(text if mode == "free" else k)
                        done = terminated or truncated
                        segment = chat.next_turn_ids(obs, action_ended_with_eos=bool(ids) and ids[-1] == chat.eos_id)
                        child = Node(prefix=node.prefix + ids + segment, snapshot=None if done else env.snapshot(),
                                     depth=node.depth + 1, action_ids=ids, action_text=text, choice_index=k, reward=float(reward),
                                     done=done, termination=info.get("termination", "") if done else "")
                        node.children.append(child)
                    unfed[i] = to_feed + child.prefix[len(node.prefix) + len(ids):]
                else:  # fully expanded: UCB1 over the children
                    child = max(node.children, key=lambda c: ucb1(node, c, args.ucb_c))
                    unfed[i] = child.prefix[len(node.prefix):]
                paths[i].append(child)
        tokens += batch.tokens
    return roots, sims, tokens


def generate(batch: KVBatch, logits, rows_mask: list[bool], chat: ChatFormat, args: Args, gen) -> dict:
    """Free mode: sample one action for the flagged rows (others feed masked pads), up to EOS or the cap.
    Every sampled token but the last is then in the cache; the last one is returned as still to feed."""
    n = len(rows_mask)
    sampled, done = [[] for _ in range(n)], [not m for m in rows_mask]
    for step in range(args.max_turn_tokens):
        token, _ = sample_from_logits(logits, args.temperature, args.top_p, gen)
        for r in range(n):
            if not done[r]:
                sampled[r].append(int(token[r]))
                done[r] = int(token[r]) == chat.eos_id
        if all(done) or step == args.max_turn_tokens - 1:
            break
        logits = batch.feed([[] if done[r] else [sampled[r][-1]] for r in range(n)])
    return {r: (sampled[r], chat.tokenizer.decode([t for t in sampled[r] if t != chat.eos_id]), -1, sampled[r][-1:])
            for r in range(n) if rows_mask[r]}


# ---- preference pairs -----------------------------------------------------------------------------
@dataclass
class Pair:
    chosen: Trajectory  # prefix + chosen continuation; its policy units are the continuation's actions
    rejected: Trajectory
    prefix_len: int  # both records share token_ids[:prefix_len] exactly
    gap: float  # Q (step) or return (trajectory) difference
    level: str


def make_record(path: list[Node], start: int, candidates, mode: str) -> Trajectory:
    """The record of path[start:] continuing path[start - 1]'s prefix: actions from `start` on are units."""
    ids, mask, steps = list(path[start - 1].prefix), [0] * len(path[start - 1].prefix), []
    for j, node in enumerate(path[start:]):
        if mode == "choice":
            steps.append(ChoiceStep(position=len(ids), candidates=candidates, chosen=node.choice_index, logprob=0.0))
        ids, mask = ids + node.action_ids, mask + [1] * len(node.action_ids)
        if j < len(path) - start - 1:  # the observation after the action, unless it is the record's last
            tail = node.prefix[len(ids):]  # node.prefix = parent prefix + action + this segment
            ids, mask = ids + tail, mask + [0] * len(tail)
    return Trajectory(token_ids=ids, source_mask=mask, behavior_logprobs=[0.0] * len(ids), policy_version=0, turns=[],
                      rewards={}, return_=0.0, termination=path[-1].termination or "truncated", env_version="",
                      task_id="", seed=0, prompt_length=len(path[start - 1].prefix), choice_steps=steps)


def step_pairs(root: Node, candidates, mode: str, min_gap: float) -> list[Pair]:
    """Step-level pairs: at every node with >= 2 visited children, highest-Q child vs lowest-Q child."""
    pairs, stack = [], [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        visited = [c for c in node.children if c.visits > 0]
        if len(visited) < 2:
            continue
        ranked = sorted(visited, key=lambda c: c.q)  # stable: on a tie the first and last expanded differ
        worst, best = ranked[0], ranked[-1]
        if best.q - worst.q >= min_gap:
            pairs.append(Pair(make_record([node, best], 1, candidates, mode), make_record([node, worst], 1, candidates, mode),
                              len(node.prefix), best.q - worst.q, "step"))
    return pairs


def trajectory_pair(sims: list[tuple[list[Node], float]], candidates, mode: str, min_gap: float) -> list[Pair]:
    """Eq. 12.9: the tree's best simulation (chosen) vs its worst (rejected), from where they diverge."""
    ranked = sorted(sims, key=lambda s: s[1])
    (worst, r_worst), (best, r_best) = ranked[0], ranked[-1]
    if r_best - r_worst < min_gap:
        return []
    split = next((j for j in range(1, min(len(best), len(worst))) if best[j] is not worst[j]), None)
    if split is None:  # one path is a prefix of the other (cut by --max-depth): no differing action to compare
        return []
    return [Pair(make_record(best, split, candidates, mode), make_record(worst, split, candidates, mode),
                 len(best[split - 1].prefix), r_best - r_worst, "trajectory")]


# ---- the loss -------------------------------------------------------------------------------------
def dpo_loss(logp_w, logp_l, ref_w, ref_l, beta: float):
    """Eq. 12.10 (Rafailov et al. 2023): -log sigma(beta [(log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))]).

    Inputs are per pair [P]; returns the mean loss and the implicit rewards beta * log(pi / ref) of both sides.
    """
    chosen_reward = beta * (logp_w - ref_w)
    rejected_reward = beta * (logp_l - ref_l)
    loss = -F.logsigmoid(chosen_reward - rejected_reward).mean()
    return loss, chosen_reward.detach(), rejected_reward.detach()


def sequence_logprobs(model, records: list[Trajectory], mode: str, token_norm: bool) -> torch.Tensor:
    """log pi(y|x) per record: the sum over its policy units (tokens in free mode, actions in choice mode)."""
    units = policy_logprobs(model, records, mode, 1.0, token_norm)
    return (units.logprobs * units.mask).sum(1)


def pair_logprobs(model, pairs: list[Pair], mode: str, token_norm: bool) -> torch.Tensor:
    """[P, 2]: (log pi(y_w|x), log pi(y_l|x)) per pair. A choice-mode step pair costs one forward of its prefix: both
    actions are scored at the same position (what follows it cannot change its logits, attention being causal)."""
    out: list = [None] * len(pairs)
    merged = [i for i, p in enumerate(pairs) if mode == "choice" and p.level == "step"]
    rest = [i for i in range(len(pairs)) if i not in set(merged)]
    if merged:
        records = []
        for i in merged:
            p, n = pairs[i], pairs[i].prefix_len
            records.append(replace(p.chosen, token_ids=p.chosen.token_ids[:n], source_mask=[0] * n,
                                   behavior_logprobs=[0.0] * n, choice_steps=p.chosen.choice_steps + p.rejected.choice_steps))
        units = policy_logprobs(model, records, mode, 1.0, token_norm)
        for row, i in enumerate(merged):
            out[i] = units.logprobs[row, :2]
    if rest:
        lp = sequence_logprobs(model, [pairs[i].chosen for i in rest] + [pairs[i].rejected for i in rest], mode,
                               token_norm).view(2, -1)
        for row, i in enumerate(rest):
            out[i] = lp[:, row]
    return torch.stack(out)


if __name__ == "__main__":
    args = cli_with_resume(Args, RESUMABLE, "agentq_dpo.py")
    validate_args(args)
    device = resolve_device(args.device)
    rank, _, world = init_distributed(device)  # torchrun: each rank searches num_tasks / world trees
    args.world_size = world
    run_dir = args.resume or os.path.join(args.output_dir, make_run_name(args.env_id, args.exp_name, args.seed))
    ckpt = Checkpointer(run_dir, args.checkpoint_every, rank, world)
    resumed = ckpt.read() if args.resume else None  # a bad checkpoint fails here, before loading a model
    if resumed and args.total_iterations < resumed["counters"]["iteration"]:
        raise SystemExit(f"--total-iterations {args.total_iterations}: the checkpoint is at iteration "
                         f"{resumed['counters']['iteration']} already")
    try:
        probe = envs.make(args.env_id)  # fail fast on a bad --env-id, before loading a model
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--env-id: {e}")
    names = getattr(probe, "action_names", None)
    mode = ("choice" if names else "free") if args.action_mode == "auto" else args.action_mode
    if mode == "choice" and not names:
        raise SystemExit(f"--action-mode choice needs an environment with action_names; {args.env_id} has none")
    if not (hasattr(probe, "snapshot") and hasattr(probe, "restore")):
        raise SystemExit(f"--env-id: {args.env_id} has no snapshot()/restore(), which the tree search needs")
    if mode == "free" and args.temperature == 0:
        raise SystemExit("--temperature must be > 0 in free mode: k candidates are k samples")

    seed_everything(args.seed, args.torch_deterministic)
    dtype = torch.float32 if args.lora_r == 0 else None  # trained weights in fp32 (bf16 rounds a 1e-5 step away)
    model, tokenizer = load_model(args.model, device, dtype, seed=args.seed)
    # the top --trainable-layers layers and the final norm, or LoRA adapters on them (base frozen, B = 0: starts as the base)
    model = train_top_layers(model, args.trainable_layers, args.lora_r, args.lora_alpha)
    if world > 1:  # identical starting weights on every rank (LoRA's init draws random numbers)
        for p in (p for p in model.parameters() if p.requires_grad):
            dist.broadcast(p.data, src=0)
    fsdp_layers = shard_layers(model) if args.fsdp else []  # (FSDP replaces the layers' parameters by their shards)
    params = [p for p in model.parameters() if p.requires_grad]
    # the frozen initial policy of eq. 12.10; with LoRA, the policy with its adapters off (no second copy)
    ref_model = model if args.lora_r else load_model(args.model, device, dtype, seed=args.seed)[0].requires_grad_(False)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=0.0)
    model.eval()
    gen, py_rng = torch.Generator(device=device).manual_seed(args.seed + rank), random.Random(args.seed)
    generators, first_iteration = {"search": gen, "shuffle": py_rng}, 1
    if resumed:  # trained weights, AdamW moments and every RNG, as they were after the checkpoint's iteration
        ckpt.restore(resumed, model, optimizer, generators=generators)
        first_iteration = resumed["counters"]["iteration"] + 1
        print0(f"resumed from {run_dir} at iteration {first_iteration - 1}")
    chat = ChatFormat(tokenizer)
    candidates = [chat.encode(n) for n in names] if mode == "choice" else None
    engine = RolloutEngine(model, tokenizer, RolloutConfig(action_mode=mode, temperature=0.0, max_turn_tokens=args.max_turn_tokens,
                                                           choice_token_norm=args.choice_token_norm))
    tracker = Tracker(run_dir, vars(args), enabled=rank == 0, resume_state=resumed and resumed["tracker"])
    print0(f"run {os.path.basename(run_dir)}: {args.model} on {args.env_id}, {mode} mode, {args.num_tasks} trees x "
           f"{args.num_simulations} simulations, k = {args.num_candidates}")
    start = time.time()

    def run_eval(iteration: int):
        """Greedy episodes (temperature 0, no RNG drawn) on seeds disjoint from the search's task seeds."""
        if args.eval_episodes > 0:
            seeds = [(1 << 40) + args.seed * 1000 + i for i in range(args.eval_episodes)][rank::world]  # torchrun: shares
            with gathered(fsdp_layers):  # FSDP: whole weights, as the ranks' shares differ
                trajs = engine.run([envs.make(args.env_id) for _ in seeds], seeds, args.env_id) if seeds else []
            got = gather_lists({"success_rate": [t.success for t in trajs], "episodic_return": [t.return_ for t in trajs],
                                "episode_length": [t.num_steps for t in trajs]}, world)
            metrics = {k: float(np.mean(v)) for k, v in got.items()}
            tracker.scalars({f"eval/{k}": v for k, v in metrics.items()}, iteration)
            tracker.trajectories(trajs, iteration, limit=1)
            print0(f"eval @ iter {iteration} | greedy success {metrics['success_rate']:.2f} "
                   f"| return {metrics['episodic_return']:.2f} | length {metrics['episode_length']:.1f}")

    if not resumed:
        run_eval(0)
    interrupt = GracefulInterrupt().start()  # Ctrl-C / SIGTERM: finish this iteration, save a checkpoint, exit
    for iteration in range(first_iteration, args.total_iterations + 1):
        # ---- search: one MCTS tree per task, with the current policy ----
        t0 = time.time()
        block = args.num_tasks // world  # torchrun: this rank's contiguous block of the iteration's tasks
        seeds = [(args.seed * 100_000 + iteration) * 1_000 + i for i in range(rank * block, (rank + 1) * block)]
        # FSDP: whole weights (the ranks' trees differ); CPU: decode-speed layouts of weights and keys (common/rollout.py)
        with gathered(fsdp_layers), decode_weight_layout(model), decode_attention_backend(model):
            roots, sims, tokens = search(model, chat, [envs.make(args.env_id) for _ in seeds], seeds, args, mode, gen)
        search_s = time.time() - t0

        # ---- preference pairs (step-level by default; eq. 12.9 by flag), then every rank's, on every rank ----
        pairs = []
        for root, tree in zip(roots, sims):
            if args.pair_level in ("step", "both"):
                pairs += step_pairs(root, candidates, mode, args.min_q_gap)
            if args.pair_level in ("trajectory", "both"):
                pairs += trajectory_pair(tree, candidates, mode, args.min_q_gap)
        found = gather_lists({"pairs": pairs, "tokens": [tokens], "nodes": [count_nodes(r) for r in roots],
                              "returns": [sum(n.reward for n in path[1:]) for tree in sims for path, _ in tree],
                              "success": [path[-1].termination == "success" for tree in sims for path, _ in tree],
                              "lengths": [len(path) - 1 for tree in sims for path, _ in tree],
                              "tree_success": [any(p[-1].termination == "success" for p, _ in tree) for tree in sims]}, world)
        pairs = found["pairs"]

        # ---- DPO against the frozen initial policy (eq. 12.10) ----
        t1, size = time.time(), args.pairs_per_step
        stats = {"chosen": [], "rejected": [], "grad_norm": []}
        if pairs:
            own, ref = list(range(rank, len(pairs), world)), torch.zeros(len(pairs), 2, device=device)  # torchrun: a share
            with torch.no_grad(), adapter_disabled(ref_model) as reference, \
                    gathered(fsdp_layers if reference is model else []):  # reference log-probs: once per iteration
                for i in range(0, len(own), size):
                    ref[own[i:i + size]] = pair_logprobs(reference, [pairs[j] for j in own[i:i + size]], mode,
                                                         args.choice_token_norm)
            model.train()
            for epoch in range(args.dpo_epochs):
                order = list(range(len(pairs)))
                py_rng.shuffle(order)
                for i in range(0, len(order), size):
                    idx = order[i:i + size]
                    mine = [j for j in idx if j % world == rank]  # torchrun: its own pairs in the minibatch (maybe none)
                    optimizer.zero_grad()
                    if mine:
                        logp = pair_logprobs(model, [pairs[j] for j in mine], mode, args.choice_token_norm)
                        loss, chosen_r, rejected_r = dpo_loss(logp[:, 0], logp[:, 1], ref[mine, 0], ref[mine, 1], args.beta)
                        # x world, then averaged over ranks (FSDP's reduce-scatter averages): the minibatch's mean loss
                        (loss * len(mine) / len(idx) * world).backward()
                    elif fsdp_layers:  # a sharded layer's forward/backward is collective: a zero-weight pass joins it
                        (pair_logprobs(model, [pairs[idx[0]]], mode, args.choice_token_norm).sum() * 0).backward()
                    if world > 1:
                        for p in (p for p in params if not is_sharded(p)):
                            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                            dist.all_reduce(p.grad)
                            p.grad /= world
                    grad_norm = clip_grad_norm(params, args.max_grad_norm)  # FSDP: the norm over every rank's slices
                    optimizer.step()
                    if epoch == 0 and mine:  # the first pass: every pair scored once, by the weights of this iteration
                        stats["chosen"] += chosen_r.tolist()
                        stats["rejected"] += rejected_r.tolist()
                    if epoch == 0:
                        stats["grad_norm"].append(grad_norm)
            model.eval()
        update_s = time.time() - t1

        # ---- logging ----
        stats.update(gather_lists({k: stats[k] for k in ("chosen", "rejected")}, world))
        chosen, rejected = np.array(stats["chosen"] or [0.0]), np.array(stats["rejected"] or [0.0])
        mean = lambda xs: float(np.mean(xs)) if xs else 0.0  # no pairs: 0 rather than NaN
        tokens = sum(found["tokens"])
        scalars = {
            "charts/episodic_return": mean(found["returns"]), "charts/success_rate": mean(found["success"]),
            "charts/tree_success_rate": mean(found["tree_success"]), "charts/episode_length": mean(found["lengths"]),
            "charts/num_pairs": float(len(pairs)), "charts/num_step_pairs": float(sum(p.level == "step" for p in pairs)),
            "losses/dpo_loss": float(np.logaddexp(0.0, rejected - chosen).mean()) if pairs else 0.0,  # -log sigma(margin)
            "diagnostics/chosen_reward": float(chosen.mean()), "diagnostics/rejected_reward": float(rejected.mean()),
            "diagnostics/reward_margin": float((chosen - rejected).mean()),
            "diagnostics/reward_accuracy": float((chosen > rejected).mean()) if pairs else 0.0,
            "diagnostics/q_gap_mean": mean([p.gap for p in pairs]),
            "diagnostics/tree_nodes": mean(found["nodes"]), "diagnostics/grad_norm": mean(stats["grad_norm"]),
            "perf/search_s": search_s, "perf/update_s": update_s, "perf/search_tokens_per_s": tokens / search_s,
        }
        if world > 1:  # every rank applied the same summed gradients: their weights must agree exactly
            scalars["diagnostics/rank_param_divergence"] = rank_param_divergence(params)
        tracker.scalars(scalars, iteration)
        print0(f"iter {iteration}/{args.total_iterations} | search success {scalars['charts/success_rate']:.2f} "
               f"| return {scalars['charts/episodic_return']:.2f} | pairs {len(pairs)} "
               f"| dpo loss {scalars['losses/dpo_loss']:.4f} | margin {scalars['diagnostics/reward_margin']:+.4f} "
               f"| acc {scalars['diagnostics/reward_accuracy']:.2f} | {search_s + update_s:.1f}s "
               f"(search {search_s:.1f}, update {update_s:.1f}) | {scalars['perf/search_tokens_per_s']:.0f} tok/s")
        run_eval(iteration)
        stop = interrupt.should_stop()
        if ckpt.due(iteration, last=iteration == args.total_iterations) or stop:  # no buffer crosses iterations
            ckpt.save({"iteration": iteration}, model, optimizer, generators=generators, tracker=tracker)
            print0(f"checkpoint saved in {run_dir} (iteration {iteration})")
        if stop:
            print0(f"interrupted: resume with  python {sys.argv[0]} --resume {run_dir}")
            tracker.close()
            raise SystemExit(130)
    interrupt.stop()

    weights = full_tensors(model.state_dict()) if args.save_model and fsdp_layers else None  # FSDP: collective
    if args.save_model and rank == 0:
        save_model(model, tokenizer, path := os.path.join(run_dir, "model"), weights)  # LoRA: adapter + base record
        print0(f"model saved to {path}")
    print0(f"done in {time.time() - start:.0f}s; logs in {run_dir}")
    tracker.close()
    if world > 1:
        finish_distributed()  # barrier, destroy the group, exit 0 skipping the interpreter's shutdown (gloo abort)
