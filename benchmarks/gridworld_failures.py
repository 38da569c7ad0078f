"""Why GridWorld episodes fail: each failed episode of a trajectory file (zero_shot.py --trajectories) in one class.

    python benchmarks/zero_shot.py --model RUN/model --env-id gridworld-procedural-relative \\
        --env-kwargs '{"split": "test"}' --temperature 0 --episodes 50 --trajectories greedy.jsonl
    python benchmarks/gridworld_failures.py greedy.jsonl [more.jsonl ...]

Classes, checked in this order:
- `stuck`: the same blocked move (same action, same place) made REPEATS or more times. A greedy policy that bumps
  into a wall reads the same text again, but for its step counter, and tends to repeat itself to the step limit.
- `oscillating`: REPEATS or more moves that undo the move before them (up after down, left after right, ...).
- `other`: neither, e.g. wandering, or a detour too long for the step limit.
It also reports the share of all moves that were blocked, and the move made most often (with its share). "The same
place" is the observation after the move without its feedback line, its "Step k/N" status line and the visit counts of
the "relative-visits" encoder: for every GridWorld encoder that text is fixed by the agent's position and the resources
left, so two blocked moves with the same action and the same such text were made from the same cell.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tyro

from common.records import Trajectory, read_jsonl

REPEATS = 5
OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}


@dataclass
class Args:
    files: tyro.conf.Positional[list[str]]
    """trajectory files written by `zero_shot.py --trajectories` (one row each)"""


def place(observation: str) -> str:
    """The observation less its feedback, step and visit-count lines: the same text, the same cell and resources left."""
    return "\n".join(line for line in observation.splitlines()[1:] if not line.startswith(("Step ", "Visits: ")))


def classify(traj: Trajectory) -> str:
    """`success`, `stuck`, `oscillating` or `other` (module docstring)."""
    if traj.success:
        return "success"
    actions = [turn.action_text.strip().lower() for turn in traj.turns]
    blocked = Counter((action, place(turn.observation)) for action, turn in zip(actions, traj.turns)
                      if turn.observation.startswith("Blocked:"))
    if blocked and max(blocked.values()) >= REPEATS:
        return "stuck"
    moved = [a for a, turn in zip(actions, traj.turns) if turn.action_valid and not turn.observation.startswith("Blocked:")]
    if sum(OPPOSITE.get(before) == after for before, after in pairwise(moved)) >= REPEATS:
        return "oscillating"
    return "other"


def blocked_share(trajs: list[Trajectory]) -> float:
    turns = [turn for traj in trajs for turn in traj.turns]
    return sum(turn.observation.startswith("Blocked:") for turn in turns) / max(len(turns), 1)


def most_frequent_move(trajs: list[Trajectory]) -> str:
    """The move made most often over all episodes, with its share: an untrained model's prior shows up here."""
    moves = Counter(turn.action_text.strip().lower() for traj in trajs for turn in traj.turns)
    if not moves:
        return "none"
    move, count = moves.most_common(1)[0]
    return f"{move} ({count / sum(moves.values()):.0%})"


if __name__ == "__main__":
    args = tyro.cli(Args, description=__doc__)
    if not args.files:
        raise SystemExit("give at least one trajectory file (written by zero_shot.py --trajectories)")
    print("| file | episodes | success | failures: stuck on a blocked move | oscillating | other | blocked moves | "
          "most frequent move |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in args.files:
        try:
            trajs = read_jsonl(path)
        except (OSError, ValueError) as error:
            raise SystemExit(f"{path}: {error}")
        counts = Counter(classify(traj) for traj in trajs)
        print(f"| {path} | {len(trajs)} | {counts['success']} | {counts['stuck']} | {counts['oscillating']} | "
              f"{counts['other']} | {blocked_share(trajs):.0%} of moves | {most_frequent_move(trajs)} |")
