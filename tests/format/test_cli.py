"""The object tools as a user runs them: ``kvpack fixture`` checked with plain ``sha256sum``,
``kvpack inspect`` and ``kvpack verify`` with their exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

KVPACK = [sys.executable, "-m", "kvpack.cli"]


def run(*args, check=False):
    return subprocess.run([*KVPACK, *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixture")
    result = run("fixture", str(out))
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture
def root_key(tmp_path):
    path = tmp_path / "root.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, bytes([99]) * 32)
    os.close(fd)
    return path


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="coreutils sha256sum not installed")
def test_fixture_output_matches_vectors_under_plain_sha256sum(fixture_dir, conformance_dir):
    lines = []
    for line in (conformance_dir / "production_v1.sha256").read_text().splitlines():
        if line.startswith("#"):
            continue
        suite, name, size, digest = line.split("\t")
        lines.append(f"{digest}  {suite}/{name}")
    check = fixture_dir / "check.sha256"
    check.write_text("\n".join(lines) + "\n")
    result = subprocess.run(["sha256sum", "--check", "--strict", "--quiet", str(check)], cwd=fixture_dir, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(lines) == 520


def test_inspect_plain_pack_json(fixture_dir):
    result = run("inspect", str(fixture_dir / "fixture/raw/plain/plain/pack"), "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["kind"] == "pack" and info["key_epoch"] == 7 and not info["encrypted"]
    assert info["manifest"]["token_count"] == 4
    assert info["manifest"]["chunks"][0]["plaintext_bytes"] == 16
    assert info["verified"] is False


def test_inspect_encrypted_pack_needs_key_for_manifest(fixture_dir, root_key):
    pack = str(fixture_dir / "fixture/lossless/encrypted/encrypted/pack")
    info = json.loads(run("inspect", pack, "--json").stdout)
    assert info["encrypted"] and "manifest" not in info
    info = json.loads(run("inspect", pack, "--json", "--root-key-file", str(root_key)).stdout)
    assert info["verified"] and info["manifest"]["family"]["states"][0]["codec"] == "lossless"


@pytest.mark.parametrize("name", ["chunk", "family", "schema", "manifest", "state_declaration", "lossless_frame"])
def test_inspect_other_objects(fixture_dir, name):
    result = run("inspect", str(fixture_dir / "fixture/raw/encrypted/plain" / name), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kind"] == name


def test_verify_pack_and_chunk_ok(fixture_dir, root_key):
    suite = fixture_dir / "fixture/lossless/encrypted/encrypted"
    for args in (["verify", str(suite / "pack")], ["verify", str(suite / "chunk")], ["verify", str(suite / "chunk"), "--pack", str(suite / "pack")]):
        result = run(*args, "--root-key-file", str(root_key))
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.startswith("ok")


def test_verify_refuses_damage_with_category(fixture_dir, root_key, tmp_path):
    data = bytearray((fixture_dir / "fixture/raw/plain/encrypted/pack").read_bytes())
    data[5000] ^= 1
    bad = tmp_path / "bad.pack"
    bad.write_bytes(bytes(data))
    result = run("verify", str(bad), "--root-key-file", str(root_key))
    assert result.returncode == 1
    assert result.stderr.startswith("kvpack: authentication:") and result.stdout == ""
    chunk = bytearray((fixture_dir / "fixture/raw/plain/plain/chunk").read_bytes())
    chunk[4096 + 20] ^= 1  # payload byte: only the ref binding (object digest) can see it
    bad_chunk = tmp_path / "bad.chunk"
    bad_chunk.write_bytes(bytes(chunk))
    result = run("verify", str(bad_chunk), "--root-key-file", str(root_key), "--pack", str(fixture_dir / "fixture/raw/plain/plain/pack"))
    assert result.returncode == 1 and result.stderr.startswith("kvpack: authentication:")


def test_verify_wrong_root_is_refused(fixture_dir, tmp_path):
    key = tmp_path / "other.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, (bytes([98]) * 32).hex().encode() + b"\n")
    os.close(fd)
    result = run("verify", str(fixture_dir / "fixture/raw/plain/plain/pack"), "--root-key-file", str(key))
    assert result.returncode == 1 and result.stderr.startswith("kvpack: authentication:")


def test_verify_usage_errors_exit_2(fixture_dir, tmp_path):
    assert run("verify", str(fixture_dir / "fixture/raw/plain/plain/pack")).returncode == 2  # no key
    loose = tmp_path / "loose.key"
    loose.write_bytes(bytes(32))
    os.chmod(loose, 0o644)  # group/other readable: the key file contract refuses it
    result = run("verify", str(fixture_dir / "fixture/raw/plain/plain/pack"), "--root-key-file", str(loose))
    assert result.returncode == 2 and "root key file" in result.stderr
    assert run("verify", str(tmp_path / "missing"), "--root-key-file", str(loose)).returncode == 2
