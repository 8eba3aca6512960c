"""Managed daemon processes on a node: ``kvpack node-local daemon start|stop|status``.

A *unit* is one ``kvpack producer`` or ``kvpack receiver`` process started from a node
directory, detached from the SSH session that started it (its own session, stdin from
/dev/null, output to ``run/<unit>.log``), and recorded durably in ``run/<unit>.json``: pid,
the exact argv and the daemon's own ready line (ports, socket). Start waits for that ready
line under a deadline; a daemon that exits first is a refusal carrying its log's tail.

Stop sends SIGTERM (the daemons' clean shutdown) and SIGKILL after a deadline, but only to
a process whose ``/proc/<pid>/cmdline`` is still exactly the recorded argv, so a recycled
pid is never signalled. Under systemd the same argv goes into ``ExecStart=`` (docs/operations.md).

The argv is built here from checked fields (role, config name, engine spec, thread count,
addresses); nothing the caller passes is handed to a shell.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import time
from typing import Any

from ..durable import atomic_write, durable_unlink, ensure_dir
from ..errors import OnboardError
from .nodeside import CONFIG_RE, node_dir

UNIT_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")
LOG_TAIL = 3000


def _paths(d: str, unit: str) -> tuple[str, str, str]:
    if not UNIT_RE.fullmatch(unit or ""):
        raise OnboardError("usage", f"unit name {unit!r} is not valid")
    run = os.path.join(d, "run")
    return run, os.path.join(run, f"{unit}.json"), os.path.join(run, f"{unit}.log")


def socket_path(d: str, unit: str) -> str:
    """``run/<unit>.sock``, or a short path under /tmp when that would exceed AF_UNIX's limit."""
    path = os.path.join(d, "run", f"{unit}.sock")
    if len(path.encode()) <= 100:
        return path
    digest = hashlib.sha256(path.encode()).hexdigest()[:16]
    return os.path.join("/tmp", f"kvpack-{os.getuid()}-{digest}.sock")


def build_argv(
    d: str,
    unit: str,
    *,
    role: str,
    config: str,
    engine: str,
    threads: int,
    no_store: bool = False,
    listen: str | None = None,
    receipts: str | None = None,
    ledger_max_tail_ms: float | None = None,
) -> list[str]:
    from ..security.config import parse_socket_address

    if role not in ("producer", "receiver"):
        raise OnboardError("usage", f"role must be producer or receiver, got {role!r}")
    if not CONFIG_RE.fullmatch(config or "") or (role == "producer") != (config == "producer.json"):
        raise OnboardError("usage", f"config {config!r} does not fit role {role}")
    from ..engine.registry import parse_spec
    from ..errors import EngineError

    try:
        engine = parse_spec(engine).text  # the one registry's grammar, in its canonical form
    except EngineError as exc:
        raise OnboardError("usage", exc.message) from None
    if not 1 <= threads <= 256:
        raise OnboardError("usage", "threads must be 1..256")
    argv = [sys.executable, "-m", "kvpack.cli", role, "--config", os.path.join(d, config), "--engine", engine, "--threads", str(threads), "--metrics-port", "0"]
    if no_store:
        argv.append("--no-store")
    if receipts:
        if not UNIT_RE.fullmatch(receipts):
            raise OnboardError("usage", "receipts must name a subdirectory of run/")
        argv += ["--receipts", os.path.join(d, "run", receipts, "receipts")]
    if role == "receiver":
        argv += ["--socket", socket_path(d, unit)]
        if ledger_max_tail_ms is not None:
            argv += ["--ledger-max-tail-ms", repr(float(ledger_max_tail_ms))]
        if listen:
            parse_socket_address(listen, "--listen")
            argv += ["--listen", listen]
    elif listen:
        raise OnboardError("usage", "--listen applies to receivers only")
    return argv


