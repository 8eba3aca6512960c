"""The OpenSSH client leg of onboarding: a pinned host key, no prompts, bounded output.

Every command reaches the node as one fixed argv joined with :func:`shlex.join`, so each
value is quoted for the remote shell and nothing the admin passes can become shell syntax.
ssh runs with ``-F /dev/null`` (no user config can loosen it), ``BatchMode=yes`` (a missing
key or unknown host fails instead of prompting), ``StrictHostKeyChecking=yes`` against a
known-hosts file that holds only the node's pinned key(s) under a per-node alias, no
password or keyboard-interactive authentication, no forwarding, and connect and keep-alive
deadlines; every call also has a wall-clock deadline.

The pin comes from an operator-supplied known-hosts file (``--known-hosts``, default
``~/.ssh/known_hosts``), looked up with ``ssh-keygen -F`` (hashed entries and
``[host]:port`` forms included). There is no trust on first use: a host without an entry is
refused, and so is a host presenting any other key.

``KVPACK_SSH`` names another ssh binary (tests use a recording wrapper to prove what
crossed the wire). This module never interprets what the remote command printed beyond
its exit status and size.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import selectors
import shlex
import subprocess
import time
from dataclasses import dataclass

from ..durable import atomic_write
from ..errors import OnboardError

_KEY_LINE = re.compile(r"^(ssh-ed25519|ecdsa-sha2-nistp256|ecdsa-sha2-nistp384|ecdsa-sha2-nistp521|ssh-rsa|rsa-sha2-256|rsa-sha2-512) ([A-Za-z0-9+/]+={0,3})$")
_USER = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")
_HOST = re.compile(r"^[A-Za-z0-9.:-]{1,253}$")
DEFAULT_OUTPUT_LIMIT = 16 << 20
STDERR_LIMIT = 64 << 10


def parse_destination(text: str) -> tuple[str, str]:
    """``USER@HOST`` -> (user, host); both checked (no options, no shell syntax)."""
    user, sep, host = text.rpartition("@")
    host = host.strip("[]")
    if not sep or not _USER.fullmatch(user) or not _HOST.fullmatch(host) or host.startswith("-"):
        raise OnboardError("usage", f"destination {text!r} must be USER@HOST (a login name and a host name or IP)")
    return user, host


def fingerprint(key_line: str) -> str:
    """OpenSSH ``SHA256:`` fingerprint of ``type base64``."""
    blob = base64.b64decode(key_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def lookup_host_keys(known_hosts: str, host: str, port: int) -> list[str]:
    """The ``type base64`` key lines ``known_hosts`` holds for ``host`` (on ``port``)."""
    if not os.path.isfile(known_hosts):
        raise OnboardError("host_key", f"known-hosts file {known_hosts!r} does not exist: pass --known-hosts FILE with the node's host key")
    name = host if port == 22 else f"[{host}]:{port}"
    try:
        proc = subprocess.run(["ssh-keygen", "-F", name, "-f", known_hosts], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OnboardError("host_key", f"ssh-keygen -F failed: {exc}") from None
    keys = []
    for line in proc.stdout.decode(errors="replace").splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if parts and parts[0].startswith("@"):
            continue  # @cert-authority / @revoked markers are not pins
        if len(parts) >= 3 and _KEY_LINE.fullmatch(f"{parts[1]} {parts[2]}"):
            keys.append(f"{parts[1]} {parts[2]}")
    if not keys:
        raise OnboardError(
            "host_key", f"{known_hosts} holds no host key for {name}: no trust on first use; add the node's key (ssh-keyscan, checked out of band)"
        )
    return list(dict.fromkeys(keys))


@dataclass(frozen=True)
class SshTarget:
    """How to reach one node: login, address, the pinned host keys and the client key."""

    alias: str
    user: str
    host: str
    port: int
    host_keys: tuple[str, ...]
    known_hosts_file: str  # written by :meth:`write_known_hosts`: only the pinned keys
    identity_file: str | None = None
    connect_timeout_s: int = 10

    def write_known_hosts(self) -> None:
        for key in self.host_keys:
            if not _KEY_LINE.fullmatch(key):
                raise OnboardError("host_key", f"pinned host key {key[:40]!r}... is not an OpenSSH public key line")
        body = "".join(f"{self.alias} {k}\n" for k in self.host_keys)
        atomic_write(self.known_hosts_file, body.encode(), mode=0o600)

    def argv(self, remote_command: str) -> list[str]:
        opts = {
            "BatchMode": "yes",
            "StrictHostKeyChecking": "yes",
            "UserKnownHostsFile": self.known_hosts_file,
            "GlobalKnownHostsFile": "/dev/null",
            "HostKeyAlias": self.alias,
            "CheckHostIP": "no",
            "UpdateHostKeys": "no",
            "PasswordAuthentication": "no",
            "KbdInteractiveAuthentication": "no",
            "ForwardAgent": "no",
            "ForwardX11": "no",
            "ClearAllForwardings": "yes",
            "ConnectTimeout": str(self.connect_timeout_s),
            "ServerAliveInterval": "10",
            "ServerAliveCountMax": "6",
            "LogLevel": "ERROR",
        }
        if self.identity_file:
            opts.update(IdentitiesOnly="yes", IdentityAgent="none")
        argv = [os.environ.get("KVPACK_SSH") or "ssh", "-F", "/dev/null", "-T"]
        for key, value in opts.items():
            argv += ["-o", f"{key}={value}"]
        if self.identity_file:
            argv += ["-i", self.identity_file]
        return argv + ["-p", str(self.port), "-l", self.user, self.host, "--", remote_command]

    def run(self, argv: list[str], *, stdin: bytes | None = None, timeout_s: float, output_limit: int = DEFAULT_OUTPUT_LIMIT) -> "Completed":
        """Run the fixed remote ``argv`` (joined and quoted); map ssh's own failures
        (exit 255: unreachable, host key, authentication) to typed refusals."""
        done = run_bounded(self.argv(shlex.join(argv)), stdin=stdin, timeout_s=timeout_s, output_limit=output_limit)
        if done.returncode == 255:
            err = done.stderr.decode(errors="replace")
            if "Host key verification failed" in err or "HOST IDENTIFICATION HAS CHANGED" in err or "host key" in err.lower():
                raise OnboardError("host_key", f"{self.user}@{self.host}:{self.port}: the node's host key is not the pinned one ({_last_line(err)})")
            raise OnboardError("ssh", f"{self.user}@{self.host}:{self.port}: ssh failed: {_last_line(err)}")
        return done


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: bytes
    stderr: bytes


def _last_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return lines[-1][:500] if lines else "no message"


def run_bounded(
    argv: list[str],
    *,
    stdin: bytes | None,
    timeout_s: float,
    output_limit: int = DEFAULT_OUTPUT_LIMIT,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
) -> Completed:
    """Run ``argv`` with a wall-clock deadline, reading at most ``output_limit`` bytes of
    stdout and :data:`STDERR_LIMIT` of stderr (a node that floods us is killed and refused)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env)
    deadline = time.monotonic() + timeout_s
    out, err = bytearray(), bytearray()
    pending = memoryview(stdin or b"")
    sel = selectors.DefaultSelector()
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    if pending.nbytes:
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                proc.wait()
                raise OnboardError("ssh", f"{os.path.basename(argv[0])}: no answer within {timeout_s:g} s")
            for key, _ in sel.select(min(left, 1.0)):
                if key.fileobj is proc.stdin:
                    try:
                        n = os.write(proc.stdin.fileno(), pending[:65536])
                    except BrokenPipeError:
                        n = pending.nbytes
                    pending = pending[n:]
                    if not pending.nbytes:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fileobj.fileno(), 65536)  # type: ignore[union-attr]
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf, limit = (out, output_limit) if key.fileobj is proc.stdout else (err, STDERR_LIMIT)
                if len(buf) + len(chunk) > limit:
                    if buf is err:
                        continue  # keep the head of stderr; it is only a message
                    proc.kill()
                    proc.wait()
                    raise OnboardError("ssh", f"{os.path.basename(argv[0])}: output exceeds {limit} bytes")
                buf += chunk
        rc = proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise OnboardError("ssh", f"{os.path.basename(argv[0])}: did not exit within {timeout_s:g} s") from None
    finally:
        sel.close()
    return Completed(rc, bytes(out), bytes(err))
