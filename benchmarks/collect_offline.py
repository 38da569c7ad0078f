"""Collect an offline dataset (trajectory JSONL + `<output>.meta.json`) for CQL / Decision Transformer / BC.

    python benchmarks/collect_offline.py --env-id gridworld --quality suboptimal --episodes 500 --seed 0 \
        --output datasets/gridworld_suboptimal.jsonl
    python benchmarks/collect_offline.py --env-id gridworld --quality expert --episodes 100 --output datasets/gw_expert.jsonl
    python benchmarks/collect_offline.py --env-id gridworld-procedural --quality noisy --episodes 500 --output datasets/gwp_noisy.jsonl
    python benchmarks/collect_offline.py --env-id frozenlake --env-kwargs '{"is_slippery": true}' --quality suboptimal ...
    python benchmarks/collect_offline.py --env-id gridworld --quality llm --model smollm2-135m --temperature 1.0 \
        --episodes 64 --output datasets/gridworld_llm.jsonl           # episodes from the LLM agent in choice mode
    python benchmarks/collect_offline.py --env-id gridworld --from-jsonl runs/<run>/trajectories.jsonl \
        --output datasets/gridworld_grpo_log.jsonl                   # convert any choice-mode agent's logged records

Qualities (seed 003 §4.4): expert = the environment's optimal planner; suboptimal = the expert with probability
epsilon of a uniformly random action (successes and failures mixed); noisy = uniformly random actions; llm = an
LLM agent (common.rollout.RolloutEngine, choice mode). Prints the dataset's size, success rate and mean return;
`--filter` additionally applies seed 003's demonstration filter (success only, no hesitant or over-long runs).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tyro

from common.offline import collect, dataset_stats, filter_demonstrations, from_agent_records, write_dataset
from common.records import read_jsonl


@dataclass
class Args:
    env_id: str = "gridworld"
    """a discrete-action environment id (gridworld, gridworld-procedural, frozenlake, taxi, cliffwalking, ...)"""
    env_kwargs: str = "{}"
    """keyword arguments for `envs.make`, as JSON (e.g. '{"split": "test"}', '{"is_slippery": true}')"""
    quality: Literal["expert", "suboptimal", "noisy", "llm"] = "suboptimal"
    """which behaviour policy plays the episodes"""
    episodes: int = 500
    """number of episodes"""
    seed: int = 0
    """episode i uses environment seed seed * 1_000_003 + i; random actions are seeded by (seed, i)"""
    epsilon: float = 0.3
    """suboptimal: probability of a uniformly random action instead of the expert's"""
    model: str = "smollm2-135m"
    """llm: the agent's model (`tiny`, `smollm2-135m` or a local path, e.g. a run's saved model)"""
    temperature: float = 1.0
    """llm: sampling temperature over the action distribution"""
    device: str = "cpu"
    """llm: `cpu` or `cuda`"""
    from_jsonl: str = ""
    """convert logged choice-mode agent trajectories (JSONL) instead of collecting (quality is then `llm`)"""
    filter: bool = False
    """apply seed 003's demonstration filter before writing"""
    filter_max_steps: int = 0
    """filter: drop runs longer than this (0: 3 x the optimal length when the environment knows it, else no limit)"""
    output: str = "datasets/dataset.jsonl"
    """where to write the JSONL; the meta file goes to `<output>.meta.json`"""


if __name__ == "__main__":
    args = tyro.cli(Args)
    try:
        env_kwargs = json.loads(args.env_kwargs)
        assert isinstance(env_kwargs, dict)
    except (json.JSONDecodeError, AssertionError):
        raise SystemExit(f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}")
    t0 = time.time()
    quality = "llm" if args.from_jsonl else args.quality
    try:
        if args.from_jsonl:
            trajs = from_agent_records(read_jsonl(args.from_jsonl), args.env_id, env_kwargs)
        else:
            trajs = collect(args.env_id, args.quality, args.episodes, args.seed, args.epsilon, env_kwargs,
                            model=args.model, temperature=args.temperature, device=args.device)
    except (ValueError, TypeError, OSError) as e:
        raise SystemExit(f"collect_offline.py: {e} (--env-id {args.env_id}, --quality {quality})")
    meta = {"env_id": args.env_id, "env_kwargs": env_kwargs, "quality": quality, "seed": args.seed,
            "epsilon": args.epsilon if quality == "suboptimal" else None,
            "model": args.model if quality == "llm" else None,
            "temperature": args.temperature if quality == "llm" and not args.from_jsonl else None,
            "source": args.from_jsonl or None}
    if args.filter:
        import envs

        max_steps = args.filter_max_steps or None
        if max_steps is None:
            env = envs.make(args.env_id, **env_kwargs)
            env.reset(seed=args.seed)
            optimal = getattr(env, "optimal_steps", lambda: None)()
            max_steps = 3 * optimal if optimal else None  # the seed's OPTIMAL_LENGTH * 3 (one layout's optimum)
        before = len(trajs)
        trajs = filter_demonstrations(trajs, max_steps=max_steps)
        meta["filter"] = {"max_repeat_fraction": 0.4, "max_steps": max_steps, "episodes_before": before}
    if not trajs:
        raise SystemExit("collect_offline.py: no episodes left to write (the filter kept none)")
    write_dataset(args.output, trajs, meta)
    s = dataset_stats(trajs)
    print(f"{args.output}: {s['episodes']} episodes, {s['num_steps']} transitions | success {s['success_rate']:.3f} "
          f"| mean return {s['mean_return']:.3f} | mean length {s['mean_length']:.1f} | {s['terminations']} "
          f"| {time.time() - t0:.1f}s")
