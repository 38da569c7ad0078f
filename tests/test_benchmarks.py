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


# --- benchmarks/rollout_speed.py ------------------------------------------------------------------------------

def tiny_speed_args(tmp_path: Path, **kw):
    from benchmarks import rollout_speed

    base = dict(model="tiny", batch_size=3, turns=[2, 3], max_turn_tokens=5, codegen_attempts=2,
                codegen_max_turn_tokens=6, temperature=0.0, single_episodes=2, fresh_process=False,
                output=str(tmp_path / "rs"))
    return rollout_speed.Args(**{**base, **kw})


def test_rollout_speed_baselines_play_the_same_episodes(tmp_path):
    from benchmarks import rollout_speed

    results = rollout_speed.main(tiny_speed_args(tmp_path))
    by = {(r["env"], r["turns"], r["method"]): r for r in results}
    assert set(by) == {("gridworld", 2, "engine"), ("gridworld", 2, "generate_batch"), ("gridworld", 3, "engine"),
                       ("gridworld", 3, "generate_batch"), ("gridworld", 3, "generate_single"), ("codegen", 2, "engine"),
                       ("codegen", 2, "generate_batch"), ("codegen", 2, "generate_single")}
    for env, n in [("gridworld", 2), ("gridworld", 3), ("codegen", 2)]:
        engine, batch, single = by[(env, n, "engine")], by[(env, n, "generate_batch")], by.get((env, n, "generate_single"))
        # greedy: (a) generates exactly the engine's tokens, and the whole token sequences match episode by episode
        assert engine["generated_tokens"] == batch["generated_tokens"] > 0
        assert engine["episode_tokens"] == batch["episode_tokens"]
        assert engine["episode_digests"] == batch["episode_digests"] and len(set(engine["episode_digests"])) == 3
        assert engine["episode_turns"] == batch["episode_turns"] == [n] * 3  # the turn limit holds; nothing ends early
        if single:  # (b) played the first two of the same episodes
            assert single["episodes"] == 2 and single["episode_digests"] == engine["episode_digests"][:2]
    # (a) re-encodes the history every turn: its tokens processed exceed the engine's, more so with more turns
    ratio = {n: by[("gridworld", n, "generate_batch")]["processed_tokens"] / by[("gridworld", n, "engine")]["processed_tokens"]
             for n in (2, 3)}
    assert 1 < ratio[2] < ratio[3]
    md = (tmp_path / "rs.md").read_text()
    for heading in ("## gridworld, 2 turns", "## gridworld, 3 turns", "## codegen, 2 turns", "## Time vs number of turns"):
        assert heading in md
    assert md.count("| (b) generate, batch 1") == 2 and "Load average" in md and "Command: `" in md
    assert len((tmp_path / "rs.jsonl").read_text().splitlines()) == 8


def test_rollout_speed_ablations_play_the_engines_episodes(tmp_path):
    """The `engine_concat` cell (the engine on transformers' DynamicCache) and the `engine_sdpa` cell (keys in the
    usual layout, SDPA) play token-identical episodes, and the engine gets its own cache back afterwards."""
    import common.rollout
    from benchmarks import rollout_speed

    methods = ["engine", "engine_concat", "engine_sdpa"]
    results = rollout_speed.main(tiny_speed_args(tmp_path, methods=methods, turns=[3], codegen_attempts=0))
    engine, concat, sdpa = sorted(results, key=lambda r: r["method"])
    assert [engine["method"], concat["method"], sdpa["method"]] == methods
    assert engine["episode_digests"] == concat["episode_digests"] == sdpa["episode_digests"]
    assert engine["generated_tokens"] > 0
    assert common.rollout.BufferedCache is not common.rollout.DynamicCache
    assert "concatenating KV cache" in (tmp_path / "rs.md").read_text()


def test_rollout_speed_bf16_engine_plays_greedy_episodes_near_the_fp32_ones(tmp_path):
    """The `engine_bf16` cell samples from a bf16 copy: it runs, writes its row, and generates as many turns; its
    greedy tokens may differ from fp32's where two logits are within bf16 rounding, so only the count is compared."""
    from benchmarks import rollout_speed

    results = rollout_speed.main(tiny_speed_args(tmp_path, methods=["engine", "engine_bf16"], turns=[3],
                                                 codegen_attempts=0))
    engine, bf16 = sorted(results, key=lambda r: r["method"])
    assert bf16["method"] == "engine_bf16" and bf16["turns_played"] == engine["turns_played"] > 0
    assert bf16["generated_tokens"] > 0 and "bf16 copy" in (tmp_path / "rs.md").read_text()


