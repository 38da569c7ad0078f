"""The rollout engine and the trainer-side scoring: token-in/token-out records, masks, KV cache, choice mode."""

import math
import time

import pytest
import torch
import torch.nn.functional as F

import envs
import envs.gridworld
from common.chat import ChatFormat
from common.models import autocast
from common.rollout import (RolloutConfig, RolloutEngine, _BufferedLayer, _shared_prefix_length, behavior_units,
                            check_env, policy_logprobs, sample_from_logits)


def run(model_tok, mode, n=3, seed=0, **cfg):
    model, tok = model_tok
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode=mode, **cfg))
    trajs = engine.run([envs.make("gridworld") for _ in range(n)], list(range(n)), "gridworld",
                       generator=torch.Generator().manual_seed(seed))
    for t in trajs:
        t.validate()
    return engine, trajs


def conversation(env_system, traj):
    """The chat messages an episode amounts to: system, first observation, then action/observation pairs."""
    env = envs.make("gridworld")
    first_obs, _ = env.reset(seed=traj.seed)
    msgs = [{"role": "system", "content": env_system}, {"role": "user", "content": first_obs}]
    for turn in traj.turns[:-1]:  # the last observation is never fed to the model
        msgs += [{"role": "assistant", "content": turn.action_text}, {"role": "user", "content": turn.observation}]
    return msgs


@pytest.fixture(scope="module")
def free_rollout(tiny):
    return run(tiny, "free", max_turn_tokens=6)


def test_source_mask_covers_exactly_the_sampled_tokens(tiny, free_rollout):
    model, tok = tiny
    engine, trajs = free_rollout
    env = envs.make("gridworld")
    for traj in trajs:
        assert len(traj.turns) == 20  # a random tiny model never reaches the goal: all 20 turns played
        # the mask-1 spans are exactly the per-turn actions, in order, as sampled (text + end of turn)
        spans = traj.policy_token_spans()
        assert len(spans) == len(traj.turns)
        for (start, end), turn in zip(spans, traj.turns):
            assert end - start == turn.num_action_tokens
            sampled = traj.token_ids[start:end]
            assert tok.decode([t for t in sampled if t != engine.chat.eos_id]) == turn.action_text
        # and everything else is prompt, template or observation: the whole sequence renders exactly as
        # the tokenizer's chat template renders the conversation, with the last action's end appended
        text = tok.decode(traj.token_ids)
        expected = tok.apply_chat_template(conversation(env.system_prompt, traj), tokenize=False, add_generation_prompt=True)
        expected += traj.turns[-1].action_text
        assert text.startswith(expected)
        # every observation's text sits in the mask-0 part
        masked_text = tok.decode([t for t, m in zip(traj.token_ids, traj.source_mask) if m == 0])
        for turn in traj.turns[:-1]:
            assert turn.observation in masked_text
        assert all(lp == 0.0 for lp, m in zip(traj.behavior_logprobs, traj.source_mask) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(traj.behavior_logprobs, traj.source_mask) if m == 1)


def test_kv_cache_logprobs_equal_full_reencode(tiny, free_rollout):
    """Batched, padded, cached rollout == each sequence encoded alone, token by token."""
    model, _ = tiny
    _, trajs = free_rollout
    for traj in trajs:
        ids = torch.tensor([traj.token_ids])
        with torch.no_grad():
            logp = F.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        for j, (tok_id, m) in enumerate(zip(traj.token_ids, traj.source_mask)):
            if m:
                assert traj.behavior_logprobs[j] == pytest.approx(logp[j - 1, tok_id].item(), abs=1e-4)


@pytest.mark.parametrize("mode", ["free", "choice"])
def test_trainer_logprobs_match_behaviour_logprobs(tiny, mode):
    model, _ = tiny
    _, trajs = run(tiny, mode, n=4, seed=3, max_turn_tokens=6, choice_token_norm=True)
    with torch.no_grad():
        units = policy_logprobs(model, trajs, mode, choice_token_norm=True)
    behaviour, mask = behavior_units(trajs, mode)
    assert torch.equal(units.mask.cpu(), mask)
    assert ((units.logprobs - behaviour).abs() * mask).max().item() < 1e-4
    # entropy is the distribution's, not the sampled unit's NLL: bounded by log(#choices) in choice mode
    if mode == "choice":
        assert (units.entropy[mask.bool()] <= torch.log(torch.tensor(4.0)) + 1e-5).all()
    assert not torch.allclose(units.entropy[mask.bool()], -units.logprobs[mask.bool()])


def test_top_k_trainer_logprobs_are_the_sampled_distributions(tiny):
    """With top-k the policy is the truncated distribution: the trainer's log-probs equal the recorded ones, its
    entropy is at most log k, and a token that has left the top k keeps a finite log-prob (ratio, not NaN)."""
    model, _ = tiny
    _, trajs = run(tiny, "free", n=4, seed=3, max_turn_tokens=6, temperature=2.0, top_k=3)
    behaviour, mask = behavior_units(trajs, "free")
    with torch.no_grad():
        truncated = policy_logprobs(model, trajs, "free", 2.0, top_k=3)
        full = policy_logprobs(model, trajs, "free", 2.0)
        one = policy_logprobs(model, trajs, "free", 2.0, top_k=1)  # the recorded token is outside it at some units
    on = mask.bool()
    assert (truncated.logprobs - behaviour).abs()[on].max().item() < 1e-4
    assert (full.logprobs - behaviour)[on].max().item() < -1e-3  # the untruncated softmax is another distribution
    assert (truncated.entropy[on] <= math.log(3) + 1e-5).all() and (full.entropy[on] > math.log(3)).any()
    assert torch.isfinite(one.logprobs[on]).all() and (one.logprobs[on] < -1e-3).any()
    assert torch.isfinite(one.entropy[on]).all()


