"""AgentQ's pieces: the DPO loss against hand-computed values, the tree's Q backup and UCB1, preference
pairs that share their prefix token for token, DPO learning on `tiny`, and `--model tiny` runs: two iterations,
checkpoint + resume == one uninterrupted run, a corrupt checkpoint, Ctrl-C, and LoRA (base frozen, adapter saved)."""

import dataclasses
import importlib.util
import json
import math
import runpy
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import envs
from common import checkpoint as ck
from common.chat import ChatFormat
from common.tracking import read_scalars
from tests.distributed_runs import assert_fsdp_matches_data_parallel

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "algorithms" / "agentq_dpo.py"
spec = importlib.util.spec_from_file_location("agentq_dpo", ROOT / "algorithms" / "agentq_dpo.py")
agentq = importlib.util.module_from_spec(spec)
sys.modules["agentq_dpo"] = agentq
spec.loader.exec_module(agentq)


def test_dpo_loss_hand_computed():
    logp_w = torch.tensor([-1.0, -2.0], requires_grad=True)
    logp_l = torch.tensor([-1.5, -1.0])
    ref_w, ref_l = torch.tensor([-1.2, -2.0]), torch.tensor([-1.4, -1.5])
    loss, chosen_r, rejected_r = agentq.dpo_loss(logp_w, logp_l, ref_w, ref_l, beta=0.1)
    # pair 0: 0.1 * ((-1.0 + 1.2) - (-1.5 + 1.4)) = 0.03;  pair 1: 0.1 * ((-2.0 + 2.0) - (-1.0 + 1.5)) = -0.05
    expected = (math.log(1 + math.exp(-0.03)) + math.log(1 + math.exp(0.05))) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert chosen_r.tolist() == pytest.approx([0.02, 0.0], abs=1e-6)
    assert rejected_r.tolist() == pytest.approx([-0.01, 0.05], abs=1e-6)
    loss.backward()  # d/d logp_w of -log sigma(m) / 2 = -beta * sigma(-m) / 2
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert logp_w.grad.tolist() == pytest.approx([-0.05 * sig(-0.03), -0.05 * sig(0.05)], abs=1e-6)


def test_policy_equal_to_reference_gives_log_two():
    x = torch.tensor([-3.0, -0.5, -7.0])
    loss, c, r = agentq.dpo_loss(x, x - 1, x, x - 1, beta=0.5)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7) and c.abs().max() == 0 and r.abs().max() == 0


def test_backup_and_ucb1_hand_computed():
    nodes = [agentq.Node(prefix=[0], snapshot=None)] + [agentq.Node(prefix=[0], snapshot=None, reward=r) for r in (1, -0.5, 2)]
    ret = agentq.backup(nodes, gamma=0.5)
    # returns-to-go: 2; -0.5 + 0.5 * 2 = 0.5; 1 + 0.5 * 0.5 = 1.25
    assert ret == pytest.approx(1.25)
    assert [n.q for n in nodes[1:]] == pytest.approx([1.25, 0.5, 2.0])
    assert all(n.visits == 1 for n in nodes)
    parent, child = agentq.Node(prefix=[], snapshot=None, visits=8), agentq.Node(prefix=[], snapshot=None, visits=2, value_sum=3.0)
    assert agentq.ucb1(parent, child, 1.5) == pytest.approx(1.5 + 1.5 * math.sqrt(math.log(8) / 2))
    assert agentq.ucb1(parent, agentq.Node(prefix=[], snapshot=None), 1.5) == math.inf


def _search(tiny, env_id, **flags):
    model, tok = tiny
    args = agentq.Args(model="tiny", env_id=env_id, **flags)
    mode = "choice" if getattr(envs.make(env_id), "action_names", None) else "free"
    chat = ChatFormat(tok)
    env_list = [envs.make(env_id) for _ in range(args.num_tasks)]
    seeds = list(range(args.num_tasks))
    roots, sims, _ = agentq.search(model, chat, env_list, seeds, args, mode, torch.Generator().manual_seed(0))
    return chat, mode, roots, sims, seeds


