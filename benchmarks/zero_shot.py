"""Zero-shot evaluation: how a model does on an environment before any training.

    python benchmarks/zero_shot.py --model smollm2-135m --env-id gridworld --action-mode choice --episodes 50
    python benchmarks/zero_shot.py --model smollm2-135m --env-id gridworld --action-mode free --episodes 50

Prints success rate, mean return, invalid-action rate, episode length and throughput, and appends a JSON line
with the settings, the git commit and the machine to `--output` if given.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
import tyro

import envs
from common.models import load_model, resolve_device
from common.rollout import RolloutConfig, RolloutEngine


@dataclass
class Args:
    model: str = "smollm2-135m"
    """`tiny`, `smollm2-135m` or a local model path"""
    env_id: str = "gridworld"
    """environment id or `package.module:Factory`"""
    env_kwargs: str = "{}"
    """keyword arguments for `envs.make`, as JSON (e.g. '{"level": 2}')"""
    action_mode: Literal["free", "choice"] = "choice"
    """`choice` (distribution over action names) or `free` (generated text)"""
    episodes: int = 50
    """number of episodes"""
    batch_size: int = 25
    """episodes played together in one batch"""
    temperature: float = 1.0
    """sampling temperature (0 = greedy)"""
    max_turn_tokens: int = 8
    """free mode: cap on generated tokens per turn"""
    max_total_tokens: int = 4096
    """cap on an episode's whole token sequence (hitting it ends the episode as truncated)"""
    seed: int = 0
    """seed of the sampler; episode i uses environment seed `seed * 100000 + i`"""
    device: str = "cpu"
    """`cpu`, `cuda` or `auto`"""
    output: str = ""
    """append the result as a JSON line to this file (empty: print only)"""
    table: str = ""
    """only print a markdown table of the results in this JSONL file (written by `--output`), then exit"""


def markdown_table(path: str) -> str:
    """One row per run in `path`: the environment, its settings and what was measured."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    lines = ["| env id | env kwargs | action mode | episodes | success | mean return | invalid actions | "
             "mean length | tokens/s | load avg | commit |", "|-|-|-|-|-|-|-|-|-|-|-|"]
    for r in rows:
        s = r["settings"]
        load = f"{r['load_average_1min']:.1f}" if "load_average_1min" in r else "not recorded"
        lines.append(f"| `{r['env_id']}` | `{s['env_kwargs']}` | {r['action_mode']} | {s['episodes']} | "
                     f"{r['success_rate']:.2f} | {r['episodic_return']:+.2f} | {r['invalid_action_rate']:.2f} | "
                     f"{r['episode_length']:.1f} | {r['tokens_per_s']:.0f} | {load} | {r['commit']} |")
    machines = sorted({r["machine"] for r in rows})
    return "\n".join([f"Model `{rows[0]['settings']['model']}` zero-shot, temperature "
                      f"{rows[0]['settings']['temperature']}; machine: {'; '.join(machines)}. A load average above "
                      "the 2 cores means other jobs shared the CPU (tokens/s is then lower than on an idle machine).", "",
                      *lines, "", "Reproduce: `bash benchmarks/zero_shot.sh`", ""]) if rows else "no results\n"


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.table:
        print(markdown_table(args.table), end="")
        sys.exit(0)
    env_kwargs = json.loads(args.env_kwargs)
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model, device, seed=args.seed)
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode=args.action_mode, temperature=args.temperature,
                                                     max_turn_tokens=args.max_turn_tokens,
                                                     max_total_tokens=args.max_total_tokens))
    generator = torch.Generator(device=device).manual_seed(args.seed)
    trajs, start = [], time.time()
    for first in range(0, args.episodes, args.batch_size):
        seeds = [args.seed * 100_000 + i for i in range(first, min(first + args.batch_size, args.episodes))]
        trajs += engine.run([envs.make(args.env_id, **env_kwargs) for _ in seeds], seeds, args.env_id, generator=generator)
        print(f"{len(trajs)}/{args.episodes} episodes, {time.time() - start:.0f}s", flush=True)
    seconds = time.time() - start
    steps = sum(t.num_steps for t in trajs)
    result = {
        "env_id": args.env_id,
        "action_mode": args.action_mode,
        "success_rate": float(np.mean([t.success for t in trajs])),
        "episodic_return": float(np.mean([t.return_ for t in trajs])),
        "invalid_action_rate": sum(t.invalid_actions for t in trajs) / max(steps, 1),
        "episode_length": steps / len(trajs),
        "seconds": seconds,
        "tokens_per_s": sum(len(t.token_ids) for t in trajs) / seconds,
        "settings": asdict(args),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "load_average_1min": os.getloadavg()[0],  # > cores means other jobs shared the CPU: tokens/s is inflated
        "command": "python benchmarks/zero_shot.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "settings"}, indent=1))
    if args.output:
        with open(args.output, "a") as f:
            f.write(json.dumps(result) + "\n")
