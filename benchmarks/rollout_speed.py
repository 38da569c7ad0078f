"""Rollout speed: the shared multi-turn engine against two plain `transformers.generate` loops.

    python benchmarks/rollout_speed.py                        # smollm2-135m, B = 16, GridWorld 5/10/20 turns + codegen
    python benchmarks/rollout_speed.py --turns 4 8 20 --baseline-max-turns 20 --codegen-attempts 2 \
        --codegen-max-turn-tokens 64 --single-episodes 1   # what results/rollout_speed.md ran
    python benchmarks/rollout_speed.py --model tiny --batch-size 4 --turns 2 4 --codegen-attempts 2   # seconds

How long it takes: the baselines dominate. Baseline (a) re-encodes ~B x (N x prompt + N^2/2 x tokens per
turn) tokens, ~290k for B = 16 and N = 20 on GridWorld (prompt 133 tokens, ~66 per turn): its 20-turn cell took
860 s and the whole run above 24 min on an idle 2-core CPU (2 threads). On an oversubscribed machine use
OMP_NUM_THREADS=1: with 2 OpenMP threads under a load average of ~9 on 2 cores, one 2-turn engine cell took
170 s against 34 s with 1 thread (the threads wait for each other at every barrier).

Three ways to play the same B episodes (same environment seeds, same prompts built with
`common.chat.ChatFormat`, same per-turn token cap, same temperature), in free mode (generated text):

* `engine`: `common.rollout.RolloutEngine`: B episodes in lockstep, one KV cache kept across turns, so each
  turn only the new observation is fed (meant to make cost grow with the total number of tokens: the sweep
  over N measures how far that holds);
* `generate_batch` (baseline a): each turn, `model.generate` on the whole batch of live episodes with each
  episode's full history re-encoded (left-padded), then the actions are parsed and the environments stepped
  (cost grows with turns x context);
* `generate_single` (baseline b): the same loop with one episode at a time (batch 1). It is slow, so it runs
  on the first `--single-episodes` of the B episodes; its per-episode rates are what is compared, and the
  time for all B episodes is extrapolated (marked in the table).

"Re-encoded" means the whole history is prefilled again by the model every turn; the baselines keep the
history as token ids (the ids sampled plus the ids fed, as the engine does) instead of re-tokenising
decoded text, so that at temperature 0 all three methods play token-identical episodes (tokenising the text
would cost nothing measurable; it would only make the episodes differ). At temperature > 0 the three draw
different samples from the same distributions; the generated tokens each method actually produced are what
its tokens/s counts.

GridWorld (`gridworld-procedural`, a different layout per seed) episodes are cut after N turns by a wrapper
(`TurnLimit`), so the sweep over N plays the same layouts and prompts; an episode ends earlier only if the
policy reaches a goal (zero-shot SmolLM2 answers with a valid move ~2% of the time, so in practice never),
and the tables count the turns actually played. Codegen (`codegen`, level 1) episodes end on a passing
submission or after `--codegen-attempts` attempts. Each (method, environment, N) cell runs in a fresh
subprocess, so its peak RSS (`getrusage` max RSS of the child) is its own; the model is loaded and one
short forward is run before the clock starts. Writes `{output}.md` (tables, machine, load average, git
commit, the command) and `{output}.jsonl` (one line per cell).

Timings on a shared machine are noisy: the methods run one after another in one invocation and the ratios
are what to read; absolute numbers hold for the machine named in the output only.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from hashlib import sha1
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import tyro

import envs
from common.chat import ChatFormat
from common.models import load_model, sampling_copy
from common.rollout import RolloutConfig, RolloutEngine

METHODS = ("engine", "generate_batch", "generate_single", "engine_concat", "engine_row_major", "engine_sdpa", "engine_bf16")


@dataclass
class Args:
    model: str = "smollm2-135m"
    """`tiny`, `smollm2-135m` or a local model path"""
    device: str = "cpu"
    """`cpu` or `cuda`"""
    seed: int = 0
    """episode i plays environment seed `seed * 1000 + i`; the sampler is seeded with `seed`"""
    batch_size: int = 16
    """episodes played together (B)"""
    gridworld_id: str = "gridworld-procedural"
    """the GridWorld environment id"""
    turns: list[int] = field(default_factory=lambda: [5, 10, 20])
    """GridWorld episode lengths N to sweep (time vs number of turns)"""
    max_turn_tokens: int = 16
    """GridWorld: cap on generated tokens per turn"""
    baseline_max_turns: int = 0
    """run the baselines only at N <= this (0: at every N; (b) always only at the largest N it runs at)"""
    codegen_attempts: int = 3
    """codegen (level 1): attempts per episode, i.e. turns (0 skips codegen)"""
    codegen_max_turn_tokens: int = 96
    """codegen: cap on generated tokens per turn"""
    temperature: float = 0.0
    """sampling temperature of every method (0 = greedy: all methods play token-identical episodes)"""
    methods: list[str] = field(default_factory=lambda: list(METHODS[:3]))
    """which of engine, generate_batch (baseline a), generate_single (baseline b) to run; engine_concat: the engine
    with transformers' DynamicCache, which appends by concatenation (the engine's own cache writes in place; it
    cannot store keys transposed, so attention is SDPA's); engine_row_major: the engine with the weights in their
    usual layout (`RolloutConfig.input_major_weights=False`); engine_sdpa: the engine with the keys cached in the
    usual layout and attention by SDPA (`RolloutConfig.transposed_keys=False`); engine_bf16: the engine on a bf16 copy
    of the model (`common.models.sampling_copy`, grpo_agent.py's `--rollout-dtype bfloat16`): weights and cache in bf16"""
    single_episodes: int = 2
    """baseline (b) plays only the first this-many of the B episodes (its time for B is extrapolated)"""
    threads: int = 0
    """torch.set_num_threads in each cell (0: torch's default, which follows OMP_NUM_THREADS)"""
    fresh_process: bool = True
    """run each cell in its own subprocess (needed for per-method peak RSS; tests turn it off)"""
    output: str = "benchmarks/results/rollout_speed"
    """output prefix: writes {output}.md and {output}.jsonl (empty: print only)"""


def validate_args(args: Args) -> None:
    checks = [("--batch-size", args.batch_size >= 1), ("--turns", bool(args.turns) and min(args.turns) >= 1),
              ("--max-turn-tokens", args.max_turn_tokens >= 1), ("--codegen-attempts", args.codegen_attempts >= 0),
              ("--codegen-max-turn-tokens", args.codegen_max_turn_tokens >= 1), ("--temperature", args.temperature >= 0),
              ("--methods", bool(args.methods) and set(args.methods) <= set(METHODS)),
              ("--single-episodes", 1 <= args.single_episodes), ("--threads", args.threads >= 0),
              ("--baseline-max-turns", args.baseline_max_turns == 0 or args.baseline_max_turns >= min(args.turns or [1]))]
    for flag, ok in checks:
        if not ok:
            raise SystemExit(f"rollout_speed.py: bad value for {flag} (see --help)")
    try:
        envs.make(args.gridworld_id)
    except Exception as e:  # noqa: BLE001 - any construction error is a bad flag
        raise SystemExit(f"--gridworld-id: {e}")


class TurnLimit:
    """Truncates an episode after `n` steps; everything else is the wrapped environment's."""

    def __init__(self, env, n: int):
        self.env, self.n, self.t = env, n, 0

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, **kwargs):
        self.t = 0
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.t += 1
        if not (terminated or truncated) and self.t >= self.n:
            truncated, info = True, {**info, "termination": "truncated"}
        return obs, reward, terminated, truncated, info


