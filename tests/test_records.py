"""Tests for common/records.py: the trajectory record contract and the trajectory buffer."""
import json

import numpy as np
import pytest

from common.records import (
    ChoiceStep,
    Trajectory,
    TrajectoryBuffer,
    Turn,
    read_jsonl,
    write_jsonl,
)


def make_traj(actions=("go north",), observations=None, termination="success", return_=1.0,
              task_id="t0", extra=None, seed=0) -> Trajectory:
    """A valid free-mode record: 3 prompt tokens, then per turn 2 action + 1 observation tokens."""
    observations = list(observations or [f"obs {i}" for i in range(len(actions))])
    token_ids, mask, logprobs, turns = [1, 2, 3], [0, 0, 0], [0.0, 0.0, 0.0], []
    for i, (a, o) in enumerate(zip(actions, observations)):
        token_ids += [100 + i, 200 + i, 300 + i]
        mask += [1, 1, 0]
        logprobs += [-0.5, -1.25, 0.0]
        turns.append(Turn(a, o, reward=0.1 * i, action_valid=(a != "bad"), num_action_tokens=2))
    return Trajectory(token_ids=token_ids, source_mask=mask, behavior_logprobs=logprobs,
                      policy_version=3, turns=turns, rewards={"task": return_},
                      return_=return_, termination=termination, env_version="v1",
                      task_id=task_id, seed=seed, prompt_length=3, extra=dict(extra or {}))


def make_choice_traj() -> Trajectory:
    # prompt [5, 6], chosen action "east" = [41, 42] at position 2, observation [7]
    return Trajectory(
        token_ids=[5, 6, 41, 42, 7], source_mask=[0, 0, 1, 1, 0],
        behavior_logprobs=[0.0, 0.0, -0.1, -0.2, 0.0], policy_version=7,
        turns=[Turn("east", "you see a wall", -0.01, True, 2, decode_s=0.012, env_s=0.003,
                    truncated_tokens=True)],
        rewards={"format": 0.0, "cost": -0.01}, return_=-0.01, termination="truncated",
        env_version="grid-2", task_id="maze-17", seed=123456789, env_id="GridWorld-v0",
        prompt_length=2,
        choice_steps=[ChoiceStep(position=2, candidates=[[40], [41, 42], [43, 44, 45]], chosen=1,
                                 logprob=-0.6931471805599453, legal=[1, 2])],
        extra={"goal": "reach the exit", "nested": {"a": [1, 2]}, "名": "中文"})


def test_jsonl_round_trip_preserves_every_field(tmp_path):
    trajs = [make_choice_traj(), make_traj(actions=("a", "b"), return_=0.1 + 0.2)]
    path = tmp_path / "sub" / "trajs.jsonl"
    write_jsonl(path, trajs)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2  # one record per line, no header
    raw = json.loads(lines[0])
    assert "return" in raw and "return_" not in raw
    assert raw["return"] == -0.01
    assert raw["choice_steps"][0]["candidates"] == [[40], [41, 42], [43, 44, 45]]
    assert raw["choice_steps"][0]["legal"] == [1, 2]
    back = read_jsonl(path)
    assert back == trajs  # dataclass equality: every field, exact floats
    assert back[1].return_ == 0.1 + 0.2
    assert isinstance(back[0].turns[0], Turn) and isinstance(back[0].choice_steps[0], ChoiceStep)
    # append mode adds records instead of overwriting
    write_jsonl(path, [make_traj(task_id="t9")], append=True)
    assert [t.task_id for t in read_jsonl(path)] == ["maze-17", "t0", "t9"]


def test_numpy_values_serialise_as_plain_numbers(tmp_path):
    traj = make_traj()
    traj.rewards["task"] = np.float32(0.5)
    traj.extra["vec"] = np.arange(3)
    write_jsonl(tmp_path / "x.jsonl", [traj])
    back = read_jsonl(tmp_path / "x.jsonl")[0]
    assert back.rewards["task"] == 0.5 and back.extra["vec"] == [0, 1, 2]


