"""The generator-backed rollout loop (common/vllm_backend.py), on CPU, without vLLM.

`TokenRolloutEngine` + `HFTokenGenerator` must write the same records as `RolloutEngine` (free mode), record
behaviour log-probs the trainer reproduces, and follow weight pushes (outputs and policy_version change).
vLLM itself is never imported here; its GPU check is described in docs/vllm_backend.md.
"""

import copy
import importlib.util
import sys

import pytest
import torch

import envs
from common.rollout import RolloutConfig, RolloutEngine, behavior_units, policy_logprobs
from common.vllm_backend import (
    BackendUnavailable,
    HFTokenGenerator,
    TokenRolloutEngine,
    VLLMGenerator,
    hf_named_weights,
    sync_weights,
)

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


def test_importing_the_backend_does_not_import_vllm():
    assert "vllm" not in sys.modules


def fields(t):
    return (t.token_ids, t.source_mask, [turn.action_text for turn in t.turns], [turn.observation for turn in t.turns],
            [turn.reward for turn in t.turns], [turn.action_valid for turn in t.turns],
            [turn.num_action_tokens for turn in t.turns], [turn.truncated_tokens for turn in t.turns],
            t.rewards, t.return_, t.termination, t.env_version, t.task_id, t.seed, t.env_id, t.prompt_length, t.extra)


def both(tiny, env_id, seeds, **cfg):
    model, tok = tiny
    config = RolloutConfig(action_mode="free", temperature=0.0, **cfg)
    ref = RolloutEngine(model, tok, config).run([envs.make(env_id) for _ in seeds], seeds, env_id)
    gen = HFTokenGenerator(model, tok)
    new = TokenRolloutEngine(gen, tok, config).run([envs.make(env_id) for _ in seeds], seeds, env_id)
    return ref, new


@pytest.mark.parametrize("env_id,seeds,cfg", [
    ("gridworld", [0, 1], {"max_turn_tokens": 4}),  # full 20-turn episodes
    ("arithmetic", [0, 1, 2, 3, 4, 5], {"max_turn_tokens": 6}),
    # the total-token cap ends episodes early, as truncated (same rule, same turn)
    ("gridworld", [3, 4], {"max_turn_tokens": 4, "max_total_tokens": 700}),
])
def test_greedy_records_are_token_identical_to_rollout_engine(tiny, env_id, seeds, cfg):
    ref, new = both(tiny, env_id, seeds, **cfg)
    assert len(ref) == len(new) == len(seeds)
    for a, b in zip(ref, new):
        b.validate()
        assert fields(a) == fields(b)
        assert b.behavior_logprobs == pytest.approx(a.behavior_logprobs, abs=1e-4)
        assert b.policy_version == 0
    # the cases exercise what they claim: capped turns, multi-turn episodes, truncation by the total cap
    turns = [turn for t in new for turn in t.turns]
    if env_id == "gridworld":
        assert any(turn.truncated_tokens for turn in turns) and all(len(t.turns) > 1 for t in new)
    if "max_total_tokens" in cfg:
        assert all(t.termination == "truncated" and t.extra["truncated_by"] == "max_total_tokens" for t in new)
        assert all(len(t.token_ids) <= cfg["max_total_tokens"] for t in new)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9)])
def test_behaviour_logprobs_equal_the_trainers(tiny, temperature, top_p):
    """The mismatch a script logs (recorded vs recomputed, same weights) is ~0 for this generator."""
    model, tok = tiny
    engine = TokenRolloutEngine(HFTokenGenerator(model, tok),
                                tok, RolloutConfig(temperature=temperature, top_p=top_p, max_turn_tokens=5,
                                                 max_total_tokens=1400))  # ~7 turns: enough, and fast
    trajs = engine.run([envs.make("gridworld") for _ in range(3)], [7, 8, 9], "gridworld",
                       generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        units = policy_logprobs(model, trajs, "free", temperature)
    behaviour, mask = behavior_units(trajs, "free")
    assert torch.equal(units.mask, mask) and mask.sum() > 20
    assert ((units.logprobs - behaviour).abs() * mask).max().item() < 1e-4
    # at T = 1 / 0.7 the logged ratio exp(new - old) is 1 on every token: no clipping from the backend alone
    ratio = torch.exp(units.logprobs - behaviour)[mask.bool()]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4)


