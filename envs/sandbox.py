"""Run untrusted Python programs against hidden unit tests, and grade them from outside (seed 000, RLEF).

RLEF (seed 000, "RLEF：从执行反馈中做 RL") scores a program by running its test suite in a sandbox:
reward = tests passed / total (eq. 12.13). Seed 001 ("把环境当作版本化的数据基础设施") asks that each
rollout be isolated (file system, processes, network), that a rollout never touch held-out answers,
and that scoring happen outside anything the agent can write. This module does that.

How one submission is graded (`run_tests`, `Sandbox.run`, `SandboxPool.map`):

- Processes. The grader starts `unshare --mount --net --pid python -S -s -B -P -u -c <harness>` as
  root. The harness builds the file-system view (below), then forks: the child, the first process of
  the new pid namespace, sets the resource limits, drops to an unprivileged uid and runs the program;
  the parent stays root outside the namespace, waits for the child and reports its pid and how it
  ended (signal, exit status, CPU time) on a pipe only it writes. So the submission sees no host
  process (`os.getppid()` is 0, a host pid does not exist), cannot signal the grader, and everything
  it forks, setsid or not, dies with it when the grader kills the child.
- Limits, set in the child before the privilege drop (DESIGN.md, "Sandbox facts measured here":
  RLIMIT_NPROC does not bind root): RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_NPROC, RLIMIT_FSIZE,
  RLIMIT_NOFILE, RLIMIT_CORE = 0, and PR_SET_NO_NEW_PRIVS; plus wall-clock deadlines per test and per
  submission, enforced by the grader, which then kills the child and the process group. RLIMIT_AS binds
  each process, not the run: a program that forks up to `Limits.nproc` processes can hold that many times
  `Limits.memory_mb` of address space (16 x 512 MB = 8 GiB by default), plus its tmpfs (`Limits.disk_mb`).
  A cgroup memory limit would bound the sum; it is not used (cgroup v1 / v2 and their delegation differ
  from host to host). Lower `nproc` where several graders run side by side on a small machine.
- Each concurrent run has its own uid (`UID_BASE` + slot, claimed with a file lock, so separate
  processes on one host never share one): RLIMIT_NPROC counts processes per uid, so a fork bomb in one
  sandbox cannot stop another from forking. The gid is 65534 (nogroup).
- No network: the new network namespace has no interface up, not even 127.0.0.1. A new IPC namespace:
  System V shared memory (which no rlimit counts once detached) dies with the run.
- Files: a new mount namespace and a chroot into a private tmpfs (`Limits.disk_mb`, gone with the
  run) holding read-only, nosuid binds of /usr, /lib*, /bin, /sbin and the interpreter's standard
  library; every site-/dist-packages directory and this repository are masked by empty mounts; plus
  /dev/{null,zero,urandom} and a writable /work (the working directory). Nothing the grader knows
  (tests, expected values, reference solutions, this repository's task generators, HumanEval's data)
  exists in that view; the tests are never written to disk at all. Only the standard library imports.
- Tamper resistance: expected values never enter the sandbox. The grader sends one call at a time
  (the arguments as a Python literal) over a pipe and receives `repr(result)`, which it parses as a
  literal (never evaluated) and compares with the expected value in its own process, type-strictly
  (`CallTest(loose=True)`: Python's `==`, as HumanEval's asserts compare, so 465.0 passes for 465). A
  program that exits early (`os._exit(0)`), prints "all tests passed", patches the harness or writes
  forged replies gains nothing: a reply counts only if it equals the expected value, which the program
  never sees, and a test without a reply fails. Arguments of a test are sent only after the earlier
  tests are answered, so code run at import time cannot see them. `CheckTest`s (HumanEval's `check`)
  run their trusted test code in the grader, with `candidate` a proxy that forwards each call to the
  sandbox; only arguments and literal results cross, so an object with a forged `__eq__` cannot pass.
  A check's `import random` gets a private generator seeded with 0: the grader's global `random` state
  is never advanced (grading threads run inside the trainer), and checks with random inputs (HumanEval
  38, 50, 53) test the same inputs on every run.
- Partial credit: if the process dies or hangs in a test (crash, timeout), that test fails and the
  remaining tests continue in a fresh process until `Limits.total_timeout_s` is spent; tests never
  reached fail as "not_run". A program that does not load (syntax error, exception or exit at import)
  fails every test.
- Output: stdout and stderr are kept up to `Limits.output_bytes` each (the cut is marked); a result
  whose repr exceeds `MAX_REPLY_CHARS` is wrong. The grader keeps at most `MAX_MESSAGE_BYTES` + 1 unread
  bytes of the reply pipe (more is a protocol error), so a program flooding it cannot exhaust its memory.
- Determinism: PYTHONHASHSEED=0, so a program gets the same verdict every time (timeouts aside).

Fallbacks, detected once (`isolation()`; `iso=` forces one):
- "user-namespace" (not root, user namespaces allowed): `unshare --map-root-user ...`, the same file
  system, network and process isolation, but the program keeps the caller's uid (there is no other to
  drop to): RLIMIT_NPROC is the caller's existing processes plus `Limits.nproc`, and parallel runs
  share that count. The harness drops every capability (bounding set and capset) before the program
  runs, so uid 0 of the namespace can neither leave its chroot nor unmount the masks.
- "root-only" (root without CAP_SYS_ADMIN): the slot uid and the limits, no network or file-system
  isolation (the run directory, owned by the slot uid, is the working directory; the interpreter must be
  readable by that uid); every process of the slot uid is killed at the end.
- "none": the limits (RLIMIT_NPROC counted as above), the caller's uid, the process-group kill, and a
  RuntimeWarning. The program can read the host's files and use the network: trusted code only.
"""

