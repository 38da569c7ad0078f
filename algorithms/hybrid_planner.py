# docs: docs/hybrid_planner.md
"""Hybrid agent: an LLM planner called rarely + an RL controller called every step (seed 003 §5, §7-8).

The planner returns subgoals, each with the observation it expects when done (seed 003's "预期观察"); a small
Q-network conditioned on the current subgoal picks every move or skill. The agent replans when an expectation is
violated (3 steps past the subgoal's expected duration), when the plan is exhausted, or every N steps. `--planner
llm` is the hybrid, `oracle` the same controller under a shortest-path planner (the upper bound), `none` the
controller alone (pure RL); the pure-LLM agent is `benchmarks/zero_shot.py --action-mode choice`.

Usage:
    python algorithms/hybrid_planner.py                                   # smollm2-135m planner, seed-003 GridWorld, CPU
    python algorithms/hybrid_planner.py --planner none                    # pure RL: the controller alone
    python algorithms/hybrid_planner.py --model tiny --total-episodes 40  # seconds, for a smoke test
    python algorithms/hybrid_planner.py --device cuda                     # the planner on one GPU
    torchrun --nproc_per_node=2 algorithms/hybrid_planner.py              # 2 processes (add --device cuda: a GPU each)
    python algorithms/hybrid_planner.py --checkpoint-every 100            # then, after a crash or Ctrl-C:
    python algorithms/hybrid_planner.py --resume runs/<run> [--total-episodes 1200]
    python algorithms/hybrid_planner.py --env-id babyai-gotolocal --planner oracle  # minigrid's BabyAIBot plans
    python benchmarks/hybrid_three_way.py                                 # seed 003's three-way table

Copying this file out: it needs `common/` (models, chat, rollout, tracking, checkpoint, distributed) and `envs/`;
`envs/subgoals.py` says what a subgoal is in each environment (its features, skills, oracle planner).

Under torchrun each rank plays its own episodes (seeds offset by rank) into its own replay buffer, with its own
planner and cache; `--total-episodes` counts all ranks' episodes. Every update averages the Q-network gradients over
ranks (lockstep: one update per step of the round's longest episode); a checkpoint holds every rank's replay buffer.

Where this departs from the seed:
- The controller is a Double DQN (van Hasselt et al. 2016) over a one-hot grid, as the seed's "Q-learning 训练的
  策略网络", not PPO: replay reuses every (planner-expensive) step. Under a planner it is paid a bonus for its
  subgoal instead of the goal reward, and a reached subgoal ends its episode (h-DQN, Kulkarni et al. 2016).
- A 135M model cannot write a reliable free-form plan: the planner *chooses* each subgoal among the candidates the
  environment offers (GridWorld: remaining resources and goals; BabyAI: go to / pick up / open an object in the
  room, drop) by the log-probability of its description (GLAM-style), with the environment's wording as expected
  observation and the Manhattan distance as expected duration; its answers are cached by prompt.
- The controller sees the whole grid (and, on BabyAI, the mission's words and the target in its own frame), not
  the egocentric view. One skill on GridWorld, `collect_adjacent`; none on BabyAI. Steps left are in the state.
"""

from __future__ import annotations

import io
import json
import os
import random
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import envs
from common.chat import ChatFormat
from common.checkpoint import Checkpointer, GracefulInterrupt, cli_with_resume
from common.distributed import (all_reduce_mean, dist_info, finish_distributed, init_distributed, print0,
                                rank_param_divergence, seed_everything)
