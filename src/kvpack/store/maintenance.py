"""Checking, healing and collecting a pack store: ls, verify, quarantine, repair, forget, gc.

* ``verify`` checks every indexed cut like ``restic check``: the pack chain always, the
  binding of each index entry to its manifest (an entry may only name a manifest of its own
  cut), and with ``read_data`` every chunk and logits object byte by byte.
* ``quarantine`` takes one cut out of the index after it failed verification (a restore
  refused it, or ``repair`` found it bad): a JSON receipt under ``quarantine/`` records what
  failed and why, the index entry is removed with a compare-and-swap (only if it still names
  that cut), and objects that are wrong for their own name are deleted so a republication
  writes them afresh instead of building on them. The cut is then a miss: recompute,
  republish.
* ``repair`` quarantines every cut ``verify --read-data`` finds bad and drops malformed
  index entries; ``forget`` removes the entries naming one cut.
* ``gc`` keeps what index entries and live leases reach and deletes the rest -- on a
  grace-period backend only what is older than the grace period.

Nothing here decides *how* bytes are stored (the environment does) or restores anything.
"""

from __future__ import annotations

import copy
import hashlib
import json
import secrets
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import FormatError, StoreError, UsageError
from ..format.chunk import ChunkHeader, decode_chunk, decode_chunk_one_pass
from ..format.objects import ChunkRef, Manifest
from .env import GC, RESTORE, Lease, ObjectInfo, seconds_setting
from .packstore import DEFAULT_MAINTENANCE_DEADLINE_S, MAX_INDEX_ENTRY_BYTES, Hit, PackStore, chunk_name, index_name, logits_name, pack_name

RECEIPT_FORMAT = "kvpack-quarantine"


def _deadline_error(location: str, op: str, seconds: float, progress: str) -> StoreError:
    return StoreError(
        "io",
        f"{location}: store {op} stopped at its deadline of {seconds:g} s (the storage answered too slowly or not at all; "
        f"--deadline / KVPACK_MAINTENANCE_DEADLINE_S): {progress}",
    )


def open_bounded(location: str, op: str, *, deadline_s: float | None = None, **kw: Any) -> tuple[PackStore, float]:
    """Open the store at ``location`` for the maintenance operation ``op`` (the CLI's verify,
    repair, forget, gc) with its whole deadline already running: reading ``store.json`` is
    bounded by it too. Returns the store and the deadline (``time.monotonic()``) to pass on.
    ``kw``: ``root_key_file``, ``endpoint``, ``credentials_file``."""
    from .location import make_env

    seconds = deadline_s if deadline_s is not None else seconds_setting("KVPACK_MAINTENANCE_DEADLINE_S", DEFAULT_MAINTENANCE_DEADLINE_S)
    at = time.monotonic() + seconds
    env = make_env(location, endpoint=kw.get("endpoint"), credentials_file=kw.get("credentials_file"))
    try:
        store = PackStore.open(env.with_deadline(at), root_key_file=kw.get("root_key_file"))
    except StoreError as exc:
        env.close()
        if exc.category == "io" and env.with_deadline(at) is not env and time.monotonic() >= at - 2.0:  # as _Deadline.margin
            raise _deadline_error(env.location, op, seconds, "nothing was changed (the store could not be opened)") from None
        raise
    store.maintenance_deadline_s = seconds
    return store, at


