"""Checkpoints and resume for the gradient-based scripts: atomic save, validated load, RNG states, Ctrl-C.

A checkpoint lives in the run directory as two files:

    checkpoint-000010.pt   one `torch.save` of a dict (tensors, numbers, strings, lists: `weights_only` loadable)
    checkpoint.json        the manifest: which .pt file is current, its size and sha256, the iteration

Saving writes the .pt under a temporary name in the same directory, fsyncs it, renames it into place
(`os.replace` is atomic on POSIX and Windows), then replaces the manifest the same way, and only then
deletes the previous .pt. A crash at any moment leaves a manifest that points to a complete file.
Loading checks the manifest, the size and the hash before unpickling, so a truncated or corrupt file
ends the run with one line (a `SystemExit` naming the file), not a traceback from deep inside torch.

What a script saves is up to it; the usual content (built by `Checkpointer.save`):
`trainable_state_dict(model)` (only parameters with requires_grad: the top layers or a LoRA adapter; the
frozen rest is rebuilt by `load_model` and checked against a fingerprint), optimizer and scheduler
state dicts, every RNG (`rng_state`), the loop counters, the logger's per-tag last step (so a resumed run
appends to the same TensorBoard run and drops what a crashed run logged after its last checkpoint), and
whatever buffer the algorithm carries (`extra`).

Under torchrun every rank calls `Checkpointer.save` (the RNG states are gathered to rank 0, which alone
writes) and every rank calls `read` and `restore` (each restores its own RNG state); the world size must
not change on resume.

Example (the shape of algorithms/grpo_agent.py):

    args = cli_with_resume(Args, {"total_iterations", "checkpoint_every", "resume"}, "my_script.py")
    run_dir = args.resume or os.path.join(args.output_dir, make_run_name(...))
    ckpt = Checkpointer(run_dir, args.checkpoint_every, rank, world_size)
    resumed = ckpt.read() if args.resume else None      # validated now, before the model is built
    ...                                                 # build model, optimizer, generators as usual
    tracker = Tracker(run_dir, vars(args), resume_state=resumed and resumed["tracker"])
    if resumed:
        ckpt.restore(resumed, model, optimizer, generators={"sample": gen})
    first = resumed["counters"]["iteration"] + 1 if resumed else 1
    interrupt = GracefulInterrupt().start()             # Ctrl-C: finish the iteration, save, exit
    for iteration in range(first, args.total_iterations + 1):
        ...                                             # one iteration, logged with tracker.scalars
        stop = interrupt.should_stop()
        if ckpt.due(iteration, last=iteration == args.total_iterations) or stop:
            ckpt.save({"iteration": iteration}, model, optimizer, generators={"sample": gen}, tracker=tracker)
        if stop:
            raise SystemExit(130)
    interrupt.stop()
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import time
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from common.distributed import full_tensors, gathered, is_sharded, shard_like, sharded_modules

MANIFEST = "checkpoint.json"
FORMAT = 1


# ---- atomic files ----

def _fsync_dir(path: Path):
    try:  # makes the rename itself durable; not possible on every OS/filesystem, and harmless to skip there
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write) -> None:
    """Call `write(file_object)` on `<dir>/.<name>.tmp`, fsync, then rename onto `path`.

    If `write` raises, the temporary file is removed and `path` is untouched.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(run_dir: str | Path, state: dict, iteration: int, keep: int = 1) -> Path:
    """Atomically write `state` as `run_dir/checkpoint-{iteration:06d}.pt` and point the manifest at it.

    Keeps the newest `keep` .pt files (0: all). Returns the path of the new file. Call it on one process only.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"checkpoint-{iteration:06d}.pt"
    atomic_write(path, lambda f: torch.save(state, f))
    manifest = {"format": FORMAT, "file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path),
                "iteration": iteration, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write(run_dir / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2).encode()))
    if keep > 0:  # the newest `keep` files, this one included (stale files from a crash mid-save go too)
        others = sorted((p for p in run_dir.glob("checkpoint-*.pt") if p != path), key=lambda p: p.stat().st_mtime)
        for old in others[: max(len(others) - (keep - 1), 0)]:
            old.unlink(missing_ok=True)
    return path


def load_checkpoint(run_dir: str | Path, map_location="cpu") -> dict:
    """The state dict of the run's current checkpoint, after checking manifest, size and sha256.

    Any problem (no checkpoint, missing/truncated/corrupt file) raises `SystemExit` naming the file.
    """
    run_dir = Path(run_dir)
    manifest_path = run_dir / MANIFEST
    if not run_dir.is_dir():
        raise SystemExit(f"--resume {run_dir}: not a directory")
    if not manifest_path.exists():
        raise SystemExit(f"--resume {run_dir}: no checkpoint ({manifest_path} not found; "
                         "was the run started with --checkpoint-every N > 0?)")
    try:
        manifest = json.loads(manifest_path.read_text())
        path, size, digest = run_dir / manifest["file"], int(manifest["bytes"]), manifest["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"checkpoint manifest {manifest_path} is corrupt ({type(e).__name__}: {e})")
    if not path.exists():
        raise SystemExit(f"checkpoint file {path} (named by {manifest_path}) is missing")
    actual = path.stat().st_size
    if actual != size:
        raise SystemExit(f"checkpoint file {path} is truncated or corrupt: {actual} bytes, the manifest says {size}")
    if sha256_file(path) != digest:
        raise SystemExit(f"checkpoint file {path} is corrupt: its sha256 does not match {manifest_path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is reported as one line
        raise SystemExit(f"checkpoint file {path} cannot be read ({type(e).__name__}: {str(e)[:200]})")


# ---- random number generators ----

def rng_state(generators: dict | None = None) -> dict:
    """This process's RNG states: python `random`, numpy's global, torch CPU (+ CUDA), and each named
    `torch.Generator`, `random.Random` or `numpy.random.Generator` in `generators`. Only tensors, ints,
    strings, lists and dicts: `weights_only` safe."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss],
             "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [], "generators": {}}
    for name, g in (generators or {}).items():
        if isinstance(g, random.Random):
            state["generators"][name] = g.getstate()
        elif isinstance(g, np.random.Generator):
            state["generators"][name] = g.bit_generator.state  # a dict of ints and strings
        else:
            state["generators"][name] = g.get_state()
    return state


