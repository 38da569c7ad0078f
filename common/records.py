"""Trajectory records and the trajectory buffer.

One `Trajectory` per episode, built token-in/token-out (seed 001, "把交互整理成有效的训练记录"):
`token_ids` are exactly what was fed to / sampled from the model, `source_mask` m_j marks the
policy-sampled tokens that enter the loss (prompt, system and observation tokens are 0), and the
record keeps what the tokens alone cannot: behaviour log-probs and policy version (for importance
ratios), per-turn rewards and timings, reward components, and an explicit termination reason
(seed 001: invalid calls and truncation are outcomes of their own, not silently dropped runs).
Records serialise to JSONL, one record per line, no header.

`TrajectoryBuffer` implements the buffer of seed 000 §12 ("轨迹缓冲区"): success filtering,
efficiency ranking (shortest successful first), diversity sampling, and experience retrieval by
goal-embedding similarity (eq. 12.4); plus seed 003 §4's demonstration filter (success only, no
"hesitant" trajectories, no over-long ones).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

TERMINATIONS = ("success", "failure", "truncated", "invalid_action", "error")


@dataclass
class Turn:
    action_text: str  # decoded action, for humans and parsers only: never re-tokenised for training
    observation: str  # observation text the env returned after the action
    reward: float  # step reward
    action_valid: bool
    num_action_tokens: int  # policy tokens sampled this turn
    decode_s: float = 0.0  # seconds generating / scoring this turn's action
    env_s: float = 0.0  # seconds in env.step
    truncated_tokens: bool = False  # the per-turn token cap cut the action


@dataclass
class ChoiceStep:
    """One action taken in `choice` mode (the policy scores a fixed list of action names)."""

    position: int  # index in token_ids where the chosen action's tokens start
    candidates: list[list[int]]  # token ids of every action name, in env.action_names order
    chosen: int  # index of the chosen action
    logprob: float  # behaviour log-prob of the chosen action, normalised over candidates
    # indices of the candidates the policy could choose (invalid-action masking, env.legal_actions()); None = all
    legal: list[int] | None = None


@dataclass
class Trajectory:
    token_ids: list[int]
    source_mask: list[int]  # 1 = sampled by the policy (trained on), 0 = prompt/system/observation
    behavior_logprobs: list[float]  # per token; 0.0 where mask == 0
    policy_version: int
    turns: list[Turn]
    rewards: dict[str, float]  # episode sums per reward component
    return_: float  # serialised under the key "return"
    termination: str  # one of TERMINATIONS
    env_version: str
    task_id: str
    seed: int
    env_id: str = ""
    prompt_length: int = 0  # tokens before the first policy token
    choice_steps: list[ChoiceStep] = field(default_factory=list)  # empty in free mode
    extra: dict = field(default_factory=dict)  # must stay JSON-serialisable (e.g. "goal")

    @property
    def success(self) -> bool:
        return self.termination == "success"

    @property
    def num_steps(self) -> int:
        return len(self.turns)

    @property
    def num_policy_tokens(self) -> int:
        return int(sum(self.source_mask))

    @property
    def invalid_actions(self) -> int:
        return sum(1 for t in self.turns if not t.action_valid)

    def policy_token_spans(self) -> list[tuple[int, int]]:
        """Half-open [start, end) runs of policy tokens (mask == 1), in order."""
        spans, start = [], None
        for i, m in enumerate(self.source_mask + [0]):  # sentinel closes a trailing run
            if m and start is None:
                start = i
            elif not m and start is not None:
                spans.append((start, i))
                start = None
        return spans

    def validate(self) -> None:
        """Raise ValueError if the record breaks the token-in/token-out contract."""
        n = len(self.token_ids)
        if len(self.source_mask) != n or len(self.behavior_logprobs) != n:
            raise ValueError(
                f"length mismatch: token_ids={n}, source_mask={len(self.source_mask)}, "
                f"behavior_logprobs={len(self.behavior_logprobs)}")
        for i, (m, lp) in enumerate(zip(self.source_mask, self.behavior_logprobs)):
            if m not in (0, 1):
                raise ValueError(f"source_mask[{i}] = {m!r}, expected 0 or 1")
            # a nonzero log-prob on a context token means the mask and log-probs are misaligned
            if m == 0 and lp != 0.0:
                raise ValueError(f"behavior_logprobs[{i}] = {lp} but source_mask[{i}] == 0")
        if self.termination not in TERMINATIONS:
            raise ValueError(f"termination {self.termination!r} not in {TERMINATIONS}")
        if not 0 <= self.prompt_length <= n or any(self.source_mask[: self.prompt_length]):
            raise ValueError(f"prompt_length {self.prompt_length}: must be in [0, {n}] "
                             "and cover no policy tokens")
        for k, step in enumerate(self.choice_steps):
            where = f"choice_steps[{k}]"
            if not 0 <= step.chosen < len(step.candidates):
                raise ValueError(f"{where}.chosen = {step.chosen} out of range")
            if step.legal is not None and (step.chosen not in step.legal or
                                           not all(0 <= k < len(step.candidates) for k in step.legal)):
                raise ValueError(f"{where}: chosen {step.chosen} not among the legal candidates {step.legal}")
            ids = list(step.candidates[step.chosen])
            start, end = step.position, step.position + len(ids)
            if not (0 <= start and end <= n):
                raise ValueError(f"{where} span [{start}, {end}) outside token_ids of length {n}")
            # token-in/token-out: the chosen action's ids must be exactly what the record holds
            if self.token_ids[start:end] != ids:
                raise ValueError(f"{where}: token_ids at {start} differ from the chosen ids")
            if not all(self.source_mask[start:end]):
                raise ValueError(f"{where}: chosen tokens are not all marked as policy tokens")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {("return" if k == "return_" else k): v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        d = dict(d)
        d["return_"] = d.pop("return")
        d["turns"] = [Turn(**t) for t in d["turns"]]
        d["choice_steps"] = [ChoiceStep(**c) for c in d.get("choice_steps", [])]
        return cls(**d)


def _json_default(obj: Any) -> Any:
    # numpy scalars/arrays slip in from env and rollout code; store them as plain numbers/lists
    if isinstance(obj, (np.generic, np.ndarray)):
        return obj.tolist()
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")


def write_jsonl(path: str | Path, trajectories: Iterable[Trajectory], append: bool = False) -> None:
    """Write one validated record per line (no header); invalid records never reach the file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w", encoding="utf-8") as f:
        for traj in trajectories:
            traj.validate()
            f.write(json.dumps(traj.to_dict(), ensure_ascii=False, default=_json_default) + "\n")


