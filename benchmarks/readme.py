"""Writes the README's measured numbers from the committed results, so none of them is typed by hand.

    python benchmarks/readme.py                       # rewrite the generated blocks of README.md
    python benchmarks/readme.py --check               # exit 1 if README.md differs from what the results say
    python benchmarks/readme.py --record-tests LOG    # after `bash .ci/run | tee LOG`: store the test counts and time

A generated block is the text between `<!-- generated: NAME -->` and `<!-- end generated: NAME -->`; the
prose around it is written by hand and holds no measurement. Each block is rendered from files that a
benchmark script wrote under benchmarks/results/ (the script is named in the block), so a rerun of that
script followed by this one updates the README. tests/test_readme.py runs `--check` in CI.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)", re.S)


@dataclass
class Args:
    check: bool = False
    """only compare: exit 1 (and show the stale blocks) if README.md is not what the results say"""
    record_tests: str = ""
    """a log of `bash .ci/run` (pytest's summary line at the end): write its counts and time to
    benchmarks/results/test_suite.json, then regenerate"""
    tested_commit: str = ""
    """with --record-tests: the commit the log's run tested (default: this checkout's HEAD)"""
    load: str = "otherwise idle"
    """with --record-tests: what else ran on the machine during the run (it changes the time, not the counts)"""
    readme: str = str(ROOT / "README.md")
    """the file whose generated blocks are rewritten"""


def markdown_tables(text: str) -> list[list[list[str]]]:
    """Every markdown table in `text`, as rows of stripped cells (the header row first, the --- row dropped)."""
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def main_job() -> str:
    """The README's main job (grpo_agent.py, defaults), from the summary benchmarks/summarize_run.py wrote."""
    text = (RESULTS / "grpo_agent_gridworld.md").read_text()
    run1 = text.split("## Main job")[1].split("\n## ")[0]
    header, *rows = markdown_tables(run1)[0]
    col = {name: i for i, name in enumerate(header)}
    evals = [r for r in rows if r[col["greedy success"]]]
    sampled = {r[0]: r[col["sampled success"]] for r in rows if r[col["sampled success"]]}
    first_sampled = min(sampled, key=int)
    cells = lambda f: " | ".join(f(r) for r in evals)  # noqa: E731
    per_iter = re.search(r"mean ([\d.]+) s \(rollout ([\d.]+) s, update ([\d.]+) s\).*?throughput (\d+) tokens/s.*?"
                         r"(\d+) iterations, (\d+) s of rollout", run1, re.S)
    mean_s, rollout_s, update_s, tok_s, iters, total_s = per_iter.groups()
    final = evals[-1]
    return "\n".join([
        f"| training episodes | {cells(lambda r: r[0])} |",
        "| --- |" + " --- |" * len(evals),
        f"| greedy success rate | {cells(lambda r: r[col['greedy success']])} |",
        f"| greedy return (optimal 4.45) | {cells(lambda r: r[col['greedy return']])} |",
        f"| sampled success rate (T = 2) | " + " | ".join(
            sampled.get(r[0], "") or (f"{sampled[first_sampled]} (ep. {first_sampled})" if r[0] == "0" else "")
            for r in evals) + " |",
        "",
        f"Time: {total_s} s of rollout + update for {iters} iterations on an otherwise idle machine ({mean_s} s per "
        f"iteration: rollout {rollout_s} s, update {update_s} s; the rollout processes about {tok_s} tokens/s); "
        f"the greedy evaluations and start-up come on top. Final greedy success {final[col['greedy success']]}, "
        f"return {final[col['greedy return']]} of the optimal 4.45. Source: `python benchmarks/summarize_run.py` "
        "on the run, [benchmarks/results/grpo_agent_gridworld.md](benchmarks/results/grpo_agent_gridworld.md).",
    ])


