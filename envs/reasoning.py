"""Verifiable single-answer reasoning tasks for STaR (seed 000, "STaR: Self-Taught Reasoner", eq. 12.5).

STaR samples a rationale z and an answer y_hat for each problem x, keeps the (x, z, y*) whose answer
is right, rationalizes the failures by conditioning on the correct answer y*, and fine-tunes on both
sets. It needs problems whose answers a program can check exactly, so both families here have an
integer answer computed by the generator:

- `arithmetic` (ArithmeticEnv): "What is a + b?" with two n-digit operands, the setting of STaR's
  arithmetic experiments (Zelikman et al. 2022), whose rationales are the carry scratchpads of Nye et
  al. (2021); `scratchpad(a, b)` writes one.
- `wordproblems` (WordProblemEnv): templated GSM8K-like problems (shopping totals, rates and time,
  sharing, ages, unit conversions) needing 1-4 arithmetic operations (the level); the generator
  also writes a reference solution, one "x op y = z" line per operation.

Actions are free text (`action_names = None`): the agent may reason first and must end with a final
line "Answer: <integer>". The answer-extraction rule (`extract_answer`): the LAST occurrence of
"Answer:" (case-insensitive, optionally bolded, optionally followed by "$") immediately followed by a
well-formed integer counts. Well formed: an optional minus sign ("-" or U+2212), then digits, with
thousands separators allowed as commas or single spaces between groups of three ("12,345", "12 345"),
and an all-zero fraction allowed ("12.00"). A number running on into more digits after a decimal
point, a malformed separator or a space ("12.5", "1,23", "1 2"), or on into an expression ("3 + 4 = 7"),
is not an answer. The number must be on the same line as "Answer:". An "Answer:" without a well-formed
integer is skipped, so an earlier well-formed one still counts. The extracted answer is normalised
to its canonical integer text ("007" -> "7") and compared with the correct answer as text.

Rewards, reported as separate components that sum to the step reward:
- `task` +1.0 for a correct answer (REWARD_CORRECT), which ends the episode with `success`;
- `format` -0.1 for an attempt from which no answer can be extracted (REWARD_NO_ANSWER);
- `progress`, `cost`, `safety` always 0.
Each step is one attempt; at most `max_attempts` (default 1: one answer ends the episode). A wrong
answer on the last attempt ends with `failure`. The one rule for invalid actions: an attempt with no
extractable answer (non-text actions included) is invalid: it is counted in `invalid_actions`,
penalised -0.1, consumes the attempt, and if it was the last attempt the episode ends with
`invalid_action`. Before the last attempt, wrong and invalid answers get a short feedback
observation and the episode goes on. The correct answer appears in `info["answer"]` on the final
step only, never in an observation.

`info` keys beyond the contract's: at reset `template` ("addition" or the word-problem template),
`level` (operand digits, or operations needed) and `heldout_template`; at every step `parsed_answer`
(the extracted answer or None) and `attempts` (so far); on the final step `answer`.

Splits (seed 001, dataset isolation): a problem's split follows from its content alone, sha1 of its
split key mod 5 == 0 -> "test". Arithmetic's key is the unordered pair ("257+624"), so a + b and
b + a share a split. Word problems' key is the problem text, and the held-out templates
(HELDOUT_TEMPLATES, one per level) are test-only, so the test split measures generalisation both to
new instances and to unseen problem shapes; `info["heldout_template"]` tells which.

STaR's verifier data: `env.problem` (the problem text), `env.answer` (the correct answer) and
`env.reference_solution` belong to the verifier, never to the agent's observation. STaR's
rationalization step reads `env.answer` and, by this module's convention, asks for a rationale with
the observation followed by `env.hint_prompt(env.answer)` ("The correct answer is X. Explain
step by step why..."); the rationale is then trained without the hint, as in the paper.
"""

from __future__ import annotations

import abc
import copy
import hashlib
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from envs.base import TextEnv, reward_components

REWARD_CORRECT = 1.0
REWARD_NO_ANSWER = -0.1
TEST_MODULUS = 5  # sha1(split key) % 5 == 0 -> test: about one problem in five is held out
MAX_DRAWS = 1000  # candidates drawn per reset before giving up on finding one in the split
SPLITS = ("train", "test")