def test_sampling_is_seeded_per_row(tiny):
    """The same RNG seed gives the same episodes; a row's sample does not depend on its batch-mates."""
    model, tok = tiny
    gen = HFTokenGenerator(model, tok)
    prompts = [tok.encode("hello", add_special_tokens=False), tok.encode("a longer prompt here", add_special_tokens=False)]
    pair = gen.generate(prompts, 6, 1.0, 1.0, [tok.eos_token_id], [11, 12])
    alone = gen.generate(prompts[1:], 6, 1.0, 1.0, [tok.eos_token_id], [12])
    assert pair[1][0] == alone[0][0]
    assert pair[1][1] == pytest.approx(alone[0][1], abs=1e-5)
    again = gen.generate(prompts, 6, 1.0, 1.0, [tok.eos_token_id], [11, 13])
    assert again[0] == pair[0]


def test_load_weights_changes_outputs_and_version(tiny):
    model, tok = tiny
    gen = HFTokenGenerator(copy.deepcopy(model), tok)  # the sampler's own weights, as vLLM holds its own
    engine = TokenRolloutEngine(gen, tok, RolloutConfig(temperature=0.0, max_turn_tokens=6))
    before = engine.run([envs.make("arithmetic") for _ in range(3)], [0, 1, 2], "arithmetic")
    assert all(t.policy_version == 0 for t in before)

    trainer = copy.deepcopy(model)  # an "update": perturb the trainer's weights
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    gen.load_weights(hf_named_weights(trainer))
    assert gen.policy_version == 1
    for (name, p), q in zip(trainer.named_parameters(), gen.model.parameters()):
        assert torch.equal(p, q), name
    after = engine.run([envs.make("arithmetic") for _ in range(3)], [0, 1, 2], "arithmetic")
    assert all(t.policy_version == 1 for t in after)
    assert [t.token_ids for t in after] != [t.token_ids for t in before]
    # the new records are the trainer's own: its recomputed log-probs match them
    with torch.no_grad():
        units = policy_logprobs(trainer, after, "free", 0.0)
    behaviour, mask = behavior_units(after, "free")
    assert ((units.logprobs - behaviour).abs() * mask).max().item() < 1e-4

    sync_weights(trainer, gen, version=7)  # the script's call: the version it sets is what gets recorded
    assert gen.policy_version == 7
    assert all(t.policy_version == 7 for t in engine.run([envs.make("arithmetic")], [0], "arithmetic"))
    with pytest.raises(ValueError, match="sync_weights"):  # a record must never name weights that did not sample
        engine.run([envs.make("arithmetic")], [0], "arithmetic", policy_version=8)