def test_choice_mode_matches_direct_per_action_scoring(tiny):
    """Each step's stored action log-prob equals an independent full forward of prompt + each action name."""
    model, tok = tiny
    engine, trajs = run(tiny, "choice", n=2, seed=5, choice_token_norm=True)
    names = envs.make("gridworld").action_names
    cand = [engine.chat.encode(n) for n in names]
    for traj in trajs:
        for step in traj.choice_steps[:5]:
            prefix = traj.token_ids[: step.position]
            scores = []
            for ids in cand:
                with torch.no_grad():
                    logp = F.log_softmax(model(input_ids=torch.tensor([prefix + ids])).logits[0].float(), -1)
                joint = sum(logp[len(prefix) - 1 + j, t].item() for j, t in enumerate(ids))
                scores.append(joint / len(ids))  # TWOSOME token-count normalisation
            dist = F.log_softmax(torch.tensor(scores), -1)
            assert dist.exp().sum().item() == pytest.approx(1.0, abs=1e-6)
            assert step.logprob == pytest.approx(dist[step.chosen].item(), abs=1e-4)
            assert traj.token_ids[step.position: step.position + len(cand[step.chosen])] == cand[step.chosen]
        # choice mode can never produce an invalid action
        assert traj.invalid_actions == 0


def test_masked_choice_mode_samples_only_legal_actions_and_the_trainer_applies_the_same_mask(tiny):
    """Invalid-action masking: every chosen move is legal (none is blocked); each step's log-prob is the softmax over
    the legal candidates' scores alone (checked against full forwards); the trainer recomputes it from the record's
    mask (ratio 1), with entropy at most log(#legal) and finite gradients, where scoring without the mask differs."""
    model, _ = tiny
    engine, trajs = run(tiny, "choice", n=4, seed=3, choice_token_norm=True, mask_illegal_actions=True)
    steps = [s for t in trajs for s in t.choice_steps]
    assert all(s.legal is not None and s.chosen in s.legal for s in steps)
    assert sum(len(s.legal) < 4 for s in steps) >= 4  # the start (2, 0) alone blocks "left" in every episode
    assert not any(turn.observation.startswith("Blocked") for t in trajs for turn in t.turns)
    cand = [engine.chat.encode(n) for n in envs.make("gridworld").action_names]
    for step in trajs[0].choice_steps[:3]:
        prefix = trajs[0].token_ids[: step.position]
        scores = []
        for ids in cand:
            with torch.no_grad():
                logp = F.log_softmax(model(input_ids=torch.tensor([prefix + ids])).logits[0].float(), -1)
            scores.append(sum(logp[len(prefix) - 1 + j, t].item() for j, t in enumerate(ids)) / len(ids))
        legal_dist = F.log_softmax(torch.tensor(scores)[step.legal], -1)
        assert step.logprob == pytest.approx(legal_dist[step.legal.index(step.chosen)].item(), abs=1e-4)
    units = policy_logprobs(model, trajs, "choice", choice_token_norm=True)
    behaviour, mask = behavior_units(trajs, "choice")
    on = mask.bool()
    assert (units.logprobs - behaviour).abs()[on].max().item() < 1e-4
    n_legal = torch.tensor([[len(s.legal) for s in t.choice_steps] + [1] * (mask.shape[1] - len(t.choice_steps))
                            for t in trajs], dtype=torch.float)
    assert (units.entropy[on] <= n_legal.log()[on] + 1e-5).all()
    model.zero_grad()
    (units.logprobs[on].sum() + units.entropy[on].sum()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad()
    for t in trajs:
        for s in t.choice_steps:
            s.legal = None
    with torch.no_grad():
        unmasked = policy_logprobs(model, trajs, "choice", choice_token_norm=True)
    blocked_somewhere = (n_legal < 4) & on
    assert (unmasked.logprobs - behaviour)[blocked_somewhere].max().item() < -1e-3  # the mask moved probability mass


def test_masking_rejects_an_environment_that_does_not_list_legal_actions(tiny):
    model, tok = tiny
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode="choice", mask_illegal_actions=True))

    class NothingLegal(envs.gridworld.GridWorldEnv):
        def legal_actions(self):
            return []

    with pytest.raises(ValueError, match="expected a non-empty list"):
        engine.run([NothingLegal()], [0], "gridworld")
    with pytest.raises(ValueError, match="legal_actions\\(\\) lists them; BabyAITextEnv does not"):  # the default: None
        engine.run([envs.make("babyai-gotoredball")], [0], "babyai-gotoredball")
    with pytest.raises(ValueError, match="it needs choice mode"):
        check_env(envs.make("gridworld"), "free", mask_illegal_actions=True)
    check_env(envs.make("gridworld"), "choice", mask_illegal_actions=True)  # GridWorld lists them


