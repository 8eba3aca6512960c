"""``kvpack verdict``, ``kvpack transcode`` and ``kvpack fixture --json-lines`` as a user runs
them: exit codes, what is printed, and that a refusal emits nothing. Expected categories and
digests come from the shared conformance files, read at test time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvpack.format.constants import MAX_CHUNK_OBJECT_BYTES
from kvpack.format.fixtures import EPOCH, ROOT, TENANT, fixture_keys, reference_fixture
from kvpack.format.pack import decode_pack

KVPACK = [sys.executable, "-m", "kvpack.cli"]


def run(*args, stdin: bytes | None = None):
    return subprocess.run([*KVPACK, *args], input=stdin, capture_output=True)


def _rows(conformance_dir):
    for line in (conformance_dir / "production_v1_check_order.tsv").read_text().splitlines():
        if line and not line.startswith("#"):
            yield line.split("\t")


def _chunk_context(suite=("raw", "plain", "plain")) -> tuple[dict, dict[str, bytes]]:
    """The decode context of a fixture chunk, taken from its own pack's manifest."""
    objs = dict(reference_fixture(*suite))
    manifest, _ = decode_pack(objs["pack"], fixture_keys())
    key, span, ref = next(manifest.chunk_refs())
    ctx = {
        "root": ROOT.hex(),
        "tenant": TENANT.hex(),
        "epoch": EPOCH,
        "family": manifest.family.encode().hex(),
        "state_key": [key.layer, key.name],
        "ref": [ref.content_id.hex(), ref.object_key.hex(), ref.object_digest.hex(), ref.key_epoch, ref.plaintext_bytes, ref.object_bytes],
        "span": [span.token_start, span.token_count, span.plaintext_offset, span.plaintext_bytes],
    }
    return ctx, objs


# -- verdict ---------------------------------------------------------------------------------


def test_verdict_prints_each_check_order_category(conformance_dir, tmp_path):
    rows = list(_rows(conformance_dir))
    assert len(rows) == 8
    for case, kind, category, context, hexdata in rows:
        path = tmp_path / case
        path.write_bytes(bytes.fromhex(hexdata))
        args = ["verdict", kind, str(path), "--json"] + (["--context", context] if context != "-" else [])
        result = run(*args)
        assert result.returncode == 1, (case, result.stderr)
        out = json.loads(result.stdout)
        assert (out["verdict"], out["category"]) == ("refused", category), case


def test_verdict_accepts_a_chunk_against_its_ref_and_span(tmp_path):
    ctx, objs = _chunk_context(("lossless", "encrypted", "plain"))
    (tmp_path / "chunk").write_bytes(objs["chunk"])
    result = run("verdict", "chunk", str(tmp_path / "chunk"), "--context", json.dumps(ctx))
    assert result.returncode == 0 and result.stdout.decode().strip() == "ok chunk", result.stderr
    # the same through standard input and a context file
    (tmp_path / "ctx.json").write_text(json.dumps(ctx))
    result = run("verdict", "chunk", "-", "--context", "@" + str(tmp_path / "ctx.json"), stdin=objs["chunk"])
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "change, category",
    [
        (lambda ctx, obj: (ctx, obj[:-1] + bytes([obj[-1] ^ 1])), "reserved"),  # padding byte
        (lambda ctx, obj: (dict(ctx, span=[0, 0, 0, ctx["span"][3]]), obj), "semantics"),  # E2-3
        (lambda ctx, obj: (dict(ctx, ref=[ctx["ref"][0], ctx["ref"][1], "00" * 32, *ctx["ref"][3:]]), obj), "authentication"),
        (lambda ctx, obj: (dict(ctx, root="64" * 32), obj), "authentication"),
    ],
)
def test_verdict_refusals(tmp_path, change, category):
    ctx, objs = _chunk_context()
    ctx, obj = change(ctx, objs["chunk"])
    result = run("verdict", "chunk", "-", "--context", json.dumps(ctx), stdin=obj)
    assert result.returncode == 1
    assert result.stdout.decode().startswith(f"refused {category}:"), result.stdout


def test_verdict_usage_errors_are_not_verdicts(tmp_path):
    ctx, objs = _chunk_context()
    missing = {k: v for k, v in ctx.items() if k != "span"}
    for context in (json.dumps(missing), json.dumps(dict(ctx, extra=1)), "{not json", json.dumps(dict(ctx, root="ab"))):
        result = run("verdict", "chunk", "-", "--context", context, stdin=objs["chunk"])
        assert result.returncode == 2 and result.stdout == b"", (context, result.stdout)
    assert run("verdict", "chunk", str(tmp_path / "absent")).returncode == 2


def test_verdict_bounds_oversize_input_before_reading_it_all():
    result = run("verdict", "chunk", "-", stdin=bytes(MAX_CHUNK_OBJECT_BYTES + 4096))
    assert result.returncode == 1 and result.stdout.decode().startswith("refused bounds:")


