"""Summarise one run directory as markdown, from its TensorBoard event file and args.json.

    python benchmarks/summarize_run.py runs/gridworld__grpo_agent__1__1700000000 --wall-clock-s 700

Prints the settings that matter, the learning curve (sampled and greedy success, return) and the
per-iteration cost, so numbers in the README come from the run itself, not from typing.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import tyro

from common.tracking import read_scalars


@dataclass
class Args:
    run_dir: tyro.conf.Positional[str]
    """the run directory (runs/{env}__{exp}__{seed}__{time})"""
    wall_clock_s: float = 0.0
    """measured wall-clock seconds of the whole command, if known (install and model load included)"""
    every: int = 40
    """a table row every N training episodes (and at the first, the last and every evaluation)"""


def series(scalars, tag):
    return [(int(step), float(value)) for step, value in scalars.get(tag, [])]


if __name__ == "__main__":
    args = tyro.cli(Args)
    run = Path(args.run_dir)
    settings = json.loads((run / "args.json").read_text())
    s = read_scalars(run)
    success, ret = series(s, "charts/success_rate"), series(s, "charts/episodic_return")
    rollout, update = [v for _, v in series(s, "perf/rollout_s")], [v for _, v in series(s, "perf/update_s")]
    value = [v for _, v in series(s, "perf/value_s")]  # PPO: V_old, pi_ref and the bootstrap, before the update
    tok_s = [v for _, v in series(s, "perf/rollout_tokens_per_s")]
    keys = ["model", "env_id", "action_mode", "total_iterations", "num_groups", "group_size", "num_episodes", "learning_rate",
            "trainable_layers", "update_epochs", "temperature", "beta", "seed"]
    print(f"Run `{run.name}` on {platform.machine()} with {os.cpu_count()} CPU cores.\n")
    print("Settings: " + ", ".join(f"`{k}={settings[k]}`" for k in keys if k in settings) + ".\n")
    print("| training episodes | sampled success | sampled return | greedy success | greedy return |")
    print("| --- | --- | --- | --- | --- |")
    evals = {step: v for step, v in series(s, "eval/success_rate")}
    eval_ret = {step: v for step, v in series(s, "eval/episodic_return")}
    for step in sorted(set(evals) | {st for st, _ in success}):
        sampled = dict(success).get(step)
        if step in evals or step == success[0][0] or step % args.every == 0 or step == success[-1][0]:
            fmt = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
            print(f"| {step} | {fmt(sampled)} | {fmt(dict(ret).get(step))} | {fmt(evals.get(step))} | {fmt(eval_ret.get(step))} |")
    iters = len(rollout)
    if len(value) == iters:  # PPO's value phase is timed apart: count it in, and say so
        update = list(np.add(update, value))
    episodes = settings.get("num_episodes") or settings.get("num_groups", 1) * settings.get("group_size", 1)
    split = f", of which values {np.mean(value):.1f} s" if len(value) == iters else ""
    steps = settings.get("max_episode_steps") or {"gridworld": 20}.get(settings.get("env_id"))  # 0: the env's default
    limit = f" of at most {steps} turns" if steps else ""
    print(f"\nPer iteration ({episodes} episodes{limit}): "
          f"mean {np.mean(rollout) + np.mean(update):.1f} s (rollout {np.mean(rollout):.1f} s, update {np.mean(update):.1f} s"
          f"{split}), first {rollout[0] + update[0]:.1f} s, last {rollout[-1] + update[-1]:.1f} s; rollout throughput "
          f"{np.mean(tok_s):.0f} tokens/s (prompt + observation + sampled tokens). {iters} iterations, "
          f"{sum(rollout) + sum(update):.0f} s of rollout + update.")
    env, ref = [v for _, v in series(s, "perf/env_s")], [v for _, v in series(s, "perf/reference_s")]
    if env and len(env) == iters:  # where an iteration's time goes (seed 001's rollout decomposition)
        ref = ref if len(ref) == iters else [0.0] * iters
        phases = {"decode (rollout minus environment)": np.subtract(rollout, env), "environment (step + verify)": env,
                  "reference log-probs": ref, "policy forward/backward + optimizer": np.subtract(update, ref)}
        total = sum(rollout) + sum(update)
        print("\n| phase | mean s / iteration | share |\n| --- | --- | --- |")
        for name, values in phases.items():
            print(f"| {name} | {np.mean(values):.2f} | {100 * np.sum(values) / total:.1f}% |")
    if args.wall_clock_s:
        print(f"Whole command, wall clock: {args.wall_clock_s / 60:.1f} min.")
