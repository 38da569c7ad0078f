"""How BabyAI GoTo episodes end: for each trajectory file (zero_shot.py --trajectories), the share of each move, the
steps per success, and how many failures had the mission's object in view at some step.

    python benchmarks/zero_shot.py --model RUN/model --env-id babyai-gotoredball --env-kwargs '{"max_steps": 24}' \\
        --temperature 0 --episodes 50 --trajectories greedy.jsonl
    python benchmarks/babyai_failures.py greedy.jsonl [more.jsonl ...]

"In view": the object the mission names ("go to the red ball" -> "red ball") is listed after "You see" in an
observation the agent read after one of its moves (envs/external.py renders the agent's 7x7 view in the BabyAI-Text
style: "You see a grey key 1 step left; a red ball 3 steps forward; ..."). A failure that saw its target lacked the
closing in; one that never did lacked the search. A greedy policy that collapsed onto one move shows in the shares.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tyro

from common.records import Trajectory, read_jsonl

MISSION = re.compile(r"Mission: go to (?:the|a) ([a-z]+ [a-z]+)\.")


@dataclass
class Args:
    files: tyro.conf.Positional[list[str]]
    """trajectory files written by `zero_shot.py --trajectories` on a BabyAI GoTo level"""


def mission_object(traj: Trajectory) -> str | None:
    """"red ball" for "go to the red ball"; None when no observation states a GoTo mission."""
    for turn in traj.turns:
        match = MISSION.search(turn.observation)
        if match:
            return match.group(1)
    return None


def saw_target(traj: Trajectory) -> bool:
    """Whether the mission's object was listed among what the agent saw after any of its moves."""
    target = mission_object(traj)
    if target is None:
        return False
    # "a red ball" or "the red ball" after "You see", not a "red box" and not the mission line itself.
    pattern = re.compile(rf"\b(?:a|the) {re.escape(target)}\b")
    return any("You see" in turn.observation and pattern.search(turn.observation.split("You see", 1)[1])
               for turn in traj.turns)


def move_shares(trajs: list[Trajectory]) -> list[tuple[str, float]]:
    """Each move's share of all moves, most frequent first."""
    moves = Counter(turn.action_text.strip().lower() for traj in trajs for turn in traj.turns)
    total = sum(moves.values())
    return [(move, count / total) for move, count in moves.most_common()]


def summary_row(path: str, trajs: list[Trajectory]) -> str:
    successes = [traj for traj in trajs if traj.success]
    failures = [traj for traj in trajs if not traj.success]
    steps = f"{sum(len(t.turns) for t in successes) / len(successes):.1f}" if successes else ""
    shares = ", ".join(f"{move} {share:.0%}" for move, share in move_shares(trajs)) or "none"
    return (f"| {path} | {len(trajs)} | {len(successes)} | {steps} | {sum(saw_target(t) for t in failures)} of "
            f"{len(failures)} | {shares} |")


if __name__ == "__main__":
    args = tyro.cli(Args, description=__doc__)
    if not args.files:
        raise SystemExit("give at least one trajectory file (written by zero_shot.py --trajectories)")
    print("| file | episodes | success | steps per success | failures with the target in view | moves |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in args.files:
        try:
            trajs = read_jsonl(path)
        except (OSError, ValueError) as error:
            raise SystemExit(f"{path}: {error}")
        print(summary_row(path, trajs))
