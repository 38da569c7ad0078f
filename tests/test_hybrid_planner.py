"""hybrid_planner.py: the Double-DQN target by hand, the replanning triggers, the planners, and the controller
alone learning the seed-003 layout."""

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import envs
from common.tracking import read_scalars
from envs.subgoals import says, subgoal_interface

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("hybrid_planner", ROOT / "algorithms" / "hybrid_planner.py")
hp = importlib.util.module_from_spec(spec)
sys.modules["hybrid_planner"] = hp  # dataclasses look their module up by name
spec.loader.exec_module(hp)


class FixedQ(torch.nn.Module):
    """A controller that always prefers one action."""

    def __init__(self, action: int):
        super().__init__()
        self.action = action

    def forward(self, x):
        q = torch.zeros(x.shape[0], 5)  # GridWorld: four moves + the skill
        q[:, self.action] = 1.0
        return q


class StubPlanner:
    """Returns the same one-subgoal plan every time."""

    def __init__(self, subgoal):
        self.subgoal, self.plans, self.model_calls, self.cache_hits = subgoal, 0, 0, 0

    def plan(self, env):
        self.plans += 1
        return [self.subgoal]


def test_double_dqn_target_by_hand():
    rewards, dones = torch.tensor([1.0, 0.5]), torch.tensor([0.0, 1.0])
    q_online = torch.tensor([[1.0, 3.0, 0, 0, 0], [2.0, 0.0, 0, 0, 0]])
    q_target = torch.tensor([[10.0, 20.0, 0, 0, 0], [30.0, 40.0, 0, 0, 0]])
    mask = torch.ones(2, 5, dtype=torch.bool)
    y = hp.double_dqn_targets(rewards, dones, q_online, q_target, mask, gamma=0.9)
    # row 0: online argmax = 1, evaluated by the target net: 1 + 0.9 * 20; row 1 is terminal: 0.5
    assert y.tolist() == pytest.approx([19.0, 0.5])
    mask[0, 1] = False  # action 1 not allowed in s': the argmax falls back to action 0 (Q_target = 10)
    y = hp.double_dqn_targets(rewards, dones, q_online, q_target, mask, gamma=0.9)
    assert y.tolist() == pytest.approx([10.0, 0.5])
    assert hp.td_loss(torch.tensor([10.0, 1.5]), y).item() == pytest.approx((0 + 0.5) / 2)  # Huber: |d| - 0.5 beyond 1


def make_args(**kw):
    return hp.Args(**{"skills": False, **kw})


def test_a_violated_expectation_triggers_replanning_after_the_bound():
    env = envs.make("gridworld")
    # expected at (0, 7) within 2 steps; a controller that only moves up never gets there
    subgoal = hp.Subgoal("go to the goal at row 0, column 7", (0, 7), "reached the goal", expected_steps=2)
    result = hp.run_episode(env, 0, StubPlanner(subgoal), FixedQ(0), 0.0, make_args(replan_bound=3), random.Random(0))
    assert result["replans"] == [(0, "start"), (6, "mismatch"), (12, "mismatch"), (18, "mismatch")]
    result = hp.run_episode(env, 0, StubPlanner(subgoal), FixedQ(0), 0.0, make_args(replan_bound=0), random.Random(0))
    assert result["replans"][1] == (3, "mismatch")  # bound 0: the first step past the expected duration
    off = hp.run_episode(env, 0, StubPlanner(subgoal), FixedQ(0), 0.0, make_args(replan_on_mismatch=False),
                         random.Random(0))
    assert off["replans"] == [(0, "start")]
    periodic = hp.run_episode(env, 0, StubPlanner(subgoal), FixedQ(0), 0.0,
                              make_args(replan_on_mismatch=False, replan_every=5), random.Random(0))
    assert [s for s, _ in periodic["replans"]] == [0, 5, 10, 15]


def test_a_met_expectation_advances_the_plan_and_an_exhausted_plan_replans():
    env = envs.make("gridworld")  # start (2, 0); "up" leads to (1, 0)
    subgoal = hp.Subgoal("go up", (1, 0), "You moved up", expected_steps=1)
    result = hp.run_episode(env, 0, StubPlanner(subgoal), FixedQ(0), 0.0, make_args(), random.Random(0))
    assert result["replans"][:2] == [(0, "start"), (1, "exhausted")]
    none = hp.run_episode(env, 0, StubPlanner(subgoal), FixedQ(0), 0.0, make_args(replan_when_exhausted=False),
                          random.Random(0))
    assert none["replans"] == [(0, "start")]


