"""One GRPO update epoch on real GridWorld episodes, in fp32 and under CPU bf16 autocast, side by side.

    python benchmarks/update_step.py          # smollm2-135m, 8 episodes, top 6 layers and all 30 (results/update_step.md)
    python benchmarks/update_step.py --model tiny --trainable-layers 1 --repeats 1 --output ""   # seconds

`grpo_agent.py --update-dtype bfloat16` runs the update's forward and backward under `torch.autocast("cpu",
torch.bfloat16)` (`common.models.autocast`): matmuls in bf16, the weights, gradients and AdamW in fp32. On a CPU
with AMX or AVX512-BF16 that is faster; it is also less exact. This script measures both on the workload the
update sees. One group of `--episodes` GridWorld episodes is sampled once (choice mode, T = 2, the rollout engine
recording the frozen trunk's output as grpo_agent.py does); then, for each `--trainable-layers` value, one update
epoch (micro-batches of `--micro-batch-size`: `policy_logprobs` forward, a token-mean loss, backward, gradient
clipping, an AdamW step) is timed in each precision, `--repeats` times interleaved, the fastest kept (the others
are the shared machine's noise). Each epoch starts from the same weights and optimizer state.

What the bf16 epoch changes, measured on the first micro-batch of the same weights: the log-prob of each policy
unit (mean and max |bf16 - fp32|, the per-unit gap the first-epoch ratio sees) and the gradient (cosine similarity
to the fp32 gradient, and the ratio of norms). Writes `{output}.md` and `{output}.jsonl`.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import tyro

import envs
from benchmarks.decode_step import provenance, write_report
from common.models import autocast, load_model, train_top_layers
from common.rollout import RolloutConfig, RolloutEngine, behavior_units, policy_logprobs

DTYPES = ("float32", "bfloat16")


@dataclass
class Args:
    model: str = "smollm2-135m"
    """`tiny`, `smollm2-135m` or a local model path"""
    env_id: str = "gridworld"
    """environment the episodes are sampled from (choice mode)"""
    episodes: int = 8
    """episodes in the batch (grpo_agent.py's default group)"""
    trainable_layers: list[int] = field(default_factory=lambda: [6, 0])
    """top layers trained, one measurement each (0: every layer, the forward starts at the embeddings)"""
    micro_batch_size: int = 4
    """episodes per forward/backward (grpo_agent.py's default)"""
    repeats: int = 3
    """timed epochs per (layers, precision), interleaved; the fastest is reported"""
    seed: int = 1
    """seed of the sampled episodes"""
    output: str = "benchmarks/results/update_step"
    """output prefix: writes {output}.md and {output}.jsonl (empty: print only)"""


def sample_batch(args: Args, model, tokenizer, frozen_below: int | None):
    """One group of choice-mode episodes and, with a frozen trunk, its recorded output at layer `frozen_below`."""
    config = RolloutConfig(action_mode="choice", temperature=2.0, max_total_tokens=4096)
    engine = RolloutEngine(model, tokenizer, config, record_layer_inputs=frozen_below)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        trajs = engine.run([envs.make(args.env_id) for _ in range(args.episodes)], [args.seed] * args.episodes,
                           args.env_id, generator=generator)
    inputs = list(zip(engine.layer_inputs, engine.branch_inputs)) if frozen_below is not None else None
    return trajs, inputs


def forward(model, trajs, inputs, chunk, frozen_below, dtype):
    trunk = ([inputs[i][0] for i in chunk], frozen_below, [inputs[i][1] for i in chunk]) if inputs else (None, 0, None)
    with autocast("cpu", dtype):
        return policy_logprobs(model, [trajs[i] for i in chunk], "choice", 2.0, True, *trunk)


def epoch(model, optimizer, params, trajs, inputs, frozen_below, dtype, micro_batch_size) -> float:
    """Seconds of one update epoch over the batch (advantages +-1 alternating: a loss with both signs)."""
    _, mask = behavior_units(trajs, "choice")
    num_units = mask.sum()
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(trajs))])
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=False)
    for start in range(0, len(trajs), micro_batch_size):
        chunk = range(start, min(start + micro_batch_size, len(trajs)))
        units = forward(model, trajs, inputs, chunk, frozen_below, dtype)
        m = mask[chunk.start:chunk.stop, : units.logprobs.shape[1]]
        (-(units.logprobs * m).sum(1) @ adv[chunk.start:chunk.stop] / num_units).backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return time.perf_counter() - t0


