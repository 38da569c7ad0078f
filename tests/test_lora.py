"""LoRA, precision, memory (common/models.py helpers, wired into ppo_gae_agent.py).

With LoRA the frozen base weights never change and only the adapters train; the reference policy is the
same model with its adapters switched off; `save_model` writes only the adapter and `load_model` of that
directory rebuilds the seeded base and reproduces the trained model's logits; gradient checkpointing
changes memory, not the loss or the gradients.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import envs
from common.models import (adapter_disabled, apply_lora, autocast, enable_gradient_checkpointing, is_peft,
                           load_model, parameter_counts, save_model, train_top_layers)
from common.rollout import RolloutConfig, RolloutEngine, behavior_units, policy_logprobs
from common.tracking import read_scalars

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ppo_gae_agent", ROOT / "algorithms" / "ppo_gae_agent.py")
ppo = importlib.util.module_from_spec(spec)
sys.modules["ppo_gae_agent"] = ppo
spec.loader.exec_module(ppo)

SEED = 5


def gridworld_batch(model, tok, n=4, seed=0):
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode="choice", temperature=1.0, max_turn_tokens=4))
    env_list = [envs.make("gridworld", max_steps=3) for _ in range(n)]
    return engine.run(env_list, [seed + i for i in range(n)], "gridworld", generator=torch.Generator().manual_seed(seed))


def base_key(name: str) -> str:
    """peft's name for a wrapped base weight -> the plain model's name."""
    return name.replace("base_model.model.", "", 1).replace(".base_layer", "")


def reinforce_steps(model, trajs, steps=3, lr=1e-2):
    """A few optimizer steps of a policy-gradient loss with random advantages (enough to move every adapter)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    adv = torch.randn(len(trajs), 8, generator=torch.Generator().manual_seed(0))
    model.train()
    for _ in range(steps):
        units = policy_logprobs(model, trajs, "choice", 1.0, True)
        loss = -(units.logprobs * adv[:, : units.logprobs.shape[1]] * units.mask).sum() / units.mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def test_lora_freezes_base_trains_adapters_and_saves_only_the_adapter(tmp_path):
    base, tok = load_model("tiny", seed=SEED)
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    trajs = gridworld_batch(base, tok)
    ids = torch.tensor([tok.encode("<|im_start|>user\nmove up<|im_end|>")])
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits.clone()
        base_units = policy_logprobs(base, trajs, "choice", 1.0, True).logprobs

    model = train_top_layers(base, trainable_layers=0, lora_r=4, lora_alpha=8.0, checkpointing=False)
    assert is_peft(model)
    trainable, total = parameter_counts(model)
    # tiny: 2 layers x (q,k,v,o: 64->64, 64->32, 64->32, 64->64; gate, up: 64->192; down: 192->64) at r = 4
    per_layer = 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 192) * 2 + (192 + 64))
    assert trainable == 2 * per_layer
    assert all(("lora_A" in n or "lora_B" in n) == p.requires_grad for n, p in model.named_parameters())
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(v.abs().sum() == 0 for n, v in lora_before.items() if "lora_B" in n)  # B = 0: starts as the base

    reinforce_steps(model, trajs)

    # the frozen base did not move, bit for bit; every adapter did
    after = {base_key(k): v for k, v in model.state_dict().items() if "lora_" not in k}
    assert set(after) == set(initial)
    changed = [k for k in initial if not torch.equal(initial[k], after[k])]
    assert not changed, changed
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.detach(), lora_before[n])]
    assert len(moved) == len(lora_before)

    with torch.no_grad():
        trained_logits = model(input_ids=ids).logits.clone()
        # the reference by disabling the adapters is the initial model: same logits, same policy log-probs
        with adapter_disabled(model) as ref:
            assert torch.equal(ref(input_ids=ids).logits, base_logits)
            assert torch.equal(policy_logprobs(ref, trajs, "choice", 1.0, True).logprobs, base_units)
        assert not torch.allclose(trained_logits, base_logits)  # and the adapters are back on afterwards

    # --save-model with LoRA: the adapter only (plus tokenizer and the record of the base), no full weights
    out = tmp_path / "model"
    save_model(model, tok, str(out))
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "agentrl_base.json"} <= names
    assert not names & {"model.safetensors", "pytorch_model.bin", "config.json"}
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert keys and all("lora_A" in k or "lora_B" in k for k in keys)
        assert sum(f.get_tensor(k).numel() for k in keys) == trainable
    full_bytes = sum(v.numel() * v.element_size() for v in initial.values())
    assert (out / "adapter_model.safetensors").stat().st_size < full_bytes / 4

    # load_model rebuilds the seeded tiny base, attaches the adapter: the trained model's logits exactly
    loaded, _ = load_model(str(out), "cpu")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained_logits)
        with adapter_disabled(loaded) as ref:
            assert torch.equal(ref(input_ids=ids).logits, base_logits)
    # training again on top of a loaded adapter merges it into the base first
    again = apply_lora(loaded, 2)
    with torch.no_grad():
        assert torch.allclose(again(input_ids=ids).logits, trained_logits, atol=1e-5)