ANSWER_FORMAT = 'End with a final line "Answer: <integer>".'
NO_ANSWER_FEEDBACK = "No answer found. " + ANSWER_FORMAT
# 1-5 digit operands: the range of STaR's n-digit addition results (Zelikman et al. 2022).
DEFAULT_DIGITS = (1, 2, 3, 4, 5)
ARITHMETIC_LEVELS = {1: (1, 2), 2: (3, 4), 3: (5, 6), 4: (7, 8)}  # level -> operand digit counts
MAX_DIGITS = 18  # operands are drawn as int64
WORD_LEVELS = (1, 2, 3, 4)  # number of arithmetic operations a problem needs

_INTEGER = (
    r"(?P<sign>[-\u2212]?)"
    r"(?P<digits>\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d+)"  # groups of three, or plain digits
    r"(?:\.0+)?"  # an all-zero fraction ("12.00")
    r"(?![\d., ]?\d)"  # not running on into more digits ("12.5", "1,23", "1 2")
    r"(?![ \t]*[-+*/=^x\u00d7\u2212]\s*\d)"  # nor into an expression ("3 + 4 = 7")
)
_ANSWER_PATTERN = re.compile(r"\banswer\**[ \t]*:[ \t*]*\$?[ \t]*" + _INTEGER, re.IGNORECASE)


