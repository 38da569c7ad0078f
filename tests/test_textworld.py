"""The optional TextWorld environment: its install hint when absent; when present, a generated game played
through the adapter (walkthrough reaches the quest's reward, invalid commands, snapshots, splits)."""

import importlib.util
import sys

import pytest
import torch

import envs
from envs.textworld_games import GameSpec, clean_feedback


def test_missing_textworld_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "textworld", None)  # what `import textworld` sees when it is not installed
    with pytest.raises(ValueError, match=r"pip install -r requirements-textworld.txt"):
        envs.make("textworld")


def test_feedback_loses_prompt_status_bar_and_end_menu():
    raw = ("\nYou drop the glove.\n\nYour score has just gone up by one point.\n\n   *** The End ***\n\n"
           "Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command?\n>  -= Cellar =-1/1")
    assert clean_feedback(raw) == "You drop the glove.\n\nYour score has just gone up by one point."


needs_textworld = pytest.mark.skipif(importlib.util.find_spec("textworld") is None,
                                     reason="optional: pip install -r requirements-textworld.txt")
SMALL = dict(num_games=2, world_size=2, nb_objects=3, quest_length=2, max_steps=12)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("textworld_games")


def make(cache, **kwargs):
    return envs.make("textworld", cache_dir=cache, **{**SMALL, **kwargs})


@needs_textworld
def test_walkthrough_completes_the_quest_with_reward_one(cache):
    env = make(cache)
    obs, info = env.reset(seed=0)
    assert "Commands:" in obs and info["admissible_commands"] and info["task_id"] == "tw-w2-o3-q2-s0"
    total, done, steps = 0.0, False, 0
    while not done:
        action = env.optimal_action()
        assert action in info["admissible_commands"]
        obs, reward, terminated, truncated, info = env.step(f"I will {action.upper()} now.")  # found inside text
        assert info["action_valid"] and sum(info["reward_components"].values()) == pytest.approx(reward)
        total, done, steps = total + reward, terminated or truncated, steps + 1
    assert info["termination"] == "success" and total == pytest.approx(1.0)
    assert steps == SMALL["quest_length"] and "The End" not in obs and env.optimal_action() is None


@needs_textworld
def test_invalid_command_is_counted_and_leaves_the_game_unchanged(cache):
    env = make(cache)
    obs, _ = env.reset(seed=1)
    before = env.snapshot()
    obs, reward, terminated, truncated, info = env.step("dance wildly")
    assert not info["action_valid"] and info["invalid_actions"] == 1 and reward == pytest.approx(-0.1)
    assert info["reward_components"]["format"] == pytest.approx(-0.1) and not (terminated or truncated)
    assert env.snapshot()["episode"].commands == before["episode"].commands == ()
    assert "not one of the commands" in obs


@needs_textworld
def test_truncation_after_max_steps(cache):
    env = make(cache, max_steps=3)
    env.reset(seed=0)
    results = [env.step("look") for _ in range(3)]
    assert [r[3] for r in results] == [False, False, True] and results[-1][4]["termination"] == "truncated"
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look")


@needs_textworld
def test_snapshot_restore_replays_to_the_same_state(cache):
    env = make(cache)
    env.reset(seed=0)
    env.step(env.optimal_action())
    snap = env.snapshot()
    obs_next = env.step("look")[0]
    env.step(env.optimal_action())
    env.restore(snap)
    assert env.step("look")[0] == obs_next


@needs_textworld
def test_same_seed_same_game_and_splits_are_disjoint(cache):
    a, b = make(cache), make(cache)
    assert a.reset(seed=3)[0] == b.reset(seed=3)[0]  # seed 3 % 2 games -> game 1
    assert a.reset(seed=3)[1]["task_id"] == a.reset(seed=1)[1]["task_id"] == "tw-w2-o3-q2-s1"
    train = {make(cache).game_spec(s).seed for s in range(10)}
    test = {make(cache, split="test").game_spec(s).seed for s in range(10)}
    assert train.isdisjoint(test)
    assert GameSpec(2, 3, 2, 1).name == "tw-w2-o3-q2-s1"


@needs_textworld
def test_rollout_engine_plays_textworld(cache, tiny):
    from common.rollout import RolloutConfig, RolloutEngine

    model, tok = tiny
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode="free", max_turn_tokens=8))
    trajs = engine.run([make(cache, max_steps=3) for _ in range(2)], [0, 1], "textworld",
                       generator=torch.Generator().manual_seed(0))
    for traj in trajs:
        traj.validate()
        assert traj.termination in ("truncated", "success", "failure") and len(traj.turns) <= 3
