"""AgentQ's pieces: the DPO loss against hand-computed values, the tree's Q backup and UCB1, preference
pairs that share their prefix token for token, DPO learning on `tiny`, and a two-iteration `--model tiny` run."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import envs
from common.chat import ChatFormat
from common.tracking import read_scalars

ROOT = Path(__file__).resolve().parents[1]
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