def test_controller_reward_pays_the_subgoal_instead_of_the_goal():
    env = envs.make("gridworld")
    replay = hp.Replay(100, 161, 5)
    # subgoal (1, 0) is reached by "up": env reward -0.05, bonus +3, and the controller's episode ends there
    subgoal = hp.Subgoal("go up", (1, 0), "You moved up", expected_steps=1)
    hp.run_episode(env, 0, StubPlanner(subgoal), FixedQ(0), 0.0, make_args(subgoal_bonus=3.0), random.Random(0), replay)
    assert replay.rewards[0] == pytest.approx(-0.05 + 3.0) and replay.dones[0] == 1.0
    assert replay.obs[0][4 * 32 + 1 * 8 + 0] == 1.0  # the subgoal channel marks (1, 0)
    assert replay.dones[1] == 0.0  # the re-planned subgoal starts a new controller episode that goes on


def test_oracle_plan_follows_the_shortest_path():
    env = envs.make("gridworld")
    env.reset(seed=0)
    plan = hp.OraclePlanner(max_subgoals=3).plan(subgoal_interface(env))
    assert [s.expected for s in plan] == ["collected a resource", "collected a resource", "reached the goal"]
    assert sum(s.expected_steps for s in plan) == env.optimal_steps() == 11


def test_skill_is_offered_only_next_to_a_resource():
    env = envs.make("gridworld")
    env.reset(seed=0)
    domain = subgoal_interface(env)
    assert not domain.action_mask(skills=True)[4]
    for move in ("right", "right", "right"):  # (2, 3): the resource at (2, 4) is next to the agent
        env.step(move)
    assert domain.action_mask(skills=True)[4] and domain.adjacent_resource() == 3 == domain.env_action(4)
    assert not domain.action_mask(skills=False)[4]


def test_llm_planner_caches_its_choices(tiny):
    model, tok = tiny
    planner = hp.LLMPlanner(model, tok, torch.device("cpu"), max_subgoals=3)
    env = envs.make("gridworld")
    env.reset(seed=0)
    first = planner.plan(subgoal_interface(env))
    calls = planner.model_calls
    assert 1 <= len(first) <= 3 and calls == len(first)
    assert all(s.expected != "reached the goal" for s in first[:-1])  # a plan ends at its first goal
    again = planner.plan(subgoal_interface(env))
    assert [s.target for s in again] == [s.target for s in first] and planner.model_calls == calls
    assert planner.cache_hits == len(first) and planner.plans == 2