def _three_way(name: str, with_seed: bool) -> str:
    """A table of benchmarks/hybrid_three_way.py's output (latency columns dropped: see the file)."""
    text = (RESULTS / f"{name}.md").read_text()
    command = next(line for line in text.splitlines() if line.startswith("python benchmarks/hybrid_three_way.py"))
    tables = markdown_tables(text)
    ours, seed = tables[0], tables[1] if with_seed else None
    keep = ["agent", "resources", "steps", "goal rate", "return", "planner calls / episode"]
    idx = [ours[0].index(k) for k in keep]
    lines = ["| " + " | ".join(keep) + " |", "|" + " --- |" * len(keep)]
    lines += ["| " + " | ".join(r[i] for i in idx) + " |" for r in ours[1:]]
    if with_seed:
        sidx = [seed[0].index(k) for k in ("agent", "resources", "steps", "goal rate", "reward", "LLM calls")]
        lines += ["| *" + " | ".join(r[i] for i in sidx) + "* |" for r in seed[1:]]
    first = text.splitlines()[2].split("; latencies")[0] + "."  # the setting and the machine
    scale = " Rewards of the seed's rows are on its own scale." if with_seed else ""
    return "\n".join(lines + ["", f"{first}{scale} "
                              f"Source: `{command}`, [benchmarks/results/{name}.md](benchmarks/results/{name}.md)."])


def three_way() -> str:
    """Seed 003's three-way table on its own layout, with the seed's numbers beside ours."""
    return _three_way("hybrid_three_way", with_seed=True)


def three_way_procedural() -> str:
    """The same three agents trained on the procedural layouts and evaluated on the held-out ones (not in the seed)."""
    return _three_way("hybrid_three_way_procedural", with_seed=False)


def three_way_babyai() -> str:
    """The three agents on a BabyAI level, with minigrid's BabyAIBot as the oracle planner (not in the seed)."""
    return _three_way("hybrid_three_way_babyai", with_seed=False)