def test_read_jsonl_reports_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps(make_traj().to_dict())
    path.write_text(good + "\n\n" + good + "\n{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:4"):
        read_jsonl(path)
    missing_return = make_traj().to_dict()
    del missing_return["return"]
    path.write_text(good + "\n" + json.dumps(missing_return) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r":2:"):
        read_jsonl(path)


def test_derived_properties():
    traj = make_traj(actions=("a", "bad", "c"), termination="failure")
    assert not traj.success and traj.num_steps == 3 and traj.num_policy_tokens == 6
    assert traj.invalid_actions == 1
    assert traj.policy_token_spans() == [(3, 5), (6, 8), (9, 11)]
    assert make_choice_traj().policy_token_spans() == [(2, 4)]


@pytest.mark.parametrize("corrupt, message", [
    (lambda t: t.source_mask.pop(), "length mismatch"),
    (lambda t: t.behavior_logprobs.append(0.0), "length mismatch"),
    (lambda t: t.behavior_logprobs.__setitem__(0, -0.3), "source_mask"),
    (lambda t: t.source_mask.__setitem__(0, 2), "expected 0 or 1"),
    (lambda t: setattr(t, "termination", "done"), "termination"),
    (lambda t: setattr(t, "prompt_length", 3), "prompt_length"),
    (lambda t: setattr(t.choice_steps[0], "position", 4), "outside token_ids"),
    (lambda t: setattr(t.choice_steps[0], "position", 1), "differ"),
    (lambda t: setattr(t.choice_steps[0], "chosen", 3), "out of range"),
    (lambda t: setattr(t.choice_steps[0], "legal", [0, 2]), "not among the legal"),  # masked out, yet chosen
    (lambda t: setattr(t.choice_steps[0], "legal", [1, 3]), "not among the legal"),  # no candidate 3
    (lambda t: t.source_mask.__setitem__(3, 0) or t.behavior_logprobs.__setitem__(3, 0.0),
     "not all marked"),
])
def test_validate_catches_broken_records(corrupt, message):
    traj = make_choice_traj()
    traj.validate()  # valid before corruption
    corrupt(traj)
    with pytest.raises(ValueError, match=message):
        traj.validate()


def test_write_jsonl_refuses_invalid_records(tmp_path):
    bad = make_traj(termination="won")
    with pytest.raises(ValueError, match="termination"):
        write_jsonl(tmp_path / "x.jsonl", [bad])


def test_successful_and_rank_by_efficiency():
    buf = TrajectoryBuffer()
    buf.extend([
        make_traj(actions=("a",) * 4, return_=1.0, task_id="long"),
        make_traj(actions=("a",), termination="failure", task_id="fail-short"),
        make_traj(actions=("a",) * 2, return_=0.5, task_id="short-low"),
        make_traj(actions=("a",) * 2, return_=0.9, task_id="short-high"),
        make_traj(actions=("a",) * 3, termination="truncated", task_id="trunc"),
        make_traj(actions=("a",) * 3, return_=0.7, task_id="mid"),
    ])
    assert [t.task_id for t in buf.successful()] == ["long", "short-low", "short-high", "mid"]
    assert [t.task_id for t in buf.rank_by_efficiency()] == [
        "short-high", "short-low", "mid", "long"]