from __future__ import annotations

import builtins
import fcntl
import functools
import glob
import inspect
import math
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

UID_BASE = 61000  # slot uids UID_BASE .. UID_BASE + MAX_SLOTS - 1: below systemd's dynamic range (61184+)
MAX_SLOTS = 128
SANDBOX_GID = 65534  # nogroup
SLOT_LOCK_DIR = Path(tempfile.gettempdir()) / "agentrl-sandbox-slots"
STARTUP_TIMEOUT_S = 20.0  # interpreter start + namespace setup; the host's load, not the program's time
MAX_REPLY_CHARS = 100_000  # a longer repr(result) counts as a wrong answer
MAX_MESSAGE_BYTES = 2 * MAX_REPLY_CHARS  # a longer line on the reply pipe is a protocol violation
MAX_DETAIL_CHARS = 300  # error messages kept per test
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Limits:
    """Per-submission limits. Times in seconds, sizes in MiB (bytes for output)."""

    timeout_s: float = 2.0  # wall clock per test; loading the program gets the same
    total_timeout_s: float = 8.0  # wall clock for the whole submission, restarts included
    cpu_s: int = 4  # RLIMIT_CPU per process
    memory_mb: int = 512  # RLIMIT_AS per process
    nproc: int = 16  # RLIMIT_NPROC: processes of the sandbox uid
    fsize_mb: int = 8  # RLIMIT_FSIZE: largest file the program may write
    disk_mb: int = 32  # size of the sandbox's tmpfs (all files together)
    nofile: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 2000  # stdout and stderr kept, each


@dataclass(frozen=True)
class CallTest:
    """`entry_point(*args, **kwargs)` must return `expected`, compared in the grader type-strictly
    (`same_value`), or with `loose` by Python's `==` (`equal_value`, for HumanEval's docstring examples)."""

    args: tuple = ()
    expected: Any = None
    kwargs: dict = field(default_factory=dict)
    loose: bool = False


@dataclass(frozen=True)
class CheckTest:
    """Trusted test code run in the grader: `source` defines `check_name(candidate)`, which raises on failure.

    `candidate` is a proxy: each call is forwarded to the sandboxed function and its result comes back as
    a Python literal; the entry point's name in `source` is bound to the same proxy (some HumanEval
    checks call the function by name). HumanEval's `test` field after its prompt (for helpers) is such
    a source.
    """

    source: str
    check_name: str = "check"


Test = CallTest | CheckTest


@dataclass(frozen=True)
class TestResult:
    """One test's outcome. `status`: passed, wrong_answer, error, timeout, crashed, load_error, not_run."""

    __test__ = False  # not a pytest test class, despite its name

    status: str
    got: str | None = None  # repr of what the program returned (truncated), for wrong answers
    detail: str | None = None  # exception, signal or reason

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass(frozen=True)
class Verdict:
    """A graded submission. `reason` is "ok" or the first abnormal event: load_error, timeout,
    total_timeout, cpu_limit, memory_limit, crashed, exited (the process ended by itself mid-run),
    protocol_error (garbage on the reply pipe), sandbox_error (the sandbox itself failed to start)."""

    results: tuple[TestResult, ...]
    reason: str
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0

    @property
    def passed(self) -> int:
        return sum(result.passed for result in self.results)

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def fraction(self) -> float:
        """Eq. 12.13: tests passed / total (0 for an empty suite)."""
        return self.passed / self.total if self.results else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.results) and self.passed == self.total


# ---------------------------------------------------------------------------------------------------
# Values across the boundary: Python literals, parsed without evaluation.


_AST_LOCK = threading.Lock()


def parse_literal(text: str) -> Any:
    """The value of a Python literal as `repr` writes it: `ast.literal_eval` plus inf, nan, set(),
    frozenset(...). Never evaluates code."""
    # Pool threads parse concurrently, and CPython 3.11's ast module is not thread-safe: measured here,
    # concurrent ast.parse calls raised "SystemError: AST constructor recursion depth mismatch".
    with _AST_LOCK:
        return _literal_value(text)