def _replayed_prefixes(chat, env_id, seed, root):
    """Every node's prefix rebuilt by playing its actions linearly in a fresh env (no snapshot/restore)."""
    out = []

    def walk(node, actions):
        env = envs.make(env_id)
        obs, _ = env.reset(seed=seed)
        ids = chat.prompt_ids(env.system_prompt, obs)
        for a in actions:
            obs, *_ = env.step(a.choice_index if a.choice_index >= 0 else a.action_text)
            ids = ids + a.action_ids + chat.next_turn_ids(obs, bool(a.action_ids) and a.action_ids[-1] == chat.eos_id)
        out.append((node, ids))
        for c in node.children:
            walk(c, actions + [c])

    walk(root, [])
    return out


@pytest.mark.parametrize("env_id,flags", [
    ("gridworld", dict(num_tasks=2, num_simulations=5, max_depth=5, num_candidates=3, expansion="sample", min_q_gap=0.0)),
    ("workspace", dict(num_tasks=1, num_simulations=3, max_depth=2, max_turn_tokens=6, min_q_gap=0.0)),
], ids=["gridworld-choice", "workspace-free"])
def test_tree_and_pairs_share_prefix_token_for_token(tiny, env_id, flags):
    chat, mode, roots, sims, seeds = _search(tiny, env_id, **flags)
    args = agentq.Args(**flags)
    for root, tree, seed in zip(roots, sims, seeds):
        assert len(tree) == args.num_simulations and root.visits == args.num_simulations
        # the tree built with snapshot/restore holds exactly the ids a linear replay produces
        for node, ids in _replayed_prefixes(chat, env_id, seed, root):
            assert node.prefix == ids
            assert len(node.children) <= args.num_candidates
            if node.children and not node.done:  # visits of the children add up (each simulation goes through one)
                assert sum(c.visits for c in node.children) == node.visits
        for path, ret in tree:  # a simulation's return is the sum of its rewards (gamma = 1)
            assert ret == pytest.approx(sum(n.reward for n in path[1:]))
        candidates = [chat.encode(n) for n in envs.make(env_id).action_names] if mode == "choice" else None
        pairs = agentq.step_pairs(root, candidates, mode, 0.0)
        assert pairs, "ties are kept with --min-q-gap 0: every branching node gives a pair"
        for p in pairs:
            n = p.prefix_len
            assert p.chosen.token_ids[:n] == p.rejected.token_ids[:n]  # same prefix, token for token
            assert p.chosen.token_ids[n:] != p.rejected.token_ids[n:]  # different action at the step
            for rec in (p.chosen, p.rejected):
                rec.validate()
                assert rec.policy_token_spans() == [(n, len(rec.token_ids))]  # only the action is trained on
                if mode == "choice":
                    assert [s.position for s in rec.choice_steps] == [n]
            assert p.gap >= 0
        for p in agentq.trajectory_pair(tree, candidates, mode, 0.0):
            n = p.prefix_len
            assert p.chosen.token_ids[:n] == p.rejected.token_ids[:n]
            first_w, first_l = p.chosen.policy_token_spans()[0], p.rejected.policy_token_spans()[0]
            assert first_w[0] == first_l[0] == n
            assert p.chosen.token_ids[slice(*first_w)] != p.rejected.token_ids[slice(*first_l)]


def test_step_pair_logprob_is_the_choice_policy(tiny):
    """log pi(y|x) of a choice-mode pair record = log softmax over the action names after the exact prefix."""
    model, tok = tiny
    chat, mode, roots, _, _ = _search(tiny, "gridworld", num_tasks=1, num_simulations=3, max_depth=3, min_q_gap=0.0)
    names = envs.make("gridworld").action_names
    candidates = [chat.encode(n) for n in names]
    pair = agentq.step_pairs(roots[0], candidates, mode, 0.0)[0]
    with torch.no_grad():
        got = agentq.sequence_logprobs(model, [pair.chosen, pair.rejected], mode, True)
        prefix, scores = pair.chosen.token_ids[:pair.prefix_len], []
        for cand in candidates:  # joint log-prob of the name's tokens (byte-level: several), / token count
            logp = F.log_softmax(model(input_ids=torch.tensor([prefix + cand])).logits[0], -1)
            scores.append(sum(logp[len(prefix) - 1 + j, t] for j, t in enumerate(cand)) / len(cand))
        by_hand = F.log_softmax(torch.stack(scores), -1)
        merged = agentq.pair_logprobs(model, [pair], mode, True)  # one forward of the prefix for both actions
    chosen, rejected = pair.chosen.choice_steps[0].chosen, pair.rejected.choice_steps[0].chosen
    assert got.tolist() == pytest.approx([by_hand[chosen].item(), by_hand[rejected].item()], abs=1e-5)
    assert merged[0].tolist() == pytest.approx(got.tolist(), abs=1e-5)