def test_per_turn_cap_is_recorded_not_silently_cut(tiny):
    _, trajs = run(tiny, "free", n=2, max_turn_tokens=2)
    engine = RolloutEngine(*tiny, RolloutConfig())
    for traj in trajs:
        capped = [t for t in traj.turns if t.truncated_tokens]
        assert capped, "a 2-token cap must cut some byte-level replies"
        # a cut reply gets its end-of-turn token from the template, as a masked (non-policy) token
        for (start, end), turn in zip(traj.policy_token_spans(), traj.turns):
            if turn.truncated_tokens and end < len(traj.token_ids):
                assert traj.token_ids[end] == engine.chat.eos_id and traj.source_mask[end] == 0


def test_total_token_cap_ends_episode_as_truncated(tiny):
    _, trajs = run(tiny, "choice", n=2, max_total_tokens=900)
    for traj in trajs:
        assert traj.termination == "truncated" and traj.extra["truncated_by"] == "max_total_tokens"
        assert len(traj.token_ids) <= 900
        assert len(traj.turns) < 20


def test_same_seed_same_rollout(tiny):
    _, a = run(tiny, "free", n=2, seed=11, max_turn_tokens=4)
    _, b = run(tiny, "free", n=2, seed=11, max_turn_tokens=4)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.behavior_logprobs for t in a] == [t.behavior_logprobs for t in b]


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 200)
    token, logp = sample_from_logits(logits, temperature=1.0, top_p=0.5, generator=torch.Generator().manual_seed(0))
    assert (token == 0).all()  # the top token alone holds > 50% of the mass
    assert torch.allclose(logp, F.log_softmax(logits, -1)[:, 0])  # log-prob under the untruncated distribution
    greedy, _ = sample_from_logits(logits, temperature=0.0, top_p=1.0)
    assert (greedy == 0).all()


def test_top_k_samples_only_the_k_most_likely_tokens():
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, 0.0, -0.5] + [-1.0] * 100] * 4000)
    token, logp = sample_from_logits(logits, temperature=2.0, top_p=1.0, generator=torch.Generator().manual_seed(0),
                                     top_k=4)
    counts = torch.bincount(token, minlength=logits.shape[1])
    assert counts[4:].sum() == 0 and (counts[:4] > 800).all()  # the 4 best, in about their renormalised shares
    # log-probs under the truncated distribution that was sampled: softmax over the 4 best logits / T
    assert torch.allclose(logp, F.log_softmax(logits[:, :4] / 2.0, -1).gather(-1, token[:, None]).squeeze(-1))
    untruncated, _ = sample_from_logits(logits, temperature=2.0, top_p=1.0, generator=torch.Generator().manual_seed(0))
    assert (untruncated >= 4).float().mean() > 0.5  # without it, T = 2 spreads most of the mass over the long tail


