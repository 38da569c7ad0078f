"""A token-level rollout loop whose generation is delegated to a pluggable generator (vLLM on GPU).

The trainer keeps the weights; a *generator* samples. `TokenRolloutEngine.run` plays B episodes in
lockstep like `common.rollout.RolloutEngine.run` in `free` mode and writes exactly the same `Trajectory`
records (same token ids, source mask, behaviour log-probs, turns, termination, truncation rules), but each
turn it hands every live episode's whole token sequence to `generator.generate(...)` and appends the ids
that come back, unchanged: token-in/token-out, nothing is re-tokenised (DESIGN.md, "Trajectory record").

A generator has one sampling method, a weight-loading method and a version counter:

    generate(prompts: list[list[int]], max_tokens, temperature, top_p, stop_token_ids, seeds)
        -> list[(sampled ids incl. the stop token if sampled, log-prob of each under softmax(logits / T))]
    load_weights(named_tensors)   # Hugging Face parameter names; bumps policy_version by one
    policy_version: int           # recorded in every trajectory it samples

Two generators:
  * `HFTokenGenerator(model, tokenizer)`: a plain batched KV-cache loop over token ids with a Hugging Face
    model. CPU or GPU; what the CPU tests use, and the reference the vLLM path is checked against.
  * `VLLMGenerator(path, ...)`: wraps `vllm.LLM` (imported lazily: vLLM is optional, see
    requirements-gpu.txt; nothing else in agentrl imports it). Token-id prompts, per-request seeds,
    `logprobs=0` (the sampled token's log-prob only), `logprobs_mode="processed_logprobs"` (after the
    temperature, like the HF engine), prefix caching (a turn's prompt is the previous turn's prompt plus
    a few tokens, so vLLM re-encodes only the new ones). Weights are pushed in process, as TRL's colocate
    mode does, then the prefix cache is reset (its KV blocks were computed with the old weights).

`sync_weights(model, generator, version)` pushes a trainer model's weights (plain, DDP-wrapped or peft/LoRA:
adapters are merged into *copies* of the base weights, the trainer's own weights are never touched).

Only `free` mode: `choice` mode scores every action name on top of the KV cache (`score_candidates`), which
a sampling server does not expose; use `RolloutEngine` for it.
"""

from __future__ import annotations

import os
import time

import torch

from common.chat import ChatFormat
from common.records import Trajectory
from common.rollout import RolloutConfig, book_turn, episode_record, sample_from_logits, start_episodes, step_envs

REQUIREMENTS_HINT = "pip install -r requirements-gpu.txt (needs a CUDA GPU; the default `hf` rollout backend needs no vLLM)"


class BackendUnavailable(RuntimeError):
    """The requested rollout backend cannot run here (vLLM missing, no GPU); the message says what to do."""