class _Deadline:
    """The whole deadline of one maintenance operation (``PackStore.maintenance_deadline_s``,
    ``KVPACK_MAINTENANCE_DEADLINE_S``, the CLI's ``--deadline``). ``store`` is a view whose
    environment bounds every request by it (S3: per-request timeouts from what is left,
    refused at once past it; :meth:`StorageEnv.with_deadline`); :meth:`check` refuses between
    steps on every backend (a POSIX call blocked in the kernel cannot be abandoned). Past it
    the operation ends with one ``io`` line saying what it had done (``progress``) and that
    nothing else was changed."""

    def __init__(self, store: PackStore, op: str, deadline: float | None) -> None:
        self.op = op
        self.seconds = store.maintenance_deadline_s
        self.at = time.monotonic() + self.seconds if deadline is None else deadline
        env = store.env.with_deadline(self.at)
        #: a failure this close to the deadline is the deadline's: no request fits any more
        #: (S3: the shortest a deadline view gives one, a 1 s connect and a 1 s read)
        self.margin = 0.0
        if env is store.env:
            self.store = store
        else:
            from .s3 import DEADLINE_CONNECT_S, DEADLINE_TIMEOUTS_S

            self.margin = DEADLINE_CONNECT_S + DEADLINE_TIMEOUTS_S[-1]
            self.store = copy.copy(store)
            self.store.env = env
        self.location = store.env.location
        #: what the operation has done so far (the refusal's second half)
        self.progress = "nothing was changed"

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def error(self) -> StoreError:
        return _deadline_error(self.location, self.op, self.seconds, self.progress)

    def check(self) -> None:
        if self.passed():
            raise self.error()

    @contextmanager
    def running(self) -> Iterator[None]:
        """Turn an ``io`` failure past the deadline (a request refused by the deadline view,
        or one that timed out on its way there) into the one deadline line."""
        try:
            yield
        except StoreError as exc:
            if exc.category == "io" and time.monotonic() >= self.at - self.margin:
                raise self.error() from None
            raise


def index_entries(store: PackStore, problems: list[str] | None = None) -> list[tuple[bytes, bytes]]:
    """(node id, manifest id) of every well-formed index entry; malformed ones are
    reported into ``problems`` when given (and otherwise skipped)."""
    out = []
    for info in store.env.list("index/"):
        name = info.name.rpartition("/")[2]
        if name.startswith("."):
            continue
        try:
            node = bytes.fromhex(name)
            mid = store._read_index(node)
        except (ValueError, StoreError) as exc:
            if isinstance(exc, StoreError):
                _verdict_only(exc)  # an unreadable entry is not a malformed one: gc would drop its cut
            if problems is not None:
                problems.append(f"index entry {name}: {exc}")
            continue
        if mid is not None:
            out.append((node, mid))
    return sorted(out)


def ls(store: PackStore) -> list[dict]:
    rows: list[dict[str, Any]] = []
    for _node, mid in index_entries(store):
        try:
            chain = store.load_chain(mid)
        except StoreError as exc:
            rows.append({"manifest_id": mid.hex(), "error": str(exc)})
            continue
        top = chain[0]
        rows.append(
            {
                "manifest_id": mid.hex(),
                "tokens": top.cut.token_count,
                "kind": "delta" if top.schema.parent else "full",
                "depth": top.schema.depth,
                "packs": len(chain),
                "states": len(top.family.states),
                "segment_bytes": top.schema.segment_restored_bytes,
                "complete_bytes": top.schema.complete_restored_bytes,
                "has_logits": store.env.exists(logits_name(mid)),
            }
        )
    return rows