def test_dpo_steps_separate_chosen_from_rejected(tiny):
    """Learning check: a few DPO steps on one iteration's pairs raise every pair's implicit-reward margin."""
    model, tok = tiny
    chat, mode, roots, _, _ = _search(tiny, "gridworld", num_tasks=2, num_simulations=3, max_depth=2, min_q_gap=0.0)
    candidates = [chat.encode(n) for n in envs.make("gridworld").action_names]
    pairs = [p for r in roots for p in agentq.step_pairs(r, candidates, mode, 0.0)]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            ref = agentq.pair_logprobs(model, pairs, mode, True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(8):
            logp = agentq.pair_logprobs(model, pairs, mode, True)
            loss, c, r = agentq.dpo_loss(logp[:, 0], logp[:, 1], ref[:, 0], ref[:, 1], beta=0.5)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"DPO on {len(pairs)} tiny pairs: loss {math.log(2):.3f} -> {loss.item():.3f}")
        assert loss.item() < 0.5 * math.log(2)
        assert bool((c > r).all())  # implicit reward accuracy 1
    finally:
        model.load_state_dict(state)


def test_tiny_run_two_iterations(tmp_path):
    cmd = [sys.executable, str(ROOT / "algorithms" / "agentq_dpo.py"), "--model", "tiny", "--output-dir", str(tmp_path),
           "--total-iterations", "2", "--num-tasks", "2", "--num-simulations", "3", "--max-depth", "4", "--dpo-epochs", "2",
           "--min-q-gap", "0", "--pairs-per-step", "64", "--eval-episodes", "1", "--pair-level", "both"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    scalars = read_scalars(run_dir)
    assert [s for s, _ in scalars["eval/success_rate"]] == [0, 1, 2]  # before training and after each iteration
    assert [s for s, _ in scalars["charts/num_pairs"]] == [1, 2] and all(v > 0 for _, v in scalars["charts/num_pairs"])
    assert scalars["charts/num_step_pairs"][0][1] < scalars["charts/num_pairs"][0][1]  # trajectory pairs too
    # iteration 1: the policy is still the reference, and all pairs are one batch -> loss ln 2, margins 0
    assert scalars["losses/dpo_loss"][0][1] == pytest.approx(math.log(2), abs=1e-6)
    assert scalars["diagnostics/reward_accuracy"][0][1] == 0.0
    # iteration 2: the policy has moved away from the reference
    assert scalars["diagnostics/chosen_reward"][1][1] != 0.0
    assert "iter 2/2" in proc.stdout



# seed 1: the searches' returns differ between iterations and trees (non-zero Q gaps), and with 6 pairs in steps
# of 2 the shuffle (python RNG) and AdamW's moments shape every iteration after the first
RESUME_FLAGS = ["--model", "tiny", "--seed", "1", "--num-tasks", "2", "--num-simulations", "4", "--max-depth", "8",
                "--dpo-epochs", "2", "--pairs-per-step", "2", "--min-q-gap", "0", "--eval-episodes", "1",
                "--learning-rate", "1e-2"]


def run_main(monkeypatch, *flags: str) -> dict:
    """The script's main, in this process (a subprocess would pay ~5 s of imports per run); returns its globals."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *flags])
    return runpy.run_path(str(SCRIPT), run_name="__main__")


def only_run_dir(path: Path) -> Path:
    (run_dir,) = [p for p in path.iterdir() if p.is_dir()]
    return run_dir


def wall_clock(tag: str) -> bool:
    return tag.startswith("perf/") and tag.endswith(("_s", "_per_s"))


def test_resume_matches_an_uninterrupted_run(tmp_path, monkeypatch, capsys):
    """3 iterations in one go == 1 iteration with --checkpoint-every 1, then --resume to 3: every logged number
    but wall-clock, at the same steps (weights, AdamW moments, the search and shuffle RNGs all restored)."""
    run_main(monkeypatch, *RESUME_FLAGS, "--total-iterations", "3", "--output-dir", str(tmp_path / "a"))
    reference = read_scalars(only_run_dir(tmp_path / "a"))
    run_main(monkeypatch, *RESUME_FLAGS, "--total-iterations", "1", "--checkpoint-every", "1", "--output-dir",
             str(tmp_path / "b"))
    run_dir = only_run_dir(tmp_path / "b")
    assert json.loads((run_dir / "checkpoint.json").read_text())["iteration"] == 1
    state = ck.load_checkpoint(run_dir)
    assert state["optimizer"]["state"] and set(state["rng"][0]["generators"]) == {"search", "shuffle"}
    capsys.readouterr()
    run_main(monkeypatch, "--resume", str(run_dir), "--total-iterations", "3")
    out = capsys.readouterr().out
    assert f"resumed from {run_dir} at iteration 1" in out and "iter 1/" not in out and "eval @ iter 0" not in out
    assert "iter 3/3" in out and json.loads((run_dir / "checkpoint.json").read_text())["iteration"] == 3
    resumed = read_scalars(run_dir)
    assert set(resumed) == set(reference)
    for tag in (t for t in reference if not wall_clock(t)):
        assert [s for s, _ in resumed[tag]] == [s for s, _ in reference[tag]], tag  # nothing duplicated or missing
        assert [v for _, v in resumed[tag]] == pytest.approx([v for _, v in reference[tag]], rel=0, abs=1e-6), tag
    # the comparison has teeth: the search outcome changes over the iterations, and every iteration trained
    assert len({v for _, v in reference["charts/episodic_return"]}) > 1
    assert all(v > 0 for _, v in reference["diagnostics/grad_norm"])
    assert reference["diagnostics/chosen_reward"][2][1] != 0.0


def test_corrupt_checkpoint_and_changed_flags_fail_with_one_line(tmp_path, monkeypatch):
    """Each fails before a model is loaded, with a SystemExit whose message is the one line the user sees."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "args.json").write_text(json.dumps(dataclasses.asdict(agentq.Args(model="tiny", total_iterations=3))))
    path = ck.save_checkpoint(run_dir, {"weights": torch.arange(10_000.0)}, iteration=2)
    path.write_bytes(path.read_bytes()[:20_000])  # truncated
    with pytest.raises(SystemExit, match=f"checkpoint file {path} is truncated or corrupt"):
        run_main(monkeypatch, "--resume", str(run_dir))
    with pytest.raises(SystemExit, match="only .*may change, not --beta"):  # a flag that changes the algorithm
        run_main(monkeypatch, "--resume", str(run_dir), "--beta", "0.5")
    ck.save_checkpoint(run_dir, {"format": ck.FORMAT, "rng": [{}], "counters": {"iteration": 2}}, iteration=2)
    with pytest.raises(SystemExit, match="--total-iterations 1: the checkpoint is at iteration 2"):
        run_main(monkeypatch, "--resume", str(run_dir), "--total-iterations", "1")
    with pytest.raises(SystemExit, match="--lora-r must be >= 0"):
        agentq.validate_args(agentq.Args(lora_r=-1))
    with pytest.raises(SystemExit, match="--checkpoint-every must be >= 0"):
        agentq.validate_args(agentq.Args(checkpoint_every=-2))


def test_ctrl_c_finishes_the_iteration_saves_and_exits_130(tmp_path, monkeypatch, capsys):
    class CtrlCInFirstIteration(ck.GracefulInterrupt):
        def should_stop(self):  # a real SIGINT, once the script's handler is known to be the one installed
            if not self.requested:
                assert signal.getsignal(signal.SIGINT) == self._handle
                signal.raise_signal(signal.SIGINT)
            return super().should_stop()

    monkeypatch.setattr(ck, "GracefulInterrupt", CtrlCInFirstIteration)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exit_info:
            run_main(monkeypatch, *agentq.SMOKE_TEST_ARGS, "--model", "tiny", "--total-iterations", "50", "--output-dir",
                     str(tmp_path))
    finally:  # the script exits (130) with its handlers in place: give pytest its Ctrl-C back
        for s, handler in previous.items():
            signal.signal(s, handler)
    out, run_dir = capsys.readouterr().out, only_run_dir(tmp_path)
    assert exit_info.value.code == 130 and "SIGINT: finishing this iteration" in out
    assert json.loads((run_dir / "checkpoint.json").read_text())["iteration"] == 1  # periodic saving was off
    assert f"checkpoint saved in {run_dir} (iteration 1)" in out and "iter 2/50" not in out
    assert f"--resume {run_dir}" in out


def test_lora_trains_only_the_adapter_and_saves_it(tmp_path, monkeypatch):
    """With --lora-r the base weights stay bit for bit those of the initial model, the reference is the same
    model with its adapters off, and --save-model writes the adapter only, which load_model rebuilds."""
    from safetensors import safe_open

    from common.models import adapter_disabled, is_peft, load_model

    run = run_main(monkeypatch, "--model", "tiny", "--output-dir", str(tmp_path), *agentq.SMOKE_TEST_ARGS,
                   "--lora-r", "4", "--learning-rate", "1e-2", "--save-model")
    model = run["model"]
    assert is_peft(model) and run["ref_model"] is model  # no second copy of the weights
    assert all(("lora_A" in n or "lora_B" in n) == p.requires_grad for n, p in model.named_parameters())
    base, tok = load_model("tiny", "cpu", seed=agentq.Args.seed)  # the run's initial weights
    after = {k.replace("base_model.model.", "", 1).replace(".base_layer", ""): v
             for k, v in model.state_dict().items() if "lora_" not in k}
    assert set(after) == set(base.state_dict())
    assert [k for k, v in base.state_dict().items() if not torch.equal(v, after[k])] == []  # the base did not move
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # B = 0 at the start: trained
    ids = torch.tensor([tok.encode("<|im_start|>user\nmove up<|im_end|>")])
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        with adapter_disabled(model) as ref:
            assert torch.equal(ref(input_ids=ids).logits, base(input_ids=ids).logits)  # the reference = initial policy
        assert not torch.allclose(trained, base(input_ids=ids).logits)
    saved = only_run_dir(tmp_path) / "model"
    names = {p.name for p in saved.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "agentrl_base.json"} <= names
    assert not names & {"model.safetensors", "pytorch_model.bin", "config.json"}
    with safe_open(str(saved / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_A" in k or "lora_B" in k for k in keys)
    loaded, _ = load_model(str(saved), "cpu")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained)


def test_tasks_must_split_evenly_over_torchrun_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets; validate_args reads it before any process group
    with pytest.raises(SystemExit, match="--num-tasks 3 must be divisible by the 2 processes"):
        agentq.validate_args(agentq.Args(num_tasks=3))
    agentq.validate_args(agentq.Args(num_tasks=4))


def test_torchrun_two_ranks_equal_one_process_and_stay_in_sync(tmp_path):
    """1 process searching 4 trees vs 2 gloo ranks searching 2 each, then DPO on all 4 trees' pairs (each minibatch
    split over the ranks, gradients summed). `--expansion top` makes the search free of random draws, so both runs
    must grow the same trees, find the same pairs and log the same losses, margins and gradient norms (up to float
    noise: the ranks batch fewer rows, so padding differs), with the ranks' weights identical after every update."""
    flags = ["--model", "tiny", "--seed", "1", "--num-tasks", "4", "--num-simulations", "4", "--max-depth", "6",
             "--expansion", "top", "--dpo-epochs", "2", "--pairs-per-step", "3", "--min-q-gap", "0", "--eval-episodes",
             "2", "--learning-rate", "1e-2", "--total-iterations", "2"]
    one = subprocess.Popen([sys.executable, str(SCRIPT), *flags, "--output-dir", str(tmp_path / "one")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with socket.socket() as s:  # a free port: other tests may run torchrun at the same time
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(port), str(SCRIPT), *flags, "--save-model", "--output-dir", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    assert two.stdout.count("iter 2/2") == 1  # print0
    _, err = one.communicate(timeout=600)
    assert one.returncode == 0, err[-3000:]
    run_dir = only_run_dir(tmp_path / "two")  # rank 0 alone writes
    assert (run_dir / "model").is_dir()
    got, expected = read_scalars(run_dir), read_scalars(only_run_dir(tmp_path / "one"))
    assert got["diagnostics/rank_param_divergence"] == [(1, 0.0), (2, 0.0)]
    for tag in ("charts/num_pairs", "charts/episodic_return", "diagnostics/tree_nodes", "losses/dpo_loss",
                "diagnostics/reward_margin", "diagnostics/grad_norm", "eval/episodic_return"):
        assert [s for s, _ in got[tag]] == [s for s, _ in expected[tag]], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in expected[tag]], rel=1e-4, abs=1e-5), tag
    # teeth: pairs were found and trained on, and the second iteration saw a policy that had moved
    assert all(v > 0 for _, v in expected["charts/num_pairs"]) and expected["diagnostics/reward_margin"][1][1] != 0.0


def test_fsdp_takes_the_data_parallel_steps(tmp_path):
    """The same 2-rank run with --fsdp (decoder layers sharded; whole weights gathered for the search, the reference
    pass and the evaluation): the same trees, pairs, DPO losses, margins and gradient norms, and the same saved
    weights. Minibatches of 3 pairs split j mod 2 leave one rank without pairs in some minibatches; it joins the
    sharded collectives with a zero-weight pass (without it the run hangs)."""
    flags = ["--model", "tiny", "--seed", "1", "--num-tasks", "4", "--num-simulations", "4", "--max-depth", "6",
             "--expansion", "top", "--dpo-epochs", "2", "--pairs-per-step", "3", "--min-q-gap", "0", "--eval-episodes",
             "2", "--learning-rate", "1e-2", "--total-iterations", "2", "--save-model"]
    _, expected = assert_fsdp_matches_data_parallel(
        "agentq_dpo.py", tmp_path, flags, ("charts/num_pairs", "charts/episodic_return", "diagnostics/tree_nodes",
                                           "losses/dpo_loss", "diagnostics/reward_margin", "diagnostics/grad_norm",
                                           "eval/episodic_return"))
    assert all(v > 0 for _, v in expected["charts/num_pairs"]) and expected["diagnostics/reward_margin"][1][1] != 0.0


def test_fsdp_needs_torchrun():
    with pytest.raises(SystemExit, match="--fsdp shards over torchrun processes"):
        agentq.validate_args(agentq.Args(fsdp=True))


def test_fsdp_refuses_both_pair_levels_in_choice_mode():
    """A choice-mode minibatch scores step pairs and trajectory pairs in separate forwards, so under --fsdp ranks
    holding different kinds of pairs would enter different numbers of collective (sharded) forwards and hang."""
    for mode in ("choice", "auto"):
        with pytest.raises(SystemExit, match="--fsdp takes --pair-level step or trajectory"):
            agentq.validate_args(agentq.Args(fsdp=True, pair_level="both", action_mode=mode))
    for level in ("step", "trajectory"):
        with pytest.raises(SystemExit) as e:  # (only for want of torchrun here)
            agentq.validate_args(agentq.Args(fsdp=True, pair_level=level))
        assert "--pair-level" not in str(e.value)
    with pytest.raises(SystemExit) as e:
        agentq.validate_args(agentq.Args(fsdp=True, pair_level="both", action_mode="free"))
    assert "--pair-level" not in str(e.value)
