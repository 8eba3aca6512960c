"""Pack store behaviour on the NumPy adapter: save/find/restore round trips, deltas and
compaction, dedup, identity scoping, and every refusal leaving the live session untouched --
each test against both backends (a directory, and a real SeaweedFS S3 server)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpack.errors import EngineError, StoreError

from .helpers import LAYOUT, TOKENS, engine, names, session_with


@pytest.mark.parametrize("encrypted", [False, True])
def test_save_find_restore_round_trip(tmp_path, backend, encrypted):
    store = backend.new(tmp_path, encrypted=encrypted)
    eng = engine()
    src = session_with(eng, TOKENS, store)
    hit = store.find_deepest(TOKENS, eng.layout, eng.ids())
    assert hit is not None and hit.cut == len(TOKENS)
    dst = eng.new_session()
    report = store.restore(hit, dst, TOKENS)
    assert dst.cache_digest() == src.cache_digest()
    assert dst.tokens == TOKENS
    assert report.packs == 5  # full at 256, deltas at 512, 768, 1024, 1200
    # a different continuation reuses the deepest aligned prefix only
    query = TOKENS[:700] + [1, 2, 3]
    hit = store.find_deepest(query, eng.layout, eng.ids())
    assert hit.cut == 512
    prefix = eng.new_session()
    store.restore(hit, prefix, query)
    reference = session_with(eng, TOKENS[:512])
    assert prefix.cache_digest() == reference.cache_digest()


def test_windowed_layers_store_zero_outside_window_and_restore_window(tmp_path, backend):
    store = backend.new(tmp_path)
    eng = engine()
    src = session_with(eng, TOKENS, store)
    hit = store.find_deepest(TOKENS, eng.layout, eng.ids())
    dst = eng.new_session()
    store.restore(hit, dst, TOKENS)
    for layer in LAYOUT.windowed_layers():
        lo, hi = dst.retained_range(layer)
        assert hi - lo == LAYOUT.layer(layer).window_tokens
        assert dst.state_digest(layer, "k") == src.state_digest(layer, "k")


def test_depth_limit_forces_full_compaction_and_dedups(tmp_path, backend):
    store = backend.new(tmp_path)
    eng = engine()
    tokens = TOKENS[:1] * 0 + [(i * 5 + 1) % 64 for i in range(256 * 10)]
    reports = []
    s = eng.new_session()
    s.prefill(tokens, chunk_size=256, on_chunk=lambda ss: reports.append(store.save(ss)))
    kinds = [(r.kind, r.depth) for r in reports]
    assert kinds[:8] == [("full", 0)] + [("delta", d) for d in range(1, 8)]
    assert kinds[8] == ("full", 0)  # depth 8 would exceed the format: compaction
    assert kinds[9] == ("delta", 1)
    assert reports[8].chunks_reused > 0  # full layers' rows dedup by content id
    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    dst = eng.new_session()
    store.restore(hit, dst, tokens)
    assert dst.cache_digest() == s.cache_digest()
    # saving the same cut again writes nothing
    assert store.save(s).kind == "existing"


def test_wrong_identity_is_a_miss(tmp_path, backend):
    store = backend.new(tmp_path)
    eng = engine()
    session_with(eng, TOKENS[:512], store)
    other = engine(scalars={"scale": 1.0000000000000002})  # one f64 bit
    assert store.find_deepest(TOKENS[:512], other.layout, other.ids()) is None
    renamed = engine(name="arrays-v2")
    assert store.find_deepest(TOKENS[:512], renamed.layout, renamed.ids()) is None
    assert store.find_deepest(TOKENS[:512], eng.layout, eng.ids()) is not None


def test_no_token_ids_in_paths_or_files(tmp_path, backend):
    store = backend.new(tmp_path)
    eng = engine()
    session_with(eng, TOKENS[:300], store)
    found = [i.name for i in store.env.list("")]
    assert found
    for name in found:
        parts = name.split("/")
        assert name in ("store.json", "root.key", "lock") or (len(parts) == 2 and len(parts[1].split(".")[0]) == 64), name
    assert "tokens" not in store.env.read("store.json").decode()


def _objects(store):
    for sub in ("chunks/", "packs/", "logits/", "index/"):
        yield from names(store, sub)


def test_any_flipped_byte_refuses_and_installs_nothing(tmp_path, backend):
    """Flip bytes of every stored object: ``verify`` reports it, and restoring the cut refuses
    with a category (or misses, or never reads an object the cut does not need: spans outside
    a windowed layer's window), while the live session stays exactly as it was."""
    store = backend.new(tmp_path, encrypted=True)
    eng = engine()
    session_with(eng, TOKENS[:600], store)
    live = session_with(eng, [5] * 300)
    before = live.cache_digest()
    outcomes: dict[str, int] = {}
    flips = 0
    objects = list(_objects(store))
    chunks = [p for p in objects if p.startswith("chunks/")]
    # the S3 run samples fewer objects and offsets (every flip is a verify and a restore)
    s3 = backend.name == "s3"
    sample = [p for p in objects if not p.startswith("chunks/")] + chunks[:: 40 if s3 else 4]
    for name in sample:
        data = bytearray(store.env.read(name))
        offsets = {60, len(data) // 2} if s3 else {0, 60, 210, len(data) // 2, len(data) - 1}
        for offset in sorted(o for o in offsets if o < len(data)):
            original = data[offset]
            data[offset] ^= 0x10
            store.env.write(name, bytes(data))
            try:
                assert not store.verify(read_data=True)["ok"], (name, offset)
                try:
                    hit = store.find_deepest(TOKENS[:600], eng.layout, eng.ids())
                except StoreError as exc:
                    hit, outcome = None, exc.category
                else:
                    outcome = "miss"
                if hit is not None:
                    try:
                        store.restore(hit, live, TOKENS[:600])
                    except StoreError as exc:
                        outcome = getattr(exc, "format_category", exc.category)
                    else:
                        outcome = "not-needed"
                        live = session_with(eng, [5] * 300)  # reset for the next flip
                assert live.cache_digest() == before
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                flips += 1
            finally:
                data[offset] = original
                store.env.write(name, bytes(data))
    assert flips > (15 if s3 else 80)
    assert outcomes.get("authentication", 0) > (4 if s3 else 20), outcomes
    assert store.verify(read_data=True)["ok"]
    store.restore(store.find_deepest(TOKENS[:600], eng.layout, eng.ids()), live, TOKENS[:600])


def test_missing_logits_or_chunk_refuses(tmp_path, backend):
    store = backend.new(tmp_path)
    eng = engine()
    session_with(eng, TOKENS[:300], store)
    hit = store.find_deepest(TOKENS[:300], eng.layout, eng.ids())
    live = eng.new_session()
    logits = f"logits/{hit.manifest_id.hex()}.kvchk"
    saved = store.env.read(logits)
    store.env.delete(logits)
    assert store.find_deepest(TOKENS[:300], eng.layout, eng.ids()).cut == 256  # incomplete cut is not offered
    with pytest.raises(StoreError) as info:
        store.restore(hit, live, TOKENS[:300])
    assert info.value.category == "incomplete" and live.position == 0
    store.env.write(logits, saved)
    top = store.load_chain(hit.manifest_id)[0]
    needed = next(ref for key, _span, ref in top.chunk_refs() if key.layer == 0)  # a full-span layer
    store.env.delete(f"chunks/{needed.content_id.hex()}.kvchk")
    with pytest.raises(StoreError):
        store.restore(store.find_deepest(TOKENS[:300], eng.layout, eng.ids()), live, TOKENS[:300])
    assert live.position == 0
    assert not store.verify(read_data=False)["ok"]


def test_save_refuses_without_logits_and_empty(tmp_path, backend):
    store = backend.new(tmp_path)
    eng = engine()
    with pytest.raises(StoreError):
        store.save(eng.new_session())
    s = session_with(eng, TOKENS[:10])
    s.last_logits = None
    with pytest.raises(EngineError):
        store.save(s)
    assert not names(store, "index/") and not names(store, "packs/") and not names(store, "chunks/")


def test_root_key_contract_and_wrong_key(tmp_path, backend):
    store = backend.new(tmp_path)
    eng = engine()
    session_with(eng, TOKENS[:300], store)
    key = os.path.join(store.path, "root.key") if backend.name == "posix" else backend.keys[store.path]
    os.chmod(key, 0o644)
    with pytest.raises(StoreError) as info:
        backend.reopen(store)
    assert info.value.category == "key"
    os.chmod(key, 0o600)
    other = tmp_path / "other.key"
    fd = os.open(other, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, bytes([7]) * 32)
    os.close(fd)
    with pytest.raises(StoreError) as info:
        backend.reopen(store, root_key_file=str(other))  # store.json's key check tells it apart
    assert info.value.category == "wrong_key"


def test_gc_removes_only_unreferenced(tmp_path, backend):
    store = backend.new(tmp_path)
    eng = engine()
    session_with(eng, TOKENS[:600], store)
    # orphans: a chunk and a pack nobody indexes, and (POSIX) a stale temp file
    store.env.write("chunks/" + "ab" * 32 + ".kvchk", b"x" * 4096)
    store.env.write("packs/" + "cd" * 32 + ".kvpkp", b"y" * 8192)
    if backend.name == "posix":
        Path(store.path, "chunks", ".zz.tmp").write_bytes(b"z")
    before = store.verify()
    removed = store.gc()
    assert removed["chunks"] == 1 and removed["packs"] == 1 and removed["temp"] == (1 if backend.name == "posix" else 0)
    after = store.verify()
    assert after["ok"] and after["cuts"] == before["cuts"]


def test_save_an_earlier_cut_with_its_captured_logits(tmp_path, backend):
    from kvpack.engine.arrays import ArrayEngine, array_layout

    eng = ArrayEngine(array_layout(windowed={}))
    store = backend.new(tmp_path)
    captured = {}
    s = eng.new_session()
    s.prefill(TOKENS[:700], chunk_size=256, on_chunk=lambda ss: captured.__setitem__(ss.position, bytes(ss.export_logits())))
    for cut in (256, 512):
        store.save(s, cut=cut, logits=captured[cut])
    store.save(s)
    hit = store.find_deepest(TOKENS[:600], eng.layout, eng.ids())
    assert hit.cut == 512
    live = eng.new_session()
    store.restore(hit, live, TOKENS[:600])
    assert live.cache_digest() == session_with(eng, TOKENS[:512]).cache_digest()
    with pytest.raises(StoreError):
        store.save(s, cut=300)  # no logits captured for it


def test_earlier_cut_refused_when_a_window_has_moved_on(tmp_path, backend):
    store = backend.new(tmp_path)
    eng = engine()
    s = session_with(eng, TOKENS[:700])
    with pytest.raises(StoreError) as info:
        store.save(s, cut=256, logits=bytes(eng.layout.logits_bytes))
    assert info.value.category == "usage"
    assert not names(store, "packs/")