def test_sampling_draws_each_token_with_its_probability():
    """Inverse-CDF sampling: over 40,000 draws each token's frequency is within 4 standard errors of its probability
    under softmax(logits / T), a token of probability ~1e-9 and every token top-k removed are never drawn, and
    the draws follow the generator's seed."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0, -20.0] + [-2.0] * 58])
    probs = F.softmax(logits[0] / 1.5, -1)
    token, _ = sample_from_logits(logits.expand(40_000, -1), 1.5, 1.0, torch.Generator().manual_seed(1))
    freq = torch.bincount(token, minlength=64).double() / 40_000
    stderr = (probs * (1 - probs) / 40_000).sqrt()
    assert ((freq - probs).abs() <= 4 * stderr + 1e-12).all() and freq[5] == 0
    top3, _ = sample_from_logits(logits.expand(5000, -1), 1.5, 1.0, torch.Generator().manual_seed(1), top_k=3)
    assert set(top3.tolist()) == {0, 1, 2}
    again, _ = sample_from_logits(logits.expand(40_000, -1), 1.5, 1.0, torch.Generator().manual_seed(1))
    assert torch.equal(token, again)


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_chat_template_turns_only_append(which, request):
    _, tok = request.getfixturevalue(which)
    chat = ChatFormat(tok)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Step 0/20.\n..R.\nA..G"}]
    ids = chat.prompt_ids(msgs[0]["content"], msgs[1]["content"])
    for t, (action, obs) in enumerate([("up", "You moved up."), ("right", "Blocked: wall."), ("left", "ok")]):
        before = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        msgs += [{"role": "assistant", "content": action}, {"role": "user", "content": obs}]
        after = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert after.startswith(before)  # the template itself only appends
        ended = t % 2 == 0  # alternate: the policy sampled its end-of-turn token, or the cap cut it
        action_ids = chat.encode(action) + ([chat.eos_id] if ended else [])
        new_ids = ids + action_ids + chat.next_turn_ids(obs, action_ended_with_eos=ended)
        assert new_ids[: len(ids)] == ids  # token ids of turns 1..t are a prefix of turns 1..t+1
        assert tok.decode(new_ids) == after  # and they spell exactly what the template renders
        ids = new_ids


def test_trainer_can_start_from_recorded_layer_inputs(tiny):
    """With the lower layers frozen, reusing the rollout's hidden states gives the full forward's numbers."""
    model, tok = tiny
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode="free", max_turn_tokens=5), record_layer_inputs=1)
    trajs = engine.run([envs.make("gridworld") for _ in range(3)], [0, 1, 2], generator=torch.Generator().manual_seed(2))
    assert [len(x) for x in engine.layer_inputs] == [len(t.token_ids) - 1 for t in trajs]  # all but the last sampled token
    with torch.no_grad():
        full = policy_logprobs(model, trajs, "free")
        partial = policy_logprobs(model, trajs, "free", layer_inputs=engine.layer_inputs, from_layer=1)
    assert torch.equal(full.mask, partial.mask)
    assert ((full.logprobs - partial.logprobs).abs() * full.mask).max().item() < 1e-4
    assert ((full.entropy - partial.entropy).abs() * full.mask).max().item() < 1e-4


def test_tree_scoring_can_start_from_recorded_candidate_inputs(tiny):
    """Multi-token action names (BabyAI's "turn left", ...): with the candidates' scoring forwards recorded as well,
    the trainer's tree-shaped forward starts at the frozen layer and gives the full forward's numbers; a record
    from another rollout is refused, not silently misread."""
    model, tok = tiny
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode="choice", choice_token_norm=True), record_layer_inputs=1)
    trajs = engine.run([envs.make("babyai-gotoredball", max_steps=n) for n in (2, 4)], [0, 1], "babyai-gotoredball",
                       generator=torch.Generator().manual_seed(2))
    branch_tokens = sum(len(c) - 1 for c in trajs[0].choice_steps[0].candidates)
    assert branch_tokens > 0 and [len(b) for b in engine.branch_inputs] == [
        len(t.choice_steps) * branch_tokens for t in trajs]
    with torch.no_grad():
        full = policy_logprobs(model, trajs, "choice", 1.0, True)
        partial = policy_logprobs(model, trajs, "choice", 1.0, True, engine.layer_inputs, 1, engine.branch_inputs)
    behaviour = torch.tensor([[s.logprob for s in t.choice_steps] + [0.0] * (full.mask.shape[1] - len(t.choice_steps))
                              for t in trajs])
    assert ((full.logprobs - partial.logprobs).abs() * full.mask).max().item() < 1e-4
    assert ((behaviour - partial.logprobs).abs() * full.mask).max().item() < 1e-4  # = the sampler's KV-cache scores
    with pytest.raises(ValueError, match="do not match"):
        policy_logprobs(model, trajs, "choice", 1.0, True, engine.layer_inputs, 1, engine.branch_inputs[::-1])

    # the LM head runs twice per episode (first tokens, then every candidate's later tokens), not once per step and
    # candidate: under CPU bf16 autocast each call keeps a fresh bf16 copy of the frozen head weight for the backward
    # (12 GB for 2 BabyAI episodes of SmolLM2 when it ran per candidate); the bf16 scores stay the fp32 ones
    calls = []
    handle = model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    try:
        with autocast("cpu", "bfloat16"):
            bf16 = policy_logprobs(model, trajs, "choice", 1.0, True, engine.layer_inputs, 1, engine.branch_inputs)
    finally:
        handle.remove()
    assert len(calls) == 2 * len(trajs), len(calls)
    assert 0 < ((bf16.logprobs.float() - partial.logprobs).abs() * full.mask).max().item() < 0.1


@pytest.mark.parametrize("mode", ["free", "choice"])
def test_final_observation_of_truncated_episodes_is_fed_with_its_trunk_inputs(tiny, mode):
    """record_final_observation: a truncated episode's final observation goes through the KV cache, and its
    layer inputs (plus the record's) are those of a full forward over record + tail; other episodes get none."""
    model, tok = tiny
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode=mode, max_turn_tokens=3), record_layer_inputs=1,
                           record_final_observation=True)
    envs_ = [envs.make("gridworld", max_steps=n) for n in (2, 3, 30)]
    trajs = engine.run(envs_, [0, 1, 2], "gridworld", generator=torch.Generator().manual_seed(2))
    captured = {}
    handle = model.get_decoder().layers[1].register_forward_pre_hook(
        lambda _m, args, kwargs: captured.__setitem__("x", args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True)
    try:
        for traj, tail, inputs in zip(trajs, engine.final_tails, engine.layer_inputs):
            if traj.termination != "truncated":
                assert tail is None
                continue
            ids, tail_inputs = tail
            ended = mode == "free" and traj.token_ids[-1] == engine.chat.eos_id
            assert ids == engine.chat.next_turn_ids(traj.turns[-1].observation, action_ended_with_eos=ended)
            assert len(inputs) == len(traj.token_ids) and len(tail_inputs) == len(ids)  # the last action was fed too
            with torch.no_grad():
                model(input_ids=torch.tensor([traj.token_ids + ids]))
            full = captured["x"][0]
            assert (torch.cat([inputs, tail_inputs]) - full).abs().max().item() < 1e-4
    finally:
        handle.remove()
    assert sum(t.termination == "truncated" for t in trajs) >= 2
    plain = RolloutEngine(model, tok, RolloutConfig(action_mode=mode, max_turn_tokens=3)).run(
        [envs.make("gridworld", max_steps=n) for n in (2, 3, 30)], [0, 1, 2], "gridworld",
        generator=torch.Generator().manual_seed(2))
    assert [t.token_ids for t in plain] == [t.token_ids for t in trajs]  # the extra feed changes no episode
    with pytest.raises(ValueError, match="needs record_layer_inputs"):
        RolloutEngine(model, tok, RolloutConfig(), record_final_observation=True)


class _SlowGridWorld(envs.gridworld.GridWorldEnv):
    """GridWorld whose step waits like a sandboxed one, counting how many steps run at the same time."""

    active, most, lock = 0, 0, None

    def step(self, action):
        cls = type(self)
        with cls.lock:
            cls.active += 1
            cls.most = max(cls.most, cls.active)
        time.sleep(0.05)
        with cls.lock:
            cls.active -= 1
        return super().step(action)


@pytest.mark.parametrize("parallel", [False, True])
def test_parallel_step_envs_are_stepped_concurrently_with_identical_records(tiny, parallel):
    import threading

    model, tok = tiny
    records = {}
    for flag in (False, parallel):
        cls = type("Slow", (_SlowGridWorld,), {"parallel_step": flag, "active": 0, "most": 0,
                                                "lock": threading.Lock()})
        engine = RolloutEngine(model, tok, RolloutConfig(action_mode="choice"))
        trajs = engine.run([cls(max_steps=3) for _ in range(4)], list(range(4)), "gridworld",
                           generator=torch.Generator().manual_seed(5))
        records[flag] = ([t.token_ids for t in trajs], [t.return_ for t in trajs], cls.most)
    assert records[False][2] == 1  # a plain environment is stepped one instance at a time
    assert records[parallel][:2] == records[False][:2]  # threads change the timing, never the episodes
    # 4 threads each wait 50 ms per step: at least two overlap (all four unless the machine stalls a thread)
    assert (records[parallel][2] >= 2) if parallel else (records[parallel][2] == 1)


def test_scoring_candidates_leaves_the_cache_as_it_was(tiny):
    from transformers import DynamicCache

    from common.rollout import score_candidates

    model, tok = tiny
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    keys_before = [layer.keys.clone() for layer in cache.layers]
    candidates = [[20], [21, 22, 23], [24, 25]]  # single- and multi-token continuations
    first = score_candidates(model, cache, torch.ones_like(ids), out.logits[:, -1], candidates, token_norm=False)
    again = score_candidates(model, cache, torch.ones_like(ids), out.logits[:, -1], candidates, token_norm=False)
    assert torch.equal(first, again) and cache.get_seq_length() == 4
    assert all(torch.equal(layer.keys, before) for layer, before in zip(cache.layers, keys_before))
    with torch.no_grad():  # the joint log-prob of [21, 22, 23], from a plain forward of the whole sequence
        logp = F.log_softmax(model(input_ids=torch.cat([ids, torch.tensor([[21, 22, 23]] * 2)], 1)).logits, -1)
    direct = logp[:, 3, 21] + logp[:, 4, 22] + logp[:, 5, 23]
    torch.testing.assert_close(first[:, 1], direct, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first[:, 2], logp[:, 3, 24] + F.log_softmax(model(input_ids=torch.cat(
        [ids, torch.tensor([[24, 25]] * 2)], 1)).logits, -1)[:, 4, 25].detach(), atol=1e-5, rtol=1e-5)
    # a left-padded row (as in a batch of unequal episodes) scores as if it were alone
    padded, mask = torch.tensor([[0, 9, 10, 11], [5, 6, 7, 8]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    cache = DynamicCache()
    out = model(input_ids=padded, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                past_key_values=cache, use_cache=True)
    scores = score_candidates(model, cache, mask, out.logits[:, -1], candidates, token_norm=False)
    alone = score_candidates(model, *_prefilled(model, torch.tensor([[9, 10, 11]])), candidates, token_norm=False)
    torch.testing.assert_close(scores[:1], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores[1:], first[:1], atol=1e-5, rtol=1e-5)


def _prefilled(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache, torch.ones_like(ids), out.logits[:, -1]


def test_tree_mask_forward_keeps_no_per_layer_attention_matrix(tiny):
    """Memory: the choice-mode tree mask (multi-token action names: every name is several bytes for `tiny`) must
    not push SDPA onto its math kernel, which would save a [B, heads, L, L] attention matrix per layer for the
    backward. At most the one mask of shape [B, 1, L, L] may be kept, shared by every layer."""
    model, _ = tiny
    _, trajs = run(tiny, "choice", n=2, seed=1, max_total_tokens=400)
    width = max(len(t.token_ids) + sum(len(c) - 1 for s in t.choice_steps for c in s.candidates) for t in trajs)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    square: dict[int, tuple] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t.dim() >= 2 and tuple(t.shape[-2:]) == (width, width):
            square[ptr] = tuple(t.shape)
        return t

    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            units = policy_logprobs(model, trajs, "choice", choice_token_norm=True)
    finally:
        model.eval()
    assert units.mask.sum() > 0 and width > 200
    assert len(square) <= 1 and all(shape[1] == 1 for shape in square.values()), square


@pytest.mark.parametrize("mode", ["free", "choice"])
def test_shared_float_mask_gives_the_boolean_masks_numbers_exactly(tiny, mode, monkeypatch):
    """`policy_logprobs` hands SDPA one float mask for all layers instead of a boolean one (which SDPA converts,
    and saves, once per layer): padded batches (free) and tree masks (choice) must give bit-identical numbers
    and gradients."""
    import common.rollout as rollout

    model, _ = tiny
    _, trajs = run(tiny, mode, n=3, seed=7, max_turn_tokens=4, max_total_tokens=1200 if mode == "free" else 700)
    t = trajs[1]  # unequal lengths, so the batch is right-padded
    if mode == "free":  # (tiny's episodes here are one-token turns of equal length) 7 more scored tokens
        t.token_ids, t.source_mask = t.token_ids + t.token_ids[-7:], t.source_mask + [1] * 7
        t.behavior_logprobs = t.behavior_logprobs + [0.0] * 7
        n = len(t.token_ids)
    else:  # cut after its first action
        t.choice_steps = t.choice_steps[:1]
        n = t.choice_steps[0].position + len(t.choice_steps[0].candidates[t.choice_steps[0].chosen])
    t.token_ids, t.source_mask, t.behavior_logprobs = t.token_ids[:n], t.source_mask[:n], t.behavior_logprobs[:n]
    assert len({len(t.token_ids) for t in trajs}) > 1

    def scored():
        model.zero_grad()
        units = policy_logprobs(model, trajs, mode, choice_token_norm=True)
        (units.logprobs * units.mask).sum().backward()
        return units, [p.grad.clone() for p in model.parameters()]

    new, new_grads = scored()
    monkeypatch.setattr(rollout, "_shared_mask", lambda allowed, model, device: allowed.to(device))
    old, old_grads = scored()
    model.zero_grad(set_to_none=True)
    assert new.mask.sum() > 0
    assert torch.equal(new.logprobs, old.logprobs) and torch.equal(new.entropy, old.entropy)
    assert all(torch.equal(a, b) for a, b in zip(new_grads, old_grads))


def layer_tokens(model, layer: int = 0):
    """A counter of the (row x position) slots that enter a decoder layer, to see what a feature saves."""
    seen = {"tokens": 0}

    def count(_module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        seen["tokens"] += x.shape[0] * x.shape[1]
    return seen, model.get_decoder().layers[layer].register_forward_pre_hook(count, with_kwargs=True)


@pytest.mark.parametrize("env_id", ["gridworld", "gridworld-procedural"])
def test_shared_prompt_prefill_gives_the_records_of_separate_prefills(tiny, env_id):
    """Prefilling the prompts' common prefix once (a group's whole prompt on the fixed layout, the system prompt on
    procedural layouts) changes no record, no recorded trunk input, and processes fewer tokens."""
    model, tok = tiny
    out = {}
    for share in (False, True):
        engine = RolloutEngine(model, tok, RolloutConfig(action_mode="free", max_turn_tokens=4, share_prompt_prefix=share),
                               record_layer_inputs=1)
        seen, hook = layer_tokens(model)
        try:
            trajs = engine.run([envs.make(env_id, max_steps=12) for _ in range(4)], [0, 1, 2, 3], env_id,
                               generator=torch.Generator().manual_seed(4))
        finally:
            hook.remove()
        out[share] = trajs, engine.layer_inputs, seen["tokens"]
    (plain, plain_inputs, plain_tokens), (shared, shared_inputs, shared_tokens) = out[False], out[True]
    prompts = [t.token_ids[: t.prompt_length] for t in plain]
    common = 0
    while all(len(p) > common and p[common] == prompts[0][common] for p in prompts):
        common += 1
    assert common > 50 and (env_id == "gridworld") == (common == len(prompts[0]))  # what there is to share
    assert plain_tokens - shared_tokens >= 3 * (min(common, len(prompts[0]) - 1) - 1)  # fed once, not 4 times
    for a, b, x, y in zip(plain, shared, plain_inputs, shared_inputs):
        assert a.token_ids == b.token_ids and a.source_mask == b.source_mask
        assert max(abs(p - q) for p, q in zip(a.behavior_logprobs, b.behavior_logprobs)) < 1e-5
        assert x.shape == y.shape and (x - y).abs().max().item() < 1e-5


def scores_and_grads(model, trajs, mode, share, **kwargs):
    model.zero_grad()
    units = policy_logprobs(model, trajs, mode, 1.0, False, share_prefix=share, **kwargs)
    ((units.logprobs + 0.1 * units.entropy) * units.mask).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    return units, grads


@pytest.mark.parametrize("trunk", [False, True])
def test_shared_prefix_scoring_gives_the_plain_forwards_numbers_and_gradients(tiny, trunk):
    """policy_logprobs runs the records' common prompt prefix once and the rest against its repeated KV cache: same
    log-probs, entropies and parameter gradients as one plain forward of the whole records, for fewer tokens; from
    the embeddings and from recorded trunk inputs; and it steps aside under gradient checkpointing."""
    model, tok = tiny
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode="free", max_turn_tokens=4), record_layer_inputs=1)
    trajs = engine.run([envs.make("gridworld-procedural", max_steps=n) for n in (12, 14, 16)], [0, 1, 2],
                       generator=torch.Generator().manual_seed(5))
    kwargs = {"layer_inputs": engine.layer_inputs, "from_layer": 1} if trunk else {}
    model.train()
    try:
        seen, hook = layer_tokens(model, -1)
        plain, plain_grads = scores_and_grads(model, trajs, "free", False, **kwargs)
        shared, shared_grads = scores_and_grads(model, trajs, "free", True, **kwargs)
        hook.remove()
        # the top layer saw the prefix once: the plain forward's width x 3 rows, twice, minus 2 prefixes
        assert seen["tokens"] < 2 * 3 * max(len(t.token_ids) for t in trajs) - 2 * 50
        assert torch.equal(plain.mask, shared.mask)
        assert ((plain.logprobs - shared.logprobs).abs() * plain.mask).max().item() < 1e-5
        assert ((plain.entropy - shared.entropy).abs() * plain.mask).max().item() < 1e-5
        assert (plain_grads - shared_grads).norm().item() < 1e-5 * plain_grads.norm().item()
        assert _shared_prefix_length(model.get_decoder(), trajs) > 50
        model.gradient_checkpointing_enable()  # checkpointed layers drop the KV cache: the plain forward runs
        assert _shared_prefix_length(model.get_decoder(), trajs) == 0
        seen, hook = layer_tokens(model)
        checkpointed, _ = scores_and_grads(model, trajs, "free", True, **kwargs)
        hook.remove()
        assert ((plain.logprobs - checkpointed.logprobs).abs() * plain.mask).max().item() < 1e-5
    finally:
        model.gradient_checkpointing_disable()
        model.eval()


def test_shared_prefix_scoring_in_choice_mode_with_smollm2(smollm2):
    """Choice mode with single-token action names (SmolLM2's GridWorld moves): shared-prefix scoring from the frozen
    trunk matches the plain forward and the sampler's action log-probs."""
    model, tok = smollm2
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode="choice"), record_layer_inputs=28)
    trajs = engine.run([envs.make("gridworld", max_steps=3) for _ in range(3)], [0, 1, 2],
                       generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        plain = policy_logprobs(model, trajs, "choice", share_prefix=False)
        shared = policy_logprobs(model, trajs, "choice", 1.0, False, engine.layer_inputs, 28)
    behaviour, mask = behavior_units(trajs, "choice")
    assert ((plain.logprobs - shared.logprobs).abs() * mask).max().item() < 1e-4
    assert ((behaviour - shared.logprobs).abs() * mask).max().item() < 1e-4


@pytest.mark.parametrize("env_id, mode", [("gridworld", "free"), ("babyai-gotoredball", "choice")])
def test_buffered_kv_cache_gives_the_concatenating_caches_records(tiny, monkeypatch, env_id, mode):
    """The rollout's cache writes each step in place (common.rollout.BufferedCache) instead of concatenating: the same
    records bit for bit as transformers' DynamicCache, through growth past a chunk, rows leaving (`keep`), the shared
    prompt's repeated rows and, with multi-token action names, the candidates' scoring forward cropped away."""
    from common import rollout

    model, tok = tiny
    out = {}
    for cache_class in (rollout.DynamicCache, rollout.BufferedCache):
        monkeypatch.setattr(rollout, "BufferedCache", cache_class)
        cfg = RolloutConfig(action_mode=mode, max_turn_tokens=5, max_total_tokens=2500, transposed_keys=False)
        engine = RolloutEngine(model, tok, cfg)
        out[cache_class] = engine.run([envs.make(env_id, max_steps=n) for n in (3, 12, 20)], [0, 1, 2], env_id,
                                      generator=torch.Generator().manual_seed(7))
    plain, buffered = out.values()
    assert max(len(t.token_ids) for t in buffered) > 2 * _BufferedLayer.CHUNK and len({len(t.turns) for t in buffered}) > 1
    for a, b in zip(plain, buffered):
        assert a.token_ids == b.token_ids and a.behavior_logprobs == b.behavior_logprobs
        assert [s.logprob for s in a.choice_steps] == [s.logprob for s in b.choice_steps]


@pytest.mark.parametrize("keys_transposed", [False, True])
def test_buffered_kv_layer_writes_in_place_and_grows_by_chunks(keys_transposed):
    layer = _BufferedLayer(keys_transposed)
    keys = torch.randn(2, 3, 5, 4)
    layer.update(keys, -keys)
    buffer = layer.key_buffer.data_ptr()
    for step in range(_BufferedLayer.CHUNK):  # one position at a time: no reallocation within the chunk
        k, v = layer.update(torch.full((2, 3, 1, 4), float(step)), torch.zeros(2, 3, 1, 4))
    assert layer.key_buffer.data_ptr() == buffer and k.shape[2] == 5 + _BufferedLayer.CHUNK
    k, _ = layer.update(torch.ones(2, 3, 1, 4), torch.ones(2, 3, 1, 4))  # past the capacity: one copy, values kept
    assert layer.key_buffer.data_ptr() != buffer and torch.equal(k[:, :, :5], keys) and k[0, 0, -2, 0] == _BufferedLayer.CHUNK - 1
    layer.crop(-3)
    layer.batch_select_indices(torch.tensor([1, 1, 0]))
    assert layer.get_seq_length() == 5 + _BufferedLayer.CHUNK - 2 and torch.equal(layer.keys[2, :, :5], keys[0])
    assert layer.keys.shape == layer.values.shape == (3, 3, 5 + _BufferedLayer.CHUNK - 2, 4)
    assert layer.key_buffer.shape[2] == (4 if keys_transposed else layer.key_buffer.shape[2])  # [B, H, D, T] stored


def test_decode_attention_equals_sdpa():
    """decode_attention (q K^T and P V as batched GEMMs on a [B, H, D, T] key cache) gives SDPA's output for a decode
    step and a short block, with grouped-query heads and boolean or additive padding masks; a query that sees only
    padding gets finite values (SDPA: NaN), and long blocks go to SDPA itself."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from common.rollout import DECODE_ATTENTION_MAX_QUERY, decode_attention

    torch.manual_seed(0)
    batch, kv_heads, groups, dim, length = 3, 2, 3, 8, 11
    module = SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)
    layer = _BufferedLayer(keys_transposed=True)
    keys, values = layer.update(torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim))
    assert keys.stride(-2) == 1  # the fast path's layout
    for q_len in (1, 5):
        query = torch.randn(batch, kv_heads * groups, q_len, dim)
        allowed = torch.rand(batch, 1, q_len, length) > 0.4
        allowed[..., 0] = True
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        for mask in ([None] if q_len == 1 else []) + [allowed, additive]:
            ours, _ = decode_attention(module, query, keys, values, mask, scaling=0.3)
            ref, _ = sdpa_attention_forward(module, query, keys.contiguous(), values, mask, scaling=0.3)
            assert ours.shape == ref.shape == (batch, q_len, kv_heads * groups, dim)
            assert torch.allclose(ours, ref, atol=1e-5)
        allowed[1, 0, 0] = False  # row 1's first query: a pad that sees only padding
        ours, _ = decode_attention(module, query, keys, values, allowed, scaling=0.3)
        ref, _ = sdpa_attention_forward(module, query, keys.contiguous(), values, allowed, scaling=0.3)
        assert torch.isfinite(ours).all() and torch.allclose(ours[:, 1:], ref[:, 1:], atol=1e-5)
    long_query = torch.randn(batch, kv_heads * groups, DECODE_ATTENTION_MAX_QUERY + 1, dim)
    mask = torch.ones(batch, 1, DECODE_ATTENTION_MAX_QUERY + 1, length, dtype=torch.bool)
    assert torch.equal(decode_attention(module, long_query, keys, values, mask)[0],
                       sdpa_attention_forward(module, long_query, keys.contiguous(), values, mask)[0])


@pytest.mark.parametrize("env_id, mode", [("gridworld", "free"), ("babyai-gotoredball", "choice")])
def test_transposed_keys_give_the_same_records_and_restore_sdpa(smollm2, env_id, mode):
    """On a CPU the engine caches keys as [B, H, D, T] and attends with `decode_attention` while it runs (seen from
    inside a layer); the records equal SDPA's up to float rounding (same tokens), in choice mode with multi-token
    action names too (the candidates' forward passes an additive mask); afterwards the model is on SDPA again."""
    from common.rollout import DECODE_ATTENTION

    model, tok = smollm2
    seen = []

    def spy(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        seen.append((model.config._attn_implementation, layer.key_buffer.shape[2] == module.head_dim))

    hook = model.model.layers[3].self_attn.register_forward_hook(spy, with_kwargs=True)
    out = {}
    try:
        for transposed in (False, True):
            seen.clear()
            cfg = RolloutConfig(action_mode=mode, max_turn_tokens=5, transposed_keys=transposed)
            engine = RolloutEngine(model, tok, cfg)
            out[transposed] = engine.run([envs.make(env_id, max_steps=3) for _ in range(3)], [0, 1, 2], env_id,
                                         generator=torch.Generator().manual_seed(3))
            assert seen and set(seen) == {(DECODE_ATTENTION, True) if transposed else ("sdpa", False)}
    finally:
        hook.remove()
    assert model.config._attn_implementation == "sdpa"
    for a, b in zip(out[False], out[True]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.behavior_logprobs, b.behavior_logprobs)) < 1e-4
        assert max([abs(x.logprob - y.logprob) for x, y in zip(a.choice_steps, b.choice_steps)] or [0]) < 1e-4


def test_input_major_weights_give_the_same_records_and_leave_the_model_as_it_was(smollm2):
    """While the engine runs on a CPU its Linear weights are input-major (`decode_weight_layout`: MKL's small-batch
    GEMM is faster from it); the records equal those of the usual layout up to float rounding (same tokens; the sums
    run in another order), and afterwards every weight is its original tensor again (same storage, same values),
    the tied LM head still tied to the embeddings."""
    model, tok = smollm2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    storage = [p.data_ptr() for p in model.parameters()]
    seen = []
    hook = model.model.layers[3].mlp.up_proj.register_forward_hook(
        lambda module, args, out: seen.append((module.weight.stride(), model.lm_head.weight.stride())))
    out = {}
    try:
        for input_major in (False, True):
            seen.clear()
            engine = RolloutEngine(model, tok, RolloutConfig(max_turn_tokens=5, input_major_weights=input_major))
            out[input_major] = engine.run([envs.make("gridworld", max_steps=3) for _ in range(3)], [0, 1, 2],
                                          generator=torch.Generator().manual_seed(3))
            up, head = model.model.layers[3].mlp.up_proj.weight.shape, model.lm_head.weight.shape
            expected = ((1, up[0]), (1, head[0])) if input_major else ((up[1], 1), (head[1], 1))
            assert seen and set(seen) == {expected}
    finally:
        hook.remove()
    for a, b in zip(out[False], out[True]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.behavior_logprobs, b.behavior_logprobs)) < 1e-4
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.is_contiguous() for p in model.parameters()) and [p.data_ptr() for p in model.parameters()] == storage
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_input_major_weights_are_restored_when_a_rollout_fails(tiny):
    class Broken(envs.gridworld.GridWorldEnv):
        def step(self, action):
            raise RuntimeError("environment crashed")

    model, tok = tiny
    engine = RolloutEngine(model, tok, RolloutConfig(max_turn_tokens=3))
    with pytest.raises(RuntimeError, match="environment crashed"):
        engine.run([Broken()], [0], "gridworld")
    assert all(p.is_contiguous() for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"  # decode_attention_backend put it back
