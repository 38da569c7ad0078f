"""Checkpoints and resume (common/checkpoint.py, grpo_agent.py --checkpoint-every / --resume).

The end-to-end check: a `--model tiny` GRPO run stopped by Ctrl-C (which saves a checkpoint), given the
events a crash would leave behind (logged after the checkpoint), then resumed to the end, logs the same
numbers as an uninterrupted run of the same length. Wall-clock tags (perf/*_s, perf/*_per_s) legitimately
differ and are not compared; every other scalar is, to 1e-6 (in practice they are bit-identical on CPU).
"""

import ast
import importlib.util
import json
import random
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from common import checkpoint as ck
from common.tracking import Tracker, read_scalars

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "algorithms" / "grpo_agent.py"
# seed 5 with these flags: every one of the 3 iterations has reward variance, so each one updates the
# weights and the Adam moments (a resume that lost the optimizer state or an RNG would show); the novelty
# bonus's visit counts and the self-imitation memory are state a resume must carry too
FLAGS = ["--model", "tiny", "--seed", "5", "--group-size", "4", "--update-epochs", "1", "--learning-rate", "1e-2",
         "--temperature", "1", "--max-total-tokens", "1600", "--eval-every", "1", "--eval-episodes", "1",
         "--novelty-coef", "0.1", "--sil-coef", "0.5"]
N = 3


def run_grpo(cwd: Path, *flags, script=SCRIPT):
    proc = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, timeout=600, cwd=cwd,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def only_run_dir(path: Path) -> Path:
    (run_dir,) = [p for p in path.iterdir() if p.is_dir()]
    return run_dir