def _literal_value(text: str) -> Any:
    """`parse_literal` without the lock; the harness (single-threaded) runs this copy."""
    import _ast as ast  # the C module behind `ast`, built in: importing `ast` costs the harness ~12 ms

    def convert(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = [convert(item) for item in node.elts]
            return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
        if isinstance(node, ast.Dict) and None not in node.keys:
            return {convert(key): convert(value) for key, value in zip(node.keys, node.values)}
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            operand = convert(node.operand)
            if isinstance(operand, (int, float, complex)) and not isinstance(operand, bool):
                return operand if isinstance(node.op, ast.UAdd) else -operand
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):  # complex: 1+2j
            left, right = convert(node.left), convert(node.right)
            if isinstance(left, (int, float)) and isinstance(right, complex):
                return left + right if isinstance(node.op, ast.Add) else left - right
        if isinstance(node, ast.Name) and node.id in ("inf", "nan"):
            return float(node.id)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords
                and node.func.id in ("set", "frozenset") and len(node.args) <= 1):
            kind = set if node.func.id == "set" else frozenset
            return kind(convert(node.args[0])) if node.args else kind()
        raise ValueError("not a literal")

    return convert(compile(text.strip(), "<literal>", "eval", ast.PyCF_ONLY_AST).body)


def same_value(got: Any, expected: Any) -> bool:
    """Type-strict equality: True is not 1, a tuple is not a list; floats equal within 1e-9 relative."""
    if type(got) is not type(expected):
        return False
    if isinstance(expected, float):
        return math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(got) and math.isnan(expected))
    if isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(same_value(g, e) for g, e in zip(got, expected))
    if isinstance(expected, dict):
        return got.keys() == expected.keys() and all(same_value(got[key], expected[key]) for key in expected)
    return got == expected


def equal_value(got: Any, expected: Any) -> bool:
    """Python's `==` (what `assert candidate(x) == y` checks: 465.0 == 465, True == 1, but [1] != (1,)),
    with floats equal within `same_value`'s tolerance."""
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)) and float in (type(got), type(expected)):
        return same_value(float(got), float(expected))
    if isinstance(expected, (list, tuple)) and type(got) is type(expected):
        return len(got) == len(expected) and all(equal_value(g, e) for g, e in zip(got, expected))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(equal_value(got[key], expected[key]) for key in expected)
    try:
        return bool(got == expected)
    except Exception:  # a comparison that raises is not equality
        return False


def _literal_repr(value: Any) -> str:
    """repr of a value that must survive `parse_literal` (test arguments); raises TypeError otherwise."""
    text = repr(value)
    try:
        parse_literal(text)
    except (ValueError, SyntaxError, RecursionError) as error:
        raise TypeError(f"argument is not a Python literal: {text[:80]}") from error
    return text


# ---------------------------------------------------------------------------------------------------
# The harness: the code of the sandboxed process. It is run with `python -c`, built from the source of
# `_literal_value` and `_harness_main`, so both must stay self-contained (imports inside, no globals).


