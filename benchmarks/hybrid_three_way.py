"""Seed 003 §7's experiment: pure LLM vs pure RL vs hybrid (LLM planner + RL controller), plus the oracle planner.

    python benchmarks/hybrid_three_way.py                                  # seed-003 layout, 3 seeds, SmolLM2 planner
    python benchmarks/hybrid_three_way.py --env-id gridworld-procedural --eval-env-kwargs '{"split": "test"}' \
        --output benchmarks/results/hybrid_three_way_procedural      # held-out layouts (the seed did not do this)
    python benchmarks/hybrid_three_way.py --env-id babyai-gotolocal --seeds 1 \
        --output benchmarks/results/hybrid_three_way_babyai          # BabyAI: the oracle planner is minigrid's BabyAIBot

RL, hybrid and oracle rows are `algorithms/hybrid_planner.py --planner none|llm|oracle`, run through
`benchmarks/run.py` (resumable: finished runs are skipped), each evaluated greedily over 50 episodes at the
end. The pure-LLM row is the LLM choosing every move (choice mode over the four action names) with the
shared rollout engine, greedy and at temperature 1, over the same 50 evaluation seeds. Writes
`{output}.md` (the table, seed 003's numbers beside it, the commands, the machine) and
`{output}_curves.png` (training return against training episodes, mean ± std over seeds, like seed 003 §7.3).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
import tyro

import envs
from benchmarks import plot, run
from common.models import load_model
from common.rollout import RolloutConfig, RolloutEngine
from common.tracking import read_scalars

SEED003_ROWS = {  # seed 003 §7.2, 50 episodes each (its own reward scale and a "simulated" LLM)
    "pure LLM": ("1.8", "16.3", "72%", "3.2", "~500 ms", "0", "every step"),
    "pure RL": ("2.1", "13.7", "88%", "4.8", "~2 ms", "50K", "0"),
    "hybrid": ("2.4", "12.8", "94%", "5.6", "~100 ms", "30K", "every 5 steps"),
}


@dataclass
class Args:
    env_id: str = "gridworld"
    """environment for training and evaluation"""
    eval_env_kwargs: str = "{}"
    """JSON keyword arguments of the evaluation environment (e.g. '{"split": "test"}')"""
    model: str = "smollm2-135m"
    """the LLM (planner of the hybrid; actor of the pure-LLM agent)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of the trained agents"""
    total_episodes: int = 800
    """training episodes of the controller (RL, hybrid, oracle)"""
    eval_episodes: int = 50
    """greedy evaluation episodes (seed 003: 50)"""
    extra_args: str = ""
    """extra flags for hybrid_planner.py"""
    runs_dir: str = "benchmarks/runs/hybrid"
    """where the runs go (one folder per planner)"""
    output: str = "benchmarks/results/hybrid_three_way"
    """output prefix of the table (.md) and the learning curves (_curves.png)"""
    workers: int = 1
    """runs at the same time (1 keeps the latency columns meaningful)"""
    pure_llm: bool = True
    """also measure the LLM acting every step (greedy and T = 1) over the evaluation episodes"""


def pure_llm(args: Args, temperature: float) -> dict[str, float]:
    model, tok = load_model(args.model, "cpu", seed=0)
    env_kwargs = json.loads(args.eval_env_kwargs)
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode="choice", temperature=temperature))
    seeds = [(1 << 40) + i for i in range(args.eval_episodes)]
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(0, len(seeds), 10):  # batches of 10 keep memory flat
        batch = seeds[i:i + 10]
        trajs += engine.run([envs.make(args.env_id, **env_kwargs) for _ in batch], batch, args.env_id, generator=gen)
    steps = sum(t.num_steps for t in trajs)
    return {"resources": np.mean([t.rewards.get("progress", 0.0) for t in trajs]),
            "episode_length": np.mean([t.num_steps for t in trajs]),
            "success_rate": np.mean([t.success for t in trajs]), "episodic_return": np.mean([t.return_ for t in trajs]),
            "ms_per_step": 1000 * sum(turn.decode_s for t in trajs for turn in t.turns) / steps}


def final_eval(run_dirs: list[Path]) -> dict[str, tuple[float, float]]:
    """Last greedy evaluation of each seed: mean and std over seeds."""
    values: dict[str, list[float]] = {}
    for d in run_dirs:
        for tag, points in read_scalars(d).items():
            if tag.startswith("eval/"):
                values.setdefault(tag[5:], []).append(points[-1][1])
    return {k: (float(np.mean(v)), float(np.std(v))) for k, v in values.items()}


def main(args: Args) -> None:
    started, load_start = time.time(), os.getloadavg()[0]
    commands, rows = [], {}
    for planner in ("none", "oracle", "llm"):
        out = Path(args.runs_dir) / planner
        script_args = (f"--planner {planner} --exp-name hybrid-{planner} --model {args.model} "
                       f"--total-episodes {args.total_episodes} --eval-episodes {args.eval_episodes} "
                       f"--eval-env-kwargs '{args.eval_env_kwargs}' {args.extra_args}").strip()
        cells = run.Args(algorithms=["hybrid_planner"], env_ids=[args.env_id], seeds=args.seeds, script_args=script_args,
                         output_dir=str(out), workers=args.workers)
        commands.append(f"python benchmarks/run.py --algorithms hybrid_planner --env-ids {args.env_id} --seeds "
                        f"{' '.join(map(str, args.seeds))} --output-dir {out} --script-args \"{script_args}\"")
        if run.main(cells) != 0:
            raise SystemExit(f"some {planner} runs failed; see {out}/*/*/*/stdout.log")
        # only --seeds and --env-id: other runs may sit in the same folder (an earlier benchmark)
        rows[planner] = final_eval(sorted(p.parent for p in out.rglob("args.json") if (lambda a: a["seed"] in args.seeds
                                          and a["env_id"] == args.env_id)(json.loads(p.read_text()))))
    llm_rows = {f"pure LLM (T = {t:g})": pure_llm(args, t) for t in ((0.0, 1.0) if args.pure_llm else ())}

    pm = lambda m, k, f="{:.2f}": f"{f.format(m[k][0])} ± {f.format(m[k][1])}"  # noqa: E731
    lines = [f"# Seed 003's three-way experiment on `{args.env_id}` (evaluation env kwargs {args.eval_env_kwargs})", "",
             f"Greedy evaluation over {args.eval_episodes} episodes; trained agents: mean ± std over seeds "
             f"{args.seeds}, {args.total_episodes} training episodes each. LLM: `{args.model}`. Machine: "
             f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; latencies on this CPU, "
             "measured in the same benchmark (load average at start / end: "
             f"{load_start:.1f} / {os.getloadavg()[0]:.1f}; other jobs inflate absolute latencies, not their ratios).", "",
             "| agent | resources | steps | goal rate | return | latency / step | training episodes | planner calls / episode |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in llm_rows.items():
        lines.append(f"| {name} | {m['resources']:.2f} | {m['episode_length']:.1f} | {100 * m['success_rate']:.0f}% | "
                     f"{m['episodic_return']:.2f} | {m['ms_per_step']:.0f} ms | 0 | every step |")
    names = {"none": "pure RL (controller alone)", "llm": f"hybrid ({args.model} planner)", "oracle": "hybrid (oracle planner)"}
    for planner in ("none", "llm", "oracle"):
        m = rows[planner]
        latency = m["planner_ms_per_step"][0] + m["controller_ms_per_step"][0]
        lines.append(f"| {names[planner]} | {pm(m, 'resources')} | {pm(m, 'episode_length', '{:.1f}')} | "
                     f"{100 * m['success_rate'][0]:.0f}% ± {100 * m['success_rate'][1]:.0f} | {pm(m, 'episodic_return')} | "
                     f"{latency:.2f} ms (planner {m['planner_ms_per_step'][0]:.2f}) | {args.total_episodes} | "
                     f"{m['llm_calls_per_episode'][0]:.2f} |")
    if args.env_id.startswith("gridworld"):  # the seed's numbers are for its GridWorld only
        lines += ["", "Seed 003 §7.2, for reference (its own reward scale, a simulated LLM, 50 episodes):", "",
                  "| agent | resources | steps | goal rate | reward | latency / step | training episodes | LLM calls |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| seed 003: {name} | " + " | ".join(v) + " |" for name, v in SEED003_ROWS.items()]
    runs = [r for r in plot.find_runs([args.runs_dir]) if r.seed in args.seeds and r.group.startswith(f"{args.env_id} /")]
    png = f"{args.output}_curves.png"
    if plot.plot(runs, "charts/episodic_return", ["episodes"], png):
        lines += ["", f"Training return (ε-greedy) against training episodes: ![curves]({Path(png).name})"]
    lines += ["", "Commands:", "", "```bash", f"python benchmarks/hybrid_three_way.py {shlex.join(sys.argv[1:])}".strip(),
              "# which runs:", *commands, "```", "", f"Benchmark wall clock: {time.time() - started:.0f} s."]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.output}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Args))
