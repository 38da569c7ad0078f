"""benchmarks/vs_trl.py without TRL: a clear install hint, no traceback, before any run (CI has no TRL)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "vs_trl.py"


def run_without_trl(tmp_path, broken: bool):
    """Runs the script with `trl` hidden: a stub package that fails to import (broken) or none on the path."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    if broken:  # a found-but-unimportable trl (e.g. a missing pandas), checked through its ImportError
        (shadow / "trl").mkdir()
        (shadow / "trl" / "__init__.py").write_text("raise ImportError(\"No module named 'pandas'\")\n")
        prelude = ""
    else:  # no trl at all: find_spec must say None, even where TRL is installed
        prelude = ("import importlib.util as u; f = u.find_spec; "
                   "u.find_spec = lambda n, *a, **k: None if n == 'trl' else f(n, *a, **k); ")
    code = prelude + f"import runpy, sys; sys.argv = [{str(SCRIPT)!r}, '--steps', '2']; " \
                     f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=False, timeout=120)


def test_missing_trl_fails_with_install_hint(tmp_path):
    proc = run_without_trl(tmp_path, broken=False)
    assert proc.returncode == 1
    assert "pip install -r benchmarks/requirements-trl.txt" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "round 1" not in proc.stdout  # failed before starting any side


def test_unimportable_trl_names_the_cause(tmp_path):
    proc = run_without_trl(tmp_path, broken=True)
    assert proc.returncode == 1
    assert "pip install -r benchmarks/requirements-trl.txt" in proc.stderr
    assert "pandas" in proc.stderr  # the underlying ImportError is shown
    assert "Traceback" not in proc.stderr