def zero_shot() -> str:
    """SmolLM2 before training on each environment family, from benchmarks/zero_shot.py's JSONL, beside the
    uniform-random policy on the environments with action names (zero_shot_random.jsonl)."""
    latest = {(r["env_id"], r["settings"]["env_kwargs"], r["action_mode"]): r
              for r in _jsonl_rows("zero_shot_families.jsonl")}
    rows = list(latest.values())  # a rerun replaces a row
    random_rows = {(r["env_id"], r["settings"]["env_kwargs"]): r for r in _jsonl_rows("zero_shot_random.jsonl")}
    lines = ["| env id | env kwargs | action mode | episodes | success | mean return | invalid actions | "
             "random policy: success / mean return |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s, rnd = r["settings"], random_rows.get((r["env_id"], r["settings"]["env_kwargs"]))
        reference = f"{rnd['success_rate']:.3f} / {rnd['episodic_return']:+.2f}" if rnd else ""
        lines.append(f"| `{r['env_id']}` | `{s['env_kwargs']}` | {r['action_mode']} | {s['episodes']} | "
                     f"{r['success_rate']:.2f} | {r['episodic_return']:+.2f} | {r['invalid_action_rate']:.2f} | "
                     f"{reference} |")
    return "\n".join(lines + ["", f"Model `{rows[0]['settings']['model']}`, temperature {rows[0]['settings']['temperature']}. "
                              "Random policy: a uniformly random action name every step, no LM (`zero_shot.py --model "
                              "random`, 2,000-20,000 episodes; blank: free-text env). Source: `bash "
                              "benchmarks/zero_shot.sh`, [benchmarks/results/zero_shot_families.md]"
                              "(benchmarks/results/zero_shot_families.md) (commit, load and tokens/s per row) and "
                              "[benchmarks/results/zero_shot_random.md](benchmarks/results/zero_shot_random.md)."])


def performance() -> str:
    """Rollout-engine and GRPO-step ratios, from rollout_speed.py's JSONL and vs_trl.py's sections."""
    cells = [json.loads(line) for line in (RESULTS / "rollout_speed.jsonl").read_text().splitlines() if line.strip()]
    by = {(c["env"], c["turns"], c["method"]): c for c in cells}
    lines = ["| rollout (B = 16, `smollm2-135m`, greedy) | turns | engine tok/s | batched re-encoding `generate` tok/s | "
             "engine / batched | per-episode `generate` tok/s | engine / per-episode |", "| --- |" + " --- |" * 6]
    for (env, turns, method), c in sorted(by.items()):
        base, single = by.get((env, turns, "generate_batch")), by.get((env, turns, "generate_single"))
        if method == "engine" and base:
            lines.append(f"| {env} | {turns} | {c['tok_s']:.1f} | {base['tok_s']:.1f} | {c['tok_s'] / base['tok_s']:.2f}x | "
                         + (f"{single['tok_s']:.1f} | {c['tok_s'] / single['tok_s']:.2f}x |" if single else "not run | |"))
    lines += ["", "| rollout engine, with vs without (B = 16, `smollm2-135m`, GridWorld, greedy) | turns | with s | "
              "without s | whole rollout | decode loop | decode tok/s with |", "| --- |" + " --- |" * 6]
    ablations = [("rollout_speed_cache", "engine_concat", "KV cache written in place (`BufferedCache`) vs "
                  "transformers' `DynamicCache`"), ("rollout_speed_layout", "engine_row_major", "weights input-major "
                  "while decoding (`decode_weight_layout`) vs row-major"), ("rollout_speed_attention", "engine_sdpa",
                  "keys cached transposed, `decode_attention` vs SDPA")]
    for name, without, label in ablations:  # each file: the engine and one ablation, back to back in one run
        rows = (RESULTS / f"{name}.jsonl").read_text().splitlines()
        cells = {(c["turns"], c["method"]): c for c in map(json.loads, rows) if c}
        for turns in sorted({t for t, _ in cells}):
            a, b = cells[(turns, "engine")], cells[(turns, without)]
            lines.append(f"| {label} | {turns} | {a['wall_s']:.1f} | {b['wall_s']:.1f} | {b['wall_s'] / a['wall_s']:.2f}x | "
                         f"{b['decode_s'] / a['decode_s']:.2f}x | {a['generated_tokens'] / a['decode_s']:.0f} |")
    lines += ["", "| bf16 on this CPU (AMX; opt-in flags of grpo_agent.py) | setting | fp32 | bf16 | bf16 speed-up |",
              "| --- |" + " --- |" * 4]
    bf16 = {(c["env"], c["turns"], c["method"]): c for c in map(json.loads, (RESULTS / "rollout_speed_bf16.jsonl")
                                                               .read_text().splitlines()) if c}
    for (env, turns, method), c in sorted(bf16.items()):  # greedy episodes may differ slightly: compare tokens/s
        if method == "engine" and (env, turns, "engine_bf16") in bf16:
            fp32_rate, bf16_rate = (x["generated_tokens"] / x["wall_s"] for x in (c, bf16[(env, turns, "engine_bf16")]))
            lines.append(f"| rollout, B = 16, generated tok/s (`--rollout-dtype bfloat16`) | {env}, {turns} turns | "
                         f"{fp32_rate:.1f} | {bf16_rate:.1f} | {bf16_rate / fp32_rate:.2f}x |")
    for r in map(json.loads, (RESULTS / "update_step.jsonl").read_text().splitlines()):
        lines.append(f"| one update epoch of 8 GridWorld episodes, s (`--update-dtype bfloat16`) | {r['trainable_layers']} "
                     f"layers trained | {r['fp32_s']:.2f} | {r['bf16_s']:.2f} | {r['fp32_s'] / r['bf16_s']:.2f}x |")
    lines += ["", "| one GRPO step vs TRL `GRPOTrainer` (gradient checkpointing off on both) | TRL / ours (median s/step) | "
              "load average at start / end | commit |", "| --- | --- | --- | --- |"]
    for section in (RESULTS / "vs_trl.md").read_text().split("\n# One GRPO step")[1:]:  # one per vs_trl.py --append
        title = section.splitlines()[0].split("GRPOTrainer")[-1].strip(" ()") or "whole model trained"
        ratio = re.search(r"TRL / ours = ([\d.]+x)", section).group(1)
        load = re.search(r"at start ([\d.]+)/.*?at end ([\d.]+)/", section)
        commit = re.search(r"Git commit (\w+)", section).group(1)
        lines.append(f"| {title} | {ratio} | {load.group(1)} / {load.group(2)} | {commit} |")
    return "\n".join(lines + ["", "Each ratio compares methods run back to back in one invocation on the shared 2-core "
                              "CPU (absolute times in the files). The GRPO rows before commit 092a660 predate the shared "
                              "prompt prefix (docs/grpo_agent.md item 16). Sources: `python benchmarks/rollout_speed.py`, "
                              "[rollout_speed.md](benchmarks/results/rollout_speed.md); with `--methods engine "
                              "engine_concat` [rollout_speed_cache.md](benchmarks/results/rollout_speed_cache.md) and "
                              "`--methods engine engine_row_major` [rollout_speed_layout.md]"
                              "(benchmarks/results/rollout_speed_layout.md), `--methods engine engine_sdpa` "
                              "[rollout_speed_attention.md](benchmarks/results/rollout_speed_attention.md); one decode "
                              "step against context length: `python benchmarks/decode_step.py`, "
                              "[decode_step.md](benchmarks/results/decode_step.md); bf16: `--methods engine engine_bf16 "
                              "--output benchmarks/results/rollout_speed_bf16` [rollout_speed_bf16.md]"
                              "(benchmarks/results/rollout_speed_bf16.md), `python benchmarks/update_step.py` "
                              "[update_step.md](benchmarks/results/update_step.md); "
                              "`python benchmarks/vs_trl.py`, [vs_trl.md](benchmarks/results/vs_trl.md)."])


def memory() -> str:
    """Peak RSS of GRPO configurations, from benchmarks/memory.py's table (its rows, fewer columns)."""
    path = RESULTS / "memory.md"
    if not path.exists():
        return "Not measured yet (`python benchmarks/memory.py`)."
    header, *rows = markdown_tables(path.read_text())[0]
    keep = [header.index(k) for k in ("configuration", "mmap threshold (KiB)", "peak RSS (GiB)", "note")]
    lines = ["| " + " | ".join(header[i] for i in keep) + " |", "|" + " --- |" * len(keep)]
    lines += ["| " + " | ".join(r[i] for i in keep) + " |" for r in rows]
    return "\n".join(lines + ["", "One iteration of 4 GridWorld episodes with `smollm2-135m`, peak = the process's maximum RSS; "
                              "mmap threshold 0 = glibc's default allocator. Source: `python benchmarks/memory.py`, "
                              "[memory.md](benchmarks/results/memory.md) (commands, seconds, machine)."])


def offline() -> str:
    """CQL, BC, filtered BC and the DT on three data qualities, one table per backbone, from offline_gridworld.py."""
    lines, sources = [], []
    for name in ("offline_gridworld", "offline_gridworld_dt_smollm2", "offline_gridworld_tiny"):
        path = RESULTS / f"{name}.md"
        if not path.exists():
            continue
        text = path.read_text()
        model = re.search(r"Model `([^`]+)`", text).group(1)
        seeds = re.search(r"seeds (\[[^\]]*\])", text).group(1)
        behaviour, returns = markdown_tables(text)[:2]
        if not lines:
            lines = ["| algorithm | LM (learner seeds) | " + " | ".join(behaviour[0][1:]) + " |",
                     "|" + " --- |" * (len(behaviour[0]) + 1),
                     "| *the data (behaviour policy): mean return / success* | | " + " | ".join(behaviour[1][1:]) + " |"]
        single = "," not in seeds  # one seed: no spread to show
        lines += [f"| {row[0]} | `{model}` ({seeds.strip('[]')}) | "
                  + " | ".join(c.replace(" ± 0.00", "") if single else c for c in row[1:]) + " |" for row in returns[1:]]
        command = next(line for line in text.splitlines() if line.startswith("python benchmarks/offline_gridworld.py"))
        sources.append(f"`{command}` ([{name}.md](benchmarks/results/{name}.md))")
    if not lines:
        return "Not measured yet (`python benchmarks/offline_gridworld.py`)."
    return "\n".join(lines + ["", "Final greedy return on the seed-003 layout (optimal 4.45; -1.00: no goal reached), mean ± "
                              "std over learner seeds, on one dataset per quality (data seed 0, the same for every row); the DT "
                              "is conditioned on R* = the dataset's best return. Sources: " + "; ".join(sources) + "."])


def _jsonl_rows(name: str) -> list[dict]:
    """The rows of benchmarks/results/NAME (one JSON object per line), or none if the file does not exist."""
    path = RESULTS / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _mean_std_over_seeds(values: list[float]) -> str:
    """A success rate's mean ± sample std (ddof = 1, in points) over seeds; one value alone; blank for none."""
    if not values:
        return ""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.0%}"
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return f"{mean:.0%} ± {std * 100:.0f} ({len(values)} seeds)"


