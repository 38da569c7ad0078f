"""One GRPO optimisation step: `algorithms/grpo_agent.py` against TRL's `GRPOTrainer` at identical settings.

    pip install -r benchmarks/requirements-trl.txt       # TRL (+ pandas, datasets): needed by this benchmark only
    python benchmarks/vs_trl.py                            # smollm2-135m, 1 prompt x 8 generations of <= 16 tokens
    python benchmarks/vs_trl.py --steps 5 --rounds 2 --threads 2 --beta 0.0
    python benchmarks/vs_trl.py --trainable-layers 6 --trl-gradient-checkpointing False --append  # grpo's default

The task is single-turn `arithmetic` (envs/reasoning.py, one attempt): one problem per step, G completions
of at most `--max-completion-length` tokens, each rewarded by the environment's own verifier (+1 correct,
-0.1 no extractable answer, 0 wrong). Both sides get the same model weights (`common.models.load_model`),
the same prompts token for token (checked), the same problem per step (the env seed grpo_agent.py derives
from `--seed` and the iteration), and the same GRPO settings: group size, one prompt per step, one epoch /
one optimiser step per batch, beta, clip eps, token-mean loss (TRL `loss_type="dapo"`), AdamW at a constant
learning rate, gradient clipping at 1.0, sampling at temperature 1, top-p 1, no top-k, fp32, whole model
trained.

Each side runs in its own fresh subprocess, sides back to back, `--rounds` times:
- ours: `algorithms/grpo_agent.py` itself (run with `runpy` so the child can read its own peak RSS), with
  the flags printed in the report; the step time comes from the wall-clock stamps of its TensorBoard
  scalars (one write per iteration), so it is the whole iteration: rollout, reference log-probs, loss,
  backward, optimiser step and logging. Its perf/rollout_s + perf/update_s (no logging) is also reported.
- TRL: `GRPOTrainer(model=<the loaded model>, processing_class=<its tokenizer>)` with a `TrainerCallback`
  stamping every optimiser step's end; the step time is the time between consecutive step ends (the same
  whole cycle: generation, reward, reference, loss, backward, optimiser step, logging). Its on_step_begin ->
  on_step_end time is reported too. TRL is run with gradient checkpointing off (as ours: the matched row)
  and on (GRPOConfig's default), unless `--trl-gradient-checkpointing` says otherwise.
The first step of every run is a warm-up and is excluded; the median of the following `--steps` is reported,
with each step's time and the child's peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`).

Measured here (benchmarks/results/vs_trl.md, sections 5-6; 2-core x86_64 CPU otherwise idle, 1 torch thread per
child, beta 0.04), since grpo_agent.py runs a group's shared prompt once (docs/grpo_agent.md item 16): whole model
trained, TRL / ours = 2.61x against TRL without gradient checkpointing (29.2 / 11.2 s, 2 rounds) and 2.57x against
TRL's default (checkpointing on); top 6 layers trained on both sides (grpo_agent.py's default, whose trainer also
reuses the rollout's frozen-trunk activations): 3.26x. Before that change the whole-model ratio was 0.97-1.14x
(the same work on both sides) and the 1.7x target was missed.
A default invocation (4 steps, 3 runs) took 10-25 min here, depending on the load.

Settings that cannot be matched exactly are listed in the report (MISMATCHES below, plus any found at run time).
Writes `benchmarks/results/vs_trl.md` (`--output`), with the command, machine, load average, git commit.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tyro

GRPO_SCRIPT = ROOT / "algorithms" / "grpo_agent.py"
ENV_ID = "arithmetic"
TRL_MISSING = ("benchmarks/vs_trl.py needs TRL, which is not a dependency of agentrl: "
               "pip install -r benchmarks/requirements-trl.txt")

TARGET_RATIO = 1.7  # issue 9: one GRPO step >= 1.7x faster than TRL's GRPOTrainer at identical settings
# Differences that remain at identical settings (none changes the work done per step)
MISMATCHES = [
    ("Sampler: ours is the shared RolloutEngine (batched, KV cache, stops rows at <|im_end|>); TRL calls "
     "`model.generate`. Same distribution (T = 1, top-p 1, no top-k, no repetition penalty), but different random "
     "draws, so completion lengths differ by chance: the mean completion length of each side is reported."),
    ("Advantage std: TRL divides by the unbiased group std (N - 1), grpo_agent.py by the population std (N); "
     "both add eps 1e-4. Changes the advantage scale only, not the cost."),
    ("pi_old: grpo_agent.py takes the sampler's recorded log-probs, TRL (num_iterations = 1, on-policy) the "
     "detached log-probs of the loss forward; neither runs an extra forward."),
    ("Zero-variance groups: grpo_agent.py drops them by default; here `--no-filter-zero-variance`, so it "
     "always runs the update, as TRL does."),
    ("Reference model: ours is `load_model(model)`, TRL's is rebuilt from `model.config._name_or_path` (the same "
     "safetensors file, same dtype); only loaded when beta > 0."),
    "Determinism: grpo_agent.py runs with torch.use_deterministic_algorithms (its default); TRL does not.",
    ("Logging: ours writes TensorBoard scalars every iteration; TRL logs its metrics every step (logging_steps = 1, "
     "report_to none)."),
]


@dataclass
class Args:
    model: str = "smollm2-135m"
    """model of both sides (`common.models.load_model`)"""
    group_size: int = 8
    """generations per prompt: grpo_agent --group-size, TRL num_generations (one prompt per step on both)"""
    max_completion_length: int = 16
    """generated tokens per completion: grpo_agent --max-turn-tokens, TRL max_completion_length"""
    beta: float = 0.04
    """KL coefficient on both sides (> 0 loads a reference model on both sides)"""
    learning_rate: float = 1e-6
    """AdamW learning rate on both sides (constant)"""
    trainable_layers: int = 0
    """train only the top N decoder layers + final norm on both sides (grpo_agent --trainable-layers; TRL gets the
    same parameters frozen); 0: the whole model, as TRL by default"""
    steps: int = 4
    """timed steps per run, after one warm-up step"""
    rounds: int = 1
    """how many times each side is run (back to back, alternating)"""
    seed: int = 1
    """seed of both sides; the problem of step i is the env seed grpo_agent.py uses at iteration i"""
    threads: int = 0
    """torch threads in each child (0: torch's default)"""
    trl_gradient_checkpointing: list[bool] = field(default_factory=lambda: [False, True])
    """TRL runs: without gradient checkpointing (matched) and with it (GRPOConfig's default)"""
    output: str = "benchmarks/results/vs_trl.md"
    """where the markdown report is written"""
    append: bool = False
    """append this run's section to --output instead of overwriting it"""
    child: str = ""
    """internal: run one side (`ours` or `trl`) and write its JSON result to --child-out"""
    child_out: str = ""
    """internal: the child's result file"""
    gradient_checkpointing: bool = False
    """internal: the TRL child's gradient checkpointing"""


def require_trl() -> str:
    """TRL's version, or a SystemExit saying how to install it (it is not a runtime dependency)."""
    try:
        found = importlib.util.find_spec("trl") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise SystemExit(TRL_MISSING)
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401  (its own imports: pandas, datasets)
    except ImportError as e:
        raise SystemExit(f"{TRL_MISSING} ({e})")
    return trl.__version__


def problem_seeds(args: Args) -> list[int]:
    """The env seed grpo_agent.py gives group 0 of iterations 1..steps+1 (rank 0)."""
    return [(args.seed * 100_000 + it) * 1_000 for it in range(1, args.steps + 2)]


def grpo_flags(args: Args, output_dir: str) -> list[str]:
    return ["--model", args.model, "--env-id", ENV_ID, "--action-mode", "free", "--seed", str(args.seed),
            "--total-iterations", str(args.steps + 1), "--num-groups", "1", "--group-size", str(args.group_size),
            "--update-epochs", "1", "--micro-batch-size", str(args.group_size),
            "--trainable-layers", str(args.trainable_layers),
            "--beta", str(args.beta), "--learning-rate", str(args.learning_rate), "--temperature", "1.0",
            "--top-p", "1.0", "--max-turn-tokens", str(args.max_completion_length), "--clip-eps-low", "0.2",
            "--clip-eps-high", "0.2", "--loss-agg", "token-mean", "--max-grad-norm", "1.0",
            "--no-filter-zero-variance", "--eval-every", "0", "--exp-name", "vs_trl", "--output-dir", output_dir]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child_ours(args: Args) -> dict:
    import runpy

    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as out:
        sys.argv = [str(GRPO_SCRIPT)] + grpo_flags(args, out)
        runpy.run_path(str(GRPO_SCRIPT), run_name="__main__")
        rss = peak_rss_mib()
        (run_dir,) = Path(out).iterdir()
        acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        acc.Reload()
        ev = {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}
    walls = [e.wall_time for e in ev["perf/rollout_s"]]  # one tracker.scalars call per iteration
    core = [r.value + u.value for r, u in zip(ev["perf/rollout_s"], ev["perf/update_s"])]
    gen = [e.value for e in ev["perf/rollout_s"]]
    ref = [e.value for e in ev["perf/reference_s"]]
    tokens = [e.value / args.group_size for e in ev["perf/iteration_generated_tokens"]]
    return {"step_s": [b - a for a, b in itertools.pairwise(walls)], "core_s": core[1:], "completion_len": tokens[1:],
            "generation_s": gen[1:], "reference_s": ref[1:],
            "peak_rss_mib": rss, "threads": torch.get_num_threads(),
            "reward": [e.value for e in ev["charts/episodic_return"]][1:]}


def child_trl(args: Args) -> dict:
    require_trl()
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import envs
    from common.chat import ChatFormat
    from common.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, "cpu")
    layers = model.get_decoder().layers
    if 0 < args.trainable_layers < len(layers):  # exactly grpo_agent.py's freezing
        model.requires_grad_(False)
        for layer in layers[-args.trainable_layers:]:
            layer.requires_grad_(True)
        model.get_decoder().norm.requires_grad_(True)
    chat, env, rows, prompt_match = ChatFormat(tok), envs.make(ENV_ID), [], True
    for s in problem_seeds(args):
        obs, _ = env.reset(seed=s)
        messages = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": obs}]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_match &= tok(rendered, add_special_tokens=False)["input_ids"] == chat.prompt_ids(env.system_prompt, obs)
        rows.append({"prompt": messages, "env_seed": s})

    def env_reward(completions, env_seed, **_):
        """The environment's verifier, exactly as grpo_agent.py's rollout steps it (one attempt)."""
        rewards = []
        for completion, s in zip(completions, env_seed):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            e = envs.make(ENV_ID)
            e.reset(seed=s)
            rewards.append(float(e.step(text)[1]))
        return rewards

    class StepClock(TrainerCallback):
        def __init__(self):
            self.begin, self.ends, self.core, self.logs = 0.0, [], [], []

        def on_step_begin(self, *a, **k):
            self.begin = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.ends.append(time.perf_counter())
            self.core.append(self.ends[-1] - self.begin)

        def on_log(self, _args, _state, _control, logs=None, **k):
            self.logs.append(dict(logs or {}))

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=args.group_size, gradient_accumulation_steps=1,
            num_generations=args.group_size, max_completion_length=args.max_completion_length, num_iterations=1,
            beta=args.beta, epsilon=0.2, loss_type="dapo", scale_rewards="group", learning_rate=args.learning_rate,
            lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, temperature=1.0, top_p=1.0, top_k=0,
            repetition_penalty=1.0, use_vllm=False, bf16=False, fp16=False, use_cpu=True,
            gradient_checkpointing=args.gradient_checkpointing, max_steps=args.steps + 1, shuffle_dataset=False,
            seed=args.seed, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0)
        clock = StepClock()
        trainer = GRPOTrainer(model=model, reward_funcs=env_reward, args=config, train_dataset=Dataset.from_list(rows),
                              processing_class=tok, callbacks=[clock])
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        generation_s, generate, ref_s, logps = [], trainer._generate, [], trainer._get_per_token_logps_and_entropies

        def timed_generate(*a, **k):  # the sampling part of a step (model.generate + decoding)
            t = time.perf_counter()
            out = generate(*a, **k)
            generation_s.append(time.perf_counter() - t)
            return out

        def timed_logps(model_, *a, **k):  # the reference forward, when beta > 0
            t = time.perf_counter()
            out = logps(model_, *a, **k)
            if model_ is trainer.ref_model:
                ref_s.append(time.perf_counter() - t)
            return out

        trainer._generate, trainer._get_per_token_logps_and_entropies = timed_generate, timed_logps
        trainer.train()
    logs = [l for l in clock.logs if "completions/mean_length" in l]
    return {"step_s": [b - a for a, b in itertools.pairwise(clock.ends)], "core_s": clock.core[1:],
            "completion_len": [l["completions/mean_length"] for l in logs][1:],
            "reward": [l.get("reward", float("nan")) for l in logs][1:], "peak_rss_mib": peak_rss_mib(),
            "generation_s": generation_s[1:], "reference_s": ref_s[1:] or [0.0] * args.steps,
            "threads": torch.get_num_threads(), "prompt_tokens_match": prompt_match, "trainable_params": trainable,
            "ref_model": trainer.ref_model is not None, "gradient_checkpointing": config.gradient_checkpointing}


