"""Run a matrix of algorithm x environment x seed as subprocesses, skipping cells already complete.

    python benchmarks/run.py --algorithms grpo_agent ppo_gae_agent --env-ids gridworld --seeds 1 2 3 \
        --script-args "--total-iterations 25" --workers 1
    python benchmarks/run.py ... --dry-run          # print the commands, run nothing

Each cell writes into `{output_dir}/{algorithm}/{env_id}/seed{seed}/`: the script's own run directory
(`--output-dir` points there), `stdout.log`, and `cell.json` with the command, the git commit, the
machine, the wall-clock seconds and the return code. A cell counts as complete when `cell.json` says
return code 0 for the same command; rerunning the matrix then runs only what is missing or failed,
so an interrupted benchmark resumes where it stopped. `benchmarks/plot.py` reads the result.

On a 2-core machine keep `--workers 1` for timings (parallel cells share the cores; their wall-clock
numbers are then not comparable with single runs).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Args:
    algorithms: list[str] = field(default_factory=lambda: ["grpo_agent"])
    """script names in algorithms/ (without .py)"""
    env_ids: list[str] = field(default_factory=lambda: ["gridworld"])
    """environment ids passed as --env-id"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds passed as --seed"""
    script_args: str = ""
    """extra flags for every script, one shell-quoted string (e.g. "--model tiny --total-iterations 5")"""
    output_dir: str = "benchmarks/runs"
    """root of the matrix's cells"""
    workers: int = 1
    """cells run at the same time (1 for timings on a small machine)"""
    timeout_s: int = 0
    """kill a cell after this many seconds (0: no limit); a killed cell is recorded as failed and rerun next time"""
    scripts_dir: str = str(ROOT / "algorithms")
    """where the scripts live (tests point this elsewhere)"""
    dry_run: bool = False
    """print the commands and which cells would be skipped; run nothing"""


@dataclass
class Cell:
    algorithm: str
    env_id: str
    seed: int
    command: list[str]
    directory: Path


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def build_cells(args: Args) -> list[Cell]:
    cells = []
    for algo in args.algorithms:
        script = Path(args.scripts_dir) / f"{algo}.py"
        for env_id in args.env_ids:
            for seed in args.seeds:
                directory = Path(args.output_dir) / algo / env_id.replace(":", "_").replace("/", "_") / f"seed{seed}"
                command = [sys.executable, str(script), "--env-id", env_id, "--seed", str(seed),
                           "--output-dir", str(directory), *shlex.split(args.script_args)]
                cells.append(Cell(algo, env_id, seed, command, directory))
    return cells


def is_complete(cell: Cell) -> bool:
    """Complete = a previous run of exactly this command exited with 0 (a changed flag reruns the cell)."""
    record = cell.directory / "cell.json"
    if not record.exists():
        return False
    try:
        done = json.loads(record.read_text())
    except json.JSONDecodeError:
        return False
    return done.get("returncode") == 0 and done.get("command") == cell.command[1:]


def run_cell(cell: Cell, commit: str, timeout_s: int) -> dict:
    cell.directory.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(cell.directory / "stdout.log", "w") as log:
        try:
            proc = subprocess.run(cell.command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                  timeout=timeout_s or None)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = -9
    record = {
        # the interpreter path differs between machines; the rest of the command identifies the cell
        "command": cell.command[1:], "returncode": returncode, "wall_clock_s": round(time.time() - start, 1),
        "git_commit": commit, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "algorithm": cell.algorithm, "env_id": cell.env_id, "seed": cell.seed,
    }
    (cell.directory / "cell.json").write_text(json.dumps(record, indent=2))
    return record


def main(args: Args) -> int:
    if args.workers < 1:
        raise SystemExit("run.py: --workers must be >= 1")
    missing = [a for a in args.algorithms if not (Path(args.scripts_dir) / f"{a}.py").exists()]
    if missing:
        raise SystemExit(f"run.py: --algorithms: no script for {missing} in {args.scripts_dir}")
    cells = build_cells(args)
    todo = [c for c in cells if not is_complete(c)]
    print(f"{len(cells)} cells, {len(cells) - len(todo)} complete, {len(todo)} to run ({args.workers} at a time)")
    if args.dry_run:
        for c in cells:
            print(("skip " if c not in todo else "run  ") + shlex.join(c.command[1:]))
        return 0
    commit, failed = git_commit(), 0
    with ThreadPoolExecutor(args.workers) as pool:
        for n, record in enumerate(pool.map(lambda c: run_cell(c, commit, args.timeout_s), todo), 1):
            ok = record["returncode"] == 0
            failed += not ok
            print(f"[{n}/{len(todo)}] {record['algorithm']} {record['env_id']} seed {record['seed']}: "
                  f"{'ok' if ok else 'FAILED (rc ' + str(record['returncode']) + ')'} in {record['wall_clock_s']:.0f}s")
    if failed:
        print(f"{failed} cell(s) failed; see their stdout.log. Rerunning the same command retries only those.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