class _Checker:
    """Checks cuts one by one, remembering chunk verdicts so shared chunks are read once."""

    def __init__(self, store: PackStore, read_data: bool) -> None:
        self.store = store
        self.read_data = read_data
        self.chunks_checked = 0
        self.verdicts: dict[tuple[bytes, bytes], dict | None] = {}  # (content id, digest) -> problem
        #: (content id, digest) of every chunk reference that failed, with its problem
        self.bad: dict[tuple[bytes, bytes], dict] = {}
        self.sizes: dict[str, int] | None = None if read_data else {i.name: i.size for i in store.env.list("chunks/")}

    def cut(self, node: bytes, mid: bytes) -> list[dict]:
        """Problems of one indexed cut: ``{"object": name or None, "problem": text,
        "remove": whether the object is wrong for its own name}``."""
        store = self.store
        try:
            chain = store.load_chain(mid)
            store.check_binding(node, mid, chain[0])
        except StoreError as exc:
            _verdict_only(exc)
            return [self._pack_problem(mid, exc)]
        problems = []
        for manifest in chain:
            for key, span, ref in manifest.chunk_refs():
                verdict = self.chunk(manifest, key, span, ref)
                if verdict is not None:
                    problems.append(verdict)
        try:
            if self.read_data:
                store._read_logits(mid, chain[0])
            elif not store.env.exists(logits_name(mid)):
                problems.append({"object": None, "problem": f"cut {mid.hex()}: no final-logits object", "remove": False})
        except StoreError as exc:
            _verdict_only(exc)
            digest = _digest_of(store, logits_name(mid)) if exc.category == "corrupt" else None
            problems.append({"object": logits_name(mid), "problem": f"{exc.category}: {exc.message}", "remove": digest is not None, "digest": digest})
        except FormatError as exc:
            digest = _digest_of(store, logits_name(mid))
            problems.append({"object": logits_name(mid), "problem": f"refused {exc.category}: {exc.message}", "remove": digest is not None, "digest": digest})
        return problems

    def _pack_problem(self, mid: bytes, exc: StoreError) -> dict:
        text = f"cut {mid.hex()}: {exc.category}: {exc.message}"
        # a pack that holds another manifest, or fails its own checks, is wrong for its name
        bad_pack = exc.category == "corrupt" and "index entry" not in exc.message and mid.hex() in exc.message
        digest = _digest_of(self.store, pack_name(mid)) if bad_pack else None
        return {"object": pack_name(mid) if bad_pack else None, "problem": text, "remove": digest is not None, "digest": digest}

    def chunk(self, manifest: Manifest, key: Any, span: Any, ref: ChunkRef) -> dict | None:
        seen = (ref.content_id, ref.object_digest)
        if seen in self.verdicts:
            return self.verdicts[seen]
        name = chunk_name(ref.content_id)
        verdict = None
        if self.sizes is not None:
            if self.sizes.get(name) != ref.object_bytes:
                verdict = {"object": None, "problem": f"chunk {ref.content_id.hex()}: missing or wrong size", "remove": False}
        else:
            verdict = self._read_chunk(manifest, key, span, ref, name)
        self.chunks_checked += 1
        self.verdicts[seen] = verdict
        if verdict is not None:
            self.bad[seen] = verdict
        return verdict

    def _read_chunk(self, manifest: Manifest, key: Any, span: Any, ref: ChunkRef, name: str) -> dict | None:
        store = self.store
        try:
            obj = store.env.read(name)
        except FileNotFoundError:
            return {"object": None, "problem": f"chunk {ref.content_id.hex()}: missing", "remove": False}
        args = dict(span=span, tenant=store.tenant, family=manifest.family, key=key, keys=store.keys)
        try:
            decode_chunk_one_pass(obj, ref=ref, **args)
            return None
        except FormatError as exc:
            problem = f"chunk {ref.content_id.hex()}: refused {exc.category}: {exc.message}"
        # Wrong for this manifest; is it still a valid object for its own name (another
        # encoding of the same plaintext)? Then only the cut is bad, not the object.
        return {"object": name, "problem": problem, "remove": not _valid_for_name(obj, ref, args), "digest": hashlib.sha256(obj).hexdigest()}


def _digest_of(store: PackStore, name: str) -> str | None:
    """SHA-256 (hex) of the object as it is now, or None if it is gone: quarantine deletes an
    object only while it still holds exactly these bytes."""
    try:
        return hashlib.sha256(store.env.read(name)).hexdigest()
    except FileNotFoundError:
        return None


def _verdict_only(exc: StoreError) -> None:
    """Re-raise what says nothing about the stored bytes (a read failing with EIO, a lock):
    only ``corrupt`` and ``incomplete`` are verdicts on a cut. A failing disk must refuse
    verify and repair with one line, never have repair quarantine every cut it could not
    read."""
    if exc.category not in ("corrupt", "incomplete"):
        raise exc


def _valid_for_name(obj: bytes, ref: ChunkRef, args: dict) -> bool:
    try:
        h = ChunkHeader.parse(obj)
        own = ChunkRef(h.content_id, h.object_key, hashlib.sha256(obj).digest(), h.key_epoch, h.plaintext_bytes, len(obj))
        if own.content_id != ref.content_id:
            return False
        decode_chunk(obj, ref=own, **args)
        return True
    except (FormatError, ValueError, IndexError, struct.error):  # struct: shorter than a header
        return False


