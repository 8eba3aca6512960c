"""A store that heals: a flipped chunk, a missing chunk, an index entry swapped to another
cut's valid manifest and a rolled-back pack are each caught by ``verify --read-data``, are a
miss for ``lookup_restore`` (quarantined with a receipt; the shallower cut is restored and
the rest recomputed bit-exactly, then republished), and ``repair`` leaves a store that
verifies clean. Both backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvpack.generate import generate
from kvpack.errors import DurableIOError, StoreError
from kvpack.store import PackStore
from kvpack.testing.faults import FaultyOps

from .helpers import TOKENS, engine, flip, names, session_with

DAMAGE = ["flipped_chunk", "missing_chunk", "swapped_index", "rolled_back_pack"]


def _top_only_chunk(store, mid: bytes) -> str:
    """A full-span chunk only the top pack of the cut references (not its parents)."""
    chain = store.load_chain(mid)
    below = {ref.content_id for m in chain[1:] for _k, _s, ref in m.chunk_refs()}
    ref = next(r for k, _s, r in chain[0].chunk_refs() if k.layer == 0 and r.content_id not in below)
    return f"chunks/{ref.content_id.hex()}.kvchk"


def _damage(store, eng, kind: str) -> None:
    top = store.find_deepest(TOKENS, eng.layout, eng.ids())
    assert top.cut == len(TOKENS)
    if kind == "flipped_chunk":
        flip(store, _top_only_chunk(store, top.manifest_id), 4096 + 16 + 100)
    elif kind == "missing_chunk":
        store.env.delete(_top_only_chunk(store, top.manifest_id))
    elif kind == "swapped_index":
        other = store.find_deepest(TOKENS[:1024], eng.layout, eng.ids())
        store.env.write(f"index/{top.node_id.hex()}", other.manifest_id.hex().encode() + b"\n")
    elif kind == "rolled_back_pack":
        parent = store.load_chain(top.manifest_id)[0].schema.parent.manifest_id
        store.env.write(f"packs/{top.manifest_id.hex()}.kvpkp", store.env.read(f"packs/{parent.hex()}.kvpkp"))


def _published(backend, tmp_path):
    store = backend.new(tmp_path)
    eng = engine()
    full = session_with(eng, TOKENS, store)  # cuts 256, 512, 768, 1024, 1200
    return store, eng, full


@pytest.mark.parametrize("kind", DAMAGE)
def test_damage_is_a_miss_that_recomputes_and_republishes(tmp_path, backend, kind):
    store, eng, full = _published(backend, tmp_path)
    _damage(store, eng, kind)
    report = store.verify(read_data=True)
    assert not report["ok"], kind  # verify --read-data sees every kind, the swapped entry too
    live = eng.new_session()
    found = store.lookup_restore(TOKENS, live)
    assert len(found.quarantined) == 1
    receipt = found.quarantined[0]
    assert receipt["index_entry_removed"] and receipt["problems"]
    assert names(store, "quarantine/") == [receipt["receipt"]]
    assert json.loads(store.env.read(receipt["receipt"]))["manifest_id"] == receipt["manifest_id"]
    assert found.hit is not None and found.hit.cut == 1024  # the shallower cut, verified
    assert live.cache_digest() == session_with(eng, TOKENS[:1024]).cache_digest()
    live.prefill(TOKENS[live.position :])  # recompute the rest ...
    assert live.cache_digest() == full.cache_digest()
    store.save(live)  # ... and republish: the damaged object is rewritten, not built on
    assert store.verify(read_data=True)["ok"]
    again = eng.new_session()
    healed = store.lookup_restore(TOKENS, again)
    assert healed.hit.cut == len(TOKENS) and not healed.quarantined
    assert again.cache_digest() == full.cache_digest()


@pytest.mark.parametrize("kind", DAMAGE)
def test_repair_leaves_a_store_that_verifies_clean(tmp_path, backend, kind):
    store, eng, _full = _published(backend, tmp_path)
    _damage(store, eng, kind)
    assert not store.verify(read_data=True)["ok"]
    out = store.repair()
    assert out["quarantined"] == 1 and out["cuts_checked"] == 5
    assert store.verify(read_data=True)["ok"]
    assert store.verify(read_data=False)["ok"]
    assert store.find_deepest(TOKENS, eng.layout, eng.ids()).cut == 1024
    store.gc()
    assert store.verify(read_data=True)["ok"]


def test_malformed_index_entry_is_dropped_by_repair(tmp_path, backend):
    store, eng, _full = _published(backend, tmp_path)
    top = store.find_deepest(TOKENS, eng.layout, eng.ids())
    store.env.write(f"index/{top.node_id.hex()}", b"not hex at all\n")
    assert not store.verify()["ok"]
    assert store.find_deepest(TOKENS, eng.layout, eng.ids()).cut == 1024  # not a hit, not a crash
    assert store.repair()["quarantined"] == 1
    assert store.verify(read_data=True)["ok"]


def test_forget_removes_the_entry_and_refuses_an_unknown_cut(tmp_path, backend):
    store, eng, _full = _published(backend, tmp_path)
    top = store.find_deepest(TOKENS, eng.layout, eng.ids())
    before = names(store, "index/")
    with pytest.raises(StoreError):
        store.forget(bytes(32))
    assert names(store, "index/") == before  # refused: nothing removed
    assert store.forget(top.manifest_id)["index_entries_removed"] == 1
    assert store.find_deepest(TOKENS, eng.layout, eng.ids()).cut == 1024
    assert store.verify(read_data=True)["ok"]


def test_identity_miss_is_not_quarantined(tmp_path, backend):
    store, eng, _full = _published(backend, tmp_path)
    other = engine(name="another-model")
    live = other.new_session()
    found = store.lookup_restore(TOKENS, live)
    assert found.hit is None and not found.quarantined and not names(store, "quarantine/")


def test_refused_init_leaves_nothing(tmp_path):
    key = tmp_path / "loose.key"
    key.write_bytes(bytes(range(32)))
    os.chmod(key, 0o644)  # breaks the key-file contract
    target = tmp_path / "s"
    with pytest.raises(StoreError) as info:
        PackStore.init(str(target), encrypted=True, root_key_file=str(key))
    assert info.value.category == "key"
    assert not target.exists()
    # the same through the CLI, into an existing empty directory: it stays empty
    target.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "kvpack.cli", "store", "init", str(target), "--encrypt", "--root-key-file", str(key)], capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stderr.startswith("kvpack: key:") and len(r.stderr.strip().splitlines()) == 1
    assert os.listdir(target) == []


def test_refused_s3_init_leaves_nothing(tmp_path, seaweed):
    from .helpers import S3Backend

    backend = S3Backend(seaweed)
    with pytest.raises(StoreError):
        backend.new(tmp_path, name="nokey", root_key_file=None)  # an S3 store needs an outside key
    key = tmp_path / "loose.key"
    key.write_bytes(bytes(range(32)))
    os.chmod(key, 0o644)
    env = backend.env("s3://kvpack-tests/refused-init")
    with pytest.raises(StoreError):
        PackStore.init(env, root_key_file=str(key))
    assert not list(env.list(""))


def test_enospc_during_save_refuses_with_one_clear_error_and_keeps_the_store(tmp_path):
    import errno

    eng = engine()
    store = PackStore.init(str(tmp_path / "s"), chunk_bytes=4096)
    session_with(eng, TOKENS[:512], store)
    nxt = eng.new_session()
    nxt.prefill(TOKENS[:768], chunk_size=256)
    full = PackStore.open(store.path, ops=FaultyOps(fail_ops={"write"}, errno_=errno.ENOSPC))
    with pytest.raises(DurableIOError) as info:
        full.save(nxt)
    assert "No space left on device" in info.value.message
    assert store.verify(read_data=True)["ok"]
    assert store.find_deepest(TOKENS[:768], eng.layout, eng.ids()).cut == 512


def test_eio_on_read_is_one_io_refusal_not_a_quarantine(tmp_path):
    """EIO restoring the cut found: restore refuses (``io``); the lookup every consumer uses
    is a miss that reports the entry as unreadable (before, it raised ``io`` and generate
    failed instead of recomputing); nothing quarantined, nothing installed."""
    eng = engine()
    store = PackStore.init(str(tmp_path / "s"), chunk_bytes=4096)
    session_with(eng, TOKENS[:512], store)
    failing = PackStore.open(store.path, ops=FaultyOps(fail_reads=lambda kind, path: kind == "read" and "/chunks/" in path))
    hit = failing.find_deepest(TOKENS[:512], eng.layout, eng.ids())
    live = eng.new_session()
    with pytest.raises(StoreError) as info:
        failing.restore(hit, live, TOKENS[:512])
    assert info.value.category == "io" and "Input/output error" in info.value.message
    found = failing.lookup_restore(TOKENS[:512], live)
    assert found.hit is None and found.report is None and not found.quarantined
    assert [u.node_id for u in found.unreadable] == [hit.node_id] and "Input/output error" in found.unreadable[0].error.message
    assert live.position == 0 and not names(store, "quarantine/")  # a failing disk is not corruption
    eng.tokenizer = None  # kvpack.generate decodes no text for the NumPy adapter
    expected = generate(eng, None, TOKENS[:512], max_new_tokens=3).tokens
    result = generate(eng, failing, TOKENS[:512], max_new_tokens=3, save=False)
    assert result.tokens == expected and result.reused_tokens == 0 and len(result.unreadable) == 1
    assert store.verify(read_data=True)["ok"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root")
def test_cli_on_a_full_disk_prints_one_line(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open(mnt / "filler", "wb") as fh:
            try:
                fh.write(bytes(1 << 20))
            except OSError:
                pass
        r = subprocess.run([sys.executable, "-m", "kvpack.cli", "store", "init", str(mnt / "s")], capture_output=True, text=True)
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvpack: ") and "No space left on device" in lines[0], r.stderr
        assert not (mnt / "s").exists() or not os.listdir(mnt / "s")
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