def _cmdline(pid: int) -> list[str] | None:
    """The live argv of ``pid``, or None if it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().rsplit(b")", 1)[-1].split()
        if stat and stat[0] == b"Z":
            return None
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]] if raw else None


def _load(record_path: str) -> dict[str, Any] | None:
    try:
        with open(record_path, "rb") as fh:
            rec = json.loads(fh.read(1 << 20))
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # a torn record cannot be produced by atomic_write; treat as absent
    return rec if isinstance(rec, dict) and isinstance(rec.get("pid"), int) and isinstance(rec.get("argv"), list) else None


def running(rec: dict[str, Any] | None) -> bool:
    return rec is not None and _cmdline(rec["pid"]) == rec["argv"]


def status(directory: str, unit: str) -> dict[str, Any]:
    d = node_dir(directory)
    _, record_path, log_path = _paths(d, unit)
    rec = _load(record_path)
    return {"unit": unit, "running": running(rec), "record": rec, "log": log_path}


def list_units(d: str) -> dict[str, bool]:
    run = os.path.join(d, "run")
    out = {}
    if os.path.isdir(run):
        for name in sorted(os.listdir(run)):
            if name.endswith(".json") and UNIT_RE.fullmatch(name[:-5]):
                out[name[:-5]] = running(_load(os.path.join(run, name)))
    return out


def start(
    directory: str, unit: str, argv_fields: dict[str, Any], *, restart: bool = False, if_running: bool = False, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Start ``unit`` (or leave it running when it already runs this exact argv and
    ``restart`` is not asked). ``if_running``: only restart a unit that is running now."""
    import subprocess

    d = node_dir(directory)
    run, record_path, log_path = _paths(d, unit)
    argv = build_argv(d, unit, **argv_fields)
    current = _load(record_path)
    is_running = running(current)
    if if_running and not is_running:
        return {"unit": unit, "running": False, "started": False}
    if is_running and current is not None and current["argv"] == argv and not restart:
        return {**current, "running": True, "started": False}
    if is_running:
        stop(d, unit)
    ensure_dir(run, mode=0o700)
    if argv_fields.get("receipts"):
        ensure_dir(os.path.join(run, argv_fields["receipts"]), mode=0o700)
    env = dict(os.environ)
    env.pop("KVPACK_FAILPOINTS", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=d, env=env, start_new_session=True, close_fds=True)
    rec = {"unit": unit, "pid": proc.pid, "argv": argv, "started_unix_ms": time.time_ns() // 1_000_000, "log": log_path, "ready": None}
    atomic_write(record_path, json.dumps(rec, indent=2).encode() + b"\n", mode=0o600)  # stop can find it at once
    deadline = time.monotonic() + timeout_s
    while True:
        ready = _ready_line(log_path)
        if ready is not None:
            break
        if proc.poll() is not None:
            raise OnboardError("daemon", f"{unit} exited {proc.returncode} before it was ready: {_tail(log_path)}")
        if time.monotonic() > deadline:
            stop(d, unit)
            raise OnboardError("daemon", f"{unit} was not ready within {timeout_s:g} s: {_tail(log_path)}")
        time.sleep(0.1)
    rec["ready"] = ready
    atomic_write(record_path, json.dumps(rec, indent=2).encode() + b"\n", mode=0o600)
    return {**rec, "running": True, "started": True}


def stop(directory: str, unit: str, *, timeout_s: float = 60.0) -> dict[str, Any]:
    """SIGTERM the unit (SIGKILL after ``timeout_s``) if it is still the recorded process."""
    d = node_dir(directory)
    _, record_path, _ = _paths(d, unit)
    rec = _load(record_path)
    was_running = running(rec)
    if rec is not None and was_running:
        _signal(rec["pid"], signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while running(rec) and time.monotonic() < deadline:
            time.sleep(0.1)
        if running(rec):
            _signal(rec["pid"], signal.SIGKILL)
            kill_deadline = time.monotonic() + 10
            while running(rec) and time.monotonic() < kill_deadline:
                time.sleep(0.05)
    if rec is not None and not running(rec):
        durable_unlink(record_path)
    return {"unit": unit, "stopped": was_running, "running": running(rec)}


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _ready_line(log_path: str) -> dict[str, Any] | None:
    try:
        with open(log_path, "rb") as fh:
            data = fh.read(4 << 20)
    except OSError:
        return None
    for line in data.decode(errors="replace").splitlines():
        if not line.startswith("{") or '"ready"' not in line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("ready") is True:
            return obj
    return None


def _tail(log_path: str) -> str:
    try:
        with open(log_path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(log_path) - LOG_TAIL))
            return fh.read().decode(errors="replace").strip()
    except OSError as exc:
        return f"(no log: {exc})"
