"""Tests for envs/external.py: gymnasium's toy-text games and minigrid's BabyAI levels as text environments."""

import random
import sys
import warnings
from collections import deque

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from envs.base import REWARD_COMPONENTS, TERMINATIONS
from envs.external import CliffWalkingTextEnv, FrozenLakeTextEnv, TaxiTextEnv

TOY_TEXT = [FrozenLakeTextEnv, TaxiTextEnv, CliffWalkingTextEnv]
INVALID_ACTIONS = ["jump", "", "🙂", "upward", "@@##", 7, -1, None, 2.0, True, ["up"]]


def play(env, actions):
    """Step until the episode ends or actions run out; returns the list of step results."""
    results = []
    for action in actions:
        results.append(env.step(action))
        if results[-1][2] or results[-1][3]:
            break
    return results


def play_optimally(env):
    """Follow the env's planner to the end; (number of steps, return, last info)."""
    steps, total = 0, 0.0
    while True:
        _, reward, terminated, truncated, info = env.step(env.optimal_action())
        steps, total = steps + 1, total + reward
        if terminated or truncated:
            return steps, total, info


def check_step_contract(env, result):
    obs, reward, terminated, truncated, info = result
    assert isinstance(obs, str) and obs
    assert set(info["reward_components"]) == set(REWARD_COMPONENTS)
    assert reward == pytest.approx(sum(info["reward_components"].values()))
    for key in ("env_version", "task_id", "invalid_actions", "action_valid"):
        assert key in info
    assert ("termination" in info) == (terminated or truncated)
    if "termination" in info:
        assert info["termination"] in TERMINATIONS
        assert truncated == (info["termination"] == "truncated")


# -- FrozenLake ------------------------------------------------------------------------------------


def test_frozenlake_renders_map_and_positions():
    env = FrozenLakeTextEnv()
    obs, info = env.reset(seed=0)
    assert obs == ("Step 0/100. You are A at row 0, col 0; the goal G is at row 3, col 3.\n"
                   "AFFF\nFHFH\nFFFH\nHFFG")
    assert info == {"env_version": f"frozenlake-1.0+gymnasium-{gymnasium.__version__}", "task_id": "frozenlake/4x4"}
    assert env.action_names == ["left", "down", "right", "up"]
    assert env.max_steps == 100 and len(env.game.P[0][1]) == 1  # one outcome per move: deterministic by default


def test_frozenlake_text_path_reaches_goal_in_six_steps():
    env = FrozenLakeTextEnv()
    env.reset(seed=0)
    texts = ["I go down", "Down!", "right", "I will move right.", "down", "RIGHT"]
    results = play(env, texts)
    assert len(results) == 6
    obs, reward, terminated, truncated, info = results[-1]
    assert sum(r[1] for r in results) == 1.0 and reward == 1.0
    assert terminated and not truncated and info["termination"] == "success"
    assert info["reward_components"]["task"] == 1.0 and info["invalid_actions"] == 0
    assert obs.startswith("You moved right. You reached the goal.\nStep 6/100. You are A at row 3, col 3;")
    assert obs.endswith("SFFF\nFHFH\nFFFH\nHFFA")
    with pytest.raises(RuntimeError):
        env.step("down")


def test_frozenlake_planner_and_index_actions():
    env = FrozenLakeTextEnv()
    env.reset(seed=0)
    assert env.optimal_return() == 1.0
    steps, total, info = play_optimally(env)
    assert (steps, total, info["termination"]) == (6, 1.0, "success")
    env.reset(seed=0)
    assert [env.step(i)[4]["action_index"] for i in (1, 1, 2)] == [1, 1, 2]  # down, down, right
    obs, *_ = env.step(np.int64(0))
    assert obs.startswith("You moved left.\nStep 4/100. You are A at row 2, col 0;")


def test_frozenlake_hole_is_failure():
    env = FrozenLakeTextEnv()
    env.reset(seed=0)
    *_, (obs, reward, terminated, truncated, info) = play(env, ["right", "down"])  # (0, 1) -> hole (1, 1)
    assert terminated and not truncated and reward == 0.0
    assert info["termination"] == "failure" and obs.startswith("You moved down. You fell into a hole.")


