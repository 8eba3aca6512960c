"""Storage tier: an enrolled storage node reached over OpenSSH with a pinned host key.

The destination is not a peer running the transfer protocol but a filesystem, so every remote
step is a fixed ("pinned") POSIX-sh fragment defined in this module, with every variable
passed through :func:`shlex.quote`, and every step is safe to re-run:

* ``prepare``: ``mkdir -p`` the bundle directory, ``chmod 700``, ``sync`` it and its parent;
* ``lookup``: committed (final file verified) / partial temp file with its *synced* size /
  prepared / absent: the reconciliation lookup and the resume offset;
* ``upload``: truncate the temp file to the resume offset (refusing if it holds fewer bytes),
  append stdin, ``sync`` the file;
* ``commit``: if the final file exists, re-verify its byte count and SHA-256 and exit clean
  (idempotent re-run); otherwise verify the temp file, ``sync`` it, ``mv`` it to the final name,
  ``sync`` the file and the directory;
* ``delete``: remove final and temp files and ``sync`` the directory;
* ``fetch``: ``cat`` the final file (the source re-checks size and SHA-256 locally).

Files: ``<lane_dir>/session-bundles/<id>.bundle`` (final) and ``.<id>.tmp`` (upload). The host
key is pinned at enrollment (``cluster.json`` node entry ``ssh``: address, user, the OpenSSH
public key line and its ``SHA256:`` fingerprint, lane dir); ssh runs with ``-F /dev/null``,
``StrictHostKeyChecking=yes``, a known-hosts file holding only that key under a per-node
alias, ``BatchMode``, ``IdentitiesOnly`` and no agent.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from ..durable import atomic_write, ensure_dir
from ..errors import MigrationError
from . import failpoints
from . import machine as M

BUNDLE_SUBDIR = "session-bundles"
SSH = "ssh"

# -- the pinned remote fragments -----------------------------------------------------------------------

PREPARE = """set -eu
umask 077
d={dir}
mkdir -p -- "$d"
chmod 700 -- "$d"
sync -- "$d"
sync -- "$(dirname -- "$d")"
echo prepared"""

LOOKUP = """set -eu
d={dir}; t={tmp}; f={final}; n={bytes}; h={sha}
if [ -f "$f" ]; then
  if [ "$(stat -c %s -- "$f")" = "$n" ] && [ "$(sha256sum -- "$f" | cut -d' ' -f1)" = "$h" ]; then echo committed; else echo mismatch; fi