def test_rollout_speed_rejects_bad_flags(tmp_path):
    from benchmarks import rollout_speed

    for bad, flag in [({"methods": ["nope"]}, "--methods"), ({"turns": [0]}, "--turns"),
                      ({"gridworld_id": "no-such-env"}, "--gridworld-id")]:
        with pytest.raises(SystemExit, match=flag):
            rollout_speed.main(tiny_speed_args(tmp_path, **bad))


@pytest.mark.slow
def test_rollout_speed_measures_each_cell_in_a_fresh_process(tmp_path):
    from benchmarks import rollout_speed

    results = rollout_speed.main(tiny_speed_args(tmp_path, turns=[1], codegen_attempts=0, methods=["engine"],
                                                 fresh_process=True))
    assert len(results) == 1 and results[0]["peak_rss_mib"] >= results[0]["rss_after_load_mib"] > 50


# --- benchmarks/<algo>.sh: the exact commands behind each algorithm's published numbers ------------------------

REPO = Path(__file__).resolve().parents[1]
# flags whose value is a command line for other scripts: (wrapper, flag) -> the algorithms it is passed to
# (None: those named by the wrapper's --algorithms)
EMBEDDED_ARGS = {("run", "--script-args"): None, ("hybrid_three_way", "--extra-args"): ["hybrid_planner"],
                 ("offline_gridworld", "--cql-args"): ["cql"], ("offline_gridworld", "--dt-args"): ["decision_transformer"]}


def _load_script(path: Path):
    """Import a script by path (not run): the module is registered before exec so dataclass/typing can resolve it."""
    import importlib.util

    name = f"_flagcheck_{path.parent.name}_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def cli_flags(path: Path) -> set[str]:
    """The flags tyro makes from the script's `Args`: --field-name, plus --no-field-name for booleans;
    Suppress-ed (derived) and Positional fields have no flag."""
    import dataclasses
    import typing

    args_cls = _load_script(path).Args
    hints = typing.get_type_hints(args_cls, include_extras=True)
    flags = {"--help"}
    for f in dataclasses.fields(args_cls):
        hint = hints[f.name]
        if "Suppress" in f"{f.type} {hint}" or "Positional" in f"{f.type} {hint}":
            continue
        flag = "--" + f.name.replace("_", "-")
        flags.add(flag)
        bare = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
        if bare is bool:
            flags.add("--no-" + flag[2:])
    return flags


def shell_commands(text: str) -> list[tuple[Path, list[str]]]:
    """(script, arguments) of every `python [-opts] algorithms|benchmarks/<name>.py ...` in a shell script:
    `\\` continuations joined, comments dropped, a command ends at ; | & > < ( ). Shell variables ($OUT, loop
    variables) stay as literal words, which is all a flag check needs."""
    import re
    import shlex

    commands = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        if ".py" not in line or line.lstrip().startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        for i, token in enumerate(tokens):
            m = re.search(r"(?:^|/)(algorithms|benchmarks)/(\w+)\.py$", token)
            if not m:
                continue
            j = i - 1
            while j >= 0 and tokens[j].startswith("-"):  # interpreter options (python -u)
                j -= 1
            if j < 0 or tokens[j].rsplit("/", 1)[-1] not in ("python", "python3"):
                continue
            end = next((k for k in range(i + 1, len(tokens)) if set(tokens[k]) <= set(";|&<>()")), len(tokens))
            commands.append((REPO / m.group(1) / f"{m.group(2)}.py", tokens[i + 1:end]))
    return commands


