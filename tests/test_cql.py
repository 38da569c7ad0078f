"""CQL's pure pieces against hand-computed values, the state encoder against a plain forward, and `--model tiny`
runs: a learning check on expert data, the --train-backbone path, a dataset file from the collector, resume, and
torchrun (2 gloo ranks == 1 process on the same global minibatch)."""

import importlib.util
import json
import math
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.chat import ChatFormat
from common.models import load_model
from common.offline import FeatureCache, collect, encode_states, transitions, write_dataset
from common.tracking import read_scalars
from tests.distributed_runs import only_run_dir, torchrun_command

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("cql", ROOT / "algorithms" / "cql.py")
cql = importlib.util.module_from_spec(spec)
sys.modules["cql"] = cql
spec.loader.exec_module(cql)


def test_td_target_double_dqn_hand_computed():
    online = torch.tensor([[1.0, 3.0], [2.0, 0.0], [5.0, 4.0]])  # argmax: 1, 0, 0
    target = torch.tensor([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]])  # evaluated there: 20, 30, 50
    rewards, dones = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 1.0, 0.0])
    y = cql.td_target(online, target, rewards, dones, gamma=0.9)
    # the target network evaluates the online argmax (not its own max 60 for row 2); terminal rows: y = r
    assert torch.allclose(y, torch.tensor([1 + 0.9 * 20, 2.0, 3 + 0.9 * 50]))


def test_td_target_bootstraps_only_at_a_time_limit_the_state_does_not_show():
    truncated = next(t for t in collect("gridworld", "noisy", 20, seed=0) if t.termination == "truncated")
    success = collect("gridworld", "expert", 1, seed=0)[0]
    assert "Step 20/20. " in truncated.turns[-1].observation
    # the same time-out with the counter cut from its last observation: the time limit is no longer in the state
    hidden = replace(truncated, turns=[*truncated.turns[:-1], replace(
        truncated.turns[-1], observation=truncated.turns[-1].observation.replace("Step 20/20. ", ""))])
    last = [transitions(t)[-1] for t in (truncated, hidden, success)]
    rewards = torch.tensor([t.reward for t in last])
    dones = torch.tensor([float(t.done) for t in last])
    q_next = torch.tensor([[1.0, 2.0, 0.5, 0.0], [1.0, 2.0, 0.5, 0.0], [4.0, 1.0, 1.0, 1.0]])
    y = cql.td_target(q_next, q_next, rewards, dones, gamma=0.5)
    assert dones.tolist() == [1.0, 0.0, 1.0]
    # shown time limit ("Step 20/20."): nothing follows, y = r; hidden one: r + gamma max Q; goal: r only
    assert y.tolist() == pytest.approx([-0.05, -0.05 + 0.5 * 2.0, 3.0 - 0.05])


def test_cql_regulariser_and_loss_hand_computed():
    q = torch.tensor([[0.0, math.log(3.0)], [2.0, 2.0]], requires_grad=True)
    actions = torch.tensor([0, 1])
    y = torch.tensor([1.0, 0.0])
    # row 0: logsumexp(0, ln 3) = ln 4, minus Q(s, a=0) = 0; row 1: ln(2 e^2) - 2 = ln 2; mean 1.5 ln 2
    assert cql.cql_regulariser(q, actions).item() == pytest.approx(1.5 * math.log(2.0))
    loss, td, _ = cql.cql_loss(q, actions, y, alpha=2.0)
    expected_td = 0.5 * ((0.0 - 1.0) ** 2 + (2.0 - 0.0) ** 2) / 2  # 1/2 mean (Q(s,a_D) - y)^2 = 1.25
    assert td.item() == pytest.approx(expected_td)
    assert loss.item() == pytest.approx(expected_td + 2.0 * 1.5 * math.log(2.0))
    loss.backward()
    # d/dQ: alpha (softmax(Q) - onehot(a_D)) / B + (Q(s,a_D) - y) onehot(a_D) / B; y gets no gradient
    expected = torch.tensor([[2.0 * (0.25 - 1) / 2 + (0.0 - 1.0) / 2, 2.0 * 0.75 / 2],
                             [2.0 * 0.5 / 2, 2.0 * (0.5 - 1) / 2 + (2.0 - 0.0) / 2]])
    assert torch.allclose(q.grad, expected, atol=1e-6)