def babyai_shaping() -> str:
    """PPO on BabyAI GoToRedBall with and without potential-based shaping, per seed and mean ± std over seeds, from
    zero_shot.py's rows for each trained model (greedy, and sampled at the training temperature), on unseen episodes."""
    cells: dict[tuple[str, int], dict[float, float]] = {}  # (training env id, seed) -> {temperature: success rate}
    for row in _jsonl_rows("ppo_gae_agent_babyai_shaped.jsonl") + _jsonl_rows("ppo_gae_agent_babyai_sampled.jsonl"):
        env_id, _, seed, _ = Path(row["settings"]["model"]).parent.name.split("__")  # run_name of the trained model
        cells.setdefault((env_id, int(seed)), {})[row["settings"]["temperature"]] = row["success_rate"]
    if not cells:
        return "Not measured yet (`BABYAI_SHAPED=1 bash benchmarks/ppo_gae_agent.sh`)."
    temperatures = sorted({t for c in cells.values() for t in c})
    heads = ["greedy" if t == 0 else f"sampled, T = {t:g}" for t in temperatures]
    lines = ["| trained on | seed | " + " | ".join(heads) + " |", "|" + " --- |" * (2 + len(heads))]
    for env_id in sorted({e for e, _ in cells}, key=lambda e: not e.endswith("-shaped")):
        seeds = sorted(s for e, s in cells if e == env_id)
        lines += [f"| `{env_id}` | {s} | " + " | ".join(f"{cells[env_id, s][t]:.0%}" if t in cells[env_id, s] else ""
                                                         for t in temperatures) + " |" for s in seeds]
        lines.append(f"| `{env_id}` | **mean ± std** | " + " | ".join(
            _mean_std_over_seeds([cells[env_id, s][t] for s in seeds if t in cells[env_id, s]])
            for t in temperatures) + " |")
    random = next((r for r in _jsonl_rows("zero_shot_random.jsonl") if r["env_id"] == "babyai-gotoredball"
                   and json.loads(r["settings"]["env_kwargs"] or "{}") == {"max_steps": 24}), None)
    rnd = f" A uniformly random action each step: {random['success_rate']:.0%}." if random else ""
    if any(len(c) < len(temperatures) for c in cells.values()):
        rnd += " A blank cell was not measured."
    if len(temperatures) > 1:
        rnd += (" Sampled: `zero_shot.py --temperature T` on the same models and episodes (GLAM tests its policies "
                "sampled; greedy decoding of these policies tends to repeat one move).")
    note = ("Success on 50 episodes of the unshaped `babyai-gotoredball` (24 steps, environment seeds 0-49, never trained "
            "on) after 400 training episodes of `ppo_gae_agent.py` (SmolLM2, choice mode, trained at T = 2); the shaping "
            f"leaves the goal rate's meaning unchanged.{rnd} Source: `BABYAI_SHAPED=1 bash benchmarks/ppo_gae_agent.sh` "
            "(part 14), [ppo_gae_agent_babyai.md](benchmarks/results/ppo_gae_agent_babyai.md).")
    return "\n".join([*lines, "", note])


