"""common/offline.py: collector qualities behave, datasets round-trip with their meta file, transitions
bootstrap at truncation only, and seed 003's demonstration filter sees through step counters."""

import json
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

import envs
from common.offline import (
    QUALITIES,
    TERMINAL,
    collect,
    episode_seed,
    filter_demonstrations,
    from_agent_records,
    load_dataset,
    place_key,
    state_key,
    transitions,
    write_dataset,
)
from common.records import Trajectory, TrajectoryBuffer, Turn

ROOT = Path(__file__).resolve().parents[1]


def test_expert_reaches_the_optimal_return_on_gridworld_and_procedural_layouts():
    env = envs.make("gridworld")
    env.reset(seed=0)
    best, steps = env.optimal_return(), env.optimal_steps()
    for traj in collect("gridworld", "expert", 3, seed=0):
        assert traj.success and traj.num_steps == steps == 11
        assert traj.return_ == pytest.approx(best) and best == pytest.approx(2 * 1.0 + 3.0 - 0.05 * 11)  # 2 resources, the goal, 11 steps
    for traj in collect("gridworld-procedural", "expert", 6, seed=2):
        env = envs.make("gridworld-procedural")
        env.reset(seed=traj.seed)  # each episode's own layout and its own optimum
        assert traj.success and traj.return_ == pytest.approx(env.optimal_return())


@pytest.mark.parametrize("env_id", ["frozenlake", "taxi"])
def test_expert_solves_the_external_adapters(env_id):
    trajs = collect(env_id, "expert", 4, seed=0)
    assert all(t.success for t in trajs)
    env = envs.make(env_id)
    for t in trajs:
        env.reset(seed=t.seed)
        assert t.return_ == pytest.approx(env.optimal_return())


def _disagreement_with_expert(traj, env_id="gridworld"):
    """Replay the episode; count steps whose action differs from the planner's choice in that state."""
    env = envs.make(env_id)
    env.reset(seed=traj.seed)
    differ = 0
    for a in traj.extra["actions"]:
        differ += a != env.optimal_action()
        env.step(a)
    return differ, len(traj.extra["actions"])


def test_noisy_is_uniformly_random_and_suboptimal_mixes():
    noisy = collect("gridworld", "noisy", 100, seed=0)
    counts = np.bincount([a for t in noisy for a in t.extra["actions"]], minlength=4)
    assert counts.sum() > 1500 and np.all(np.abs(counts / counts.sum() - 0.25) < 0.03)
    assert np.mean([t.success for t in noisy]) < 0.1  # random play rarely reaches G on seed 003's layout
    sub = collect("gridworld", "suboptimal", 100, seed=0, epsilon=0.4)
    rate = np.mean([t.success for t in sub])
    assert 0.5 < rate < 0.9  # successes and failures mixed (~70% at epsilon 0.4, like seed 003's annotators)
    assert np.mean([t.return_ for t in noisy]) < np.mean([t.return_ for t in sub]) < 4.45
    # a random action is one of 4, so it differs from the expert's with probability 3/4: rate ~ 0.75 * epsilon
    differ, steps = map(sum, zip(*(_disagreement_with_expert(t) for t in sub[:50])))
    assert differ / steps == pytest.approx(0.75 * 0.4, abs=0.04)
    expert_differ = sum(_disagreement_with_expert(t)[0] for t in collect("gridworld", "suboptimal", 5, 0, epsilon=0.0))
    assert expert_differ == 0


def test_records_seeds_and_reproducibility():
    a = collect("gridworld", "suboptimal", 5, seed=3)
    b = collect("gridworld", "suboptimal", 3, seed=3)
    assert [t.seed for t in a] == [episode_seed(3, i) for i in range(5)] == [3 * 1_000_003 + i for i in range(5)]
    # episode i depends on (seed, i) only: the first three are the same however many were collected
    assert [t.to_dict() for t in a[:3]] == [t.to_dict() for t in b]
    assert [t.extra["actions"] for t in collect("gridworld", "suboptimal", 5, seed=4)] != [t.extra["actions"] for t in a]
    env = envs.make("gridworld")
    for t in a:
        assert set(t.extra) == {"system_prompt", "initial_observation", "actions", "quality"}
        assert t.extra["system_prompt"] == env.system_prompt and t.extra["quality"] == "suboptimal"
        assert [u.action_text for u in t.turns] == [env.action_names[i] for i in t.extra["actions"]]
        assert t.token_ids == t.source_mask == t.behavior_logprobs == [] and t.env_id == "gridworld"
        assert t.return_ == pytest.approx(sum(u.reward for u in t.turns))


def test_transitions_done_on_termination_and_shown_time_limits_and_chain_observations():
    trajs = collect("gridworld", "noisy", 30, seed=0) + collect("frozenlake", "noisy", 10, seed=0)
    kinds = {t.termination for t in trajs}
    assert {"truncated", "success", "failure"} <= kinds  # gridworld times out; frozenlake falls in holes
    for traj in trajs:
        ts = transitions(traj)
        assert len(ts) == traj.num_steps
        assert ts[0].observation == traj.extra["initial_observation"] and ts[0].history == []
        for prev, cur in pairwise(ts):
            assert cur.observation == prev.next_observation and not prev.done
            assert cur.history == prev.history + [prev.observation, prev.action_name]
        # terminated (success / failure) ends the MDP; so does a time limit the last observation shows
        shown = traj.termination == "truncated" and f"Step {traj.num_steps}/{traj.num_steps}." in traj.turns[-1].observation
        assert ts[-1].done == (traj.termination in TERMINAL or shown)
        assert traj.termination != "truncated" or shown  # both environments print their step counter
        assert sum(t.reward for t in ts) == pytest.approx(traj.return_)