def wall_clock(tag: str) -> bool:
    return tag.startswith("perf/") and tag.endswith(("_s", "_per_s"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    run_grpo(out, *FLAGS, "--total-iterations", str(N), "--output-dir", str(out))
    return only_run_dir(out)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run of 50 iterations, without periodic checkpoints, sent SIGINT once its first iteration is logged."""
    out = tmp_path_factory.mktemp("interrupted")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *FLAGS, "--total-iterations", "50", "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=out)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("iter 1/50"):
            proc.send_signal(signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=300)
    return {"run_dir": only_run_dir(out), "rc": proc.returncode, "stdout": "".join(lines) + rest, "stderr": err}


def test_ctrl_c_finishes_the_iteration_and_saves_a_checkpoint(interrupted):
    assert interrupted["rc"] == 130, interrupted["stdout"][-2000:] + interrupted["stderr"][-3000:]
    assert "Traceback" not in interrupted["stderr"]
    manifest = json.loads((interrupted["run_dir"] / "checkpoint.json").read_text())
    # the signal arrives during iteration 1 or its evaluation, or at the latest during iteration 2
    assert manifest["iteration"] in (1, 2)
    assert f"checkpoint saved in {interrupted['run_dir']} (iteration {manifest['iteration']})" in interrupted["stdout"]
    assert f"iter {manifest['iteration'] + 1}/50" not in interrupted["stdout"]  # it stopped right after saving
    state = ck.load_checkpoint(interrupted["run_dir"])
    assert state["counters"] == {"iteration": manifest["iteration"], "episodes_seen": 4 * manifest["iteration"],
                                 "generated_tokens": state["counters"]["generated_tokens"]}
    assert state["optimizer"]["state"] or manifest["iteration"] == 0  # Adam moments after the first update


def test_resume_after_a_crash_gives_the_same_numbers_as_an_uninterrupted_run(interrupted, uninterrupted, tmp_path):
    run_dir = interrupted["run_dir"]
    k = json.loads((run_dir / "checkpoint.json").read_text())["iteration"]
    # a crash after the checkpoint leaves events behind it: write some (wrong values, at later steps)
    writer = SummaryWriter(str(run_dir))
    for tag in read_scalars(run_dir):
        for step in (4 * (k + 1), 4 * (N + 5)):
            writer.add_scalar(tag, 12345.0, step)
    writer.close()
    assert read_scalars(run_dir)["charts/success_rate"][-1] == (4 * (N + 5), 12345.0)
    # resume from the checkpoint at k to the end: the orphaned events are purged, iteration k + 1 played again
    out = run_grpo(tmp_path, "--resume", str(run_dir), "--total-iterations", str(N), "--checkpoint-every", "1").stdout
    assert f"resumed from {run_dir} at iteration {k}" in out and f"iter {k + 1}/{N}" in out and "iter 1/" not in out
    assert json.loads((run_dir / "checkpoint.json").read_text())["iteration"] == N
    assert len(list(run_dir.glob("checkpoint-*.pt"))) == 1  # older checkpoints are removed

    resumed, reference = read_scalars(run_dir), read_scalars(uninterrupted)
    assert set(resumed) == set(reference)
    compared = [t for t in reference if not wall_clock(t)]
    assert "losses/entropy" in compared and "perf/generated_tokens" in compared and "eval/success_rate" in compared
    assert "diagnostics/novelty_bonus" in compared
    assert reference["diagnostics/replayed_episodes"][-1][1] > 0  # the last iteration replays the restored memory
    worst = 0.0
    for tag in compared:
        steps = [s for s, _ in reference[tag]]
        assert [s for s, _ in resumed[tag]] == steps, tag  # one value per step: nothing duplicated or missing
        assert np.allclose([v for _, v in resumed[tag]], [v for _, v in reference[tag]], rtol=0, atol=1e-6), tag
        worst = max(worst, *(abs(a - b) for (_, a), (_, b) in zip(resumed[tag], reference[tag])))
    print(f"resumed at iteration {k} of {N}: {len(compared)} tags compared, largest difference {worst:g}")
    assert len(reference["charts/success_rate"]) == N and reference["eval/success_rate"][0][0] == 0
    # the run really learned between iterations (so the comparison covers restored weights + Adam state)
    assert resumed["diagnostics/grad_norm"][-1][1] > 0 and resumed["diagnostics/zero_variance_groups"][-1][1] == 0


def test_policy_lag_counts_the_replayed_episodes_versions(uninterrupted):
    """diagnostics/policy_lag: 0 for a batch sampled by the weights being updated; self-imitation's replays were
    sampled by older policies, so an iteration that replays has a lag above 0 and below its iteration count."""
    s = read_scalars(uninterrupted)
    replayed, lag = [v for _, v in s["diagnostics/replayed_episodes"]], [v for _, v in s["diagnostics/policy_lag"]]
    assert len(lag) == N and any(replayed)
    for iteration, (r, lagged) in enumerate(zip(replayed, lag), 1):
        assert (lagged > 0) == (r > 0) and lagged < iteration


def test_truncated_checkpoint_is_reported_with_the_file_name(uninterrupted, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(uninterrupted / "args.json", run_dir / "args.json")
    path = ck.save_checkpoint(run_dir, {"weights": torch.arange(10_000.0)}, iteration=4)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut in half
    with pytest.raises(SystemExit, match=f"{path}.*truncated"):
        ck.load_checkpoint(run_dir)
    # the script (in-process: the SystemExit message is the one line the user sees): fails before loading a model
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--resume", str(run_dir)])
    with pytest.raises(SystemExit, match=f"{path}.*truncated"):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    # same size, one byte flipped: the hash catches it
    path.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    with pytest.raises(SystemExit, match=f"{path}.*corrupt.*sha256"):
        ck.load_checkpoint(run_dir)
    (run_dir / "checkpoint.json").write_text('{"file": ')
    with pytest.raises(SystemExit, match="checkpoint.json is corrupt"):
        ck.load_checkpoint(run_dir)
    (run_dir / "checkpoint.json").unlink()
    with pytest.raises(SystemExit, match="no checkpoint.*--checkpoint-every"):
        ck.load_checkpoint(run_dir)


def test_a_save_interrupted_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ck.save_checkpoint(tmp_path, {"w": torch.ones(1000), "iteration": 1}, iteration=1)

    def crash_mid_write(obj, f, *a, **kw):
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_mid_write)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(tmp_path, {"w": torch.zeros(1000), "iteration": 2}, iteration=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000001.pt", "checkpoint.json"]  # no temp left
    state = ck.load_checkpoint(tmp_path)
    assert state["iteration"] == 1 and torch.equal(state["w"], torch.ones(1000))
    # the next save works and replaces it
    ck.save_checkpoint(tmp_path, {"w": torch.zeros(1000), "iteration": 2}, iteration=2)
    assert ck.load_checkpoint(tmp_path)["iteration"] == 2 and not (tmp_path / "checkpoint-000001.pt").exists()


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    gen, py, npg = torch.Generator().manual_seed(7), random.Random(3), np.random.default_rng(5)
    named = {"gen": gen, "py": py, "npg": npg}

    def draw():
        return (random.random(), np.random.rand(), torch.rand(2).tolist(), torch.rand(2, generator=gen).tolist(),
                py.random(), npg.random(), np.random.normal())  # normal(): numpy's cached gaussian is state too

    np.random.normal()
    ck.save_checkpoint(tmp_path, {"rng": ck.rng_state(named)}, iteration=1)
    expected = draw()
    draw()  # move every generator on
    ck.set_rng_state(ck.load_checkpoint(tmp_path)["rng"], named)
    assert draw() == expected
    with pytest.raises(SystemExit, match="generators"):
        ck.set_rng_state(ck.rng_state({"gen": gen}), {"other": gen})


def test_tracker_resume_purges_what_was_logged_after_the_checkpoint(tmp_path):
    """Two x-axes (cold-start SFT steps 1..10, then episodes 4, 8): only post-checkpoint events go, although
    the purge step (8, the first orphan) is below SFT steps logged before the checkpoint."""
    t = Tracker(tmp_path, {"a": 1})
    for step in range(1, 11):
        t.scalars({"losses/sft_loss": 10.0 - step}, step)
    t.scalars({"charts/r": 1.0}, 4)
    saved = t.state_dict()  # the checkpoint after the first iteration
    t.scalars({"charts/r": 2.0}, 8)  # then a crash
    t.scalars({"charts/new": 5.0}, 8)
    t.close()
    assert saved == {"last_steps": {"losses/sft_loss": 10, "charts/r": 4}}
    t = Tracker(tmp_path, {"a": 1}, resume_state=saved)
    t.scalars({"charts/r": 3.0}, 8)
    t.close()
    scalars = read_scalars(tmp_path)
    assert scalars["charts/r"] == [(4, 1.0), (8, 3.0)]
    assert scalars["losses/sft_loss"] == [(s, 10.0 - s) for s in range(1, 11)]  # steps 8-10 purged, then re-logged
    assert scalars.get("charts/new", []) == []  # TensorBoard keeps the tag name, with no events
    assert json.loads((tmp_path / "args.json").read_text()) == {"a": 1}


def test_resume_keeps_the_saved_arguments_and_rejects_changed_ones(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("grpo_agent_ck", SCRIPT)
    grpo = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "grpo_agent_ck", grpo)  # dataclasses look the module up
    spec.loader.exec_module(grpo)
    saved = {**vars(grpo.Args()), "learning_rate": 0.003, "total_iterations": 4, "world_size": 1}
    (tmp_path / "args.json").write_text(json.dumps(saved))
    monkeypatch.setattr(sys, "argv", ["grpo_agent.py", "--resume", str(tmp_path), "--total-iterations", "9"])
    args = ck.cli_with_resume(grpo.Args, grpo.RESUMABLE, "grpo_agent.py")
    assert (args.learning_rate, args.total_iterations, args.resume) == (0.003, 9, str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["grpo_agent.py", "--resume", str(tmp_path), "--learning-rate", "0.5", "--seed", "2"])
    with pytest.raises(SystemExit, match=r"--learning-rate \(saved 0.003, given 0.5\).*--seed") as e:
        ck.cli_with_resume(grpo.Args, grpo.RESUMABLE, "grpo_agent.py")
    assert str(e.value).startswith("grpo_agent.py: --resume")
    monkeypatch.setattr(sys, "argv", ["grpo_agent.py", "--resume", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="args.json not found"):
        ck.cli_with_resume(grpo.Args, grpo.RESUMABLE, "grpo_agent.py")


def test_graceful_interrupt_sets_a_flag_then_aborts_on_the_second_ctrl_c():
    previous = signal.getsignal(signal.SIGINT)
    with ck.GracefulInterrupt() as interrupt:
        assert not interrupt.should_stop()
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.01)
        assert interrupt.should_stop()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) is previous


def test_star_resumed_run_logs_the_same_numbers(tmp_path):
    """algorithms/star.py (fine-tunes once per outer iteration): 1 outer iteration + resume = 2 uninterrupted."""
    star = ROOT / "algorithms" / "star.py"
    smoke = next(ast.literal_eval(n.value) for n in ast.parse(star.read_text()).body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SMOKE_TEST_ARGS")
    flags = ["--model", "tiny", *smoke, "--outer-iterations", "2"]  # (the last of a repeated flag counts)
    run_grpo(tmp_path, *flags, "--output-dir", str(tmp_path / "a"), script=star)
    run_grpo(tmp_path, *flags, "--outer-iterations", "1", "--checkpoint-every", "1", "--output-dir",
             str(tmp_path / "b"), script=star)
    run_dir = only_run_dir(tmp_path / "b")
    out = run_grpo(tmp_path, "--resume", str(run_dir), "--outer-iterations", "2", script=star).stdout
    assert "resumed from" in out and "iter 2/2" in out and "iter 1/" not in out
    resumed, reference = read_scalars(run_dir), read_scalars(only_run_dir(tmp_path / "a"))
    assert set(resumed) == set(reference) and len(reference["charts/success_rate"]) == 2
    assert reference["losses/sft_loss"][-1][1] > 0  # iteration 2 fine-tuned (from samples of the restored M_1)
    for tag in (t for t in reference if not wall_clock(t)):
        assert [s for s, _ in resumed[tag]] == [s for s, _ in reference[tag]], tag
        assert np.allclose([v for _, v in resumed[tag]], [v for _, v in reference[tag]], rtol=0, atol=1e-6), tag


@pytest.mark.slow
def test_torchrun_resume_logs_the_same_numbers(tmp_path):
    """Two gloo ranks: rank 0 alone writes the checkpoint (with both ranks' RNG states); both load it."""
    def torchrun(*flags):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531",
               str(SCRIPT), *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, check=False)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    torchrun(*FLAGS, "--total-iterations", str(N), "--output-dir", str(tmp_path / "a"))
    torchrun(*FLAGS, "--total-iterations", "2", "--checkpoint-every", "2", "--output-dir", str(tmp_path / "b"))
    run_dir = only_run_dir(tmp_path / "b")
    assert len(ck.load_checkpoint(run_dir)["rng"]) == 2
    torchrun("--resume", str(run_dir), "--total-iterations", str(N))
    resumed, reference = read_scalars(run_dir), read_scalars(only_run_dir(tmp_path / "a"))
    assert [s for s, _ in reference["charts/success_rate"]] == [8 * i for i in range(1, N + 1)]
    for tag in (t for t in reference if not wall_clock(t)):
        assert [s for s, _ in resumed[tag]] == [s for s, _ in reference[tag]], tag
        assert np.allclose([v for _, v in resumed[tag]], [v for _, v in reference[tag]], rtol=0, atol=1e-6), tag


def test_ppo_gae_resumed_run_logs_the_same_numbers(tmp_path):
    """algorithms/ppo_gae_agent.py: 1 iteration + checkpoint + resume to 3 = 3 uninterrupted. A separate critic
    on a frozen lower layer: the policy's and the critic's top layers, the value head (none of them in the same
    module) and both AdamW param groups must all come back, with the sampling and shuffling generators."""
    ppo = ROOT / "algorithms" / "ppo_gae_agent.py"
    flags = ["--model", "tiny", "--num-episodes", "4", "--eval-every", "1", "--eval-episodes", "1", "--learning-rate",
             "1e-2", "--critic", "separate", "--trainable-layers", "1", "--max-episode-steps", "6", "--update-epochs", "1"]
    run_grpo(tmp_path, *flags, "--total-iterations", "3", "--output-dir", str(tmp_path / "a"), script=ppo)
    run_grpo(tmp_path, *flags, "--total-iterations", "1", "--checkpoint-every", "1", "--output-dir",
             str(tmp_path / "b"), script=ppo)
    run_dir = only_run_dir(tmp_path / "b")
    out = run_grpo(tmp_path, "--resume", str(run_dir), "--total-iterations", "3", script=ppo).stdout
    assert f"resumed from {run_dir} at iteration 1" in out and "iter 2/3" in out and "iter 1/" not in out
    state = ck.load_checkpoint(run_dir)
    assert state["counters"] == {"iteration": 3, "episodes_seen": 12}
    names = set(state["model"])
    assert {"value_head.weight", "value_head.bias"} <= names and any(n.startswith("critic.") for n in names)
    assert state["model"]["value_head.weight"].abs().sum() > 0  # zero-initialised: it trained
    assert len(state["optimizer"]["param_groups"]) == 2 and state["optimizer"]["state"]
    resumed, reference = read_scalars(run_dir), read_scalars(only_run_dir(tmp_path / "a"))
    assert set(resumed) == set(reference) and len(reference["charts/success_rate"]) == 3
    assert min(v for _, v in reference["diagnostics/approx_kl"]) > 0  # the policy moved within every update
    for tag in (t for t in reference if not wall_clock(t)):
        assert [s for s, _ in resumed[tag]] == [s for s, _ in reference[tag]], tag
        assert np.allclose([v for _, v in resumed[tag]], [v for _, v in reference[tag]], rtol=0, atol=1e-6), tag


# rlef: a codegen environment whose extra reward a random `tiny` model earns (a checksum of the action's bytes, in
# tenths), so every group has reward variance and every iteration updates the weights; imported via PYTHONPATH
SHAPED_CODEGEN = '''
from envs.codegen import CodegenEnv


class ShapedCodegen(CodegenEnv):
    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward + sum(map(ord, str(action))) % 10 / 10, terminated, truncated, info
'''


def test_rlef_resumed_run_logs_the_same_numbers(tmp_path):
    """algorithms/rlef.py: 1 iteration + resume = 3 uninterrupted. The curriculum window (6 episodes, 4 per
    iteration) spans the checkpoint, so the level only matches if the window was restored; the SFT cold start
    runs before iteration 1 only, not again on resume."""
    import os

    (tmp_path / "shaped_codegen.py").write_text(SHAPED_CODEGEN)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}

    def rlef(*flags):
        proc = subprocess.run([sys.executable, str(ROOT / "algorithms" / "rlef.py"), *flags], capture_output=True,
                              text=True, timeout=600, cwd=tmp_path, env=env, check=False)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc.stdout

    flags = ["--model", "tiny", "--env-id", "shaped_codegen:ShapedCodegen", "--group-size", "4", "--max-turn-tokens",
             "8", "--sft-steps", "2", "--sft-batch-size", "2", "--learning-rate", "1e-2", "--promote-threshold", "0",
             "--curriculum-window", "6", "--eval-tasks", "0", "--humaneval-tasks", "0"]
    rlef(*flags, "--total-iterations", "3", "--output-dir", str(tmp_path / "a"))
    rlef(*flags, "--total-iterations", "1", "--checkpoint-every", "1", "--output-dir", str(tmp_path / "b"))
    run_dir = only_run_dir(tmp_path / "b")
    out = rlef("--resume", str(run_dir), "--total-iterations", "3")
    assert "resumed from" in out and "iter 2/3" in out and "iter 1/" not in out and "sft " not in out
    resumed, reference = read_scalars(run_dir), read_scalars(only_run_dir(tmp_path / "a"))
    assert set(resumed) == set(reference)
    assert [v for _, v in reference["charts/curriculum_level"]] == [1.0, 1.0, 2.0]  # promoted once the window filled
    assert all(v > 0 for _, v in reference["diagnostics/grad_norm"]) and len(reference["losses/sft_loss"]) == 2
    for tag in (t for t in reference if not wall_clock(t)):
        assert [s for s, _ in resumed[tag]] == [s for s, _ in reference[tag]], tag
        assert np.allclose([v for _, v in resumed[tag]], [v for _, v in reference[tag]], rtol=0, atol=1e-6), tag
