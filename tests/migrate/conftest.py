"""Real daemons for the migration tests: an enrolled cluster, HTTPS decode nodes (uvicorn
subprocesses on 127.0.0.1) and a real OpenSSH sshd on a loopback port with its own config and
host key. Nothing here stands in for a component: nodes are ``kvpack decode-node-api``
processes, crashes are SIGKILL (failure points or the test's own kill), journals and sessions
are files on disk.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvpack.cli import main as kvpack_main
from kvpack.testing import lifeline

REPO = Path(__file__).resolve().parents[2]
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
# Small geometry keeps each node start fast; 8 KiB per token (4 layers x k,v x 4 heads x 64 x f32).
ENGINE = {"kind": "arrays", "layers": 4, "kv_heads": 4, "head_dim": 64, "vocab": 64}
API_KEY = "kvpack-test-api-key-0123456789abcdef"
IDENTITY = {
    "identity": {
        "adapter_sha256": "1" * 64,
        "chat_template_sha256": "2" * 64,
        "context_policy_sha256": "3" * 64,
        "model_sha256": "4" * 64,
        "tokenizer_sha256": "5" * 64,
        "model_revision": "m",
        "tokenizer_revision": "t",
    },
    "target_cache_identity_sha256": "6" * 64,
}
FINAL = {"completed", "ambiguous", "conflict", "destination_committed_source_retained", "source_restored", "source_restored_remote_retained"}


def free_port() -> int:
    from kvpack.testing.ports import free_port as below_ephemeral

    return below_ephemeral()


def tokens(n: int, seed: int = 1) -> list[int]:
    return [(i * 7 + seed * 13) % 64 for i in range(n)]


def write_secret(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text + "\n")
    return str(path)


class Node:
    """One decode node: config, home, and its ``kvpack decode-node-api`` process."""

    def __init__(
        self,
        root: Path,
        cluster: Path,
        name: str,
        *,
        tls: bool = True,
        peer_key: bool = True,
        ssh_identity: str | None = None,
        engine: dict | None = None,
        extra: dict | None = None,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.dir = root / f"node-{name}"
        self.dir.mkdir(parents=True)
        self.home = self.dir / "home"
        tls_dir = cluster / "nodes" / name / "tls"
        key = write_secret(self.dir / "api.key", API_KEY)
        cfg = {
            "node_name": name,
            "home": "home",
            "listen": f"127.0.0.1:{self.port}",
            "tls": {"certificate_chain": str(tls_dir / "node.crt"), "private_key": str(tls_dir / "node.key"), "ca": str(tls_dir / "ca.crt")} if tls else None,
            "api_key_file": "api.key",
            "cluster_dir": str(cluster),
            "engine": engine or ENGINE,
            "upload_chunk_bytes": 256 * 1024,
            "checkpoint_bytes": 1024 * 1024,
        }
        if peer_key:
            cfg["peer_api_key_file"] = key
            cfg["peer_ca"] = str(tls_dir / "ca.crt")
        if ssh_identity:
            cfg["ssh_identity_file"] = ssh_identity
        cfg.update(extra or {})
        self.config = str(self.dir / "node.json")
        Path(self.config).write_text(json.dumps(cfg, indent=2))
        self.ca = str(tls_dir / "ca.crt")
        self.tls = tls
        self.proc: subprocess.Popen | None = None
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._client: httpx.Client | None = None
        self.log = self.dir / "node.log"

    # -- process ---------------------------------------------------------------------------------------
    def start(self, failpoints: str = "", timeout: float = 60.0) -> "Node":
        env = dict(os.environ)
        env.pop("KVPACK_FAILPOINTS", None)
        if failpoints:
            env["KVPACK_FAILPOINTS"] = failpoints
        env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpack.cli", "decode-node-api", "--config", self.config], env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=str(self.dir)
        )
        logf.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"node {self.name} exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                if self.client.get("/openapi.json").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"node {self.name} did not come up: {self.log.read_text()[-3000:]}")

    def wait_dead(self, timeout: float = 60.0) -> int:
        """Wait for the node to die (a failure point SIGKILLed it); returns the exit status."""
        assert self.proc is not None
        rc = self.proc.wait(timeout)
        self.reset_client()
        return rc

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.reset_client()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.reset_client()

    def reset_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            import ssl

            verify = False
            if self.tls:
                verify = ssl.create_default_context(cafile=self.ca)
            self._client = httpx.Client(base_url=self.url, verify=verify, headers={"authorization": f"Bearer {API_KEY}"}, timeout=120.0, trust_env=False)
        return self._client

    # -- API helpers --------------------------------------------------------------------------------------
    def create(self, sid: str, n: int, seed: int = 1) -> dict:
        r = self.client.post(
            "/v1/sessions", json={"session_id": sid, "prompt_token_ids": tokens(n, seed), "messages": [{"role": "user", "content": f"prompt {sid}"}]}
        )
        assert r.status_code == 201, r.text
        return r.json()

    def info(self, sid: str) -> httpx.Response:
        return self.client.get(f"/v1/sessions/{sid}")

    def decode(self, sid: str, n: int) -> httpx.Response:
        return self.client.post(f"/v1/sessions/{sid}/decode", json={"tokens": n})

    def migrate(self, sid: str, destination: str, mode: str, tid: str, tier: str = "decode") -> httpx.Response:
        return self.client.post(f"/v1/sessions/{sid}/migrate", json={"destination": destination, "mode": mode, "tier": tier, "transfer_id": tid})

    def view(self, tid: str) -> dict:
        r = self.client.get(f"/v1/session-transfers/{tid}")
        assert r.status_code == 200, r.text
        return r.json()

    def wait_final(self, tid: str, timeout: float = 60.0, statuses=FINAL) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            v = self.view(tid)
            if v["status"] in statuses:
                return v
            if time.monotonic() > deadline:
                raise AssertionError(f"transfer {tid} stuck at {v}")
            time.sleep(0.05)

    def wait_restore(self, tid: str, timeout: float = 60.0) -> dict:
        """Wait until the restore run of ``tid`` has ended (its status alone starts out final)."""
        deadline = time.monotonic() + timeout
        while True:
            p = self.client.get(f"/v1/session-transfers/{tid}/progress").json()
            if p["phase"] != "restore-pending" and not p["running"] and p["status"] in FINAL:
                return self.view(tid)
            if time.monotonic() > deadline:
                raise AssertionError(f"restore {tid} stuck at {p} {self.journal(tid)}")
            time.sleep(0.05)

    def reconcile_cli(self, tid: str) -> tuple[int, dict]:
        """``kvpack transfer reconcile ID --json`` as a real subprocess."""
        env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("KVPACK_FAILPOINTS", None)
        p = subprocess.run(
            [sys.executable, "-m", "kvpack.cli", "transfer", "reconcile", tid, "--config", self.config, "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert p.stdout, p.stderr
        return p.returncode, json.loads(p.stdout)

    # -- disk ---------------------------------------------------------------------------------------------
    def journal(self, tid: str) -> dict | None:
        path = self.home / "session-transfers" / f"{tid}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def has_session(self, sid: str) -> bool:
        return (self.home / "sessions" / f"{sid}.bundle").exists()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Path:
    """An enrolled cluster: CA, decode nodes dec-a/dec-b/dec-c (receiver role), storage node st-a."""
    root = tmp_path_factory.mktemp("cluster")
    ident = root / "identity.json"
    ident.write_text(json.dumps(IDENTITY))
    cdir = root / "cluster"
    assert kvpack_main(["enroll", "init", str(cdir), "--identity", str(ident)]) == 0
    for name in ("dec-a", "dec-b", "dec-c"):
        assert kvpack_main(["enroll", "node", str(cdir), name, "--role", "receiver", "--listen", f"127.0.0.1:{free_port()}"]) == 0
    assert kvpack_main(["enroll", "node", str(cdir), "st-a", "--role", "storage"]) == 0
    return cdir


@pytest.fixture
def nodes(tmp_path, cluster):
    """Factory of nodes; every process started is stopped afterwards."""
    made: list[Node] = []

    def make(name: str, **kw) -> Node:
        n = Node(tmp_path, cluster, name, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.kill()


# -- sshd -------------------------------------------------------------------------------------------------


class Sshd:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.user = pwd.getpwuid(os.getuid()).pw_name
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "host_key")], check=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "client_key")], check=True)
        (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
        os.chmod(root / "authorized_keys", 0o600)
        self.lane = root / "lane dir 'quoted'"  # spaces and quotes: every path is shell-quoted
        self.lane.mkdir()
        self.config = root / "sshd_config"
        self.config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {root / 'host_key'}\nPidFile {root / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {root / 'authorized_keys'}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PubkeyAuthentication yes\nPermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
            f"AllowUsers {self.user}\nLogLevel ERROR\nMaxStartups 50\nMaxSessions 50\n"
            + (f"SetEnv {lifeline.setenv_words()}\n" if lifeline.setenv_words() else "")  # sessions a killed run leaves are swept
        )
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        os.makedirs("/run/sshd", exist_ok=True) if os.getuid() == 0 else None
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(self.config)], stdout=subprocess.DEVNULL, stderr=open(self.root / "sshd.log", "ab"), start_new_session=True
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.root / 'sshd.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    if s.recv(64).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("sshd did not come up")

    def stop(self) -> None:
        """Kill sshd and every session it spawned (its own process group)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory, cluster):
    if SSHD is None:
        pytest.skip("sshd (Debian openssh-server) is not installed and scripts/install.sh could not install it")
    root = tmp_path_factory.mktemp("sshd")
    d = Sshd(root)
    try:
        d.start()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"sshd cannot run here: {exc}")
    # enrollment records the address, user, pinned host key and lane dir of the storage node
    assert (
        kvpack_main(
            [
                "storage-node",
                "pin",
                str(cluster),
                "st-a",
                "--address",
                f"127.0.0.1:{d.port}",
                "--user",
                d.user,
                "--host-key-file",
                str(root / "host_key.pub"),
                "--lane-dir",
                str(d.lane),
            ]
        )
        == 0
    )
    yield d
    d.stop()


def remote_files(sshd: Sshd) -> dict[str, bytes]:
    d = sshd.lane / "session-bundles"
    return {p.name: p.read_bytes() for p in d.iterdir()} if d.exists() else {}