def test_bc_loss_is_cross_entropy_over_q_logits():
    q = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])
    assert cql.bc_loss(q, torch.tensor([1, 0])).item() == pytest.approx((-math.log(0.75) - math.log(0.5)) / 2)


def test_state_text_window_and_ids(tiny):
    _, tok = tiny
    chat = ChatFormat(tok)
    hist = ["o0", "up", "o1", "left"]
    assert cql.state_texts(hist, "o2", 0) == ("o2",)
    assert cql.state_texts(hist, "o2", 1) == ("o1", "left", "o2")
    assert cql.state_texts(hist, "o2", 5) == ("o0", "up", "o1", "left", "o2")
    for k in (2, 3, 4):  # fewer past turns than K: all of them (a negative slice start would keep only the last)
        assert cql.state_texts(hist, "o2", k) == ("o0", "up", "o1", "left", "o2")
    assert cql.state_texts(hist[:2], "o1", 3) == ("o0", "up", "o1")
    ids = cql.state_ids(chat, "SYS", ("o1", "left", "o2"))
    text = tok.decode(ids)
    assert text == ("<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\no1<|im_end|>\n<|im_start|>assistant\n"
                    "left<|im_end|>\n<|im_start|>user\no2<|im_end|>\n<|im_start|>assistant\n")


def test_encode_states_shares_the_prefix_and_equals_plain_forwards(tiny):
    model, tok = tiny
    chat, body = ChatFormat(tok), model.get_decoder()
    texts = [("Step 0/20. A at 1",), ("o", "up", "Step 1/20. A at 2, longer"), ("x",)]
    ids = [cql.state_ids(chat, "You are A.", t) for t in texts] + [[5, 6, 7]]  # the last shares no prefix
    with torch.no_grad():
        plain = torch.stack([body(input_ids=torch.tensor([i])).last_hidden_state[0, -1] for i in ids])
        assert torch.allclose(encode_states(body, ids[:3], tok.pad_token_id, "cpu"), plain[:3], atol=1e-5)
        assert torch.allclose(encode_states(body, ids, tok.pad_token_id, "cpu"), plain, atol=1e-5)


def run_cql(tmp_path, *flags, timeout=300):
    proc = subprocess.run([sys.executable, str(ROOT / "algorithms" / "cql.py"), "--model", "tiny", "--output-dir",
                           str(tmp_path), *flags], capture_output=True, text=True, timeout=timeout, cwd=tmp_path, check=False)
    return proc, sorted(p for p in tmp_path.iterdir() if p.is_dir())


def test_tiny_cql_learns_gridworld_from_expert_data(tmp_path):
    proc, runs = run_cql(tmp_path, "--dataset-quality", "expert", "--dataset-episodes", "3", "--total-updates", "400",
                         "--minibatch-size", "64", "--eval-every", "400", "--eval-episodes", "1", "--log-every", "100",
                         "--save-model")
    assert proc.returncode == 0, proc.stderr[-3000:]
    scalars = read_scalars(runs[-1])
    (first_step, first), (last_step, last) = scalars["eval/episodic_return"][0], scalars["eval/episodic_return"][-1]
    assert (first_step, last_step) == (0, 400) and first < 0  # the random head wanders for 20 steps
    assert last == pytest.approx(4.45) and scalars["eval/success_rate"][-1][1] == 1.0  # the optimal return
    assert scalars["diagnostics/action_agreement"][-1][1] == 1.0
    assert scalars["losses/cql_regulariser"][-1][1] < scalars["losses/cql_regulariser"][0][1]
    meta = json.loads((runs[-1] / "dataset.jsonl.meta.json").read_text())  # the collected data lives in the run
    assert meta["quality"] == "expert" and meta["episodes"] == 3
    head = torch.load(runs[-1] / "model" / "q_head.pt")
    assert head["net.2.weight"].shape == (4, 256) and head["mean"].shape == (64,)