def verify(store: PackStore, *, read_data: bool = True, deadline: float | None = None) -> dict:
    """Check every indexed cut: packs and index bindings (always), and with ``read_data``
    every chunk and logits object byte by byte (restic-style ``check --read-data``).

    Read-only: it writes nothing to the store (no lease object, no lock file, no receipt),
    so it runs with read-only S3 credentials or on a read-only mount. Where gc may run beside
    it without waiting (S3, or a directory without a lock file yet), a cut whose index entry
    no longer names it once its check found problems was forgotten or replaced meanwhile:
    counted in ``withdrawn``, not reported as a problem.

    Ends by ``deadline`` (``time.monotonic()``; default: ``store.maintenance_deadline_s``
    from now), else refuses ``io`` (it never changes anything)."""
    problems: list[str] = []
    cuts = withdrawn = 0
    dl = _Deadline(store, "verify", deadline)
    dl.progress = "verify changes nothing"
    store = dl.store
    # read-only: no lease object, no lock file created, no receipt (env.check_lease)
    with dl.running(), store.env.check_lease():
        checker = _Checker(store, read_data)
        entries = index_entries(store, problems)
        for node, mid in entries:
            dl.check()
            dl.progress = f"{cuts + withdrawn} of {len(entries)} cuts checked; verify changes nothing"
            found = checker.cut(node, mid)
            if found and not _still_indexed(store, node, mid):
                withdrawn += 1  # forgotten or replaced while checked (gc may have taken its objects)
                continue
            problems.extend(p["problem"] if p["problem"].startswith("cut ") else f"cut {mid.hex()}: {p['problem']}" for p in found)
            cuts += 1
    return {"cuts": cuts, "chunks_checked": checker.chunks_checked, "problems": problems, "ok": not problems, "withdrawn": withdrawn}


def _still_indexed(store: PackStore, node: bytes, mid: bytes) -> bool:
    """Whether the entry at ``node`` still names ``mid``; an entry that became malformed
    meanwhile counts as still there (its cut's problems stand, and verify reports no
    withdrawal for damage). An I/O error refuses like any other read."""
    try:
        return store._read_index(node) == mid
    except StoreError as exc:
        _verdict_only(exc)
        return True


