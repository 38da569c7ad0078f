"""LATS's pure tree pieces against hand-computed values, branching without leaks, the node cache, budgets."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

import envs
from common.rollout import RolloutConfig, RolloutEngine
from envs.codegen import CodegenEnv
from envs.gridworld import GridWorldEnv

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("lats", ROOT / "algorithms" / "lats.py")
lats = importlib.util.module_from_spec(spec)
sys.modules["lats"] = lats
spec.loader.exec_module(lats)


def _tree():
    root = lats.Node(expanded=True)
    a, b, c = (lats.Node(parent=root, value_est=v, action_text=n) for v, n in ((0.2, "a"), (0.6, "b"), (0.4, "c")))
    root.children = [a, b, c]
    return root, a, b, c


def test_ucb1_selection_and_backpropagation_hand_computed():
    root, a, b, c = _tree()
    # nothing visited: UCB1 = +inf for all; the tie goes to the best evaluation
    assert lats.ucb1(a, 1.0) == math.inf and lats.select(root, 1.0) is b
    lats.backpropagate(b, 0.3)
    assert lats.select(root, 1.0) is c  # c (0.4) before a (0.2): both unvisited
    lats.backpropagate(c, 0.1)
    lats.backpropagate(a, 1.0)
    assert (root.visits, root.value_sum) == (3, pytest.approx(1.4))
    assert (a.visits, a.value, b.visits, b.value, c.value) == (1, 1.0, 1, pytest.approx(0.3), pytest.approx(0.1))
    # eq. 12.8 with N(root) = 3: a = 1.0 + sqrt(ln 3) = 2.048, b = 0.3 + sqrt(ln 3), c = 0.1 + sqrt(ln 3)
    assert lats.ucb1(a, 1.0) == pytest.approx(1.0 + math.sqrt(math.log(3)))
    assert lats.ucb1(b, 0.5) == pytest.approx(0.3 + 0.5 * math.sqrt(math.log(3)))
    assert lats.select(root, 1.0) is a  # a is a leaf (not expanded): selection stops there
    a.expanded = True
    a1 = lats.Node(parent=a, value_est=0.1)
    a.children = [a1]
    lats.backpropagate(a1, 0.2)
    lats.backpropagate(b, 0.7)
    assert (a1.visits, a.visits, b.visits, root.visits) == (1, 2, 2, 5)
    assert a.value == pytest.approx(0.6) and b.value == pytest.approx(0.5) and root.value == pytest.approx(2.3 / 5)
    # N(root) = 5: a = 0.6 + sqrt(ln 5 / 2) = 1.4971, b = 0.5 + sqrt(ln 5 / 2) = 1.3971, c = 0.1 + sqrt(ln 5) = 1.3686
    assert lats.ucb1(a, 1.0) == pytest.approx(0.6 + math.sqrt(math.log(5) / 2))
    assert lats.ucb1(c, 1.0) == pytest.approx(0.1 + math.sqrt(math.log(5)))
    assert lats.select(root, 1.0) is a1
    # c = 2 favours the less visited: c = 0.1 + 2 sqrt(ln 5) = 2.637 > a = 0.6 + 2 sqrt(ln 5 / 2) = 2.394
    assert lats.select(root, 2.0) is c
    # pruning: a1 fails -> a has no live child -> a is dead; b (1.3971) now beats c (1.3686)
    lats.mark_dead(a1)
    assert a.dead and not root.dead
    assert lats.select(root, 1.0) is b
    # the answer without a success: most visited child at each level (a, b both N = 2: the higher V, a)
    assert [n.action_text for n in lats.most_visited_path(root)[1:]] == ["a", ""]
    lats.mark_dead(b), lats.mark_dead(c)
    assert root.dead


def test_env_value_normalisation():
    assert lats.env_value(2.5, 5.0) == 0.5
    assert lats.env_value(-0.3, 5.0) == 0.0 and lats.env_value(7.0, 5.0) == 1.0


def _args(**kw):
    return lats.Args(model="tiny", **kw)


def test_branches_diverge_without_leaking_state(tiny):
    model, tok = tiny
    lm = lats.LM(model, tok, torch.Generator().manual_seed(0))
    search = lats.Search(_args(), lm, GridWorldEnv(), seed=0, action_mode="choice", scale=5.0)
    root = search.root
    prop = lambda a: (search.candidates[a], [0.0] * len(search.candidates[a]), False, a)  # noqa: E731
    up, right = search.step(root, prop(0)), search.step(root, prop(3))
    right2 = search.step(right, prop(3))
    down_from_up = search.step(up, prop(1))  # back to the start cell, from the "up" branch
    env = search.env
    for node, pos, steps in ((root, (2, 0), 0), (up, (1, 0), 1), (right, (2, 1), 1), (right2, (2, 2), 2),
                             (down_from_up, (2, 0), 2)):
        env.restore(node.snapshot)
        assert (env._state.pos, env._state.steps) == (pos, steps)
    assert "A" in right2.obs.splitlines()[-2] and right2.ret == pytest.approx(-0.10)
    # a snapshot stays reusable: stepping after a restore does not change it
    env.restore(right.snapshot)
    env.step(3)
    env.restore(right.snapshot)
    assert env._state.pos == (2, 1)


def test_codegen_branches_diverge(tiny):
    model, tok = tiny
    lm = lats.LM(model, tok)
    env = CodegenEnv(level=1)
    search = lats.Search(_args(), lm, env, seed=3, action_mode="free", scale=1.0)
    good = f"```python\n{env.task.reference}```"
    bad = f"```python\ndef {env.task.entry_point}(*a):\n    return None\n```"
    wrong = search.step(search.root, ([1], [0.0], False, bad))
    right = search.step(search.root, ([1], [0.0], False, good))
    assert right.termination == "success" and right.ret == pytest.approx(1.0)
    assert not wrong.terminal and wrong.ret < 1.0
    env.restore(wrong.snapshot)
    assert env._state.attempts == 1 and env._state.termination is None
    env.restore(search.root.snapshot)
    assert env._state.attempts == 0


def test_node_cache_avoids_duplicate_generations(tiny):
    model, tok = tiny
    lm = lats.LM(model, tok, torch.Generator().manual_seed(0))
    search = lats.Search(_args(k=4), lm, GridWorldEnv(), seed=0, action_mode="choice", scale=5.0)
    children = search.expand(search.root)
    assert lm.calls == 1 and len(children) == 4  # k distinct action names from one scored prompt
    calls, tokens = lm.calls, lm.tokens
    assert search.expand(search.root) is children and (lm.calls, lm.tokens) == (calls, tokens)
    search.evaluate(children)
    assert lm.calls == calls + 1  # one batched value forward for all 4 children
    calls, tokens = lm.calls, lm.tokens
    search.evaluate(children)
    assert (lm.calls, lm.tokens) == (calls, tokens)
    # the simulation's first greedy step caches the child's action scores; expanding it later reuses them
    best = children[0]
    search.simulate(best)
    calls, tokens = lm.calls, lm.tokens
    search.expand(best)
    assert (lm.calls, lm.tokens) == (calls, tokens) and best.children


def test_free_mode_expansion_is_one_batched_call_and_cached(tiny):
    model, tok = tiny
    lm = lats.LM(model, tok, torch.Generator().manual_seed(0))
    search = lats.Search(_args(k=3, max_turn_tokens=6), lm, GridWorldEnv(), seed=0, action_mode="free", scale=5.0)
    children = search.expand(search.root)
    prompt = len(search.context([search.root]))
    assert lm.calls == 1 and lm.prompt_tokens == prompt and 3 <= lm.generated_tokens <= 18
    assert 1 <= len(children) <= 3  # duplicates merged
    generated = lm.generated_tokens
    search.expand(search.root)
    assert lm.generated_tokens == generated


def test_value_blend_hand_computed(tiny):
    model, tok = tiny
    lm = lats.LM(model, tok)
    search = lats.Search(_args(value_lambda=0.25), lm, GridWorldEnv(layout=("SR.G",)), seed=0, action_mode="choice",
                         scale=5.0)
    child = search.step(search.root, (search.candidates[3], [0.0], False, 3))  # right: collects R (+1 - 0.05)
    child.cache["value"] = 0.8  # a cached LLM value: no call
    search.evaluate([child])
    assert lm.calls == 0
    assert child.value_est == pytest.approx(0.25 * 0.8 + 0.75 * (0.95 / 5.0))
    goal = search.step(child, (search.candidates[3], [0.0], False, 3))
    goal = search.step(goal, (search.candidates[3], [0.0], False, 3))
    search.evaluate([goal])  # terminal: the verifier's value only, no LLM
    assert goal.termination == "success" and goal.value_est == pytest.approx((0.95 - 0.05 + 2.95) / 5.0)


def test_sampling_leaves_the_session_reusable_and_counts_tokens(tiny):
    model, tok = tiny
    lm = lats.LM(model, tok)
    session = lm.start([5, 6, 7, 8])
    first = lm.sample(session, 3, 5, 0.0)
    second = lm.sample(session, 1, 5, 0.0)
    assert first[0][0] == first[2][0] == second[0][0]  # greedy from an untouched cache
    assert lm.prompt_tokens == 4 and lm.generated_tokens == 3 * len(first[0][0]) + len(second[0][0])
    p = lm.yes_prob([[1, 2, 3], [4, 5]])
    assert all(0 < x < 1 for x in p) and lm.calls == 2 and lm.prompt_tokens == 9


def test_search_finds_a_verified_success(tiny):
    model, tok = tiny
    lm = lats.LM(model, tok, torch.Generator().manual_seed(1))
    args = _args(k=4, iterations=40, rollout_depth=0, reflect=False, token_budget=0)
    search = lats.Search(args, lm, GridWorldEnv(layout=("S..G",)), seed=0, action_mode="choice", scale=5.0)
    iterations = search.run()
    path = search.answer()
    assert path[-1].termination == "success" and [n.action_text for n in path[1:]] == ["right"] * 3
    assert iterations <= 40 and search.root.visits == iterations  # one back-propagation per iteration
    traj = lats.record(lm.chat, search.env, path, 0, "gridworld")
    traj.validate()
    assert traj.success and traj.num_policy_tokens == sum(len(n.action_ids) for n in path[1:])


@pytest.mark.parametrize("max_steps, rollout_depth", [(20, 1), (2, 8), (1, 0)])
def test_reflection_only_after_a_failed_terminal_state(tiny, max_steps, rollout_depth):
    """LATS step 6: a lesson after a trajectory that ended without success, never after a rollout the depth cap cut
    (20 steps, rollouts of 1: nothing ends within 3 iterations); (2, 8): rollouts end at the step limit; (1, 0):
    every expanded child is a failed terminal and nothing is simulated, so only the children can be reflected on."""
    model, tok = tiny
    lm = lats.LM(model, tok, torch.Generator().manual_seed(0))
    args = _args(k=2, iterations=3, rollout_depth=rollout_depth, token_budget=0)
    search = lats.Search(args, lm, GridWorldEnv(layout=("S......G",), max_steps=max_steps), seed=0,
                         action_mode="choice", scale=5.0)
    reflected = []
    search.reflect = reflected.append
    search.run()
    assert all(path[-1].terminal and path[-1].termination != "success" for path in reflected)
    assert all(path[0] is search.root for path in reflected)
    assert len(reflected) == (0 if max_steps == 20 else min(3, search.root.visits))  # <= 1 lesson per iteration


def test_react_respects_the_token_budget(tiny):
    model, tok = tiny
    args = _args(token_budget=2500, react_batch=2)
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode="choice", max_total_tokens=4096))
    counted, tokens, generated = lats.react_task(args, engine, "gridworld", {}, 0, torch.Generator().manual_seed(0))
    assert tokens == sum(len(t.token_ids) for t in counted) and generated == sum(t.num_policy_tokens for t in counted)
    # an episode starts only while the budget is not spent; without a success, the budget is spent
    assert tokens - len(counted[-1].token_ids) < args.token_budget
    assert any(t.success for t in counted) or tokens >= args.token_budget
    assert counted[0].turns and all(not t.success for t in counted[:-1])


def test_bad_env_level_fails_fast(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "algorithms" / "lats.py"), "--model", "tiny", "--env-level", "2",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--env-level" in proc.stderr and "Traceback" not in proc.stderr
    assert envs.make("codegen", level=1).level == 1
