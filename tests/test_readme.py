"""The README's measured numbers are the ones benchmarks/readme.py renders from benchmarks/results/ (none typed by hand)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import readme

ROOT = Path(__file__).resolve().parents[1]


def run_readme(*flags):
    return subprocess.run([sys.executable, "benchmarks/readme.py", *flags], cwd=ROOT, capture_output=True, text=True)


def test_readme_blocks_are_current():
    result = run_readme("--check")
    assert result.returncode == 0, result.stdout + result.stderr
    text = (ROOT / "README.md").read_text()
    for name in readme.BLOCKS:  # every generator has its place in the README
        assert f"<!-- generated: {name} -->" in text


def test_a_hand_edited_number_is_caught(tmp_path):
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- generated: main-job -->")[1].split("<!-- end generated: main-job -->")[0]
    edited = block.replace("| greedy success rate | 0.00", "| greedy success rate | 0.90", 1)
    assert edited != block
    bad = tmp_path / "README.md"
    bad.write_text(text.replace(block, edited))
    result = run_readme("--check", "--readme", str(bad))
    assert result.returncode == 1 and "main-job" in result.stdout
    assert run_readme("--readme", str(bad)).returncode == 0  # regenerating repairs it
    assert bad.read_text() == text


def test_markdown_tables_drop_separator_rows():
    text = "intro\n\n| a | b |\n| --- | ---: |\n| 1 | 2 |\n\nmiddle\n| x |\n|-|\n| y |\n"
    assert readme.markdown_tables(text) == [[["a", "b"], ["1", "2"]], [["x"], ["y"]]]


def test_record_tests_reads_the_pytest_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(readme, "RESULTS", tmp_path)
    log = tmp_path / "ci.log"
    log.write_text("....\n626 passed, 7 skipped, 4 deselected in 1124.30s (0:18:44)\n")
    readme.record_tests(str(log))
    stored = json.loads((tmp_path / "test_suite.json").read_text())
    assert (stored["passed"], stored["skipped"], stored["seconds"]) == (626, 7, 1124.30)
    log.write_text("..F.\n1 failed, 625 passed, 7 skipped in 1100.00s\n")
    with pytest.raises(SystemExit, match="all-green"):
        readme.record_tests(str(log))


def test_babyai_shaping_block_groups_rows_by_training_env_and_seed_and_spreads_over_seeds(tmp_path, monkeypatch):
    """Each trained model's row lands under its run's env id and seed and under its temperature's column; the mean ±
    std is over seeds (ddof = 1); a later row for the same model and temperature replaces the earlier one."""
    monkeypatch.setattr(readme, "RESULTS", tmp_path)
    assert "Not measured yet" in readme.babyai_shaping()

    def row(env_id: str, seed: int, temperature: float, success: float) -> str:
        model = f"runs/x/{env_id}__exp__{seed}__17964/model"
        return json.dumps({"success_rate": success, "settings": {"model": model, "temperature": temperature}})
    (tmp_path / "ppo_gae_agent_babyai_shaped.jsonl").write_text("\n".join([
        row("babyai-gotoredball-shaped", 1, 0.0, 0.50), row("babyai-gotoredball-shaped", 2, 0.0, 0.10),
        row("babyai-gotoredball", 1, 0.0, 0.30), row("babyai-gotoredball-shaped", 2, 0.0, 0.20)]) + "\n")
    (tmp_path / "ppo_gae_agent_babyai_sampled.jsonl").write_text(row("babyai-gotoredball", 1, 2.0, 0.40) + "\n")
    header, *rows = readme.markdown_tables(readme.babyai_shaping())[0]
    assert header == ["trained on", "seed", "greedy", "sampled, T = 2"]
    assert rows == [["`babyai-gotoredball-shaped`", "1", "50%", ""], ["`babyai-gotoredball-shaped`", "2", "20%", ""],
                    ["`babyai-gotoredball-shaped`", "**mean ± std**", "35% ± 21 (2 seeds)", ""],
                    ["`babyai-gotoredball`", "1", "30%", "40%"], ["`babyai-gotoredball`", "**mean ± std**", "30%", "40%"]]
    note = readme.babyai_shaping().split("\n\n")[-1]
    assert "A blank cell was not measured." in note and "--temperature T" in note  # the shaped seeds lack T = 2 rows
    (tmp_path / "ppo_gae_agent_babyai_sampled.jsonl").unlink()
    only_greedy = readme.babyai_shaping().split("\n\n")[-1]
    assert "blank cell" not in only_greedy and "--temperature T" not in only_greedy


def test_ppo_procedural_block_reads_repeated_tests_of_one_model_as_longer_training(tmp_path, monkeypatch):
    """The k-th held-out test of the same model at one temperature is its k-th training length; train-split rows and
    other temperatures stay out of the row; the seed comes from the run name (or a copied model's `seedN`)."""
    monkeypatch.setattr(readme, "RESULTS", tmp_path)
    monkeypatch.setattr(readme, "PROCEDURAL_PPO", [("a.jsonl", "`-shaped`", 0.0, [400, 800], "SWITCH_A (part 1)"),
                                                   ("a.jsonl", "`-shaped`", 1.0, [400], "SWITCH_A (part 1)")])

    def row(model: str, split: str, temperature: float, success: float) -> str:
        return json.dumps({"success_rate": success, "settings": {
            "model": model, "temperature": temperature, "env_kwargs": json.dumps({"split": split})}})
    one, two = "runs/x/gridworld-procedural-relative-shaped__e__1__17963/model", "runs/x/model_200_seed2"
    (tmp_path / "a.jsonl").write_text("\n".join([
        row(one, "test", 0.0, 0.60), row(one, "train", 0.0, 0.48), row(two, "test", 0.0, 0.20),
        row(one, "test", 1.0, 0.50), row(one, "test", 0.0, 0.58)]) + "\n")
    header, *rows = readme.markdown_tables(readme.ppo_procedural())[0]
    assert header[:7] == ["trained on", "episodes", "evaluated", "seed 1", "seed 2", "seed 3", "mean ± std"]
    assert rows == [["`-shaped`", "400", "greedy", "60%", "20%", "", "40% ± 28 (2 seeds)", "`SWITCH_A=1` (part 1)"],
                    ["`-shaped`", "800", "greedy", "58%", "", "", "58%", "`SWITCH_A=1` (part 1)"],
                    ["`-shaped`", "400", "T = 1", "50%", "", "", "50%", "`SWITCH_A=1` (part 1)"]]
    with open(tmp_path / "a.jsonl", "a") as f:  # a third greedy test of seed 1: more tests than training lengths
        f.write(row(one, "test", 0.0, 0.70) + "\n")
    with pytest.raises(SystemExit, match="more tests than"):
        readme.ppo_procedural()