elif [ -f "$t" ]; then sync -- "$t"; echo "partial $(stat -c %s -- "$t")"
elif [ -d "$d" ]; then echo "prepared 0"
else echo absent; fi"""

UPLOAD = """set -eu
umask 077
t={tmp}; o={offset}
s=$(stat -c %s -- "$t" 2>/dev/null || echo 0)
[ "$s" -ge "$o" ] || {{ echo "temp file holds $s bytes, below the resume offset $o" >&2; exit 3; }}
truncate -s "$o" -- "$t"
cat >> "$t"
sync -- "$t"
stat -c %s -- "$t"
"""

COMMIT_STEPS = (
    "set -eu",
    "d={dir}; t={tmp}; f={final}; n={bytes}; h={sha}",
    """check() {{ [ "$(stat -c %s -- "$1")" = "$n" ] && [ "$(sha256sum -- "$1" | cut -d' ' -f1)" = "$h" ]; }}""",
    """if [ -f "$f" ]; then check "$f" || {{ echo "final file exists with other bytes" >&2; exit 4; }}; sync -- "$f"; sync -- "$d"; rm -f -- "$t"; sync -- "$d"; echo committed; exit 0; fi""",
    """[ -f "$t" ] || {{ echo "no uploaded temp file" >&2; exit 6; }}""",
    """check "$t" || {{ echo "uploaded bytes differ in size or SHA-256" >&2; exit 5; }}""",
    'sync -- "$t"',
    'mv -f -- "$t" "$f"',
    'sync -- "$f"',
    'sync -- "$d"',
    "echo committed",
)
COMMIT = "\n".join(COMMIT_STEPS)

DELETE = """set -eu
d={dir}; t={tmp}; f={final}
rm -f -- "$f" "$t"
if [ -d "$d" ]; then sync -- "$d"; fi
echo deleted"""

FETCH = """set -eu
cat -- {final}"""

_KEY_RE = re.compile(r"^(ssh-ed25519|ecdsa-sha2-nistp256|ecdsa-sha2-nistp384|ecdsa-sha2-nistp521|ssh-rsa) ([A-Za-z0-9+/]+={0,3})$")


def host_key_fingerprint(line: str) -> str:
    """OpenSSH ``SHA256:`` fingerprint of a public key line (``type base64 [comment]``)."""
    parts = line.strip().split()
    if len(parts) < 2 or not _KEY_RE.fullmatch(" ".join(parts[:2])):
        raise MigrationError("usage", "host key must be an OpenSSH public key line (type base64)")
    blob = base64.b64decode(parts[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


@dataclass(frozen=True)
class StorageNode:
    name: str
    host: str
    port: int
    user: str
    host_key: str  # "type base64"
    host_key_sha256: str
    lane_dir: str

    @property
    def bundle_dir(self) -> str:
        return os.path.join(self.lane_dir, BUNDLE_SUBDIR)

    def final(self, tid: str) -> str:
        return os.path.join(self.bundle_dir, f"{tid}.bundle")

    def tmp(self, tid: str) -> str:
        return os.path.join(self.bundle_dir, f".{tid}.tmp")


def load_storage_node(cluster_dir: str | None, name: str) -> StorageNode:
    """The enrolled storage node ``name`` and its SSH pin, from the cluster registry."""
    from ..errors import SecurityError
    from ..security.enroll import NAME_RE, Cluster

    if not NAME_RE.fullmatch(name or ""):
        raise MigrationError("usage", f"storage node name {name!r} is not a valid node name")
    if not cluster_dir:
        raise MigrationError("usage", "no cluster_dir configured: storage nodes are unknown")
    try:
        entry = Cluster.open(cluster_dir).registry["nodes"].get(name)
    except SecurityError as exc:
        raise MigrationError("usage", f"cluster registry: {exc.message}") from None
    if entry is None:
        raise MigrationError("not_found", f"storage node {name!r} is not enrolled")
    if entry.get("role") != "storage":
        raise MigrationError("usage", f"node {name!r} is enrolled as {entry.get('role')}, not storage")
    ssh = entry.get("ssh")
    if not isinstance(ssh, dict):
        raise MigrationError("usage", f"storage node {name!r} has no pinned SSH host key (kvpack storage-node pin)")
    host, _, port = ssh["address"].rpartition(":")
    node = StorageNode(name, host.strip("[]"), int(port), ssh["user"], ssh["host_key"], ssh["host_key_sha256"], ssh["lane_dir"])
    if host_key_fingerprint(node.host_key) != node.host_key_sha256:
        raise MigrationError("integrity", f"storage node {name!r}: recorded host key does not match its pin")
    return node


class StorageDestination:
    """The destination interface of :mod:`.transfer` for one enrolled storage node."""

    def __init__(self, node: StorageNode, identity_file: str | None, workdir: str, *, chunk_bytes: int = 1024 * 1024, timeout: float = 120.0) -> None:
        if not identity_file:
            raise MigrationError("usage", "no ssh_identity_file configured for the storage tier")
        self.node = node
        self.identity_file = identity_file
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self.alias = f"kvpack-storage-{node.name}"
        ensure_dir(workdir, mode=0o700)
        self.known_hosts = os.path.join(workdir, f"known_hosts.{node.name}")
        # Only the pinned key, under an alias: no other key and no other host can satisfy ssh.
        atomic_write(self.known_hosts, f"{self.alias} {node.host_key}\n".encode(), mode=0o600)

    def argv(self, script: str) -> list[str]:
        n = self.node
        return [
            SSH,
            "-F",
            "/dev/null",
            "-T",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            f"HostKeyAlias={self.alias}",
            "-o",
            "CheckHostIP=no",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "IdentityAgent=none",
            "-o",
            "PasswordAuthentication=no",
            "-o",
            "KbdInteractiveAuthentication=no",
            "-o",
            "ConnectTimeout=10",
            "-o",
            "ServerAliveInterval=5",
            "-o",
            "ServerAliveCountMax=3",
            "-i",
            self.identity_file,
            "-p",
            str(n.port),
            "-l",
            n.user,
            n.host,
            "--",
            "sh -c " + shlex.quote(script),
        ]

    def vars(self, rec: M.TransferRecord, **extra: Any) -> dict[str, str]:
        tid = rec.id
        out = {
            "dir": shlex.quote(self.node.bundle_dir),
            "tmp": shlex.quote(self.node.tmp(tid)),
            "final": shlex.quote(self.node.final(tid)),
            "bytes": shlex.quote(str(int(rec.bytes))),
            "sha": shlex.quote(str(rec.sha256)),
        }
        out.update({k: shlex.quote(str(v)) for k, v in extra.items()})
        return out

    def run(self, script: str, *, stdin: bytes | None = None, what: str = "ssh") -> bytes:
        try:
            proc = subprocess.run(self.argv(script), input=stdin, capture_output=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise MigrationError("transport", f"{what}: ssh timed out") from None
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            raise MigrationError("transport", f"{what}: ssh exit {proc.returncode}: {err[-1] if err else ''}")
        return proc.stdout

    # -- destination interface ------------------------------------------------------------------------
    def lookup(self, rec: M.TransferRecord) -> tuple[Optional[M.Status], int]:
        out = self.run(LOOKUP.format(**self.vars(rec)), what="lookup").decode().strip()
        if out == "committed":
            return M.COMMITTED, int(rec.bytes)
        if out == "mismatch":
            raise MigrationError("integrity", f"storage node holds {rec.id} with other bytes")
        if out == "absent":
            return None, 0
        word, _, num = out.partition(" ")
        if word in ("partial", "prepared") and num.isdigit():
            size = int(num)
            if size == rec.bytes:
                return M.UPLOADED, size
            return M.PREPARED, size if size < rec.bytes else 0
        raise MigrationError("transport", f"lookup: unexpected reply {out!r}")

    def prepare(self, rec: M.TransferRecord, identity: Optional[dict[str, Optional[str]]] = None) -> M.Status:
        self.run(PREPARE.format(**self.vars(rec)), what="prepare")
        return M.PREPARED

    def upload(self, rec: M.TransferRecord, path: str, offset: int, progress: Optional[Callable[[int], None]] = None) -> None:
        kill_at = failpoints.byte_threshold("source.upload")
        proc = subprocess.Popen(
            self.argv(UPLOAD.format(**self.vars(rec, offset=offset))), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None  # all three are PIPEs
        sent = offset
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                while True:
                    block = fh.read(self.chunk_bytes)
                    if not block:
                        break
                    proc.stdin.write(block)
                    proc.stdin.flush()
                    sent += len(block)
                    if progress:
                        progress(sent)
                    if kill_at is not None and sent >= kill_at:
                        failpoints.die()
        except BrokenPipeError:
            pass  # the remote side ended early; its exit status below says why
        finally:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise MigrationError("transport", "upload: ssh timed out") from None
        out, err = proc.stdout.read(), proc.stderr.read()
        if proc.returncode != 0:
            raise MigrationError("transport", f"upload: ssh exit {proc.returncode}: {err.decode(errors='replace').strip()[-200:]}")
        if out.decode().strip() != str(rec.bytes):
            raise MigrationError("transport", f"upload: remote temp file holds {out.decode().strip()} bytes, expected {rec.bytes}")

    def commit(self, rec: M.TransferRecord) -> M.Status:
        script = COMMIT
        cut = failpoints.action("storage.commit_interrupt")
        if cut is not None:
            # matrix row: the remote shell dies by SIGKILL after the first K pinned steps
            script = "\n".join((*COMMIT_STEPS[: int(cut)], "kill -KILL $$"))
        out = self.run(script.format(**self.vars(rec)), what="commit").decode().strip()
        failpoints.hit("source.after_remote_commit")
        if out.splitlines()[-1:] != ["committed"]:
            raise MigrationError("transport", f"commit: unexpected reply {out!r}")
        return M.COMMITTED

    def delete(self, rec: M.TransferRecord) -> None:
        self.run(DELETE.format(**self.vars(rec)), what="delete")

    def fetch(self, rec: M.TransferRecord) -> bytes:
        data = self.run(FETCH.format(**self.vars(rec)), what="fetch")
        if len(data) != rec.bytes or hashlib.sha256(data).hexdigest() != rec.sha256:
            raise MigrationError("integrity", "fetched bundle differs in size or SHA-256 from the record")
        return data

    def close(self) -> None:
        pass
