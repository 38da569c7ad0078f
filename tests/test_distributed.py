"""common/distributed.py under a real 2-process gloo group: sums, means and maxima, the global loss denominator
(2 ranks x batch b == 1 process x batch 2b), the rank-divergence check, how a rank ends (finish_distributed), and
a checkpoint of per-rank state (common/checkpoint.py)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.checkpoint import Checkpointer
from common.distributed import all_reduce_mean, all_reduce_sum, global_loss_denominator, rank_param_divergence

# one batch of "policy units": per-unit inputs, and which rank played each sequence (unequal shares on purpose)
TORCH_SEED = 0
UNITS = torch.randn(7, 3, generator=torch.Generator().manual_seed(TORCH_SEED))
TARGETS = torch.randn(7, generator=torch.Generator().manual_seed(1))
SHARES = {0: slice(0, 2), 1: slice(2, 7)}  # rank 0 has 2 units, rank 1 has 5


def token_mean_grad(weights: torch.Tensor, units: torch.Tensor, targets: torch.Tensor, denominator: float):
    w = weights.clone().requires_grad_(True)
    loss = ((units @ w - targets) ** 2).sum() / denominator
    loss.backward()
    return w.grad


def _worker(rank: int, port: int, results, run_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        weights = torch.tensor([0.5, -1.0, 2.0])
        share = SHARES[rank]
        out = {"sum": all_reduce_sum({"x": float(rank + 1)})["x"],
               "mean": all_reduce_mean({"return": float(rank + 1), "return_max": float(4 * rank + 1)})}
        for name, denominator in (("global", global_loss_denominator(UNITS[share].shape[0])),
                                  ("local", float(UNITS[share].shape[0]))):
            grad = token_mean_grad(weights, UNITS[share], TARGETS[share], denominator)
            dist.all_reduce(grad)
            out[name] = grad / 2  # what the scripts do: average the ranks' gradients
        params = [torch.ones(2, 2), torch.arange(3.0)]
        out["in_sync"] = rank_param_divergence(params)
        if rank == 1:
            params[1] = params[1] + 0.25  # a rank that drifted
        out["drifted"] = rank_param_divergence(params)
        # a checkpoint keeps each rank's own state (e.g. visit counts) apart, and rank 0's shared `extra` once
        ckpt = Checkpointer(run_dir, 1, rank, 2)
        ckpt.save({"iteration": 1}, torch.nn.Linear(2, 2), extra={"target": rank}, rank_extra={"counts": {"s": rank + 1}})
        out["checkpoint"] = {k: ckpt.read()[k] for k in ("extra", "rank_extra")}
        results[rank] = out
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), results, str(tmp_path_factory.mktemp("ckpt"))), nprocs=2, join=True)
    return dict(results)


def test_a_checkpoint_keeps_every_ranks_own_state(two_ranks):
    for rank in (0, 1):  # each rank reads back both ranks' states (it resumes from its own) and rank 0's extra
        assert two_ranks[rank]["checkpoint"] == {"extra": {"target": 0}, "rank_extra": [{"counts": {"s": 1}},
                                                                                          {"counts": {"s": 2}}]}


def test_all_reduce_sum_adds_the_ranks(two_ranks):
    assert two_ranks[0]["sum"] == two_ranks[1]["sum"] == 3.0


def test_all_reduce_mean_averages_but_takes_the_maximum_of_a_max(two_ranks):
    assert two_ranks[0]["mean"] == two_ranks[1]["mean"] == {"return": 1.5, "return_max": 5.0}


def test_two_ranks_give_the_update_of_one_process_on_the_whole_batch(two_ranks):
    weights = torch.tensor([0.5, -1.0, 2.0])
    whole = token_mean_grad(weights, UNITS, TARGETS, float(len(UNITS)))  # 1 process, batch 2b, token mean
    for rank in (0, 1):
        torch.testing.assert_close(two_ranks[rank]["global"], whole)
    # dividing by the local count instead weights rank 0's 2 units 2.5x more than rank 1's 5: not the same update
    assert not torch.allclose(two_ranks[0]["local"], whole, atol=1e-3)


def test_rank_divergence_is_zero_in_sync_and_catches_a_drifted_rank(two_ranks):
    assert two_ranks[0]["in_sync"] == two_ranks[1]["in_sync"] == 0.0
    # checksums of arange(3) + 0.25: sum moves by 0.75, sum of squares by 2 * 0.25 * 3 + 3 * 0.0625 = 1.6875
    assert two_ranks[0]["drifted"] == two_ranks[1]["drifted"] == pytest.approx(1.6875)


def test_without_torchrun_everything_is_the_identity():
    assert all_reduce_sum({"a": 2.0}) == {"a": 2.0}
    assert global_loss_denominator(5) == 5.0
    assert rank_param_divergence([torch.ones(2)]) == 0.0


RANK_SCRIPT = """
import atexit, sys
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from common.distributed import finish_distributed, init_distributed

rank, _, world = init_distributed(torch.device("cpu"))
total = torch.ones(4) * (rank + 1)
dist.all_reduce(total)
atexit.register(lambda: print("interpreter shutdown ran", flush=True))
print(f"rank {{rank}} of {{world}}: sum {{total[0].item():.0f}}")  # stdout is a pipe: this waits in the buffer
finish_distributed()
print("after finish_distributed", flush=True)
"""


def test_finish_distributed_flushes_and_exits_zero_without_the_interpreter_shutdown(tmp_path):
    """A rank's last call: its buffered output reaches the pipe, the exit status is 0, and neither the code after it nor
    the interpreter's shutdown (atexit) runs: where gloo's worker threads could abort. The ranks are started by hand,
    as a cluster launcher would (torchrun sets PYTHONUNBUFFERED, which would hide a missing flush)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(root=str(Path(__file__).resolve().parents[1])))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(2)]
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
        assert out == f"rank {rank} of 2: sum 3\n", out  # nothing after the call, no atexit handler
