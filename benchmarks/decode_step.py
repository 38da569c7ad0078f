"""One batched decode step of the rollout engine, timed against the context length, with each CPU kernel on or off.

    python benchmarks/decode_step.py          # smollm2-135m, B = 16, contexts 100..1500 (what results/decode_step.md ran)
    python benchmarks/decode_step.py --model tiny --contexts 16 64 --steps 2 --repeats 1   # seconds

Issue 9's rollout target is stated per decode step: "batched multi-turn decoding with smollm2-135m at B = 16
reaches >= 150 generated tokens/s", against a plain KV-cache decode loop (74 tok/s at B = 16). A rollout mixes
decode steps with observation prefills and environment steps, and its tokens/s depends on how long the
episodes' contexts have grown (benchmarks/rollout_speed.py). This script isolates the decode step: B rows of T
cached tokens, then `--steps` forwards of one token per row through `common.rollout.KVBatch` (the engine's cache
and forward, LM head included, sampling excluded), in four configurations run back to back:

* `engine`: the rollout engine's defaults on a CPU: weights input-major (`decode_weight_layout`), keys cached
  transposed and attended by `decode_attention` (`decode_attention_backend`);
* `sdpa`: the same with the keys in the usual layout and torch's SDPA (`RolloutConfig.transposed_keys=False`);
* `plain`: weights row-major and SDPA as well: an in-place KV cache with transformers' kernels, i.e. the plain
  decode loop the target is measured against;
* `engine_bf16`: the engine's defaults on a bf16 copy of the model (`grpo_agent.py --rollout-dtype bfloat16`):
  half the bytes per step, and this machine's CPU has AVX512-BF16.

The context is one random sequence prefilled once and its cache row repeated B times (rows alike; no padding).
Each configuration is measured `--repeats` times, interleaved, and the fastest repeat is reported (the others are
the shared machine's noise). Writes `{output}.md` and `{output}.jsonl`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import tyro

from common.models import load_model, sampling_copy
from common.rollout import KVBatch, decode_attention_backend, decode_weight_layout

# (input-major weights, transposed keys, weight and cache dtype)
CONFIGS = {"engine": (True, True, "float32"), "sdpa": (True, False, "float32"), "plain": (False, False, "float32"),
           "engine_bf16": (True, True, "bfloat16")}


@dataclass
class Args:
    model: str = "smollm2-135m"
    """`tiny`, `smollm2-135m` or a local model path"""
    batch_size: int = 16
    """rows decoded together (B)"""
    contexts: list[int] = field(default_factory=lambda: [100, 300, 600, 1000, 1500])
    """cached tokens per row before the timed steps (T)"""
    steps: int = 10
    """timed decode steps per measurement"""
    repeats: int = 3
    """measurements per (configuration, context), interleaved; the fastest is reported"""
    seed: int = 0
    """seed of the random context"""
    output: str = "benchmarks/results/decode_step"
    """output prefix: writes {output}.md and {output}.jsonl (empty: print only)"""


def time_steps(models: dict, pad_id: int, context: list[int], batch: int, steps: int, config: str) -> float:
    """Seconds per decode step of `batch` rows after `context`, under one configuration."""
    input_major, transposed, dtype = CONFIGS[config]
    model = models[dtype]
    with torch.no_grad(), decode_weight_layout(model, input_major), decode_attention_backend(model, transposed):
        kv = KVBatch(model, pad_id)
        kv.feed([context])
        kv.keep([0] * batch)
        kv.feed([[context[-1]]] * batch)  # one untimed step: first-call costs
        t0 = time.perf_counter()
        for _ in range(steps):
            kv.feed([[context[-1]]] * batch)
        return (time.perf_counter() - t0) / steps


def main(args: Args) -> list[dict]:
    if args.batch_size < 1 or args.steps < 1 or args.repeats < 1 or not args.contexts or min(args.contexts) < 1:
        raise SystemExit("decode_step.py: --batch-size, --steps, --repeats and every --contexts must be >= 1")
    started, load_start = time.time(), os.getloadavg()[0]
    model, tok = load_model(args.model)
    models = {"float32": model, "bfloat16": sampling_copy(model, "bfloat16")}  # grpo_agent.py --rollout-dtype bfloat16
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    generator = torch.Generator().manual_seed(args.seed)
    results = []
    for length in args.contexts:
        context = torch.randint(100, model.config.vocab_size, (length,), generator=generator).tolist()
        best = {name: float("inf") for name in CONFIGS}
        for _ in range(args.repeats):
            for name in CONFIGS:
                best[name] = min(best[name], time_steps(models, pad_id, context, args.batch_size, args.steps, name))
        for name, seconds in best.items():
            results.append({"model": args.model, "batch_size": args.batch_size, "context": length, "config": name,
                            "step_ms": seconds * 1000, "tok_s": args.batch_size / seconds})
        print(f"[decode_step] T={length}: " + ", ".join(f"{n} {best[n] * 1000:.1f} ms" for n in CONFIGS), flush=True)
    write_report(args.output, report(args, results, (load_start, os.getloadavg()[0]), time.time() - started), results)
    return results


def write_report(output: str, text: str, results: list[dict]) -> None:
    """Print the report; with an `output` prefix also write it to {output}.md and the rows to {output}.jsonl."""
    print(text)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output + ".md").write_text(text)
        Path(output + ".jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))


def provenance(script: str, args, load: tuple, seconds: float) -> str:
    """The command (as typed, or the `main` call), then the machine, commit, load and duration: a report's header."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], capture_output=True, text=True, check=False).stdout.strip()

    commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    command = f"python benchmarks/{script} " + " ".join(sys.argv[1:]) if sys.argv[0].endswith(script) \
        else f"{script[:-3]}.main({args})"
    return (f"Command: `{command}`\n\nMachine: {platform.platform()}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"with {torch.get_num_threads()} threads. Git commit {commit or 'unknown'}"
            f"{' (working tree with uncommitted changes)' if dirty else ''}. Load average (1 min) at start / end: "
            f"{load[0]:.2f} / {load[1]:.2f}; the run took {seconds:.0f} s.")