# ppo_gae_agent.py on procedural GridWorld (benchmarks/ppo_gae_agent.sh): results file, what was trained, evaluation
# temperature, the training episodes behind the 1st, 2nd, ... held-out test of the same model (part 9 tests seed 1
# after 400 episodes and again after 800, into one file), and the script's switch for that part.
_ENT = "`-shaped`, `--ent-coef 0.05`"
PROCEDURAL_PPO = [
    ("ppo_gae_agent_procedural_relative.jsonl", "`gridworld-procedural-relative` (unshaped)", 0.0, [400],
     "PROCEDURAL_RELATIVE (part 8)"),
    ("ppo_gae_agent_procedural_shaped.jsonl", "`-shaped`", 0.0, [400, 800], "PROCEDURAL_SHAPED (part 9)"),
    ("ppo_gae_agent_procedural_shaped_blocked.jsonl", "`-shaped-blocked` (a blocked move costs as much as a step away)",
     0.0, [400], "PROCEDURAL_SHAPED_BLOCKED (part 12)"),
    ("ppo_gae_agent_procedural_shaped_t1.jsonl", "`-shaped`, rollouts at T = 1 instead of 2", 0.0, [400],
     "PROCEDURAL_SHAPED_T1 (part 13)"),
    *[("ppo_gae_agent_procedural_shaped_ent05.jsonl", _ENT, temperature, [400], "PROCEDURAL_SHAPED_ENT (part 10)")
      for temperature in (0.0, 1.0)],
    *[(f"ppo_gae_agent_procedural_shaped_ent05_100{suffix}.jsonl", f"{_ENT}, the same runs continued", temperature,
       [800], "PROCEDURAL_SHAPED_ENT_LONG (part 11)") for suffix, temperature in (("", 0.0), ("_t1", 1.0))],
    ("ppo_gae_agent_procedural_shaped_ent05_1600_at800.jsonl", f"{_ENT}, new runs", 0.0, [800],
     "PROCEDURAL_SHAPED_ENT_1600 (part 15)"),
    *[(f"ppo_gae_agent_procedural_shaped_ent05_{length}{suffix}.jsonl", f"{_ENT}, new runs", temperature, [length],
       f"PROCEDURAL_SHAPED_ENT_{length} (part {part})")
      for length, part in ((1600, 15), (2400, 16)) for suffix, temperature in (("", 0.0), ("_t1", 1.0))],
    *[(f"ppo_gae_agent_procedural_shaped_ent05_anneal{suffix}.jsonl", f"{_ENT}, `--anneal-lr` (both rates decayed to 0)",
       temperature, [1600], "PROCEDURAL_SHAPED_ANNEAL (part 17)") for suffix, temperature in (("", 0.0), ("_t1", 1.0))],
    ("ppo_gae_agent_procedural_shaped_ent05_top12.jsonl", f"{_ENT}, top 12 layers trained (`--trainable-layers 12`)", 0.0,
     [400], "PROCEDURAL_SHAPED_TOP12 (part 18)"),
    *[(f"ppo_gae_agent_procedural_shaped_ent05_top12_{name}.jsonl", f"{_ENT}, top 12 layers, the same runs continued",
       temperature, [length], "PROCEDURAL_SHAPED_TOP12_1600 (part 19)")
      for name, temperature, length in (("at800", 0.0, 800), ("1600", 0.0, 1600), ("1600_t1", 1.0, 1600))],
    ("ppo_gae_agent_procedural_shaped_ent05_top12_masked.jsonl", (f"{_ENT}, top 12 layers, invalid-action masking "
     "(`--mask-illegal-actions`: trained and tested choosing only moves no wall blocks; its own action space)"), 0.0,
     [400], "PROCEDURAL_SHAPED_MASKED (part 20)"),
    ("ppo_gae_agent_procedural_shaped_ent05_top12_masked_fp32.jsonl", (f"{_ENT}, top 12 layers, masked, in fp32 "
     "(part 20 without the two bf16 flags, on an AVX2-only CPU)"), 0.0, [400], "PROCEDURAL_MASKED_FP32 (part 24)"),
    ("ppo_gae_agent_procedural_visits_top12_masked.jsonl", (f"{_ENT}, top 12 layers, masked, with visit counts "
     "(`gridworld-procedural-relative-visits-shaped`; tested on `-relative-visits`: the same layouts, the text plus "
     "a line of visit counts)"), 0.0, [400], "PROCEDURAL_VISITS_MASKED (part 21)"),
    *[(f"ppo_gae_agent_procedural_shaped_ent05_top12_masked_b16{suffix}.jsonl", (f"{_ENT}, top 12 layers, masked, 16 "
       "episodes per iteration (`--num-episodes 16`: part 20's 50 updates, each on twice the layouts)"), temperature,
       [800], "PROCEDURAL_MASKED_B16 (part 22)") for suffix, temperature in (("", 0.0), ("_t1", 1.0))],
    *[(f"ppo_gae_agent_procedural_shaped_ent05_top12_masked_b16_more{suffix}.jsonl", (f"{_ENT}, top 12 layers, masked, "
       "16 episodes per iteration, tested on 50 other held-out layouts (`zero_shot.py --seed 1`: none of the first 50)"),
       temperature, [800], "PROCEDURAL_MASKED_B16 (part 22)") for suffix, temperature in (("", 0.0), ("_t1", 1.0))],
    *[(f"ppo_gae_agent_procedural_shaped_ent05_top12_masked_b16_1600{more}{suffix}.jsonl", (f"{_ENT}, top 12 layers, "
       "masked, 16 episodes per iteration, the same runs continued" + (", tested on 50 other held-out layouts" if more
       else "")), temperature, [1600], "PROCEDURAL_MASKED_B16_1600 (part 23)")
      for more in ("", "_more") for suffix, temperature in (("", 0.0), ("_t1", 1.0))],
    *[(f"ppo_gae_agent_procedural_shaped_ent05_top12_b16{more}{suffix}.jsonl", (f"{_ENT}, top 12 layers, 16 episodes "
       "per iteration, unmasked (part 22 without `--mask-illegal-actions`, trained and tested on all four moves)"
       + (", tested on 50 other held-out layouts" if more else "")), temperature, [800],
       "NO_MASK PROCEDURAL_MASKED_B16 (part 25)")
      for more in ("", "_more") for suffix, temperature in (("", 0.0), ("_t1", 1.0))],
    *[(f"ppo_gae_agent_procedural_shaped_ent05_top12_b16_1600{more}{suffix}.jsonl", (f"{_ENT}, top 12 layers, 16 "
       "episodes per iteration, unmasked, the same runs continued" + (", tested on 50 other held-out layouts" if more
       else "")), temperature, [1600], "NO_MASK PROCEDURAL_MASKED_B16_1600 (part 25)")
      for more in ("", "_more") for suffix, temperature in (("", 0.0), ("_t1", 1.0))],
    *[(f"grpo_agent_procedural_gigpo{more}{suffix}.jsonl", ("`-shaped`, **`grpo_agent.py`** with GiGPO's step-level "
       "advantages (`--step-adv-coef 1`), 2 layouts x 8 episodes per iteration, top 12 layers, lr 1e-4, unmasked"
       + (", tested on 50 other held-out layouts" if more else "")), temperature, [800],
       "PROCEDURAL_GIGPO (part 26, in grpo_agent.sh)")
      for more in ("", "_more") for suffix, temperature in (("", 0.0), ("_t1", 1.0))],
    *[(f"grpo_agent_procedural_gigpo{more}_testmask.jsonl", ("`-shaped`, **`grpo_agent.py`** with GiGPO, the unmasked "
       "runs above, tested with invalid-action masking (`zero_shot.py --mask-illegal-actions`: masked at test time "
       "only)" + (", on 50 other held-out layouts" if more else "")), 0.0, [800],
       "PROCEDURAL_GIGPO (part 26, in grpo_agent.sh)")
      for more in ("", "_more")],
    *[(f"grpo_agent_procedural_gigpo_masked{more}{suffix}.jsonl", ("`-shaped`, **`grpo_agent.py`** with GiGPO, 2 layouts "
       "x 8 episodes per iteration, top 12 layers, lr 1e-4, masked (`--mask-illegal-actions`, trained and tested)"
       + (", tested on 50 other held-out layouts" if more else "")), temperature, [800],
       "PROCEDURAL_GIGPO MASKED (part 27, in grpo_agent.sh)")
      for more in ("", "_more") for suffix, temperature in (("", 0.0), ("_t1", 1.0))],
]


