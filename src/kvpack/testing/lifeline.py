"""Tie every process a test run starts to that run, so a run killed outright (SIGKILL, a CI
timeout) leaves no sshd, ``weed server``, kvpack daemon, HTTPS API or browser behind holding
ports and CPU while the next run starts.

Two layers, both installed for the whole pytest process by ``tests/conftest.py``:

1. :func:`install` makes every ``subprocess.Popen`` (asyncio's too) started from the **main
   thread** set ``PR_SET_PDEATHSIG(SIGKILL)`` in the child before it execs: the kernel kills
   the child the moment the test process dies, however it dies. Every service a fixture starts
   is such a Popen; the blocking ``subprocess.run``/``call`` are left out (see ``_BLOCKING``). The
   signal is tied to the *thread* that forked, not the process (prctl(2)), so a child spawned
   from a worker thread would be killed when that thread ends (a pool worker finishing its
   task) although the test still uses it; such spawns keep the plain behaviour and are left to
   layer 2. Test fixtures spawn their services from the main thread.
2. :func:`install` also puts a marker naming this run (``KVPACK_LIFELINE=<pid>:<start time>``)
   into the environment, which every descendant that keeps its environment inherits: daemons
   that start their own session, grandchildren whose parent already exited (PDEATHSIG follows
   one generation only), and, through ``SetEnv`` in the test sshd configs
   (:func:`setenv_words`), units started over ssh. :func:`sweep`, run by the next pytest
   session before any test, SIGKILLs every process whose marker names a run that is no longer
   alive. Runs that are alive (a parallel session on the same box) are never touched.

Linux only (prctl and /proc); elsewhere both layers are no-ops. Never used by production code.
"""

from __future__ import annotations

import ctypes
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

ENV = "KVPACK_LIFELINE"
PR_SET_PDEATHSIG = 1

_original_init = subprocess.Popen.__init__
_init_signature = inspect.signature(_original_init)
_installed = False

# Resolved once here, never in the forked child: the child only makes the call.
_prctl: Any = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _prctl.restype = ctypes.c_int
    except (OSError, AttributeError):
        _prctl = None


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot): with the pid it
    names one process, not whichever later process reuses the pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    return stat[stat.rindex(b")") + 2 :].split()[19].decode()


def token(pid: int | None = None) -> str | None:
    """The marker value naming process ``pid`` (default: this one)."""
    pid = os.getpid() if pid is None else pid
    start = _start_time(pid)
    return None if start is None else f"{pid}:{start}"


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGKILL when the thread that forked it ends. If the
    parent already died between fork and this call, the signal will never come: die now."""

    def preexec() -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


# The blocking calls (check_call, check_output and getoutput go through these two): their child
# ends before the call returns, so it is bounded by its own work; were it tied, every one of
# the suite's many short CLI runs would pay a full fork of the test process (the preexec
# function rules out vfork): 2 ms became 13-34 ms per spawn at 730 MiB resident. A child left
# running by a killed run is still swept by the next one (layer 2).
_BLOCKING = {subprocess.run.__code__, subprocess.call.__code__}


def _tied_init(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:
    if threading.current_thread() is threading.main_thread() and sys._getframe(1).f_code not in _BLOCKING:
        bound = _init_signature.bind(self, *args, **kwargs)
        user_fn = bound.arguments.get("preexec_fn")
        tie = die_with_parent(os.getpid())
        if user_fn is None:
            bound.arguments["preexec_fn"] = tie
        else:

            def both() -> None:
                tie()
                user_fn()

            bound.arguments["preexec_fn"] = both
        _original_init(*bound.args, **bound.kwargs)
    else:
        _original_init(self, *args, **kwargs)


def install() -> None:
    """Tie this process's future children to it (layer 1) and mark its descendants (layer 2).
    Idempotent. Tied children are started with ``fork`` instead of ``vfork`` (a preexec
    function forces it), hence the blocking calls are left out (``_BLOCKING``)."""
    global _installed
    if _installed or _prctl is None:
        return
    mark = token()
    if mark is not None:
        os.environ[ENV] = mark
    subprocess.Popen.__init__ = _tied_init  # type: ignore[method-assign]
    _installed = True


def uninstall() -> None:
    """Undo :func:`install` (the marker stays: descendants already carry it)."""
    global _installed
    subprocess.Popen.__init__ = _original_init  # type: ignore[method-assign]
    _installed = False


def setenv_words() -> str:
    """This run's marker as the words of an sshd_config ``SetEnv`` line (one line holds every
    variable: sshd keeps only the first ``SetEnv`` directive), or "" outside a tied run."""
    mark = os.environ.get(ENV)
    return f"{ENV}={mark}" if mark else ""


def _marker_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read()
    except OSError:  # gone, or another user's process we may not read (and could not kill)
        return None
    prefix = ENV.encode() + b"="
    for item in env.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat = fh.read()
            pid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _alive(mark: str) -> bool:
    pid, _, start = mark.partition(":")
    try:
        return _start_time(int(pid)) == start
    except ValueError:
        return True  # not a marker this module wrote: leave its process alone


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return True  # gone
    return stat[stat.rindex(b")") + 2 :].split()[0] == b"Z"


def strays() -> list[int]:
    """Live processes whose marker names a run that is gone (never this process or its ancestors)."""
    if not os.path.isdir("/proc"):
        return []
    mine = _ancestors()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in mine:
            continue
        mark = _marker_of(int(name))
        if mark is not None and not _alive(mark) and not _is_zombie(int(name)):
            found.append(int(name))
    return found


def sweep(wait_s: float = 10.0) -> list[int]:
    """SIGKILL the strays of dead runs and wait (bounded) until they are gone or zombies, so
    their ports are free when this run starts. Returns the pids it killed."""
    killed = []
    for pid in strays():
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(_is_zombie(pid) for pid in killed):
        time.sleep(0.05)
    return killed