def test_adapter_disabled_is_a_no_op_without_adapters():
    model, tok = load_model("tiny", seed=SEED)
    with adapter_disabled(model) as ref:
        assert ref is model
    with autocast("cpu"):  # a no-op on CPU: fp32 matmuls
        assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.dtype == torch.float32


def test_lora_on_top_layers_keeps_lower_layers_the_base():
    """`--trainable-layers 1 --lora-r 4`: adapters in the top layer only, so the rollout's recorded
    inputs of that layer are the base model's and the frozen-trunk path gives the full forward's numbers."""
    base, tok = load_model("tiny", seed=SEED)
    model = train_top_layers(base, trainable_layers=1, lora_r=4, lora_alpha=8.0, checkpointing=False)
    layers_with_adapters = {n.split(".layers.")[1].split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert layers_with_adapters == {"1"}
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)  # as if trained
    engine = RolloutEngine(model, tok, RolloutConfig(action_mode="choice", temperature=1.0, choice_token_norm=True),
                           record_layer_inputs=1)
    trajs = engine.run([envs.make("gridworld", max_steps=3) for _ in range(3)], [0, 1, 2], "gridworld",
                       generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = policy_logprobs(model, trajs, "choice", 1.0, True).logprobs
        trunk = policy_logprobs(model, trajs, "choice", 1.0, True, engine.layer_inputs, 1).logprobs
        assert torch.allclose(full, trunk, atol=1e-5)
        behaviour, mask = behavior_units(trajs, "choice")
        assert torch.allclose(full * mask, behaviour, atol=1e-5)


@pytest.mark.parametrize("lora_r", [0, 4])
def test_gradient_checkpointing_same_loss_and_grads(lora_r):
    tok = load_model("tiny", seed=SEED)[1]
    models = []
    for ckpt in (False, True):
        torch.manual_seed(0)  # LoRA's A matrices are drawn from the global generator
        models.append(train_top_layers(load_model("tiny", seed=SEED)[0], 0, lora_r, 8.0, checkpointing=ckpt))
    if lora_r:  # non-zero B so the adapters' gradients are not all in A's direction only
        for m in models:
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    torch.nn.init.constant_(p, 0.01)
    trajs = gridworld_batch(models[0], tok)
    calls = [0, 0]
    for i, m in enumerate(models):
        m.get_decoder().layers[0].mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    results = []
    for i, m in enumerate(models):
        m.train()
        units = policy_logprobs(m, trajs, "choice", 1.0, True)
        loss = -(units.logprobs * units.mask).sum() + units.entropy.sum()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}))
    (loss0, grads0), (loss1, grads1) = results
    assert calls == [1, 2]  # checkpointing really ran: layer 0 (its MLP) was recomputed in the backward (pre-hook: the
    # recompute stops early, after the last saved tensor, so a post-hook would not see it)
    assert torch.allclose(loss0, loss1, rtol=1e-6)
    assert grads0.keys() == grads1.keys() and len(grads0) > 0
    for n in grads0:
        assert grads0[n].abs().sum() > 0, n  # gradients reach every trained tensor (non-reentrant checkpointing)
        assert torch.allclose(grads0[n], grads1[n], rtol=1e-4, atol=1e-7), n


def test_ppo_with_lora_saves_adapter_and_trains_value_head(tmp_path):
    cmd = [sys.executable, str(ROOT / "algorithms" / "ppo_gae_agent.py"), "--model", "tiny", "--output-dir", str(tmp_path),
           *ppo.SMOKE_TEST_ARGS, "--eval-every", "0", "--lora-r", "4", "--gradient-checkpointing", "--save-model",
           "--seed", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    # 9,728 adapter weights (see above) and the value head's 65 train; the frozen base adds 115,200
    assert "9,793 trainable parameters of 124,993" in proc.stdout
    scalars = read_scalars(run)
    assert scalars["diagnostics/logprob_mismatch"][0][1] < 1e-4  # no dropout: the trainer sees the sampler's policy
    assert scalars["losses/kl"][0][1] >= 0.0
    names = {p.name for p in (run / "model").iterdir()}
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names
    head = torch.load(run / "value_head.pt")
    assert head["weight"].abs().sum() > 0  # zero-initialised, so it trained next to the adapters
    model, tok = load_model(str(run / "model"), "cpu")
    assert is_peft(model)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([tok.encode("up")])).logits).all()


def test_bad_lora_rank_fails_fast():
    with pytest.raises(SystemExit, match="--lora-r"):
        ppo.validate_args(ppo.Args(lora_r=-1))


def test_enable_gradient_checkpointing_leaves_no_input_grad_hook():
    model, _ = load_model("tiny", seed=SEED)
    model = enable_gradient_checkpointing(apply_lora(model, 4))
    assert model.get_decoder().gradient_checkpointing
    assert not getattr(model.get_base_model(), "_require_grads_hooks", [])