def test_controller_alone_learns_the_seed003_layout(tmp_path):
    cmd = [sys.executable, str(ROOT / "algorithms" / "hybrid_planner.py"), "--planner", "none", "--total-episodes", "300",
           "--eval-every", "0", "--eval-episodes", "5", "--output-dir", str(tmp_path), "--seed", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = next(tmp_path.iterdir())
    scalars = read_scalars(run)
    before, after = scalars["eval/success_rate"][0][1], scalars["eval/success_rate"][-1][1]
    ret_before, ret_after = scalars["eval/episodic_return"][0][1], scalars["eval/episodic_return"][-1][1]
    print(f"controller alone: success {before:.2f} -> {after:.2f}, return {ret_before:.2f} -> {ret_after:.2f}")
    assert before == 0.0 and after == 1.0 and ret_after >= 3.5


def test_a_resource_collected_on_the_way_is_skipped_not_chased():
    env = envs.make("gridworld")
    env.reset(seed=0)
    domain = subgoal_interface(env)
    first, second, goal = hp.OraclePlanner(max_subgoals=3).plan(domain)
    assert domain.next_subgoal([second, goal]) is second  # still on the map: kept
    path = {(2, 4): ["right"] * 4, (0, 2): ["up", "up", "right", "right"]}[second.target]  # around the first one
    for move in path:  # the plan's second resource, picked up before its first
        env.step(move)
    assert domain.resources() == 1 and first.target != second.target
    plan = [second, goal]
    assert domain.next_subgoal(plan) is goal and plan == []  # picked up early: skipped
    assert domain.next_subgoal([]) is None


def test_resume_after_a_crash_logs_the_same_numbers_as_an_uninterrupted_run(tmp_path):
    """A run killed (SIGKILL: a crash) after its checkpoint at episode k, resumed with --resume, logs every scalar
    of the uninterrupted run: Q-networks, replay buffer, Adam, RNGs, ε position and the half-filled logging window
    all come back. The checkpoint falls mid logging window (k = 10, --log-every 4) and between target-network
    copies; the crashed run's events after k are purged. Wall-clock tags (perf/*, *_ms*) are not compared."""
    import json
    import signal

    script, n, k = str(ROOT / "algorithms" / "hybrid_planner.py"), 30, 10
    flags = ["--planner", "oracle", "--total-episodes", str(n), "--learning-starts", "20", "--replay-batch-size", "16",
             "--log-every", "4", "--eval-every", "10", "--eval-episodes", "2", "--target-update-every", "25", "--seed", "3"]
    ref_out, crash_out = tmp_path / "reference", tmp_path / "crashed"
    popen = lambda *extra: subprocess.Popen([sys.executable, script, *flags, *extra], stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True)
    reference = popen("--output-dir", str(ref_out))  # both at once: the CI time is mostly start-up
    crashed = popen("--output-dir", str(crash_out), "--checkpoint-every", str(k))
    for line in crashed.stdout:
        if line.startswith("checkpoint saved") and line.rstrip().endswith(f"(episode {k})"):
            crashed.send_signal(signal.SIGKILL)
            break
    crashed.communicate(timeout=300)
    assert reference.wait(timeout=300) == 0, reference.stderr.read()[-3000:]
    run_dir = next(crash_out.iterdir())
    saved_at = json.loads((run_dir / "checkpoint.json").read_text())["iteration"]
    assert k <= saved_at < n, saved_at
    proc = subprocess.run([sys.executable, script, "--resume", str(run_dir), "--total-episodes", str(n)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {run_dir} at episode {saved_at}" in proc.stdout and "eval @ 0 " not in proc.stdout

    resumed, expected = read_scalars(run_dir), read_scalars(next(ref_out.iterdir()))
    wall_clock = lambda tag: tag.startswith("perf/") or "_ms" in tag or "seconds" in tag
    compared = sorted(t for t in expected if not wall_clock(t))
    assert set(resumed) == set(expected) and "losses/td_loss" in compared and "eval/success_rate" in compared
    for tag in compared:
        assert resumed[tag] == expected[tag], tag  # same steps, bit-identical values (CPU)
    assert expected["diagnostics/updates"][-1][1] > 25 * 4  # several target-network copies happened


def test_total_episodes_must_split_evenly_over_the_processes():
    hp.validate_args(make_args(total_episodes=12), world=2)
    with pytest.raises(SystemExit, match="--total-episodes 13 must be divisible by the 2 processes"):
        hp.validate_args(make_args(total_episodes=13), world=2)


def test_torchrun_two_ranks_play_distinct_episodes_and_stay_in_sync(tmp_path):
    """2 gloo ranks: rank r plays the global episodes r+1, r+3, ... (its own seeds) into its own replay buffer, the
    logged means cover both ranks' episodes, and the averaged DQN updates keep the online and target networks
    identical on both ranks. Greedy (ε = 0) and no update during the first 4 episodes, so those episodes (and the
    start-of-run evaluation, shared among the ranks) depend on the seeds alone: they must log exactly what one
    process logs for the same 4 episodes. Procedural layouts, so different seeds are different episodes."""
    script = str(ROOT / "algorithms" / "hybrid_planner.py")
    flags = ["--env-id", "gridworld-procedural", "--planner", "oracle", "--epsilon-start", "0", "--epsilon-end", "0",
             "--learning-starts", "80", "--replay-batch-size", "16", "--log-every", "4", "--eval-every", "0",
             "--eval-episodes", "4", "--target-update-every", "20"]
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir()
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                                 "29549", script, *flags, "--total-episodes", "16", "--output-dir", str(two)],
                                cwd=two, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    single = subprocess.run([sys.executable, script, *flags, "--total-episodes", "4", "--output-dir", str(one)],
                            capture_output=True, text=True, timeout=300)
    out, err = torchrun.communicate(timeout=300)
    assert torchrun.returncode == 0, out[-2000:] + err[-3000:]
    assert single.returncode == 0, single.stderr[-3000:]
    (run_dir,) = list(two.iterdir())  # rank 0 alone writes
    s, ref = read_scalars(run_dir), read_scalars(next(one.iterdir()))
    assert [k for k, _ in s["charts/episodic_return"]] == [4, 8, 12, 16]  # the x-axis counts both ranks' episodes
    assert out.count("episode 16/16") == 1 and "over 2 processes" in out  # rank 0 alone prints
    for tag in ref:
        if tag.startswith(("charts/", "eval/")) and "_ms_" not in tag:
            assert s[tag][0] == ref[tag][0], tag  # episodes 1-4 and the first evaluation: both ranks' share
    assert s["diagnostics/updates"][0][1] == 0 and s["diagnostics/updates"][-1][1] > 2 * 20  # target copies happened
    assert [v for _, v in s["diagnostics/rank_param_divergence"]] == [0.0] * 4


@pytest.mark.slow
def test_torchrun_resume_restores_every_ranks_replay_buffer(tmp_path):
    """2 ranks: a run stopped at episode 8 (its final checkpoint) and resumed to 16 logs exactly what an uninterrupted
    16-episode run logs, which needs both ranks' replay buffers, RNGs and logging windows back (constant ε, so the
    two runs' ε schedules agree)."""
    script = str(ROOT / "algorithms" / "hybrid_planner.py")
    flags = ["--planner", "oracle", "--epsilon-start", "0.3", "--epsilon-end", "0.3", "--learning-starts", "20",
             "--replay-batch-size", "16", "--log-every", "4", "--eval-every", "8", "--eval-episodes", "2",
             "--target-update-every", "25", "--checkpoint-every", "8"]
    torchrun = lambda port, *extra: subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                                    "--master_port", str(port), script, *extra],
                                                   capture_output=True, text=True, timeout=300, cwd=tmp_path)
    full = torchrun(29551, *flags, "--total-episodes", "16", "--output-dir", str(tmp_path / "full"))
    part = torchrun(29552, *flags, "--total-episodes", "8", "--output-dir", str(tmp_path / "part"))
    assert full.returncode == 0 and part.returncode == 0, full.stderr[-2000:] + part.stderr[-2000:]
    run_dir = next((tmp_path / "part").iterdir())
    resumed = torchrun(29553, "--resume", str(run_dir), "--total-episodes", "16")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at episode 8" in resumed.stdout
    got, expected = read_scalars(run_dir), read_scalars(next((tmp_path / "full").iterdir()))
    compared = [t for t in expected if not (t.startswith("perf/") or "_ms" in t)]
    assert set(got) == set(expected) and "losses/td_loss" in compared
    for tag in compared:
        assert got[tag] == expected[tag], tag


