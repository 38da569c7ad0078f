"""Many `python SCRIPT ARGS...` command lines in a few interpreters instead of one each.

For command lines that end before any real work (`--help`, flags the script must reject): most of such a run
is importing torch and transformers, ~5 s a process on 2 cores, so forty of them cost minutes of CI. Here each
interpreter pays the imports once and runs its share with `runpy.run_path(..., run_name="__main__")`, as
`python SCRIPT` would: argv, `__file__` and `sys.modules["__main__"]` are the script's. An exception that
escapes the script is reported with its traceback in stderr and return code 1, as a subprocess would show it.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import subprocess
import sys
import traceback
from pathlib import Path


def run_many(jobs: list[tuple[Path, list[str]]], processes: int = 2, timeout: float = 600) -> list[dict]:
    """Run each (script, argv); return, in order, {"returncode", "stdout", "stderr"} per job."""
    chunks = [list(range(len(jobs)))[i::processes] for i in range(processes)]
    procs = [subprocess.Popen([sys.executable, __file__, json.dumps([[str(jobs[i][0]), list(jobs[i][1])] for i in chunk])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for chunk in chunks]
    results: list[dict | None] = [None] * len(jobs)
    for proc, chunk in zip(procs, chunks):
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"the runner itself failed: {err[-4000:]}"
        for i, result in zip(chunk, json.loads(out)):
            results[i] = result
    return results


def _run_one(script: str, argv: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    returncode = 0
    saved_argv = sys.argv
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            sys.argv = [script, *argv]
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:  # what the interpreter does with an uncaught SystemExit
            if isinstance(stop.code, int) or stop.code is None:
                returncode = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                returncode = 1
        except BaseException:  # noqa: BLE001 -- reported like an uncaught exception
            traceback.print_exc()
            returncode = 1
        finally:
            sys.argv = saved_argv
    return {"returncode": returncode, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    import torch  # noqa: F401 -- the imports every script shares, paid once
    import transformers  # noqa: F401

    results = [_run_one(script, argv) for script, argv in json.loads(sys.argv[1])]
    json.dump(results, sys.__stdout__)
