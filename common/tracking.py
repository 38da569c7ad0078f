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
    """A SummaryWriter that also writes `args.json`; on ranks other than 0 every call is a no-op.

    Resuming (`resume_state` = what `state_dict()` returned when the checkpoint was saved) appends to
    the same run directory: events a crashed run logged after its checkpoint are purged (TensorBoard's
    `purge_step`), so every tag reads as one uninterrupted curve.
    """

    def __init__(self, run_dir: str | Path, args: dict, enabled: bool = True, resume_state: dict | None = None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.writer = None
        self.last_steps: dict[str, int] = {}  # the last step logged per scalar tag (what a checkpoint records)
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if resume_state is None:
                self.writer = SummaryWriter(str(self.run_dir))
                self.writer.add_text("hyperparameters", hparams_markdown(args))
            else:
                self._reopen(resume_state)
            (self.run_dir / "args.json").write_text(json.dumps(args, indent=2, default=str))

    def state_dict(self) -> dict:
        return {"last_steps": dict(self.last_steps)}

    def _reopen(self, state: dict):
        """Reopen a run at a checkpoint: purge from the first step logged after it, re-log the rest.

        One purge step covers all tags, but tags can live on different x-axes (a cold start's SFT steps,
        then episodes): events at or past the purge step that were logged *before* the checkpoint
        (step <= that tag's last step then) are written again after the purge marker.
        """
        self.last_steps = {k: int(v) for k, v in state.get("last_steps", {}).items()}
        logged = read_scalars(self.run_dir)
        orphans = [step for tag, events in logged.items() for step, _ in events if step > self.last_steps.get(tag, -1)]
        purge_step = min(orphans) if orphans else None
        # event files load in name order and the name starts with the unix second: start a new second
        newest = max((int(p.name.split(".")[3]) for p in self.run_dir.glob("events.out.tfevents.*")
                      if p.name.split(".")[3].isdigit()), default=0)
        while int(time.time()) <= newest:
            time.sleep(0.05)
        self.writer = SummaryWriter(str(self.run_dir), purge_step=purge_step)
        if purge_step is not None:
            for tag, events in logged.items():
                for step, value in events:
                    if purge_step <= step <= self.last_steps.get(tag, -1):
                        self.writer.add_scalar(tag, value, step)

    def scalars(self, values: dict[str, float], step: int):
        if self.writer:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
                self.last_steps[tag] = step

    def flush(self):
        if self.writer:
            self.writer.flush()

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