def test_write_and_load_dataset_with_meta(tmp_path):
    trajs = collect("gridworld", "suboptimal", 12, seed=1, epsilon=0.4)
    path = tmp_path / "d" / "gw.jsonl"
    write_dataset(path, trajs, {"env_id": "gridworld", "env_kwargs": {}, "quality": "suboptimal", "epsilon": 0.4,
                                "seed": 1})
    back, meta = load_dataset(path)
    assert [t.to_dict() for t in back] == [t.to_dict() for t in trajs]
    assert meta["episodes"] == 12 and meta["num_steps"] == sum(t.num_steps for t in trajs)
    assert meta["success_rate"] == pytest.approx(np.mean([t.success for t in trajs]))
    assert meta["mean_return"] == pytest.approx(np.mean([t.return_ for t in trajs]))
    assert meta["quality"] == "suboptimal" and meta["epsilon"] == 0.4 and meta["seed"] == 1
    assert "created_by" in meta and "git_commit" in meta and sum(meta["terminations"].values()) == 12
    (tmp_path / "bare.jsonl").write_text(path.read_text())
    assert load_dataset(tmp_path / "bare.jsonl")[1] == {}  # no meta file: still loads


def test_bad_requests_raise_clear_errors():
    with pytest.raises(ValueError, match="quality"):
        collect("gridworld", "great", 1, 0)
    with pytest.raises(ValueError, match="epsilon"):
        collect("gridworld", "suboptimal", 1, 0, epsilon=1.5)
    with pytest.raises(ValueError, match="action_names"):
        collect("arithmetic", "noisy", 1, 0)
    assert set(QUALITIES) == {"expert", "suboptimal", "noisy", "llm"}


def _traj(observations, termination):
    turns = [Turn(action_text="up", observation=o, reward=0.0, action_valid=True, num_action_tokens=0)
             for o in observations]
    return Trajectory([], [], [], 0, turns, {}, 0.0, termination, "", "", 0)


def test_demonstration_filter_ignores_step_counters():
    clean = _traj([f"Step {i}/20. at {i}" for i in range(1, 6)], "success")
    # 6 steps, only 3 distinct places: unique 3 < 0.6 * 6 -> hesitant; the step counter hides it from the raw filter
    hesitant = _traj([f"Step {i}/20. at {p}" for i, p in enumerate([1, 2, 1, 2, 1, 3], 1)], "success")
    long = _traj([f"Step {i}/20. at {i}" for i in range(1, 11)], "success")
    failed = _traj([f"Step {i}/20. at {i}" for i in range(1, 4)], "truncated")
    assert state_key("You moved up.\nStep 3/20. Resources 0/2.") == "You moved up.\nResources 0/2."
    assert place_key("You moved up.\nStep 3/20. Resources 0/2.") == "Resources 0/2." == place_key("Step 1/20. Resources 0/2.")
    assert place_key("no counter here") == "no counter here"
    kept = filter_demonstrations([clean, hesitant, long, failed], max_steps=8)
    assert kept == [clean]
    assert filter_demonstrations([clean, hesitant, long, failed]) == [clean, long]
    raw = TrajectoryBuffer()
    raw.extend([clean, hesitant])
    assert raw.filter_demonstrations() == [clean, hesitant]  # why the state key is needed


def test_llm_quality_logs_choice_mode_episodes(tiny):
    trajs = collect("gridworld", "llm", 3, seed=0, model=tiny, temperature=1.0, batch_size=2)
    env = envs.make("gridworld")
    for t in trajs:
        assert t.extra["quality"] == "llm" and t.token_ids and len(t.choice_steps) == t.num_steps
        assert t.extra["actions"] == [c.chosen for c in t.choice_steps]
        obs, _ = env.reset(seed=t.seed)
        assert obs == t.extra["initial_observation"]
        for a, turn in zip(t.extra["actions"], t.turns):  # the logged actions replay to the logged observations
            assert env.step(a)[0] == turn.observation
        assert len(transitions(t)) == t.num_steps
    again = from_agent_records(trajs, "gridworld")
    assert [t.extra for t in again] == [t.extra for t in trajs]


def test_collector_cli_writes_dataset_and_meta(tmp_path):
    out = tmp_path / "gw.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "collect_offline.py"), "--env-id", "gridworld",
                           "--quality", "expert", "--episodes", "4", "--seed", "0", "--output", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "4 episodes, 44 transitions | success 1.000 | mean return 4.450" in proc.stdout
    meta = json.loads((tmp_path / "gw.jsonl.meta.json").read_text())
    assert meta["quality"] == "expert" and meta["episodes"] == 4 and "collect_offline.py" in meta["created_by"]
    assert len(load_dataset(out)[0]) == 4