def make_envs(cell: dict) -> list:
    if cell["env"] == "codegen":
        return [envs.make("codegen", level=1, max_attempts=cell["turns"]) for _ in range(cell["episodes"])]
    steps = max(cell["turns"], 20)  # the env's own budget (and prompt) stay the same across the sweep
    return [TurnLimit(envs.make(cell["env_id"], max_steps=steps), cell["turns"]) for _ in range(cell["episodes"])]


def digest(ids: list[int]) -> str:
    return sha1(json.dumps(ids).encode()).hexdigest()[:12]


def step_all(live_envs: list, actions: list[str]) -> list[tuple]:
    """Step a batch of environments, concurrently when they wait on a subprocess (as the engine does)."""
    if len(live_envs) > 1 and all(getattr(e, "parallel_step", False) for e in live_envs):
        with ThreadPoolExecutor(max_workers=min(8, len(live_envs))) as pool:
            return list(pool.map(lambda ea: ea[0].step(ea[1]), zip(live_envs, actions)))
    return [e.step(a) for e, a in zip(live_envs, actions)]


def run_engine(model, tok, cell: dict, seeds: list[int]) -> dict:
    cfg = RolloutConfig(action_mode="free", temperature=cell["temperature"], max_turn_tokens=cell["max_turn_tokens"],
                        max_total_tokens=1 << 20, input_major_weights=cell["method"] != "engine_row_major",
                        transposed_keys=cell["method"] not in ("engine_sdpa", "engine_concat"))
    engine = RolloutEngine(model, tok, cfg)
    timers = {"decode_s": 0.0, "env_s": 0.0}

    def timed(name: str, fn):  # instance-level wrapper: time one phase of the engine without changing it
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            timers[name] += time.perf_counter() - t0
            return out
        return wrapper

    engine._act_free = timed("decode_s", engine._act_free)  # the decode loop (tokens 2.. of each turn)
    if hasattr(engine, "_step_envs"):
        engine._step_envs = timed("env_s", engine._step_envs)
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(cell["seed"])
    t0 = time.perf_counter()
    trajs = engine.run(make_envs(cell), seeds, cell["env"], generator=gen)
    wall = time.perf_counter() - t0
    if not hasattr(engine, "_step_envs"):
        timers["env_s"] = sum(turn.env_s for t in trajs for turn in t.turns)
    return {"wall_s": wall, **timers, "episode_tokens": [sum(turn.num_action_tokens for turn in t.turns) for t in trajs],
            "episode_turns": [t.num_steps for t in trajs], "processed_tokens": sum(len(t.token_ids) for t in trajs),
            "episode_digests": [digest(t.token_ids) for t in trajs]}


