"""Zero-shot evaluation: how a model does on an environment before any training.

    python benchmarks/zero_shot.py --model smollm2-135m --env-id gridworld --action-mode choice --episodes 50
    python benchmarks/zero_shot.py --model smollm2-135m --env-id gridworld --action-mode free --episodes 50
    python benchmarks/zero_shot.py --model random --env-id gridworld --episodes 20000   # the uniform-random reference

Prints success rate, mean return, invalid-action rate, episode length and throughput, and appends a JSON line
with the settings, the git commit and the machine to `--output` if given. Where the environment knows its optimal
return (GridWorld, the toy-text adapters) it also reports `near_optimal_rate`, the share of episodes whose return
is at least 90% of the optimum (issue 9's learning target); `--model random` (no LM: a uniformly random action
name every step) measures how often plain exploration finds such an episode.
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
from common.records import write_jsonl
from common.rollout import RolloutConfig, RolloutEngine, check_env


@dataclass
class Args:
    model: str = "smollm2-135m"
    """`tiny`, `smollm2-135m`, a local model path, or `random` (uniform over the env's action names; no LM)"""
    env_id: str = "gridworld"
    """environment id or `package.module:Factory`"""
    env_kwargs: str = "{}"
    """keyword arguments for `envs.make`, as JSON (e.g. '{"level": 2}')"""
    action_mode: Literal["free", "choice"] = "choice"
    """`choice` (distribution over action names) or `free` (generated text)"""
    mask_illegal_actions: bool = False
    """choice mode: choose only among the environment's legal_actions() (invalid-action masking), as a policy
    trained with ppo_gae_agent.py --mask-illegal-actions acts; with `--model random`, uniform over them"""
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
    trajectories: str = ""
    """also write every episode's trajectory record to this JSONL file (common/records.py), to read the failures
    (e.g. with benchmarks/gridworld_failures.py); empty: not kept"""
    table: str = ""
    """only print a markdown table of the results in this JSONL file (written by `--output`), then exit"""


NEAR_OPTIMAL = 0.9  # `near_optimal_rate`: return within 10% of the episode's optimal return (of its size)


def near_optimal_return(ret: float, optimum: float) -> bool:
    """At least 90% of a positive optimum; for a negative one (CliffWalking's -13), at most 10% worse than it."""
    return ret >= optimum - (1 - NEAR_OPTIMAL) * abs(optimum)


def random_policy_episodes(args: Args, env_kwargs: dict):
    """`--model random`: a uniformly random action name every step, one episode at a time (no LM, no tokens)."""
    rng = np.random.default_rng(args.seed)
    returns, successes, lengths, near_optimal = [], [], [], []
    for i in range(args.episodes):
        env = envs.make(args.env_id, **env_kwargs)
        if not env.action_names:
            raise SystemExit(f"--model random: {args.env_id!r} has no action names to choose from (free-text env)")
        env.reset(seed=args.seed * 100_000 + i)
        ret, done, info, steps = 0.0, False, {}, 0
        while not done:
            legal = env.legal_actions() if args.mask_illegal_actions else range(len(env.action_names))
            _, reward, terminated, truncated, info = env.step(int(rng.choice(list(legal))))
            ret, steps, done = ret + reward, steps + 1, terminated or truncated
        returns.append(ret)
        successes.append(info.get("termination") == "success")  # what the rollout engine records as success
        lengths.append(steps)
        if hasattr(env, "optimal_return"):
            near_optimal.append(near_optimal_return(ret, env.optimal_return()))
    return returns, successes, lengths, near_optimal


def near_optimal_cell(row: dict) -> str:
    """The share as a percentage with enough digits for rare events (0.055%), blank when not measured."""
    rate = row.get("near_optimal_rate")
    return "" if rate is None else f"{100 * rate:.3g}%"


def markdown_table(path: str) -> str:
    """One row per run in `path`: the environment, its settings and what was measured."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    # several models or temperatures in one file (e.g. a trained checkpoint beside its base): one column says whose row
    mixed = len({(r["settings"]["model"], r["settings"]["temperature"]) for r in rows}) > 1
    lines = [("| model | temperature " if mixed else "") + "| env id | env kwargs | action mode | episodes | success | "
             "mean return | invalid actions | near-optimal | mean length | tokens/s | load avg | commit |",
             "|-|-|-|-|-|-|-|-|-|-|-|-|" + ("-|-|" if mixed else "")]
    for r in rows:
        s = r["settings"]  # rows written before env_id / action_mode / env_kwargs were top-level keep them in settings
        r = {"env_id": s["env_id"], "action_mode": s["action_mode"], **r}
        s = {"env_kwargs": "{}", **s}
        load = f"{r['load_average_1min']:.1f}" if "load_average_1min" in r else "not recorded"
        tokens_per_s = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else ""  # blank: no LM (`--model random`)
        lines.append((f"| `{s['model']}` | {s['temperature']} " if mixed else "") +
                     f"| `{r['env_id']}` | `{s['env_kwargs']}` | {r['action_mode']}"
                     f"{' (legal only)' if s.get('mask_illegal_actions') else ''} | {s['episodes']} | "
                     f"{r['success_rate']:.2f} | {r['episodic_return']:+.2f} | {r['invalid_action_rate']:.2f} | "
                     f"{near_optimal_cell(r)} | {r['episode_length']:.1f} | {tokens_per_s} | {load} | {r['commit']} |")
    machines = sorted({r["machine"] for r in rows})
    model = rows[0]["settings"]["model"]
    policy = ("Each row's model and temperature in its first columns" if mixed else
              "A uniformly random action name every step (`--model random`, no LM)" if model == "random" else
              f"Model `{model}` zero-shot, temperature {rows[0]['settings']['temperature']}")
    return "\n".join([f"{policy}; near-optimal: share of episodes with a return within {1 - NEAR_OPTIMAL:.0%} of the "
                      f"optimum (blank: the env does not know its optimum); machine: {'; '.join(machines)}. A load average above "
                      "the 2 cores means other jobs shared the CPU (tokens/s is then lower than on an idle machine).", "",
                      *lines, "", "Reproduce: `bash benchmarks/zero_shot.sh`", ""]) if rows else "no results\n"


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.table:
        print(markdown_table(args.table), end="")
        sys.exit(0)
    if args.trajectories and args.model == "random":
        raise SystemExit("--trajectories: `--model random` plays without the rollout engine and keeps no records")
    env_kwargs = json.loads(args.env_kwargs)
    if args.mask_illegal_actions:  # the engine's own check, before loading a model (and for `--model random` too)
        try:
            check_env(envs.make(args.env_id, **env_kwargs), args.action_mode, mask_illegal_actions=True)
        except ValueError as e:
            raise SystemExit(f"--mask-illegal-actions: {e}")
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    trajs, start = [], time.time()
    if args.model == "random":
        returns, successes, steps_per_episode, near_optimal = random_policy_episodes(args, env_kwargs)
        seconds = time.time() - start
        steps, tokens = sum(steps_per_episode), 0
        invalid = 0  # a random action *index* is always a valid action
    else:
        model, tok = load_model(args.model, device, seed=args.seed)
        engine = RolloutEngine(model, tok, RolloutConfig(action_mode=args.action_mode, temperature=args.temperature,
                                                         max_turn_tokens=args.max_turn_tokens,
                                                         max_total_tokens=args.max_total_tokens,
                                                         mask_illegal_actions=args.mask_illegal_actions))
        generator = torch.Generator(device=device).manual_seed(args.seed)
        near_optimal = []
        for first in range(0, args.episodes, args.batch_size):
            seeds = [args.seed * 100_000 + i for i in range(first, min(first + args.batch_size, args.episodes))]
            batch = [envs.make(args.env_id, **env_kwargs) for _ in seeds]
            trajs += engine.run(batch, seeds, args.env_id, generator=generator)
            near_optimal += [near_optimal_return(t.return_, env.optimal_return())
                             for env, t in zip(batch, trajs[first:]) if hasattr(env, "optimal_return")]
            print(f"{len(trajs)}/{args.episodes} episodes, {time.time() - start:.0f}s", flush=True)
        seconds = time.time() - start
        returns, successes = [t.return_ for t in trajs], [t.success for t in trajs]
        steps, tokens = sum(t.num_steps for t in trajs), sum(len(t.token_ids) for t in trajs)
        invalid = sum(t.invalid_actions for t in trajs)
        if args.trajectories:
            write_jsonl(args.trajectories, trajs)
    result = {
        "env_id": args.env_id,
        "action_mode": args.action_mode,
        "success_rate": float(np.mean(successes)),
        "episodic_return": float(np.mean(returns)),
        "invalid_action_rate": invalid / max(steps, 1),
        "episode_length": steps / args.episodes,
        **({"near_optimal_rate": float(np.mean(near_optimal))} if near_optimal else {}),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
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
