"""benchmarks/run.py skips completed cells and reruns failed or changed ones; benchmarks/plot.py turns event
files into the right mean ± std table and curves."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import plot, run
from common.tracking import Tracker

# a stand-in for an algorithm script: logs two scalars and counts its own invocations
FAKE_SCRIPT = '''
import argparse, os, sys
sys.path.insert(0, {root!r})
from common.tracking import Tracker
p = argparse.ArgumentParser()
p.add_argument("--env-id"); p.add_argument("--seed", type=int); p.add_argument("--output-dir"); p.add_argument("--fail", action="store_true")
a = p.parse_args()
with open(os.path.join({counter!r}), "a") as f:
    f.write(f"{{a.env_id}} {{a.seed}}\\n")
if a.fail:
    sys.exit(3)
t = Tracker(os.path.join(a.output_dir, "run"), {{"env_id": a.env_id, "exp_name": "fake", "seed": a.seed}})
t.scalars({{"eval/success_rate": a.seed / 10}}, 8)
t.close()
'''


def make_fake(tmp_path: Path) -> tuple[Path, Path]:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    counter = tmp_path / "calls.txt"
    (scripts / "fake.py").write_text(FAKE_SCRIPT.format(root=str(Path(__file__).resolve().parents[1]), counter=str(counter)))
    return scripts, counter


def calls(counter: Path) -> list[str]:
    return counter.read_text().splitlines() if counter.exists() else []


def test_run_skips_completed_cells_and_retries_failed_ones(tmp_path):
    scripts, counter = make_fake(tmp_path)
    args = run.Args(algorithms=["fake"], env_ids=["gridworld", "taxi"], seeds=[1, 2], scripts_dir=str(scripts),
                    output_dir=str(tmp_path / "out"))
    assert run.main(args) == 0
    assert sorted(calls(counter)) == ["gridworld 1", "gridworld 2", "taxi 1", "taxi 2"]
    cell = json.loads((tmp_path / "out" / "fake" / "taxi" / "seed2" / "cell.json").read_text())
    assert cell["returncode"] == 0 and cell["git_commit"] and cell["seed"] == 2

    assert run.main(args) == 0  # everything complete: nothing runs again
    assert len(calls(counter)) == 4

    (tmp_path / "out" / "fake" / "taxi" / "seed1" / "cell.json").unlink()  # an interrupted cell
    args.seeds = [1, 2, 3]  # and a new seed
    assert run.main(args) == 0
    assert sorted(calls(counter)[4:]) == ["gridworld 3", "taxi 1", "taxi 3"]

    failing = run.Args(**{**vars(args), "seeds": [1], "env_ids": ["gridworld"], "script_args": "--fail"})
    assert run.main(failing) == 1  # changed flags = a different cell; its failure is recorded and reported
    assert run.main(failing) == 1  # and retried on the next call, not skipped
    assert calls(counter)[-2:] == ["gridworld 1", "gridworld 1"]


def test_run_rejects_unknown_algorithms(tmp_path):
    with pytest.raises(SystemExit, match="no script for"):
        run.main(run.Args(algorithms=["no_such_algo"], output_dir=str(tmp_path)))


def write_run(root: Path, env_id: str, exp: str, seed: int, points: list[tuple[int, float]], tokens_per_step: int = 10):
    tracker = Tracker(root / f"{env_id}__{exp}__{seed}", {"env_id": env_id, "exp_name": exp, "seed": seed})
    for step, value in points:
        tracker.scalars({"eval/success_rate": value, "perf/generated_tokens": step * tokens_per_step}, step)
    tracker.close()


def test_plot_table_is_mean_and_std_of_last_values(tmp_path):
    write_run(tmp_path, "gridworld", "grpo_agent", 1, [(0, 0.0), (8, 0.5), (16, 1.0)])
    write_run(tmp_path, "gridworld", "grpo_agent", 2, [(0, 0.0), (8, 0.25), (16, 0.5)])
    write_run(tmp_path, "gridworld", "ppo_gae_agent", 1, [(0, 0.1), (8, 0.2)])
    runs = plot.find_runs([str(tmp_path)])
    assert len(runs) == 3
    table = plot.final_values(runs, ["eval/success_rate"])
    mean, std, n = table["gridworld / grpo_agent"]["eval/success_rate"]
    assert (mean, n) == (0.75, 2) and std == pytest.approx(0.25)  # population std of {1.0, 0.5}
    assert table["gridworld / ppo_gae_agent"]["eval/success_rate"] == (pytest.approx(0.2), 0.0, 1)
    md = plot.markdown_table(table, ["eval/success_rate"])
    assert "| gridworld / grpo_agent | 2 | 0.750 ± 0.250 |" in md


def test_plot_aggregates_on_a_common_grid_up_to_the_shortest_seed():
    grid, mean, std = plot.aggregate([(np.array([0.0, 10.0]), np.array([0.0, 1.0])),
                                      (np.array([0.0, 4.0, 8.0]), np.array([0.0, 0.8, 0.8]))])
    assert grid.tolist() == [0.0, 4.0, 8.0]  # stops at 8: the second seed never reached 10
    assert mean.tolist() == pytest.approx([0.0, (0.4 + 0.8) / 2, (0.8 + 0.8) / 2])
    assert std[1] == pytest.approx(0.2)


def test_plot_writes_table_and_figure_with_three_denominators(tmp_path):
    write_run(tmp_path / "runs", "gridworld", "grpo_agent", 1, [(0, 0.0), (8, 0.5)], tokens_per_step=7)
    run_obj = plot.find_runs([str(tmp_path / "runs")])[0]
    assert plot.x_values(run_obj, "eval/success_rate", "tokens").tolist() == [0, 56]
    assert (plot.x_values(run_obj, "eval/success_rate", "wall") >= 0).all()
    out = tmp_path / "res" / "curves"
    proc = subprocess.run([sys.executable, "benchmarks/plot.py", str(tmp_path / "runs"), "--tags", "eval/success_rate",
                           "--output", str(out)], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert "0.500 ± 0.000" in (tmp_path / "res" / "curves.md").read_text()
    png = tmp_path / "res" / "curves_eval_success_rate.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
