"""torchrun awareness, seeding and rank-0 printing (nanoGPT-style); a plain `python` run is rank 0 of 1."""

from __future__ import annotations

import math
import os
import random
import sys
from contextlib import contextmanager

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



def finish_distributed():
    """The last call of a torchrun rank: wait for every rank (rank 0 saves last), destroy the group, and leave at once
    with status 0, skipping the interpreter's shutdown.

    Why not a plain return (torch 2.13, gloo): a gloo worker thread frees a finished collective's tensors just after
    the caller's `wait()` returns, and freeing a tensor Python knows takes the GIL. When that lands in the interpreter's
    shutdown the thread is unwound while it waits for the GIL, and the rank aborts after all its work is done (SIGABRT,
    "terminate called without an active exception": 2 of 6 two-rank FSDP test runs here; gdb shows the gloo
    `runLoop` in `~AsyncAllgatherCoalescedWork` under `Py_FinalizeEx`). `destroy_process_group` does not stop those
    threads while models still hold the group. Call it once every file is written and closed: nothing after it runs."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

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
    """Average scalar metrics across ranks before rank 0 logs them (identity without torchrun); a metric whose
    name ends in `_max` is the maximum over ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    out = {}
    for op, keys in ((dist.ReduceOp.SUM, sorted(k for k in values if not k.endswith("_max"))),
                     (dist.ReduceOp.MAX, sorted(k for k in values if k.endswith("_max")))):
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)  # every rank holds the same keys, so both calls happen on all of them
        scale = dist.get_world_size() if op == dist.ReduceOp.SUM else 1
        out.update({k: float(v) / scale for k, v in zip(keys, t.tolist())})
    return out


def all_reduce_sum(values: dict[str, float]) -> dict[str, float]:
    """Sum scalars across ranks (identity without torchrun): e.g. the global count of policy tokens."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    return {k: v * dist.get_world_size() for k, v in all_reduce_mean(values).items()}


def gather_lists(local: dict[str, list], world: int) -> dict[str, list]:
    """Each list of the ranks' dicts concatenated in rank order, on every rank (one process: as is). The lists may
    hold any picklable objects (preference pairs, per-episode numbers)."""
    if world == 1:
        return local
    parts = [None] * world
    dist.all_gather_object(parts, local)
    return {k: [x for part in parts for x in part[k]] for k in local}


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
    FSDP-sharded parameters are left out (their slices differ by design), so with every trained parameter
    sharded (LoRA under FSDP) there is nothing to compare and the result is 0.0.
    """
    params = [p for p in params if not is_sharded(p)]  # FSDP: each rank holds a different slice by design
    if not (dist.is_available() and dist.is_initialized()) or not params:
        return 0.0
    local = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()]) for p in params])
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    local = local.to(device)
    reference = local.clone()
    dist.broadcast(reference, src=0)
    gap = (local - reference).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return float(gap)


# ---- FSDP (`--fsdp`): the decoder layers sharded over the ranks (PyTorch's FSDP2, `fully_shard`) ----

def shard_layers(model) -> list:
    """Shard every decoder layer's weights, gradients and optimizer state over the ranks (1/world each).

    The layers hold nearly all of an LLM's parameters. The embeddings, the final norm and the (tied) LM head stay
    replicated: their gradients are all-reduced as without FSDP. Call it after the starting weights are broadcast
    and before the optimizer is built; the returned layers are what `gathered` takes.
    """
    from torch.distributed.fsdp import fully_shard

    layers = list(model.get_decoder().layers)
    for layer in layers:  # explicit: FSDP2's default (None) keeps a root module's weights whole after its forward, and
        fully_shard(layer, reshard_after_forward=True)  # with the model itself unsharded every layer is a root
    return layers


@contextmanager
def gathered(layers: list):
    """Whole weights on every rank inside the block (one all-gather per layer, collective: every rank enters it).

    A sharded layer gathers its weights in each forward, so every rank would have to run the same forwards;
    rollouts differ in length from rank to rank. Inside the block forwards need no communication, and
    `named_parameters()` yields the whole tensors (for checkpoints and saving). An empty list: a no-op.
    """
    for layer in layers:
        layer.set_reshard_after_forward(False)
        layer.unshard()
    try:
        yield
    finally:
        for layer in layers:
            layer.reshard()
            layer.set_reshard_after_forward(True)


def sharded_modules(model) -> list:
    """The modules of `model` that FSDP shards (empty without FSDP)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def average_gradients(params: list, world_size: int) -> None:
    """Data parallel by hand (as CleanRL): all-reduce-average the gradients FSDP has not reduced already (its
    sharded layers' are reduce-scattered in the backward). A parameter without a gradient joins with zeros, so a
    rank that had nothing to train on still takes part in every all-reduce. A no-op for one process."""
    for p in (p for p in params if not is_sharded(p)) if world_size > 1 else ():
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        dist.all_reduce(p.grad)
        p.grad /= world_size


def clip_grad_norm(params: list, max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` for a mix of FSDP-sharded gradients (each rank holds a slice) and
    replicated ones (the same on every rank, after their all-reduce); returns the total norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g.to_local() for g in grads if is_sharded(g)]
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm).item()
    local = torch.stack([g.detach().double().square().sum() for g in sharded]).sum()
    dist.all_reduce(local)  # the slices' sums of squares add up to the whole tensors'
    total = math.sqrt(float(local) + sum(float(g.detach().double().square().sum()) for g in grads if not is_sharded(g)))
    coef = max_norm / (total + 1e-6)  # as torch's clip_grad_norm_
    if coef < 1:
        for g in grads:
            (g.to_local() if is_sharded(g) else g).mul_(coef)
    return total


def full_tensors(obj):
    """`obj` (nested dicts/lists, e.g. an optimizer's state_dict) with every sharded tensor gathered whole (collective)."""
    if is_sharded(obj):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: full_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_tensors(v) for v in obj)
    return obj


def shard_like(tensor: torch.Tensor, param) -> torch.Tensor:
    """The slice of a whole `tensor` that this rank holds for the sharded `param` (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(tensor.to(param.device_mesh.device_type), param.device_mesh, param.placements,
                             src_data_rank=None)
