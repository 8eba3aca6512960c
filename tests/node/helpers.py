"""Test helpers for the node daemons: enrolled clusters (listening on port 0), loopback TCP
proxies, daemon subprocesses. Everything listens on 127.0.0.1 only."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from kvpack.node.wire import identity_file_json
from kvpack.security.config import load_producer_config, load_receiver_config
from kvpack.security.enroll import Cluster


def edit_config(path: str, edit) -> None:
    """Rewrite one node config file in place (``edit`` mutates the parsed JSON object)."""
    with open(path, "rb") as fh:
        obj = json.loads(fh.read())
    edit(obj)
    tmp = f"{path}.edit"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


class Enrolled:
    """A cluster directory with receivers and producers enrolled for one engine identity.

    Every node config listens on ``127.0.0.1:0``: the daemons bind a free port themselves and
    report it (``data_port`` / ``control_port``), so no port is reserved here and released
    before a daemon binds it (another process could take it in between). Enrollment needs a
    real port, so the registry holds placeholders that nothing binds; a receiver's
    ``producer_control`` points at a placeholder (port 1..: refused at once) until
    :meth:`producer_listening` writes the port its producer reported."""

    def __init__(self, root: str, engine, receivers=("decode-a",), producers=("prefill-a",)) -> None:
        self.root = root
        self.receivers = tuple(receivers)
        self.producers = tuple(producers)
        self.cluster = Cluster.init(root, identity=identity_file_json(engine))
        placeholder = iter(range(1, 1 + len(self.receivers) + len(self.producers)))
        for name in self.receivers:
            self.cluster.enroll_node(name, "receiver", listen=f"127.0.0.1:{next(placeholder)}")
        for name in self.producers:
            self.cluster.enroll_node(name, "producer", control_listen=f"127.0.0.1:{next(placeholder)}")
        self.listen_on_port_zero()

    def listen_on_port_zero(self) -> None:
        """(Re)point every config's own listener at port 0 (again after a re-enrollment)."""
        for name in self.producers:
            edit_config(self.producer_config_path(name), lambda obj: obj.__setitem__("control_listen", "127.0.0.1:0"))
            for receiver in self.receivers:
                edit_config(self.receiver_config_path(receiver, name), lambda obj: obj.__setitem__("listen", "127.0.0.1:0"))

    def producer_listening(self, producer: str, port: int) -> int:
        """Point every receiver config of ``producer`` at the control port it reported (or at a
        proxy in front of it); returns ``port``."""
        for receiver in self.receivers:
            edit_config(self.receiver_config_path(receiver, producer), lambda obj: obj["producer_control"].__setitem__("address", f"127.0.0.1:{port}"))
        return port

    def receiver_config_path(self, receiver="decode-a", producer="prefill-a") -> str:
        return self.cluster.receiver_config_path(receiver, producer)

    def producer_config_path(self, producer="prefill-a") -> str:
        return self.cluster.producer_config_path(producer)

    def receiver_config(self, receiver="decode-a", producer="prefill-a"):
        return load_receiver_config(self.receiver_config_path(receiver, producer))

    def producer_config(self, producer="prefill-a"):
        return load_producer_config(self.producer_config_path(producer))

    def producer_config_without_identities(self, producer="prefill-a"):
        """The producer's config as written before enrollment recorded each receiver's
        identity: the producer then starts with any engine (and its receivers refuse its
        begins ``identity``), which the tests of the receiver's own check need."""

        def drop(obj) -> None:
            for entry in obj["receivers"]:
                entry.pop("identity", None)
                entry.pop("target_cache_identity_sha256", None)

        edit_config(self.producer_config_path(producer), drop)
        return self.producer_config(producer)


class Proxy:
    """A loopback TCP relay ``listen_port -> target_port`` that counts (and may tamper with)
    the bytes in each direction. ``flip_at``: flip one bit of the client->server byte at
    that offset (a corrupted segment on the wire)."""

    def __init__(self, target_port: int, *, flip_at: int | None = None) -> None:
        self.target_port = target_port
        self.flip_at = flip_at
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.up = 0  # client -> server bytes
        self.down = 0  # server -> client bytes
        self.flipped = False
        self.connections = 0
        self._stop = False
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            server = socket.create_connection(("127.0.0.1", self.target_port))
            t = threading.Thread(target=self._relay, args=(client, server), daemon=True)
            t.start()
            self._threads.append(t)

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        socks = [client, server]
        try:
            while True:
                r, _, _ = select.select(socks, [], [], 0.5)
                if self._stop:
                    return
                for s in r:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    if s is client:
                        if self.flip_at is not None and not self.flipped and self.up <= self.flip_at < self.up + len(data):
                            buf = bytearray(data)
                            buf[self.flip_at - self.up] ^= 0x01
                            data = bytes(buf)
                            self.flipped = True
                        self.up += len(data)
                        server.sendall(data)
                    else:
                        self.down += len(data)
                        client.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for t in self._threads:
            t.join(timeout=2)


LOOSE_LEDGER_GATE_MS = "5000"


class Daemon:
    """A ``kvpack receiver|producer`` subprocess; waits for its ready line."""

    def __init__(self, args: list[str], *, timeout: float = 240.0) -> None:
        import tempfile

        # stderr (JSON log lines) goes to a file: an undrained pipe would fill up and block
        # the daemon's logging threads
        if args and args[0] in ("receiver", "receive") and "--ledger-max-tail-ms" not in args:
            # The start-up volume probe (C.9) is tested on its own (tests/security/test_probe.py,
            # test_unsolicited's gate); a daemon test is about the node, and a shared CI host's
            # disk may stall past 100 ms while other tests load models.
            args = [*args, "--ledger-max-tail-ms", LOOSE_LEDGER_GATE_MS]
        self.stderr_file = tempfile.NamedTemporaryFile(prefix="kvpack-daemon-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpack.cli", *args], stdout=subprocess.PIPE, stderr=self.stderr_file, text=True)
        self.ready: dict | None = None
        self._timeout = timeout

    def stderr_text(self) -> str:
        with open(self.stderr_file.name, errors="replace") as fh:
            return fh.read()

    def wait_ready(self) -> dict:
        deadline = time.monotonic() + self._timeout
        while self.ready is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"daemon did not start: {self.stderr_text()[-3000:]}")
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                line = self.proc.stdout.readline()
                if line.startswith("{"):
                    self.ready = json.loads(line)
        return self.ready

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def producer_daemon(enrolled: Enrolled, args: list[str], name: str = "prefill-a", **kw) -> Daemon:
    """Start a ``kvpack producer`` daemon, wait for its ready line and point ``name``'s
    receiver configs at the control port it bound (start receivers after this)."""
    daemon = Daemon(["producer", "--config", enrolled.producer_config_path(name), *args], **kw)
    enrolled.producer_listening(name, daemon.wait_ready()["control_port"])
    return daemon


def receipts(directory: str) -> list[dict]:
    out = []
    if not os.path.isdir(directory):
        return out
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json") and not name.startswith("."):
            with open(os.path.join(directory, name), "rb") as fh:
                out.append(json.loads(fh.read()))
    return out


def http_get(port: int, path: str = "/metrics") -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace")