def extract_answer(text: object) -> str | None:
    """The answer a reply gives by the module's extraction rule (see the docstring), or None.

    "x = 3\\nAnswer: 3\\nAnswer: 1,204" -> "1204"; "Answer: -7" -> "-7"; "I think 12" -> None.
    """
    if not isinstance(text, str):
        return None
    matches = list(_ANSWER_PATTERN.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    value = int(re.sub(r"[, ]", "", last.group("digits")))
    return str(-value if last.group("sign") else value)


def scratchpad(a: int, b: int) -> str:
    """The carry scratchpad for a + b (Nye et al. 2021, the rationale format of STaR's arithmetic).

    Each line holds the digits still to add, the result digits so far and the carry C; the last
    scratch line is the final carry followed by the result digits. 29 + 57:

        <scratch>
        2 9 + 5 7 , C: 0
        2 + 5 , 6 C: 1
        , 8 6 C: 0
        0 8 6
        </scratch>
        Answer: 86

    The answer line is read off the scratch digits (not computed as a + b), so the scratchpad is a
    worked derivation that ends in the module's answer format.
    """
    if a < 0 or b < 0:
        raise ValueError(f"scratchpad needs non-negative operands, got {a} and {b}")
    left, right = list(str(a)), list(str(b))

    def pending() -> list[str]:  # the digits still to add ("9 9 +" once the right operand runs out)
        return [part for part in (" ".join(left), "+", " ".join(right)) if part] if left or right else []

    lines = [" ".join(pending() + [", C: 0"])]
    result: list[str] = []
    carry = 0
    while left or right:
        column = (int(left.pop()) if left else 0) + (int(right.pop()) if right else 0) + carry
        carry, digit = divmod(column, 10)
        result.insert(0, str(digit))
        lines.append(" ".join(pending() + [",", " ".join(result), f"C: {carry}"]))
    lines.append(" ".join([str(carry)] + result))
    total = int(str(carry) + "".join(result))
    return "\n".join(["<scratch>", *lines, "</scratch>", f"Answer: {total}"])


@dataclass(frozen=True)
class Problem:
    """One generated problem, everything the verifier knows about it."""

    template: str  # "addition", or the word-problem template's name
    level: int  # operand digits (arithmetic) or operations needed (word problems)
    text: str
    numbers: dict[str, int]  # the generator's drawn quantities, from which the answer follows
    answer: str
    reference_solution: str  # a worked rationale ending in "Answer: <answer>"
    split_key: str
    heldout_template: bool = False

    @property
    def digest(self) -> str:
        return hashlib.sha1(self.split_key.encode()).hexdigest()

    @property
    def split(self) -> str:
        """Fixed by content alone, so no problem can be in both splits."""
        return "test" if self.heldout_template or int(self.digest, 16) % TEST_MODULUS == 0 else "train"


class AnswerVerifier:
    """Scores one attempt against the correct answer; the agent's text is only ever parsed."""

    def __init__(self, answer: str) -> None:
        self.answer = answer

    def check(self, action: object) -> tuple[str | None, bool]:
        """(the extracted answer or None, whether it is correct)."""
        given = extract_answer(action)
        return given, given == self.answer

    def score(self, given: str | None, correct: bool) -> dict[str, float]:
        return reward_components(format=REWARD_NO_ANSWER if given is None else 0.0,
                                 task=REWARD_CORRECT if correct else 0.0)


@dataclass(frozen=True)
class AttemptState:
    """Everything that changes within an episode. Immutable, so branches never share state."""

    attempts: int = 0
    invalid_actions: int = 0
    termination: str | None = None  # set once the episode is over


class ReasoningEnv(TextEnv):
    """A single-answer reasoning task: one problem per episode, up to `max_attempts` answers."""

    family: str  # the task_id prefix
    instructions: str  # the task-specific head of the system prompt

    def __init__(self, split: str = "train", max_attempts: int = 1, worked_example: bool = True,
                 render_mode: str | None = None) -> None:
        super().__init__()
        if split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.split, self.max_attempts, self.render_mode = split, max_attempts, render_mode
        self.worked_example = worked_example
        self._problem: Problem | None = None
        self._state: AttemptState | None = None

    @abc.abstractmethod
    def _draw(self, problem_seed: int) -> Problem:
        """The problem of this env's split and difficulty that `problem_seed` selects."""

    @abc.abstractmethod
    def _example(self) -> Problem:
        """A fixed train-split problem whose reference solution the system prompt shows."""

    @property
    def system_prompt(self) -> str:
        prompt = f"{self.instructions} You may reason step by step first. {ANSWER_FORMAT}"
        if self.worked_example:
            example = self._example()
            prompt += f"\nExample:\n{example.text}\n{example.reference_solution}"
        return prompt

    @property
    def task_id(self) -> str:
        problem = self._require_problem()
        return f"{self.family}/{problem.template}/{hashlib.sha1(problem.text.encode()).hexdigest()[:10]}"

    @property
    def problem(self) -> str:
        """The problem text (also in the first observation)."""
        return self._require_problem().text

    @property
    def answer(self) -> str:
        """The correct answer: verifier data, for STaR's rationalization hint and for evaluation."""
        return self._require_problem().answer

    @property
    def reference_solution(self) -> str:
        """The generator's worked solution, ending in "Answer: <answer>" (verifier data)."""
        return self._require_problem().reference_solution

    @staticmethod
    def hint_prompt(answer: str) -> str:
        """STaR's rationalization hint, appended to the observation to ask for a rationale for `answer`."""
        return (f"The correct answer is {answer}. Explain step by step why, "
                f'then end with a final line "Answer: {answer}".')

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        # Without a seed, continue the env's own seeded stream (gymnasium's convention).
        problem_seed = seed if seed is not None else int(self.np_random.integers(2**31))
        self._problem = self._draw(problem_seed)
        self._state = AttemptState()
        info = {"env_version": self.env_version, "task_id": self.task_id, "template": self._problem.template,
                "level": self._problem.level, "heldout_template": self._problem.heldout_template}
        return f"{self._problem.text}\n{ANSWER_FORMAT}", info

    def step(self, action: str | int) -> tuple[str, float, bool, bool, dict[str, Any]]:
        problem = self._require_problem()
        before = self._state
        if before.termination is not None:
            raise RuntimeError("episode is over; call reset()")  # a caller bug, not an agent error
        verifier = AnswerVerifier(problem.answer)
        given, correct = verifier.check(action)
        after = replace(before, attempts=before.attempts + 1,
                        invalid_actions=before.invalid_actions + int(given is None))
        left = self.max_attempts - after.attempts
        if correct:
            termination, feedback = "success", "Correct."
        elif left == 0:
            termination = "failure" if given is not None else "invalid_action"
            feedback = "Incorrect." if given is not None else NO_ANSWER_FEEDBACK
        else:
            termination = None
            tries = f"{left} attempt{'s' if left > 1 else ''} left."
            feedback = (f"Incorrect: {given}. {tries} {ANSWER_FORMAT}" if given is not None
                        else f"{NO_ANSWER_FEEDBACK} {tries}")
        self._state = after = replace(after, termination=termination)
        components = verifier.score(given, correct)
        info: dict[str, Any] = {"env_version": self.env_version, "task_id": self.task_id,
                                "invalid_actions": after.invalid_actions, "action_valid": given is not None,
                                "parsed_answer": given, "attempts": after.attempts,
                                "reward_components": components}
        if termination is not None:
            info["termination"], info["answer"] = termination, problem.answer
        return feedback, sum(components.values()), termination is not None, False, info

    def render(self) -> str:
        problem, state = self._require_problem(), self._state
        return f"{problem.text}\nAttempts {state.attempts}/{self.max_attempts}."

    def snapshot(self) -> dict[str, Any]:
        self._require_problem()
        return copy.deepcopy({"problem": self._problem, "state": self._state,
                              "np_random": self.np_random.bit_generator.state})

    def restore(self, state: dict[str, Any]) -> None:
        state = copy.deepcopy(state)  # the snapshot stays reusable for other branches
        self._problem, self._state = state["problem"], state["state"]
        self.np_random.bit_generator.state = state["np_random"]

    def _require_problem(self) -> Problem:
        if self._problem is None:
            raise RuntimeError("call reset() first")
        return self._problem


def _draw_in_split(rng: np.random.Generator, generate: Callable[[np.random.Generator], Problem],
                   split: str) -> Problem:
    for _ in range(MAX_DRAWS):
        problem = generate(rng)
        if problem.split == split:
            return problem
    raise RuntimeError(f"no {split} problem in {MAX_DRAWS} draws")


# ---------------------------------------------------------------------------------------------
# Arithmetic


def addition_problem(a: int, b: int) -> Problem:
    """The problem "What is a + b?" (the level is the longer operand's digit count)."""
    return Problem(template="addition", level=max(len(str(a)), len(str(b))), text=f"What is {a} + {b}?",
                   numbers={"a": a, "b": b}, answer=str(a + b), reference_solution=scratchpad(a, b),
                   split_key=f"{min(a, b)}+{max(a, b)}")


def _operand(rng: np.random.Generator, digits: int) -> int:
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, 10**digits))


