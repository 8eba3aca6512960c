"""The lifeline (kvpack.testing.lifeline) holds: a service started by a test process dies when
that process is SIGKILLed; a grandchild that escaped the kernel's tie is swept by the next run
and only then; a child spawned from a worker thread is not killed when the thread ends; a
fixture's own preexec function still runs. Each kill test has a control without the lifeline
that shows the stray really survives (so the assertions can fail)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvpack.testing import lifeline

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) and /proc are Linux")

SRC = str(Path(__file__).resolve().parents[1] / "src")
DEADLINE_S = 30.0  # a bound for a loaded 2-core CI box, not a performance figure

# A service like the fixtures' ones: its own session (so a signal to the test's process group
# does not reach it), a listening port, and no end of its own.
SERVICE = textwrap.dedent(
    """
    import socket, sys, time
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
    print(s.getsockname()[1], flush=True)
    while True:
        time.sleep(60)
    """
)

# The test process stand-in: spawns SERVICE (directly, or through a short-lived middle process
# that leaves it behind: the grandchild case), reports it, then waits to be killed.
PARENT = textwrap.dedent(
    """
    import json, subprocess, sys, time
    from kvpack.testing import lifeline
    tied, depth, service = sys.argv[1] == "tied", int(sys.argv[2]), sys.argv[3]
    if tied:
        lifeline.install()
    if depth == 1:
        argv = [sys.executable, "-c", service]
    else:  # a middle process starts the service and exits at once, as a daemonizing CLI does
        argv = [sys.executable, "-c",
                "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdout=subprocess.PIPE, start_new_session=True);"
                " print(p.pid, p.stdout.readline().decode().strip(), flush=True)", service]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True, text=True)
    if depth == 1:
        pid, port = p.pid, p.stdout.readline().strip()
    else:
        pid, port = p.stdout.readline().split()
        p.wait()
    print(json.dumps({"pid": int(pid), "port": int(port)}), flush=True)
    time.sleep(3600)
    """
)


def _gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie waiting for a reaper (its sockets are closed)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(b")") + 2 :].split()[0] == b"Z"


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return True
    except OSError:
        return False


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + DEADLINE_S
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _start_parent(tied: bool, depth: int) -> tuple[subprocess.Popen, dict]:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(lifeline.ENV, None)  # the control's processes carry no marker at all
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, "tied" if tied else "plain", str(depth), SERVICE], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    line = parent.stdout.readline()
    assert line, f"parent exited {parent.wait()} before starting the service"
    return parent, json.loads(line)


def _kill_parent(parent: subprocess.Popen) -> None:
    parent.kill()  # SIGKILL: no finalizer, no atexit, nothing of the parent's runs
    parent.wait(DEADLINE_S)
    parent.stdout.close()


def _reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_service_dies_with_its_sigkilled_parent():
    parent, svc = _start_parent(tied=True, depth=1)
    try:
        assert _answers(svc["port"])
        _kill_parent(parent)
        assert _wait_gone(svc["pid"]), f"service {svc['pid']} outlived its SIGKILLed parent by {DEADLINE_S} s"
        assert not _answers(svc["port"])
    finally:
        _kill_parent(parent)
        _reap(svc["pid"])


def test_control_without_lifeline_the_service_survives():
    parent, svc = _start_parent(tied=False, depth=1)
    try:
        _kill_parent(parent)
        # the kernel sends the parent-death signal while the parent exits, before wait() returns
        assert not _gone(svc["pid"]) and _answers(svc["port"])
    finally:
        _reap(svc["pid"])


def test_escaped_grandchild_is_swept_once_its_run_is_dead():
    parent, svc = _start_parent(tied=True, depth=2)
    try:
        # its middle parent exited: PDEATHSIG no longer covers it, the marker does
        assert svc["pid"] not in lifeline.strays(), "a live run's process must never be swept"
        _kill_parent(parent)
        assert not _gone(svc["pid"]) and _answers(svc["port"])  # the kernel did not catch it
        assert svc["pid"] in lifeline.strays()
        assert svc["pid"] in lifeline.sweep(wait_s=DEADLINE_S)
        assert _gone(svc["pid"]) and not _answers(svc["port"])
    finally:
        _kill_parent(parent)
        _reap(svc["pid"])


def test_control_unmarked_grandchild_is_not_swept():
    parent, svc = _start_parent(tied=False, depth=2)
    try:
        _kill_parent(parent)
        assert svc["pid"] not in lifeline.sweep(wait_s=0)
        assert not _gone(svc["pid"])
    finally:
        _reap(svc["pid"])


def test_child_of_a_worker_thread_outlives_the_thread():
    """PDEATHSIG follows the forking thread: a worker's child must not die when the worker ends."""
    assert subprocess.Popen.__init__ is not lifeline._original_init, "tests/conftest.py installs the lifeline"
    procs: list[subprocess.Popen] = []
    code = "import sys; print(sys.stdin.read().upper(), end='')"
    t = threading.Thread(target=lambda: procs.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)))
    t.start()
    t.join()
    out, _ = procs[0].communicate("still here", timeout=DEADLINE_S)
    assert (procs[0].returncode, out) == (0, "STILL HERE")


def test_fixture_preexec_fn_still_runs(tmp_path):
    flag = tmp_path / "ran"
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getppid())"], preexec_fn=lambda: flag.write_text("yes"), capture_output=True, text=True)
    assert proc.returncode == 0 and int(proc.stdout) == os.getpid() and flag.read_text() == "yes"


# what the child itself reports: its parent-death signal (prctl PR_GET_PDEATHSIG) and its marker
PROBE = "import ctypes, os; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value, os.environ.get('KVPACK_LIFELINE', ''))"


def test_main_thread_popen_is_tied_and_blocking_run_is_marked_only():
    """Services (Popen) get SIGKILL on the run's death; a blocking run() (bounded by its own
    work, and spared the fork of this whole process) only carries the marker for the sweep."""
    with subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True) as p:
        popen_sig, popen_mark = p.stdout.read().split()
    run_sig, run_mark = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    assert (int(popen_sig), int(run_sig)) == (signal.SIGKILL, 0)
    assert popen_mark == run_mark == lifeline.token() == os.environ[lifeline.ENV]