def ppo_procedural() -> str:
    """Issue 9's held-out target: ppo_gae_agent.py's goal rate on the 50 held-out test layouts of
    gridworld-procedural-relative, per training setting, length and seed, from zero_shot.py's rows."""
    lines = ["| trained on | episodes | evaluated | seed 1 | seed 2 | seed 3 | mean ± std | source |", "|" + " --- |" * 8]
    for name, trained, temperature, episodes, switch in PROCEDURAL_PPO:
        tests: dict[str, int] = {}  # model -> how many of its test rows at this temperature came before
        by_length: dict[int, dict[int, float]] = {}  # training episodes -> {seed: success rate}
        for row in _jsonl_rows(name):
            settings = row["settings"]
            if json.loads(settings["env_kwargs"] or "{}").get("split") != "test" or settings["temperature"] != temperature:
                continue
            n = tests[settings["model"]] = tests.get(settings["model"], -1) + 1
            seed = re.search(r"__(\d+)__\d+/model$|seed(\d+)$", settings["model"].rstrip("/"))
            if seed is None or n >= len(episodes):
                raise SystemExit(f"{name}: no seed in the model path {settings['model']}, or more tests than {episodes}")
            by_length.setdefault(episodes[n], {})[int(seed.group(1) or seed.group(2))] = row["success_rate"]
        for length, seeds in sorted(by_length.items()):
            cells = [f"{seeds[s]:.0%}" if s in seeds else "" for s in (1, 2, 3)]
            evaluated = "greedy" if temperature == 0 else f"T = {temperature:g}"
            variables, part = switch.split(" (", 1)  # "SWITCH [SWITCH ...] (part N)"
            command = " ".join(f"{variable}=1" for variable in variables.split())
            lines.append(f"| {trained} | {length:,} | {evaluated} | " + " | ".join(cells)
                         + f" | {_mean_std_over_seeds(list(seeds.values()))} | `{command}` ({part} |")
    untrained = next((r for r in _jsonl_rows("grpo_agent_procedural_relative.jsonl")
                      if r["settings"]["model"] == "smollm2-135m"
                      and json.loads(r["settings"]["env_kwargs"]) == {"split": "test"}), None)
    masked = next((r for r in _jsonl_rows("ppo_gae_agent_procedural_untrained_masked.jsonl")
                   if r["env_id"] == "gridworld-procedural-relative"), None)  # the masked rows' starting point
    before = (f" The untrained model, greedy: {untrained['success_rate']:.0%}" + (
        f" ({masked['success_rate']:.0%} masked)" if masked else "") + ".") if untrained else ""
    return "\n".join([*lines, "", (
        "Goal rate on the 50 held-out test layouts of `gridworld-procedural-relative` (never trained on; 50 others "
        "where the row says), greedy or "
        "sampled (`zero_shot.py --temperature T`), after training `ppo_gae_agent.py` (`grpo_agent.py` where the row "
        "says; SmolLM2, choice mode, "
        "`--learning-rate 1e-4 --num-episodes 8`, rollouts at T = 2, unless the row says; both CPU bf16 flags) on "
        "the training layouts of the id shown (`-shaped`: `gridworld-procedural-relative-shaped`, potential-based "
        f"shaping).{before} A blank cell was not measured. Source: `SWITCH=1 bash benchmarks/ppo_gae_agent.sh` (or the "
        "script the row names) with the row's switch, details in [grpo_agent_procedural.md](benchmarks/results/grpo_agent_procedural.md).")])