def run_child(args: Args, side: str, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, __file__, "--child", side, "--child-out", out, "--model", args.model,
           "--group-size", str(args.group_size), "--max-completion-length", str(args.max_completion_length),
           "--beta", str(args.beta), "--learning-rate", str(args.learning_rate), "--steps", str(args.steps),
           "--seed", str(args.seed), "--threads", str(args.threads), "--trainable-layers", str(args.trainable_layers)
           ] + extra
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"vs_trl.py: the {side} child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    result["run_s"] = time.time() - t0
    return result


def load_note(load_start, load_end, threads: int) -> str:
    """What the 1-minute load average says about the machine, beside the benchmark's own threads."""
    own = threads or torch.get_num_threads()
    if max(load_start[0], load_end[0]) <= own + 0.5:
        return f"about this benchmark's own {own} thread(s), so nothing else ran"
    return "above this benchmark's own threads: other jobs shared the cores, which inflates absolute times"


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "algorithms", "common", "envs"], cwd=ROOT,
                               capture_output=True, text=True, check=False).stdout
        return head.strip() + (" (algorithms/common/envs have uncommitted changes)" if dirty.strip() else "")
    except OSError:
        return "unknown"


def fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.child:
        fn = {"ours": child_ours, "trl": child_trl}[args.child]
        Path(args.child_out).write_text(json.dumps(fn(args)))
        sys.exit(0)
    for name in ("group_size", "steps", "rounds", "max_completion_length"):
        if getattr(args, name) < (2 if name in ("group_size", "steps") else 1):
            raise SystemExit(f"vs_trl.py: --{name.replace('_', '-')} is too small")
    trl_version = require_trl()  # fail before any run
    import torch
    import transformers

    load_start, started = os.getloadavg(), time.time()
    runs = []  # (label, result)
    for r in range(args.rounds):
        sides = [("grpo_agent.py", "ours", [])] + [
            (f"TRL GRPOTrainer (gradient checkpointing {'on' if gc else 'off'})", "trl",
             ["--gradient-checkpointing" if gc else "--no-gradient-checkpointing"]) for gc in args.trl_gradient_checkpointing]
        for label, side, extra in sides:
            print(f"round {r + 1}/{args.rounds}: {label} ...", flush=True)
            res = run_child(args, side, extra)
            print(f"  step s: {fmt(res['step_s'])} | median {statistics.median(res['step_s']):.2f} | "
                  f"peak RSS {res['peak_rss_mib']:.0f} MiB | completion length {fmt(res['completion_len'])} | "
                  f"sampling s {fmt(res['generation_s'])} | reference s {fmt(res['reference_s'])}", flush=True)
            runs.append((label, res))
    load_end = os.getloadavg()

    by_label: dict[str, dict] = {}
    for label, res in runs:
        agg = by_label.setdefault(label, {"rss": [], "extra": res})
        for key in ("step_s", "core_s", "generation_s", "reference_s", "completion_len"):
            agg[key] = agg.get(key, []) + res[key]
        agg["rss"].append(res["peak_rss_mib"])
    ours = statistics.median(by_label["grpo_agent.py"]["step_s"])
    rows = []
    for label, agg in by_label.items():
        med = statistics.median(agg["step_s"])
        rows.append(f"| {label} | {fmt(agg['step_s'])} | **{med:.2f}** | {statistics.median(agg['core_s']):.2f} | "
                    f"{statistics.median(agg['generation_s']):.2f} | {statistics.median(agg['reference_s']):.2f} | "
                    f"{max(agg['rss']):.0f} | {statistics.mean(agg['completion_len']):.1f} | "
                    f"{'1.00 (reference)' if label == 'grpo_agent.py' else f'**{med / ours:.2f}x**'} |")

    found = []
    for label, agg in by_label.items():
        x = agg["extra"]
        if "prompt_tokens_match" in x and not x["prompt_tokens_match"]:
            found.append(f"{label}: TRL's chat-templated prompt tokens differ from ChatFormat.prompt_ids")
        if x["threads"] != by_label["grpo_agent.py"]["extra"]["threads"]:
            found.append(f"{label}: {x['threads']} torch threads vs ours {by_label['grpo_agent.py']['extra']['threads']}")
        if "ref_model" in x and x["ref_model"] != (args.beta > 0):
            found.append(f"{label}: reference model loaded = {x['ref_model']} with beta {args.beta}")
    trl_x = next((a["extra"] for lab, a in by_label.items() if lab != "grpo_agent.py"), {})
    matched = by_label.get("TRL GRPOTrainer (gradient checkpointing off)")
    target = ("not measured (no TRL run without gradient checkpointing)" if matched is None else
              f"TRL / ours = {statistics.median(matched['step_s']) / ours:.2f}x at matched settings: "
              + ("met" if statistics.median(matched["step_s"]) / ours >= TARGET_RATIO else "NOT met"))
    cmd = "python benchmarks/vs_trl.py " + " ".join(sys.argv[1:])
    lines = [
        "# One GRPO step: algorithms/grpo_agent.py vs TRL GRPOTrainer"
        + (f" (top {args.trainable_layers} layers trained)" if args.trainable_layers else ""), "",
        f"{args.model}, single-turn `{ENV_ID}` (one problem per step, the environment's verifier as reward), "
        f"1 prompt x {args.group_size} generations of <= {args.max_completion_length} tokens, beta {args.beta}, "
        f"1 epoch / 1 optimiser step per batch, lr {args.learning_rate} (constant AdamW), clip eps 0.2, token-mean "
        f"loss, T = 1, top-p 1, fp32, CPU, "
        + ("whole model trained" if not args.trainable_layers else
           f"top {args.trainable_layers} decoder layers + final norm trained (the rest frozen on both sides)")
        + (f" ({trl_x['trainable_params'] / 1e6:.1f} M parameters)" if "trainable_params" in trl_x else "") + ". "
        f"Each run is a fresh subprocess; its first step is a warm-up and is excluded; {args.steps} timed steps per "
        f"run, {args.rounds} round(s), sides back to back.", "",
        (f"Target (issue 9): grpo_agent.py's step >= {TARGET_RATIO}x faster than TRL's GRPOTrainer: {target}. "
        "(The issue's reference: TRL 12.7 s/step for this step on this machine, FLOP floor about 6 s.)"), "",
        ("| side | seconds per step (each) | median s/step | median s/step without logging/dataloader | "
        "of which sampling (median s) | of which reference log-probs (median s) | peak RSS MiB | "
        "mean completion tokens | TRL / ours |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
        ("Seconds per step = wall time between consecutive optimiser-step ends (generation, reward, reference "
        "log-probs, loss, backward, optimiser step, logging). The column without logging is ours "
        "perf/rollout_s + perf/update_s, TRL's on_step_begin -> on_step_end. Sampling: ours perf/rollout_s (prompt "
        "prefill + the decode steps + reward), TRL's `_generate`; reference: ours perf/reference_s, TRL's reference "
        "`_get_per_token_logps_and_entropies` call. Peak RSS: ru_maxrss of the child "
        "(model, reference model, optimiser state, activations, libraries)."), "",
        "Settings that could not be matched exactly (none changes the work per step):", "",
        *[f"- {m}" for m in MISMATCHES],
        ("- TRL's GRPOConfig turns gradient checkpointing on by default (a memory/compute trade grpo_agent.py does "
        "not make): the matched row has it off, the other row shows TRL's default."),
        *([f"- found at run time: {m}" for m in found] or [("- found at run time: none (prompt tokens identical, "
                                                             "same torch threads, reference model as beta asks)")]), "",
        "Command:", "", "```bash", cmd, "# grpo_agent.py side, as run in its child:",
        "python algorithms/grpo_agent.py " + " ".join(grpo_flags(args, "<tmp>")), "```", "",
        (f"Machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{by_label['grpo_agent.py']['extra']['threads']} torch threads per child; Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl_version}. "
        f"Git commit {git_commit()}. Load average (1/5/15 min) at start {'/'.join(f'{x:.2f}' for x in load_start)}, "
        f"at end {'/'.join(f'{x:.2f}' for x in load_end)}: {load_note(load_start, load_end, args.threads)}; the sides "
        f"ran back to back. Total {time.time() - started:.0f} s."), "",
    ]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    previous = Path(args.output).read_text() + "\n" if args.append and Path(args.output).exists() else ""
    Path(args.output).write_text(previous + "\n".join(lines))
    print("\n".join(lines))
