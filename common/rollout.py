"""The batched multi-turn rollout engine, and the trainer-side scoring of the same records.

`RolloutEngine.run` plays B episodes in lockstep with one KV cache:
  * each turn, every live episode's new tokens (first prompt, or the wrapper + observation after its last
    action) are left-padded to a common length and appended to the cache in one forward; padding in the
    middle of a row is masked out and position ids count real tokens only, so a row's numbers equal those
    of the same sequence encoded alone (a test holds it);
  * the history is never re-encoded: cost grows with total tokens, not turns x context;
  * `free` mode samples up to `max_turn_tokens` per turn (temperature / top-p), stopping each row at EOS;
    `choice` mode scores every action name of the environment in one batched step on top of the cache
    (GLAM, Carta et al. 2023; TWOSOME's token-count normalisation optional, Tan et al. 2024) and samples
    an action from that distribution, so it is never invalid; with `mask_illegal_actions` only among the
    environment's `legal_actions()` (invalid-action masking, Huang & Ontañón 2022), recorded per step so that
    `policy_logprobs` applies the same mask;
  * the first prompts' longest common prefix (a group's whole prompt, or a shared system prompt) is prefilled
    once and its cache rows repeated, so G episodes of one task cost one prompt prefill, not G;
  * finished episodes leave the batch (their cache rows are dropped);
  * on a CPU the Linear weights are stored input-major while it runs (`decode_weight_layout`): MKL's GEMM at
    decode batch sizes is 1.5-9x faster from that layout (same numbers up to float rounding); and the keys are
    cached transposed so that attention over the cache is two batched GEMMs (`decode_attention`);
  * environments that wait on a subprocess to step (`parallel_step`, e.g. codegen's sandbox) are stepped
    concurrently, up to `env_workers` at a time, so a batch's submissions are graded in parallel;
  * the record is token-in/token-out: the ids sampled plus the ids fed, with source mask and the
    behaviour log-prob of every sampled token (under softmax(logits / T), before top-p truncation).

`policy_logprobs` recomputes, with gradients, the log-prob and entropy of every *policy unit* of a batch
of records: a sampled token in free mode, an action in choice mode. Losses are written over units, so
an algorithm file reads the same in both modes.
"""

from __future__ import annotations

import contextlib
import functools
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from common.chat import ChatFormat
from common.distributed import clip_grad_norm, print0
from common.models import autocast
from common.records import ChoiceStep, Trajectory, Turn


MIN_SHARED_PREFIX = 8  # tokens: a shorter common prefix is not worth a separate forward


@dataclass
class RolloutConfig:
    action_mode: str = "free"  # "free" | "choice"
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_turn_tokens: int = 16  # per-turn cap on sampled tokens (free mode)
    max_total_tokens: int = 4096  # per-episode cap on the whole sequence; hitting it ends the episode as truncated
    choice_token_norm: bool = False  # TWOSOME: divide each action's log-prob by its token count
    # choice mode: sample only among env.legal_actions() (invalid-action masking; an env must list them); each
    # ChoiceStep records them
    mask_illegal_actions: bool = False
    env_workers: int = 8  # threads stepping a batch's environments at once when they set `parallel_step`
    share_prompt_prefix: bool = True  # prefill the first prompts' common prefix once (a GRPO group: the whole prompt)
    top_k: int = 0  # free mode: sample among the k most likely tokens only (0: all)
    input_major_weights: bool = True  # CPU: Linear weights input-major while decoding (`decode_weight_layout`)
    transposed_keys: bool = True  # CPU: keys cached as [B, H, D, T], attended by `decode_attention` instead of SDPA


def mask_illegal(logits: torch.Tensor, legal: list[list[int] | None]) -> torch.Tensor:
    """Invalid-action masking (Huang & Ontañón 2022): row r's candidates outside legal[r] get the dtype's minimum
    (not -inf: their p log p stays 0 and every gradient finite), so a softmax gives them probability 0 and the
    policy gradient flows only through the legal ones. legal[r] None masks nothing in row r."""
    if all(keep is None for keep in legal):
        return logits
    illegal = torch.zeros(logits.shape, dtype=torch.bool)
    for row, keep in enumerate(legal):
        if keep is not None:
            illegal[row] = True
            illegal[row, keep] = False
    return logits.masked_fill(illegal.to(logits.device), torch.finfo(logits.dtype).min)


def check_env(env, action_mode: str, mask_illegal_actions: bool = False) -> None:
    """Raise ValueError if the engine cannot act on `env` so (a script calls it on a probe before loading a model):
    choice mode needs action names; `mask_illegal_actions`, choice mode and a `legal_actions()` that lists them (asked
    after a reset to seed 0)."""
    if action_mode == "choice" and not getattr(env, "action_names", None):
        raise ValueError(f"choice mode (--action-mode choice) needs an environment with action_names; "
                         f"{type(env).__name__} has none")
    if mask_illegal_actions:
        if action_mode != "choice":
            raise ValueError("invalid-action masking (--mask-illegal-actions) masks action names: it needs choice mode")
        env.reset(seed=0)
        if not callable(getattr(env, "legal_actions", None)) or env.legal_actions() is None:
            raise ValueError(f"invalid-action masking (--mask-illegal-actions) needs an environment whose "
                             f"legal_actions() lists them; {type(env).__name__} does not")


def sample_from_logits(logits: torch.Tensor, temperature: float, top_p: float, generator=None, top_k: int = 0):
    """Returns (token ids, their log-probs under softmax(logits / T)). T = 0 is greedy (log-probs at T = 1).

    top-k, then top-p, truncate the distribution that is sampled from (renormalised), as transformers' generate
    does. With top-k the policy is that truncated distribution, and the log-probs returned are under it (the
    trainer recomputes them so: `policy_logprobs(top_k=...)`); top-p's are under the untruncated softmax(logits / T)."""
    if temperature == 0:
        token = logits.argmax(-1)
        return token, F.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    logprobs = F.log_softmax(logits / temperature, -1)
    probs = logprobs.exp()
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, -1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
        kept = probs.sum(-1, keepdim=True)
        probs, logprobs = probs / kept, logprobs - kept.log()
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always survives)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    # inverse-CDF sampling: one uniform per row, where torch.multinomial draws one exponential per vocabulary entry
    # (49,152 for SmolLM2: ~18 ms of a ~100 ms decode step at B = 16); float64 sums keep rare tokens' odds accurate
    cdf = probs.double().cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    token = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


def _lm_parts(model):
    """The transformer body (hidden states) and the LM head, so logits are computed only where needed."""
    return model.get_decoder(), model.get_output_embeddings()


