"""Exploration for text environments: a count-based novelty bonus, and a self-imitation memory.

r+(s) = coef / sqrt(N(s)) (Strehl & Littman 2008's MBIE-EB bonus; Bellemare et al. 2016 and Tang et al. 2017,
"#Exploration", for the count-based bonus in deep RL), where N(s) counts the episodes so far that visited
state s. The state of a text observation is its text without the "Step t/T." counter (`common.offline.state_key`):
the counter would make every observation new, and a count that never grows is no count at all.

Self-imitation (Oh et al. 2018, SIL): an on-policy learner that stumbles on a rare good episode pushes
its actions up once, under the clip, and then seldom samples that path again. SIL keeps the best episodes
seen and keeps imitating them, weighted by (R - V)_+, for as long as they beat what the policy does now.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from typing import Any

from common.offline import state_key
from common.records import Trajectory


class NoveltyBonus:
    """Per-episode novelty: sum over the distinct states s the episode visited of coef / sqrt(N(s)).

    Counts include the current batch (a state first reached now by one episode earns the full `coef`; by
    two, coef / sqrt 2 each). An episode is credited once per distinct state, so looping in place earns
    nothing. The counts are what a resumed run must carry: `state_dict` / `load_state_dict`."""

    def __init__(self, coef: float):
        self.coef, self.counts = coef, Counter()

    def __call__(self, trajs: list[Trajectory]) -> list[float]:
        visited = [{state_key(turn.observation) for turn in traj.turns} for traj in trajs]
        for states in visited:
            self.counts.update(states)
        return [self.coef * sum(1.0 / math.sqrt(self.counts[s]) for s in states) for states in visited]

    def state_dict(self) -> dict[str, int]:
        return dict(self.counts)

    def load_state_dict(self, counts: dict[str, int]) -> None:
        self.counts = Counter(counts)


class SelfImitationMemory:
    """The `per_task` highest-return distinct episodes seen for each task (the environment's `task_id`).

    `replay(task_id, baseline)` returns the kept episodes whose return beats `baseline` (the caller's value
    estimate, e.g. the mean return of the task's current group) with their weight R - baseline, SIL's
    (R - V)_+: an episode stops being replayed once the policy does as well. Episodes are distinct by their
    action sequence; among equal returns the earlier one stays. Only tasks that recur (a fixed layout)
    are ever replayed, so the memory keeps the `max_tasks` most recently seen tasks only. `layer_inputs`
    (whatever the caller keeps per episode, e.g. the frozen trunk's output of `RolloutEngine(record_layer_inputs=)`)
    travel with their episode."""

    def __init__(self, per_task: int, max_tasks: int = 16):
        self.per_task, self.max_tasks = per_task, max_tasks
        self.best: OrderedDict[str, list[tuple[Trajectory, Any]]] = OrderedDict()

    @staticmethod
    def _actions(traj: Trajectory) -> tuple[str, ...]:
        return tuple(turn.action_text for turn in traj.turns)

    def replay(self, task_id: str, baseline: float) -> list[tuple[Trajectory, Any, float]]:
        return [(t, x, t.return_ - baseline) for t, x in self.best.get(task_id, []) if t.return_ > baseline]

    def add(self, trajs: list[Trajectory], layer_inputs: list | None = None) -> None:
        for i, traj in enumerate(trajs):
            entries = self.best.setdefault(traj.task_id, [])
            self.best.move_to_end(traj.task_id)
            if all(self._actions(t) != self._actions(traj) for t, _ in entries):
                entries.append((traj, layer_inputs[i] if layer_inputs is not None else None))
                entries.sort(key=lambda e: -e[0].return_)  # stable: among equal returns the earlier stays first
                del entries[self.per_task:]
        while len(self.best) > self.max_tasks:
            self.best.popitem(last=False)

    @property
    def best_return(self) -> float:
        return max((t.return_ for entries in self.best.values() for t, _ in entries), default=float("nan"))

    def state_dict(self) -> dict:
        return {"tasks": [[task, [(t.to_dict(), x) for t, x in entries]] for task, entries in self.best.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.best = OrderedDict((task, [(Trajectory.from_dict(t), x) for t, x in entries])
                                for task, entries in state["tasks"])
