"""Tests for envs/reasoning.py: STaR's verifiable tasks (n-digit addition, templated word problems)."""

import hashlib
import random
import re
import warnings

import pytest
from gymnasium.utils.env_checker import check_env

from envs.base import REWARD_COMPONENTS, TERMINATIONS
from envs.reasoning import (
    ARITHMETIC_LEVELS,
    HELDOUT_TEMPLATES,
    TEMPLATES,
    ArithmeticEnv,
    WordProblemEnv,
    addition_problem,
    extract_answer,
    scratchpad,
)

ENV_CLASSES = [ArithmeticEnv, WordProblemEnv]
NOT_TEXT = [None, 7, 2.5, ["Answer: 3"], b"Answer: 3"]

# The answer of each template recomputed from the generator's stored numbers, written independently
# of the templates' own arithmetic.
INDEPENDENT_ANSWERS = {
    "shop_total": lambda v: v["n"] * v["p"],
    "share_equal": lambda v: v["total"] // v["k"],
    "age_older": lambda v: v["a"] + v["d"],
    "hours_to_minutes": lambda v: 60 * v["h"],
    "shop_change": lambda v: v["bill"] - v["n"] * v["p"],
    "rate_distance": lambda v: v["v"] * v["h"] + v["d"],
    "share_after_gift": lambda v: (v["a"] + v["b"]) // v["k"],
    "age_future_multiple": lambda v: v["a"] * v["m"] + v["y"],
    "shop_two_items": lambda v: v["n1"] * v["p1"] + v["n2"] * v["p2"],
    "bake_sale": lambda v: (v["t"] * v["c"] - v["e"]) * v["p"],
    "daily_run_meters": lambda v: (1000 * v["km"] + v["m"]) * v["d"],
    "savings_weeks": lambda v: (v["goal"] - v["saved"]) // (v["w"] - v["s"]),
    "shop_coupon": lambda v: v["n1"] * v["p1"] + v["n2"] * v["p2"] - v["c"],
    "age_sum_three": lambda v: v["a"] + (v["a"] + v["d"]) + 2 * (v["a"] + v["d"]),
    "fuel_two_legs": lambda v: (v["v1"] * v["h1"] + v["v2"] * v["h2"]) // v["e"],
    "shift_pay": lambda v: (v["m1"] + v["m2"]) // 60 * v["rate"] - v["lunch"],
}
# Quantities that the problem must divide exactly for its answer to be an integer.
EXACT_DIVISIONS = {
    "share_equal": lambda v: (v["total"], v["k"]),
    "share_after_gift": lambda v: (v["a"] + v["b"], v["k"]),
    "savings_weeks": lambda v: (v["goal"] - v["saved"], v["w"] - v["s"]),
    "fuel_two_legs": lambda v: (v["v1"] * v["h1"] + v["v2"] * v["h2"], v["e"]),
    "shift_pay": lambda v: (v["m1"] + v["m2"], 60),
}