def _harness_main(config: dict) -> None:
    """Set up isolation and limits (as root), drop privileges, load the program, answer calls."""
    import builtins
    import ctypes
    import os
    import resource

    def send(message: dict, fd: int = config["reply_fd"]) -> None:
        data = (repr(message) + "\n").encode()  # one line: repr escapes newlines
        while data:
            data = data[os.write(fd, data):]

    def describe(error: BaseException) -> str:
        try:
            message = str(error)
        except BaseException:  # a hostile __str__
            message = ""
        text = f"{type(error).__name__}: {message}" if message else type(error).__name__
        line, frame = None, error.__traceback__
        while frame is not None:
            if frame.tb_frame.f_code.co_filename == "solution.py":
                line = frame.tb_lineno
            frame = frame.tb_next
        if line is None and isinstance(error, SyntaxError) and error.filename == "solution.py":
            line = error.lineno
        return (text[:280] + (f" (line {line})" if line else "")).strip()

    os.dup2(config["stderr_fd"], 2)  # the program's stderr; unshare's own messages go to /dev/null
    os.close(config["stderr_fd"])
    os.umask(0o022)
    libc = ctypes.CDLL(None, use_errno=True)
    if config["chroot"]:
        ms_rdonly, ms_nosuid, ms_nodev, ms_remount, ms_bind, ms_rec = 1, 2, 4, 32, 4096, 16384

        def mount(source, target, fstype, flags, data):
            encode = lambda text: None if text is None else text.encode()
            if libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"mount {target}: {os.strerror(error)}")

        root = config["root"]
        mount("tmpfs", root, "tmpfs", ms_nosuid | ms_nodev, f"size={config['disk_kb']}k,mode=755")
        for path, target in config["links"]:
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(target, root + path)
        for path in config["binds"]:
            os.makedirs(root + path, exist_ok=True)
            mount(path, root + path, None, ms_bind | ms_rec, None)
            flags = os.statvfs(path).f_flag
            kept = flags & (os.ST_NODEV | os.ST_NOEXEC)  # a user namespace may not drop locked flags
            for flag, ms_flag in ((os.ST_NOATIME, 1024), (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21)):
                kept |= ms_flag if flags & flag else 0
            mount(None, root + path, None, ms_bind | ms_remount | ms_rdonly | ms_nosuid | kept, None)
        for path in config["masks"]:
            mount("tmpfs", root + path, "tmpfs", ms_rdonly | ms_nosuid | ms_nodev, "size=4k,mode=555")
        os.makedirs(root + "/dev", exist_ok=True)
        for device in ("/dev/null", "/dev/zero", "/dev/urandom"):
            open(root + device, "w").close()
            mount(device, root + device, None, ms_bind, None)
        os.mkdir(root + "/work", 0o700)  # the only writable place
        os.chown(root + "/work", config["uid"], config["gid"])

    # The program runs in a child: the first process of the new pid namespace, so its death kills all it
    # started. This parent stays outside, trusted: SIGTERM from the grader makes it kill the child (only
    # the parent can do so safely: until it reaps the child, that pid cannot be reused), and it reports
    # how the child ended (signal, exit status, CPU time) on a pipe only it holds.
    import _signal  # `signal` would import enum (~7 ms)

    children = []
    _signal.signal(15, lambda *_: children and os.kill(children[0], 9))  # SIGTERM -> SIGKILL the child
    children.append(os.fork())
    if children[0]:
        os.close(config["request_fd"])
        os.close(config["reply_fd"])
        os.waitid(os.P_PID, children[0], os.WEXITED | os.WNOWAIT)  # dead but not reaped: a kill is harmless
        _signal.signal(15, _signal.SIG_IGN)
        _, status, usage = os.wait4(children[0], 0)
        send({"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
              "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
              "cpu_s": usage.ru_utime + usage.ru_stime}, config["status_fd"])
        return
    _signal.signal(15, _signal.SIG_DFL)
    os.close(config["status_fd"])
    if config["chroot"]:
        os.chroot(config["root"])
        os.chdir("/work")
    for name, (soft, hard) in config["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if config["drop"]:
        os.setgroups([])
        os.setgid(config["gid"])
        os.setuid(config["uid"])
    else:  # uid 0 of a user namespace (or the caller itself): give up every capability, so that the chroot and the
        # mounts cannot be undone (a chroot escape needs CAP_SYS_CHROOT, an unmount CAP_SYS_ADMIN)
        for cap in range(64):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last capability, EPERM without any: fine)
        header, empty = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # _LINUX_CAPABILITY_VERSION_3
        libc.capset(header, empty)  # effective, permitted and inheritable sets all empty
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no set-uid program can regain privileges

    requests = os.fdopen(config["request_fd"], "rb")
    send({"event": "started"})
    request = _literal_value(requests.readline().decode())
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(request["program"], "solution.py", "exec"), namespace)
        function = namespace.get(request["entry_point"])
        if function is None:
            raise NameError(f"the code defines no function {request['entry_point']!r}")
        if not callable(function):
            raise TypeError(f"{request['entry_point']!r} is not a function")
    except BaseException as error:  # SystemExit and KeyboardInterrupt at import are load errors too
        send({"event": "load_error", "error": describe(error)})
        return
    send({"event": "ready"})
    for line in requests:
        call = _literal_value(line.decode())
        try:
            value = function(*_literal_value(call["args"]), **_literal_value(call["kwargs"]))
            text = repr(value)
        except BaseException as error:
            send({"error": describe(error)})
            continue
        send({"value": text[: config["max_reply"] + 1]})


@functools.lru_cache(maxsize=1)
def _harness_source() -> str:
    return ("from __future__ import annotations\n" + inspect.getsource(_literal_value) + "\n" + inspect.getsource(_harness_main)
            + "\nimport sys\n_harness_main(_literal_value(sys.argv[1]))\n")


# ---------------------------------------------------------------------------------------------------
# Isolation: what this host allows, detected once.


@dataclass(frozen=True)
class Isolation:
    """How sandboxes run on this host: the command prefix that creates namespaces (empty: none), and
    whether the program runs as an unprivileged slot uid (only possible when the host process is root)."""

    prefix: tuple[str, ...]
    drop_privileges: bool

    @property
    def namespaces(self) -> bool:
        return bool(self.prefix)

    @property
    def mode(self) -> str:
        return {(True, True): "root+namespaces", (True, False): "user-namespace",
                (False, True): "root-only", (False, False): "none"}[(self.namespaces, self.drop_privileges)]


_ISOLATION: Isolation | None = None
_ISOLATION_LOCK = threading.Lock()