def tests_block() -> str:
    """The last recorded full test run (benchmarks/results/test_suite.json, written by --record-tests)."""
    path = RESULTS / "test_suite.json"
    if not path.exists():
        return "No full run recorded yet (`python benchmarks/readme.py --record-tests LOG`)."
    r = json.loads(path.read_text())
    return (f"The last recorded full run (`bash .ci/run` from a fresh clone of commit {r['commit']}, {r['date']}, "
            f"{r['machine']}): {r['passed']} passed, {r['skipped']} skipped (optional packages absent), "
            f"{r['seconds'] / 60:.0f} min of tests. Tests marked slow run with `python -m pytest -m slow`.")


def record_tests(log: str, commit: str = "", load: str = "otherwise idle") -> None:
    """Store the summary line of a `.ci/run` log: counts, seconds, commit, date, machine."""
    tail = Path(log).read_text().strip().splitlines()
    m = next((re.search(r"(\d+) passed(?:, (\d+) skipped)?.* in ([\d.]+)s", line) for line in reversed(tail)
              if re.search(r"\d+ passed.* in [\d.]+s", line)), None)
    if m is None or "failed" in " ".join(tail[-3:]):
        raise SystemExit(f"--record-tests {log}: no all-green pytest summary line at the end of the log")
    commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    (RESULTS / "test_suite.json").write_text(json.dumps({
        "passed": int(m.group(1)), "skipped": int(m.group(2) or 0), "seconds": float(m.group(3)), "commit": commit,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores, {load}"}, indent=1) + "\n")


BLOCKS = {"main-job": main_job, "three-way": three_way, "three-way-procedural": three_way_procedural,
          "three-way-babyai": three_way_babyai, "zero-shot": zero_shot, "performance": performance,
          "memory": memory, "offline": offline, "babyai-shaping": babyai_shaping,
          "ppo-procedural": ppo_procedural, "tests": tests_block}


def render(readme: str) -> str:
    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise SystemExit(f"README block `{name}` has no generator in benchmarks/readme.py ({', '.join(BLOCKS)})")
        return f"{m.group(1)}{BLOCKS[name]()}\n{m.group(4)}"
    return BLOCK.sub(fill, readme)


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.record_tests:
        record_tests(args.record_tests, args.tested_commit, args.load)
    current = Path(args.readme).read_text()
    fresh = render(current)
    if args.check:
        stale = [m.group("name") for m, f in zip(BLOCK.finditer(current), BLOCK.finditer(fresh)) if m.group(0) != f.group(0)]
        if stale:
            print(f"README.md is out of date in block(s) {', '.join(stale)}: run `python benchmarks/readme.py`")
            sys.exit(1)
        print(f"README.md: {len(BLOCK.findall(current))} generated blocks are current")
    elif fresh != current:
        Path(args.readme).write_text(fresh)
        print(f"rewrote {args.readme}")