def quarantine(store: PackStore, node: bytes, mid: bytes | None, problems: list[dict], *, by: str, deferred: dict[str, str | None] | None = None) -> dict:
    """Take the cut at ``node`` out of the index (only if it still names ``mid``), with a
    receipt; delete objects that are wrong for their own name. Returns the receipt.

    ``deferred``: delete nothing here; add the objects to remove (name: digest of the damaged
    bytes) to it instead, and leave ``objects_removed`` empty (``repair`` removes them once
    every bad cut is out of the index, so no entry ever names a deleted object)."""
    receipt: dict[str, Any] = {
        "format": RECEIPT_FORMAT,
        "version": 1,
        "time": round(time.time(), 3),
        "by": by,
        "node_id": node.hex(),
        "manifest_id": mid.hex() if mid is not None else None,
        "problems": [p["problem"] for p in problems],
        "objects_removed": sorted({p["object"] for p in problems if p.get("remove") and p.get("object")}),
        "index_entry_removed": False,
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    receipt_name = f"quarantine/{stamp}-{(mid or node).hex()[:16]}-{secrets.token_hex(4)}.json"
    store.env.write(receipt_name, json.dumps(receipt, indent=1, sort_keys=True).encode() + b"\n", create_only=True)
    got = store.env.read_versioned(index_name(node), max_bytes=MAX_INDEX_ENTRY_BYTES)  # an oversized one parses as malformed
    if got is not None:
        try:
            named: bytes | None = bytes.fromhex(got[0].strip().decode())
        except (ValueError, UnicodeDecodeError):
            named = None
        if named is not None and (len(named) != 32 or len(got[0]) > MAX_INDEX_ENTRY_BYTES):
            named = None  # hex of the wrong length (a truncated entry) is malformed too
        # mid None: a malformed entry, removed only while it still is one (a save may have
        # replaced it with a valid entry since it was read)
        if (named is None and mid is None) or (mid is not None and named == mid):
            receipt["index_entry_removed"] = store.env.delete(index_name(node), if_version=got[1])
    doomed = {p["object"]: p.get("digest") for p in problems if p.get("remove") and p.get("object")}
    receipt["receipt"] = receipt_name
    if deferred is not None:
        for name in receipt["objects_removed"]:
            deferred.setdefault(name, doomed[name])
        receipt["planned"] = receipt["objects_removed"]
        receipt["objects_removed"] = []
        return receipt
    receipt["objects_removed"] = [name for name in receipt["objects_removed"] if _delete_if_unchanged(store, name, doomed[name])]
    return receipt


def _delete_if_unchanged(store: PackStore, name: str, digest: str | None) -> bool:
    """Delete ``name`` only while it still holds the damaged bytes the check read (SHA-256
    ``digest``), with a compare-and-swap on its version: a publisher healing the cut
    meanwhile rewrites it with good bytes under the same name, and deleting those would
    break the cut it republished."""
    if digest is None:
        return False
    got = store.env.read_versioned(name)
    if got is None or hashlib.sha256(got[0]).hexdigest() != digest:
        return False
    return store.env.delete(name, if_version=got[1])


def quarantine_after_refusal(store: PackStore, hit: Hit, exc: StoreError) -> dict | None:
    """A restore refused ``hit``: quarantine it, unless its index entry moved meanwhile (a
    concurrent republication or forget: then it is only a miss)."""
    try:
        if store._read_index(hit.node_id) != hit.manifest_id:
            return None
    except StoreError:
        pass  # a malformed entry is quarantined below like any other bad one
    with store.env.lease(RESTORE, protects=[hit.manifest_id.hex()]):
        checker = _Checker(store, read_data=True)
        problems = checker.cut(hit.node_id, hit.manifest_id)
    refusal = {"object": None, "problem": f"restore refused {exc.category}: {exc.message}", "remove": False}
    # the damaged objects go last, once the ancestors sharing them are out of the index too:
    # no entry is ever left naming an object this deleted (a crash in between included)
    deferred: dict[str, str | None] = {}
    receipt = quarantine(store, hit.node_id, hit.manifest_id, [refusal, *problems], by="restore", deferred=deferred)
    receipt["ancestors"] = _quarantine_ancestors(store, hit.manifest_id, checker)
    _remove_deferred(store, [receipt], deferred)
    return receipt


def _remove_deferred(store: PackStore, receipts: list[dict], deferred: dict[str, str | None], dl: "_Deadline | None" = None, done: str = "") -> None:
    """Delete the objects :func:`quarantine` deferred (each only while it still holds the
    damaged bytes), once every cut naming them is out of the index; each deleted object is
    reported in ``objects_removed`` of the first receipt that planned it."""
    gone: set[str] = set()
    for name, digest in sorted(deferred.items()):
        if dl is not None:
            dl.check()
        if _delete_if_unchanged(store, name, digest):
            gone.add(name)
        if dl is not None:
            dl.progress = (
                f"{done}, {len(gone)} of {len(deferred)} damaged objects deleted (the rest are unreferenced: gc removes them); nothing else was changed"
            )
    for receipt in receipts:
        receipt["objects_removed"] = [name for name in receipt.pop("planned", ()) if name in gone]
        gone.difference_update(receipt["objects_removed"])


def quarantine_incomplete(store: PackStore, node: bytes, mid: bytes | None) -> dict | None:
    """Quarantine the entry at ``node`` if it still names ``mid`` and that cut's pack or
    final-logits object is missing (``find_deepest`` skips such entries), or -- ``mid``
    None -- if it is still malformed; None otherwise."""
    if mid is None:
        try:
            store._read_index(node)
            return None  # well-formed (or gone) by now
        except StoreError as exc:
            if exc.category != "corrupt":
                return None
            problem = {"object": None, "problem": f"{index_name(node)}: malformed: {exc.message}", "remove": False}
            return quarantine(store, node, None, [problem], by="restore")
    try:
        if store._read_index(node) != mid:
            return None
    except StoreError:
        return None
    missing = [name for name in (pack_name(mid), logits_name(mid)) if not store.env.exists(name)]
    if not missing:
        return None  # complete after all (republished meanwhile)
    problems = [{"object": None, "problem": f"cut {mid.hex()}: incomplete: {name} is missing", "remove": False} for name in missing]
    return quarantine(store, node, mid, problems, by="restore")


def _quarantine_ancestors(store: PackStore, mid: bytes, checker: _Checker) -> list[dict]:
    """Quarantine the cuts below ``mid`` in its delta chain that reference a chunk the check
    found bad (a damaged chunk of a parent is damage of the parent's own cut too). Without
    this the next shallower cut was tried only on the next lookup attempt -- and, past
    ``max_attempts``, left indexed, so the republication built its delta on that very parent
    and published a cut that failed again (the damaged object had just been removed).
    Returns their receipts."""
    if not checker.bad:
        return []
    try:
        chain = store.load_chain(mid)
    except StoreError:
        return []
    receipts = []
    below: set[tuple[bytes, bytes]] = set()
    refs_below = []
    for manifest in reversed(chain[1:]):  # from the full cut up: a cut is bad if its chain is
        below.update((ref.content_id, ref.object_digest) for _k, _s, ref in manifest.chunk_refs())
        refs_below.append((manifest, sorted(below & checker.bad.keys())))
    for manifest, bad in reversed(refs_below):
        if not bad:
            continue
        node, amid = manifest.cut.token_root, manifest.manifest_id()
        try:
            if store._read_index(node) != amid:
                continue  # not indexed any more (forgotten, replaced, quarantined)
        except StoreError:
            continue  # malformed: repair drops it
        problems = [{"object": None, "problem": f"delta parent of quarantined cut {mid.hex()}: {checker.bad[key]['problem']}", "remove": False} for key in bad]
        receipts.append(quarantine(store, node, amid, problems, by="restore"))
    return receipts


def repair(store: PackStore, *, deadline: float | None = None) -> dict:
    """Quarantine every cut that fails ``verify --read-data`` and drop malformed entries.

    In two passes: every bad cut is taken out of the index first (receipt, then the entry's
    compare-and-swap removal), and only then are the objects that are wrong for their own
    name deleted (each only while it still holds the damaged bytes). So wherever it stops --
    its ``deadline`` (default: ``store.maintenance_deadline_s`` from now; past it one ``io``
    line), a crash, a failing disk -- no index entry names an object it deleted, and a
    ``verify`` finds no problem it did not find before: cuts not reached yet are still
    indexed with the damage they had, a receipt may exist for a cut whose entry is still
    there (``index_entry_removed`` false), and damaged objects not deleted yet are
    unreferenced (gc removes them). Running it again finishes the job."""
    receipts = []
    checked = 0
    deferred: dict[str, str | None] = {}
    dl = _Deadline(store, "repair", deadline)
    store = dl.store
    with dl.running(), store.env.lease(RESTORE):
        checker = _Checker(store, read_data=True)
        for info in list(store.env.list("index/")):
            dl.check()
            name = info.name.rpartition("/")[2]
            try:
                node = bytes.fromhex(name)
                if len(node) != 32:
                    raise ValueError("index name is not 32 bytes of hex")
                mid = store._read_index(node)
            except (ValueError, StoreError) as exc:
                if isinstance(exc, StoreError):
                    _verdict_only(exc)  # EIO reading it says nothing about the entry
                # a malformed entry (or a stray object under index/): drop it with a receipt
                receipts.append(_drop_malformed(store, info, str(exc)))
            else:
                if mid is None:
                    continue
                checked += 1
                problems = checker.cut(node, mid)
                if problems:
                    receipts.append(quarantine(store, node, mid, problems, by="repair", deferred=deferred))
            dl.progress = (
                f"{checked} cuts checked, {len(receipts)} quarantined (receipts written, index entries removed; "
                "damaged objects not deleted yet, unreferenced: gc removes them); nothing else was changed: run it again"
            )
        # every bad cut is out of the index: only now delete what is wrong for its own name
        _remove_deferred(store, receipts, deferred, dl, f"{checked} cuts checked, {len(receipts)} quarantined")
    return {"cuts_checked": checked, "quarantined": len(receipts), "receipts": receipts}


def _drop_malformed(store: PackStore, info: ObjectInfo, why: str) -> dict:
    problem = {"object": None, "problem": f"{info.name}: malformed: {why}", "remove": False}
    try:
        node = bytes.fromhex(info.name.rpartition("/")[2])
        stray = len(node) != 32 or index_name(node) != info.name
    except ValueError:
        node, stray = hashlib.sha256(info.name.encode()).digest(), True
    receipt = quarantine(store, node, None, [problem], by="repair")
    if stray:
        # no index entry could live under this name: nothing replaces it concurrently
        receipt["index_entry_removed"] = store.env.delete(info.name)
    return receipt


def forget(store: PackStore, manifest_id: bytes | str, *, deadline: float | None = None) -> dict:
    """Remove every index entry naming ``manifest_id`` (its objects become garbage); a str is
    a hex prefix that must name exactly one indexed cut. Each removal is one compare-and-swap;
    nothing else is written or deleted, so a stop at its ``deadline`` (default:
    ``store.maintenance_deadline_s`` from now; one ``io`` line) leaves some of those entries
    removed and the rest in place, every object untouched."""
    removed = 0
    dl = _Deadline(store, "forget", deadline)
    store = dl.store
    with dl.running():
        named = index_entries(store)
        if isinstance(manifest_id, str):
            manifest_id = _unique_cut(named, manifest_id)
        entries = [node for node, mid in named if mid == manifest_id]
        for node in entries:
            dl.check()
            got = store.env.read_versioned(index_name(node))
            if got is not None and store.env.delete(index_name(node), if_version=got[1]):
                removed += 1
            dl.progress = f"{removed} of the {len(entries)} index entries naming cut {manifest_id.hex()} removed, no object deleted: run it again"
    if not removed:
        raise StoreError("miss", f"no index entry names cut {manifest_id.hex()} (never stored, or forgotten or quarantined already)")
    return {"manifest_id": manifest_id.hex(), "index_entries_removed": removed}


def _unique_cut(named: list[tuple[bytes, bytes]], text: str) -> bytes:
    """The one indexed cut whose manifest id (hex) starts with ``text``."""
    matches = sorted({mid.hex() for _node, mid in named if mid.hex().startswith(text)})
    if not matches:
        raise StoreError("miss", f"no committed cut has a manifest id starting with {text}")
    if len(matches) > 1:
        raise UsageError("usage", f"{text} is the prefix of {len(matches)} cuts ({', '.join(m[:16] for m in matches[:4])} ...): give more digits")
    return bytes.fromhex(matches[0])


def gc(store: PackStore, *, deadline: float | None = None) -> dict:
    """Remove what no indexed cut (nor a live lease) references. POSIX runs under the
    exclusive lock, so it never races a publication; S3 runs beside publishers, deletes only
    unreferenced objects older than the grace period, and holds a sweep lease from before it
    reads the leases until its last delete, which publishers wait for before they commit
    (docs/store.md "gc and leases").

    Ends by ``deadline`` (default: ``store.maintenance_deadline_s`` from now; a directory
    store's wait for its lock counts), else one ``io`` line: the unreferenced objects deleted
    by then stay deleted, the rest stay for the next gc; nothing an index entry or a lease
    references was touched (entries whose cut did not load may have been quarantined)."""
    removed = {"chunks": 0, "packs": 0, "logits": 0, "index": 0, "temp": 0, "bytes": 0, "quarantined": 0}
    dl = _Deadline(store, "gc", deadline)
    store = dl.store
    env = store.env

    def progress() -> None:
        n = removed["chunks"] + removed["packs"] + removed["logits"] + removed["temp"]
        dl.progress = (
            f"{n} unreferenced objects removed ({removed['bytes']} bytes) and {removed['quarantined']} unloadable index entries quarantined; "
            "nothing an index entry or a lease references was touched, the rest waits for the next gc"
        )

    with dl.running(), env.lease(GC):
        started = env.now()
        live_packs: set[str] = set()
        live_chunks: set[str] = set()
        marked: set[tuple[bytes, bytes]] = set()
        _mark(store, removed, marked, live_packs, live_chunks, dl)
        progress()
        # listed before the sweep lease, so publishers that see it wait only for the deletes
        # (an object written after this listing is young: never a candidate)
        candidates = {prefix: _old_objects(env, prefix, started) for prefix, _suffix, _label in _SWEPT}
        with env.sweeping() as sweep:
            for mid_hex in env.protected():
                try:
                    _add_chain(store, bytes.fromhex(mid_hex), live_packs, live_chunks)
                except (ValueError, StoreError) as exc:
                    if isinstance(exc, StoreError):
                        # a read that failed (io, the deadline) says nothing about the cut:
                        # skipping it would let the sweep delete what a restore is reading
                        _verdict_only(exc)
                    continue  # a protected cut that does not load (damaged, gone) protects nothing
            if env.gc_grace_s:
                # A delta committed after the listing above may build on a parent no entry seen
                # there names (forgotten meanwhile), and its publisher may have released the lease
                # protecting that parent before the leases were read: the parent's objects are old,
                # so neither rule keeps them. Entries written up to now are marked again here, after
                # the leases were read. (A publisher that protected its cut only after the leases
                # were read sees this sweep and waits for it: publish._commit_safely.)
                _mark(store, removed, marked, live_packs, live_chunks, dl)
            for prefix, suffix, label in _SWEPT:
                live = live_chunks if label == "chunks" else live_packs  # a cut's logits share its pack's id
                _sweep(store, candidates[prefix], prefix, live, suffix, label, started, removed, sweep, dl, progress)
            removed["temp"] += env.sweep_incomplete(started - env.gc_grace_s) if env.gc_grace_s else 0
    return removed


def _mark(store: PackStore, removed: dict, marked: set[tuple[bytes, bytes]], live_packs: set[str], live_chunks: set[str], dl: _Deadline) -> None:
    """Add the chains of every index entry not in ``marked`` to the live sets (and to
    ``marked``); quarantine entries whose cut cannot be loaded."""
    for node, mid in index_entries(store):
        if (node, mid) in marked:
            continue
        dl.check()
        marked.add((node, mid))
        try:
            _add_chain(store, mid, live_packs, live_chunks)
        except StoreError as exc:
            if exc.category not in ("corrupt", "incomplete"):
                raise
            # an entry whose cut cannot be loaded is useless: quarantine the entry, keep the
            # files until nothing references them
            problem = {"object": None, "problem": f"cut {mid.hex()}: {exc.category}: {exc.message}", "remove": False}
            quarantine(store, node, mid, [problem], by="gc")
            removed["index"] += 1
            removed["quarantined"] += 1


def _add_chain(store: PackStore, mid: bytes, live_packs: set[str], live_chunks: set[str]) -> None:
    for manifest in store.load_chain(mid):
        live_packs.add(manifest.manifest_id().hex())
        for _key, _span, ref in manifest.chunk_refs():
            live_chunks.add(ref.content_id.hex())


def _still_old(env: Any, name: str, started: float, grace: float) -> bool:
    """Whether ``name`` is still older than the grace period right before gc deletes it. A
    publisher reusing an old unreferenced chunk rewrites it (publish._refresh_if_old) and may
    commit a cut naming it while gc works through a listing taken before that rewrite; the
    listing's time is stale by then. A rewrite landing between this check and the delete is
    not seen here: that publisher sees the sweep lease and re-checks its objects after the
    sweep (publish._commit_safely)."""
    info = env.stat(name)
    return info is not None and started - info.mtime > grace


#: what gc sweeps: (prefix, object suffix, counter)
_SWEPT = (("chunks/", ".kvchk", "chunks"), ("packs/", ".kvpkp", "packs"), ("logits/", ".kvchk", "logits"))


def _old_objects(env: Any, prefix: str, started: float) -> list[ObjectInfo]:
    """Objects under ``prefix`` older than the grace period (young ones may belong to a
    publication in flight); every object where gc excludes publishers with a lock."""
    grace = env.gc_grace_s
    return [info for info in env.list(prefix) if not grace or started - info.mtime > grace]


def _sweep(
    store: PackStore,
    candidates: list[ObjectInfo],
    prefix: str,
    live: set[str],
    suffix: str,
    label: str,
    started: float,
    removed: dict,
    sweep: Lease | None,
    dl: _Deadline,
    progress: Any,
) -> None:
    env = store.env
    grace = env.gc_grace_s
    try:
        for info in candidates:
            name = info.name[len(prefix) :]
            if name.startswith(".") and name.endswith(".tmp"):
                kind = "temp"  # left by a crashed writer (POSIX)
            elif name.endswith(suffix) and name[: -len(suffix)] not in live:
                kind = label
            else:
                continue
            if grace and not _still_old(env, info.name, started, grace):
                continue  # rewritten since the listing: a publisher reused it (or it is gone)
            dl.check()
            if sweep is not None:
                # a sweep whose lease lapsed may look finished (or dead) to a publisher, which
                # then commits without waiting: stop before deleting anything more
                sweep.check()
            if env.delete(info.name, batch=True):
                removed["bytes"] += info.size
                removed[kind] += 1
                progress()
    except BaseException:
        try:
            env.commit(prefix)  # what was unlinked stays unlinked (POSIX: the directory fsync), a stop included
        except Exception:
            pass  # the refusal in flight says more; an unlink not made durable is garbage again
        raise
    env.commit(prefix)
