"""Peak RSS of one GRPO iteration on CPU, per configuration, each in a fresh process.

    OMP_NUM_THREADS=1 python benchmarks/memory.py                          # every config, with the allocator fix (1024 KiB)
    OMP_NUM_THREADS=1 python benchmarks/memory.py --thresholds 0 1024      # before (glibc default) and after
    OMP_NUM_THREADS=1 python benchmarks/memory.py --configs full-kl full-kl-gc --thresholds 1024
    python benchmarks/memory.py --model tiny --configs top6 --output /tmp/m.md   # seconds, a smoke test

Each row runs `algorithms/grpo_agent.py` for one iteration of one group of 4 GridWorld episodes (choice mode,
seed 1, no evaluation, zero-variance filtering off so the update always runs: rollout, reference log-probs when
beta > 0, `--update-epochs` (default 2) forward/backward passes over micro-batches of 4 episodes
(`--micro-batch-size 4` unless a config sets it), AdamW steps) and records the child's peak resident set size
(`os.wait4` ru_maxrss, the same number `/usr/bin/time -v` prints as "Maximum resident set size") and its wall-clock
seconds. Rows are appended to a JSONL file next to `--output` and the markdown table is rebuilt from all rows there,
so a "before" run and an "after" run made separately end up in one table. `--thresholds` sets grpo_agent's `--malloc-mmap-threshold-kib`
(0: glibc's dynamic default, i.e. the behaviour before that flag existed).

How long it takes (shared 2-core CPU, OMP_NUM_THREADS=1): 1-5 min per row with smollm2-135m (gradient
checkpointing and full fine-tuning are the slow ones).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "algorithms/grpo_agent.py"
# the configurations of the issue: name -> (description, extra flags)
CONFIGS = {
    "top6": ("top 6 layers, β = 0", []),
    "top6-bf16": ("top 6 layers, β = 0, bf16 sampler and update", ["--rollout-dtype", "bfloat16", "--update-dtype",
                                                                   "bfloat16"]),
    "top6-kl": ("top 6 layers, β = 0.04", ["--beta", "0.04"]),
    "top6-kl-lora": ("top 6 layers, β = 0.04, LoRA r16", ["--beta", "0.04", "--lora-r", "16"]),
    "full": ("all layers, β = 0", ["--trainable-layers", "0"]),
    "full-kl": ("all layers, β = 0.04", ["--trainable-layers", "0", "--beta", "0.04"]),
    "full-kl-gc": ("all layers, β = 0.04, grad. checkpointing", ["--trainable-layers", "0", "--beta", "0.04",
                                                                  "--gradient-checkpointing"]),
    "full-kl-mb1": ("all layers, β = 0.04, micro-batch 1", ["--trainable-layers", "0", "--beta", "0.04",
                                                            "--micro-batch-size", "1"]),
    "full-kl-lora": ("all layers, β = 0.04, LoRA r16", ["--trainable-layers", "0", "--beta", "0.04", "--lora-r", "16"]),
    "full-kl-lora-gc": ("all layers, β = 0.04, LoRA r16, grad. checkpointing",
                        ["--trainable-layers", "0", "--beta", "0.04", "--lora-r", "16", "--gradient-checkpointing"]),
    "full-gc-ddp2": ("all layers, β = 0, grad. checkpointing, torchrun 2 ranks (one rank's peak)",
                     ["--trainable-layers", "0", "--gradient-checkpointing"]),
    "full-gc-fsdp2": ("all layers, β = 0, grad. checkpointing, torchrun 2 ranks `--fsdp` (one rank's peak)",
                      ["--trainable-layers", "0", "--gradient-checkpointing", "--fsdp"]),
}
# configurations run under torchrun: the number of processes (ru_maxrss of the launcher is its largest rank's peak)
RANKS = {"full-gc-ddp2": 2, "full-gc-fsdp2": 2}
KEEP = "<!-- kept by benchmarks/memory.py -->"
COMMON = ["--total-iterations", "1", "--group-size", "4", "--eval-every", "0", "--no-filter-zero-variance", "--seed", "1"]
# the rows were measured at micro-batch 4, grpo_agent.py's default until session 32 (now 1); a config may override it
MICRO_BATCH = ["--micro-batch-size", "4"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="configurations:\n" + "\n".join(f"  {k:18s} {d}: {' '.join(f)}"
                                                                        for k, (d, f) in CONFIGS.items()))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), help="which rows to run")
    p.add_argument("--thresholds", nargs="+", type=int, default=[1024],
                   help="values of grpo_agent's --malloc-mmap-threshold-kib to run each config with (0: glibc default)")
    p.add_argument("--model", default="smollm2-135m", help="`smollm2-135m` (the issue's setting) or `tiny`")
    p.add_argument("--output", default="benchmarks/results/memory.md", help="markdown table; rows accumulate in <output>.jsonl")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a row is killed and recorded as timed out")
    p.add_argument("--note", default="", help="a label stored with these rows (e.g. which code state they measure)")
    p.add_argument("--fresh", action="store_true", help="start a new JSONL instead of appending to the existing rows")
    return p.parse_args(argv)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    mem = next((int(line.split()[1]) / 2**20 for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0) \
        if os.path.exists("/proc/meminfo") else 0
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def _spawn(cmd: list[str], env: dict, timeout: float) -> tuple[int, float, float, str]:
    """Run cmd; return (exit code, peak RSS in GiB, seconds, output). The child is reaped with os.wait4, whose
    ru_maxrss (KiB on Linux) is the largest of the child's and its reaped descendants' peaks: under torchrun, the
    largest rank's."""
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.time() - t0 > timeout:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
        seconds = time.time() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not try to reap it again
        log.seek(0)
        return proc.returncode, usage.ru_maxrss / 2**20, seconds, log.read()