def report(args: Args, results: list[dict], load: tuple, seconds: float) -> str:
    by = {(r["context"], r["config"]): r for r in results}
    lines = [f"# One decode step of the rollout engine (`{args.model}`, B = {args.batch_size})", "",
             provenance("decode_step.py", args, load, seconds) + f" Fastest of {args.repeats} interleaved "
             f"repeats of {args.steps} steps each; absolute times hold for this machine only, read the ratios.", "",
             "| cached tokens per row | engine ms / step | engine tok/s | sdpa ms / step | plain ms / step | "
             "sdpa / engine | plain / engine | engine bf16 ms / step | engine bf16 tok/s | engine / engine bf16 |",
             "| ---: |" + " ---: |" * 9]
    for length in args.contexts:
        e, s, p, b = (by[(length, c)] for c in CONFIGS)
        lines.append(f"| {length} | {e['step_ms']:.1f} | {e['tok_s']:.0f} | {s['step_ms']:.1f} | {p['step_ms']:.1f} | "
                     f"{s['step_ms'] / e['step_ms']:.2f}x | {p['step_ms'] / e['step_ms']:.2f}x | {b['step_ms']:.1f} | "
                     f"{b['tok_s']:.0f} | {e['step_ms'] / b['step_ms']:.2f}x |")
    lines += ["", "engine: weights input-major + keys transposed with `decode_attention`; sdpa: weights input-major, "
              "keys in the usual layout, torch's SDPA; plain: weights row-major, SDPA (all three fp32); engine bf16: the "
              "engine's defaults on a bf16 copy of the model (`sampling_copy`, `grpo_agent.py --rollout-dtype "
              "bfloat16`): weights and KV cache in bf16. tok/s = B / seconds per step (one token per row per step)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(tyro.cli(Args))
