"""torchrun awareness, seeding and rank-0 printing (nanoGPT-style); a plain `python` run is rank 0 of 1."""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist


def dist_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the torchrun environment; (0, 0, 1) without it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed(device: torch.device) -> tuple[int, int, int]:
    """Initialise the process group under torchrun: gloo on CPU (so it is tested here), NCCL on CUDA."""
    rank, local_rank, world = dist_info()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(local_rank)
    return rank, local_rank, world


def print0(*args, **kwargs):
    if dist_info()[0] == 0:
        print(*args, **kwargs, flush=True)


def seed_everything(seed: int, torch_deterministic: bool = True):
    """The same seeding block in every script; with `torch_deterministic`, CPU runs repeat exactly."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = torch_deterministic
    if torch_deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def all_reduce_mean(values: dict[str, float]) -> dict[str, float]:
    """Average scalar metrics across ranks before rank 0 logs them (identity without torchrun)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    keys = sorted(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return {k: float(v) / dist.get_world_size() for k, v in zip(keys, t.tolist())}


def all_reduce_sum(values: dict[str, float]) -> dict[str, float]:
    """Sum scalars across ranks (identity without torchrun): e.g. the global count of policy tokens."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    return {k: v * dist.get_world_size() for k, v in all_reduce_mean(values).items()}


def global_loss_denominator(local_count: float) -> float:
    """The denominator that makes averaged gradients equal one process's gradient on the whole batch.

    Each rank's loss is `sum over its units / D`, and the all-reduce averages the ranks' gradients, so the
    update is `sum over all units / (D * world)`. With D = N_global / world that is the token mean over the
    global batch, whatever the ranks' shares: 2 ranks x batch b give the update of 1 process x batch 2b
    (dividing by the local count instead would weight a rank's units by the inverse of its count).
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return all_reduce_sum({"n": float(local_count)})["n"] / world


def rank_param_divergence(params) -> float:
    """Largest difference between this rank's parameter checksums and rank 0's, over ranks (0.0 = in sync).

    DDP-style training keeps ranks identical only if every rank applies the same averaged update; a rank
    that skipped an all-reduce or stepped on its own gradients drifts. Cheap: two numbers per tensor.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0.0
    params = list(params)
    local = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()]) for p in params])
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    local = local.to(device)
    reference = local.clone()
    dist.broadcast(reference, src=0)
    gap = (local - reference).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return float(gap)