def run_generate(model, tok, cell: dict, seeds: list[int], batch: int) -> dict:
    """Baselines (a) and (b): `model.generate` each turn on the full histories, `batch` episodes at a time."""
    from transformers import GenerationConfig

    chat = ChatFormat(tok)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else chat.eos_id
    temp = cell["temperature"]
    gen_cfg = GenerationConfig(max_new_tokens=cell["max_turn_tokens"], do_sample=temp > 0, temperature=temp or None,
                               top_p=None, top_k=None, eos_token_id=chat.eos_id, pad_token_id=pad_id)
    device = next(model.parameters()).device
    torch.manual_seed(cell["seed"])  # generate samples from the global generator
    all_envs = make_envs(cell)
    result = {"wall_s": 0.0, "decode_s": 0.0, "env_s": 0.0, "episode_tokens": [0] * len(seeds),
              "episode_turns": [0] * len(seeds), "processed_tokens": 0, "episode_digests": [""] * len(seeds)}
    t_start = time.perf_counter()
    for first in range(0, len(seeds), batch):
        idx = list(range(first, min(first + batch, len(seeds))))
        history = {}
        for i in idx:
            obs, _ = all_envs[i].reset(seed=seeds[i])
            history[i] = chat.prompt_ids(all_envs[i].system_prompt, obs)
        live = list(idx)
        while live:
            width = max(len(history[i]) for i in live)
            ids = torch.full((len(live), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(live):  # left padding: every row ends where generation starts
                ids[row, width - len(history[i]):] = torch.tensor(history[i])
                mask[row, width - len(history[i]):] = 1
            result["processed_tokens"] += sum(len(history[i]) for i in live)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg)
            result["decode_s"] += time.perf_counter() - t0
            actions, sampled = [], []
            for row, i in enumerate(live):
                new = out[row, width:].tolist()
                cut = new.index(chat.eos_id) + 1 if chat.eos_id in new else len(new)  # keep EOS, drop the padding
                sampled.append(new[:cut])
                actions.append(tok.decode([t for t in new[:cut] if t != chat.eos_id]))
            t0 = time.perf_counter()
            stepped = step_all([all_envs[i] for i in live], actions)
            result["env_s"] += time.perf_counter() - t0
            keep = []
            for i, tokens, (obs, _, terminated, truncated, _) in zip(live, sampled, stepped):
                history[i] = history[i] + tokens
                result["episode_tokens"][i] += len(tokens)
                result["episode_turns"][i] += 1
                result["processed_tokens"] += len(tokens)
                if terminated or truncated:
                    result["episode_digests"][i] = digest(history[i])
                    continue
                history[i] = history[i] + chat.next_turn_ids(obs, action_ended_with_eos=tokens[-1] == chat.eos_id)
                keep.append(i)
            live = keep
    result["wall_s"] = time.perf_counter() - t_start
    return result


_MODELS: dict = {}


def run_cell(cell: dict) -> dict:
    """Load the model (untimed), warm it up, play the cell's episodes with its method, measure."""
    if cell["threads"]:
        torch.set_num_threads(cell["threads"])
    key = (cell["model"], cell["device"])
    if key not in _MODELS:
        _MODELS[key] = load_model(cell["model"], cell["device"], seed=cell["seed"])
    model, tok = _MODELS[key]
    with torch.no_grad():  # first-call overheads (allocator, kernels) are no method's cost
        model(torch.arange(1, 17, device=next(model.parameters()).device)[None])
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seeds = [cell["seed"] * 1000 + i for i in range(cell["episodes"])]
    if cell["method"] in ("engine", "engine_row_major", "engine_sdpa"):
        out = run_engine(model, tok, cell, seeds)
    elif cell["method"] == "engine_bf16":  # the copy is made (and warmed up) before the clock starts
        sampler = sampling_copy(model, "bfloat16")
        with torch.no_grad():
            sampler(torch.arange(1, 17, device=next(model.parameters()).device)[None])
        out = run_engine(sampler, tok, cell, seeds)
    elif cell["method"] == "engine_concat":  # the same engine on a concatenating cache: what the buffered one saves
        import common.rollout

        buffered, common.rollout.BufferedCache = common.rollout.BufferedCache, common.rollout.DynamicCache
        try:
            out = run_engine(model, tok, cell, seeds)
        finally:
            common.rollout.BufferedCache = buffered
    else:
        out = run_generate(model, tok, cell, seeds, batch=cell["episodes"] if cell["method"] == "generate_batch" else 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**cell, **out, "generated_tokens": sum(out["episode_tokens"]), "turns_played": sum(out["episode_turns"]),
            "rss_after_load_mib": rss_loaded, "peak_rss_mib": peak, "torch_threads": torch.get_num_threads()}


def make_cells(args: Args) -> list[dict]:
    base = {"model": args.model, "device": args.device, "seed": args.seed, "temperature": args.temperature,
            "threads": args.threads}
    cells = []
    specs = [("gridworld", n, args.max_turn_tokens) for n in sorted(set(args.turns))]
    if args.codegen_attempts:
        specs.append(("codegen", args.codegen_attempts, args.codegen_max_turn_tokens))
    baseline_cap = max(n for n in args.turns if n <= args.baseline_max_turns) if args.baseline_max_turns else max(args.turns)
    for env, n, max_tokens in specs:
        for method in args.methods:
            if not method.startswith("engine") and env == "gridworld" and n > baseline_cap:
                continue
            if method == "generate_single" and env == "gridworld" and n != baseline_cap:
                continue
            episodes = min(args.single_episodes, args.batch_size) if method == "generate_single" else args.batch_size
            cells.append({**base, "env": env, "env_id": args.gridworld_id if env == "gridworld" else "codegen",
                          "turns": n, "max_turn_tokens": max_tokens, "method": method, "episodes": episodes})
    return cells


def measure(cell: dict, fresh_process: bool) -> dict:
    if not fresh_process:
        return run_cell(cell)
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--cell-json", json.dumps(cell), f.name],
                              check=False)
        if proc.returncode != 0:
            raise SystemExit(f"rollout_speed.py: the {cell['method']} cell on {cell['env']} failed (exit {proc.returncode})")
        return json.load(f)


