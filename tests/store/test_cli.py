"""``kvpack store ...`` and ``kvpack generate`` as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .helpers import TOKENS, engine, session_with

KVPACK = [sys.executable, "-m", "kvpack.cli"]


def run(*args, timeout=900):
    return subprocess.run([*KVPACK, *args], capture_output=True, text=True, timeout=timeout)


def test_store_init_ls_verify_show_gc(tmp_path):
    path = str(tmp_path / "s")
    r = run("store", "init", path, "--encrypt", "--chunk-bytes", "4096")
    assert r.returncode == 0, r.stderr
    assert oct(os.stat(os.path.join(path, "root.key")).st_mode & 0o777) == "0o600"
    from kvpack.store import PackStore

    store = PackStore.open(path)
    session_with(engine(), TOKENS[:600], store)
    rows = json.loads(run("store", "ls", path, "--json").stdout)
    assert sorted(r["tokens"] for r in rows) == [256, 512, 600]
    assert all(r["has_logits"] for r in rows)
    r = run("store", "verify", path, "--read-data", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"]
    top = max(rows, key=lambda r: r["tokens"])
    shown = json.loads(run("store", "show", path, top["manifest_id"]).stdout)
    assert [m["token_count"] for m in shown["chain"]] == [600, 512, 256]
    assert run("store", "show", path, "zz").returncode == 2
    # damage one chunk: verify --read-data reports it and exits 1; gc does not hide it
    chunk = sorted(os.listdir(os.path.join(path, "chunks")))[0]
    with open(os.path.join(path, "chunks", chunk), "r+b") as fh:
        fh.seek(5000)
        b = fh.read(1)
        fh.seek(5000)
        fh.write(bytes([b[0] ^ 1]))
    r = run("store", "verify", path, "--read-data")
    assert r.returncode == 1 and "problem:" in r.stdout and r.stderr.startswith("kvpack: corrupt:")
    assert run("store", "gc", path, "--json").returncode == 0
    assert run("store", "verify", path, "--read-data").returncode == 1


def test_store_refuses_bad_key_file(tmp_path):
    path = str(tmp_path / "s")
    assert run("store", "init", path).returncode == 0
    os.chmod(os.path.join(path, "root.key"), 0o640)
    r = run("store", "ls", path)
    assert r.returncode == 2 and r.stderr.startswith("kvpack: key:")  # an unsafe key file: exit 2
    r = run("store", "ls", str(tmp_path / "nope"))
    assert r.returncode == 10 and r.stderr.startswith("kvpack: no_store:") and "not a kvpack store" in r.stderr


@pytest.mark.slow
def test_generate_reuses_the_stored_prefix_and_gives_the_same_text(tmp_path):
    pytest.importorskip("transformers")
    store = str(tmp_path / "gen")
    prompt = "List three facts about the Moon, one per line. " * 30
    first = run("generate", "--store", store, "--prompt", prompt, "--max-new-tokens", "12", "--json", "--threads", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    a = json.loads(first.stdout)
    assert a["reused_tokens"] == 0 and a["prefilled_tokens"] == a["prompt_tokens"] > 256
    assert {"text", "reused_tokens", "prefilled_tokens", "ttft_s"} <= set(a)
    second = run("generate", "--store", store, "--prompt", prompt, "--max-new-tokens", "12", "--json", "--threads", "2")
    b = json.loads(second.stdout)
    assert b["reused_tokens"] == b["prompt_tokens"] and b["prefilled_tokens"] == 0
    assert b["text"] == a["text"] and b["tokens"] == a["tokens"]
    third = run("generate", "--store", store, "--prompt", prompt + " And one about Mars.", "--max-new-tokens", "4", "--json", "--threads", "2")
    c = json.loads(third.stdout)
    assert c["reused_tokens"] % 256 == 0 and c["reused_tokens"] >= 256
    assert c["prefilled_tokens"] == c["prompt_tokens"] - c["reused_tokens"]
    # the same prompt without the store gives the same text (reuse changes nothing)
    fresh = run(
        "generate",
        "--store",
        str(tmp_path / "empty"),
        "--no-save",
        "--prompt",
        prompt + " And one about Mars.",
        "--max-new-tokens",
        "4",
        "--json",
        "--threads",
        "2",
    )
    assert json.loads(fresh.stdout)["tokens"] == c["tokens"]


@pytest.mark.parametrize("endpoint", ["notaurl", "ftp://127.0.0.1:9000", "http://", "http://127.0.0.1:notaport", "http://127.0.0.1:99999"])
def test_a_bad_s3_endpoint_is_a_usage_error_in_one_line(tmp_path, endpoint):
    """Before: ``notaurl`` was boto3's bare ValueError, printed as ``internal`` (exit 70)."""
    from kvpack.rootkey import create_root_key

    key = str(tmp_path / "root.key")
    create_root_key(key)
    for args, env in (
        (["--endpoint", endpoint], None),
        ([], {**os.environ, "KVPACK_S3_ENDPOINT": endpoint}),
    ):
        r = subprocess.run([*KVPACK, "store", "ls", "s3://kvpack-tests/x", "--root-key-file", key, *args], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2 and r.stderr.startswith("kvpack: usage: S3 endpoint"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    new_key = str(tmp_path / "new.key")
    r = run("store", "init", "s3://kvpack-tests/x", "--root-key-file", new_key, "--endpoint", endpoint)
    assert r.returncode == 2 and r.stderr.startswith("kvpack: usage: S3 endpoint"), r.stderr
    assert not os.path.exists(new_key)  # refused before the key was created


def test_missing_s3_credentials_are_named_in_one_line(tmp_path):
    """No credentials file and no AWS variables: a ``key`` refusal (exit 2) that says how to
    give them (before: ``io`` exit 1, botocore's 'Unable to locate credentials')."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KVPACK_S3_"))}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_EC2_METADATA_DISABLED="true")
    from kvpack.rootkey import create_root_key

    key = str(tmp_path / "root.key")
    create_root_key(key)
    r = subprocess.run(
        [*KVPACK, "store", "ls", "s3://kvpack-tests/x", "--endpoint", "http://127.0.0.1:9", "--root-key-file", key],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2 and r.stderr.startswith("kvpack: key: no S3 credentials:") and "--s3-credentials" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "edit",
    [
        {"tenant": None},
        {"tenant": ""},
        {"tenant": 7},
        {"key_epoch": None},
        {"key_epoch": "1"},
        {"key_epoch": 0},
        {"key_epoch": 1 << 64},
        {"key_epoch": True},
        {"encrypted": None},
        {"encrypted": "no"},
        {"chunk_bytes": 0},
        {"chunk_bytes": 5 << 20},
        {"chunk_bytes": 4.5},
    ],
)
def test_a_damaged_store_json_field_is_one_corrupt_line(tmp_path, edit):
    """store.json of the right format and version with a field missing (None) or of the
    wrong type or range: every verb refuses ``corrupt`` naming the field (exit 1) and writes
    nothing. Before: a missing tenant or epoch was a KeyError and a string epoch a
    ValueError (``internal``, exit 70); epoch 0 a format error; a chunk size of 0 or 5 MiB
    opened and failed later."""
    path = str(tmp_path / "s")
    assert run("store", "init", path, "--chunk-bytes", "4096").returncode == 0
    config_path = os.path.join(path, "store.json")
    with open(config_path) as fh:
        config = json.load(fh)
    field, value = next(iter(edit.items()))
    if value is None:
        del config[field]
    else:
        config[field] = value
    with open(config_path, "w") as fh:
        json.dump(config, fh)
    before = sorted(os.listdir(path))
    for verb in (["store", "ls", path], ["store", "verify", path], ["store", "gc", path]):
        r = run(*verb)
        assert r.returncode == 1 and r.stderr.startswith("kvpack: corrupt:") and f"'{field}'" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert sorted(os.listdir(path)) == before


def test_store_verbs_on_s3(tmp_path, seaweed):
    """Every store verb takes s3://bucket/prefix; credentials come from a 0600 file (or the
    AWS environment) and never reach store.json, receipts or output."""
    from kvpack.store import PackStore

    loc = "s3://kvpack-tests/cli-" + os.urandom(4).hex()
    key = str(tmp_path / "root.key")
    common = ["--endpoint", seaweed.endpoint, "--s3-credentials", seaweed.credentials_file, "--root-key-file", key]
    r = run("store", "init", loc, "--chunk-bytes", "4096", *common)
    assert r.returncode == 0, r.stderr
    again = run("store", "init", loc, *common)
    assert again.returncode == 2 and "already holds a store" in again.stderr  # refused: a usage error
    store = PackStore.open(loc, endpoint=seaweed.endpoint, credentials_file=seaweed.credentials_file, root_key_file=key)
    config = store.env.read("store.json").decode()
    assert seaweed.secret_key not in config and seaweed.access_key not in config and '"external"' in config
    eng = engine()
    session_with(eng, TOKENS[:600], store)
    rows = json.loads(run("store", "ls", loc, "--json", *common).stdout)
    assert sorted(r["tokens"] for r in rows) == [256, 512, 600]
    assert run("store", "verify", loc, "--read-data", *common).returncode == 0
    top = max(rows, key=lambda r: r["tokens"])
    chunk = next(i.name for i in store.env.list("chunks/"))
    data = bytearray(store.env.read(chunk))
    data[5000] ^= 1
    store.env.write(chunk, bytes(data))
    r = run("store", "verify", loc, "--read-data", *common)
    assert r.returncode == 1 and "problem:" in r.stdout
    r = run("store", "repair", loc, "--json", *common)
    assert r.returncode == 0 and json.loads(r.stdout)["quarantined"] >= 1
    assert run("store", "verify", loc, "--read-data", *common).returncode == 0
    left = json.loads(run("store", "ls", loc, "--json", *common).stdout)
    if left:
        r = run("store", "forget", loc, left[0]["manifest_id"], *common)
        assert r.returncode == 0, r.stderr
    gone = run("store", "forget", loc, top["manifest_id"][:10], *common)  # quarantined above: no such cut
    assert gone.returncode == 1 and gone.stderr.startswith("kvpack: miss:"), gone.stderr
    assert run("store", "gc", loc, "--json", *common).returncode == 0
    outputs = r.stdout + r.stderr
    assert seaweed.secret_key not in outputs
    # without credentials the S3 call is refused with one line
    r = run("store", "ls", loc, "--endpoint", seaweed.endpoint, "--root-key-file", key)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("kvpack: "), r.stderr