def flag_problems(script: Path, args: list[str], where: str) -> list[str]:
    """Flags in `args` that `script`'s Args does not have (and those inside --script-args & co.)."""
    import shlex

    if not script.exists():
        return [f"{where}: {script.relative_to(REPO)} does not exist"]
    flags, problems = cli_flags(script), []
    listed = []  # the values of --algorithms (benchmarks/run.py)
    for k, token in enumerate(args):
        if token == "--algorithms":
            rest = args[k + 1:]
            listed = rest[:next((n for n, a in enumerate(rest) if a.startswith("-")), len(rest))]
    k = 0
    while k < len(args):
        token = args[k]
        name, eq, value = token.partition("=")
        if name.startswith("--") and not any(c.isspace() for c in name):  # not a value such as "--planner none"
            if name not in flags:
                problems.append(f"{where}: {script.relative_to(REPO)} has no flag {name}")
            elif (script.stem, name) in EMBEDDED_ARGS:
                if not eq:
                    k += 1
                    value = args[k] if k < len(args) else ""
                targets = EMBEDDED_ARGS[(script.stem, name)] or [a for a in listed if "$" not in a]
                for target in targets:
                    problems += flag_problems(REPO / "algorithms" / f"{target}.py", shlex.split(value),
                                              f"{where} ({name})")
        k += 1
    return problems


def test_every_algorithm_has_an_executable_benchmark_script():
    import os

    for algo in sorted((REPO / "algorithms").glob("*.py")):
        sh = REPO / "benchmarks" / f"{algo.stem}.sh"
        assert sh.exists(), f"{algo.name} has no benchmarks/{sh.name} (the commands behind its published numbers)"
        assert os.access(sh, os.X_OK), f"{sh.name} is not executable (chmod +x)"
        text = sh.read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text, sh.name
        assert 'cd "$(dirname "$0")/.."' in text, sh.name
        proc = subprocess.run(["bash", "-n", str(sh)], check=False, capture_output=True, text=True)
        assert proc.returncode == 0, f"{sh.name}: {proc.stderr}"
        ran = {script.relative_to(REPO).as_posix() for script, _ in shell_commands(text)}
        wrappers = ran - {"benchmarks/plot.py", "benchmarks/summarize_run.py"}
        assert f"algorithms/{algo.name}" in ran or any(w.startswith("benchmarks/") for w in wrappers), \
            f"{sh.name} runs neither algorithms/{algo.name} nor a benchmark wrapper: {sorted(ran)}"


def test_benchmark_scripts_use_only_flags_the_scripts_have():
    problems, checked = [], 0
    for sh in sorted((REPO / "benchmarks").glob("*.sh")):
        for script, args in shell_commands(sh.read_text()):
            problems += flag_problems(script, args, sh.name)
            checked += 1
    assert checked >= 2 * len(list((REPO / "algorithms").glob("*.py"))), checked  # the parser found the commands
    assert not problems, "flags that drifted away from the scripts:\n" + "\n".join(problems)


def test_flag_check_catches_drifted_flags():
    sh = """
OUT=x
for mode in cql bc; do
  OMP_NUM_THREADS=2 timed python -u algorithms/cql.py --mode "$mode" --eval-episodes=1 --no-train-backbone \\
      --output-dir "$OUT/a" --total-updatez 5  # a comment --not-a-flag
done
python benchmarks/run.py --algorithms grpo_agent star --seeds 1 2 --script-args "--total-iterations 2 --lr 3" > log
# python algorithms/cql.py --commented-out
python benchmarks/offline_gridworld.py '--cql-args=--total-updates 100 --eval-everyy 1' --dt-args "--train-steps 3"
echo python algorithms/cql.py.txt --nope
"""
    commands = shell_commands(sh)
    assert [(s.relative_to(REPO).as_posix(), a[:2]) for s, a in commands] == [
        ("algorithms/cql.py", ["--mode", "$mode"]), ("benchmarks/run.py", ["--algorithms", "grpo_agent"]),
        ("benchmarks/offline_gridworld.py", ["--cql-args=--total-updates 100 --eval-everyy 1", "--dt-args"])]
    assert commands[0][1][-2:] == ["--total-updatez", "5"] and commands[1][1][-1] == "--total-iterations 2 --lr 3"
    problems = [p for script, args in commands for p in flag_problems(script, args, "t.sh")]
    assert problems == ["t.sh: algorithms/cql.py has no flag --total-updatez",
                        "t.sh (--script-args): algorithms/grpo_agent.py has no flag --lr",
                        "t.sh (--script-args): algorithms/star.py has no flag --total-iterations",
                        "t.sh (--script-args): algorithms/star.py has no flag --lr",
                        "t.sh (--cql-args): algorithms/cql.py has no flag --eval-everyy"]
    assert "--no-save-model" in cli_flags(REPO / "algorithms" / "grpo_agent.py")
    assert "--world-size" not in cli_flags(REPO / "algorithms" / "grpo_agent.py")  # Suppress-ed: derived, no flag


