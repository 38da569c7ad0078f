"""Offline RL on the GridWorld: CQL, BC, filtered BC (algorithms/cql.py) and the Decision Transformer
(algorithms/decision_transformer.py) on expert, suboptimal and noisy datasets, mean ± std over seeds.

    python benchmarks/offline_gridworld.py                                   # smollm2-135m, seeds 1 2 3 (hours on 2 cores)
    python benchmarks/offline_gridworld.py --model tiny --seeds 1 2 3 --episodes 50 \\
        --cql-args="--total-updates 200 --eval-every 200" --dt-args="--train-steps 200 --eval-every 0" --workers 2
    python benchmarks/offline_gridworld.py --dry-run                         # print the commands only

1. One dataset per quality is collected with `common.offline.collect` (`--episodes` episodes, data seed
   `--dataset-seed`; `suboptimal` uses `--epsilon`) and written with `common.offline.write_dataset` to
   `{runs_dir}/datasets/gridworld_{quality}.jsonl` (+ `.meta.json`). Every algorithm and seed trains on the
   same file, as in D4RL: the seeds vary the learner, not the data.
2. Each (quality, algorithm, seed) cell runs its script as a subprocess with `--dataset`, `--seed`, `--model`,
   `--output-dir {runs_dir}/{quality}/{algorithm}/seed{seed}` (plus `--cql-args` / `--dt-args`); its output
   goes to `stdout.log` there. Cells run `--workers` at a time, each with OMP_NUM_THREADS=--threads-per-worker.
3. The final `eval/episodic_return` and `eval/success_rate` of each run are read from its TensorBoard events
   (`common.tracking.read_scalars`); the Decision Transformer's are at R* = the dataset's best return, and its
   R*-sweep correlation `eval/rtg_correlation` is reported too.
4. A markdown table (mean ± sample std over seeds, and the exact commands) goes to `--output`
   (default benchmarks/results/offline_gridworld.md).
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parents[1]
# algorithm label -> (script, fixed flags)
ALGORITHMS = {
    "CQL": ("cql.py", ["--mode", "cql"]),
    "BC": ("cql.py", ["--mode", "bc"]),
    "filtered BC": ("cql.py", ["--mode", "filtered-bc"]),
    "DT": ("decision_transformer.py", []),
}
QUALITIES = ("expert", "suboptimal", "noisy")


@dataclass
class Args:
    model: str = "smollm2-135m"
    """--model of every run (`tiny` for a quick end-to-end check)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """learner seeds (--seed of each run)"""
    episodes: int = 200
    """episodes per dataset"""
    epsilon: float = 0.4
    """random-action probability of the `suboptimal` dataset (0.4: about 70% success, seed 003's annotator data)"""
    dataset_seed: int = 0
    """seed of the data collection (common.offline: episode i uses env seed dataset_seed * 1_000_003 + i)"""
    qualities: list[str] = field(default_factory=lambda: list(QUALITIES))
    """dataset qualities (columns of the table)"""
    algorithms: list[str] = field(default_factory=lambda: list(ALGORITHMS))
    """algorithms (rows): any of CQL, BC, "filtered BC", DT"""
    cql_args: str = ""
    """extra flags for the cql.py runs, one string, given with `=` (e.g. --cql-args="--total-updates 500")"""
    dt_args: str = ""
    """extra flags for the decision_transformer.py runs, given with `=` (e.g. --dt-args="--train-steps 100")"""
    workers: int = 1
    """runs at the same time"""
    threads_per_worker: int = 1
    """OMP_NUM_THREADS of each run"""
    runs_dir: str = "benchmarks/runs/offline_gridworld"
    """datasets and the runs' output directories"""
    output: str = "benchmarks/results/offline_gridworld.md"
    """the markdown table"""
    timeout_s: int = 0
    """kill a run after this many seconds (0: no limit); it is reported as failed"""
    feature_cache: bool = True
    """cql.py runs share `{runs_dir}/features` (--feature-cache): each dataset's states are encoded by the frozen LM
    once, not once per algorithm and seed (first run per quality first, so concurrent workers do not duplicate it)"""
    dry_run: bool = False
    """print the commands and exit"""
    report_only: bool = False
    """run nothing: rebuild the table from the cells already in --runs-dir"""


def collect_datasets(args: Args, data_dir: Path) -> dict[str, dict]:
    """One dataset file per quality (kept if it exists with the same settings); returns each file's meta."""
    import json

    from common.offline import collect, load_dataset, meta_path, write_dataset

    metas = {}
    for quality in args.qualities:
        path = data_dir / f"gridworld_{quality}.jsonl"
        want = {"env_id": "gridworld", "quality": quality, "seed": args.dataset_seed, "episodes_requested": args.episodes,
                "epsilon": args.epsilon if quality == "suboptimal" else None}
        if path.exists() and meta_path(path).exists():
            meta = json.loads(meta_path(path).read_text())
            if all(meta.get(k) == v for k, v in want.items()):
                metas[quality] = meta
                continue
        t0 = time.time()
        trajs = collect("gridworld", quality, args.episodes, args.dataset_seed, args.epsilon)
        write_dataset(path, trajs, {**want, "env_kwargs": {}})
        metas[quality] = load_dataset(path)[1]
        print(f"dataset {path}: success {metas[quality]['success_rate']:.2f}, mean return "
              f"{metas[quality]['mean_return']:.2f} ({time.time() - t0:.1f}s)", flush=True)
    return metas