def test_frozenlake_edge_and_truncation():
    env = FrozenLakeTextEnv(max_steps=3)
    env.reset(seed=0)
    obs, *_ = env.step("up")
    assert obs.startswith("You tried to move up and stayed in place.")
    *_, (obs, reward, terminated, truncated, info) = play(env, ["left", "left"])
    assert truncated and not terminated and info["termination"] == "truncated" and "Step 3/3" in obs


def test_slippery_frozenlake_planner_matches_the_known_optimum():
    # Undiscounted, with time enough, the best chance to cross the slippery 4x4 lake is 14/17.
    env = FrozenLakeTextEnv(is_slippery=True, max_steps=1000)
    env.reset(seed=0)
    assert env.optimal_return() == pytest.approx(14 / 17, abs=1e-6)
    assert FrozenLakeTextEnv(is_slippery=True).reset(seed=0)[1]["task_id"] == "frozenlake/4x4-slippery"


def test_frozenlake_8x8():
    env = FrozenLakeTextEnv(map_name="8x8")
    obs, _ = env.reset(seed=0)
    assert env.max_steps == 200 and obs.splitlines()[1] == "AFFFFFFF" and len(obs.splitlines()) == 9
    steps, total, _ = play_optimally(env)
    assert (steps, total) == (14, 1.0)
    with pytest.raises(ValueError, match="map_name"):
        FrozenLakeTextEnv(map_name=None)


# -- Taxi ------------------------------------------------------------------------------------------

TAXI_MAP = ["R: | : :G", " : | : : ", " : : : : ", " | : | : ", "Y| : |B: "]
TAXI_STANDS = [(0, 0), (0, 4), (4, 0), (4, 3)]


def taxi_bfs(row, col, passenger, destination):
    """Fewest steps to deliver, by BFS over (row, col, passenger) with Taxi's rules written out here."""
    def moves(r, c):
        yield min(r + 1, 4), c
        yield max(r - 1, 0), c
        yield r, (c + 1 if c < 4 and TAXI_MAP[r][2 * c + 1] == ":" else c)
        yield r, (c - 1 if c > 0 and TAXI_MAP[r][2 * c - 1] == ":" else c)

    start = (row, col, passenger)
    seen, queue = {start: 0}, deque([start])
    while queue:
        r, c, p = node = queue.popleft()
        if p == 4 and (r, c) == TAXI_STANDS[destination]:
            return seen[node] + 1  # the dropoff
        children = [(nr, nc, p) for nr, nc in moves(r, c)]
        if p < 4 and (r, c) == TAXI_STANDS[p]:
            children.append((r, c, 4))
        for child in children:
            if child not in seen:
                seen[child] = seen[node] + 1
                queue.append(child)
    raise AssertionError("undeliverable")


@pytest.mark.parametrize("seed", range(5))
def test_taxi_optimal_return_matches_an_independent_bfs(seed):
    env = TaxiTextEnv()
    obs, info = env.reset(seed=seed)
    row, col, passenger, destination = env.decode(env.game.s)
    assert info["task_id"] == f"taxi/{env.game.s}"
    n = taxi_bfs(row, col, passenger, destination)
    best = 20 - (n - 1)  # -1 for every step but the delivery, +20 for it
    assert env.optimal_return() == best
    steps, total, info = play_optimally(env)
    assert (steps, total, info["termination"]) == (n, best, "success")
    assert info["reward_components"] == {"format": 0.0, "progress": 0.0, "task": 20.0, "cost": 0.0, "safety": 0.0}


def test_taxi_renders_positions_and_map():
    env = TaxiTextEnv()
    obs, _ = env.reset(seed=0)
    assert env.decode(env.game.s) == (3, 0, 3, 2)
    assert obs == ("Step 0/200. Taxi T at row 3, col 0. Passenger at B (row 4, col 3); destination Y (row 4, col 0).\n"
                   "R: | : :G\n : | : : \n : : : : \nT| : | : \nY| : |B: ")
    assert env.action_names == ["south", "north", "east", "west", "pickup", "dropoff"]


