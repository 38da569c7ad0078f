"""Helpers for the tests that launch `torchrun`: a 2-rank command on a free port, and the check that `--fsdp` takes
the same steps as plain data parallel (same logged numbers, same saved weights)."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.tracking import read_scalars

ROOT = Path(__file__).resolve().parents[1]


def torchrun_command(script: str, out_dir: Path, *flags: str, nproc: int = 2) -> list[str]:
    """`torchrun --nproc_per_node nproc algorithms/<script> --output-dir out_dir *flags`, on a free port."""
    with socket.socket() as s:  # a free port: other tests may run torchrun at the same time
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
            str(ROOT / "algorithms" / script), "--output-dir", str(out_dir), *flags]


def only_run_dir(out_dir: Path) -> Path:
    (run_dir,) = [p for p in out_dir.iterdir() if p.is_dir()]  # rank 0 alone writes
    return run_dir


def assert_fsdp_matches_data_parallel(script: str, tmp_path: Path, flags: list[str], tags: tuple[str, ...],
                                      saved: tuple[str, ...] = ("model",), weight_atol: float = 1e-5,
                                      **run_kwargs) -> tuple[dict, dict]:
    """Runs `script` on 2 ranks without and with `--fsdp` (`flags` must include --save-model); every tag in `tags`
    must be logged at the same steps with the same values (float noise: rel 1e-4), and each saved model folder in
    `saved` must hold the same tensors (rel 1e-4, abs `weight_atol`). Returns (fsdp scalars, data-parallel scalars).

    The two runs do not round alike: plain data parallel runs a group's shared prompt once (`policy_logprobs`'s
    shared prefix), FSDP runs whole sequences. AdamW's normalised step turns that noise into up to a sizeable
    fraction of a step on the few weights whose gradients are near zero; a test at a high learning rate allows it."""
    from safetensors.torch import load_file

    # both runs at once (torchrun gives each rank 1 thread): start-up is mostly importing torch, so this halves the wait
    procs = {name: subprocess.Popen(torchrun_command(script, tmp_path / name, *flags, *extra), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, **run_kwargs)
             for name, extra in (("ddp", []), ("fsdp", ["--fsdp"]))}
    dirs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: " + out[-2000:] + err[-4000:]
        dirs[name] = only_run_dir(tmp_path / name)
    got, expected = read_scalars(dirs["fsdp"]), read_scalars(dirs["ddp"])
    for tag in tags:
        assert [s for s, _ in got[tag]] == [s for s, _ in expected[tag]], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in expected[tag]], rel=1e-4, abs=1e-6), tag
    for folder in saved:
        sharded, whole = (load_file(str(dirs[name] / folder / "model.safetensors")) for name in ("fsdp", "ddp"))
        assert set(sharded) == set(whole), folder
        for key, value in whole.items():
            torch.testing.assert_close(sharded[key], value, rtol=1e-4, atol=weight_atol)
    return got, expected
