"""A real remote node for the onboarding tests: OpenSSH sshd on a loopback port, logging in a
separate Unix user with its own home, and the wizard run as a real ``kvpack node add``
subprocess (so a failure point can SIGKILL it for real).

sshd must run as root to log in another user, and the user is created here (``useradd``),
so these tests skip when not root or when sshd is missing (scripts/install.sh installs it).
The node user runs this checkout's kvpack with the shared interpreter: sshd's ``SetEnv``
gives it ``PYTHONPATH``; if a directory above the interpreter is closed to other users
(pyenv under a 0700 /root), the fixture opens it for traversal only (``o+x``, never read)
for the session and restores the mode afterwards when no other session still needs it.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvpack.testing import lifeline

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
NODE_USER = "kvpack-onb"
REMOTE_KVPACK = f"{sys.executable} -m kvpack.cli"
TRAVERSE_STATE = Path("/tmp/kvpack-onboard-traverse.json")
TRAVERSE_LOCK = Path("/tmp/kvpack-onboard-traverse.lock")


def free_port() -> int:
    from kvpack.testing.ports import free_port as below_ephemeral

    return below_ephemeral()


def kvpack_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("KVPACK_FAILPOINTS", None)
    env.pop("KVPACK_SSH", None)
    env.update(extra)
    return env


# -- the node user ---------------------------------------------------------------------------------


def _ensure_user() -> pwd.struct_passwd:
    try:
        pw = pwd.getpwnam(NODE_USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", NODE_USER], check=True, capture_output=True)
        pw = pwd.getpwnam(NODE_USER)
    # UsePAM=no sshd refuses a locked account ("!" password): "*" is "no password", not locked
    subprocess.run(["usermod", "-p", "*", NODE_USER], check=True, capture_output=True)
    return pw


def _as_user_can_run(pw: pwd.struct_passwd) -> bool:
    try:
        probe = _run_as(pw)
    except PermissionError:
        return False  # exec itself was refused: a directory above the interpreter is closed
    return probe.returncode == 0


def _run_as(pw: pwd.struct_passwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import kvpack.cli"],
        user=pw.pw_uid,
        group=pw.pw_gid,
        extra_groups=[],
        env={"PYTHONPATH": str(SRC), "HOME": pw.pw_dir, "PATH": "/usr/bin:/bin"},
        cwd=pw.pw_dir,
        capture_output=True,
        timeout=120,
    )


class Traverse:
    """Grant o+x on the closed ancestors of the interpreter and the repo for this session."""

    def __init__(self) -> None:
        self.fd = os.open(TRAVERSE_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_SH)

    def grant(self) -> None:
        with _exclusive_state():
            state = json.loads(TRAVERSE_STATE.read_text()) if TRAVERSE_STATE.exists() else {}
            for base in (Path(sys.executable).resolve(), SRC.resolve(), Path(sys.prefix).resolve()):
                for d in [*reversed(base.parents)]:
                    mode = os.stat(d).st_mode & 0o7777
                    if not mode & 0o001:
                        state.setdefault(str(d), mode)
                        os.chmod(d, mode | 0o001)
            TRAVERSE_STATE.write_text(json.dumps(state))

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other session holds it
        except OSError:
            os.close(self.fd)
            return
        with _exclusive_state():
            if TRAVERSE_STATE.exists():
                for d, mode in json.loads(TRAVERSE_STATE.read_text()).items():
                    os.chmod(d, mode)
                TRAVERSE_STATE.unlink()
        os.close(self.fd)


class _exclusive_state:
    def __enter__(self):
        self.fd = os.open(str(TRAVERSE_STATE) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        os.close(self.fd)


# -- sshd ------------------------------------------------------------------------------------------


@dataclass
class Remote:
    """The remote host: sshd on 127.0.0.1:port logging in NODE_USER."""

    root: Path
    pw: pwd.struct_passwd
    port: int
    known_hosts: Path
    client_key: Path
    host_pub: str
    base: Path  # node directories of this session live below it (in the node user's home)
    proc: subprocess.Popen | None = None
    extra: dict = field(default_factory=dict)

    @property
    def destination(self) -> str:
        return f"{NODE_USER}@127.0.0.1"

    def node_dir(self, name: str) -> str:
        return str(self.base / name)

    def stop_units(self) -> None:
        """Kill every daemon unit a test left running on the node (their own sessions)."""
        for run in self.base.glob("*/run/*.json"):
            try:
                rec = json.loads(run.read_text())
                os.kill(int(rec["pid"]), signal.SIGKILL)
            except (OSError, ValueError, KeyError):
                pass


def _write_sshd_config(root: Path, port: int, pw: pwd.struct_passwd, authorized: Path) -> Path:
    config = root / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {root / 'host_key'}\nPidFile {root / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {authorized}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PubkeyAuthentication yes\nPermitRootLogin no\nStrictModes no\nUsePAM no\n"
        f"AllowUsers {NODE_USER}\nLogLevel ERROR\nMaxStartups 50\nMaxSessions 50\n"
        f"SetEnv PYTHONPATH={SRC} {lifeline.setenv_words()}\n"  # the marker: units left by a killed run are swept
    )
    return config


@pytest.fixture(scope="session")
def remote(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("onboarding tests need root: sshd must log in a separate Unix user, created here with useradd")
    if SSHD is None:
        pytest.skip("sshd (Debian openssh-server) is not installed; scripts/install.sh installs it")
    pw = _ensure_user()
    traverse = Traverse()
    if not _as_user_can_run(pw):
        traverse.grant()
        if not _as_user_can_run(pw):
            traverse.release()
            pytest.skip(f"user {NODE_USER} cannot run {sys.executable} with this checkout")
    root = tmp_path_factory.mktemp("sshd")
    port = free_port()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "host_key")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "client_key")], check=True)
    ssh_dir = Path(pw.pw_dir) / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    authorized = ssh_dir / f"authorized_keys.{port}"
    authorized.write_text((root / "client_key.pub").read_text())
    base = Path(pw.pw_dir) / f"onb-{secrets.token_hex(4)}"
    base.mkdir(mode=0o700)
    for p in (ssh_dir, authorized, base):
        os.chown(p, pw.pw_uid, pw.pw_gid)
    host_pub = " ".join((root / "host_key.pub").read_text().split()[:2])
    known = root / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {host_pub}\n")
    config = _write_sshd_config(root, port, pw, authorized)
    os.makedirs("/run/sshd", exist_ok=True)
    log = open(root / "sshd.log", "ab")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    r = Remote(root, pw, port, known, root / "client_key", host_pub, base, proc)
    try:
        _wait_ssh(port, proc, root)
        yield r
    finally:
        r.stop_units()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)
        authorized.unlink(missing_ok=True)
        traverse.release()


def _wait_ssh(port: int, proc: subprocess.Popen, root: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.skip(f"sshd cannot run here: {(root / 'sshd.log').read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.05)
    pytest.skip("sshd did not come up")


# -- the wizard as a subprocess --------------------------------------------------------------------


@dataclass
class Run:
    rc: int
    out: str
    err: str

    @property
    def record(self) -> dict:
        return json.loads(self.out.strip().splitlines()[-1])


def node_add(
    remote: Remote, cluster: Path, name: str, role: str, *extra: str, failpoint: str = "", ssh_wrapper: str | None = None, timeout: float = 3600
) -> Run:
    """``kvpack node add`` as a real process against the loopback sshd."""
    argv = [sys.executable, "-m", "kvpack.cli", "node", "add", remote.destination, "--cluster", str(cluster), "--role", role, "--name", name]
    argv += ["--ssh-port", str(remote.port), "--known-hosts", str(remote.known_hosts), "--ssh-key", str(remote.client_key)]
    argv += ["--node-dir", remote.node_dir(name), "--remote-kvpack", REMOTE_KVPACK, "--json", *extra]
    env = kvpack_env()
    if failpoint:
        env["KVPACK_FAILPOINTS"] = f"{failpoint}=kill"
    if ssh_wrapper:
        env["KVPACK_SSH"] = ssh_wrapper
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    return Run(p.returncode, p.stdout, p.stderr)


def kvpack(*args: str, timeout: float = 600) -> Run:
    p = subprocess.run([sys.executable, "-m", "kvpack.cli", *args], capture_output=True, text=True, env=kvpack_env(), timeout=timeout)
    return Run(p.returncode, p.stdout, p.stderr)


def record(cluster: Path, name: str) -> dict:
    return json.loads((cluster / "onboard" / name / "state.json").read_text())


def stop_local_units(cluster: Path) -> None:
    """Kill daemon units the tests started on admin-side (offline) nodes."""
    for run in cluster.glob("nodes/*/run/*.json"):
        try:
            os.kill(int(json.loads(run.read_text())["pid"]), signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass


def recording_ssh(directory: Path) -> str:
    """An ssh wrapper that keeps every byte of each session's stdin and stdout."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "ssh-record"
    script.write_text(
        "#!/bin/bash\n"
        f"d={directory}; n=$(date +%s%N)-$$\n"
        'printf "%s\\n" "$@" > "$d/$n.argv"\n'
        'tee "$d/$n.in" | ssh "$@" | tee "$d/$n.out"\n'
        "exit ${PIPESTATUS[1]}\n"
    )
    script.chmod(0o755)
    return str(script)