def test_taxi_components_and_feedback():
    env = TaxiTextEnv()
    env.reset(seed=0)
    obs, reward, *_, info = env.step("pickup")
    assert reward == -10 and info["reward_components"]["safety"] == -10 and obs.startswith("Illegal pickup")
    obs, reward, *_, info = env.step("dropoff")
    assert reward == -10 and info["reward_components"]["safety"] == -10 and obs.startswith("Illegal dropoff")
    obs, reward, *_, info = env.step("I drive east")  # (3, 0) has a wall to the east
    assert reward == -1 and info["reward_components"]["cost"] == -1
    assert obs.startswith("You tried to drive east but a wall or the edge is in the way.")
    obs, *_ = env.step(1)
    assert obs.startswith("You drove north.") and "Taxi T at row 2, col 0." in obs
    # Drive to B (4, 3), pick up, and drop the passenger at G, a stand that is not the destination.
    play(env, ["east", "east", "east", "south", "south"])
    obs, reward, *_ = env.step("pickup")
    assert obs.startswith("You picked up the passenger.") and reward == -1 and "Passenger in the taxi" in obs
    play(env, ["north", "north", "north", "north", "east"])
    obs, reward, terminated, _, info = env.step("dropoff")
    assert obs.startswith("You dropped the passenger at G, not the destination.") and reward == -1
    assert not terminated and info["reward_components"]["cost"] == -1


# -- CliffWalking ----------------------------------------------------------------------------------


def test_cliffwalking_fall_is_costly_but_not_terminal():
    env = CliffWalkingTextEnv()
    obs, info = env.reset(seed=0)
    assert obs.endswith("............\n............\n............\nACCCCCCCCCCG")
    assert info["task_id"] == "cliffwalking" and env.max_steps == 100
    obs, reward, terminated, truncated, info = env.step("right")
    assert (reward, terminated, truncated) == (-100, False, False)
    assert info["reward_components"]["safety"] == -100 and "termination" not in info
    assert obs.startswith("You tried to move right, fell off the cliff and are back at the start.")
    assert "Step 1/100. You are A at row 3, col 0" in obs


def test_cliffwalking_optimal_path():
    env = CliffWalkingTextEnv()
    env.reset(seed=0)
    assert env.optimal_return() == -13
    results = play(env, ["up"] + ["right"] * 11 + ["down"])
    assert sum(r[1] for r in results) == -13 and results[-1][4]["termination"] == "success"
    assert all(r[4]["reward_components"]["cost"] == -1 for r in results)
    env.reset(seed=0)
    assert play_optimally(env)[:2] == (13, -13)


# -- every toy-text game ---------------------------------------------------------------------------


@pytest.mark.parametrize("env_class", TOY_TEXT)
@pytest.mark.parametrize("action", INVALID_ACTIONS)
def test_invalid_actions_never_raise_and_are_counted(env_class, action):
    env = env_class()
    obs0, _ = env.reset(seed=0)
    state = env.game.s
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs.startswith(f"Invalid action. Reply with one of: {', '.join(env.action_names)}.")
    assert env.game.s == state and obs.splitlines()[2:] == obs0.splitlines()[1:]  # nothing moved
    assert "Step 1/" in obs  # the step is consumed
    assert info["action_valid"] is False and info["invalid_actions"] == 1 and info["action_index"] is None
    assert reward == info["reward_components"]["format"] == env.invalid_penalty < 0
    assert not terminated and not truncated
    env.step(action)
    assert env.step(0)[4]["invalid_actions"] == 2


def test_invalid_penalties_and_their_rule_at_the_time_limit():
    assert [c().invalid_penalty for c in TOY_TEXT] == [-0.1, -10.0, -1.0]
    env = TaxiTextEnv(max_steps=2, invalid_penalty=-3.0)
    env.reset(seed=0)
    *_, (_, reward, terminated, truncated, info) = play(env, ["honk", "honk"])
    assert truncated and not terminated and info["termination"] == "truncated" and reward == -3.0


