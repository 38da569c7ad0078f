"""Offline datasets for discrete-action environments: collect, write, load, and cut into transitions.

Seed 003 §4.4 names three data levels, collected here by policy (plus the agents' own logs):

| quality      | how an episode is played                                                              |
| ------------ | ------------------------------------------------------------------------------------- |
| `expert`     | the environment's optimal planner (`env.optimal_action()`: GridWorld's BFS, the exact  |
|              | finite-horizon planner of FrozenLake / Taxi / CliffWalking in envs/external.py)       |
| `suboptimal` | the expert, but with probability `epsilon` a uniformly random action instead, so       |
|              | successes and failures mix (seed 003 §6 "坑2": annotator data with ~70% success)       |
| `noisy`      | uniformly random actions                                                              |
| `llm`        | an LLM agent in choice mode (`common.rollout.RolloutEngine`) at `temperature`        |

Episode i of a dataset uses environment seed `seed * 1_000_003 + i`; the random actions of episode i
come from a generator seeded by (seed, i), so a dataset is reproducible and its first n episodes do not
depend on how many were collected.

Every record is a `common.records.Trajectory` whose turns hold the action NAME (`action_text`), the
observation that followed and the step reward, and whose `extra` holds what an offline learner needs to
rebuild states: `system_prompt`, `initial_observation`, `actions` (indices into `env.action_names`) and
`quality`. Non-LLM records carry no tokens (each algorithm encodes the text with its own tokenizer).

`transitions(traj)` cuts an episode into (s, a, r, s', done, history) with `done` True when the episode
*terminated* (success / failure / invalid action). A truncation (the time limit) is terminal too when the last
observation shows it ("Step 20/20."): time is then part of the state and nothing follows, so TD targets must
not bootstrap; without a visible counter the time limit is not in the state and they do (Pardo et al. 2018,
"Time limits in reinforcement learning", time-aware vs partial-episode bootstrapping).

The demonstration filter of seed 003 §4 is `common.records.TrajectoryBuffer.filter_demonstrations`;
`filter_demonstrations` below applies it with a state key that ignores step counters (see there).

`encode_states` turns token sequences into an LM's final hidden states at their last position (the batch's
shared prefix run once); `FeatureCache` keeps a frozen encoder's state features on disk, keyed by the
encoder's weights and the state's token ids, so runs on the same data (other seeds, other modes) skip the
LM forwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.records import Trajectory, TrajectoryBuffer, Turn, read_jsonl, write_jsonl

QUALITIES = ("expert", "suboptimal", "noisy", "llm")
SEED_STRIDE = 1_000_003
TERMINAL = ("success", "failure", "invalid_action")  # ends the MDP: no bootstrap; "truncated": see time_limit_shown


@dataclass
class Transition:
    """One step of an episode. `history` is everything before `observation`, as alternating texts
    [obs_0, action_name_0, obs_1, action_name_1, ..., obs_{t-1}, action_name_{t-1}] (empty at t = 0);
    the state after this step is therefore `history + [observation, action_name] + [next_observation]`."""

    observation: str
    action: int
    reward: float
    next_observation: str
    done: bool  # terminated (success / failure / invalid action) on this step; False at truncation
    history: list[str] = field(default_factory=list)
    action_name: str = ""
    step: int = 0  # t, the index of this step in its episode


def episode_seed(seed: int, i: int) -> int:
    return seed * SEED_STRIDE + i


def _make_env(env_id: str, env_kwargs: dict | None):
    import envs  # imported here so common/ does not import envs/ at module load (copy-out contract)

    return envs.make(env_id, **(env_kwargs or {}))


def _play(env, env_id: str, seed: int, rng: np.random.Generator, quality: str, epsilon: float) -> Trajectory:
    """One episode with the expert / epsilon-expert / random policy."""
    names = list(env.action_names)
    obs, info = env.reset(seed=seed)
    first_obs, turns, actions, components, termination = obs, [], [], {}, None
    while termination is None:
        if quality == "noisy" or (quality == "suboptimal" and rng.random() < epsilon):
            action = int(rng.integers(len(names)))
        else:
            action = env.optimal_action()
            if action is None:  # the planner says the episode is over; the env would disagree only on a bug
                raise RuntimeError(f"{env_id}: optimal_action() returned None in a live episode")
        obs, reward, terminated, truncated, info = env.step(int(action))
        for k, v in info.get("reward_components", {}).items():
            components[k] = components.get(k, 0.0) + float(v)
        turns.append(Turn(action_text=names[action], observation=obs, reward=float(reward),
                          action_valid=bool(info.get("action_valid", True)), num_action_tokens=0))
        actions.append(int(action))
        if terminated or truncated:
            termination = info.get("termination", "truncated" if truncated else "failure")
    return Trajectory(token_ids=[], source_mask=[], behavior_logprobs=[], policy_version=0, turns=turns,
                      rewards=components, return_=sum(t.reward for t in turns), termination=termination,
                      env_version=str(info.get("env_version", env.env_version)), task_id=str(info.get("task_id", "")),
                      seed=int(seed), env_id=env_id,
                      extra={"system_prompt": env.system_prompt, "initial_observation": first_obs,
                             "actions": actions, "quality": quality})


def _collect_llm(env_id: str, episodes: int, seed: int, env_kwargs: dict | None, model: Any, temperature: float,
                 device: str, batch_size: int) -> list[Trajectory]:
    import torch

    from common.models import load_model
    from common.rollout import RolloutConfig, RolloutEngine

    if isinstance(model, str):
        lm, tok = load_model(model, device, seed=seed)
    else:
        lm, tok = model  # an already loaded (model, tokenizer), e.g. a trained agent
    engine = RolloutEngine(lm, tok, RolloutConfig(action_mode="choice", temperature=temperature))
    gen = torch.Generator(device=next(lm.parameters()).device).manual_seed(seed)
    out = []
    for start in range(0, episodes, batch_size):
        seeds = [episode_seed(seed, i) for i in range(start, min(start + batch_size, episodes))]
        trajs = engine.run([_make_env(env_id, env_kwargs) for _ in seeds], seeds, env_id, generator=gen)
        out += from_agent_records(trajs, env_id, env_kwargs, quality="llm")
    return out


def from_agent_records(trajs: list[Trajectory], env_id: str, env_kwargs: dict | None = None,
                       quality: str = "llm") -> list[Trajectory]:
    """Turn trajectories logged by any choice-mode agent (RolloutEngine records, e.g. a run's JSONL) into
    dataset records: fills `extra` (system prompt, initial observation, action indices, quality). The
    tokens are kept. Action indices come from `choice_steps`, or from the action names when absent."""
    out = []
    for traj in trajs:
        env = _make_env(env_id, env_kwargs)
        names = list(env.action_names or [])
        first_obs, _ = env.reset(seed=traj.seed)
        if traj.choice_steps and len(traj.choice_steps) == len(traj.turns):
            actions = [c.chosen for c in traj.choice_steps]
        else:
            try:
                actions = [names.index(t.action_text.strip()) for t in traj.turns]
            except ValueError as e:
                raise ValueError(f"episode seed {traj.seed}: an action is not one of {names} ({e}); "
                                 "only choice-mode records convert") from None
        extra = {**traj.extra, "system_prompt": env.system_prompt, "initial_observation": first_obs,
                 "actions": actions, "quality": quality}
        out.append(replace(traj, env_id=traj.env_id or env_id, extra=extra))
    return out


def collect(env_id: str, quality: str, episodes: int, seed: int, epsilon: float = 0.3,
            env_kwargs: dict | None = None, model: Any = "smollm2-135m", temperature: float = 1.0,
            device: str = "cpu", batch_size: int = 16) -> list[Trajectory]:
    """Play `episodes` episodes of `env_id` with the policy `quality` names (see the module docstring).

    `model` (llm only) is a model name for `common.models.load_model` or a loaded (model, tokenizer) pair;
    `device` and `batch_size` (episodes played in lockstep) only matter for `llm`. Raises ValueError on a
    bad quality / epsilon, an environment without `action_names`, or (expert, suboptimal) without
    `optimal_action`.
    """
    if quality not in QUALITIES:
        raise ValueError(f"quality must be one of {QUALITIES}, got {quality!r}")
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    env = _make_env(env_id, env_kwargs)
    if not getattr(env, "action_names", None):
        raise ValueError(f"{env_id} has no action_names: offline datasets need a discrete-action environment")
    if quality in ("expert", "suboptimal") and not hasattr(env, "optimal_action"):
        raise ValueError(f"{env_id} has no optimal_action() planner: use quality 'noisy' or 'llm'")
    if quality == "llm":
        return _collect_llm(env_id, episodes, seed, env_kwargs, model, temperature, device, batch_size)
    return [_play(env, env_id, episode_seed(seed, i), np.random.default_rng([seed, i]), quality, epsilon)
            for i in range(episodes)]


def dataset_stats(trajs: list[Trajectory]) -> dict[str, Any]:
    """Size and quality of a dataset: what the meta file and the collector report."""
    terms: dict[str, int] = {}
    for t in trajs:
        terms[t.termination] = terms.get(t.termination, 0) + 1
    return {"episodes": len(trajs), "num_steps": sum(t.num_steps for t in trajs),
            "success_rate": float(np.mean([t.success for t in trajs])) if trajs else 0.0,
            "mean_return": float(np.mean([t.return_ for t in trajs])) if trajs else 0.0,
            "mean_length": float(np.mean([t.num_steps for t in trajs])) if trajs else 0.0,
            "terminations": terms}


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def meta_path(path: str | Path) -> Path:
    return Path(str(path) + ".meta.json")


def write_dataset(path: str | Path, trajs: list[Trajectory], meta: dict) -> None:
    """Trajectories as JSONL at `path` and `<path>.meta.json` with how the data was made and its size.

    `meta` should carry env_id, env_kwargs, quality, epsilon, seed (and anything else worth keeping);
    size and quality (episodes, num_steps, success_rate, mean_return, ...) are computed from `trajs`,
    `created_by` defaults to this process's command line, `git_commit` is added when available.
    """
    write_jsonl(path, trajs)
    full = {"created_by": " ".join([Path(sys.executable).name] + sys.argv), **meta, **dataset_stats(trajs),
            "git_commit": meta.get("git_commit") or _git_commit()}
    meta_path(path).write_text(json.dumps(full, indent=2, default=str))


def load_dataset(path: str | Path) -> tuple[list[Trajectory], dict]:
    """(trajectories, meta); meta is {} when there is no meta file (e.g. a converted agent log)."""
    trajs = read_jsonl(path)
    m = meta_path(path)
    return trajs, (json.loads(m.read_text()) if m.exists() else {})


def transitions(traj: Trajectory) -> list[Transition]:
    """The episode as transitions (see `Transition`); needs the dataset `extra` fields."""
    missing = [k for k in ("initial_observation", "actions") if k not in traj.extra]
    if missing:
        raise ValueError(f"trajectory seed {traj.seed} lacks extra{missing}: not an offline-dataset record "
                         "(convert agent logs with common.offline.from_agent_records)")
    actions = traj.extra["actions"]
    if len(actions) != len(traj.turns):
        raise ValueError(f"trajectory seed {traj.seed}: {len(actions)} actions for {len(traj.turns)} turns")
    out, history, obs = [], [], traj.extra["initial_observation"]
    for t, (turn, action) in enumerate(zip(traj.turns, actions)):
        last = t == len(traj.turns) - 1
        out.append(Transition(observation=obs, action=int(action), reward=float(turn.reward),
                              next_observation=turn.observation, done=last and (traj.termination in TERMINAL or (
                                  traj.termination == "truncated" and time_limit_shown(turn.observation))),
                              history=list(history), action_name=turn.action_text, step=t))
        history += [obs, turn.action_text]
        obs = turn.observation
    return out


_STEP_COUNTER = re.compile(r"\bStep (\d+)/(\d+)\.\s*")


def time_limit_shown(observation: str) -> bool:
    """Whether the observation shows its step budget spent ("Step 20/20."): a time-aware state with no future."""
    match = _STEP_COUNTER.search(observation)
    return match is not None and match[1] == match[2]


def state_key(observation: str) -> str:
    """The observation without its "Step t/T." counter: the same place at another time is the same state."""
    return _STEP_COUNTER.sub("", observation)


def place_key(observation: str) -> str:
    """What an observation says about the state, not how the agent got there: with a "Step t/T." counter, the text
    after it (the line before the counter reports the last move, "You moved up."); without one, the whole text."""
    match = _STEP_COUNTER.search(observation)
    return observation[match.end():] if match else observation


def filter_demonstrations(trajs: list[Trajectory], max_repeat_fraction: float = 0.4,
                          max_steps: int | None = None) -> list[Trajectory]:
    """Seed 003 §4's filter (success only, no hesitant runs, none longer than `max_steps`) through
    `TrajectoryBuffer.filter_demonstrations`. Our observations print a step counter, which would make
    every state unique and the hesitation rule a no-op, so states are compared by `state_key`."""
    keyed = [replace(t, turns=[replace(u, observation=state_key(u.observation)) for u in t.turns],
                     extra={"index": i}) for i, t in enumerate(trajs)]
    buf = TrajectoryBuffer()
    buf.extend(keyed)
    return [trajs[k.extra["index"]] for k in buf.filter_demonstrations(max_repeat_fraction, max_steps)]


def encode_states(body, ids_list: list[list[int]], pad_id: int, device, share_prefix: bool = True) -> torch.Tensor:
    """Final hidden state at the last position of each sequence, [B, H]. The batch's common prefix (the
    system prompt) is run once and its KV cache repeated: most of a state's tokens are that prefix.
    `share_prefix=False`: one plain forward of the whole sequences (FSDP2 allows one forward per backward)."""
    from transformers import DynamicCache

    n = min(len(ids) for ids in ids_list)
    p = 0
    while share_prefix and p < n - 1 and all(ids[p] == ids_list[0][p] for ids in ids_list):
        p += 1
    cache, prefix_mask = DynamicCache(), torch.ones((1, p), dtype=torch.long, device=device)
    if p:
        body(input_ids=torch.tensor([ids_list[0][:p]], device=device), attention_mask=prefix_mask,
             past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(len(ids_list))
    width = max(len(ids) for ids in ids_list) - p
    ids = torch.full((len(ids_list), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids_list), width), dtype=torch.long)
    for row, full in enumerate(ids_list):  # left-padded suffixes: position -1 is every row's last token
        ids[row, width - len(full) + p:] = torch.tensor(full[p:])
        mask[row, width - len(full) + p:] = 1
    attn = torch.cat([prefix_mask.expand(len(ids_list), p), mask.to(device)], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)[:, -width:]
    out = body(input_ids=ids.to(device), attention_mask=attn, position_ids=pos, past_key_values=cache if p else None,
               use_cache=bool(p)).last_hidden_state
    return out[:, -1].float()


class FeatureCache:
    """State features of a frozen encoder, kept across runs in `{directory}/{encoder_key(model)}.pt`.

    The key hashes every parameter of the encoder (so `tiny` models of different seeds, or a fine-tuned
    checkpoint, never share features) and each entry is keyed by the sha1 of the state's token ids. A value
    read back equals a fresh encoding up to float noise (~1e-6): the padding of the batch it was encoded
    in differs. `save` merges with what other processes wrote since `load` and replaces the file atomically.
    """

    def __init__(self, directory: str | Path, model: torch.nn.Module, name: str):
        self.path = Path(directory) / f"{self.encoder_key(model, name)}.pt"
        self.features: dict[str, torch.Tensor] = self._read()
        self.added: dict[str, torch.Tensor] = {}

    @staticmethod
    def encoder_key(model: torch.nn.Module, name: str) -> str:
        h = hashlib.sha1()
        for pname, p in sorted(model.state_dict().items()):
            h.update(pname.encode())
            h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(name).name or "model") + "-" + h.hexdigest()[:16]

    @staticmethod
    def ids_key(ids: list[int]) -> str:
        return hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()

    def _read(self) -> dict[str, torch.Tensor]:
        if not self.path.exists():
            return {}
        try:
            return torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as e:  # a cache must never break a run: start afresh and say why
            print(f"feature cache {self.path} unreadable ({type(e).__name__}: {e}); ignoring it", file=sys.stderr)
            return {}

    def get(self, ids: list[int]) -> torch.Tensor | None:
        return self.features.get(self.ids_key(ids))

    def put(self, ids: list[int], feature: torch.Tensor) -> None:
        key = self.ids_key(ids)
        self.features[key] = self.added[key] = feature.detach().cpu()

    def save(self) -> None:
        if not self.added:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**self._read(), **self.added}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(merged, f)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.added = {}