# ---- BabyAI through envs/subgoals.py: minigrid's BabyAIBot as the oracle planner ----
def drive_with_bot(env, until, limit=64):
    """Steps `env` with minigrid's BabyAIBot's own actions until `until(observation)` holds; returns that observation."""
    from minigrid.utils.baby_ai_bot import BabyAIBot

    bot, observation = BabyAIBot(env.game), None
    for _ in range(limit):
        observation, _, terminated, truncated, _ = env.step(int(bot.replan()))
        if until(observation) or terminated or truncated:
            return observation
    raise AssertionError("the bot did not get there")


def test_babyai_oracle_plan_is_the_bots_subgoal_stack_and_is_reached_by_following_the_bot():
    pytest.importorskip("minigrid")
    env = envs.make("babyai-pickuploc")
    env.reset(seed=1)
    domain = subgoal_interface(env)
    plan = hp.OraclePlanner(max_subgoals=3).plan(domain)
    go, pick, _ = plan
    assert go.target in {tuple(int(v) for v in p) for p in env.game.instrs.desc.obj_poss}  # an object the mission means
    target = env.game.grid.get(*go.target)
    mission_object = f"{target.color} {target.type}"
    # the bot's stack for "pick up X": go next to X, pick it up, (drop it: the bot's own habit)
    assert [s.description for s in plan] == [f"go to the {mission_object}", f"pick up the {mission_object}",
                                             "drop what you carry"]
    assert not domain.reached(go, domain.view()) and not domain.reached(pick, domain.view())
    observation = drive_with_bot(env, lambda obs: says(obs, f"a {mission_object} 1 step forward"))
    assert domain.reached(go, observation) and not domain.reached(pick, observation)
    assert domain.next_subgoal([go, pick]) is pick  # a subgoal already done is skipped
    seen = "You see a red ball 2 steps forward and 1 step left; a red ball 1 step forward."
    assert says(seen, "a red ball 1 step forward") and not says(seen, "a red ball 2 steps forward")
    observation = drive_with_bot(env, lambda obs: "You carry" in obs)
    assert domain.reached(pick, observation)


