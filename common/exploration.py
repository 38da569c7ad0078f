"""Count-based exploration for text environments: a novelty bonus from visit counts.

r+(s) = coef / sqrt(N(s)) (Strehl & Littman 2008's MBIE-EB bonus; Bellemare et al. 2016 and Tang et al. 2017,
"#Exploration", for the count-based bonus in deep RL), where N(s) counts the episodes so far that visited
state s. The state of a text observation is its text without the "Step t/T." counter (`common.offline.state_key`):
the counter would make every observation new, and a count that never grows is no count at all.
"""

from __future__ import annotations

import math
from collections import Counter

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