def score_candidates(model, cache, attention_mask, last_logits, candidates: list[list[int]], token_norm: bool):
    """Joint log-prob of each candidate continuation after the cached prefix, for every row.

    `last_logits` [n, V] are the logits at the prefix's last position. Tokens 1..m-1 of every multi-token
    candidate go into one forward on top of the cache, side by side: a 4-D mask lets each candidate's
    tokens see the prefix and its own earlier tokens only (the tree of `_branch_layout`), so one forward
    scores them all. The cache is cropped back to the prefix afterwards, never copied (repeating it once
    per candidate would need k times the cache's memory, tens of GB for 25 long episodes with 6 actions).
    Returns scores [n, K] (with grad if the inputs carry it); the cache is left as it was.
    """
    first_logp = F.log_softmax(last_logits.float(), -1)
    device = last_logits.device
    scores = first_logp[:, torch.tensor([c[0] for c in candidates], device=device)]  # [n, K]
    lengths = torch.tensor([len(c) for c in candidates], device=device, dtype=scores.dtype)
    multi = [(j, c) for j, c in enumerate(candidates) if len(c) > 1]
    if multi:
        body, head = _lm_parts(model)
        n, prefix = scores.shape[0], cache.get_seq_length()
        feed = torch.tensor([t for _, c in multi for t in c[:-1]], device=device)  # [Q]
        targets = torch.tensor([t for _, c in multi for t in c[1:]], device=device)
        offset = torch.tensor([k for _, c in multi for k in range(len(c) - 1)], device=device)  # within its candidate
        owner = torch.tensor([q for q, (_, c) in enumerate(multi) for _ in c[:-1]], device=device)
        q_len = len(feed)
        # [n, 1, Q, prefix + Q]: the prefix's real tokens, and the same candidate's tokens up to this one
        block = (owner[:, None] == owner[None, :]) & (offset[None, :] <= offset[:, None])
        allowed = torch.cat([attention_mask.bool()[:, None, None, :].expand(n, 1, q_len, prefix),
                             block[None, None].expand(n, 1, q_len, q_len)], -1)
        pos = attention_mask.sum(1, keepdim=True) + offset[None, :]  # real-token positions, as the cache counts
        try:
            hidden = body(input_ids=feed.expand(n, q_len), attention_mask=_shared_mask(allowed, model, device),
                          position_ids=pos, past_key_values=cache, use_cache=True).last_hidden_state
        finally:
            if cache.get_seq_length() > prefix:  # back to the prefix, for the caller
                cache.crop(prefix - cache.get_seq_length())
        logp = F.log_softmax(head(hidden).float(), -1).gather(-1, targets.expand(n, q_len)[..., None]).squeeze(-1)
        columns = torch.tensor([multi[q][0] for q in owner.tolist()], device=device)
        scores = scores + torch.zeros_like(scores).index_add(1, columns, logp)
    if token_norm:
        scores = scores / lengths
    return scores


class _Episode:
    """Mutable per-episode state while the batch runs; becomes a Trajectory at the end."""

    def __init__(self, env, seed: int, env_id: str):
        self.env, self.seed, self.env_id = env, seed, env_id
        self.token_ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.unfed: list[int] = []  # ids in the record but not yet in the KV cache
        self.turns: list[Turn] = []
        self.choice_steps: list[ChoiceStep] = []
        self.components: dict[str, float] = {}
        self.termination = ""
        self.info: dict = {}
        self.layer_inputs: list[torch.Tensor] = []  # see RolloutEngine(record_layer_inputs=...)
        self.branch_inputs: list[torch.Tensor] = []  # one [branch tokens, hidden] per choice step
        self.tail: list[int] = []  # see RolloutEngine(record_final_observation=...)
        self.tail_inputs: torch.Tensor | None = None

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None):
        self.token_ids += ids
        self.mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.unfed += ids


def start_episodes(envs: list, seeds: list[int], env_id: str, chat, max_action: int,
                   max_total_tokens: int) -> list[_Episode]:
    """Reset each environment with its seed and put the system + first observation prompt in its record."""
    episodes = [_Episode(env, seed, env_id) for env, seed in zip(envs, seeds)]
    for ep in episodes:
        obs, ep.info = ep.env.reset(seed=ep.seed)
        ep.append(chat.prompt_ids(ep.env.system_prompt, obs), 0)
        if len(ep.token_ids) + max_action > max_total_tokens:
            raise ValueError(f"max_total_tokens={max_total_tokens} cannot hold the first prompt "
                             f"({len(ep.token_ids)} tokens) and one action")
    return episodes


def step_envs(episodes: list[_Episode], actions: list, workers: int) -> list[tuple[tuple, float]]:
    """(env.step(action), seconds) for each episode, in order; concurrent for `parallel_step` envs."""
    def step(row: int):
        t0 = time.perf_counter()
        out = episodes[row].env.step(actions[row])
        return out, time.perf_counter() - t0

    workers = min(workers, len(episodes))
    if workers > 1 and all(getattr(ep.env, "parallel_step", False) for ep in episodes):
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env-step") as pool:
            return list(pool.map(step, range(len(episodes))))
    return [step(row) for row in range(len(episodes))]


def book_turn(ep: _Episode, stepped: tuple, text: str, num_action_tokens: int, ended_with_eos: bool, capped: bool,
              decode_s: float, chat, max_action: int, max_total_tokens: int) -> bool:
    """Record the environment's answer to one action (`stepped` from `step_envs`); True while the episode goes on.

    Going on appends the next observation's segment to the record; the episode ends at termination or
    truncation, or when the next observation plus a full action would not fit in `max_total_tokens`.
    """
    (obs, reward, terminated, truncated, info), env_s = stepped
    for name, value in info.get("reward_components", {}).items():
        ep.components[name] = ep.components.get(name, 0.0) + float(value)
    ep.turns.append(Turn(action_text=text, observation=obs, reward=float(reward),
                         action_valid=bool(info.get("action_valid", True)), num_action_tokens=num_action_tokens,
                         decode_s=decode_s, env_s=env_s, truncated_tokens=capped))
    ep.info = info
    if terminated or truncated:
        ep.termination = info.get("termination", "truncated" if truncated else "failure")
        return False
    segment = chat.next_turn_ids(obs, action_ended_with_eos=ended_with_eos)
    if len(ep.token_ids) + len(segment) + max_action > max_total_tokens:
        ep.termination = "truncated"
        ep.info = {**info, "truncated_by": "max_total_tokens"}
        return False
    ep.append(segment, 0)
    return True