def test_zero_shot_random_policy_is_the_uniform_reference(tmp_path):
    """`zero_shot.py --model random` plays a uniformly random action every step: on the seed-003 layout about 3% of
    its episodes reach a goal (3.3% over 20,000) and almost none get 90% of the optimal return (0.055%); never an
    invalid action. A policy that always took the same action, or a success/near-optimal count that was wrong, fails."""
    out = tmp_path / "random.jsonl"
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "benchmarks" / "zero_shot.py"), "--model", "random", "--episodes", "3000"]
    subprocess.run(cmd + ["--output", str(out)], check=True, capture_output=True, text=True, cwd=root)
    row = json.loads(out.read_text())
    assert 0.02 < row["success_rate"] < 0.05 and row["invalid_action_rate"] == 0.0
    assert 0.0 <= row["near_optimal_rate"] < 0.005 and 19 < row["episode_length"] <= 20
    table = subprocess.run(cmd[:2] + ["--table", str(out)], check=True, capture_output=True, text=True, cwd=root).stdout
    assert "uniformly random action" in table and "| `gridworld` | `{}` | choice | 3000 | 0.03 |" in table
    free = subprocess.run(cmd + ["--env-id", "arithmetic"], capture_output=True, text=True, cwd=root)
    assert free.returncode != 0 and "has no action names" in free.stderr and "Traceback" not in free.stderr


def _scripted_episode(env_id: str, actions: list[str]):
    """A trajectory record of `actions` played on `env_id` (seed 0), with only what gridworld_failures.py reads."""
    import envs
    from common.records import Trajectory, Turn

    env, turns, termination = envs.make(env_id), [], "truncated"
    env.reset(seed=0)
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        turns.append(Turn(action_text=action, observation=obs, reward=reward, action_valid=info["action_valid"],
                          num_action_tokens=1))
        if terminated or truncated:
            termination = info["termination"]
            break
    return Trajectory(token_ids=[], source_mask=[], behavior_logprobs=[], policy_version=0, turns=turns, rewards={},
                      return_=0.0, termination=termination, env_version="", task_id="", seed=0)


def test_gridworld_failures_tells_a_stuck_agent_from_an_oscillating_one_and_from_blocked_moves_in_different_places():
    """On the seed-003 layout (S on the left edge, row 2): 5 x left is 5 blocked moves from one cell (stuck), 4 are
    not (other); right/left x 3 is 5 reversals (oscillating); up, up and then up/right along the top row blocks 5 times but
    from 5 different cells (other); the optimal path succeeds. Every encoder gives the same classes (the visit counts
change the text after each blocked move, not the place)."""
    import envs
    from benchmarks import gridworld_failures as gf
    from envs.gridworld import ACTIONS

    top_row = ["up", "up"] + ["up", "right"] * 5
    for env_id in ("gridworld", "gridworld-relative", "gridworld-relative-visits"):
        cases = {"stuck": ["left"] * 5 + ["right"] * 3, "other": ["left"] * 4 + ["right"] * 3,
                 "oscillating": ["right", "left"] * 3}
        for expected, actions in cases.items():
            assert gf.classify(_scripted_episode(env_id, actions)) == expected, (env_id, expected)
        along_the_top = _scripted_episode(env_id, top_row)
        assert sum(t.observation.startswith("Blocked:") for t in along_the_top.turns) == 5
        assert gf.classify(along_the_top) == "other"
    env = envs.make("gridworld")
    env.reset(seed=0)
    optimal = []
    while not optimal or not optimal[-1][1]:
        action = ACTIONS[env.optimal_action()]
        optimal.append((action, env.step(action)[2]))
    success = _scripted_episode("gridworld", [a for a, _ in optimal])
    assert gf.classify(success) == "success" and gf.blocked_share([success]) == 0.0
    assert gf.blocked_share([_scripted_episode("gridworld", ["left"] * 4 + ["right"] * 3)]) == pytest.approx(4 / 7)
    assert gf.most_frequent_move([_scripted_episode("gridworld", ["left"] * 4 + ["right"] * 3)]) == "left (57%)"