class ArithmeticEnv(ReasoningEnv):
    """n-digit addition (both operands n digits, n drawn uniformly from `digits` each episode).

    `digits` is one count or several (default 1-5); `level` (1-4) instead picks ARITHMETIC_LEVELS[level]
    (1-2, 3-4, 5-6, 7-8 digits). Giving both is an error.
    """

    env_version = "arithmetic-1.0"
    family = "arithmetic"
    instructions = "Add the two numbers."

    def __init__(self, digits: int | Sequence[int] | None = None, level: int | None = None,
                 split: str = "train", max_attempts: int = 1, worked_example: bool = True,
                 render_mode: str | None = None) -> None:
        super().__init__(split=split, max_attempts=max_attempts, worked_example=worked_example,
                         render_mode=render_mode)
        if digits is not None and level is not None:
            raise ValueError("give digits or level, not both")
        if level is not None:
            if level not in ARITHMETIC_LEVELS:
                raise ValueError(f"level must be one of {sorted(ARITHMETIC_LEVELS)}, got {level!r}")
            digits = ARITHMETIC_LEVELS[level]
        counts = DEFAULT_DIGITS if digits is None else (digits,) if isinstance(digits, int) else tuple(digits)
        if not counts or any(not isinstance(n, int) or not 1 <= n <= MAX_DIGITS for n in counts):
            raise ValueError(f"digits must be integers in 1..{MAX_DIGITS}, got {digits!r}")
        self.digits = counts

    def _draw(self, problem_seed: int) -> Problem:
        rng = np.random.default_rng(problem_seed)
        n = int(rng.choice(self.digits))
        return _draw_in_split(rng, lambda r: addition_problem(_operand(r, n), _operand(r, n)), self.split)

    def _example(self) -> Problem:
        return _draw_in_split(np.random.default_rng(0), lambda r: addition_problem(_operand(r, 2), _operand(r, 2)),
                              "train")


# ---------------------------------------------------------------------------------------------
# Word problems