def episode_record(ep: _Episode, policy_version: int) -> Trajectory:
    """The finished episode as the trajectory record (every rollout engine writes it through here)."""
    first_policy = next((i for i, m in enumerate(ep.mask) if m), len(ep.mask))
    return Trajectory(
        token_ids=ep.token_ids, source_mask=ep.mask, behavior_logprobs=ep.logprobs,
        policy_version=policy_version, turns=ep.turns, rewards=ep.components,
        return_=sum(t.reward for t in ep.turns), termination=ep.termination or "failure",
        env_version=str(ep.info.get("env_version", getattr(ep.env, "env_version", ""))),
        task_id=str(ep.info.get("task_id", "")), seed=int(ep.seed), env_id=ep.env_id,
        prompt_length=first_policy, choice_steps=ep.choice_steps,
        extra={k: ep.info[k] for k in ("truncated_by",) if k in ep.info},
    )


class _BufferedLayer(DynamicLayer):
    """One layer's keys and values in a preallocated buffer, written in place and grown `CHUNK` positions at a time.

    transformers' DynamicLayer appends by `torch.cat`, which copies the layer's whole cache at every decode step:
    at B = 16 and ~1,000 cached tokens that is ~0.7 GB of copies per step for SmolLM2, more than its weights. Here
    a step writes only its new positions; `keys` / `values` are views of the filled part. Same numbers.

    `keys_transposed=True` stores the keys as [B, H, D, T] (`keys` is then a transposed view, still [B, H, T, D])
    so that `decode_attention` computes q K^T from contiguous rows of K^T; the values stay [B, H, T, D].
    """

    CHUNK = 256

    def __init__(self, keys_transposed: bool = False):
        super().__init__()
        self.keys_transposed = keys_transposed

    def _key_rows(self, buffer: torch.Tensor) -> torch.Tensor:  # a key buffer seen as [B, H, T, D]
        return buffer.transpose(-1, -2) if self.keys_transposed else buffer

    def _new_buffer(self, like: torch.Tensor, positions: int, transposed: bool) -> torch.Tensor:
        batch, heads, _, dim = like.shape
        return like.new_empty((batch, heads, dim, positions) if transposed else (batch, heads, positions, dim))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.length = key_states.dtype, key_states.device, 0
        self.key_buffer = self._new_buffer(key_states, 0, self.keys_transposed)
        self.value_buffer = self._new_buffer(value_states, 0, False)
        self.is_initialized = True
        self._views()

    def _views(self):
        self.keys = self._key_rows(self.key_buffer)[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[2]
        if end > self.value_buffer.shape[2]:  # grow: one copy per CHUNK positions, not one per step
            keys = self._new_buffer(key_states, end + self.CHUNK, self.keys_transposed)
            values = self._new_buffer(value_states, end + self.CHUNK, False)
            self._key_rows(keys)[:, :, : self.length] = self.keys
            values[:, :, : self.length] = self.values
            self.key_buffer, self.value_buffer = keys, values
        self._key_rows(self.key_buffer)[:, :, self.length: end] = key_states
        self.value_buffer[:, :, self.length: end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if self.is_initialized and tokens_to_remove < 0:  # DynamicLayer's convention: a negative count to drop
            self.length = max(0, self.length + tokens_to_remove)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
            self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._views()


class BufferedCache(DynamicCache):
    """A DynamicCache whose layers are `_BufferedLayer`s (no-grad rollouts: the buffers are written in place)."""

    def __init__(self, keys_transposed: bool = False):
        super().__init__()
        self.layer_class_to_replicate = functools.partial(_BufferedLayer, keys_transposed=keys_transposed)


@contextlib.contextmanager
def decode_weight_layout(model, enabled: bool = True):
    """While the block runs, every Linear weight W [out, in] of a CPU model is stored input-major (W^T contiguous,
    `W.t().contiguous().t()`: same shape, same values); the usual row-major layout is restored on the way out.

    Why: y = x W^T with a few rows x (a decode step: one token per episode) runs 1.5-9x faster in MKL's sgemm on
    this machine's AVX-512 CPU from the input-major layout (SmolLM2's projections at 4-16 rows; 2x for the LM head),
    while prefill and training run at about the same speed (benchmarks/results/rollout_speed_layout.md). The numbers
    are those of the usual layout up to float rounding (the GEMM may sum in another order: log-probs within ~1e-5,
    same tokens in the tests). Training keeps the usual layout: a gradient follows its parameter's layout, and
    gloo's all-reduce and FSDP2 want contiguous tensors. The original tensors are kept and put back (nothing trains
    inside the block), so leaving costs no copy and a model memory-mapped from its safetensors file is still one
    copy of the weights afterwards. Cost: one copy of the weights while the block runs (~0.25 s and ~540 MB for
    SmolLM2). Skipped on GPUs (cuBLAS does not care) and under FSDP2, whose gathered weights alias its buffers.
    """
    from torch.distributed.fsdp import FSDPModule

    enabled = enabled and not any(isinstance(m, FSDPModule) for m in model.modules())
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2}
    weights = [w for w in weights.values() if w.device.type == "cpu" and w.is_contiguous()] if enabled else []
    originals = [w.data for w in weights]  # given back as they were: same storage, no copy (see the docstring)
    try:
        for w in weights:  # a tied LM head / embedding matrix is one parameter: moved once
            w.data = w.data.t().contiguous().t()
        yield
    finally:
        for w, original in zip(weights, originals):
            w.data = original


DECODE_ATTENTION = "agentrl_decode"  # the name `decode_attention` is registered under in transformers (below)
DECODE_ATTENTION_MAX_QUERY = 64  # longer query blocks (prefills) go to torch's fused SDPA kernel


def decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """softmax(q K^T * scale + mask) V for a short block of queries (a decode step, an observation), written as two
    batched matrix products that read the keys from a [B, H_kv, D, T] cache (`_BufferedLayer(keys_transposed=True)`).

    Why: at a decode step each layer's attention reads the whole cache for 1 query per row, so it is bound by
    memory traffic, and torch's CPU flash kernel (tiled for long query blocks) reaches about half of this machine's
    bandwidth on it. With K^T stored contiguously, q K^T and P V are plain batched GEMMs with few rows, and the 3
    query heads that share a key/value head (grouped-query attention) are one 3-row product over that head's keys,
    which are read once. Same numbers as SDPA up to float rounding. Masked scores get the dtype's minimum (not -inf),
    so a query that sees only padding (a pad fed for a finished row) gets finite, unused values rather than NaN.
    Anything else (a long query block, a cache in the usual layout, dropout, a causal block without a mask) goes to
    transformers' SDPA path, so the function is correct on any input; it is only fast on the short ones.
    """
    batch, heads, q_len, dim = query.shape
    if (key.stride(-2) != 1 or q_len > DECODE_ATTENTION_MAX_QUERY or dropout > 0
            or (attention_mask is None and q_len > 1)):
        return sdpa_attention_forward(module, query, key.contiguous(), value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads  # query heads kv*groups .. kv*groups + groups-1 share key/value head kv
    scores = torch.matmul(query.reshape(batch, kv_heads, groups * q_len, dim), key.transpose(-1, -2))
    scores = scores.mul_(dim ** -0.5 if scaling is None else scaling).view(batch, kv_heads, groups, q_len, length)
    if attention_mask is not None:  # [B, 1, L, T], one mask for every head
        mask = attention_mask[:, :, None]
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
        else:  # an additive float mask (0 / -inf), as score_candidates passes
            scores.add_(mask)
    probs = torch.softmax(scores, -1).view(batch, kv_heads, groups * q_len, length)
    out = torch.matmul(probs, value).view(batch, heads, q_len, dim)
    return out.transpose(1, 2).contiguous(), None  # [B, L, H, D], as transformers' attention functions return


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)  # the same boolean masks as for "sdpa"


def uses_decode_attention(model) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == DECODE_ATTENTION


@contextlib.contextmanager
def decode_attention_backend(model, enabled: bool = True):
    """While the block runs, a CPU model on SDPA attends with `decode_attention`, and `KVBatch` caches its keys
    transposed for it; the model's attention implementation is put back on the way out. Training never runs inside.
    """
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    enabled = enabled and previous == "sdpa" and next(model.parameters()).device.type == "cpu"
    if enabled:
        config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        if enabled:
            config._attn_implementation = previous


class KVBatch:
    """One KV cache over a batch of token streams (one row each), grown by appending segments.

    Segments are left-padded into a column block and the padding is masked; position ids count real tokens only,
    so a row's numbers do not depend on what the other rows hold. Rows that are done leave with `keep`. The cache
    is written in place (`BufferedCache`), so a decode step costs its new tokens, not a copy of the whole cache.
    """

    def __init__(self, model, pad_id: int):
        self.body, self.head = _lm_parts(model)
        self.pad_id, self.device = pad_id, next(model.parameters()).device
        # keys transposed for decode_attention when it is on (`decode_attention_backend`)
        self.cache = BufferedCache(keys_transposed=True) if uses_decode_attention(model) else BufferedCache()
        self.attn, self.tokens = None, 0  # tokens: real (unpadded) tokens fed so far

    def feed(self, segments: list[list[int]]) -> torch.Tensor:
        """Append each row's segment (an empty one feeds a masked pad); return float logits at each row's last token."""
        width = max(1, max(len(s) for s in segments))
        ids = torch.full((len(segments), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(segments), width), dtype=torch.long)
        for row, seg in enumerate(segments):
            if seg:
                ids[row, width - len(seg):], mask[row, width - len(seg):] = torch.tensor(seg), 1
        self.tokens += int(mask.sum())
        ids, mask = ids.to(self.device), mask.to(self.device)
        self.attn = mask if self.attn is None else torch.cat([self.attn, mask], 1)
        pos = (self.attn.cumsum(1) - 1).clamp(min=0)[:, -width:]
        hidden = self.body(input_ids=ids, attention_mask=self.attn, position_ids=pos, past_key_values=self.cache,
                           use_cache=True).last_hidden_state
        return self.head(hidden[:, -1]).float()

    def keep(self, rows: list[int]):
        """Drop every row not in `rows` (indices into the current batch, in the order to keep)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.attn = self.attn[index]


class RolloutEngine:
    """Plays batches of episodes; see the module docstring.

    `record_layer_inputs=k` keeps, for every token fed during the rollout, the hidden state entering
    decoder layer k (`self.layer_inputs`, one [fed_tokens, hidden] tensor per returned trajectory). When
    layers below k are frozen, the trainer starts its forward there (`policy_logprobs(..., layer_inputs=)`)
    instead of recomputing what the rollout already computed. In choice mode with multi-token action names
    the candidates' scoring forwards are recorded too (`self.branch_inputs`, one [branch tokens, hidden]
    tensor per trajectory in `_branch_layout`'s order, or None), so the tree-shaped scoring forward of
    `policy_logprobs(..., branch_inputs=)` also starts at layer k.

    `record_final_observation=True` (with `record_layer_inputs`): an episode that ends truncated (time limit
    or token cap) gets its last action and final observation fed into the KV cache before it leaves the
    batch, one short prefill, so that a critic can read V(s_T) off the recorded layer inputs without a
    full forward. `self.final_tails[i]` is then (tail ids, their layer-k inputs) for trajectory i, else
    None; the tail ids are `chat.next_turn_ids(final observation)` and are not part of the record.
    """

    def __init__(self, model, tokenizer, config: RolloutConfig, record_layer_inputs: int | None = None,
                 record_final_observation: bool = False):
        if config.action_mode not in ("free", "choice"):
            raise ValueError(f"action_mode must be 'free' or 'choice', got {config.action_mode!r}")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.chat = ChatFormat(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.chat.eos_id
        self.device = next(model.parameters()).device
        self.body, self.head = _lm_parts(model)
        if record_final_observation and record_layer_inputs is None:
            raise ValueError("record_final_observation needs record_layer_inputs")
        self.record_layer_inputs, self.record_final_observation = record_layer_inputs, record_final_observation
        self.layer_inputs: list[torch.Tensor] = []
        self.final_tails: list[tuple[list[int], torch.Tensor] | None] = []
        self.branch_inputs: list[torch.Tensor | None] = []
        self._captured, self._recording, self._branch_log = None, False, None
        if record_layer_inputs is not None:
            def capture(_module, args, kwargs):
                if self._recording:
                    self._captured = args[0] if args else kwargs["hidden_states"]
                    if self._branch_log is not None:  # the candidate-scoring forward (score_candidates)
                        self._branch_log.append(self._captured)
            self.body.layers[record_layer_inputs].register_forward_pre_hook(capture, with_kwargs=True)

    def action_candidates(self, env) -> list[list[int]]:
        if not getattr(env, "action_names", None):
            raise ValueError("choice mode needs an environment with action_names")
        return [self.chat.encode(name) for name in env.action_names]

    def legal_candidates(self, env) -> list[int] | None:
        """env.legal_actions() under `mask_illegal_actions` (else None: every action), checked."""
        if not self.config.mask_illegal_actions:
            return None
        legal = env.legal_actions()
        if not legal or not all(0 <= k < len(env.action_names) for k in legal):
            raise ValueError(f"{type(env).__name__}.legal_actions() returned {legal!r}: expected a non-empty list of "
                             f"indices into its {len(env.action_names)} action names")
        return sorted({int(k) for k in legal})

    # -- the KV cache ----------------------------------------------------------------------------------
    def _feed(self, segments: list[list[int]], rows: list[_Episode]) -> torch.Tensor:
        """Append each row's segment to the batch's cache; return logits at each row's last token."""
        logits = self.kv.feed(segments)
        if self.record_layer_inputs is not None:
            width = max(len(s) for s in segments)
            for row, (seg, ep) in enumerate(zip(segments, rows)):
                if seg:
                    ep.layer_inputs.append(self._captured[row, width - len(seg):])
        return logits

    def _feed_shared_prefix(self, live: list[_Episode]):
        """Prefill the first prompts' longest common prefix once, then repeat its cache row for every episode.

        At least one token of each prompt is left to feed, so the first feed still returns every row's logits.
        """
        prompts = [ep.unfed for ep in live]
        limit = min(len(p) for p in prompts) - 1
        shared = 0
        while shared < limit and all(p[shared] == prompts[0][shared] for p in prompts):
            shared += 1
        if shared < MIN_SHARED_PREFIX:
            return
        self._feed([prompts[0][:shared]], live[:1])
        if self.record_layer_inputs is not None:  # every episode's record starts with the same layer inputs
            for ep in live[1:]:
                ep.layer_inputs.append(live[0].layer_inputs[0])
        self.kv.keep([0] * len(live))
        for ep in live:
            ep.unfed = ep.unfed[shared:]

    def _feed_final_observations(self, live: list[_Episode]):
        """Feed each truncated episode's unfed action tokens and final observation (`ep.tail`); the other rows feed
        a masked pad. The action's inputs complete the record's; the observation's are kept apart."""
        self._feed([ep.unfed + ep.tail if ep.tail else [] for ep in live], live)
        for ep in live:
            if ep.tail:
                inputs = ep.layer_inputs.pop()
                ep.layer_inputs.append(inputs[: len(ep.unfed)])
                ep.tail_inputs, ep.unfed = inputs[len(ep.unfed):], []

    # -- acting ----------------------------------------------------------------------------------------
    def _act_free(self, logits: torch.Tensor, episodes: list[_Episode], generator):
        cfg = self.config
        n = len(episodes)
        sampled = [[] for _ in range(n)]
        sampled_lp = [[] for _ in range(n)]
        done = torch.zeros(n, dtype=torch.bool)
        for step in range(cfg.max_turn_tokens):
            token, logp = sample_from_logits(logits, cfg.temperature, cfg.top_p, generator, cfg.top_k)
            token, logp = token.cpu(), logp.cpu()
            for row in range(n):
                if not done[row]:
                    sampled[row].append(int(token[row]))
                    sampled_lp[row].append(float(logp[row]))
            done |= token == self.chat.eos_id
            if bool(done.all()) or step == cfg.max_turn_tokens - 1:
                break
            # rows still generating feed their token; finished rows feed a masked pad
            logits = self._feed([[] if done[r] else [sampled[r][-1]] for r in range(n)], episodes)
        for row, ep in enumerate(episodes):
            ep.append(sampled[row], 1, sampled_lp[row])
            ep.unfed = sampled[row][-1:]  # everything but the last sampled token is already in the cache
        texts = [self.tokenizer.decode([t for t in s if t != self.chat.eos_id]) for s in sampled]
        ended = [s[-1] == self.chat.eos_id for s in sampled]
        return texts, texts, ended, [len(s) for s in sampled]

    def _act_choice(self, logits: torch.Tensor, episodes: list[_Episode], generator):
        cfg = self.config
        candidates = self.action_candidates(episodes[0].env)
        self._branch_log = [] if self._recording else None
        try:
            scores = score_candidates(self.model, self.kv.cache, self.kv.attn, logits, candidates, cfg.choice_token_norm)
        finally:
            branch_log, self._branch_log = self._branch_log, None
        if branch_log:  # [rows, branch tokens, hidden]: every multi-token candidate's tokens 1..m-1, in order
            for row, ep in enumerate(episodes):
                ep.branch_inputs.append(torch.cat([x[row] for x in branch_log]))
        legal = [self.legal_candidates(ep.env) for ep in episodes]
        action_logp = F.log_softmax(mask_illegal(scores / (cfg.temperature or 1.0), legal), -1)
        if cfg.temperature == 0:
            chosen = action_logp.argmax(-1)
        else:
            chosen = torch.multinomial(action_logp.exp(), 1, generator=generator).squeeze(-1)
        token_logp = F.log_softmax(logits, -1)
        actions, texts = [], []
        for row, ep in enumerate(episodes):
            k = int(chosen[row])
            ids = candidates[k]
            # per-token behaviour log-probs of the chosen name are kept for inspection; the action-level
            # log-prob (normalised over the candidates) in ChoiceStep is what enters the loss
            first_lp = [float(token_logp[row, ids[0]])] + [0.0] * (len(ids) - 1)
            ep.choice_steps.append(ChoiceStep(position=len(ep.token_ids), candidates=candidates, chosen=k,
                                              logprob=float(action_logp[row, k]), legal=legal[row]))
            ep.append(ids, 1, first_lp)
            actions.append(k)
            texts.append(ep.env.action_names[k])
        return actions, texts, [False] * len(episodes), [len(candidates[a]) for a in actions]

    # -- the episode loop ------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, envs: list, seeds: list[int], env_id: str = "", policy_version: int = 0,
            generator: torch.Generator | None = None) -> list[Trajectory]:
        with (decode_weight_layout(self.model, self.config.input_major_weights),
              decode_attention_backend(self.model, self.config.transposed_keys)):
            return self._run(envs, seeds, env_id, policy_version, generator)

    def _run(self, envs: list, seeds: list[int], env_id: str, policy_version: int,
             generator: torch.Generator | None) -> list[Trajectory]:
        cfg = self.config
        self._recording = self.record_layer_inputs is not None
        self.kv = KVBatch(self.model, self.pad_id)
        max_action = cfg.max_turn_tokens
        check_env(envs[0], cfg.action_mode, cfg.mask_illegal_actions)
        if cfg.action_mode == "choice":
            max_action = max(len(c) for c in self.action_candidates(envs[0]))
        episodes = start_episodes(envs, seeds, env_id, self.chat, max_action, cfg.max_total_tokens)
        live = list(episodes)
        finished: list[_Episode] = []
        while live:
            t0 = time.perf_counter()
            if cfg.share_prompt_prefix and not finished and not live[0].turns and len(live) > 1:  # first turn
                self._feed_shared_prefix(live)
            logits = self._feed([ep.unfed for ep in live], live)
            for ep in live:
                ep.unfed = []
            act = self._act_free if cfg.action_mode == "free" else self._act_choice
            actions, texts, ended_with_eos, n_tokens = act(logits, live, generator)
            decode_s = time.perf_counter() - t0
            keep = []
            stepped = step_envs(live, actions, cfg.env_workers)
            for row, ep in enumerate(live):
                capped = cfg.action_mode == "free" and not ended_with_eos[row]
                if book_turn(ep, stepped[row], texts[row], n_tokens[row], ended_with_eos[row], capped, decode_s,
                             self.chat, max_action, cfg.max_total_tokens):
                    keep.append(row)  # its next segment is queued behind the action's unfed tokens
                else:
                    finished.append(ep)
                    if self.record_final_observation and ep.termination == "truncated":
                        ep.tail = self.chat.next_turn_ids(ep.turns[-1].observation,
                                                          action_ended_with_eos=ended_with_eos[row])
            if self.record_final_observation and any(ep.tail for ep in live):
                self._feed_final_observations(live)
            if len(keep) < len(live):
                if keep:
                    self.kv.keep(keep)
                live = [live[i] for i in keep]
        self.kv = None
        order = {id(ep): i for i, ep in enumerate(episodes)}
        finished.sort(key=lambda ep: order[id(ep)])
        if self.record_layer_inputs is not None:
            self.layer_inputs = [torch.cat(ep.layer_inputs) for ep in finished]
            self.final_tails = [(ep.tail, ep.tail_inputs) if ep.tail else None for ep in finished]
            self.branch_inputs = [torch.cat(ep.branch_inputs) if ep.branch_inputs else None for ep in finished]
        self._captured, self._recording = None, False
        return [episode_record(ep, policy_version) for ep in finished]