# -- transcode -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["manifest", "family", "schema", "state_declaration"])
def test_transcode_structural_kinds_re_emit_canonical_bytes(tmp_path, kind):
    objs = dict(reference_fixture("raw", "plain", "plain"))
    result = run("transcode", kind, "-", stdin=objs[kind])
    assert result.returncode == 0, result.stderr
    assert result.stdout == objs[kind]


@pytest.mark.parametrize("suite", [("raw", "plain", "encrypted"), ("lossless", "encrypted", "plain")])
def test_transcode_pack_and_chunk_under_a_context(tmp_path, suite):
    ctx, objs = _chunk_context(suite)
    key = tmp_path / "root.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, ROOT)
    os.close(fd)
    pack_ctx = json.dumps({"tenant": TENANT.hex(), "epoch": EPOCH})
    (tmp_path / "pack").write_bytes(objs["pack"])
    result = run("transcode", "pack", str(tmp_path / "pack"), "--context", pack_ctx, "--root-key-file", str(key), "--hex")
    assert result.returncode == 0, result.stderr
    assert bytes.fromhex(result.stdout.decode().strip()) == objs["pack"]
    out = tmp_path / "chunk.out"
    result = run("transcode", "chunk", "-", "--context", json.dumps(ctx), "--out", str(out), stdin=objs["chunk"])
    assert result.returncode == 0 and out.read_bytes() == objs["chunk"], result.stderr


def test_transcode_refusal_writes_nothing(tmp_path):
    objs = dict(reference_fixture("raw", "plain", "plain"))
    bad = bytearray(objs["manifest"])
    bad[-1] ^= 0xFF
    out = tmp_path / "never"
    result = run("transcode", "manifest", "-", "--out", str(out), stdin=bytes(bad))
    assert result.returncode == 1 and result.stdout == b"" and not out.exists()
    assert result.stderr.decode().startswith("kvpack: ")  # the CLI's error contract: category and message
    # a pack without its keys is a usage error, not a verdict on the pack
    result = run("transcode", "pack", "-", stdin=objs["pack"])
    assert result.returncode == 2 and result.stdout == b"" and b"root, tenant and epoch" in result.stderr


# -- fixture --json-lines --------------------------------------------------------------------


def test_fixture_json_lines_objects_match_every_vector_line(conformance_dir):
    result = run("fixture", "--json-lines")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.decode().splitlines()]
    objects = [(r["suite"], r["name"], str(r["bytes"]), r["sha256"]) for r in records if r["record"] == "object"]
    expected = [tuple(line.split("\t")) for line in (conformance_dir / "production_v1.sha256").read_text().splitlines() if line and not line.startswith("#")]
    assert len(expected) == 520 and objects == expected
    assert all(bytes.fromhex(r["hex"]).__len__() == r["bytes"] for r in records if r["record"] == "object")

    by_name = {(r["suite"], r["name"]): r["hex"] for r in records if r["record"] == "object"}
    prefixes = [r for r in records if r["record"] == "prefix"]
    assert len(prefixes) == 8
    for p in prefixes:  # 4 tokens: one open (not reusable) block whose node is the token root
        assert p["tokens"] == [1, 2, 3, 4] and len(p["nodes"]) == 1 and not p["nodes"][0]["reusable"]
        assert p["token_root"] == p["nodes"][-1]["node_id"] == by_name[(p["suite"], "token_root")]
    stages = [r for r in records if r["record"] == "stage"]
    assert len(stages) == 64
    for st in stages:
        assert st["manifest_id"] == by_name[(st["suite"], f"stage-{st['stage']}/manifest-id")]
        assert st["token_count"] == st["stage"] + 1 == len(st["tokens"]) and st["depth"] == st["stage"]
        assert st["prefix"]["token_root"] == st["prefix"]["nodes"][-1]["node_id"]
        if st["stage"]:
            previous = stages[stages.index(st) - 1]
            assert st["parent_manifest_id"] == previous["manifest_id"] and st["parent_token_count"] == previous["token_count"]
        else:
            assert st["parent_manifest_id"] is None


def test_fixture_json_lines_selection_and_usage(tmp_path):
    result = run("fixture", "--json-lines", "--suite", "raw/encrypted/plain", "--only", "delta-chain")
    records = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert result.returncode == 0 and {r["suite"] for r in records} == {"delta-chain/raw/encrypted/plain"}
    assert [r["stage"] for r in records if r["record"] == "stage"] == list(range(8))
    assert run("fixture", "--json-lines", str(tmp_path)).returncode == 2
    assert run("fixture").returncode == 2
    assert run("fixture", "--json-lines", "--suite", "raw/plain").returncode == 2
    assert not any(tmp_path.iterdir())