def set_rng_state(state: dict, generators: dict | None = None):
    """Restore what `rng_state` captured; `generators` must name the same generators."""
    random.setstate(_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    saved, given = set(state["generators"]), set(generators or {})
    if saved != given:
        raise SystemExit(f"checkpoint has RNG generators {sorted(saved)}, the script passed {sorted(given)}")
    for name, g in (generators or {}).items():
        s = state["generators"][name]
        if isinstance(g, random.Random):
            g.setstate(_tuples(s))
        elif isinstance(g, np.random.Generator):
            g.bit_generator.state = s
        else:
            g.set_state(s)


def _tuples(x):
    """random.setstate wants the nested tuples getstate gave (a round trip may turn them into lists)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---- model weights ----

def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only the parameters being trained (top layers, a LoRA adapter, or all of them), detached, on CPU."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def frozen_fingerprint(model: torch.nn.Module) -> float:
    """A cheap checksum of the frozen parameters: a resumed run must rebuild the same base model."""
    with torch.no_grad():
        return float(sum((p.full_tensor() if is_sharded(p) else p).double().abs().sum().item()  # FSDP: collective
                         for p in model.parameters() if not p.requires_grad))


def load_trainable_state_dict(model: torch.nn.Module, weights: dict[str, torch.Tensor], fingerprint: float | None = None):
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(trainable) != set(weights):
        diff = sorted(set(trainable) ^ set(weights))[:5]
        raise SystemExit(f"checkpoint weights do not match the model's trainable parameters (e.g. {diff}): "
                         "same --model and --trainable-layers (or adapter settings) as the saved run?")
    if fingerprint is not None and not np.isclose(frozen_fingerprint(model), fingerprint, rtol=1e-9, atol=1e-6):
        raise SystemExit("the frozen weights differ from those the checkpoint was trained on (a different --model?)")
    with torch.no_grad():
        for n, p in trainable.items():  # FSDP: this rank's slice of the whole tensor
            p.to_local().copy_(shard_like(weights[n], p).to_local()) if is_sharded(p) else p.copy_(weights[n])


# ---- Ctrl-C ----

class GracefulInterrupt:
    """While active, the first Ctrl-C (SIGINT) or SIGTERM only sets a flag: the loop finishes its
    iteration, saves a checkpoint and exits. A second Ctrl-C interrupts at once (KeyboardInterrupt).

    `should_stop()` agrees across torchrun ranks (a max all-reduce), so they all stop after the same
    iteration instead of one waiting forever in a collective the others left.
    """

    def __init__(self, signals=(signal.SIGINT, signal.SIGTERM)):
        self.signals, self.requested, self._previous = signals, False, {}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: finishing this iteration, then saving a checkpoint "
              "(Ctrl-C again to abort without one)", flush=True)

    def start(self) -> GracefulInterrupt:
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def stop(self):
        """Put the previous handlers back."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def should_stop(self) -> bool:
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([float(self.requested)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.requested = bool(flag.item())
        return self.requested


# ---- the usual save/load, in a few lines of the script ----

class Checkpointer:
    """Saves model (trainable part), optimizer, schedulers, RNG states, counters, tracker steps and
    `extra` every `every` iterations into `run_dir`; `every = 0` turns periodic saving off."""

    def __init__(self, run_dir: str | Path, every: int, rank: int = 0, world_size: int = 1):
        self.run_dir, self.every, self.rank, self.world_size = Path(run_dir), every, rank, world_size

    def due(self, iteration: int, last: bool = False) -> bool:
        """A checkpoint every `every` iterations and at the end of the run (so it can be extended)."""
        return self.every > 0 and (iteration % self.every == 0 or last)

    def save(self, counters: dict, model, optimizer=None, schedulers=(), generators=None, tracker=None,
             extra=None, rank_extra=None) -> Path | None:
        """Collective under torchrun (every rank calls it); rank 0 writes. `counters` must hold `iteration`.
        `extra`: rank 0's, the same on every rank (e.g. a target network); `rank_extra`: each rank's own state (e.g.
        visit counts of its own episodes), gathered like the RNG states and kept per rank (`state["rank_extra"][r]`)."""
        rngs, ranked = [rng_state(generators)], [rank_extra]
        if self.world_size > 1:  # as bytes: all_gather_object cannot carry tensors (torch 2.13)
            buffer, blobs = io.BytesIO(), [None] * self.world_size
            torch.save((rngs[0], rank_extra), buffer)
            dist.all_gather_object(blobs, buffer.getvalue())
            rngs, ranked = map(list, zip(*(torch.load(io.BytesIO(b), weights_only=True) for b in blobs)))
        path, sharded = None, sharded_modules(model)
        optim = optimizer.state_dict() if optimizer is not None and (sharded or self.rank == 0) else None
        optim = full_tensors(optim) if sharded else optim  # FSDP: every rank joins in gathering the slices
        with gathered(sharded):  # FSDP: whole weights while rank 0 copies them
            weights = (trainable_state_dict(model), frozen_fingerprint(model)) if self.rank == 0 else None
        if self.rank == 0:
            if tracker is not None:
                tracker.flush()  # what the tracker state says was logged must be on disk
            state = {"format": FORMAT, "counters": dict(counters), "model": weights[0], "frozen_fingerprint": weights[1],
                     "optimizer": optim, "schedulers": [s.state_dict() for s in schedulers], "rng": rngs,
                     "tracker": tracker.state_dict() if tracker is not None else None, "extra": extra}
            if rank_extra is not None:
                state["rank_extra"] = ranked
            path = save_checkpoint(self.run_dir, state, counters["iteration"])
        if self.world_size > 1:
            dist.barrier()  # nobody exits (Ctrl-C) or moves on before the file is complete
        return path

    def read(self) -> dict:
        """Load and validate the file only (before building the model: bad files fail fast)."""
        state = load_checkpoint(self.run_dir)
        if not isinstance(state, dict) or state.get("format") != FORMAT or "rng" not in state:
            raise SystemExit(f"{self.run_dir / MANIFEST} names a file that is not a checkpoint of this format ({FORMAT})")
        if len(state["rng"]) != self.world_size:
            raise SystemExit(f"the checkpoint in {self.run_dir} was written by {len(state['rng'])} process(es); "
                             f"resume with the same number (now {self.world_size})")
        return state

    def restore(self, state: dict, model, optimizer=None, schedulers=(), generators=None, rank_extra=None) -> dict:
        """Put weights, optimizer/scheduler states and this rank's RNG states back; returns `state`. `rank_extra`
        ({key: object with load_state_dict, or None}) gets this rank's part of `save(rank_extra=...)` (a file
        written before per-rank extras: the `extra` saved with it, rank 0's)."""
        load_trainable_state_dict(model, state["model"], state.get("frozen_fingerprint"))
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
            for p, moments in optimizer.state.items():  # FSDP: keep this rank's slice of each whole moment
                if is_sharded(p):
                    moments.update({k: shard_like(v, p) for k, v in moments.items() if torch.is_tensor(v) and v.dim() > 0})
        for s, sd in zip(schedulers, state["schedulers"], strict=True):
            s.load_state_dict(sd)
        set_rng_state(state["rng"][self.rank], generators)
        mine = state["rank_extra"][self.rank] if "rank_extra" in state else state.get("extra", {})
        for key, target in (rank_extra or {}).items():
            if target is not None:
                target.load_state_dict(mine[key])
        return state


def cli_with_resume(args_class, allowed: set[str], script: str):
    """`tyro.cli(args_class)`, except that with `--resume RUN_DIR` the saved run's `args.json` gives the
    values: the command line may only change the flags in `allowed` (e.g. raise --total-iterations);
    changing any other one ends with a `SystemExit` listing them.

    The second parse uses the saved values as defaults, so a flag differs from the saved run exactly
    when the user typed a different value.
    """
    import tyro

    args = tyro.cli(args_class)
    if not getattr(args, "resume", ""):
        return args
    path = Path(args.resume) / "args.json"
    if not path.exists():
        raise SystemExit(f"--resume {args.resume}: {path} not found (not a run directory of {script}?)")
    saved = json.loads(path.read_text())
    names = {f.name for f in fields(args_class)}
    default = replace(args, **{k: v for k, v in saved.items() if k in names})
    args = tyro.cli(args_class, default=default)
    def normal(value):  # compare values as args.json stores them
        return json.loads(json.dumps(value, default=str))

    changed = [k for k in sorted(names & set(saved)) if k not in allowed and normal(getattr(args, k)) != saved[k]]
    if changed:
        flags = ", ".join(f"--{k.replace('_', '-')} (saved {saved[k]!r}, given {getattr(args, k)!r})" for k in changed)
        raise SystemExit(f"{script}: --resume continues the saved run with its arguments; only "
                         f"{', '.join('--' + a.replace('_', '-') for a in sorted(allowed))} may change, not {flags}")
    return args
