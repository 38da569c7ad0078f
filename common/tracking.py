"""Run directories, TensorBoard writing with the shared tags, hyper-parameter and trajectory text.

Every script writes to `runs/{env_id}__{exp_name}__{seed}__{unix_time}/` and logs `vars(args)` (the
values actually used) as a markdown table under the `hyperparameters` text tag, CleanRL-style.
Tags shared by all scripts (so curves compare across algorithms): `charts/*`, `losses/*`,
`diagnostics/*`, `perf/*`, `eval/*` (see DESIGN.md, "Logging and CLI").
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from common.records import Trajectory


def make_run_name(env_id: str, exp_name: str, seed: int) -> str:
    safe_env = env_id.replace("/", "_").replace(":", "_")
    return f"{safe_env}__{exp_name}__{seed}__{int(time.time())}"


def hparams_markdown(args: dict) -> str:
    rows = "\n".join(f"|{key}|{value}|" for key, value in args.items())
    return "|param|value|\n|-|-|\n" + rows


class Tracker:
    """A SummaryWriter that also writes `args.json`; on ranks other than 0 every call is a no-op."""

    def __init__(self, run_dir: str | Path, args: dict, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.writer = None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(str(self.run_dir))
            self.writer.add_text("hyperparameters", hparams_markdown(args))
            (self.run_dir / "args.json").write_text(json.dumps(args, indent=2, default=str))

    def scalars(self, values: dict[str, float], step: int):
        if self.writer:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def trajectories(self, trajs: list[Trajectory], step: int, tokenizer=None, limit: int = 2):
        """A few episodes as readable text: each turn's action, reward and the observation that followed."""
        if not self.writer:
            return
        for i, traj in enumerate(trajs[:limit]):
            lines = [f"task `{traj.task_id}` seed {traj.seed}: return {traj.return_:.2f}, "
                     f"termination **{traj.termination}**, {traj.num_steps} steps", ""]
            for n, turn in enumerate(traj.turns, 1):
                obs = turn.observation.replace("\n", " / ")
                lines.append(f"{n}. `{turn.action_text!r}` -> r={turn.reward:+.2f}; {obs}")
            self.writer.add_text(f"trajectories/sample_{i}", "\n".join(lines), step)

    def close(self):
        if self.writer:
            self.writer.close()


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars of a run directory's event files: {tag: [(step, value), ...]} in logging order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