def require_vllm() -> None:
    """Raise `BackendUnavailable` (a one-line message naming requirements-gpu.txt) unless vLLM can run here.

    Scripts call it before loading a model, to fail fast; it never imports vllm."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise BackendUnavailable(f"the vLLM rollout backend needs vllm, which is not installed: {REQUIREMENTS_HINT}")
    if not torch.cuda.is_available():
        raise BackendUnavailable("the vLLM rollout backend needs a CUDA GPU (torch.cuda.is_available() is False)")


# ---- generators ---------------------------------------------------------------------------------------

class HFTokenGenerator:
    """Samples continuations of token-id prompts with a Hugging Face causal LM (batched, left-padded, KV cache).

    Each call encodes the prompts from scratch (no cache between calls, like vLLM without prefix caching),
    then decodes up to `max_tokens` tokens per row, a row stopping at its first stop token. Row i draws from
    its own `torch.Generator` seeded with `seeds[i]`, so a row's sample does not depend on the batch it is in.
    Log-probs are those of `common.rollout.sample_from_logits`: under softmax(logits / T), before top-p;
    at T = 0 (greedy) under softmax(logits).
    """

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.policy_version = 0

    @property
    def device(self):
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float, top_p: float,
                 stop_token_ids: list[int], seeds: list[int]) -> list[tuple[list[int], list[float]]]:
        from transformers import DynamicCache

        n, device = len(prompts), self.device
        body, head = self.model.get_decoder(), self.model.get_output_embeddings()
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            attn[row, width - len(p):] = 1
        ids, attn = ids.to(device), attn.to(device)
        cache = DynamicCache()
        gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        stop = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long)
        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lp: list[list[float]] = [[] for _ in range(n)]
        done = torch.zeros(n, dtype=torch.bool)
        feed = ids
        for step in range(max_tokens):
            # position ids count real tokens only, as in RolloutEngine._feed: padding never shifts a row
            pos = (attn.cumsum(1) - 1).clamp(min=0)[:, -feed.shape[1]:]
            hidden = body(input_ids=feed, attention_mask=attn, position_ids=pos, past_key_values=cache,
                          use_cache=True).last_hidden_state
            logits = head(hidden[:, -1]).float()
            tokens = []
            for row in range(n):
                if done[row]:
                    tokens.append(self.pad_id)
                    continue
                tok, lp = sample_from_logits(logits[row: row + 1], temperature, top_p, gens[row])
                tok = int(tok)
                out_ids[row].append(tok)
                out_lp[row].append(float(lp))
                tokens.append(tok)
                done[row] = bool((stop == tok).any())
            if bool(done.all()) or step == max_tokens - 1:
                break
            # a finished row feeds a masked pad, so the batch keeps one shape
            feed = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
            attn = torch.cat([attn, (~done).long().to(device)[:, None]], 1)
        return list(zip(out_ids, out_lp))

    def load_weights(self, named_tensors):
        """Copy (name, tensor) pairs (Hugging Face names) into the model; every name must exist."""
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        unknown = []
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    unknown.append(name)
                    continue
                params[name].copy_(tensor)
        if unknown:
            raise KeyError(f"load_weights: no parameter named {unknown[:5]} in the generator's model")
        self.policy_version += 1


class VLLMGenerator:
    """`vllm.LLM` in this process (colocated with the trainer), sampling from token-id prompts.

    `model_name_or_path`: a directory vLLM can load (config.json + safetensors + tokenizer), e.g. the
    trainer's initial weights written with `common.models.save_model`. `max_model_len` must hold
    `RolloutConfig.max_total_tokens`. The rest goes to `vllm.LLM` unchanged.
    """

    def __init__(self, model_name_or_path: str, *, dtype: str = "auto", gpu_memory_utilization: float = 0.3,
                 max_model_len: int | None = None, seed: int = 0, enable_prefix_caching: bool = True, **llm_kwargs):
        require_vllm()
        # the engine core must live in this process, so weights can be pushed into its model (TRL colocate);
        # set before vLLM reads its environment
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import vllm
        self.llm = vllm.LLM(model=model_name_or_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                            max_model_len=max_model_len, seed=seed, enable_prefix_caching=enable_prefix_caching,
                            # log-probs after the temperature (softmax(logits / T)), what the HF engine records
                            logprobs_mode="processed_logprobs", **llm_kwargs)
        self.policy_version = 0

    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float, top_p: float,
                 stop_token_ids: list[int], seeds: list[int]) -> list[tuple[list[int], list[float]]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # ignore_eos: stop exactly at `stop_token_ids` (the chat format's end of turn) and nowhere else, as
        # RolloutEngine does; a model's generation_config may list more EOS ids
        params = [SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                 stop_token_ids=list(stop_token_ids), ignore_eos=True, logprobs=0, seed=int(s))
                  for s in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        results = []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            # logprobs=0: each position holds the sampled token's entry only
            lps = [float(completion.logprobs[i][tok].logprob) for i, tok in enumerate(ids)]
            results.append((ids, lps))
        return results

    def _model(self):
        """The nn.Module inside the in-process engine (the attribute path moved between vLLM versions)."""
        engine = self.llm.llm_engine
        for path in ("model_executor.driver_worker.worker.model_runner.model",
                     "model_executor.driver_worker.model_runner.model",
                     "engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model"):
            obj = engine
            try:
                for attr in path.split("."):
                    obj = getattr(obj, attr)
                return obj
            except AttributeError:
                continue
        return None

    def load_weights(self, named_tensors):
        weights = [(name, t.detach()) for name, t in named_tensors]
        model = self._model()
        if model is not None:
            model.load_weights(weights)  # vLLM maps HF names (q/k/v -> qkv_proj, gate/up -> gate_up_proj)
        else:  # engine in another process: run the same call on every worker
            self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        # cached prefixes hold KV computed with the old weights: they must not be reused
        self.llm.reset_prefix_cache()
        self.policy_version += 1


def _load_weights_on_worker(worker, weights):
    worker.model_runner.model.load_weights(weights)


# ---- weight sync ------------------------------------------------------------------------------------

def hf_named_weights(model) -> list[tuple[str, torch.Tensor]]:
    """The trainer model's weights under plain Hugging Face names, ready for `generator.load_weights`.

    * DDP / torch.compile wrappers: the `module.` / `_orig_mod.` prefixes are dropped.
    * peft (LoRA): every adapted layer's weight is W + (alpha / r) B A computed into a *new* tensor
      (the trainer's W is not merged in place: merge/unmerge round trips drift in low precision); the
      adapter tensors themselves are not sent; `base_model.model.` and `.base_layer` are dropped.
    Tied weights (lm_head = embed_tokens) are sent once, under the first name.
    """
    model = getattr(model, "module", model)
    model = getattr(model, "_orig_mod", model)
    deltas = {}
    if hasattr(model, "peft_config"):
        for name, module in model.named_modules():
            lora = hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")
            if lora and not getattr(module, "merged", False):  # merged: W already holds the update
                for adapter in getattr(module, "active_adapters", []):
                    if adapter in getattr(module, "lora_A", {}):
                        delta = module.get_delta_weight(adapter).detach()
                        key = name + ".base_layer.weight"
                        deltas[key] = deltas[key] + delta if key in deltas else delta
    out, seen = [], set()
    for name, tensor in model.state_dict(keep_vars=False).items():
        if ".lora_" in name or "original_module" in name:
            continue
        key = tensor.data_ptr(), tensor.shape
        if key in seen:  # tied weights
            continue
        seen.add(key)
        value = tensor + deltas[name].to(tensor.dtype) if name in deltas else tensor
        clean = name.removeprefix("base_model.model.").replace(".base_layer", "").replace("modules_to_save.default.", "")
        out.append((clean, value.detach()))
    return out


def sync_weights(model, generator, version: int) -> float:
    """Push the trainer's weights into the generator and set its policy version; returns the seconds taken.

    Call it after every optimizer step (and after a cold-start SFT) so the next rollout samples from the
    weights being trained; the version it sets is what the next trajectories record.
    """
    t0 = time.perf_counter()
    with torch.no_grad():
        generator.load_weights(hf_named_weights(model))
    generator.policy_version = int(version)
    return time.perf_counter() - t0


# ---- the rollout loop -------------------------------------------------------------------------------

class TokenRolloutEngine:
    """`RolloutEngine.run` in free mode, with each turn's sampling done by `generator` (see the module docstring).

    `run(envs, seeds, env_id, policy_version=None, generator=None)` has RolloutEngine's signature: the last
    argument is the torch RNG the per-row sampling seeds are drawn from (one seed per episode and turn).
    `policy_version` defaults to the generator's; passing a different one raises (the weights that sampled
    would not be the ones the record names: a forgotten `sync_weights`).
    """

    def __init__(self, generator, tokenizer, config: RolloutConfig):
        if config.action_mode != "free":
            raise ValueError(f"TokenRolloutEngine supports action_mode='free' only (got {config.action_mode!r}): "
                             "choice mode scores every action name on the trainer's KV cache, which a sampling "
                             "backend such as vLLM does not expose; use common.rollout.RolloutEngine for it")
        self.generator, self.tokenizer, self.config = generator, tokenizer, config
        self.chat = ChatFormat(tokenizer)

    def _generate(self, live: list, generator: torch.Generator | None):
        cfg, eos = self.config, self.chat.eos_id
        # one seed per episode and turn, from the script's RNG (which may live on the GPU)
        where = generator.device if generator is not None else "cpu"
        seeds = torch.randint(0, 2**31 - 1, (len(live),), generator=generator, device=where).tolist()
        outs = self.generator.generate([ep.token_ids for ep in live], cfg.max_turn_tokens, cfg.temperature,
                                       cfg.top_p, [eos], seeds)
        if len(outs) != len(live):
            raise RuntimeError(f"generator returned {len(outs)} completions for {len(live)} prompts")
        for ids, lps in outs:
            # the record's contract: one log-prob per sampled id, at least one id, nothing after the stop token
            if not 1 <= len(ids) <= cfg.max_turn_tokens or len(lps) != len(ids) or eos in ids[:-1]:
                raise RuntimeError(f"generator broke the contract: {len(ids)} ids, {len(lps)} log-probs, "
                                   f"max_tokens={cfg.max_turn_tokens}, stop token inside: {eos in ids[:-1]}")
        return outs

    @torch.no_grad()
    def run(self, envs: list, seeds: list[int], env_id: str = "", policy_version: int | None = None,
            generator: torch.Generator | None = None) -> list[Trajectory]:
        cfg, eos = self.config, self.chat.eos_id
        version = self.generator.policy_version
        if policy_version is not None and policy_version != version:
            raise ValueError(f"policy_version={policy_version} but the generator holds weights of version {version}: "
                             "call sync_weights(model, generator, version) after each update")
        max_action = cfg.max_turn_tokens
        episodes = start_episodes(envs, seeds, env_id, self.chat, max_action, cfg.max_total_tokens)
        live, finished = list(episodes), []
        while live:
            t0 = time.perf_counter()
            outs = self._generate(live, generator)
            decode_s = time.perf_counter() - t0
            texts, ended = [], []
            for ep, (ids, lps) in zip(live, outs):
                ep.append(list(ids), 1, [float(x) for x in lps])  # the ids as sampled: never re-tokenised
                texts.append(self.tokenizer.decode([t for t in ids if t != eos]))
                ended.append(ids[-1] == eos)
            stepped = step_envs(live, texts, cfg.env_workers)
            keep = []
            for row, ep in enumerate(live):
                if book_turn(ep, stepped[row], texts[row], len(outs[row][0]), ended[row], not ended[row], decode_s,
                             self.chat, max_action, cfg.max_total_tokens):
                    keep.append(row)
                else:
                    finished.append(ep)
            live = [live[i] for i in keep]
        order = {id(ep): i for i, ep in enumerate(episodes)}
        finished.sort(key=lambda ep: order[id(ep)])
        return [episode_record(ep, version) for ep in finished]