def read_jsonl(path: str | Path) -> list[Trajectory]:
    """Read and validate records; blank lines are skipped, a bad line raises with its number."""
    out = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                traj = Trajectory.from_dict(json.loads(line))
                traj.validate()
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{lineno}: malformed trajectory record: {e}") from e
            out.append(traj)
    return out


def _action_features(traj: Trajectory) -> frozenset:
    """Action unigrams and bigrams: two runs share features only if they act alike, in order."""
    acts = [t.action_text.strip() for t in traj.turns]
    return frozenset([(a,) for a in acts] + list(zip(acts, acts[1:])))


def _jaccard_distance(a: frozenset, b: frozenset) -> float:
    union = len(a | b)
    return 0.0 if union == 0 else 1.0 - len(a & b) / union


class TrajectoryBuffer:
    """List-backed trajectory store with optional max size (oldest evicted first)."""

    def __init__(self, max_size: int | None = None):
        if max_size is not None and max_size <= 0:
            raise ValueError(f"max_size must be positive, got {max_size}")
        self.max_size = max_size
        self._items: list[Trajectory] = []
        # goal text -> embedding, valid for `_embed_fn` only (reset when another embedder comes)
        self._embed_fn: Callable[[str], np.ndarray] | None = None
        self._embeddings: dict[str, np.ndarray] = {}

    def add(self, traj: Trajectory) -> None:
        self.extend([traj])

    def extend(self, trajs: Iterable[Trajectory]) -> None:
        self._items.extend(trajs)
        if self.max_size is not None and len(self._items) > self.max_size:
            del self._items[: len(self._items) - self.max_size]  # FIFO eviction

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self._items)

    def __getitem__(self, i: int) -> Trajectory:
        return self._items[i]

    def save(self, path: str | Path) -> None:
        write_jsonl(path, self._items)

    @classmethod
    def load(cls, path: str | Path, max_size: int | None = None) -> "TrajectoryBuffer":
        buf = cls(max_size)
        buf.extend(read_jsonl(path))
        return buf

    def successful(self) -> list[Trajectory]:
        """Success filtering (seed 000): only runs that reached the goal are trained on."""
        return [t for t in self._items if t.success]

    def rank_by_efficiency(self) -> list[Trajectory]:
        """Successful runs, fewest steps first; ties: higher return first, then insertion order."""
        return sorted(self.successful(), key=lambda t: (t.num_steps, -t.return_))

    def sample_diverse(self, k: int, rng: np.random.Generator,
                       successful_only: bool = False) -> list[Trajectory]:
        """Pick k trajectories by greedy farthest-point selection (seed 000 diversity sampling).

        Feature: the set of action unigrams and bigrams; distance: Jaccard. The first pick is
        uniform from `rng`; each next pick maximises its minimum distance to those already
        picked (ties: lowest index), so duplicates of a picked action sequence (distance 0)
        come only after every distinct sequence. Returns min(k, pool size) trajectories.
        """
        pool = self.successful() if successful_only else list(self._items)
        if k <= 0 or not pool:
            return []
        feats = [_action_features(t) for t in pool]
        first = int(rng.integers(len(pool)))
        picked = [first]
        min_dist = np.array([_jaccard_distance(f, feats[first]) for f in feats])
        min_dist[first] = -1.0  # never re-pick
        while len(picked) < min(k, len(pool)):
            nxt = int(np.argmax(min_dist))
            picked.append(nxt)
            min_dist = np.minimum(min_dist, [_jaccard_distance(f, feats[nxt]) for f in feats])
            min_dist[picked] = -1.0
        return [pool[i] for i in picked]

    def retrieve(self, query_embedding: np.ndarray, k: int, embed_fn: Callable[[str], np.ndarray],
                 solved: Callable[[Trajectory], bool] | None = None) -> list[Trajectory]:
        """Experience retrieval (seed 000 eq. 12.4): the top-k successful trajectories by cosine
        similarity between `query_embedding` and embed_fn(goal), goal = extra["goal"] or task_id.
        Embeddings are cached per goal text (same goal, same embedding) for this embed_fn.
        `solved`: what counts as a success (default: termination "success"), e.g. a caller's own evaluator."""
        if embed_fn is not self._embed_fn:
            self._embed_fn, self._embeddings = embed_fn, {}
        pool = self.successful() if solved is None else [t for t in self._items if solved(t)]
        if k <= 0 or not pool:
            return []
        q = np.asarray(query_embedding, dtype=np.float64).ravel()
        q = q / (np.linalg.norm(q) + 1e-12)
        scores = []
        for traj in pool:
            goal = str(traj.extra.get("goal", traj.task_id))
            if goal not in self._embeddings:
                e = np.asarray(embed_fn(goal), dtype=np.float64).ravel()
                self._embeddings[goal] = e / (np.linalg.norm(e) + 1e-12)
            scores.append(float(q @ self._embeddings[goal]))
        order = sorted(range(len(pool)), key=lambda i: -scores[i])  # stable: ties keep order
        return [pool[i] for i in order[:k]]

    def filter_demonstrations(self, max_repeat_fraction: float = 0.4,
                              max_steps: int | None = None) -> list[Trajectory]:
        """Seed 003 §4 demonstration filter ("次优数据陷阱"), rules in the seed's order:
        1. keep successes only;
        2. drop hesitant runs: unique states < (1 - max_repeat_fraction) * states (the seed's
           0.6), with the observations returned after each turn standing in for states;
        3. drop over-long runs: num_steps > max_steps (the seed uses 3 x the optimal length).
        """
        keep = []
        for traj in self.successful():
            states = [t.observation for t in traj.turns]
            if len(set(states)) < len(states) * (1.0 - max_repeat_fraction):
                continue
            if max_steps is not None and traj.num_steps > max_steps:
                continue
            keep.append(traj)
        return keep