def test_sample_diverse_prefers_distinct_action_sequences():
    buf = TrajectoryBuffer()
    dup = ("north", "north", "pick")
    buf.extend([make_traj(actions=dup, task_id=f"dup{i}") for i in range(5)])
    buf.add(make_traj(actions=("east", "open door", "pick"), task_id="distinct1"))
    buf.add(make_traj(actions=("west", "west", "drop"), task_id="distinct2"))
    for seed in range(10):
        picked = buf.sample_diverse(3, np.random.default_rng(seed))
        assert len(picked) == 3 and len({id(t) for t in picked}) == 3
        ids = {t.task_id for t in picked}
        assert {"distinct1", "distinct2"} <= ids  # all three distinct sequences, no duplicates
        assert sum(i.startswith("dup") for i in ids) == 1
    # same rng seed -> same picks; asking for more than exists returns everything once
    a = buf.sample_diverse(3, np.random.default_rng(1))
    assert a == buf.sample_diverse(3, np.random.default_rng(1))
    assert len(buf.sample_diverse(50, np.random.default_rng(0))) == len(buf)
    only_ok = buf.sample_diverse(2, np.random.default_rng(0), successful_only=True)
    assert all(t.success for t in only_ok)


def test_retrieve_nearest_by_cosine_and_caches_embeddings():
    vectors = {"find the key": [1.0, 0.0], "open the door": [0.0, 1.0],
               "find the red key": [0.9, 0.1], "failed goal": [1.0, 0.0]}
    calls = []

    def embed(text):
        calls.append(text)
        return np.array(vectors[text])

    buf = TrajectoryBuffer()
    buf.add(make_traj(extra={"goal": "open the door"}, task_id="door"))
    buf.add(make_traj(extra={"goal": "find the red key"}, task_id="red"))
    buf.add(make_traj(termination="failure", extra={"goal": "failed goal"}, task_id="fail"))
    buf.add(make_traj(task_id="find the key"))  # no goal in extra -> task_id is the goal text
    query = np.array([10.0, 0.5])  # cosine is scale-free: nearest to [1, 0]
    assert [t.task_id for t in buf.retrieve(query, 2, embed)] == ["find the key", "red"]
    assert [t.task_id for t in buf.retrieve(np.array([0.0, 3.0]), 1, embed)] == ["door"]
    assert sorted(calls) == sorted(["open the door", "find the red key", "find the key"])
    assert "failed goal" not in calls  # only successful runs are candidates


def test_filter_demonstrations_follows_seed_003_rules():
    buf = TrajectoryBuffer()
    buf.add(make_traj(actions=("a", "b", "c", "d", "e"), task_id="clean"))
    # 5 states, 3 unique: 3 >= 0.6 * 5 -> kept (boundary of the seed's rule)
    buf.add(make_traj(actions=("a",) * 5, observations=["s1", "s2", "s1", "s2", "s3"],
                      task_id="boundary"))
    # 5 states, 2 unique: 2 < 3 -> hesitant, dropped
    buf.add(make_traj(actions=("a",) * 5, observations=["s1", "s2", "s1", "s2", "s1"],
                      task_id="hesitant"))
    buf.add(make_traj(actions=("a",) * 9, task_id="long"))
    buf.add(make_traj(actions=("a", "b"), termination="failure", task_id="failed"))
    kept = buf.filter_demonstrations(max_repeat_fraction=0.4, max_steps=6)
    assert [t.task_id for t in kept] == ["clean", "boundary"]
    assert [t.task_id for t in buf.filter_demonstrations()] == ["clean", "boundary", "long"]


def test_fifo_eviction_and_save_load(tmp_path):
    buf = TrajectoryBuffer(max_size=3)
    for i in range(5):
        buf.add(make_traj(task_id=f"t{i}"))
    assert len(buf) == 3 and [t.task_id for t in buf] == ["t2", "t3", "t4"]
    buf.extend([make_traj(task_id="t5"), make_traj(task_id="t6")])
    assert [t.task_id for t in buf] == ["t4", "t5", "t6"]
    buf.save(tmp_path / "buf.jsonl")
    loaded = TrajectoryBuffer.load(tmp_path / "buf.jsonl", max_size=2)
    assert [t.task_id for t in loaded] == ["t5", "t6"]
    assert list(TrajectoryBuffer.load(tmp_path / "buf.jsonl")) == list(buf)
    with pytest.raises(ValueError):
        TrajectoryBuffer(max_size=0)