def test_sync_weights_merges_lora_without_touching_the_trainer(tiny):
    from common.models import apply_lora

    model, tok = tiny
    torch.manual_seed(0)
    peft_model = apply_lora(copy.deepcopy(model), r=4, alpha=8.0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # B = 0 at the start: give the adapter an effect
    base_before = {n: p.clone() for n, p in peft_model.named_parameters() if "lora" not in n}
    gen = HFTokenGenerator(copy.deepcopy(model), tok)
    sync_weights(peft_model, gen, version=1)
    names = [n for n, _ in hf_named_weights(peft_model)]
    assert not any("lora" in n or "base_layer" in n or n.startswith("base_model") for n in names)
    ids = torch.tensor([tok.encode("GridWorld step 3", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.allclose(gen.model(input_ids=ids).logits, peft_model(input_ids=ids).logits, atol=1e-5)
        assert not torch.allclose(gen.model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-3)
    for n, p in peft_model.named_parameters():  # the trainer's base weights are untouched (no in-place merge)
        if n in base_before:
            assert torch.equal(p, base_before[n]), n


def test_choice_mode_is_refused_with_a_clear_error(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="free' only"):
        TokenRolloutEngine(HFTokenGenerator(model, tok), tok, RolloutConfig(action_mode="choice"))


def test_a_generator_breaking_the_contract_is_caught(tiny):
    model, tok = tiny

    class TooLong(HFTokenGenerator):
        def generate(self, prompts, max_tokens, *a):
            return [([65] * (max_tokens + 1), [-1.0] * (max_tokens + 1)) for _ in prompts]

    engine = TokenRolloutEngine(TooLong(model, tok), tok, RolloutConfig(max_turn_tokens=3))
    with pytest.raises(RuntimeError, match="contract"):
        engine.run([envs.make("arithmetic")], [0], "arithmetic")


@pytest.mark.skipif(VLLM_INSTALLED, reason="vllm is installed here")
def test_vllm_generator_without_vllm_names_the_requirements_file():
    with pytest.raises(BackendUnavailable, match="requirements-gpu.txt") as info:
        VLLMGenerator("unused")
    assert info.value.__cause__ is None and info.value.__context__ is None  # no ImportError chain behind it
    assert "vllm" not in sys.modules


@pytest.mark.slow
@pytest.mark.skipif(not (VLLM_INSTALLED and torch.cuda.is_available()), reason="needs vllm and a CUDA GPU")
def test_vllm_generator_on_gpu(tmp_path, smollm2):
    """The device check (docs/vllm_backend.md): vLLM samples, the trainer recomputes, weights follow pushes.

    Run on a GPU machine with vllm installed:  pytest -m slow -s tests/test_vllm_backend.py -k gpu
    """
    from common.models import save_model

    model, tok = smollm2
    model = copy.deepcopy(model).to("cuda", torch.bfloat16)
    save_model(model, tok, str(tmp_path / "init"))
    gen = VLLMGenerator(str(tmp_path / "init"), dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.3)
    config = RolloutConfig(temperature=1.0, max_turn_tokens=8, max_total_tokens=4096)
    engine = TokenRolloutEngine(gen, tok, config)
    seeds = list(range(16))
    rng = lambda: torch.Generator().manual_seed(0)
    trajs = engine.run([envs.make("gridworld") for _ in seeds], seeds, "gridworld", generator=rng())
    for t in trajs:
        t.validate()
    # reproducible: the same per-request seeds give the same tokens
    again = engine.run([envs.make("gridworld") for _ in seeds], seeds, "gridworld", generator=rng())
    assert [t.token_ids for t in again] == [t.token_ids for t in trajs]
    # behaviour log-probs (vLLM, after temperature) vs the trainer's recomputation (HF, bf16 both)
    with torch.no_grad():
        units = policy_logprobs(model, trajs, "free", config.temperature)
    behaviour, mask = behavior_units(trajs, "free")
    gap = ((units.logprobs.float().cpu() - behaviour).abs() * mask)
    ratio = torch.exp(units.logprobs.float().cpu() - behaviour)[mask.bool()]
    clipped = ((ratio < 0.8) | (ratio > 1.2)).float().mean().item()
    print(f"\nvLLM vs trainer: mismatch mean {gap.sum().item() / mask.sum().item():.4f} max {gap.max().item():.4f}, "
          f"ratio mean {ratio.mean().item():.4f}, clip fraction {clipped:.4f}, {int(mask.sum())} tokens")
    assert gap.sum().item() / mask.sum().item() < 0.05 and clipped < 0.05
    # greedy: the HF engine and vLLM agree on most first actions (bf16 kernels differ; ties may flip)
    greedy = RolloutConfig(temperature=0.0, max_turn_tokens=8)
    ref = RolloutEngine(model, tok, greedy).run([envs.make("gridworld") for _ in seeds[:8]], seeds[:8], "gridworld")
    new = TokenRolloutEngine(gen, tok, greedy).run([envs.make("gridworld") for _ in seeds[:8]], seeds[:8], "gridworld")
    agree = sum(a.turns[0].action_text == b.turns[0].action_text for a, b in zip(ref, new)) / 8
    print(f"greedy first-action agreement HF vs vLLM: {agree:.2f}")
    assert agree >= 0.75
    # a weight push changes what vLLM samples, and pushing the old weights back restores it (prefix cache reset)
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sync_weights(perturbed, gen, version=1)
    moved = TokenRolloutEngine(gen, tok, greedy).run([envs.make("gridworld") for _ in seeds[:8]], seeds[:8], "gridworld")
    assert all(t.policy_version == 1 for t in moved)
    assert [t.token_ids for t in moved] != [t.token_ids for t in new]
    sync_weights(model, gen, version=2)
    back = TokenRolloutEngine(gen, tok, greedy).run([envs.make("gridworld") for _ in seeds[:8]], seeds[:8], "gridworld")
    assert [t.token_ids for t in back] == [t.token_ids for t in new]