NAMES = ("Ava", "Ben", "Chen", "Dana", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jade",
         "Kofi", "Lena", "Mia", "Noah", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara")
ITEMS = ("pencils", "notebooks", "apples", "stickers", "tickets", "candles", "mugs", "books")
SHARED_THINGS = ("marbles", "stickers", "cookies", "cards", "grapes")
VEHICLES = ("train", "bus", "car", "boat")


class Work:
    """Records the reference solution, one "x op y = z" line per operation; division must be exact."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, x: int, op: str, y: int) -> int:
        if op == "+":
            value = x + y
        elif op == "-":
            value = x - y
        elif op == "*":
            value = x * y
        elif op == "/" and x % y == 0:
            value = x // y
        else:
            raise ValueError(f"unsupported or inexact operation {x} {op} {y}")
        self.lines.append(f"{x} {op} {y} = {value}")
        return value


Generated = tuple[str, dict[str, int], int]  # a template's (text, numbers, answer)


@dataclass(frozen=True)
class Template:
    """A word-problem generator: draws quantities, returns (text, numbers, answer) via `Work`."""

    name: str
    level: int
    heldout: bool
    generate: Callable[[np.random.Generator, Work], Generated] = field(repr=False)

    def problem(self, rng: np.random.Generator) -> Problem:
        work = Work()
        text, numbers, answer = self.generate(rng, work)
        if len(work.lines) != self.level:  # the level is the number of operations, by definition
            raise RuntimeError(f"template {self.name} used {len(work.lines)} operations, not {self.level}")
        solution = "\n".join(work.lines + [f"Answer: {answer}"])
        return Problem(template=self.name, level=self.level, text=text, numbers=numbers, answer=str(answer),
                       reference_solution=solution, split_key=text, heldout_template=self.heldout)


TEMPLATES: dict[str, Template] = {}


def _template(level: int, heldout: bool = False) -> Callable[[Callable[..., Generated]], Callable[..., Generated]]:
    """Registers the decorated generator in TEMPLATES under its function name."""
    def register(generate: Callable[..., Generated]) -> Callable[..., Generated]:
        TEMPLATES[generate.__name__] = Template(generate.__name__, level, heldout, generate)
        return generate
    return register


def _int(rng: np.random.Generator, low: int, high: int) -> int:
    """Uniform integer in [low, high], both included."""
    return int(rng.integers(low, high + 1))


def _pick(rng: np.random.Generator, options: Sequence[str], k: int = 1) -> list[str]:
    return [options[i] for i in rng.choice(len(options), size=k, replace=False)]


@_template(level=1)
def shop_total(rng: np.random.Generator, work: Work) -> Generated:
    (name,), (item,) = _pick(rng, NAMES), _pick(rng, ITEMS)
    n, p = _int(rng, 2, 12), _int(rng, 2, 25)
    text = f"{name} buys {n} {item} at ${p} each. How many dollars does {name} spend?"
    return text, {"n": n, "p": p}, work(n, "*", p)


@_template(level=1)
def share_equal(rng: np.random.Generator, work: Work) -> Generated:
    (name,), (thing,) = _pick(rng, NAMES), _pick(rng, SHARED_THINGS)
    k = _int(rng, 2, 9)
    total = k * _int(rng, 2, 15)
    text = f"{name} shares {total} {thing} equally among {k} friends. How many {thing} does each friend get?"
    return text, {"total": total, "k": k}, work(total, "/", k)


@_template(level=1)
def age_older(rng: np.random.Generator, work: Work) -> Generated:
    name, other = _pick(rng, NAMES, 2)
    a, d = _int(rng, 5, 40), _int(rng, 2, 30)
    text = f"{name} is {a} years old. {other} is {d} years older than {name}. How old is {other}?"
    return text, {"a": a, "d": d}, work(a, "+", d)


@_template(level=1, heldout=True)
def hours_to_minutes(rng: np.random.Generator, work: Work) -> Generated:
    (vehicle,) = _pick(rng, VEHICLES)
    h = _int(rng, 2, 12)
    text = f"A {vehicle} trip takes {h} hours. How many minutes does the trip take?"
    return text, {"h": h}, work(h, "*", 60)


@_template(level=2)
def shop_change(rng: np.random.Generator, work: Work) -> Generated:
    (name,), (item,) = _pick(rng, NAMES), _pick(rng, ITEMS)
    n, p = _int(rng, 2, 9), _int(rng, 2, 11)
    bill = int(rng.choice([note for note in (20, 50, 100) if note >= n * p]))
    text = (f"{name} buys {n} {item} at ${p} each and pays with a ${bill} bill. "
            f"How many dollars of change does {name} get?")
    return text, {"n": n, "p": p, "bill": bill}, work(bill, "-", work(n, "*", p))


@_template(level=2)
def rate_distance(rng: np.random.Generator, work: Work) -> Generated:
    (vehicle,) = _pick(rng, VEHICLES)
    v, h, d = 5 * _int(rng, 6, 18), _int(rng, 2, 6), _int(rng, 5, 60)
    text = (f"A {vehicle} travels at {v} km per hour for {h} hours, then {d} more km. "
            f"How many km does it travel in all?")
    return text, {"v": v, "h": h, "d": d}, work(work(v, "*", h), "+", d)


@_template(level=2)
def share_after_gift(rng: np.random.Generator, work: Work) -> Generated:
    (name,), (thing,) = _pick(rng, NAMES), _pick(rng, SHARED_THINGS)
    k = _int(rng, 2, 8)
    total = k * _int(rng, 3, 12)
    a = _int(rng, 1, total - 1)
    b = total - a
    text = (f"{name} has {a} {thing} and is given {b} more. {name} shares all of them equally among {k} "
            f"friends. How many {thing} does each friend get?")
    return text, {"a": a, "b": b, "k": k}, work(work(a, "+", b), "/", k)


@_template(level=2, heldout=True)
def age_future_multiple(rng: np.random.Generator, work: Work) -> Generated:
    (name,) = _pick(rng, NAMES)
    a, m, y = _int(rng, 4, 12), _int(rng, 3, 5), _int(rng, 2, 20)
    text = (f"{name} is {a} years old. {name}'s mother is {m} times as old as {name}. "
            f"How old will {name}'s mother be in {y} years?")
    return text, {"a": a, "m": m, "y": y}, work(work(a, "*", m), "+", y)


@_template(level=3)
def shop_two_items(rng: np.random.Generator, work: Work) -> Generated:
    (name,), (item1, item2) = _pick(rng, NAMES), _pick(rng, ITEMS, 2)
    n1, p1, n2, p2 = _int(rng, 2, 9), _int(rng, 2, 15), _int(rng, 2, 9), _int(rng, 2, 15)
    text = (f"{name} buys {n1} {item1} at ${p1} each and {n2} {item2} at ${p2} each. "
            f"How many dollars does {name} spend?")
    return text, {"n1": n1, "p1": p1, "n2": n2, "p2": p2}, work(work(n1, "*", p1), "+", work(n2, "*", p2))


@_template(level=3)
def bake_sale(rng: np.random.Generator, work: Work) -> Generated:
    (name,) = _pick(rng, NAMES)
    t, c, e, p = _int(rng, 2, 6), _int(rng, 6, 12), _int(rng, 1, 5), _int(rng, 2, 4)
    text = (f"{name} bakes {t} trays of {c} cookies and eats {e} of them. {name} sells the rest for "
            f"${p} each. How many dollars does {name} earn?")
    return text, {"t": t, "c": c, "e": e, "p": p}, work(work(work(t, "*", c), "-", e), "*", p)


@_template(level=3)
def daily_run_meters(rng: np.random.Generator, work: Work) -> Generated:
    (name,) = _pick(rng, NAMES)
    km, m, d = _int(rng, 1, 9), 100 * _int(rng, 1, 9), _int(rng, 2, 7)
    text = f"{name} runs {km} km and {m} m every day. How many meters does {name} run in {d} days?"
    return text, {"km": km, "m": m, "d": d}, work(work(work(km, "*", 1000), "+", m), "*", d)


@_template(level=3, heldout=True)
def savings_weeks(rng: np.random.Generator, work: Work) -> Generated:
    (name,) = _pick(rng, NAMES)
    w = _int(rng, 20, 60)
    s, weeks, saved = _int(rng, 5, w - 5), _int(rng, 2, 12), _int(rng, 5, 100)
    goal = saved + weeks * (w - s)
    text = (f"{name} earns ${w} a week and spends ${s} a week. {name} has ${saved} saved. "
            f"How many weeks until {name} has ${goal}?")
    return text, {"w": w, "s": s, "saved": saved, "goal": goal}, work(work(goal, "-", saved), "/", work(w, "-", s))


@_template(level=4)
def shop_coupon(rng: np.random.Generator, work: Work) -> Generated:
    (name,), (item1, item2) = _pick(rng, NAMES), _pick(rng, ITEMS, 2)
    n1, p1, n2, p2 = _int(rng, 2, 9), _int(rng, 3, 15), _int(rng, 2, 9), _int(rng, 3, 15)
    c = _int(rng, 1, 10)  # the cheapest basket costs 2*3 + 2*3 = 12 > 10
    text = (f"{name} buys {n1} {item1} at ${p1} each and {n2} {item2} at ${p2} each. {name} uses a ${c} "
            f"coupon. How many dollars does {name} pay?")
    total = work(work(n1, "*", p1), "+", work(n2, "*", p2))
    return text, {"n1": n1, "p1": p1, "n2": n2, "p2": p2, "c": c}, work(total, "-", c)


@_template(level=4)
def age_sum_three(rng: np.random.Generator, work: Work) -> Generated:
    first, second, third = _pick(rng, NAMES, 3)
    a, d = _int(rng, 3, 20), _int(rng, 1, 15)
    text = (f"{first} is {a} years old. {second} is {d} years older than {first}. {third} is twice as old "
            f"as {second}. What is the sum of their three ages?")
    b = work(a, "+", d)
    c = work(2, "*", b)
    return text, {"a": a, "d": d}, work(work(a, "+", b), "+", c)


@_template(level=4)
def fuel_two_legs(rng: np.random.Generator, work: Work) -> Generated:
    e = _int(rng, 5, 15)
    h1, v1, h2, v2 = _int(rng, 1, 5), e * _int(rng, 4, 10), _int(rng, 1, 5), e * _int(rng, 4, 10)
    text = (f"A car drives {h1} hours at {v1} km per hour and then {h2} hours at {v2} km per hour. It uses "
            f"1 litre of fuel for every {e} km. How many litres of fuel does it use?")
    distance = work(work(v1, "*", h1), "+", work(v2, "*", h2))
    return text, {"h1": h1, "v1": v1, "h2": h2, "v2": v2, "e": e}, work(distance, "/", e)


@_template(level=4, heldout=True)
def shift_pay(rng: np.random.Generator, work: Work) -> Generated:
    (name,) = _pick(rng, NAMES)
    hours, rate = _int(rng, 2, 9), _int(rng, 8, 30)
    m1 = 15 * _int(rng, 1, 4 * hours - 1)
    m2 = 60 * hours - m1
    lunch = _int(rng, 1, 15)  # pay is at least 2 * 8 = 16 dollars
    text = (f"{name} works {m1} minutes on Monday and {m2} minutes on Tuesday. {name} is paid ${rate} per "
            f"hour and spends ${lunch} on lunch. How many dollars of the pay are left?")
    pay = work(work(work(m1, "+", m2), "/", 60), "*", rate)
    return text, {"m1": m1, "m2": m2, "rate": rate, "lunch": lunch}, work(pay, "-", lunch)


HELDOUT_TEMPLATES = tuple(name for name, template in TEMPLATES.items() if template.heldout)


class WordProblemEnv(ReasoningEnv):
    """Templated multi-step word problems. Each episode picks a level uniformly from `level` (1-4, one
    or several; default all), then a template of that level allowed in the split uniformly (optionally
    only among `templates`), then instances of it until one falls in the split."""

    env_version = "wordproblems-1.0"
    family = "wordproblems"
    instructions = "Solve the math word problem."

    def __init__(self, level: int | Sequence[int] | None = None, templates: Sequence[str] | None = None,
                 split: str = "train", max_attempts: int = 1, worked_example: bool = True,
                 render_mode: str | None = None) -> None:
        super().__init__(split=split, max_attempts=max_attempts, worked_example=worked_example,
                         render_mode=render_mode)
        levels = WORD_LEVELS if level is None else (level,) if isinstance(level, int) else tuple(level)
        if not levels or set(levels) - set(WORD_LEVELS):
            raise ValueError(f"level must be in {WORD_LEVELS}, got {level!r}")
        unknown = set(templates or ()) - set(TEMPLATES)
        if unknown:
            raise ValueError(f"unknown templates {sorted(unknown)}; valid: {sorted(TEMPLATES)}")
        pool = [t for t in TEMPLATES.values() if t.level in levels and (templates is None or t.name in templates)
                and (split == "test" or not t.heldout)]  # held-out templates never reach train
        if not pool:
            raise ValueError(f"no {split} templates for level {level!r} and templates {templates!r}")
        self.templates = pool
        self.levels = sorted({t.level for t in pool})

    def _draw(self, problem_seed: int) -> Problem:
        rng = np.random.default_rng(problem_seed)
        level = self.levels[int(rng.integers(len(self.levels)))]
        candidates = [t for t in self.templates if t.level == level]
        template = candidates[int(rng.integers(len(candidates)))]
        return _draw_in_split(rng, template.problem, self.split)

    def _example(self) -> Problem:
        return _draw_in_split(np.random.default_rng(0), TEMPLATES["shop_change"].problem, "train")