def precision_gap(model, params, trajs, inputs, frozen_below, micro_batch_size) -> dict:
    """Log-prob and gradient of the first micro-batch in bf16 against fp32, at the same weights."""
    chunk = range(min(micro_batch_size, len(trajs)))
    _, mask = behavior_units([trajs[i] for i in chunk], "choice")
    out = {}
    for dtype in DTYPES:
        for p in params:
            p.grad = None
        units = forward(model, trajs, inputs, chunk, frozen_below, dtype)
        (-(units.logprobs * mask[:, : units.logprobs.shape[1]]).sum()).backward()
        out[dtype] = (units.logprobs.detach(), torch.cat([p.grad.flatten() for p in params]))
    (lp32, g32), (lp16, g16) = out["float32"], (out["bfloat16"][0], out["bfloat16"][1].double())
    g32 = g32.double()  # ~1e8 summands: fp32 accumulation alone can put the cosine off by 1e-2
    gap = (lp16 - lp32).abs()[mask[:, : lp32.shape[1]].bool()]
    return {"logprob_gap_mean": gap.mean().item(), "logprob_gap_max": gap.max().item(),
            "grad_cosine": torch.nn.functional.cosine_similarity(g32, g16, dim=0).item(),
            "grad_norm_ratio": (g16.norm() / g32.norm()).item()}


def main(args: Args) -> list[dict]:
    if args.episodes < 1 or args.micro_batch_size < 1 or args.repeats < 1 or min(args.trainable_layers, default=-1) < 0:
        raise SystemExit("update_step.py: --episodes, --micro-batch-size and --repeats must be >= 1, "
                         "--trainable-layers >= 0 (0: all)")
    started, load_start = time.time(), os.getloadavg()[0]
    results = []
    for layers in args.trainable_layers:
        model, tokenizer = load_model(args.model, dtype=torch.float32, seed=args.seed)
        num_layers = len(model.get_decoder().layers)
        frozen_below = num_layers - layers if 0 < layers < num_layers else None
        model = train_top_layers(model, layers, 0, 16.0, False)
        params = [p for p in model.parameters() if p.requires_grad]
        trajs, inputs = sample_batch(args, model, tokenizer, frozen_below)
        model.train()
        gap = precision_gap(model, params, trajs, inputs, frozen_below, args.micro_batch_size)
        optimizer = torch.optim.AdamW(params, lr=1e-5)
        start_state = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
        epoch(model, optimizer, params, trajs, inputs, frozen_below, "float32", args.micro_batch_size)  # warm-up
        best = dict.fromkeys(DTYPES, float("inf"))
        for _ in range(args.repeats):
            for dtype in DTYPES:
                model.load_state_dict(start_state[0])
                optimizer.load_state_dict(start_state[1])
                best[dtype] = min(best[dtype], epoch(model, optimizer, params, trajs, inputs, frozen_below, dtype,
                                                     args.micro_batch_size))
        units = int(behavior_units(trajs, "choice")[1].sum())
        tokens = sum(len(t.token_ids) for t in trajs)
        results.append({"model": args.model, "trainable_layers": layers or num_layers, "episodes": len(trajs),
                        "tokens": tokens, "policy_units": units, "fp32_s": best["float32"], "bf16_s": best["bfloat16"],
                        **gap})
        print(f"[update_step] layers {layers or num_layers}: fp32 {best['float32']:.2f} s, bf16 {best['bfloat16']:.2f} s "
              f"({best['float32'] / best['bfloat16']:.2f}x); log-prob gap mean {gap['logprob_gap_mean']:.4f}, "
              f"grad cosine {gap['grad_cosine']:.4f}", flush=True)
        del model, optimizer, start_state
    write_report(args.output, report(args, results, (load_start, os.getloadavg()[0]), time.time() - started), results)
    return results


def report(args: Args, results: list[dict], load: tuple, seconds: float) -> str:
    lines = [(f"# One GRPO update epoch, fp32 and CPU bf16 autocast (`{args.model}`, {args.episodes} {args.env_id} "
              f"episodes, micro-batches of {args.micro_batch_size})"), "",
             provenance("update_step.py", args, load, seconds) + f" Fastest of {args.repeats} interleaved epochs per "
             "cell; absolute times hold for this machine only, read the ratios.", "",
             ("| layers trained | tokens in batch | policy units | fp32 s / epoch | bf16 s / epoch | fp32 / bf16 | "
              "log-prob gap mean | log-prob gap max | gradient cosine | bf16 / fp32 gradient norm |"),
             "| ---: |" + " ---: |" * 9]
    for r in results:
        lines.append(f"| {r['trainable_layers']} | {r['tokens']} | {r['policy_units']} | {r['fp32_s']:.2f} | "
                     f"{r['bf16_s']:.2f} | {r['fp32_s'] / r['bf16_s']:.2f}x | {r['logprob_gap_mean']:.4f} | "
                     f"{r['logprob_gap_max']:.4f} | {r['grad_cosine']:.4f} | {r['grad_norm_ratio']:.3f} |")
    lines += ["", ("An epoch: every micro-batch's forward (from the recorded trunk output when fewer layers than all are "
                   "trained) and backward, gradient clipping and one AdamW step. Gaps and gradients: the first micro-batch, "
                   "same weights, bf16 autocast against fp32; the log-prob gap is per policy unit (a choice-mode action).")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(tyro.cli(Args))