def git_commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        def git(*a):
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, check=False).stdout.strip()
        sha, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain")
        return sha + (" (working tree with uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def rates(r: dict) -> dict:
    """Per-cell rates; (b)'s time for all B episodes is extrapolated from its per-episode time."""
    scale = r["batch_size"] / r["episodes"]
    return {"tok_s": r["generated_tokens"] / r["wall_s"], "ep_s": r["episodes"] / r["wall_s"],
            "time_for_b": r["wall_s"] * scale, "model_s_for_b": (r["wall_s"] - r["env_s"]) * scale}


def report(args: Args, results: list[dict], command: str, load: tuple, started: float) -> str:
    names = {"engine": "engine (KV cache across turns)", "generate_batch": "(a) generate, batch, history re-encoded",
             "generate_single": "(b) generate, batch 1, history re-encoded",
             "engine_concat": "engine, concatenating KV cache (transformers' DynamicCache)",
             "engine_row_major": "engine, weights in their usual (row-major) layout",
             "engine_sdpa": "engine, keys in their usual layout, attention by SDPA",
             "engine_bf16": "engine on a bf16 copy of the model (`--rollout-dtype bfloat16`)"}
    r0 = results[0]
    lines = [f"# Rollout speed: engine vs `generate` baselines (`{args.model}`, B = {args.batch_size})", "",
             f"Command: `{command}`", "",
             f"Machine: {platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__} with {r0['torch_threads']} threads (OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', 'unset')}), python {platform.python_version()}. "
             f"Git commit {git_commit()}. Load average (1 min) at start / end: {load[0]:.2f} / {load[1]:.2f}; "
             f"the run took {time.time() - started:.0f} s. "
             "The machine is shared with other jobs: absolute times are noisy and hold for this machine only; "
             "the methods ran one after another in this invocation, so read the ratios.", "",
             f"Temperature {args.temperature:g} ("
             + ("greedy: the methods play token-identical episodes" if args.temperature == 0
                else "sampled: same seeds and prompts, different samples") + "); "
             f"free mode; GridWorld = `{args.gridworld_id}`, at most {args.max_turn_tokens} generated tokens per turn; "
             f"codegen = `codegen` level 1, {args.codegen_attempts} attempts, at most {args.codegen_max_turn_tokens} "
             f"tokens per turn. Baseline (b) played {min(args.single_episodes, args.batch_size)} of the "
             f"{args.batch_size} episodes; its 'time for B' is extrapolated "
             f"(×{args.batch_size / min(args.single_episodes, args.batch_size):g}). "
             "Each cell ran in " + ("a fresh subprocess (peak RSS = that process's max RSS, model included)."
                                    if args.fresh_process else "this process (peak RSS not per method)."), ""]
    for env, n in sorted({(r["env"], r["turns"]) for r in results}, key=lambda k: (k[0] != "gridworld", k[1])):
        rows = [r for r in results if (r["env"], r["turns"]) == (env, n)]
        eng = next((r for r in rows if r["method"] == "engine"), None)
        lines += [f"## {env}, {n} turns", "",
                  "| method | episodes | turns played | generated tokens | tokens processed | wall s | env s | time for B s "
                  "| generated tok/s | episodes/s | decode-only tok/s | peak RSS MiB | engine speed-up (tok/s) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            x = rates(r)
            speed = f"{rates(eng)['tok_s'] / x['tok_s']:.2f}×" if eng and x["tok_s"] > 0 else "-"
            lines.append(f"| {names[r['method']]} | {r['episodes']} | {r['turns_played']} | {r['generated_tokens']} | "
                         f"{r['processed_tokens']} | {r['wall_s']:.1f} | {r['env_s']:.1f} | {x['time_for_b']:.1f}"
                         f"{'*' if r['method'] == 'generate_single' else ''} | {x['tok_s']:.1f} | {x['ep_s']:.3f} | "
                         f"{r['generated_tokens'] / max(r['decode_s'], 1e-9):.1f} | {r['peak_rss_mib']:.0f} | {speed} |")
        lines.append("")
    sweep = {(r["method"], r["turns"]): r for r in results if r["env"] == "gridworld"}
    ns = sorted(set(args.turns))
    if len(ns) > 1:
        lines += ["## Time vs number of turns (GridWorld)", "",
                  "Baseline (a) re-encodes the whole history every turn, so its tokens processed grow ~N² (Σ over turns "
                  "of the context); the engine feeds each token once. Were the engine's cost proportional to the tokens "
                  "it processes, its ms / token processed would stay flat with N.", "",
                  "| N | engine s | engine tokens processed | engine ms / token processed | (a) s | (a) tokens processed "
                  "| (a) ms / engine token | (a) s / engine s |", "|" + " ---: |" * 8]
        for n in ns:
            e, a = sweep.get(("engine", n)), sweep.get(("generate_batch", n))
            cols = ["-"] * 3
            if e:
                cols = [f"{e['wall_s']:.1f}", str(e["processed_tokens"]),
                        f"{1000 * e['wall_s'] / e['processed_tokens']:.2f}"]
            if a:
                cols += [f"{a['wall_s']:.1f}", str(a["processed_tokens"])]
                cols += ([f"{1000 * a['wall_s'] / e['processed_tokens']:.2f}", f"{a['wall_s'] / e['wall_s']:.2f}"]
                         if e else ["-", "-"])
            else:
                cols += ["-"] * 4
            lines.append(f"| {n} | " + " | ".join(cols) + " |")
        lines.append("")
    lines += ["'tokens processed': engine = every token of the episodes, each fed once; (a)/(b) = the prompt of every "
              "`generate` call (the whole history, again each turn) + the generated tokens. 'decode-only tok/s': "
              "generated tokens / time in the decode loop (engine: `_act_free`, "
              "which excludes the forward feeding each turn's observation; baselines: the whole `generate` call, "
              "prefill included). 'env s': time stepping the environments (codegen runs the submissions in a sandbox).", ""]
    return "\n".join(lines)


def main(args: Args) -> list[dict]:
    validate_args(args)
    started, load_start = time.time(), os.getloadavg()[0]
    command = "python benchmarks/rollout_speed.py " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("rollout_speed.py") \
        else f"rollout_speed.main({args})"
    results = []
    for cell in make_cells(args):
        t0 = time.time()
        r = {**measure(cell, args.fresh_process), "batch_size": args.batch_size}
        results.append(r)
        print(f"[rollout_speed] {r['env']} N={r['turns']} {r['method']}: {r['episodes']} episodes, {r['generated_tokens']} "
              f"generated tokens in {r['wall_s']:.1f} s ({rates(r)['tok_s']:.1f} tok/s; cell {time.time() - t0:.0f} s)",
              flush=True)
    text = report(args, results, command, (load_start, os.getloadavg()[0]), started)
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output + ".md").write_text(text)
        with open(args.output + ".jsonl", "w") as f:
            for r in results:
                f.write(json.dumps({**r, **rates(r)}) + "\n")
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cell-json"]:  # a child process measuring one cell
        outcome = run_cell(json.loads(sys.argv[2]))
        Path(sys.argv[3]).write_text(json.dumps(outcome))
    else:
        main(tyro.cli(Args))