def _works(command: list[str]) -> bool:
    try:
        return subprocess.run(command + ["true"], capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def isolation() -> Isolation:
    """The isolation this host supports (see the module docstring), probed on first use."""
    global _ISOLATION
    with _ISOLATION_LOCK:
        if _ISOLATION is None:
            is_root = os.geteuid() == 0
            # the harness forks the pid namespace's init; --ipc: System V shared memory dies with the run (a segment
            # counts against no rlimit once detached, and would outlive the program on the host)
            namespaces = ["unshare", "--mount", "--net", "--pid", "--ipc"]
            if not is_root:
                namespaces.insert(1, "--map-root-user")
            prefix = tuple(namespaces) if shutil.which("unshare") and _works(namespaces) else ()
            _ISOLATION = Isolation(prefix, is_root)
            if not prefix:
                warnings.warn(f"sandbox: no namespaces on this host (mode {_ISOLATION.mode}): programs can "
                              "read the host's files and use the network", RuntimeWarning, stacklevel=2)
    return _ISOLATION


@functools.lru_cache(maxsize=1)
def _filesystem_view() -> dict[str, list]:
    """The directories bound into the sandbox's root, the symlinks recreated there, and the masked paths."""
    binds, links = [], []
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            links.append([top, os.readlink(top)])
        elif os.path.isdir(top):
            binds.append(top)
    stdlib = os.path.realpath(os.path.dirname(os.__file__))  # the interpreter's own library may live elsewhere
    if not any(stdlib == b or stdlib.startswith(b + "/") for b in binds):
        binds.append(stdlib)
    candidates = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    candidates += glob.glob("/usr/lib/python3*/*-packages") + glob.glob("/usr/local/lib/python3*/*-packages")
    candidates.append(str(REPO_ROOT))
    masks = sorted({os.path.realpath(p) for p in candidates if os.path.isdir(p)})
    masks = [m for m in masks if any(m.startswith(b + "/") for b in binds)]
    return {"binds": binds, "links": links, "masks": masks}


# ---------------------------------------------------------------------------------------------------
# Uid slots: one uid per concurrent run, across every process on the host.


class _Slot:
    """An exclusive uid, held with a file lock (released by the kernel if this process dies)."""

    def __init__(self) -> None:
        SLOT_LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        for index in range(MAX_SLOTS):
            handle = open(SLOT_LOCK_DIR / f"{UID_BASE + index}.lock", "a")  # noqa: SIM115 (held until release)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            self.uid, self._handle = UID_BASE + index, handle
            return
        raise RuntimeError(f"all {MAX_SLOTS} sandbox uid slots are busy")

    def release(self) -> None:
        self._handle.close()


def _processes_of(uid: int, zombies: bool = True) -> list[int]:
    """Pids of `uid`'s processes; `zombies=False` leaves out the dead ones their new parent has yet to reap."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid and (zombies or Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                    pids.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    return pids


# ---------------------------------------------------------------------------------------------------
# The grader's side of one sandboxed process.


class _ProcessGone(BaseException):
    """The sandboxed process died or timed out during a call (BaseException: check code cannot catch it)."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


class _Child:
    """One sandboxed process: start, load the program, forward calls, kill."""

    def __init__(self, root: str, uid: int | None, limits: Limits, iso: Isolation) -> None:
        self.limits, self.iso, self.uid = limits, iso, uid
        request_read, self._request_write = os.pipe()
        self._reply_read, reply_write = os.pipe()
        self._stderr_fd, stderr_write = os.pipe()
        self._status_fd, status_write = os.pipe()  # written only by the harness's trusted parent
        nproc = limits.nproc if iso.drop_privileges else len(_processes_of(os.getuid())) + limits.nproc
        rlimits = {"RLIMIT_AS": limits.memory_mb << 20, "RLIMIT_NPROC": nproc, "RLIMIT_FSIZE": limits.fsize_mb << 20,
                   "RLIMIT_NOFILE": limits.nofile, "RLIMIT_CORE": 0}
        config = {
            # Without a drop the program stays root of its user namespace (uid 0 there is the caller).
            "chroot": iso.namespaces, "drop": iso.drop_privileges, "root": root, "uid": uid if uid is not None else 0,
            "gid": SANDBOX_GID if iso.drop_privileges else 0, "disk_kb": limits.disk_mb * 1024,
            "request_fd": request_read, "reply_fd": reply_write, "stderr_fd": stderr_write,
            "status_fd": status_write, "max_reply": MAX_REPLY_CHARS,
            # CPU: SIGXCPU at the soft limit, SIGKILL a second later (a pid namespace's init ignores SIGXCPU).
            "rlimits": {"RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1), **{k: (v, v) for k, v in rlimits.items()}},
            **(_filesystem_view() if iso.namespaces else {}),
        }
        env = {"PATH": "/usr/bin:/bin", "HOME": "/work" if iso.namespaces else root, "LANG": "C.UTF-8",
               "TMPDIR": "/work" if iso.namespaces else root, "PYTHONHASHSEED": "0"}
        command = [*iso.prefix, sys.executable, "-S", "-s", "-B", "-P", "-u", "-c", _harness_source(), repr(config)]
        try:
            self.popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, cwd=root, env=env, start_new_session=True,
                                          pass_fds=(request_read, reply_write, stderr_write, status_write))
        finally:
            for fd in (request_read, reply_write, stderr_write, status_write):
                os.close(fd)
        self._selector = selectors.DefaultSelector()
        self._stdout_fd = self.popen.stdout.fileno()
        self._buffers = {fd: bytearray() for fd in (self._reply_read, self._stdout_fd, self._stderr_fd, self._status_fd)}
        self._dropped = {fd: 0 for fd in self._buffers}
        self._eof: set[int] = set()
        for fd in self._buffers:
            os.set_blocking(fd, False)
            self._selector.register(fd, selectors.EVENT_READ)

    # -- transport ------------------------------------------------------------------------------

    def _pump(self, timeout: float) -> None:
        """Read whatever is ready (up to `timeout` seconds); stdout/stderr beyond their bound are dropped."""
        for key, _ in self._selector.select(max(timeout, 0.0)):
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                self._selector.unregister(key.fd)
                self._eof.add(key.fd)
                continue
            buffer = self._buffers[key.fd]
            if key.fd == self._status_fd:
                buffer += chunk  # written by the trusted parent
            elif key.fd == self._reply_read:  # one message is outstanding at a time: more than a message's bound
                buffer += chunk[: max(MAX_MESSAGE_BYTES + 1 - len(buffer), 0)]  # unread is a protocol error anyway
            else:
                kept = chunk[: max(self.limits.output_bytes - len(buffer), 0)]
                buffer += kept
                self._dropped[key.fd] += len(chunk) - len(kept)

    def receive(self, deadline: float) -> dict | None:
        """The next message on the reply pipe; None at end of file; raises TimeoutError past `deadline`;
        a line too long or not a literal dict gives {"protocol_error": ...}."""
        buffer = self._buffers[self._reply_read]
        while True:
            newline = buffer.find(b"\n")
            if newline >= 0:
                line = bytes(buffer[:newline])
                del buffer[: newline + 1]
                try:
                    message = parse_literal(line.decode("utf-8", errors="replace"))
                except (ValueError, SyntaxError, RecursionError, MemoryError):
                    message = None
                return message if isinstance(message, dict) else {"protocol_error": "malformed reply"}
            if len(buffer) > MAX_MESSAGE_BYTES:
                return {"protocol_error": "reply too long"}
            if self._reply_read in self._eof:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self._pump(remaining)

    def send(self, message: dict) -> bool:
        """Write one request; False if the process no longer reads (it died or closed the pipe)."""
        data = (repr(message) + "\n").encode()
        try:
            while data:
                data = data[os.write(self._request_write, data):]
        except (BrokenPipeError, OSError):
            return False
        return True

    # -- protocol -------------------------------------------------------------------------------

    def start(self, program: str, entry_point: str, deadline: float) -> tuple[str, str] | None:
        """Start and load the program: None when ready, else (reason, detail)."""
        startup_deadline = min(deadline, time.monotonic() + STARTUP_TIMEOUT_S)
        try:
            message = self.receive(startup_deadline)
        except TimeoutError:
            return "sandbox_error", "the sandbox did not start in time"
        if message is None or message.get("event") != "started":
            detail = self.stderr_text()[-300:] or f"exit status {self.popen.wait()}"
            return "sandbox_error", f"the sandbox failed to start: {detail}"
        if not self.send({"program": program, "entry_point": entry_point}):
            return "sandbox_error", "the sandbox closed its request pipe"
        try:
            message = self.receive(min(deadline, time.monotonic() + self.limits.timeout_s))
        except TimeoutError:
            return "timeout", f"loading the program took over {self.limits.timeout_s:g} s"
        if message is None:
            return self.death_reason()
        if message.get("event") == "load_error":
            error = str(message.get("error", ""))[:MAX_DETAIL_CHARS]
            return ("memory_limit" if error.startswith("MemoryError") else "load_error"), error
        if message.get("event") != "ready":
            return "protocol_error", "unexpected message before the program was ready"
        return None

    def call(self, args: tuple, kwargs: dict, deadline: float) -> dict:
        """Forward one call; returns {"value": repr} or {"error": text}; raises _ProcessGone."""
        if not self.send({"args": _literal_repr(tuple(args)), "kwargs": _literal_repr(dict(kwargs))}):
            raise _ProcessGone(*self.death_reason())
        try:
            message = self.receive(deadline)
        except TimeoutError:
            raise _ProcessGone("timeout", f"no answer within {self.limits.timeout_s:g} s") from None
        if message is None:
            raise _ProcessGone(*self.death_reason())
        if "protocol_error" in message or not ({"value", "error"} & message.keys()):
            raise _ProcessGone("protocol_error", str(message.get("protocol_error", "unexpected reply")))
        return message

    def _end_report(self, timeout: float) -> dict | None:
        """The trusted parent's report of how the program's process ended, waiting up to `timeout`
        seconds; None if it does not come (the process still runs)."""
        deadline = time.monotonic() + timeout
        while True:
            buffer = self._buffers[self._status_fd]
            if buffer.endswith(b"\n"):
                return parse_literal(buffer.decode())
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._status_fd in self._eof:
                return None
            self._pump(remaining)

    def death_reason(self) -> tuple[str, str]:
        """Why the program's process ended by itself (its reply pipe reached end of file)."""
        end = self._end_report(timeout=2.0)
        if end is None:  # the pipe was closed but the process lives on
            return "exited", "the program closed the reply pipe"
        number = end["signal"]
        if number == signal.SIGXCPU or (number == signal.SIGKILL and end["cpu_s"] >= self.limits.cpu_s):
            return "cpu_limit", f"killed at the CPU limit ({self.limits.cpu_s} s)"
        if number is not None:
            return "crashed", f"killed by {signal.Signals(number).name}" if number in signal.valid_signals() else f"signal {number}"
        return "exited", f"the program ended the process (exit status {end['exit']})"

    # -- end --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill everything the run started, wait until it is gone, and release the pipes."""
        # The trusted parent kills the program's process; with namespaces that is the pid namespace's init,
        # and the kernel kills every process inside before it is reaped, so once the parent has exited
        # nothing of the run is left. The group is killed before the parent is reaped: until then its pid, which
        # is the group's id, cannot be reused, so the signal cannot reach another program's group.
        if self.popen.returncode is None:  # (reaped already only where starting failed, before any program ran)
            os.kill(self.popen.pid, signal.SIGTERM)  # not Popen.send_signal, whose poll() would reap an exited parent
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not os.waitid(os.P_PID, self.popen.pid,
                                                                 os.WEXITED | os.WNOHANG | os.WNOWAIT):
                time.sleep(0.005)
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.iso.drop_privileges and not self.iso.namespaces:
            _kill_user(self.uid)  # processes that left the process group with setsid()
        self.popen.wait()
        self._pump(0)
        self._selector.close()
        for fd in (self._request_write, self._reply_read, self._stderr_fd, self._status_fd):
            os.close(fd)
        self.popen.stdout.close()

    def output_text(self, fd: int) -> str:
        text = self._buffers[fd].decode("utf-8", errors="replace")
        return text + (f"\n[... {self._dropped[fd]} bytes truncated]" if self._dropped[fd] else "")

    def stdout_text(self) -> str:
        return self.output_text(self._stdout_fd)

    def stderr_text(self) -> str:
        return self.output_text(self._stderr_fd)


def _kill_user(uid: int, timeout: float = 2.0) -> None:
    """SIGKILL every process of `uid` until none is left (one may fork while the others die)."""
    deadline = time.monotonic() + timeout
    while (pids := _processes_of(uid, zombies=False)) and time.monotonic() < deadline:
        for pid in pids:
            _kill(pid)
        time.sleep(0.005)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------------------
# Grading.


def _grade_call(child: _Child, test: CallTest, deadline: float) -> TestResult:
    reply = child.call(test.args, test.kwargs, deadline)
    if "error" in reply:
        return TestResult("error", detail=str(reply["error"])[:MAX_DETAIL_CHARS])
    text = str(reply["value"])
    if len(text) > MAX_REPLY_CHARS:
        return TestResult("wrong_answer", got=text[:MAX_DETAIL_CHARS], detail="result too long")
    try:
        got = parse_literal(text)
    except (ValueError, SyntaxError, RecursionError, MemoryError):
        return TestResult("wrong_answer", got=text[:MAX_DETAIL_CHARS], detail="result is not a literal value")
    equal = (equal_value if test.loose else same_value)(got, test.expected)
    return TestResult("passed" if equal else "wrong_answer", got=text[:MAX_DETAIL_CHARS])


class _ProgramError(Exception):
    """The sandboxed function raised (its description is the message)."""


def _check_builtins() -> dict[str, Any]:
    """Builtins for a check's code whose `import random` (or `from random import ...`) gets a module bound
    to a private `random.Random(0)`: see the module docstring (tamper resistance)."""
    private = types.ModuleType("random")
    rng = random.Random(0)
    for name in random.__all__:
        value = getattr(random, name)
        private.__dict__[name] = getattr(rng, name) if inspect.ismethod(value) or inspect.isbuiltin(value) else value

    def check_import(name: str, globals=None, locals=None, fromlist=(), level: int = 0):  # noqa: A002 (the signature)
        return private if name == "random" and level == 0 else __import__(name, globals, locals, fromlist, level)

    return {**builtins.__dict__, "__import__": check_import}


def _grade_check(child: _Child, test: CheckTest, entry_point: str, deadline: float) -> TestResult:
    def candidate(*args: Any, **kwargs: Any) -> Any:
        reply = child.call(args, kwargs, deadline)
        if "error" in reply:
            raise _ProgramError(str(reply["error"])[:MAX_DETAIL_CHARS])
        return parse_literal(str(reply["value"]))

    namespace: dict[str, Any] = {"__name__": "check", "__builtins__": _check_builtins()}
    exec(compile(test.source, "check.py", "exec"), namespace)  # trusted test code, in the grader
    namespace[entry_point] = candidate
    try:
        namespace[test.check_name](candidate)
    except AssertionError as error:
        return TestResult("wrong_answer", detail=f"AssertionError: {error}"[:MAX_DETAIL_CHARS].rstrip(": "))
    except _ProgramError as error:
        return TestResult("error", detail=str(error))
    except Exception as error:  # the result was not what the check could use (e.g. not a literal)
        return TestResult("error", detail=f"{type(error).__name__}: {error}"[:MAX_DETAIL_CHARS])
    return TestResult("passed")


def run_tests(program: str, entry_point: str, tests: Sequence[Test], limits: Limits = Limits(),
              iso: Isolation | None = None) -> Verdict:
    """Grade `program` (which must define `entry_point`) on `tests` in a fresh sandbox; see the module
    docstring. `iso` overrides the detected isolation (to run or test a fallback deliberately)."""
    started = time.monotonic()
    deadline = started + limits.total_timeout_s
    iso = iso or isolation()
    slot = _Slot() if iso.drop_privileges else None
    root = tempfile.mkdtemp(prefix="agentrl-sandbox-")
    results: list[TestResult] = []
    reason, stdout, stderr = "ok", [], []
    try:
        if slot is not None:
            os.chown(root, slot.uid, SANDBOX_GID)
        while len(results) < len(tests):
            if time.monotonic() >= deadline:
                reason = reason if reason != "ok" else "total_timeout"
                break
            try:
                child = _Child(root, slot.uid if slot else None, limits, iso)
            except OSError as error:  # e.g. the host is out of processes: the sandbox's failure, not the program's
                reason = "sandbox_error"
                results += [TestResult("not_run", detail=f"the sandbox could not start: {error}")] * (len(tests) - len(results))
                break
            try:
                failure = child.start(program, entry_point, deadline)
                if failure is not None:  # loading is deterministic: no retry, every remaining test fails
                    reason = reason if reason != "ok" else failure[0]
                    status = {"timeout": "timeout", "sandbox_error": "not_run"}.get(failure[0], "load_error")
                    results += [TestResult(status, detail=failure[1])] * (len(tests) - len(results))
                    break
                while len(results) < len(tests):
                    test = tests[len(results)]
                    test_deadline = min(deadline, time.monotonic() + limits.timeout_s)
                    try:
                        if isinstance(test, CallTest):
                            result = _grade_call(child, test, test_deadline)
                        else:
                            result = _grade_check(child, test, entry_point, test_deadline)
                    except _ProcessGone as gone:
                        status = gone.status if gone.status in ("timeout", "crashed") else "error"
                        results.append(TestResult(status, detail=gone.detail[:MAX_DETAIL_CHARS]))
                        reason = reason if reason != "ok" else gone.status
                        break  # this process is spent: the next test gets a fresh one
                    if result.detail and result.detail.startswith("MemoryError") and reason == "ok":
                        reason = "memory_limit"
                    results.append(result)
            finally:
                child.close()
                stdout.append(child.stdout_text())
                stderr.append(child.stderr_text())
        results += [TestResult("not_run", detail="the submission's time ran out")] * (len(tests) - len(results))
    finally:
        if slot is not None:
            slot.release()
        shutil.rmtree(root, ignore_errors=True)
    return Verdict(tuple(results), reason, _bounded(stdout, limits.output_bytes),
                   _bounded(stderr, limits.output_bytes), time.monotonic() - started)


def _bounded(texts: list[str], bound: int) -> str:
    """The non-empty outputs of a run's processes joined, cut to `bound` characters (cut marked)."""
    text = "\n".join(filter(None, texts))
    return text if len(text) <= bound else text[:bound] + "\n[... truncated]"


class Sandbox:
    """Grades one submission at a time with fixed `limits` (and isolation, detected unless given)."""

    def __init__(self, limits: Limits = Limits(), iso: Isolation | None = None) -> None:
        self.limits, self.iso = limits, iso

    def run(self, program: str, entry_point: str, tests: Sequence[Test]) -> Verdict:
        return run_tests(program, entry_point, tests, self.limits, self.iso)


class SandboxPool:
    """Grades many submissions in parallel: a thread pool, each thread driving one sandboxed process.

    Threads suffice: the grader's work is waiting on pipes, and each submission has its own process,
    uid, namespaces and limits, so parallel runs cannot see or starve each other.
    """

    def __init__(self, workers: int = 2, limits: Limits = Limits(), iso: Isolation | None = None) -> None:
        if not 1 <= workers <= MAX_SLOTS:
            raise ValueError(f"workers must be in 1..{MAX_SLOTS}, got {workers}")
        self.limits, self.iso = limits, iso
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")

    def submit(self, program: str, entry_point: str, tests: Sequence[Test]) -> Future:
        return self._executor.submit(run_tests, program, entry_point, tests, self.limits, self.iso)

    def map(self, jobs: Iterable[tuple[str, str, Sequence[Test]]]) -> list[Verdict]:
        """Verdicts for (program, entry_point, tests) jobs, in order."""
        return [future.result() for future in [self.submit(*job) for job in jobs]]

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