@dataclass
class UnitBatch:
    """Per policy unit (free: sampled token; choice: action), padded to [B, U]."""

    logprobs: torch.Tensor  # current policy log-prob of the unit
    entropy: torch.Tensor  # entropy of the distribution the unit was drawn from
    mask: torch.Tensor  # 1 where a unit exists
    hidden: torch.Tensor | None = None  # final hidden states (after the norm) of the forward, [B, L - hidden_start, H]
    hidden_start: int = 0  # the record position of hidden[:, 0]: > 0 when a shared prefix ran apart (a value head
    # reads position j at hidden[:, j - hidden_start])


def behavior_units(trajs: list[Trajectory], action_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Behaviour log-probs per policy unit, padded [B, U], and the unit mask."""
    rows = [[c.logprob for c in t.choice_steps] if action_mode == "choice"
            else [lp for lp, m in zip(t.behavior_logprobs, t.source_mask) if m] for t in trajs]
    width = max(1, max(len(r) for r in rows))
    out = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return out, mask


def _branch_layout(trajs: list[Trajectory]):
    """Where each multi-token candidate's tokens go when appended after an episode's own tokens.

    For choice step s (prefix length p) and candidate k, tokens 1..m-1 of the candidate are appended
    with positions p .. p+m-2 and may attend only to the episode's first p tokens and to the earlier
    tokens of the same candidate (tree attention), so one forward scores every candidate of every step.
    Returns, per episode, a list of (step, k, start, n) with `start` the index of the first appended token.
    """
    layout = []
    for t in trajs:
        rows, cursor = [], len(t.token_ids)
        for s_idx, step in enumerate(t.choice_steps):
            for k, cand in enumerate(step.candidates):
                rows.append((s_idx, k, cursor, len(cand) - 1))
                cursor += len(cand) - 1
        layout.append(rows)
    return layout


def policy_logprobs(model, trajs: list[Trajectory], action_mode: str, temperature: float = 1.0,
                    choice_token_norm: bool = False, layer_inputs: list[torch.Tensor] | None = None,
                    from_layer: int = 0, branch_inputs: list[torch.Tensor | None] | None = None,
                    share_prefix: bool = True, top_k: int = 0) -> UnitBatch:
    """One packed forward over the records (right-padded), log-probs and entropies at the policy units.

    The LM head runs only at the positions that predict a policy token, not over the whole sequence.
    In choice mode with multi-token action names, the candidates' tokens are appended to each episode
    with a tree-shaped 4-D attention mask (see `_branch_layout`), still one forward. A 4-D mask (tree, or
    causal + padding for unequal lengths) is passed as one float tensor shared by all layers (`_shared_mask`).
    With `layer_inputs` (recorded by the rollout engine at decoder layer `from_layer`, below which the
    model is frozen), only layers from `from_layer` up run: the lower layers' result is already known. With
    multi-token action names that needs the candidates' recorded inputs too (`branch_inputs`, from the same
    engine); without them the forward starts at the embeddings.

    `share_prefix`: the records' longest common prefix before their first policy unit (a GRPO group's prompt)
    runs once, at batch 1, and every row's remainder attends to its repeated KV cache; gradients from all rows
    meet in that one prefix forward. Same numbers as the plain forward, at a fraction of the tokens. Off by
    itself where it cannot apply: one record, multi-token action names (the tree layout), layers under
    gradient checkpointing (they drop the cache) or sharded by FSDP2 (one forward of a layer per backward).

    `top_k` (free mode): log-probs and entropies under the distribution the rollout sampled from, softmax over the
    k most likely tokens (`sample_from_logits`); the recorded token stays in it should an update push it out.
    """
    device = next(model.parameters()).device
    body, head = _lm_parts(model)
    temp = temperature or 1.0
    multi = action_mode == "choice" and any(len(c) > 1 for t in trajs for s in t.choice_steps[:1] for c in s.candidates)
    layout = _branch_layout(trajs) if multi else [[] for _ in trajs]
    lengths = [len(t.token_ids) + sum(n for *_, n in rows) for t, rows in zip(trajs, layout)]
    width = max(lengths)
    shared = _shared_prefix_length(body, trajs) if share_prefix and not multi else 0
    ids = torch.zeros((len(trajs), width), dtype=torch.long)
    pos = torch.zeros_like(ids)
    for i, (t, rows) in enumerate(zip(trajs, layout)):
        ids[i, : len(t.token_ids)] = torch.tensor(t.token_ids)
        pos[i, : len(t.token_ids)] = torch.arange(len(t.token_ids))
        for s_idx, k, start, n in rows:
            p = t.choice_steps[s_idx].position
            ids[i, start: start + n] = torch.tensor(t.choice_steps[s_idx].candidates[k][:-1])
            pos[i, start: start + n] = torch.arange(p, p + n)
    if multi:
        allowed = torch.zeros((len(trajs), 1, width, width), dtype=torch.bool)
        for i, (t, rows) in enumerate(zip(trajs, layout)):
            n_base = len(t.token_ids)
            allowed[i, 0, :n_base, :n_base] = torch.tril(torch.ones(n_base, n_base, dtype=torch.bool))
            for s_idx, _, start, n in rows:
                p = t.choice_steps[s_idx].position
                allowed[i, 0, start: start + n, :p] = True
                allowed[i, 0, start: start + n, start: start + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            allowed[i, 0, lengths[i]:, 0] = True  # padding rows attend somewhere (their output is unused)
        attention_mask = _shared_mask(allowed, model, device)
    elif shared:  # the remainders: every row sees the whole prefix, then itself causally, up to its length
        key = torch.arange(shared, width)
        causal = (key[None, :] <= key[:, None])[None, None] & (key < torch.tensor(lengths)[:, None])[:, None, None, :]
        allowed = torch.cat([torch.ones((len(trajs), 1, width - shared, shared), dtype=torch.bool), causal], -1)
        attention_mask = _shared_mask(allowed, model, device)
    elif min(lengths) < width:  # right padding: causal and key-padding, as transformers builds it from a 2-D mask
        key = torch.arange(width)
        causal = (key[None, :] <= key[:, None])[None, None]  # [1, 1, query, key]
        allowed = causal & (key[None, None, None, :] < torch.tensor(lengths)[:, None, None, None])
        attention_mask = _shared_mask(allowed, model, device)
    else:  # no padding: transformers drops the mask and runs the causal kernel
        attention_mask = torch.ones((len(trajs), width), dtype=torch.long, device=device)
    ids, pos = ids.to(device), pos.to(device)
    from_trunk = layer_inputs is not None and (not multi or branch_inputs is not None)
    cache = None
    if shared:  # the prefix once, at batch 1; its keys and values repeated for every row (autograd sums the rows)
        cache = DynamicCache()
        prefix_pos = pos[:1, :shared]
        if from_trunk:
            _forward_from_layer(body, [layer_inputs[0][:shared]], from_layer, None, prefix_pos, cache=cache)
        else:
            body(input_ids=ids[:1, :shared], position_ids=prefix_pos, past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(len(trajs))
        ids, pos = ids[:, shared:], pos[:, shared:]
        layer_inputs = [x[shared:] for x in layer_inputs] if from_trunk else None
    if from_trunk:
        branches = None
        if multi:
            branches = [(len(t.token_ids), b) for t, b in zip(trajs, branch_inputs)]
            for (start, b), rows in zip(branches, layout):
                if (0 if b is None else len(b)) != sum(n for *_, n in rows):
                    raise ValueError("branch_inputs do not match the records' choice steps (another rollout's?)")
        hidden = _forward_from_layer(body, layer_inputs, from_layer, attention_mask, pos, branches, cache)
    else:
        # use_cache=False without a prefix: a scoring/training forward needs no KV cache (building one costs memory)
        hidden = body(input_ids=ids, attention_mask=attention_mask, position_ids=pos, past_key_values=cache,
                      use_cache=cache is not None).last_hidden_state
    rows_lp, rows_ent = [], []
    for i, t in enumerate(trajs):
        if action_mode == "choice" and not t.choice_steps:
            lp, ent = [], []
        elif action_mode == "choice":
            # an episode's steps share one candidate list: the environment's action names
            steps, candidates = t.choice_steps, t.choice_steps[0].candidates
            positions = torch.tensor([s.position for s in steps], device=device)
            first_logp = F.log_softmax(head(hidden[i, positions - 1 - shared]).float(), -1)  # hidden starts at `shared`
            scores = first_logp[:, [c[0] for c in candidates]]  # [S, K]
            if multi and (rows := [r for r in layout[i] if r[3]]):
                # every candidate's later tokens through the head in one call: under CPU bf16 autocast each call
                # casts the (frozen, so uncached) 49152 x 576 head weight anew and keeps the copy for the backward
                # (a call per candidate and step took 12 GB on 2 BabyAI episodes)
                at = torch.cat([torch.arange(start, start + n) for _, _, start, n in rows]).to(device)
                target = torch.tensor([tok for _, k, _, _ in rows for tok in candidates[k][1:]], device=device)
                token_logp = F.log_softmax(head(hidden[i, at]).float(), -1).gather(-1, target[:, None]).squeeze(-1)
                row_of = torch.repeat_interleave(torch.tensor([n for *_, n in rows], device=device))
                extra = torch.zeros(len(rows), dtype=token_logp.dtype, device=device).index_add(0, row_of, token_logp)
                step_k = torch.tensor([(s_idx, k) for s_idx, k, _, _ in rows], device=device)
                scores = scores.index_put((step_k[:, 0], step_k[:, 1]), extra, accumulate=True)
            if choice_token_norm:
                scores = scores / torch.tensor([len(c) for c in candidates], device=device, dtype=scores.dtype)
            # the rollout's mask (each step's legal candidates, recorded): the ratio compares like with like
            action_logp = F.log_softmax(mask_illegal(scores / temp, [s.legal for s in steps]), -1)
            chosen = torch.tensor([s.chosen for s in steps], device=device)
            lp = list(action_logp.gather(-1, chosen[:, None]).squeeze(-1).unbind())
            ent = list((-(action_logp.exp() * action_logp).sum(-1)).unbind())
        else:
            positions = torch.tensor([j for j, m in enumerate(t.source_mask) if m], device=device)
            logits = head(hidden[i, positions - 1 - shared]).float() / temp
            taken = ids[i, positions - shared][:, None]
            if 0 < top_k < logits.shape[-1]:  # the dtype's minimum, not -inf: p log p stays 0 and its gradient finite
                dropped = (logits < logits.topk(top_k, -1).values[:, -1:]).scatter(-1, taken, False)
                logits = logits.masked_fill(dropped, torch.finfo(logits.dtype).min)
            logp_all = F.log_softmax(logits, -1)
            lp = list(logp_all.gather(-1, taken).squeeze(-1).unbind())
            ent = list((-(logp_all.exp() * logp_all).sum(-1)).unbind())
        rows_lp.append(lp)
        rows_ent.append(ent)
    units = max(1, max(len(r) for r in rows_lp))
    zero = hidden.new_zeros(())
    pad = lambda r: torch.stack(list(r) + [zero] * (units - len(r)))
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (units - len(r)) for r in rows_lp], device=device)
    return UnitBatch(torch.stack([pad(r) for r in rows_lp]), torch.stack([pad(r) for r in rows_ent]), mask, hidden, shared)


def _shared_mask(allowed: torch.Tensor, model, device) -> torch.Tensor:
    """The [B, 1, L, L] boolean mask as SDPA's additive float mask (0 / -inf), built once for all layers.

    Given a boolean mask, torch's SDPA converts it to exactly this float tensor inside every layer's call and
    saves that layer's copy for the backward: B x L^2 x 4 bytes per trained layer (0.65 GiB for 4 GridWorld
    episodes of ~1,170 tokens on SmolLM2's 30 layers). Passed as float, one tensor is shared by every layer;
    the numbers are the same. Under autocast (CUDA bf16) the query dtype differs from the weights', so the
    boolean mask is kept there.
    """
    dtype = next(model.parameters()).dtype
    if torch.is_autocast_enabled(torch.device(device).type) or not dtype.is_floating_point:
        return allowed.to(device)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf")).to(device)


def _shared_prefix_length(body, trajs: list[Trajectory]) -> int:
    """How many leading tokens every record shares before its first policy unit, less one; 0 when sharing them
    does not apply (see `policy_logprobs`). Every position whose output is read (the one before each policy
    unit) stays outside the prefix."""
    from torch.distributed.fsdp import FSDPModule

    if len(trajs) < 2 or any(isinstance(layer, FSDPModule) or (getattr(layer, "gradient_checkpointing", False)
                                                               and layer.training) for layer in body.layers):
        return 0
    first_unit = min(next((j for j, m in enumerate(t.source_mask) if m), len(t.token_ids)) for t in trajs)
    limit, ref = first_unit - 1, trajs[0].token_ids
    shared = 0
    while shared < limit and all(t.token_ids[shared] == ref[shared] for t in trajs):
        shared += 1
    return shared if shared >= MIN_SHARED_PREFIX else 0


def _forward_from_layer(body, layer_inputs: list[torch.Tensor], from_layer: int, attention_mask, pos, branches=None,
                        cache=None):
    """Run decoder layers `from_layer`.. (and the final norm) on recorded inputs of those layers.

    Tokens never fed during the rollout (each episode's last action) get zeros: nothing reads their output
    and, attention being causal, they influence no earlier position. `branches`: per row (start, inputs or
    None), the candidates' recorded inputs placed after the record (the tree layout of `_branch_layout`).
    `cache`: a KV cache to extend (its entries sit at the layers' own indices). Inputs recorded by a sampler in
    another dtype (a bf16 `sampling_copy`) are promoted to the trained layers' dtype.
    """
    dtype = torch.promote_types(layer_inputs[0].dtype, next(body.layers[from_layer].parameters()).dtype)
    x = layer_inputs[0].new_zeros((len(layer_inputs), pos.shape[1], layer_inputs[0].shape[-1]), dtype=dtype)
    for i, states in enumerate(layer_inputs):
        x[i, : len(states)] = states
    for i, (start, states) in enumerate(branches or []):
        if states is not None:
            x[i, start: start + len(states)] = states
    all_layers = body.layers
    body.layers = all_layers[from_layer:]
    try:
        return body(inputs_embeds=x, attention_mask=attention_mask, position_ids=pos, past_key_values=cache,
                    use_cache=cache is not None).last_hidden_state
    finally:
        body.layers = all_layers


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """The batch means logged under charts/: return, success rate, length (turns) and invalid actions per turn."""
    n, steps = max(len(trajs), 1), sum(t.num_steps for t in trajs)
    return {"episodic_return": sum(t.return_ for t in trajs) / n, "success_rate": sum(t.success for t in trajs) / n,
            "episode_length": steps / n, "invalid_action_rate": sum(t.invalid_actions for t in trajs) / max(steps, 1)}


def evaluate_episodes(engine, make_env: Callable, env_id: str, num: int, seed: int, temperature: float,
                      device) -> dict[str, float]:
    """`episode_metrics` of `num` episodes at `temperature` (0: greedy) on environment seeds no training iteration
    draws ((1 << 40) + seed * 1000 + i), sampled by a fresh generator, so training's RNG stays untouched."""
    sampling, engine.config = engine.config, replace(engine.config, temperature=temperature)
    seeds, gen = [(1 << 40) + seed * 1000 + i for i in range(num)], torch.Generator(device).manual_seed((1 << 40) + seed)
    try:
        return episode_metrics(engine.run([make_env() for _ in seeds], seeds, env_id, generator=gen))
    finally:
        engine.config = sampling


def sft_cold_start(model, params: list, demonstrations: Callable[[], list[Trajectory]], steps: int, learning_rate: float,
                   max_grad_norm: float, reduce_grads: Callable[[], None], tracker, device, print_every: int = 10) -> None:
    """The cold start before RL (seed 001): `steps` AdamW steps (an optimizer of its own, no weight decay) of
    cross-entropy on the policy tokens of a fresh `demonstrations()` batch each, the forward under `autocast(device)`
    (bf16 on CUDA). `reduce_grads()` averages the gradients over torchrun ranks before clipping to `max_grad_norm`.
    Each step's loss goes to `tracker` as losses/sft_loss (x = step); leaves the model in eval mode."""
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    model.train()
    for step in range(1, steps + 1):
        with autocast(device):
            units = policy_logprobs(model, demonstrations(), "free")
        loss = -(units.logprobs * units.mask).sum() / units.mask.sum()
        optimizer.zero_grad()
        loss.backward()
        reduce_grads()
        clip_grad_norm(params, max_grad_norm)
        optimizer.step()
        tracker.scalars({"losses/sft_loss": loss.item()}, step)
        if step % print_every == 0 or step == steps:
            print0(f"sft {step}/{steps} | loss {loss.item():.3f}")
    model.eval()


def format_demonstrations(chat: ChatFormat, env, rng: random.Random, n: int, max_turns: int = 3) -> list[Trajectory]:
    """SFT cold-start data (seed 001): short episodes whose actions are random *valid* action names.

    They teach the answer format (one action name, then end of turn), not which action is good.
    """
    demos = []
    for _ in range(n):
        obs, _ = env.reset(seed=rng.randrange(1 << 30))
        ids = chat.prompt_ids(env.system_prompt, obs)
        mask = [0] * len(ids)
        for turn in range(rng.randint(1, max_turns)):
            name = rng.choice(env.action_names)
            action = chat.encode(name) + [chat.eos_id]
            ids, mask = ids + action, mask + [1] * len(action)
            obs, _, terminated, truncated, _ = env.step(name)
            if terminated or truncated or turn == max_turns - 1:
                break
            segment = chat.next_turn_ids(obs, action_ended_with_eos=True)
            ids, mask = ids + segment, mask + [0] * len(segment)
        demos.append(Trajectory(token_ids=ids, source_mask=mask, behavior_logprobs=[0.0] * len(ids), policy_version=0,
                                turns=[], rewards={}, return_=0.0, termination="truncated", env_version="",
                                task_id="", seed=0))
    return demos