def command(args: Args, algorithm: str, dataset: Path, seed: int, out_dir: Path) -> list[str]:
    script, fixed = ALGORITHMS[algorithm]
    extra = shlex.split(args.dt_args if script == "decision_transformer.py" else args.cql_args)
    if script == "cql.py" and args.feature_cache:
        extra = ["--feature-cache", str(Path(args.runs_dir).resolve() / "features"), *extra]
    return [sys.executable, str(ROOT / "algorithms" / script), *fixed, "--dataset", str(dataset), "--seed", str(seed),
            "--model", args.model, "--output-dir", str(out_dir), *extra]


def run_cell(cmd: list[str], out_dir: Path, threads: int, timeout_s: int) -> dict:
    """Run one script into `out_dir` (its run directory, stdout.log, cell.json); return `read_cell`."""
    import json
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():  # a rerun replaces the cell's previous run, so "the run" is unambiguous
        if old.is_dir():
            shutil.rmtree(old)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.time()
    with open(out_dir / "stdout.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                timeout=timeout_s or None).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    (out_dir / "cell.json").write_text(json.dumps({"command": cmd, "rc": rc, "seconds": time.time() - t0}))
    return read_cell(out_dir)


def read_cell(out_dir: Path) -> dict:
    """A finished cell: return code, seconds, the final eval scalars, and the last log line if it failed."""
    import json

    from common.tracking import read_scalars

    cell = out_dir / "cell.json"
    result = {"rc": "missing", "seconds": 0.0}
    if cell.exists():
        meta = json.loads(cell.read_text())
        result = {"rc": meta["rc"], "seconds": meta["seconds"]}
    runs = sorted(p for p in out_dir.iterdir() if p.is_dir()) if out_dir.exists() else []
    if result["rc"] == "missing" and runs and (out_dir / "stdout.log").exists():  # a cell from before cell.json
        result["rc"] = 0 if "done in" in (out_dir / "stdout.log").read_text() else "unknown"
    if result["rc"] == 0 and runs:
        scalars = read_scalars(runs[-1])
        for tag in ("eval/episodic_return", "eval/success_rate", "eval/rtg_correlation"):
            if tag in scalars:
                result[tag] = scalars[tag][-1][1]  # the final value
    elif (out_dir / "stdout.log").exists():
        lines = [ln.strip() for ln in (out_dir / "stdout.log").read_text().splitlines() if ln.strip()]
        result["error"] = lines[-1][:160] if lines else ""
    return result


def num(x: float) -> str:
    return f"{round(float(x), 2) + 0.0:.2f}"  # + 0.0: a return of -1e-9 prints as 0.00, not -0.00


def mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return f"{num(np.mean(values))} ± {num(std)}"


def markdown(args: Args, metas: dict, results: dict, commands: dict, seconds: float) -> str:
    def table(tag: str, title: str) -> list[str]:
        lines = [f"### {title}", "", "| algorithm | " + " | ".join(args.qualities) + " |",
                 "| --- |" + " --- |" * len(args.qualities)]
        for algorithm in args.algorithms:
            cells = []
            for quality in args.qualities:
                runs = [results[(quality, algorithm, s)] for s in args.seeds]
                values = [r[tag] for r in runs if tag in r]
                failed = sum(1 for r in runs if r["rc"] != 0)  # e.g. filtered BC when no episode survives the filter
                cells.append(mean_std(values) + (f" ({failed} failed)" if failed else ""))
            lines.append(f"| {algorithm} | " + " | ".join(cells) + " |")
        return lines + [""]

    dataset_row = " | ".join(f"{metas[q]['mean_return']:.2f} / {metas[q]['success_rate']:.2f}" for q in args.qualities)
    lines = [
        "# Offline RL on the GridWorld (seed-003 layout)", "",
        f"Model `{args.model}`, seeds {args.seeds} (learner seeds; one dataset per quality, data seed "
        f"{args.dataset_seed}), {args.episodes} episodes per dataset, suboptimal epsilon {args.epsilon}. "
        "Cells: final greedy evaluation, mean ± sample std over seeds. The optimal return is 4.45 "
        "(both resources, then a goal, in 11 steps); a run that never reaches a goal scores -1.00.", "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), {args.workers} run(s) at a "
        f"time with OMP_NUM_THREADS={args.threads_per_worker}"
        + (f"; {seconds / 60:.1f} min in all." if seconds else "; per-run seconds below (table rebuilt with --report-only)."),
        "",
        "| dataset | " + " | ".join(args.qualities) + " |", "| --- |" + " --- |" * len(args.qualities),
        "| behaviour policy: mean return / success | " + dataset_row + " |", "",
        *table("eval/episodic_return", "Final eval/episodic_return"),
        *table("eval/success_rate", "Final eval/success_rate"),
    ]
    if "DT" in args.algorithms:
        lines += ["The DT's evaluation conditions on R* = the dataset's best return; corr(R*, achieved return) over its "
                  "final R* sweep (`eval/rtg_correlation`):", "",
                  "| | " + " | ".join(args.qualities) + " |", "| --- |" + " --- |" * len(args.qualities),
                  "| DT rtg correlation | " + " | ".join(mean_std([results[(q, "DT", s)]["eval/rtg_correlation"]
                                                                    for s in args.seeds
                                                                    if "eval/rtg_correlation" in results[(q, "DT", s)]])
                                                           for q in args.qualities) + " |", ""]
    lines += ["## Commands", "", "```bash", "python " + " ".join(shlex.quote(a) for a in sys.argv if a != "--report-only"), "```", "",
              "Each cell ran (seed 1 shown; the others differ only in --seed and --output-dir):", "", "```bash"]
    lines += [" ".join(shlex.quote(a) for a in cmd).replace(sys.executable, "python").replace(str(ROOT) + "/", "")
              for cmd in commands.values()]
    lines += ["```", "", "## Per run", "", "| quality | algorithm | seed | return | success | rc | seconds | error |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (quality, algorithm, seed), r in results.items():
        ret, succ = r.get("eval/episodic_return"), r.get("eval/success_rate")
        lines.append(f"| {quality} | {algorithm} | {seed} | {'n/a' if ret is None else num(ret)} | "
                     f"{'n/a' if succ is None else num(succ)} | {r['rc']} | {r['seconds']:.0f} | "
                     f"{r.get('error', '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    args = tyro.cli(Args)
    bad = [q for q in args.qualities if q not in QUALITIES] + [a for a in args.algorithms if a not in ALGORITHMS]
    if bad:
        raise SystemExit(f"offline_gridworld.py: unknown --qualities/--algorithms {bad}; "
                         f"choose from {list(QUALITIES)} and {list(ALGORITHMS)}")
    if args.workers < 1 or args.threads_per_worker < 1 or args.episodes < 1 or not args.seeds:
        raise SystemExit("offline_gridworld.py: --workers, --threads-per-worker and --episodes must be >= 1, --seeds non-empty")
    runs_dir = Path(args.runs_dir).resolve()
    data_dir = runs_dir / "datasets"
    cells = {(q, a, s): command(args, a, data_dir / f"gridworld_{q}.jsonl", s, runs_dir / q / a.replace(" ", "_") / f"seed{s}")
             for q in args.qualities for a in args.algorithms for s in args.seeds}
    first_commands = {a: cells[(args.qualities[0], a, args.seeds[0])] for a in args.algorithms}
    if args.dry_run:
        for cmd in cells.values():
            print(" ".join(shlex.quote(c) for c in cmd))
        raise SystemExit(0)
    start = time.time()
    data_dir.mkdir(parents=True, exist_ok=True)
    metas = collect_datasets(args, data_dir)

    def work(key):
        quality, algorithm, seed = key
        out_dir = runs_dir / quality / algorithm.replace(" ", "_") / f"seed{seed}"
        result = run_cell(cells[key], out_dir, args.threads_per_worker, args.timeout_s)
        status = "ok" if result["rc"] == 0 else f"FAILED (rc {result['rc']}, see {out_dir / 'stdout.log'})"
        print(f"{quality:10s} {algorithm:12s} seed {seed}: return {result.get('eval/episodic_return', float('nan')):.2f} "
              f"success {result.get('eval/success_rate', float('nan')):.2f} | {result['seconds']:.0f}s | {status}", flush=True)
        return key, result

    if args.report_only:
        results = {key: read_cell(runs_dir / key[0] / key[1].replace(" ", "_") / f"seed{key[2]}") for key in cells}
    else:
        # seed-major order: the first runs are one per dataset quality, so the feature cache fills without two
        # workers encoding the same dataset; the table keeps the (quality, algorithm, seed) order
        order = sorted(cells, key=lambda k: (args.seeds.index(k[2]), args.algorithms.index(k[1]), args.qualities.index(k[0])))
        with ThreadPoolExecutor(args.workers) as pool:
            done = dict(pool.map(work, order))
        results = {key: done[key] for key in cells}
    text = markdown(args, metas, results, first_commands, None if args.report_only else time.time() - start)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    print(text)
    print(f"table written to {args.output}")