from common.models import load_model, resolve_device
from common.rollout import score_candidates
from common.tracking import Tracker, make_run_name
from envs.subgoals import Subgoal, subgoal_interface


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of the experiment (model init for `tiny`, controller init, exploration, environment seeds)"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms, so the same seed gives the same numbers on CPU"""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N` or `auto` (the planner LLM; the controller is tiny and stays on the CPU)"""
    save_model: bool = False
    """save the planner LLM (Hugging Face format) to `runs/{run_name}/model` and the controller to `controller.pt`"""
    model: str = "smollm2-135m"
    """planner LLM: `tiny` (random, for tests), `smollm2-135m` (embedded default) or a local model path"""
    env_id: str = "gridworld"
    """`gridworld` (seed-003 layout), `gridworld-procedural` (random layouts; train split by default) or a BabyAI
    level, e.g. `babyai-gotolocal` (needs minigrid)"""
    output_dir: str = "runs"
    """where run directories are created"""
    checkpoint_every: int = 0
    """checkpoint (Q-networks, replay buffers, Adam, RNGs) every N episodes and at the end; 0: only on Ctrl-C/SIGTERM"""
    resume: str = ""
    """a run directory to continue from its checkpoint, with its saved arguments and TensorBoard run"""

    # Algorithm specific arguments
    planner: Literal["llm", "oracle", "none"] = "llm"
    """`llm`: hybrid; `oracle`: the environment's solver (GridWorld: shortest path; BabyAI: BabyAIBot) as planner
    (upper bound); `none`: the controller alone (pure RL)"""
    total_episodes: int = 800
    """training episodes of the controller"""
    max_subgoals: int = 3
    """subgoals per plan (a plan also ends at the first goal)"""
    replan_on_mismatch: bool = True
    """replan when a subgoal's expected observation has not appeared within its expected steps + bound"""
    replan_bound: int = 3
    """steps of slack past a subgoal's expected duration before its expectation counts as violated (seed 003: 3)"""
    replan_when_exhausted: bool = True
    """replan when every subgoal of the plan is done (otherwise the controller goes on without a subgoal)"""
    replan_every: int = 0
    """also replan every N steps (seed 003's first design used 10, its experiment 5); 0 disables"""
    skills: bool = True
    """let the controller call the skill library (GridWorld: `collect_adjacent`) in addition to the primitive actions"""
    subgoal_bonus: float = 3.0
    """controller reward for reaching its subgoal; under a planner it replaces the goal reward (+3)"""
    learning_rate: float = 1e-3
    """Adam learning rate of the controller"""
    gamma: float = 0.97
    """discount of the controller's TD target"""
    buffer_size: int = 50_000
    """replay buffer capacity (transitions)"""
    replay_batch_size: int = 64
    """transitions per DQN update"""
    learning_starts: int = 300
    """transitions collected before the first update"""
    target_update_every: int = 250
    """updates between hard copies of the online network into the target network"""
    epsilon_start: float = 1.0
    """initial exploration rate"""
    epsilon_end: float = 0.05
    """final exploration rate"""
    exploration_fraction: float = 0.6
    """fraction of the training episodes over which epsilon decays linearly"""
    hidden_size: int = 128
    """width of the controller's two hidden layers"""
    log_every: int = 25
    """episodes per logged training point"""
    eval_every: int = 200
    """greedy evaluation every N training episodes (and before training and at the end); 0: only at the end"""
    eval_episodes: int = 50
    """episodes per greedy evaluation (seed 003 reports 50)"""
    eval_env_kwargs: str = "{}"
    """JSON keyword arguments for the evaluation environment, e.g. '{"split": "test"}' for held-out layouts"""


# read by tests/test_conformance.py: a few-second `--model tiny` run, and the shared tags it writes
SMOKE_TEST_ARGS = ["--total-episodes", "12", "--learning-starts", "20", "--replay-batch-size", "16", "--log-every", "6",
                   "--eval-every", "6", "--eval-episodes", "2"]
LOGGED_TAGS = ("charts/episodic_return", "charts/success_rate", "charts/episode_length", "charts/resources",
               "charts/llm_calls_per_episode", "charts/replans_per_episode", "losses/td_loss", "losses/q_values",
               "diagnostics/epsilon", "diagnostics/skill_rate", "perf/planner_ms_per_step", "perf/controller_ms_per_step",
               "eval/success_rate", "eval/episodic_return", "eval/resources", "eval/llm_calls_per_episode")

# the flags --resume lets differ from the saved run (none of them changes what the controller trains on)
RESUMABLE = {"total_episodes", "checkpoint_every", "eval_every", "eval_episodes", "save_model", "resume", "output_dir"}


def validate_args(args: Args, world: int = 1) -> dict:
    problems = [f"--total-episodes {args.total_episodes} must be divisible by the {world} processes"] \
        if args.total_episodes % world else []
    problems += [f"--{n.replace('_', '-')} must be >= 1" for n in ("total_episodes", "max_subgoals", "replay_batch_size",
                 "buffer_size", "target_update_every", "log_every", "eval_episodes", "hidden_size") if getattr(args, n) < 1]
    if min(args.replan_bound, args.replan_every, args.eval_every, args.learning_starts, args.checkpoint_every) < 0:
        problems.append("--replan-bound, --replan-every, --eval-every, --learning-starts, --checkpoint-every must be >= 0")
    if not (0 <= args.epsilon_end <= args.epsilon_start <= 1 and 0 < args.exploration_fraction <= 1 and 0 < args.gamma <= 1):
        problems.append("need 0 <= --epsilon-end <= --epsilon-start <= 1, 0 < --exploration-fraction <= 1, 0 < --gamma <= 1")
    try:
        eval_kwargs = json.loads(args.eval_env_kwargs)
        assert isinstance(eval_kwargs, dict)
    except (json.JSONDecodeError, AssertionError):
        problems.append(f"--eval-env-kwargs must be a JSON object, got {args.eval_env_kwargs!r}")
        eval_kwargs = {}
    if problems:
        raise SystemExit("hybrid_planner.py: " + "; ".join(problems))
    return eval_kwargs


# ---- planners: both return a list of Subgoals (envs/subgoals.py: what a subgoal is in each environment) ----
class LLMPlanner:
    """Chooses subgoals one by one by the LM's (length-normalised) log-probability of their descriptions."""

    def __init__(self, model, tokenizer, device, max_subgoals: int):
        self.model, self.chat, self.device, self.max_subgoals = model, ChatFormat(tokenizer), device, max_subgoals
        self.cache: dict[tuple, int] = {}  # (prompt, candidates) -> choice
        self.plans = self.model_calls = self.cache_hits = 0

    @torch.no_grad()
    def choose(self, system: str, observation: str, planned: list[Subgoal], cands: list[Subgoal]) -> int:
        so_far = "".join(f"\nStep {i + 1}: {s.description}." for i, s in enumerate(planned))
        user = f"{observation}\nPlan so far:{so_far or ' nothing yet.'}\nWhat should step {len(planned) + 1} be?"
        key = (user, tuple(c.description for c in cands))
        self.cache_hits += key in self.cache
        if key not in self.cache:
            self.model_calls += 1
            prompt = torch.tensor([self.chat.prompt_ids(system, user)], device=self.device)
            out = self.model(input_ids=prompt, use_cache=True)
            scores = score_candidates(self.model, out.past_key_values, torch.ones_like(prompt), out.logits[:, -1],
                                      [self.chat.encode(c.description.capitalize() + ".") for c in cands], True)
            self.cache[key] = int(scores[0].argmax())
        return self.cache[key]

    def plan(self, domain) -> list[Subgoal]:
        self.plans += 1
        observation, planned = domain.planner_observation(), []
        while len(planned) < self.max_subgoals and not domain.plan_complete(planned):
            cands = domain.candidates(planned)
            if not cands:
                break
            planned.append(cands[self.choose(domain.planner_system, observation, planned, cands)])
        return planned


class OraclePlanner:
    """The environment's own solver (GridWorld: a shortest path; BabyAI: minigrid's BabyAIBot): the upper bound."""

    def __init__(self, max_subgoals: int):
        self.max_subgoals, self.plans, self.model_calls, self.cache_hits = max_subgoals, 0, 0, 0

    def plan(self, domain) -> list[Subgoal]:
        self.plans += 1
        return domain.oracle_plan(self.max_subgoals)


# ---- controller: Double DQN ----
class QNetwork(nn.Module):
    def __init__(self, in_dim: int, hidden: int, num_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def double_dqn_targets(rewards, dones, next_q_online, next_q_target, next_mask, gamma: float) -> torch.Tensor:
    """y = r + γ (1 - done) Q_target(s', argmax_a' Q_online(s', a')), over the actions allowed in s'."""
    next_q_online = next_q_online.masked_fill(~next_mask, -torch.inf)
    best = next_q_online.argmax(1, keepdim=True)
    return rewards + gamma * (1 - dones) * next_q_target.gather(1, best).squeeze(1)


def td_loss(q_taken: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Huber loss between Q(s, a) and the (fixed) targets, as in DQN."""
    return F.smooth_l1_loss(q_taken, targets.detach())


class Replay:
    FIELDS = ("obs", "actions", "rewards", "next_obs", "dones", "next_masks")

    def __init__(self, size: int, dim: int, num_actions: int):
        self.obs, self.next_obs = np.zeros((size, dim), np.float32), np.zeros((size, dim), np.float32)
        self.actions, self.rewards = np.zeros(size, np.int64), np.zeros(size, np.float32)
        self.dones, self.next_masks = np.zeros(size, np.float32), np.zeros((size, num_actions), bool)
        self.size, self.n, self.i = size, 0, 0

    def add(self, obs, action, reward, next_obs, done, next_mask):
        j = self.i
        self.obs[j], self.actions[j], self.rewards[j], self.next_obs[j] = obs, action, reward, next_obs
        self.dones[j], self.next_masks[j] = done, next_mask
        self.i, self.n = (j + 1) % self.size, min(self.n + 1, self.size)

    def sample(self, k: int, rng: np.random.Generator):
        idx = rng.integers(0, self.n, k)
        return [torch.from_numpy(getattr(self, f)[idx]) for f in self.FIELDS]

    def state_dict(self) -> dict:  # the filled rows, copied (a view would save the whole array) into tensors
        return {"n": self.n, "i": self.i, **{f: torch.from_numpy(getattr(self, f)[: self.n].copy()) for f in self.FIELDS}}

    def load_state_dict(self, state: dict):
        for f in self.FIELDS:
            getattr(self, f)[: state["n"]] = state[f].numpy()
        self.n, self.i = state["n"], state["i"]


# ---- one episode of the hybrid agent ----
def run_episode(env, seed: int, planner, qnet: QNetwork, epsilon: float, args: Args,
                rng: random.Random, replay: Replay | None = None, on_step=None) -> dict:
    """Plays one episode; stores controller transitions in `replay` if given. Returns its metrics and replans."""
    domain = subgoal_interface(env)  # the environment's subgoals, features and oracle (envs/subgoals.py)
    observation, _ = env.reset(seed=seed)
    plan_, current, since, since_plan = [], None, 0, 0
    replans: list[tuple[int, str]] = []  # (step, cause)
    total, planner_s, controller_s, skill_uses = 0.0, 0.0, 0.0, 0
    calls_before, model_calls_before = (planner.plans, planner.model_calls) if planner else (0, 0)
    step, done, info = 0, False, {}

    def replan(cause: str):
        nonlocal plan_, current, since, since_plan, planner_s
        t = time.perf_counter()
        plan_ = planner.plan(domain)
        planner_s += time.perf_counter() - t
        current, since, since_plan = domain.next_subgoal(plan_), 0, 0
        replans.append((step, cause))

    if planner is not None:
        replan("start")
    while not done:
        x, mask = domain.features(current), domain.action_mask(args.skills and planner is not None)
        t = time.perf_counter()
        if rng.random() < epsilon:
            action = rng.choice(np.flatnonzero(mask).tolist())
        else:
            with torch.no_grad():
                q = qnet(torch.from_numpy(x)[None])[0].masked_fill(~torch.from_numpy(mask), -torch.inf)
            action = int(q.argmax())
        move = domain.env_action(action)  # a skill resolves to the primitive action it takes now
        skill_uses += action >= domain.num_primitives
        controller_s += time.perf_counter() - t
        observation, reward, terminated, truncated, info = env.step(move)
        step, since, since_plan = step + 1, since + 1, since_plan + 1
        done = terminated or truncated
        reached = domain.reached(current, observation)  # the world agrees and the expected observation appeared
        if replay is not None:
            # h-DQN: under a planner, paid for its subgoal (reward - task part + bonus), which ends its episode
            ctrl_reward = reward if planner is None else \
                reward - info["reward_components"]["task"] + args.subgoal_bonus * reached
            replay.add(x, action, ctrl_reward, domain.features(None if reached else current),
                       float(done or reached), domain.action_mask(args.skills and planner is not None))
        total += reward
        if on_step:
            on_step(done)
        if done or planner is None:
            continue
        # ---- replanning triggers (seed 003, pit 3): expectation violated, plan exhausted, periodic ----
        if reached:
            current, since = domain.next_subgoal(plan_), 0
            if current is None and args.replan_when_exhausted:
                replan("exhausted")
        elif args.replan_on_mismatch and current is not None and since > current.expected_steps + args.replan_bound:
            replan("mismatch")
        elif args.replan_every and since_plan >= args.replan_every:
            replan("periodic")
    return {"return": total, "success": float(info.get("termination") == "success"), "length": step,
            "resources": domain.resources(), "replans": replans, "skill_uses": skill_uses,
            "planner_calls": (planner.plans - calls_before) if planner else 0,
            "llm_calls": (planner.model_calls - model_calls_before) if planner else 0,
            "planner_ms_per_step": 1000 * planner_s / step, "controller_ms_per_step": 1000 * controller_s / step}


def gather(obj) -> list:
    """Every rank's `obj`, in rank order (as bytes: tensors travel too); `[obj]` without torchrun."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    buffer, blobs = io.BytesIO(), [None] * dist.get_world_size()
    torch.save(obj, buffer)
    dist.all_gather_object(blobs, buffer.getvalue())
    return [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]


def summarize(results: list[dict]) -> dict[str, float]:
    """Means over episodes (every rank's, under torchrun) of what run_episode measured; planner calls per episode."""
    mean = lambda k: float(np.mean([r[k] for r in results]))
    return {"success_rate": mean("success"), "episodic_return": mean("return"), "resources": mean("resources"),
            "episode_length": mean("length"), "llm_calls_per_episode": mean("planner_calls"),
            "llm_model_calls_per_episode": mean("llm_calls"),
            "replans_per_episode": float(np.mean([len(r["replans"]) for r in results])),
            "planner_ms_per_step": mean("planner_ms_per_step"), "controller_ms_per_step": mean("controller_ms_per_step")}


def evaluate(env, planner, qnet, args, num: int, seed: int) -> dict[str, float]:
    """Greedy controller on evaluation seeds disjoint from training seeds (shared among the ranks under torchrun)."""
    rng, (rank, _, world) = random.Random(seed), dist_info()
    mine = [run_episode(env, (1 << 40) + seed * 1000 + i, planner, qnet, 0.0, args, rng) for i in range(rank, num, world)]
    return summarize([r for part in gather(mine) for r in part])


if __name__ == "__main__":
    args = cli_with_resume(Args, RESUMABLE, "hybrid_planner.py")
    eval_kwargs = validate_args(args, world=dist_info()[2])
    device = resolve_device(args.device)
    try:
        train_env, eval_env = envs.make(args.env_id), envs.make(args.env_id, **eval_kwargs)
        domain = subgoal_interface(train_env)
    except (ValueError, TypeError, ImportError) as e:
        raise SystemExit(f"--env-id {args.env_id}: {e}")
    rank, local_rank, world = init_distributed(torch.device("cpu"))  # gloo: the ranks exchange CPU tensors only
    if world > 1 and device.type == "cuda" and device.index is None:  # a GPU per rank for its planner
        device = torch.device("cuda", local_rank)
    run_dir = args.resume or os.path.join(args.output_dir, make_run_name(args.env_id, args.exp_name, args.seed))
    ckpt = Checkpointer(run_dir, args.checkpoint_every, rank, world)
    resumed = ckpt.read() if args.resume else None  # a bad checkpoint fails here, before loading a model
    if resumed and args.total_episodes < resumed["counters"]["iteration"]:
        raise SystemExit(f"--total-episodes {args.total_episodes}: the run is at episode {resumed['counters']['iteration']}")
    seed_everything(args.seed, args.torch_deterministic)  # the planner and Q-network init: the same on every rank
    rng, np_rng = random.Random(args.seed + 1000 * rank), np.random.default_rng(args.seed + 1000 * rank)

    model, tokenizer = load_model(args.model, device, seed=args.seed) if args.planner == "llm" else (None, None)
    planner = LLMPlanner(model.eval(), tokenizer, device, args.max_subgoals) if model is not None else \
        OraclePlanner(args.max_subgoals) if args.planner == "oracle" else None
    train_env.reset(seed=0)
    dim, num_actions = len(domain.features(None)), len(domain.action_names)
    qnet, target_net = QNetwork(dim, args.hidden_size, num_actions), QNetwork(dim, args.hidden_size, num_actions)
    for p in qnet.parameters() if world > 1 else ():  # identical networks on every rank: broadcast, not seeding alone
        dist.broadcast(p.data, src=0)
    target_net.load_state_dict(qnet.state_dict())
    optimizer = torch.optim.Adam(qnet.parameters(), lr=args.learning_rate)
    replay = Replay(args.buffer_size, dim, num_actions)

    tracker = Tracker(run_dir, vars(args), enabled=rank == 0, resume_state=resumed and resumed["tracker"])
    print0(f"run {os.path.basename(run_dir)}: planner {args.planner}{' (' + args.model + ')' if model is not None else ''}"
           f" on {args.env_id}, {args.total_episodes} episodes{f' over {world} processes' if world > 1 else ''}")

    def run_eval(episode: int):
        m = evaluate(eval_env, planner, qnet, args, args.eval_episodes, args.seed)
        tracker.scalars({f"eval/{k}": v for k, v in m.items()}, episode)
        print0(f"eval @ {episode} episodes | success {m['success_rate']:.2f} | return {m['episodic_return']:.2f} | "
               f"resources {m['resources']:.2f} | steps {m['episode_length']:.1f} | planner calls/ep "
               f"{m['llm_calls_per_episode']:.1f} | planner {m['planner_ms_per_step']:.1f} ms/step | controller "
               f"{m['controller_ms_per_step']:.2f} ms/step")

    start, updates, window, first_episode, others_playing = time.time(), 0, [], world, False  # episodes: all ranks' ones
    recent_losses, recent_q = deque(maxlen=200), deque(maxlen=200)
    decay_episodes = max(1, int(args.exploration_fraction * args.total_episodes))
    generators = {"python": rng, "numpy": np_rng}
    if resumed:  # everything the next episode depends on, as it was after the checkpoint's episode
        ckpt.restore(resumed, qnet, optimizer, generators=generators)  # online Q-network, Adam, this rank's RNGs
        counters, extra = resumed["counters"], resumed["extra"]
        first_episode, updates = counters["iteration"] + world, counters["updates"]
        decay_episodes = counters["decay_episodes"]  # the saved run's ε schedule: a longer run goes on at --epsilon-end
        target_net.load_state_dict(extra["target"])
        mine = extra["ranks"][rank] if "ranks" in extra else extra  # this rank's buffers ("ranks": since torchrun)
        replay.load_state_dict(mine["replay"])
        recent_losses, recent_q = (deque(values, maxlen=200) for values in mine["recent"])
        window = mine["window"]  # the unfinished logging window
        if args.planner == "llm":  # its answers are deterministic, but a lost cache would cost LLM calls
            planner.cache = {(user, tuple(descs)): pick for user, descs, pick in mine["llm_cache"]}
        print0(f"resumed from {run_dir} at episode {first_episode - world} ({replay.n} transitions, {updates} updates)")
    else:
        run_eval(0)
    interrupt = GracefulInterrupt().start()  # Ctrl-C / SIGTERM: finish this episode, save a checkpoint, exit
    for episode in range(first_episode, args.total_episodes + 1, world):
        own = episode - world + 1 + rank  # this rank's episode among all ranks': its seed and ε
        epsilon = max(args.epsilon_end, args.epsilon_start - (args.epsilon_start - args.epsilon_end) * own / decay_episodes)
        last = episode == args.total_episodes
        reached = lambda every, e=episode: every > 0 and e // every > (e - world) // every  # crossed a multiple of every?

        def learn(done: bool):  # one DQN update per environment step
            global updates, others_playing
            ready = replay.n >= max(args.learning_starts, args.replay_batch_size)
            if world > 1:  # lockstep: update when every rank can; a rank whose episode ended goes on updating
                flags = torch.tensor([float(not done), float(ready)])  # while another rank still plays
                dist.all_reduce(flags)
                others_playing, ready = bool(flags[0] > 0), bool(flags[1] == world)
            if not ready:
                return
            obs, act, rew, nxt, dn, nmask = replay.sample(args.replay_batch_size, np_rng)
            q = qnet(obs).gather(1, act[:, None]).squeeze(1)
            with torch.no_grad():
                y = double_dqn_targets(rew, dn, qnet(nxt), target_net(nxt), nmask, args.gamma)
            loss = td_loss(q, y)
            optimizer.zero_grad()
            loss.backward()
            for p in qnet.parameters() if world > 1 else ():  # equal batches: the mean of the ranks' gradients is
                dist.all_reduce(p.grad)  # the gradient on all of them; every rank takes the same step
                p.grad /= world
            nn.utils.clip_grad_norm_(qnet.parameters(), 10.0)
            optimizer.step()
            updates += 1
            if updates % args.target_update_every == 0:
                target_net.load_state_dict(qnet.state_dict())
            recent_losses.append(loss.item())
            recent_q.append(q.mean().item())

        result = run_episode(train_env, args.seed * 1_000_003 + own, planner, qnet, epsilon, args, rng, replay, learn)
        while others_playing:
            learn(done=True)
        window.append(result)
        if reached(args.log_every) or last:
            merged = [r for part in gather(window) for r in part]  # every rank's episodes since the last point
            m, causes = summarize(merged), Counter(c for r in merged for _, c in r["replans"])
            losses = all_reduce_mean({"td": float(np.mean(recent_losses)) if recent_losses else 0.0,
                                      "q": float(np.mean(recent_q)) if recent_q else 0.0})
            scalars = {
                **{("perf/" if "_ms_" in k else "charts/") + k: v for k, v in m.items()},
                **{f"charts/replans_{c}": causes[c] / len(merged) for c in ("start", "mismatch", "exhausted", "periodic")},
                "losses/td_loss": losses["td"], "losses/q_values": losses["q"],
                "diagnostics/epsilon": epsilon, "diagnostics/updates": updates,
                "diagnostics/skill_rate": sum(r["skill_uses"] for r in merged) / sum(r["length"] for r in merged),
                "perf/episodes_per_s": (episode - first_episode + world) / (time.time() - start)}
            if world > 1:  # every rank applied the same averaged updates: both networks must agree exactly
                networks = [*qnet.parameters(), *target_net.parameters()]
                scalars["diagnostics/rank_param_divergence"] = rank_param_divergence(networks)
            tracker.scalars(scalars, episode)
            print0(f"episode {episode}/{args.total_episodes} | return {m['episodic_return']:.2f} | success "
                   f"{m['success_rate']:.2f} | resources {m['resources']:.2f} | eps {epsilon:.2f} | replans/ep "
                   f"{m['replans_per_episode']:.2f} ({dict(causes)}) | td {losses['td']:.4f} | {time.time() - start:.0f}s")
            window = []
        if reached(args.eval_every) or last:
            run_eval(episode)
        stop = interrupt.should_stop()
        if ckpt.due(episode, last=last) or reached(args.checkpoint_every) or stop:
            mine = {"replay": replay.state_dict(), "window": window, "recent": [list(recent_losses), list(recent_q)],
                    "llm_cache": [[u, list(d), c] for (u, d), c in getattr(planner, "cache", {}).items()]}
            ckpt.save({"iteration": episode, "updates": updates, "decay_episodes": decay_episodes}, qnet, optimizer,
                      generators=generators, tracker=tracker,
                      extra={"target": target_net.state_dict(), "ranks": gather(mine)})  # every rank's buffers
            print0(f"checkpoint saved in {run_dir} (episode {episode})")
        if stop:
            print0(f"interrupted: resume with  python {sys.argv[0]} --resume {run_dir}")
            tracker.close()
            raise SystemExit(130)
    interrupt.stop()

    if args.save_model and rank == 0:
        torch.save(qnet.state_dict(), os.path.join(run_dir, "controller.pt"))
        for part in (model, tokenizer) if model is not None else ():
            part.save_pretrained(os.path.join(run_dir, "model"))
        print0(f"controller{' and planner' if model is not None else ''} saved to {run_dir}")
    if planner is not None:
        print0(f"planner: {planner.plans} plans; {planner.model_calls} LLM forwards, {planner.cache_hits} from the cache")
    print0(f"done in {time.time() - start:.0f}s; logs in {run_dir}")
    tracker.close()
    if world > 1:
        finish_distributed()  # barrier, destroy the group, exit 0 skipping the interpreter's shutdown (gloo abort)