def in_test_split(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 5 == 0


@pytest.mark.parametrize("text, expected", [
    ("Answer: 42", "42"),
    ("Answer: 3\nwait, no.\nAnswer: 1,204", "1204"),  # the last answer wins
    ("Answer: 12,345,678", "12345678"),
    ("answer: 12 345", "12345"),
    ("Answer: -7", "-7"),
    ("Answer: \u22123", "-3"),
    ("**Answer:** 17", "17"),
    ("Answer: $1,234.", "1234"),
    ("Answer: 12.00", "12"),
    ("ANSWER:007", "7"),
    ("So the final answer: 9 apples", "9"),
    ("Answer: 5\nAnswer: not sure", "5"),  # an answer-less marker does not erase an earlier answer
    ("Answer: 12.5", None),
    ("Answer: 1,23", None),
    ("Answer: 1 2", None),
    ("Answer: 3 + 4 = 7", None),
    ("Answer:\n5", None),
    ("The sum is 86.", None),
    ("answers: 4", None),
    ("", None),
    (None, None),
    (86, None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_scratchpad_matches_the_paper_format():
    assert scratchpad(29, 57).splitlines() == [
        "<scratch>", "2 9 + 5 7 , C: 0", "2 + 5 , 6 C: 1", ", 8 6 C: 0", "0 8 6", "</scratch>", "Answer: 86"]
    assert scratchpad(999, 1).splitlines()[1:6] == [
        "9 9 9 + 1 , C: 0", "9 9 + , 0 C: 1", "9 + , 0 0 C: 1", ", 0 0 0 C: 1", "1 0 0 0"]
    with pytest.raises(ValueError):
        scratchpad(-1, 3)


def test_scratchpad_ends_in_the_right_answer_for_random_problems():
    rng = random.Random(0)
    for _ in range(300):
        a, b = rng.randrange(10 ** rng.randint(1, 9)), rng.randrange(10 ** rng.randint(1, 9))
        pad = scratchpad(a, b)
        lines = pad.splitlines()
        assert extract_answer(pad) == str(a + b)
        assert int(lines[-3].replace(" ", "")) == a + b  # the final carry-and-digits line
        assert len(lines) == max(len(str(a)), len(str(b))) + 5
        carries = [int(m) for m in re.findall(r"C: (\d)", pad)]
        assert carries[0] == 0 and set(carries) <= {0, 1}


def test_correct_answer_scores_one_with_success():
    for cls in ENV_CLASSES:
        env = cls()
        obs, info = env.reset(seed=3)
        assert env.problem in obs and 'End with a final line "Answer: <integer>".' in obs
        assert "answer" not in info
        obs, reward, terminated, truncated, info = env.step(f"Let me work it out.\nAnswer: {env.answer}")
        assert reward == 1.0 and terminated and not truncated
        assert info["termination"] == "success" and info["answer"] == env.answer
        assert info["reward_components"] == {"format": 0.0, "progress": 0.0, "task": 1.0, "cost": 0.0,
                                             "safety": 0.0}
        assert info["action_valid"] and info["invalid_actions"] == 0 and info["parsed_answer"] == env.answer
        assert env.answer not in obs
        with pytest.raises(RuntimeError):
            env.step("Answer: 1")


def test_reference_solution_is_a_correct_reply():
    for cls in ENV_CLASSES:
        env = cls()
        for seed in range(20):
            env.reset(seed=seed)
            assert env.step(env.reference_solution)[4]["termination"] == "success"


def test_wrong_answer_scores_zero_with_failure():
    for cls in ENV_CLASSES:
        env = cls()
        env.reset(seed=4)
        wrong = str(int(env.answer) + 1)
        obs, reward, terminated, truncated, info = env.step(f"Answer: {wrong}")
        assert reward == 0.0 and terminated and not truncated
        assert info["termination"] == "failure" and info["parsed_answer"] == wrong
        assert info["action_valid"] and info["invalid_actions"] == 0 and info["answer"] == env.answer
        assert obs == "Incorrect."


@pytest.mark.parametrize("action", ["I am not sure.", "Answer: twelve", "86", ""] + NOT_TEXT)
def test_no_answer_is_an_invalid_action_with_the_format_penalty(action):
    for cls in ENV_CLASSES:
        env = cls()
        env.reset(seed=5)
        obs, reward, terminated, truncated, info = env.step(action)
        assert terminated and info["termination"] == "invalid_action"
        assert reward == pytest.approx(-0.1) and info["reward_components"]["format"] == pytest.approx(-0.1)
        assert info["action_valid"] is False and info["invalid_actions"] == 1 and info["parsed_answer"] is None
        assert obs.startswith("No answer found.")


def test_several_attempts_feedback_and_counts():
    env = ArithmeticEnv(digits=3, max_attempts=3)
    env.reset(seed=0)
    wrong = str(int(env.answer) + 10)
    obs, reward, terminated, _, info = env.step(f"Answer: {wrong}")
    assert obs == f'Incorrect: {wrong}. 2 attempts left. End with a final line "Answer: <integer>".'
    assert reward == 0.0 and not terminated and "termination" not in info and "answer" not in info
    obs, reward, terminated, _, info = env.step("no idea")
    assert obs == 'No answer found. End with a final line "Answer: <integer>". 1 attempt left.'
    assert reward == pytest.approx(-0.1) and not terminated and info["invalid_actions"] == 1
    assert info["attempts"] == 2 and "answer" not in info
    obs, reward, terminated, _, info = env.step(f"Answer: {env.answer}")
    assert reward == 1.0 and terminated and info["termination"] == "success" and info["invalid_actions"] == 1
    # An invalid last attempt ends with invalid_action even after a valid wrong one.
    env.reset(seed=1)
    env.step("Answer: 0")
    env.step("Answer: 0")
    assert env.step("...")[4]["termination"] == "invalid_action"


def test_info_keys_and_components_sum_to_reward():
    rng = random.Random(2)
    for cls in ENV_CLASSES:
        env = cls(max_attempts=2)
        for seed in range(30):
            env.reset(seed=seed)
            while True:
                action = rng.choice([f"Answer: {env.answer}", "Answer: 123456789", "hmm", None])
                obs, reward, terminated, truncated, info = env.step(action)
                assert set(info["reward_components"]) == set(REWARD_COMPONENTS)
                assert reward == pytest.approx(sum(info["reward_components"].values()))
                for key in ("env_version", "task_id", "invalid_actions", "action_valid", "attempts"):
                    assert key in info
                assert ("termination" in info) == ("answer" in info) == terminated
                assert not truncated
                if terminated:
                    assert info["termination"] in TERMINATIONS
                    break


def test_hint_prompt_is_the_rationalization_convention():
    env = WordProblemEnv()
    obs, _ = env.reset(seed=0)
    hint = env.hint_prompt(env.answer)
    assert hint.startswith(f"The correct answer is {env.answer}. Explain")
    assert f"Answer: {env.answer}" not in obs and f"Answer: {env.answer}" in hint


def test_arithmetic_difficulty_kwargs():
    for level, counts in ARITHMETIC_LEVELS.items():
        env = ArithmeticEnv(level=level)
        for seed in range(20):
            obs, info = env.reset(seed=seed)
            a, b = (int(x) for x in re.fullmatch(r"What is (\d+) \+ (\d+)\?", env.problem).groups())
            assert len(str(a)) == len(str(b)) == info["level"] in counts
            assert env.answer == str(a + b) and info["task_id"].startswith("arithmetic/addition/")
    one_digit = ArithmeticEnv(digits=1)
    operands = set()
    for seed in range(200):
        one_digit.reset(seed=seed)
        operands |= set(map(int, re.findall(r"\d+", one_digit.problem)))
    assert operands == set(range(10))  # 0 is a one-digit operand too
    for bad in ({"digits": 0}, {"digits": 19}, {"digits": []}, {"level": 5}, {"digits": 3, "level": 1},
                {"split": "dev"}, {"max_attempts": 0}, {"render_mode": "human"}):
        with pytest.raises(ValueError):
            ArithmeticEnv(**bad)


def test_arithmetic_splits_disjoint_and_fixed_by_the_unordered_pair():
    seen = {}
    for split in ("train", "test"):
        env = ArithmeticEnv(digits=(1, 2, 3), split=split)
        seen[split] = set()
        for seed in range(400):
            env.reset(seed=seed)
            a, b = map(int, re.findall(r"\d+", env.problem))
            assert in_test_split(f"{min(a, b)}+{max(a, b)}") == (split == "test")
            seen[split].add(frozenset((a, b)))
        assert len(seen[split]) > 200
    assert not seen["train"] & seen["test"]
    assert addition_problem(624, 257).split == addition_problem(257, 624).split


def test_word_problem_splits_disjoint_and_heldout_templates_only_in_test():
    texts, templates = {}, {}
    for split in ("train", "test"):
        env = WordProblemEnv(split=split)
        texts[split], templates[split] = set(), set()
        for seed in range(400):
            obs, info = env.reset(seed=seed)
            heldout = info["template"] in HELDOUT_TEMPLATES
            assert info["heldout_template"] == heldout
            assert (split == "test") == (heldout or in_test_split(env.problem))
            texts[split].add(env.problem)
            templates[split].add(info["template"])
    assert not texts["train"] & texts["test"]
    assert len(HELDOUT_TEMPLATES) == 4 and {TEMPLATES[name].level for name in HELDOUT_TEMPLATES} == {1, 2, 3, 4}
    assert templates["train"] == set(TEMPLATES) - set(HELDOUT_TEMPLATES)
    assert templates["test"] == set(TEMPLATES)  # test holds new instances of train templates too
    with pytest.raises(ValueError):
        WordProblemEnv(templates=["shift_pay"])  # a held-out template cannot be trained on
    with pytest.raises(ValueError):
        WordProblemEnv(templates=["no_such_template"])
    with pytest.raises(ValueError):
        WordProblemEnv(level=5)


def test_every_template_answer_matches_an_independent_computation():
    assert set(INDEPENDENT_ANSWERS) == set(TEMPLATES)
    for name, template in TEMPLATES.items():
        env = WordProblemEnv(templates=[name], split="test")
        for seed in range(40):
            _, info = env.reset(seed=seed)
            problem = env.snapshot()["problem"]
            assert info["template"] == name and info["level"] == template.level
            assert problem.answer == str(INDEPENDENT_ANSWERS[name](problem.numbers))
            assert int(problem.answer) >= 0
            for value in problem.numbers.values():  # every quantity is stated in the problem
                assert re.search(rf"(?<!\d){value}(?!\d)", problem.text), (name, value, problem.text)
            if name in EXACT_DIVISIONS:
                dividend, divisor = EXACT_DIVISIONS[name](problem.numbers)
                assert dividend % divisor == 0
            steps = problem.reference_solution.splitlines()
            assert len(steps) == template.level + 1 and steps[-1] == f"Answer: {problem.answer}"
            for line in steps[:-1]:
                x, op, y, z = re.fullmatch(r"(\d+) ([-+*/]) (\d+) = (-?\d+)", line).groups()
                assert eval(f"{x} {op} {y}") == int(z)  # each step's arithmetic holds


def test_word_problem_levels_and_template_filter():
    env = WordProblemEnv(level=[1, 3])
    levels = {env.reset(seed=seed)[1]["level"] for seed in range(60)}
    assert levels == {1, 3}
    env = WordProblemEnv(level=2, split="test")
    assert {t.name for t in env.templates} == {n for n, t in TEMPLATES.items() if t.level == 2}


@pytest.mark.parametrize("cls", ENV_CLASSES)
def test_same_seed_same_episode(cls):
    runs = []
    for _ in range(2):
        env = cls(max_attempts=2)
        episode = [env.reset(seed=11), env.step("Answer: 3"), env.reset(), env.step("???")]
        episode.append(env.reset(seed=12))
        runs.append(episode)
    assert repr(runs[0]) == repr(runs[1])
    env = cls()
    problems = {env.reset(seed=seed)[0] for seed in range(30)}
    assert len(problems) > 25


@pytest.mark.parametrize("cls", ENV_CLASSES)
def test_snapshot_restore_branches_independently(cls):
    env = cls(max_attempts=2)
    env.reset(seed=8)
    snap = env.snapshot()
    wrong = env.step("Answer: 99999999")
    assert not wrong[2]
    env.restore(snap)
    right = env.step(f"Answer: {env.answer}")
    assert right[4]["termination"] == "success" and right[4]["attempts"] == 1
    other = cls(max_attempts=2)
    other.restore(snap)
    assert repr(other.step("Answer: 99999999")) == repr(wrong)
    # The restored random stream continues as the original would have.
    env.restore(snap)
    other.restore(snap)
    assert env.reset() == other.reset()


@pytest.mark.parametrize("cls", ENV_CLASSES)
def test_system_prompt_states_the_format_and_a_train_example(cls):
    env = cls()
    prompt = env.system_prompt
    assert 'End with a final line "Answer: <integer>".' in prompt
    example = prompt.split("Example:\n", 1)[1]
    question = example.splitlines()[0]
    key = "+".join(sorted(re.findall(r"\d+", question), key=int)) if cls is ArithmeticEnv else question
    assert not in_test_split(key)  # the prompt never shows a test problem
    assert extract_answer(example) is not None
    assert "Example" not in cls(worked_example=False).system_prompt


@pytest.mark.parametrize("cls", ENV_CLASSES)
def test_render_and_errors_before_reset(cls):
    env = cls(render_mode="ansi")
    with pytest.raises(RuntimeError):
        env.step("Answer: 1")
    env.reset(seed=0)
    assert env.render() == f"{env.problem}\nAttempts 0/1."


@pytest.mark.parametrize("cls", ENV_CLASSES)
def test_gymnasium_env_checker_passes(cls):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(cls(render_mode="ansi"), skip_render_check=False)