@pytest.mark.parametrize("env_class, kwargs", [(FrozenLakeTextEnv, {"is_slippery": True}),
                                               (TaxiTextEnv, {"is_rainy": True}),
                                               (CliffWalkingTextEnv, {"is_slippery": True})])
def test_same_seed_same_trajectory_and_components_sum(env_class, kwargs):
    def rollout(seed):
        env = env_class(**kwargs)
        obs, _ = env.reset(seed=seed)
        rng, trace = random.Random(1), [obs]
        for _ in range(60):
            result = env.step(rng.choice(env.action_names + ["noise"]))
            check_step_contract(env, result)
            trace.append(result[:4])
            if result[2] or result[3]:
                break
        return trace

    assert rollout(3) == rollout(3)
    assert any(rollout(seed) != rollout(3) for seed in (4, 5, 6))  # the seed drives the randomness


@pytest.mark.parametrize("env_class, kwargs", [(FrozenLakeTextEnv, {"is_slippery": True, "max_steps": 500}),
                                               (TaxiTextEnv, {"is_rainy": True})])
def test_snapshot_restore_branches_independently(env_class, kwargs):
    env = env_class(**kwargs)
    env.reset(seed=2)
    play(env, [0, 1])
    snap = env.snapshot()
    state = env.game.s

    def branch(target, actions):
        target.restore(snap)
        return [result[:4] for result in play(target, actions)]

    actions = [1, 2, 1, 2, 2, 1, 0, 3] * 3
    first = branch(env, actions)
    assert branch(env, actions) == first  # the simulator's random stream is restored too
    assert len(first) > 3 and snap["s"] == state and snap["episode"].steps == 2  # stepping never changed it
    assert branch(env, [3] * 24) != first  # another branch from the same state goes its own way
    other = env_class(**kwargs)
    other.reset(seed=99)
    assert branch(other, actions) == first  # a snapshot carries everything: it replays in another env
    assert env.optimal_action(snap) == other.optimal_action(snap)


@pytest.mark.parametrize("env_class", TOY_TEXT)
def test_gymnasium_env_checker_and_prompts(env_class):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(env_class(render_mode="ansi"), skip_render_check=False)
    env = env_class()
    assert env.action_space.n == len(env.action_names)
    assert f"At most {env.max_steps} steps" in env.system_prompt
    assert all(name in env.system_prompt for name in env.action_names)
    with pytest.raises(RuntimeError):
        env.step(0)  # before reset
    with pytest.raises(ValueError):
        env_class(render_mode="human")
    with pytest.raises(ValueError):
        env_class(max_steps=0)


# -- BabyAI (minigrid) -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def babyai():
    pytest.importorskip("minigrid", reason="BabyAI needs minigrid: pip install minigrid==3.2.0")
    from envs import external
    return external


def test_babyai_level_ids(babyai):
    assert babyai.babyai_gym_id("goto") == "BabyAI-GoTo-v0"
    assert babyai.babyai_gym_id("gotolocal") == "BabyAI-GoToLocal-v0"
    assert babyai.babyai_gym_id("PickupLoc") == "BabyAI-PickupLoc-v0"
    assert babyai.babyai_gym_id("babyai-GoToObjS6") == "BabyAI-GoToObjS6-v1"
    assert all(babyai.babyai_gym_id(level) for level in babyai.BABYAI_LEVELS)
    with pytest.raises(ValueError, match="unknown BabyAI level"):
        babyai.babyai_gym_id("gotomars")