def phase_times(log: str) -> str:
    """`rollout X, update Y` from grpo_agent's iteration line."""
    for line in log.splitlines():
        if line.startswith("iter 1/") and "(rollout" in line:
            return line.split("(", 1)[1].split(")", 1)[0]
    return ""


def write_table(rows: list[dict], output: Path):
    lines = ["# Peak RSS of one GRPO iteration on CPU", "",
             "Written by `benchmarks/memory.py` (see its docstring). Each row: a fresh `algorithms/grpo_agent.py` process,",
             "1 iteration, 1 group of 4 GridWorld episodes (choice mode, seed 1), 2 update epochs, micro-batch 4 unless",
             "stated, no evaluation, `--no-filter-zero-variance`; peak = the child's ru_maxrss (`/usr/bin/time -v`'s",
             "\"Maximum resident set size\"). `mmap threshold` is `--malloc-mmap-threshold-kib`: `0` = glibc's dynamic",
             "default (the behaviour before the flag), `1024` = the flag set to 1024 (opt-in). Seconds are wall-clock on a shared",
             "machine (other jobs on the cores): compare them loosely.", ""]
    for mach in sorted({r["machine"] for r in rows}):
        lines += [f"Machine: {mach}.", ""]
    lines += ["| configuration | model | mmap threshold (KiB) | peak RSS (GiB) | seconds | phases (s) | exit | note | date (UTC) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    order = {k: i for i, k in enumerate(CONFIGS)}
    for r in sorted(rows, key=lambda r: (r["model"], order.get(r["config"], 99), r["threshold"], r["date"])):
        lines.append(f"| {CONFIGS[r['config']][0]} | {r['model']} | {r['threshold']} | {r['peak_gib']:.2f} | "
                     f"{r['seconds']:.0f} | {r['phases']} | {r['exit']} | {r.get('note', '')} | {r['date']} |")
    lines += ["", "Commands (`OMP_NUM_THREADS=1`, run from the repository root):", ""]
    seen = set()
    for r in rows:
        if r["command"] not in seen:
            seen.add(r["command"])
            lines.append(f"- `{r['command']}`")
    kept = ""  # hand-written sections (e.g. "## Before the fixes") after the generated part survive a rerun
    if output.exists() and KEEP in output.read_text():
        kept = "\n" + KEEP + output.read_text().split(KEEP, 1)[1]
    output.write_text("\n".join(lines) + "\n" + kept)


def main(argv=None):
    args = parse_args(argv)
    output = ROOT / args.output if not os.path.isabs(args.output) else Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    jsonl = output.with_suffix(".jsonl")
    rows = [] if args.fresh or not jsonl.exists() else [json.loads(line) for line in jsonl.read_text().splitlines() if line]
    mach = machine()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore"}
    for config in args.configs:
        for threshold in args.thresholds:
            with tempfile.TemporaryDirectory() as out:
                extra = CONFIGS[config][1]
                flags = ["--model", args.model, *COMMON, *([] if "--micro-batch-size" in extra else MICRO_BATCH), *extra,
                         "--malloc-mmap-threshold-kib", str(threshold)]
                launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS[config]),
                          "--master_port", str(29700 + threshold % 97)] if config in RANKS else [sys.executable]
                code, peak, seconds, log = _spawn([*launch, SCRIPT, *flags, "--output-dir", out], env, args.timeout)
            row = {"config": config, "model": args.model, "threshold": threshold, "peak_gib": peak, "seconds": seconds,
                   "phases": phase_times(log), "exit": code, "note": args.note, "machine": mach,
                   "load_avg": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                   "command": f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} "
                              + (f"torchrun --nproc_per_node {RANKS[config]}" if config in RANKS else "python")
                              + f" {SCRIPT} {shlex.join(flags)}"}
            if code != 0:
                print(log[-2000:], file=sys.stderr)
            print(f"{config:18s} threshold {threshold:5d} KiB | peak {peak:.2f} GiB | {seconds:.0f} s | {row['phases']} "
                  f"| exit {code}", flush=True)
            rows.append(row)
            with jsonl.open("a" if jsonl.exists() and not (args.fresh and len(rows) == 1) else "w") as f:
                f.write(json.dumps(row) + "\n")
            write_table(rows, output)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