def test_babyai_failures_counts_a_failure_as_having_seen_its_target_only_when_the_target_itself_was_in_view():
    """A red box or the mission line naming the red ball is not seeing it; "a red ball 2 steps forward" is. Steps per
    success and move shares are over the episodes given; the mission format is pinned on a real BabyAI episode."""
    from benchmarks import babyai_failures as bf
    from common.records import Trajectory, Turn

    def episode(observations: list[str], actions: list[str], termination: str) -> Trajectory:
        turns = [Turn(action_text=a, observation=o, reward=0.0, action_valid=True, num_action_tokens=1)
                 for a, o in zip(actions, observations)]
        return Trajectory(token_ids=[], source_mask=[], behavior_logprobs=[], policy_version=0, turns=turns,
                          rewards={}, return_=0.0, termination=termination, env_version="", task_id="", seed=0)

    line = "Step {}/24. Mission: go to the red ball.\nYou see {}."
    decoys = episode([line.format(1, "a red box 1 step left; a grey ball 2 steps forward"),
                      line.format(2, "nothing but the floor")], ["turn left", "go forward"], "truncated")
    seen = episode([line.format(1, "a grey key 1 step right"), line.format(2, "a red ball 2 steps forward")],
                   ["go forward", "go forward"], "truncated")
    success = episode([line.format(k, "a red ball 1 step forward") for k in (1, 2, 3)],
                      ["turn right", "go forward", "go forward"], "success")
    assert bf.mission_object(decoys) == "red ball"
    assert not bf.saw_target(decoys) and bf.saw_target(seen)
    assert [(m, round(s, 3)) for m, s in bf.move_shares([decoys, seen, success])] == [
        ("go forward", 0.714), ("turn left", 0.143), ("turn right", 0.143)]
    assert bf.summary_row("f", [decoys, seen, success]) == (
        "| f | 3 | 1 | 3.0 | 1 of 2 | go forward 71%, turn left 14%, turn right 14% |")
    assert bf.summary_row("f", [decoys]) == "| f | 1 | 0 |  | 0 of 1 | turn left 50%, go forward 50% |"
    pytest.importorskip("minigrid", reason="BabyAI needs minigrid: pip install minigrid==3.2.0")
    real = _scripted_episode("babyai-gotoredball", ["turn left"] * 4)
    assert bf.mission_object(real) == "red ball" and len(real.turns) == 4


def test_zero_shot_keeps_trajectories_that_gridworld_failures_reads(tmp_path):
    """`--trajectories` writes one valid record per episode; gridworld_failures.py puts every episode in one class."""
    root = Path(__file__).resolve().parents[1]
    records = tmp_path / "greedy.jsonl"
    cmd = [sys.executable, str(root / "benchmarks" / "zero_shot.py"), "--model", "tiny", "--env-id", "gridworld-relative",
           "--episodes", "3", "--temperature", "0", "--trajectories", str(records)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=root)
    assert len(records.read_text().splitlines()) == 3
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "gridworld_failures.py"), str(records)],
                         check=True, capture_output=True, text=True, cwd=root).stdout
    row = out.strip().splitlines()[-1].split(" | ")
    assert row[1] == "3" and sum(int(cell) for cell in row[2:6]) == 3 and row[6].endswith("% of moves")
    assert row[7].split(" (")[0] in ("up", "down", "left", "right") and row[7].endswith("%) |")
    # `--mask-illegal-actions`: the same policy never makes a blocked move, and its rows say so
    masked, row_file = tmp_path / "masked.jsonl", tmp_path / "masked_row.jsonl"
    subprocess.run(cmd[:-1] + [str(masked), "--mask-illegal-actions", "--output", str(row_file)], check=True,
                   capture_output=True, text=True, cwd=root)
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "gridworld_failures.py"), str(masked)],
                         check=True, capture_output=True, text=True, cwd=root).stdout
    row = out.strip().splitlines()[-1].split(" | ")
    assert row[2] == "0" and row[6] == "0% of moves", out  # no episode stuck on a blocked move; no blocked move at all
    table = subprocess.run(cmd[:2] + ["--table", str(row_file)], check=True, capture_output=True, text=True, cwd=root)
    assert "| `gridworld-relative` | `{}` | choice (legal only) | 3 |" in table.stdout
    no_lm = subprocess.run(cmd[:2] + ["--model", "random", "--trajectories", str(records)], capture_output=True,
                           text=True, cwd=root)
    assert no_lm.returncode != 0 and "keeps no records" in no_lm.stderr and "Traceback" not in no_lm.stderr
    missing = subprocess.run([sys.executable, str(root / "benchmarks" / "gridworld_failures.py"), str(tmp_path / "no")],
                             capture_output=True, text=True, cwd=root)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr


def test_decode_step_times_every_configuration_and_rejects_bad_flags(tmp_path):
    """decode_step.py times the engine's kernels, SDPA and the plain loop at each context length and writes both
    files."""
    from benchmarks import decode_step

    args = decode_step.Args(model="tiny", batch_size=3, contexts=[8, 40], steps=2, repeats=2, output=str(tmp_path / "ds"))
    results = decode_step.main(args)
    assert sorted((r["context"], r["config"]) for r in results) == sorted((c, n) for c in (8, 40) for n in decode_step.CONFIGS)
    assert all(r["step_ms"] > 0 and r["tok_s"] == pytest.approx(3000 / r["step_ms"]) for r in results)
    md = (tmp_path / "ds.md").read_text()
    assert md.count("\n| 8 |") == 1 and md.count("\n| 40 |") == 1 and "Command: `" in md
    assert len((tmp_path / "ds.jsonl").read_text().splitlines()) == 2 * len(decode_step.CONFIGS) == 8
    with pytest.raises(SystemExit, match="--contexts"):
        decode_step.main(decode_step.Args(model="tiny", contexts=[0], output=""))


def test_update_step_times_both_precisions_and_measures_what_bf16_changes(tmp_path):
    """update_step.py times one update epoch in fp32 and under bf16 autocast for each trained-layer count, and
    measures the bf16 log-prob gap (more than 0: the autocast took effect; small: the same model) and how closely
    the bf16 gradient points along the fp32 one."""
    from benchmarks import update_step

    args = update_step.Args(model="tiny", episodes=2, trainable_layers=[1, 0], micro_batch_size=1, repeats=1,
                            output=str(tmp_path / "us"))
    results = update_step.main(args)
    assert [r["trainable_layers"] for r in results] == [1, 2]  # 0: all of tiny's 2 layers
    for r in results:
        assert r["fp32_s"] > 0 and r["bf16_s"] > 0 and r["policy_units"] > 0
        assert 0 < r["logprob_gap_mean"] <= r["logprob_gap_max"] < 0.05
        assert 0.99 < r["grad_cosine"] <= 1 + 1e-9 and 0.9 < r["grad_norm_ratio"] < 1.1
    md = (tmp_path / "us.md").read_text()
    assert md.count("\n| 1 |") == 1 and md.count("\n| 2 |") == 1 and "Command: `" in md
    assert len((tmp_path / "us.jsonl").read_text().splitlines()) == 2
    with pytest.raises(SystemExit, match="--trainable-layers"):
        update_step.main(update_step.Args(model="tiny", trainable_layers=[-1], output=""))


def test_every_committed_zero_shot_result_renders_and_families_md_is_current():
    """`zero_shot.py --table` reads every JSONL it ever wrote (rows from before env_id / action_mode / env_kwargs
    became top-level keys included), and the committed families table is what --table makes of its JSONL today."""
    from benchmarks import zero_shot

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for path in sorted(results.glob("zero_shot_*.jsonl")):
        rows = [line for line in path.read_text().splitlines() if line.strip()]
        assert zero_shot.markdown_table(str(path)).count("\n| `") == len(rows), path.name
    assert "| `gridworld` | `{}` | free | 50 | 0.00 |" in zero_shot.markdown_table(str(results / "zero_shot_gridworld.jsonl"))
    families = zero_shot.markdown_table(str(results / "zero_shot_families.jsonl"))
    assert (results / "zero_shot_families.md").read_text() == families