def test_describe_view_directions(babyai):
    from minigrid.core.constants import COLOR_TO_IDX, OBJECT_TO_IDX, STATE_TO_IDX

    image = np.zeros((7, 7, 3), dtype=np.uint8)  # all unseen; the agent is at (3, 6) facing decreasing j
    image[3, 1:6] = OBJECT_TO_IDX["empty"]
    image[3, 0] = OBJECT_TO_IDX["wall"]  # 6 steps forward
    image[0:3, 6] = OBJECT_TO_IDX["empty"]
    image[2, 6] = (OBJECT_TO_IDX["ball"], COLOR_TO_IDX["red"], 0)  # 1 step left: hides the wall behind
    image[0, 6] = OBJECT_TO_IDX["wall"]
    image[4, 6] = OBJECT_TO_IDX["wall"]  # 1 step right
    image[5, 4] = (OBJECT_TO_IDX["door"], COLOR_TO_IDX["blue"], STATE_TO_IDX["locked"])
    assert babyai.describe_view(image) == [
        "a red ball 1 step left", "a locked blue door 2 steps forward and 2 steps right",
        "a wall 6 steps forward", "a wall 1 step right"]


def test_babyai_reset_renders_mission_and_view(babyai):
    env = babyai.BabyAITextEnv("gotolocal")
    obs, info = env.reset(seed=0)
    assert obs.splitlines()[0] == "Step 0/64. Mission: go to the green ball."
    assert obs.splitlines()[1].startswith("You see a yellow key 1 step forward and 1 step left; ")
    assert "a green ball 3 steps forward" in obs and obs.endswith("a wall 2 steps left.")
    assert info["env_version"] == f"babyai-1.0+minigrid-{sys.modules['minigrid'].__version__}" and info["task_id"].startswith("BabyAI-GoToLocal-v0/")
    assert env.action_names == ["turn left", "turn right", "go forward", "pick up", "drop", "toggle"]
    again, info_again = babyai.BabyAITextEnv("gotolocal").reset(seed=0)
    assert (again, info_again) == (obs, info)
    assert babyai.BabyAITextEnv("gotolocal").reset(seed=1)[1]["task_id"] != info["task_id"]


def test_babyai_actions_step_and_report(babyai):
    env = babyai.BabyAITextEnv("gotolocal")
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("I turn left")
    check_step_contract(env, (obs, reward, terminated, truncated, info))
    assert info["action_index"] == 0 and "a green ball 3 steps right" in obs
    play(env, ["go forward"])
    obs, reward, *_, info = env.step(2)  # a wall is one step forward now
    assert obs.startswith("Nothing happened.\nStep 3/64.") and reward == 0.0
    obs, reward, terminated, truncated, info = env.step("fly")
    assert obs.startswith("Invalid action. Reply with one of: turn left, turn right, go forward, pick up, drop, toggle.")
    assert "Step 4/64." in obs and reward == -0.1 == info["reward_components"]["format"]
    assert info["invalid_actions"] == 1 and not terminated and not truncated


def test_babyai_bot_succeeds_through_the_adapter(babyai):
    from minigrid.utils.baby_ai_bot import BabyAIBot

    for level, seed in [("gotolocal", 0), ("pickuploc", 2), ("putnextlocal", 3)]:
        env = babyai.BabyAITextEnv(level)
        env.reset(seed=seed)
        bot, total = BabyAIBot(env.game), 0.0
        while True:
            result = env.step(int(bot.replan()))
            check_step_contract(env, result)
            total += result[1]
            if result[2] or result[3]:
                break
        info = result[4]
        assert info["termination"] == "success" and total > 0.9
        assert info["reward_components"]["task"] == pytest.approx(1 - 0.9 * env.game.step_count / env.game.max_steps)


def test_babyai_truncation_counts_invalid_turns(babyai):
    env = babyai.BabyAITextEnv("gotolocal", max_steps=3)
    obs, _ = env.reset(seed=0)
    assert "Step 0/3." in obs
    *_, (obs, reward, terminated, truncated, info) = play(env, ["turn left", "???", "turn left"])
    assert truncated and not terminated and info["termination"] == "truncated" and info["invalid_actions"] == 1


def test_babyai_snapshot_restore(babyai):
    env = babyai.BabyAITextEnv("gotolocal")
    env.reset(seed=0)
    env.step("turn left")
    snap = env.snapshot()
    forward = [env.step("go forward")[0] for _ in range(2)]
    env.restore(snap)
    assert [env.step("go forward")[0] for _ in range(2)] == forward
    env.restore(snap)
    assert env.step("turn right")[0] != forward[0]
    assert snap["game"].step_count == 1  # the snapshot never moved
    other = babyai.BabyAITextEnv("gotolocal")
    other.reset(seed=5)
    other.restore(snap)
    assert other.step("go forward")[0] == forward[0]