def test_tiny_train_backbone_history_and_dataset_file(tmp_path):
    trajs = collect("gridworld", "suboptimal", 3, seed=0)
    write_dataset(tmp_path / "data" / "gw.jsonl", trajs, {"env_id": "gridworld", "env_kwargs": {}})
    proc, runs = run_cql(tmp_path, "--dataset", str(tmp_path / "data" / "gw.jsonl"), "--train-backbone", "--history-len",
                         "1", "--head", "linear", "--total-updates", "4", "--minibatch-size", "4", "--log-every", "2",
                         "--eval-every", "4", "--eval-episodes", "1", "--tau", "1.0", "--target-update-every", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "distinct states" in proc.stdout
    scalars = read_scalars([r for r in runs if r.name != "data"][-1])
    assert len(scalars["losses/td_loss"]) == 2 and math.isfinite(scalars["losses/loss"][-1][1])
    proc, _ = run_cql(tmp_path, "--dataset", str(tmp_path / "data" / "gw.jsonl"), "--env-id", "frozenlake")
    assert proc.returncode != 0 and "collected on gridworld; pass --env-id gridworld" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_feature_cache_keys_on_weights_and_ids_and_merges_writers(tmp_path):
    one, _ = load_model("tiny", "cpu", seed=1)
    other, _ = load_model("tiny", "cpu", seed=2)  # another tiny seed: other weights, so never the same features
    a, b = FeatureCache(tmp_path, one, "tiny"), FeatureCache(tmp_path, one, "tiny")  # two runs on one encoder
    assert a.path == b.path and FeatureCache(tmp_path, other, "tiny").path != a.path
    a.put([1, 2, 3], torch.ones(4))
    b.put([1, 2, 4], torch.zeros(4))
    a.save()
    b.save()  # merges a's entry instead of overwriting it
    fresh = FeatureCache(tmp_path, one, "tiny")
    assert torch.equal(fresh.get([1, 2, 3]), torch.ones(4)) and torch.equal(fresh.get([1, 2, 4]), torch.zeros(4))
    assert fresh.get([1, 2]) is None and FeatureCache(tmp_path, other, "tiny").get([1, 2, 3]) is None
    fresh.path.write_bytes(b"truncated")  # a broken cache file is ignored, never fatal
    assert FeatureCache(tmp_path, one, "tiny").get([1, 2, 3]) is None


def test_feature_cache_is_reused_across_modes_with_the_same_results(tmp_path):
    trajs = collect("gridworld", "suboptimal", 4, seed=0)
    write_dataset(tmp_path / "data" / "gw.jsonl", trajs, {"env_id": "gridworld", "env_kwargs": {}})
    common = ["--dataset", str(tmp_path / "data" / "gw.jsonl"), "--feature-cache", str(tmp_path / "features"),
              "--total-updates", "20", "--minibatch-size", "16", "--log-every", "10", "--eval-every", "20",
              "--eval-episodes", "1"]
    for d in "abc":
        (tmp_path / d).mkdir()
    first, runs = run_cql(tmp_path / "a", *common, "--mode", "bc")
    assert first.returncode == 0, first.stderr[-3000:]
    found, total = map(int, first.stdout.split("feature cache ")[1].split(": ")[1].split(" states")[0].split(" of "))
    assert found == 0 and total > 0
    again, runs_again = run_cql(tmp_path / "b", *common, "--mode", "bc")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{total} of {total} states found" in again.stdout  # no state encoded twice
    x, y = read_scalars(runs[-1]), read_scalars(runs_again[-1])
    assert [v for _, v in x["losses/loss"]] == pytest.approx([v for _, v in y["losses/loss"]], abs=1e-5)
    assert x["eval/episodic_return"] == y["eval/episodic_return"]
    cql_run, _ = run_cql(tmp_path / "c", *common)  # CQL also needs the next states: only those are new
    assert cql_run.returncode == 0, cql_run.stderr[-3000:]
    found, cql_total = map(int, cql_run.stdout.split("feature cache ")[1].split(": ")[1].split(" states")[0].split(" of "))
    assert cql_total > total and found == total  # every state BC saw; the next states at the ends are new


@pytest.mark.parametrize("flags", [[], pytest.param(["--train-backbone", "--lora-r", "4", "--head", "linear"],
                                                    marks=pytest.mark.slow)], ids=["frozen", "lora"])
def test_resume_matches_an_uninterrupted_run(tmp_path, flags):
    """N updates in one go == k updates with a checkpoint, then --resume to N: every logged number but wall-clock.
    k is a multiple of --log-every and --eval-every, so the stopped run logs nothing the long one does not."""
    common = ["--dataset-episodes", "4", "--minibatch-size", "8", "--log-every", "2", "--eval-every", "4",
              "--eval-episodes", "1", "--tau", "0.3", *flags]  # a large tau: the target network's state matters
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    proc, runs = run_cql(tmp_path / "a", "--total-updates", "8", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = read_scalars(runs[-1])
    proc, runs = run_cql(tmp_path / "b", "--total-updates", "4", "--checkpoint-every", "4", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s for s, _ in read_scalars(runs[-1])["losses/loss"]] == [2, 4]
    proc, _ = run_cql(tmp_path / "b", "--resume", str(runs[-1]), "--total-updates", "8")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    resumed = read_scalars(runs[-1])
    wall_clock = lambda tag: tag.startswith("perf/") and tag.endswith(("_s", "_per_s"))
    assert {t for t in full if not wall_clock(t)} == {t for t in resumed if not wall_clock(t)}
    for tag in full:  # same steps; values equal up to float noise (two runs with 2 threads differ by ~1e-6)
        if not wall_clock(tag):
            assert [st for st, _ in resumed[tag]] == [st for st, _ in full[tag]], tag
            assert [v for _, v in resumed[tag]] == pytest.approx([v for _, v in full[tag]], rel=1e-4, abs=1e-6), tag
    assert [s for s, _ in full["losses/loss"]] == [2, 4, 6, 8] and [s for s, _ in full["eval/success_rate"]] == [0, 4, 8]


def test_minibatch_must_split_evenly_over_torchrun_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets; validate_args reads it before any process group
    with pytest.raises(SystemExit, match="--minibatch-size 7 must be divisible by the 2 processes"):
        cql.validate_args(cql.Args(minibatch_size=7))
    cql.validate_args(cql.Args(minibatch_size=8))


def torchrun(*args):
    with socket.socket() as s:  # a free port: other tests may run torchrun at the same time
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), str(ROOT / "algorithms" / "cql.py"), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("resume", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["straight", "resumed"])
def test_torchrun_two_ranks_equal_one_process_and_stay_in_sync(tmp_path, resume):
    """1 process x minibatch 8 vs 2 gloo ranks x 4 (the same global minibatch, split), 6 updates (resumed: 4 with a
    checkpoint, then --resume under torchrun). Every logged loss and the saved head match the 1-process run up to
    float noise (the ranks encode different halves of the states: features differ by ~1e-7), and the ranks'
    weights are identical after every update."""
    flags = ["--model", "tiny", "--dataset-episodes", "4", "--minibatch-size", "8", "--log-every", "1", "--eval-every",
             "2", "--eval-episodes", "1", "--tau", "0.3", "--learning-rate", "3e-3"]
    one = subprocess.Popen([sys.executable, str(ROOT / "algorithms" / "cql.py"), *flags, "--total-updates", "6",
                            "--save-model", "--output-dir", str(tmp_path / "one")], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    proc = torchrun(*flags, "--output-dir", str(tmp_path / "two"),
                    *(["--total-updates", "4", "--checkpoint-every", "4"] if resume else ["--total-updates", "6", "--save-model"]))
    (run_dir,) = (tmp_path / "two").iterdir()  # rank 0 alone writes
    assert proc.stdout.count("update 4/") == 1  # print0
    if resume:
        proc = torchrun("--resume", str(run_dir), "--total-updates", "6", "--save-model")
        assert "resumed from" in proc.stdout
    _, err = one.communicate(timeout=300)
    assert one.returncode == 0, err[-3000:]
    got, expected = read_scalars(run_dir), read_scalars(next((tmp_path / "one").iterdir()))
    assert got["diagnostics/rank_param_divergence"] == [(step, 0.0) for step in range(1, 7)]
    for tag in ("losses/loss", "losses/td_loss", "losses/cql_regulariser", "diagnostics/q_data", "diagnostics/grad_norm",
                "diagnostics/action_agreement", "eval/episodic_return"):
        assert [s for s, _ in got[tag]] == [s for s, _ in expected[tag]], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in expected[tag]], rel=1e-4, abs=1e-5), tag
    heads = [torch.load(d / "model" / "q_head.pt") for d in (run_dir, next((tmp_path / "one").iterdir()))]
    for name, value in heads[1].items():  # atol 1e-4: summing gradients in another order changes a weight whose
        # Adam second moment is ~0 by up to ~5e-5 after 6 steps (seen on one machine); a missing all-reduce moves
        # weights by the learning rate per step, and the divergence and loss checks above are exact or rel 1e-4
        torch.testing.assert_close(heads[0][name], value, rtol=1e-4, atol=1e-4)
    assert all(v > 0 for _, v in got["diagnostics/grad_norm"])  # and the updates moved the weights