def test_babyai_features_mark_the_subgoal_cell_kind_and_mission():
    pytest.importorskip("minigrid")
    env = envs.make("babyai-gotolocal")
    env.reset(seed=0)
    domain = subgoal_interface(env)
    go = next(c for c in domain.candidates([]) if c.description == "go to the " + env.game.mission.removeprefix("go to the "))
    plain, marked = domain.features(None), domain.features(go)
    width, height = env.game.width, env.game.height
    grid_part = (len(domain.OBJECTS) + len(domain.COLORS) + 3 + 2) * width * height
    target_cell = grid_part - width * height + go.target[0] * height + go.target[1]  # the last grid channel
    kind = grid_part + 4 + len(domain.OBJECTS) + len(domain.COLORS)  # after direction and carrying: "go to"
    assert np.flatnonzero(plain[:kind + 4] != marked[:kind + 4]).tolist() == [target_cell, kind]
    # the target in the agent's frame, by hand: minigrid's dir_vec points ahead, right_vec to the right
    dx, dy = go.target[0] - env.game.agent_pos[0], go.target[1] - env.game.agent_pos[1]
    forward = dx * env.game.dir_vec[0] + dy * env.game.dir_vec[1]
    right = dx * env.game.right_vec[0] + dy * env.game.right_vec[1]
    ego = marked[kind + 4: kind + 14]
    assert ego[:2].tolist() == pytest.approx([forward / 8, right / 8]) and ego[2:7].tolist() == [
        forward > 0, forward < 0, right > 0, right < 0, (forward, right) == (1, 0)]
    assert not plain[kind + 4: kind + 11].any() and (plain[kind + 11: kind + 14] == ego[7:]).all()  # no target: zeros
    words = plain[-len(domain.MISSION_WORDS) - 1: -1]
    assert {w for w, on in zip(domain.MISSION_WORDS, words) if on} == {"go", *env.game.mission.split()[-2:]}
    assert domain.action_mask(skills=True).all() and len(domain.action_names) == 6


def test_babyai_llm_planner_chooses_among_the_rooms_objects(tiny):
    pytest.importorskip("minigrid")
    env = envs.make("babyai-gotolocal")
    env.reset(seed=0)
    domain = subgoal_interface(env)
    planner = hp.LLMPlanner(*tiny, torch.device("cpu"), max_subgoals=2)
    plan = planner.plan(domain)
    names = {c.description for c in domain.candidates([])}
    assert len(plan) == 2 and plan[0].description in names and plan[1].description != plan[0].description
    assert "Mission: go to the" in domain.planner_observation() and "step" not in domain.planner_observation()
    env.step("turn left")  # the view changes, the room does not: the same prompt, answered from the cache
    assert [s.description for s in planner.plan(domain)] == [s.description for s in plan] and planner.cache_hits == 2


def test_hybrid_runs_on_babyai_and_rejects_environments_without_subgoals(tmp_path):
    pytest.importorskip("minigrid")
    script = str(ROOT / "algorithms" / "hybrid_planner.py")
    proc = subprocess.run([sys.executable, script, "--env-id", "babyai-gotolocal", "--planner", "oracle", "--total-episodes",
                           "4", "--learning-starts", "8", "--replay-batch-size", "8", "--log-every", "2", "--eval-every",
                           "0", "--eval-episodes", "2", "--output-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scalars = read_scalars(next(tmp_path.iterdir()))
    assert scalars["charts/llm_calls_per_episode"][0][1] >= 1 and scalars["diagnostics/updates"][-1][1] > 0
    bad = subprocess.run([sys.executable, script, "--env-id", "frozenlake", "--output-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no subgoal interface for FrozenLakeTextEnv" in bad.stderr
    assert "Traceback" not in bad.stderr
