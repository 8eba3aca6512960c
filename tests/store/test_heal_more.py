"""More ways a stored cut goes bad, tried as a user and an operator would (issue 16's
checks, beyond test_heal.py): each damage is found by ``verify --read-data``, is a miss for
``generate`` that is quarantined with a receipt, recomputed to the same tokens and
republished (the next run reuses the whole prompt); ``repair`` leaves a store that verifies
clean and a second ``repair`` changes nothing. Both backends (a directory and a real
SeaweedFS bucket prefix)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvpack.errors import StoreError
from kvpack.generate import generate
from kvpack.store import PackStore

from .helpers import TOKENS, PosixBackend, S3Backend, engine, files, flip, names, session_with

KVPACK = [sys.executable, "-m", "kvpack.cli"]


def _backend(request, where: str):
    return S3Backend(request.getfixturevalue("seaweed")) if where == "s3" else PosixBackend()


def _engine():
    eng = engine()
    eng.tokenizer = None  # kvpack.generate decodes no text for the NumPy adapter
    return eng


def _top_only_chunk(store, mid: bytes) -> tuple[str, int]:
    """A layer-0 chunk only the top pack of the cut references, and its object size."""
    chain = store.load_chain(mid)
    below = {ref.content_id for m in chain[1:] for _k, _s, ref in m.chunk_refs()}
    ref = next(r for k, _s, r in chain[0].chunk_refs() if k.layer == 0 and r.content_id not in below)
    return f"chunks/{ref.content_id.hex()}.kvchk", ref.object_bytes


def _damage(store, eng, kind: str, server=None) -> None:
    top = store.find_deepest(TOKENS, eng.layout, eng.ids())
    assert top.cut == len(TOKENS)
    mid, env = top.manifest_id, store.env
    chain = store.load_chain(mid)
    if kind == "truncated_chunk":
        name, _size = _top_only_chunk(store, mid)
        env.write(name, env.read(name)[:3000])
    elif kind == "zero_length_chunk":
        name = _top_only_chunk(store, mid)[0]
        if server is None:
            env.write(name, b"")
        else:
            # through a client of its own: SeaweedFS stalls the next PUT on the connection of
            # an empty PUT for the read timeout (30 s); kvpack itself never PUTs an empty body
            server.client().put_object(Bucket=env.bucket, Key=env.key(name), Body=b"")
    elif kind == "chunk_swapped_same_size":
        name, size = _top_only_chunk(store, mid)
        other = next(i.name for i in env.list("chunks/") if i.name != name and i.size == size)
        env.write(name, env.read(other))  # another valid chunk object, same size
    elif kind == "corrupt_logits":
        flip(store, f"logits/{mid.hex()}.kvchk", 300)
    elif kind == "logits_of_another_cut":
        other = store.find_deepest(TOKENS[:1024], eng.layout, eng.ids()).manifest_id
        env.write(f"logits/{mid.hex()}.kvchk", env.read(f"logits/{other.hex()}.kvchk"))
    elif kind == "truncated_pack":
        name = f"packs/{mid.hex()}.kvpkp"
        env.write(name, env.read(name)[:500])
    elif kind == "missing_pack":
        env.delete(f"packs/{mid.hex()}.kvpkp")
    elif kind == "missing_logits":
        env.delete(f"logits/{mid.hex()}.kvchk")
    elif kind == "index_to_missing_pack":
        env.write(f"index/{top.node_id.hex()}", b"ab" * 32 + b"\n")
    elif kind == "parent_pack_missing":
        env.delete(f"packs/{chain[1].manifest_id().hex()}.kvpkp")
    elif kind == "parent_pack_corrupt":
        flip(store, f"packs/{chain[1].manifest_id().hex()}.kvpkp", 150)
    elif kind == "malformed_index_entry":
        env.write(f"index/{top.node_id.hex()}", b"not hex at all\n")
    elif kind == "short_hex_index_entry":
        env.write(f"index/{top.node_id.hex()}", mid.hex()[:8].encode() + b"\n")  # a truncated entry
    elif kind == "oversized_index_entry":
        env.write(f"index/{top.node_id.hex()}", mid.hex().encode() * 4096)  # 256 KiB of valid hex digits
    elif kind == "root_chunk_flipped":
        # a chunk of the full cut at the bottom of the chain: every delta above shares it
        ref = next(r for k, _s, r in chain[-1].chunk_refs() if k.layer == 0)
        flip(store, f"chunks/{ref.content_id.hex()}.kvchk", 4096 + 16 + 50)
    else:
        raise AssertionError(kind)


KINDS = [
    "truncated_chunk",
    "zero_length_chunk",
    "chunk_swapped_same_size",
    "corrupt_logits",
    "logits_of_another_cut",
    "truncated_pack",
    "missing_pack",
    "missing_logits",
    "index_to_missing_pack",
    "parent_pack_missing",
    "parent_pack_corrupt",
    "root_chunk_flipped",
    "malformed_index_entry",
    "short_hex_index_entry",
    "oversized_index_entry",
]


#: every kind on a directory; on S3 the kinds that take other paths there (an empty object
#: is a 416 to a ranged GET; missing objects are 404s; a parent shared by the whole chain)
CASES = [("posix", kind) for kind in KINDS] + [
    ("s3", kind)
    for kind in (
        "zero_length_chunk",
        "chunk_swapped_same_size",
        "missing_pack",
        "index_to_missing_pack",
        "root_chunk_flipped",
        "short_hex_index_entry",
        "oversized_index_entry",
    )
]


def _published(request, where, tmp_path):
    backend = _backend(request, where)
    store = backend.new(tmp_path)
    eng = _engine()
    session_with(eng, TOKENS, store)  # cuts 256, 512, 768, 1024, 1200 (a delta chain)
    return store, eng, getattr(backend, "server", None)


@pytest.mark.parametrize("where,kind", CASES)
def test_generate_quarantines_recomputes_and_republishes(request, tmp_path, where, kind):
    store, eng, server = _published(request, where, tmp_path)
    expected = generate(eng, None, TOKENS, max_new_tokens=3).tokens
    _damage(store, eng, kind, server)
    assert not store.verify(read_data=True)["ok"]
    second = generate(eng, store, TOKENS, max_new_tokens=3)
    assert second.tokens == expected and second.reused_tokens < len(TOKENS)
    assert second.quarantined, "a damaged cut must be quarantined with a receipt, not only skipped"
    receipts = names(store, "quarantine/")
    assert sorted(r["receipt"] for r in second.quarantined) == receipts
    assert all(json.loads(store.env.read(r))["node_id"] for r in receipts)
    # republished: the store verifies clean and the next run reuses the whole prompt
    assert store.verify(read_data=True)["ok"], store.verify(read_data=True)["problems"][:2]
    third = generate(eng, store, TOKENS, max_new_tokens=3)
    assert third.tokens == expected and third.reused_tokens == len(TOKENS) and not third.quarantined


def _everything(store) -> dict[str, bytes]:
    return {i.name: store.env.read(i.name) for i in store.env.list("") if not i.name.startswith(("leases/", "gc.epoch")) and i.name != "lock"}


@pytest.mark.parametrize("where,kind", CASES)
def test_repair_verifies_clean_and_is_idempotent(request, tmp_path, where, kind):
    store, eng, server = _published(request, where, tmp_path)
    _damage(store, eng, kind, server)
    first = store.repair()
    assert first["quarantined"] >= 1
    assert store.verify(read_data=True)["ok"] and store.verify(read_data=False)["ok"]
    before = _everything(store)
    second = store.repair()
    assert second["quarantined"] == 0 and second["receipts"] == []
    assert _everything(store) == before  # a second repair changes nothing
    store.gc()
    assert store.verify(read_data=True)["ok"]
    assert store.repair()["quarantined"] == 0


def _kvpack(*args, env=None):
    return subprocess.run([*KVPACK, *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("where", ["posix", "s3"])
def test_a_store_that_lost_its_store_json_is_refused_not_reinitialised(request, tmp_path, where):
    """An encrypted store whose store.json is gone: open says so (not 'run kvpack store
    init'), and init -- which ``kvpack generate`` runs on a location without store.json --
    refuses instead of writing a new plain store.json over the encrypted objects."""
    backend = _backend(request, where)
    store = backend.new(tmp_path, encrypted=True)
    eng = _engine()
    session_with(eng, TOKENS[:600], store)
    store.env.delete("store.json")
    before = _everything(store)
    with pytest.raises(StoreError) as opened:
        backend.reopen(store)
    assert opened.value.category == "corrupt" and "no store.json" in opened.value.message
    with pytest.raises(StoreError) as init:
        PackStore.init(backend.env(store.path) if where == "s3" else store.path, root_key_file=backend.keys.get(store.path) if where == "s3" else None)
    assert init.value.category == "usage" and "no store.json" in init.value.message
    assert _everything(store) == before  # nothing written: no store.json, no key, no object
    if where == "posix":
        # the store is opened (and refused) before the bundled model would load
        r = _kvpack("generate", "--store", store.path, "--raw", "--prompt", "1 2 3")
        assert r.returncode == 1 and r.stderr.startswith("kvpack: corrupt:") and "no store.json" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert _everything(store) == before


def test_repair_keeps_an_entry_a_save_republished_while_it_ran(tmp_path):
    """``repair`` reads a malformed index entry; before it drops it, a save (another
    process's, sharing the store lock) replaces the entry with a valid one. repair must drop
    only what is still malformed: the republished cut stays indexed."""
    from kvpack.testing.faults import FaultyOps

    store = PosixBackend().new(tmp_path)
    eng = _engine()
    full = session_with(eng, TOKENS, store)
    top = store.find_deepest(TOKENS, eng.layout, eng.ids())
    entry = f"index/{top.node_id.hex()}"
    store.env.write(entry, b"not hex\n")
    fired = []

    def save_meanwhile(path: str, data: bytes) -> bytes:
        if path.endswith(entry) and not fired:
            fired.append(store.save(full))  # the entry is malformed: the save replaces it
        return data  # repair goes on with what it read (the malformed bytes)

    repairer = PackStore.open(store.path, ops=FaultyOps(corrupt_reads=save_meanwhile))
    out = repairer.repair()
    assert fired and fired[0].manifest_id == top.manifest_id.hex()
    assert out["quarantined"] == 1 and not out["receipts"][0]["index_entry_removed"]
    assert store.find_deepest(TOKENS, eng.layout, eng.ids()).cut == len(TOKENS)
    assert store.verify(read_data=True)["ok"]


@pytest.mark.parametrize("where", ["posix", "s3"])
def test_forget_of_an_unknown_cut_twice_is_a_miss_and_changes_nothing(request, tmp_path, where):
    """``store forget`` of a cut no entry names -- never stored, or forgotten already -- is a
    miss (exit 1) whether the id is given whole or as a prefix, and removes nothing."""
    backend = _backend(request, where)
    store = backend.new(tmp_path)
    eng = _engine()
    session_with(eng, TOKENS[:600], store)
    top = store.find_deepest(TOKENS[:600], eng.layout, eng.ids())
    assert store.forget(top.manifest_id)["index_entries_removed"] == 1
    before = _everything(store)
    for _ in range(2):
        for cut in (top.manifest_id, bytes(32)):
            with pytest.raises(StoreError) as info:
                store.forget(cut)
            assert info.value.category == "miss"
    assert _everything(store) == before
    if where == "posix":
        for text in (top.manifest_id.hex(), top.manifest_id.hex()[:12]):
            r = _kvpack("store", "forget", store.path, text)
            assert r.returncode == 1 and r.stderr.startswith("kvpack: miss:"), r.stderr
        r = _kvpack("store", "show", store.path, bytes(32).hex())  # never stored: a miss too
        assert r.returncode == 1 and r.stderr.startswith("kvpack: miss:"), r.stderr
        assert _everything(store) == before


def test_every_verb_that_takes_a_store_takes_an_s3_location():
    """Every command with a store argument (the store verbs, generate, and the node daemons'
    ``--store``) offers ``--endpoint``, ``--s3-credentials`` and ``--root-key-file``, so an
    ``s3://bucket/prefix`` store can be named wherever a directory can."""
    from kvpack.cli import build_parser, leaf_parsers

    lacking = []
    for words, parser in leaf_parsers(build_parser()):
        if words[0] != "store" and "store" not in {a.dest for a in parser._actions}:
            continue
        options = {o for a in parser._actions for o in a.option_strings}
        need = {"--endpoint", "--s3-credentials"} | ({"--root-key-file"} if words[-1] != "init" or "--root-key-file" in options else set())
        if not need <= options:
            lacking.append(" ".join(words))
    assert not lacking, lacking
    assert {"receiver", "producer", "receive", "generate"} <= {w[0] for w, p in leaf_parsers(build_parser()) if "store" in {a.dest for a in p._actions}}


def test_a_daemon_store_on_s3_is_created_once_then_opened(tmp_path, seaweed, monkeypatch):
    """``kvpack receive --store s3://... --endpoint ...`` (the daemons' store, opened as
    generate's): created in the bucket on the first start, opened on the next -- never a
    local directory named ``s3:``, never refused as 'already holds a store' on a restart."""
    from kvpack.cli import build_parser
    from kvpack.commands.node import _store
    from kvpack.rootkey import create_root_key

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "receiver.json"
    config.write_text("{}")
    loc = "s3://kvpack-tests/daemon-" + os.urandom(4).hex()
    create_root_key(str(tmp_path / "root.key"))  # an S3 store's key lives outside the bucket
    argv = ["receive", "--config", str(config), "--store", loc, "--endpoint", seaweed.endpoint]
    argv += ["--s3-credentials", seaweed.credentials_file, "--root-key-file", str(tmp_path / "root.key")]
    args = build_parser().parse_args(argv)
    first = _store(args, str(tmp_path / "state" / "store"))
    eng = _engine()
    session_with(eng, TOKENS[:300], first)
    again = _store(args, str(tmp_path / "state" / "store"))  # a restart
    assert again.path == loc and again.find_deepest(TOKENS[:300], eng.layout, eng.ids()).cut == 300
    assert sorted(os.listdir(tmp_path)) == ["receiver.json", "root.key"]
    assert seaweed.secret_key not in first.env.read("store.json").decode()


@pytest.mark.parametrize("failing", ["index", "packs", "logits", "stat"])
@pytest.mark.parametrize("verb", ["verify", "repair", "gc"])
def test_a_failing_disk_refuses_maintenance_and_changes_nothing(tmp_path, verb, failing):
    """EIO reading index entries, packs or logits objects (or stat-ing them) is one ``io``
    refusal for verify, repair and gc -- never a verdict on the cuts: before, an unreadable
    index entry counted as malformed, so gc saw no live cut and deleted every object of the
    store, repair wrote receipts, and an unreadable pack or logits object made repair
    quarantine the cut."""
    from kvpack.testing.faults import FaultyOps

    store = PosixBackend().new(tmp_path)
    eng = _engine()
    session_with(eng, TOKENS[:600], store)
    before = files(store.path)
    if failing == "stat":
        ops = FaultyOps(fail_reads={"stat"})  # every stat, the listing's included
    else:
        ops = FaultyOps(fail_reads=lambda kind, path: kind == "read" and f"/{failing}/" in path)
    sick = PackStore.open(store.path, ops=ops)
    try:
        out = getattr(sick, verb)()
    except StoreError as exc:
        assert exc.category == "io" and "Input/output error" in exc.message, exc
    else:
        assert verb == "gc" and not any(v for k, v in out.items()), out  # gc read nothing that failed
    after = files(store.path)
    # gc's lock file (posix.GC_PENDING, empty, made on a store's first gc) is coordination,
    # not store content: the first gc of this store makes it whatever the disk does
    if verb == "gc" and "gc.pending" not in before:
        assert after.pop("gc.pending") == b""
    assert after == before  # nothing deleted, quarantined or written
    healthy = PackStore.open(store.path)
    assert healthy.verify(read_data=True)["ok"] and healthy.verify(read_data=True)["cuts"] == 3


def test_healing_and_saving_go_on_after_an_operator_removed_store_directories(tmp_path):
    """An operator clears receipts (``rm -r STORE/quarantine``) or every index entry
    (``rm -r STORE/index``): the next heal writes its receipt and the next save commits,
    instead of a lookup that fails on the missing directory (before: DurableIOError
    'No such file or directory' out of generate)."""
    import shutil

    store = PosixBackend().new(tmp_path)
    eng = _engine()
    session_with(eng, TOKENS, store)
    expected = generate(eng, None, TOKENS, max_new_tokens=3).tokens
    _damage(store, eng, "truncated_chunk")
    shutil.rmtree(os.path.join(store.path, "quarantine"))
    healed = generate(eng, store, TOKENS, max_new_tokens=3)
    assert healed.tokens == expected and len(healed.quarantined) == 1
    assert names(store, "quarantine/") == [healed.quarantined[0]["receipt"]]
    shutil.rmtree(os.path.join(store.path, "index"))
    again = generate(eng, store, TOKENS, max_new_tokens=3)  # a miss: recomputed, saved again
    assert again.tokens == expected and again.reused_tokens == 0
    assert generate(eng, store, TOKENS, max_new_tokens=3).reused_tokens == len(TOKENS)
    assert store.verify(read_data=True)["ok"]


@pytest.mark.parametrize("where", ["posix", "s3"])
def test_a_wrong_root_key_is_a_clear_refusal_that_writes_nothing(request, tmp_path, where):
    """An encrypted store opened with another root key: every verb refuses with
    ``wrong_key`` (exit 12) before reading a cut -- never a miss that would quarantine the
    cuts and republish over them."""
    from kvpack.rootkey import create_root_key

    backend = _backend(request, where)
    store = backend.new(tmp_path, encrypted=True)
    eng = _engine()
    session_with(eng, TOKENS[:600], store)
    wrong = str(tmp_path / "wrong.key")
    create_root_key(wrong)
    before = _everything(store)
    with pytest.raises(StoreError) as info:
        backend.reopen(store, root_key_file=wrong)
    assert info.value.category == "wrong_key"
    assert _everything(store) == before
    if where == "posix":
        for argv in (
            ["generate", "--store", store.path, "--raw", "--prompt", "1 2 3"],
            ["store", "repair", store.path],
            ["store", "gc", store.path],
        ):
            r = _kvpack(*argv, "--root-key-file", wrong)
            assert r.returncode == 12 and r.stderr.startswith("kvpack: wrong_key:"), r.stderr
        assert _everything(store) == before


def test_repair_never_deletes_an_object_a_save_rewrote_while_it_ran(tmp_path):
    """``repair`` reads a damaged chunk; before it quarantines the cut, a ``generate`` in
    another process heals it (quarantines the cut, recomputes, rewrites the chunk with good
    bytes and commits the cut again). repair must not then delete the rewritten chunk by its
    name: the republished cut would be missing it (before: it was deleted). Encrypted, so the
    republished cut is another manifest (fresh salts), which repair leaves indexed."""
    from kvpack.testing.faults import FaultyOps

    store = PosixBackend().new(tmp_path, encrypted=True)
    eng = _engine()
    session_with(eng, TOKENS, store)
    expected = generate(eng, None, TOKENS, max_new_tokens=3).tokens
    top = store.find_deepest(TOKENS, eng.layout, eng.ids())
    damaged, _size = _top_only_chunk(store, top.manifest_id)
    store.env.write(damaged, store.env.read(damaged)[:3000])
    healed = []

    def heal_meanwhile(path: str, data: bytes) -> bytes:
        if path.endswith(damaged) and not healed:
            healed.append(generate(eng, store, TOKENS, max_new_tokens=3))  # the other process
        return data  # repair goes on with the damaged bytes it read

    repairer = PackStore.open(store.path, ops=FaultyOps(corrupt_reads=heal_meanwhile))
    repairer.repair()
    assert healed and healed[0].quarantined and healed[0].tokens == expected
    assert len(store.env.read(damaged)) > 3000  # the good copy the heal wrote is still there
    assert store.verify(read_data=True)["ok"]
    again = generate(eng, store, TOKENS, max_new_tokens=3)
    assert again.reused_tokens == len(TOKENS) and again.tokens == expected and not again.quarantined


def test_refused_s3_locations_leave_nothing_and_never_echo_the_secret(tmp_path):
    """``store init s3://...`` refused for a credentials file readable by others, or for an
    endpoint nothing listens on: one line, no root key created, the secret in no output."""
    secret = "s3cr3t" + os.urandom(8).hex()
    creds = tmp_path / "creds.json"
    creds.write_text(json.dumps({"access_key_id": "kvpackprobe", "secret_access_key": secret}))
    key = tmp_path / "root.key"
    common = ["--root-key-file", str(key), "--endpoint", "http://127.0.0.1:9"]
    os.chmod(creds, 0o644)
    r = _kvpack("store", "init", "s3://kvpack-probe/x", "--s3-credentials", str(creds), *common)
    assert r.returncode == 2 and r.stderr.startswith("kvpack: key:") and "0644" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and secret not in r.stderr + r.stdout and not key.exists()
    os.chmod(creds, 0o600)
    r = _kvpack("store", "init", "s3://kvpack-probe/x", "--s3-credentials", str(creds), *common, "--debug")
    assert r.returncode == 1 and "kvpack: io:" in r.stderr and "127.0.0.1:9" in r.stderr, r.stderr
    assert secret not in r.stderr + r.stdout and not key.exists()


@pytest.mark.parametrize("where", ["posix", "s3"])
def test_a_wrong_key_on_a_store_without_a_key_check_is_refused_too(request, tmp_path, where):
    """A store.json without ``key_check`` (written before kvpack recorded one): a wrong root
    key used to open it, every cut then failed authentication, and ``repair`` quarantined
    every cut of the store. Open now tries the packs of the first indexed cuts and refuses
    ``wrong_key`` when none authenticates; the right key opens it as before."""
    from kvpack.rootkey import create_root_key

    backend = _backend(request, where)
    store = backend.new(tmp_path, encrypted=True)
    eng = _engine()
    session_with(eng, TOKENS[:600], store)
    config = json.loads(store.env.read("store.json"))
    del config["key_check"]
    store.env.write("store.json", json.dumps(config).encode())
    wrong = str(tmp_path / "wrong.key")
    create_root_key(wrong)
    before = _everything(store)
    with pytest.raises(StoreError) as info:
        backend.reopen(store, root_key_file=wrong)
    assert info.value.category == "wrong_key" and "no key check" in info.value.message
    assert _everything(store) == before
    right = backend.reopen(store)
    found = right.lookup_restore(TOKENS[:600], eng.new_session())
    assert found.hit is not None and found.hit.cut == 600


def test_the_vllm_planner_on_s3_plans_healthy_cuts_and_quarantines_nothing(request, tmp_path):
    """The planner's size check of the chunks it will load goes through the store's
    environment: it used ``os.stat`` of the chunk's path, which for an S3 store is no file,
    so every healthy cut was ``incomplete`` and the planner quarantined it (a lookup on a
    5-cut bucket emptied its index). A chunk really missing is still found."""
    from kvpack.integrations.vllm.prefix import PrefixPlanner

    store, eng, _server = _published(request, "s3", tmp_path)
    entries = names(store, "index/")
    plan = PrefixPlanner(store, eng.layout, eng.ids(), block_size=16).lookup(TOKENS, 0)
    assert plan.hit is not None and plan.stored == len(TOKENS) and not plan.refusals
    assert names(store, "index/") == entries and not names(store, "quarantine/")
    top = store.find_deepest(TOKENS, eng.layout, eng.ids())
    name, _size = _top_only_chunk(store, top.manifest_id)
    store.env.delete(name)
    plan = PrefixPlanner(store, eng.layout, eng.ids(), block_size=16).lookup(TOKENS, 0)
    assert plan.refusals == ["incomplete"] and 0 < plan.stored < len(TOKENS)
    assert len(names(store, "quarantine/")) == 1 and not store.env.exists(f"index/{top.node_id.hex()}")


@pytest.mark.parametrize("kind", ["missing_pack", "missing_logits", "malformed_index_entry"])
def test_the_vllm_planner_quarantines_the_damaged_entries_it_passes_over(request, tmp_path, kind):
    """The vLLM connector's scheduler-side lookup (PrefixPlanner) takes the next shallower
    cut past an index entry whose cut lost its pack or logits object, or that is malformed,
    and quarantines that entry with a receipt, as generate's lookup does (it used to skip it
    and leave it for every later lookup to skip again)."""
    from kvpack.integrations.vllm.prefix import PrefixPlanner

    store, eng, _server = _published(request, "posix", tmp_path)
    damaged = store.find_deepest(TOKENS, eng.layout, eng.ids())
    _damage(store, eng, kind)
    assert not [i for i in store.env.list("quarantine/")]
    plan = PrefixPlanner(store, eng.layout, eng.ids(), block_size=16).lookup(TOKENS, 0)
    assert 0 < plan.stored < damaged.cut  # the next shallower cut
    receipts = [i.name for i in store.env.list("quarantine/")]
    assert receipts, "no receipt for the damaged entry"
    assert not store.env.exists(f"index/{damaged.node_id.hex()}")
    assert store.find_deepest(TOKENS, eng.layout, eng.ids()).cut == plan.stored


@pytest.mark.parametrize("kind", ["missing_pack", "malformed_index_entry"])
def test_the_decode_nodes_ladder_quarantines_the_damaged_entries_it_passes_over(request, tmp_path, kind):
    """The daemons' reuse ladder plans from the durable tier past a damaged index entry (a
    shallower cut) and quarantines that entry with a receipt, like generate's lookup."""
    from kvpack.node.ladder import Ladder, ResidentRadix

    store, eng, _server = _published(request, "posix", tmp_path)
    damaged = store.find_deepest(TOKENS, eng.layout, eng.ids())
    _damage(store, eng, kind)
    plan = Ladder(eng, ResidentRadix(), store).plan(TOKENS)  # the damaged cut is the whole prompt
    assert plan.tier == "durable" and 0 < plan.matched < damaged.cut
    assert [i.name for i in store.env.list("quarantine/")], "no receipt for the damaged entry"
    assert not store.env.exists(f"index/{damaged.node_id.hex()}")


@pytest.mark.skipif(not hasattr(os, "truncate"), reason="sparse files")
def test_an_index_entry_of_gigabytes_is_malformed_without_being_read_into_memory(tmp_path):
    """A damaged (or hostile) index entry of 8 GiB -- a sparse file here -- is read for at
    most MAX_INDEX_ENTRY_BYTES + 1 bytes: lookups pass over it, healing quarantines it (its
    compare-and-swap version hashed blockwise), repair and verify stay within memory. Run in
    a child limited to 3 GiB of address space: before, the lookup read the whole file
    (MemoryError)."""
    import resource

    store = PosixBackend().new(tmp_path)
    eng = _engine()
    session_with(eng, TOKENS, store)
    top = store.find_deepest(TOKENS, eng.layout, eng.ids())
    with open(store.index_path(top.node_id), "r+b") as fh:
        fh.truncate(8 << 30)
    child = f"""
import sys
sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))!r})
from tests.store.helpers import TOKENS, engine
from kvpack.store import PackStore
eng = engine()
store = PackStore.open({store.path!r})
assert store.find_deepest(TOKENS, eng.layout, eng.ids()).cut == 1024
found = store.lookup_restore(TOKENS, eng.new_session())
assert found.hit.cut == 1024 and len(found.quarantined) == 1, found
assert found.quarantined[0]["index_entry_removed"], found.quarantined
assert store.verify(read_data=False)["ok"]
print("ok")
"""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    assert not os.path.exists(store.index_path(top.node_id))


def test_a_heal_crashing_at_any_step_leaves_no_entry_naming_an_object_it_deleted(tmp_path):
    """``lookup_restore`` meets cut 768 with a damaged chunk of 512's delta (shared by both
    chains): it quarantines 768, then 512 as its damaged parent, and deletes the chunk. A
    simulated power loss (FaultyOps) before each durable step of that healing: afterwards no
    index entry names an object the heal deleted (verify reports no missing chunk, only the
    damage there was), and the next lookup finishes the job (256 restores). Before, the
    chunk was deleted right after 768's entry and before 512's quarantine, so a crash there
    left 512 indexed naming a deleted chunk."""
    import shutil

    from kvpack.store.packstore import chunk_name
    from kvpack.testing.faults import FaultyOps, SimulatedCrash

    base = PosixBackend().new(str(tmp_path), "base")
    eng = _engine()
    session_with(eng, TOKENS[:768], base)
    chain = base.load_chain(base.find_deepest(TOKENS[:512], eng.layout, eng.ids()).manifest_id)
    below = {ref.content_id for m in chain[1:] for _k, _s, ref in m.chunk_refs()}
    # a chunk of layer 0 (full span: every restore reads it; a windowed layer's chunk outside
    # the window would not be read, and the cut would restore)
    own = sorted(ref.content_id for key, _s, ref in chain[0].chunk_refs() if str(key).startswith("0/") and ref.content_id not in below)
    flip(base, chunk_name(own[0]), -1)
    before = base.verify(read_data=True)
    assert not before["ok"] and not any("missing" in p for p in before["problems"])
    crashes = 0
    for step in range(1, 200):
        path = str(tmp_path / f"crash{step}")
        shutil.copytree(base.path, path)
        try:
            found = PackStore.open(path, ops=FaultyOps(crash_at=step)).lookup_restore(TOKENS[:768], eng.new_session())
        except SimulatedCrash:
            crashes += 1
        else:
            assert found.hit is not None and found.hit.cut == 256 and len(found.quarantined) == 2, (step, found)
            break  # the healing ended before this step: every crash point was tried
        after = PackStore.open(path).verify(read_data=True)
        assert not any("missing" in p for p in after["problems"]), (step, after["problems"])
        assert set(after["problems"]) <= set(before["problems"]), step
        live = eng.new_session()
        assert PackStore.open(path).lookup_restore(TOKENS[:768], live).hit.cut == 256 and live.position == 256
        shutil.rmtree(path)
    assert crashes >= 6, crashes  # two receipts, two entry removals, the chunk's deletion