def test_fsdp_train_backbone_takes_the_data_parallel_steps_through_a_resume(tmp_path):
    """--train-backbone --fsdp on 2 ranks (the online and the target LM's layers sharded; a checkpoint at update 2,
    then --resume to 4) logs the same losses and gradient norms, and saves the same LM and Q head, as plain data
    parallel straight to 4. From update 3 on the TD target reads the restored, sharded target LM (tau 0.3)."""
    from safetensors.torch import load_file

    flags = ["--model", "tiny", "--train-backbone", "--dataset-episodes", "4", "--minibatch-size", "8", "--log-every", "1",
             "--eval-every", "2", "--eval-episodes", "1", "--tau", "0.3", "--backbone-learning-rate", "3e-4"]
    ddp = subprocess.Popen(torchrun_command("cql.py", tmp_path / "ddp", *flags, "--total-updates", "4", "--save-model"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = subprocess.run(torchrun_command("cql.py", tmp_path / "fsdp", *flags, "--fsdp", "--total-updates", "2",
                                            "--checkpoint-every", "2"), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "fsdp")
    second = subprocess.run(torchrun_command("cql.py", tmp_path, "--resume", str(run_dir), "--total-updates", "4",
                                             "--save-model"), capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    out, err = ddp.communicate(timeout=300)
    assert ddp.returncode == 0, out[-2000:] + err[-3000:]
    ddp_dir = only_run_dir(tmp_path / "ddp")
    got, expected = read_scalars(run_dir), read_scalars(ddp_dir)
    for tag in ("losses/loss", "losses/td_loss", "losses/cql_regulariser", "diagnostics/td_target", "diagnostics/grad_norm",
                "eval/episodic_return"):
        assert [s for s, _ in got[tag]] == [s for s, _ in expected[tag]], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in expected[tag]], rel=1e-4, abs=1e-6), tag
    # atol 1e-4: under FSDP each state is one plain forward, not a shared prefix + suffix (features differ by ~1e-7),
    # and Adam turns that into up to ~3e-5 on weights whose second moment is ~0; a lost target or Adam state
    # moves every trained weight by ~2 x the learning rate (3e-4 here) per update
    sharded, whole = (load_file(str(d / "model" / "model.safetensors")) for d in (run_dir, ddp_dir))
    assert set(sharded) == set(whole)
    for key, value in whole.items():
        torch.testing.assert_close(sharded[key], value, rtol=1e-4, atol=1e-4)
    heads = [torch.load(d / "model" / "q_head.pt") for d in (run_dir, ddp_dir)]
    for name, value in heads[1].items():
        torch.testing.assert_close(heads[0][name], value, rtol=1e-4, atol=1e-4)


def test_fsdp_needs_torchrun_and_a_trained_backbone():
    with pytest.raises(SystemExit, match="--fsdp need --train-backbone"):
        cql.validate_args(cql.Args(fsdp=True))
    with pytest.raises(SystemExit, match="--fsdp shards over torchrun processes"):
        cql.validate_args(cql.Args(fsdp=True, train_backbone=True))
