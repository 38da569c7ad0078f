"""Learning curves (PNG) and a results table (markdown) from TensorBoard event files, mean ± std over seeds.

    python benchmarks/plot.py benchmarks/runs --tags eval/success_rate eval/episodic_return \
        --output benchmarks/results/gridworld

Every run directory below the given roots (one holding `args.json` and an event file) is grouped by
(env_id, exp_name) from its `args.json`; the seeds of a group are aggregated. Each curve is drawn
against three denominators, because each answers a different question (seed 001): environment
episodes (sample efficiency: the step our scripts log at), generated tokens (what the model had to
produce: `perf/generated_tokens`, cumulative), and wall-clock seconds (what it costs on this machine:
the event timestamps). Seeds are interpolated onto a common grid that stops where the shortest seed
stops, so a mean is never taken over seeds that did not get that far.

The table holds each tag's last value per group as mean ± std over seeds (population std, n shown).
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import tyro

X_AXES = {"episodes": "environment episodes", "tokens": "generated tokens", "wall": "wall-clock seconds"}


@dataclass
class Args:
    roots: tyro.conf.Positional[list[str]]
    """directories searched (recursively) for run directories"""
    tags: list[str] = field(default_factory=lambda: ["eval/success_rate", "eval/episodic_return"])
    """scalar tags to plot and tabulate"""
    output: str = "benchmarks/results/plot"
    """output prefix: writes {output}.md and {output}_{tag}.png"""
    x_axes: list[str] = field(default_factory=lambda: list(X_AXES))
    """denominators to plot against: episodes, tokens, wall"""
    png: bool = True
    """write PNG figures (needs matplotlib); the table is always written"""


@dataclass
class Run:
    path: Path
    group: str  # "{env_id} / {exp_name}"
    seed: int
    scalars: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]  # tag -> (steps, values, wall_times)


def load_run(path: Path) -> Run:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = json.loads((path / "args.json").read_text())
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        scalars[tag] = (np.array([e.step for e in events], dtype=float), np.array([e.value for e in events], dtype=float),
                        np.array([e.wall_time for e in events], dtype=float))
    return Run(path, f"{args.get('env_id', '?')} / {args.get('exp_name', path.name)}", int(args.get("seed", 0)), scalars)


def find_runs(roots: list[str]) -> list[Run]:
    dirs = sorted({p.parent for root in roots for p in Path(root).rglob("args.json")
                   if any(q.name.startswith("events.out.tfevents") for q in p.parent.iterdir())})
    return [load_run(d) for d in dirs]


def x_values(run: Run, tag: str, axis: str) -> np.ndarray:
    """The tag's points expressed in the chosen denominator."""
    steps, _, walls = run.scalars[tag]
    if axis == "episodes":
        return steps
    if axis == "wall":
        start = min(float(w[0]) for _, _, w in run.scalars.values() if len(w))
        return walls - start
    # tokens: the cumulative count the script logged, looked up at the same step (carried forward)
    if "perf/generated_tokens" not in run.scalars:
        raise KeyError(f"{run.path} has no perf/generated_tokens; plot it with --x-axes episodes wall")
    tok_steps, tok_values, _ = run.scalars["perf/generated_tokens"]
    idx = np.searchsorted(tok_steps, steps, side="right") - 1
    return np.where(idx >= 0, tok_values[np.clip(idx, 0, None)], 0.0)


def aggregate(curves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and std over seeds on the union of their x values, up to the shortest seed's end."""
    end = min(float(x[-1]) for x, _ in curves)
    grid = np.unique(np.concatenate([x[x <= end] for x, _ in curves]))
    ys = np.stack([np.interp(grid, x, y) for x, y in curves])
    return grid, ys.mean(0), ys.std(0)


def final_values(runs: list[Run], tags: list[str]) -> dict[str, dict[str, tuple[float, float, int]]]:
    """group -> tag -> (mean, std, n) of the last logged value over the group's seeds."""
    table: dict[str, dict[str, tuple[float, float, int]]] = defaultdict(dict)
    by_group = defaultdict(list)
    for run in runs:
        by_group[run.group].append(run)
    for group, members in sorted(by_group.items()):
        for tag in tags:
            last = [float(r.scalars[tag][1][-1]) for r in members if tag in r.scalars and len(r.scalars[tag][1])]
            if last:
                table[group][tag] = (float(np.mean(last)), float(np.std(last)), len(last))
    return table


def markdown_table(table: dict[str, dict[str, tuple[float, float, int]]], tags: list[str]) -> str:
    lines = ["| run (env / exp_name) | seeds | " + " | ".join(tags) + " |", "| --- | --- |" + " --- |" * len(tags)]
    for group, cols in table.items():
        n = max((v[2] for v in cols.values()), default=0)
        cells = [f"{cols[t][0]:.3f} ± {cols[t][1]:.3f}" if t in cols else "–" for t in tags]
        lines.append(f"| {group} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], tag: str, axes: list[str], path: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_group = defaultdict(list)
    for run in runs:
        if tag in run.scalars:
            by_group[run.group].append(run)
    if not by_group:
        return False
    fig, panels = plt.subplots(1, len(axes), figsize=(5 * len(axes), 3.6), squeeze=False)
    for panel, axis in zip(panels[0], axes):
        for group, members in sorted(by_group.items()):
            try:
                curves = [(x_values(r, tag, axis), r.scalars[tag][1]) for r in members]
            except KeyError:
                continue
            grid, mean, std = aggregate(curves)
            panel.plot(grid, mean, label=f"{group} (n={len(members)})")
            panel.fill_between(grid, mean - std, mean + std, alpha=0.2)
        panel.set_xlabel(X_AXES[axis])
        panel.set_ylabel(tag)
        panel.grid(alpha=0.3)
    panels[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(args: Args) -> None:
    bad = [a for a in args.x_axes if a not in X_AXES]
    if bad:
        raise SystemExit(f"plot.py: --x-axes: unknown {bad}; choose from {list(X_AXES)}")
    runs = find_runs(args.roots)
    if not runs:
        raise SystemExit(f"plot.py: no run directories (args.json + event file) under {args.roots}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    table = markdown_table(final_values(runs, args.tags), args.tags)
    Path(f"{args.output}.md").write_text(f"Last logged value, mean ± std over seeds ({len(runs)} runs).\n\n" + table)
    print(table)
    if args.png:
        for tag in args.tags:
            out = f"{args.output}_{tag.replace('/', '_')}.png"
            if plot(runs, tag, args.x_axes, out):
                print(f"wrote {out}")


if __name__ == "__main__":
    main(tyro.cli(Args))