def test_babyai_env_checker(babyai):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(babyai.BabyAITextEnv(render_mode="ansi"), skip_render_check=False)


def _shortest_path_step(env):
    """The action (turn / forward / toggle) whose step raises the shaping potential by exactly w, found by trying each."""
    snap = env.snapshot()
    for action in (0, 1, 2, 5):
        env.restore(snap)
        before = env.potential()
        result = env.step(action)
        if result[4]["reward_components"]["progress"] == pytest.approx(env.shaping) and env.potential() > before:
            env.restore(snap)
            return action
    raise AssertionError("no action brings the agent one step closer: babyai_goto_distance is inconsistent")


@pytest.mark.parametrize("level, seeds", [("gotoredball", range(8)), ("gotolocal", range(4))])
def test_babyai_shaping_pays_w_per_step_along_a_shortest_path_and_changes_no_outcome(babyai, level, seeds):
    from minigrid.utils.baby_ai_bot import BabyAIBot

    for seed in seeds:
        env, plain = babyai.BabyAITextEnv(level, shaping=0.1), babyai.BabyAITextEnv(level)
        env.reset(seed=seed)
        distance = babyai.babyai_goto_distance(env.game)
        assert distance is not None and env.potential() == pytest.approx(-0.1 * distance)
        bot_env = babyai.BabyAITextEnv(level)  # minigrid's own planner never beats the shortest path
        bot_env.reset(seed=seed)
        bot, bot_steps = BabyAIBot(bot_env.game), 0
        while not any(bot_env.step(int(bot.replan()))[2:4]):
            bot_steps += 1
        assert bot_steps + 1 >= distance
        plain.reset(seed=seed)
        shaped_total = plain_total = 0.0
        for step in range(distance):  # greedy descent of the distance: every step earns exactly +w
            action = _shortest_path_step(env)
            obs, reward, terminated, _, info = env.step(action)
            plain_obs, plain_reward, *_, plain_info = plain.step(action)
            assert info["reward_components"]["progress"] == pytest.approx(0.1)
            assert obs == plain_obs and terminated == (step == distance - 1)  # the text and the ending are unchanged
            shaped_total, plain_total = shaped_total + reward, plain_total + plain_reward
        assert info["termination"] == plain_info["termination"] == "success" and env.potential() == 0.0
        assert shaped_total == pytest.approx(plain_total + 0.1 * distance)  # telescopes to Φ(s_T) - Φ(s_0)


def test_babyai_shaping_telescopes_on_random_play_and_is_refused_off_the_goto_levels(babyai):
    rng = random.Random(0)
    for seed in range(6):
        env, plain = babyai.BabyAITextEnv("gotolocal", max_steps=20, shaping=0.1), babyai.BabyAITextEnv("gotolocal", max_steps=20)
        env.reset(seed=seed), plain.reset(seed=seed)
        start, progress = env.potential(), 0.0
        while True:
            action = rng.choice(["turn left", "turn right", "go forward", "go forward", "pick up", "toggle", "??"])
            *_, terminated, truncated, info = env.step(action)
            *_, plain_terminated, plain_truncated, plain_info = plain.step(action)
            progress += info["reward_components"]["progress"]
            assert info["reward_components"]["task"] == plain_info["reward_components"]["task"]
            assert (terminated, truncated) == (plain_terminated, plain_truncated)
            if terminated or truncated:
                break
        assert progress == pytest.approx(env.potential() - start)
    assert babyai.BabyAITextEnv("gotolocal").potential() == 0.0  # off by default
    with pytest.raises(ValueError, match="GoTo levels only"):
        babyai.BabyAITextEnv("pickuploc", shaping=0.1)
    with pytest.raises(ValueError, match="shaping must be"):
        babyai.BabyAITextEnv("gotolocal", shaping=-0.1)
