"""Publication of one cut: chunks, pack and final logits (all durable) -> index entry.

Every object is written through the store's environment. Chunk objects are created only if
absent (content-addressed objects are immutable: an encrypted re-encoding must never replace
bytes a manifest already names by digest); an existing chunk is reused only after it verified
against the plaintext being saved, and replaced when it does not (that is how a damaged chunk
heals). The index entry is the commit point and a compare-and-swap: a concurrent publisher
of the same cut never loses its entry, and an entry naming an incomplete cut is replaced.

On backends whose gc runs beside publishers (S3: a grace period instead of a lock) every
object the new cut references is young when the entry is written: reused objects older than
a quarter of the grace period are rewritten (same bytes), the parent is protected by the
publisher's lease, and a publication that outlived half the grace period is not committed.
Before its commit a publisher protects its own cut by its lease and checks whether a gc sweep
ran beside it; if one did it waits for the sweep to end and commits only if every object of
the cut's chain is still there (else it publishes once more as a full cut): see
``_commit_safely`` and docs/store.md "gc and leases".
"""

from __future__ import annotations

import hashlib
import queue
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from ..engine.contract import CacheLayout, SpanExport
from ..errors import FormatError, StoreError
from ..format import constants as C
from ..format.build import build_schema
from ..format.chunk import ChunkHeader, decode_chunk_one_pass, encode_chunk, encode_chunk_parts
from ..format.identity import InputCutId, PrefixChain, chunk_content_id
from ..format.objects import ChunkRef, Manifest, PayloadState
from ..format.pack import encode_pack
from .env import PUBLISH, GcSeen, Lease, ObjectMissing
from .mapping import logits_key, logits_span, semantic_id
from .packstore import INDEX_ABSENT, MAX_INDEX_ENTRY_BYTES, PackStore, SaveReport, _Context, _engine_ids, chunk_name, index_name, logits_name, pack_name


def save(
    store: PackStore,
    session: Any,
    *,
    cut: int | None = None,
    logits: bytes | memoryview | None = None,
    aux: Sequence[tuple[bytes, bytes]] = (),
    max_delta_depth: int = C.MAX_DELTA_DEPTH,
    prefix_only: bool = False,
) -> SaveReport:
    """Publish a cut of the session.

    By default the cut is the session's position and its logits are the session's last
    row. An earlier ``cut`` may be saved with the ``logits`` row captured at that point
    (e.g. at each 256-token boundary during prefill), provided every layer still holds
    the rows the cut needs (always true for full-span layers).

    ``prefix_only=True`` saves a *prefix cut* for engines that never expose the logits row
    at a cut (vLLM): its logits object carries the manifest id alone (a prefix marker,
    authenticated and bound to the manifest like a row), so the cut is found only by
    ``find_deepest(require_logits=False)`` and restored only by
    ``restore(require_logits=False)``, as a prefix the engine extends by computing.
    """
    kw: dict[str, Any] = dict(cut=cut, logits=logits, aux=aux, prefix_only=prefix_only)
    try:
        return _save_once(store, session, max_delta_depth=max_delta_depth, **kw)
    except _SweptUnder:
        # a gc sweep beside this publication removed objects its cut references (an old chunk
        # it reused, or a forgotten ancestor of its parent): publish once more as a full cut,
        # which writes again whatever is missing and builds on no parent
        return _save_once(store, session, max_delta_depth=0, **kw)


class _SweptUnder(StoreError):
    """A gc sweep beside the publication removed objects its cut references (not committed)."""


def _save_once(
    store: PackStore,
    session: Any,
    *,
    cut: int | None,
    logits: bytes | memoryview | None,
    aux: Sequence[tuple[bytes, bytes]],
    max_delta_depth: int,
    prefix_only: bool,
) -> SaveReport:
    t0 = time.perf_counter()
    layout: CacheLayout = session.layout
    ids = _engine_ids(session)
    cut = session.position if cut is None else cut
    logits = _checked_logits(session, layout, cut, logits, prefix_only)
    ctx = store.context(layout, ids, aux)
    chain = store._chain(ctx, session.tokens[:cut])
    node = chain.nodes[-1]
    with store.env.lease(PUBLISH) as lease:
        started = store.env.now()
        seen = store.env.gc_seen()  # before anything is read (see _commit_safely)
        try:
            existing = store._read_index(node.node_id)
        except StoreError:
            existing = None  # malformed: the commit below replaces it
        if existing is not None and store._complete(existing):
            return SaveReport(existing.hex(), cut, "existing", -1, seconds=time.perf_counter() - t0)
        t_lookup = time.perf_counter()
        schema, report = _plan(store, chain, ctx, cut, max_delta_depth, lease)
        t_plan = time.perf_counter()
        refs = _write_chunks(store, session, ctx, schema, report, cut)
        t_chunks = time.perf_counter()
        payload = tuple(PayloadState(fs.key, tuple(refs[fs.key])) for fs in ctx.family.states)
        manifest = Manifest(store.tenant, store.epoch, semantic_id(ids), InputCutId(node.node_id, ctx.aux_root, cut), ctx.family, schema, payload)
        mbytes = manifest.encode()
        mid = manifest.manifest_id(mbytes)
        salt, nonce = _salt_nonce(store)
        pack = encode_pack(manifest, store.keys, encrypted=store.encrypted, salt=salt, nonce=nonce, manifest_bytes=mbytes)
        lobj = _logits_object(store, ctx, layout, cut, mid, logits)
        _make_durable(
            store,
            (lambda: store.env.commit("chunks/"), lambda: store.env.write(pack_name(mid), pack), lambda: store.env.write(logits_name(mid), lobj)),
        )
        t_durable = time.perf_counter()
        _check_young(store, started)
        lease.check()
        committed = _commit_safely(store, lease, seen, node.node_id, mid, started)
    report.manifest_id = committed.hex()
    if committed != mid:
        report.kind = "existing"  # a concurrent publisher committed this cut first
    report.bytes_written += len(pack) + len(lobj)
    report.seconds = time.perf_counter() - t0
    report.phases = {
        "lookup_s": t_lookup - t0,
        "plan_s": t_plan - t_lookup,
        "chunks_s": t_chunks - t_plan,
        "durable_s": t_durable - t_chunks,
        "commit_s": t0 + report.seconds - t_durable,
    }
    return report


def _make_durable(store: PackStore, steps: Sequence[Callable[[], object]]) -> None:
    """Run the independent durability steps that precede the index entry (the chunk
    directory's fsync, the pack, the logits object) and return once all are done. Each ends
    in its own fsyncs, so with more than one worker they run at once (their flushes
    overlap); one worker runs them in order (the crash tests number its steps). The first
    failure is raised after every step has ended: nothing is committed then."""
    if store.workers <= 1:
        for step in steps:
            step()
        return
    with ThreadPoolExecutor(len(steps)) as pool:
        futures = [pool.submit(step) for step in steps]
        wait(futures)
    for fut in futures:
        fut.result()


def _checked_logits(session: Any, layout: CacheLayout, cut: int, logits: bytes | memoryview | None, prefix_only: bool) -> bytes | memoryview:
    """Refuse early what could never be a complete cut (nothing is written before this).
    A prefix cut's row is empty (its logits object holds the manifest id alone)."""
    if not 0 < cut <= session.position:
        raise StoreError("usage", f"cannot save cut {cut} of a session at position {session.position}")
    if prefix_only:
        if logits is not None:
            raise StoreError("usage", "a prefix cut carries no logits row")
        logits = b""
    elif logits is None:
        if cut != session.position:
            raise StoreError("incomplete", "an earlier cut needs the logits row captured at that cut")
        logits = session.export_logits()  # refuse early: a cut without its logits is never written
    if not prefix_only and memoryview(logits).nbytes != layout.logits_bytes:
        raise StoreError("incomplete", "final-logits row has the wrong size")
    for spec in layout.layers:
        need_lo = spec.retained_range(cut)[0]
        if need_lo < cut and layout.retained_range(spec.index, session.position)[0] > need_lo:
            raise StoreError("usage", f"layer {spec.index} no longer holds the window of cut {cut}")
    return logits


def _plan(store: PackStore, chain: PrefixChain, ctx: _Context, cut: int, max_depth: int, lease: Lease) -> tuple[Any, SaveReport]:
    """The schema of the new pack: a delta on the deepest committed aligned strict prefix
    when the depth allows, else a full compaction."""
    parent = _pick_parent(store, chain, ctx, max_depth, lease)
    if parent is not None:
        parent_manifest, parent_id = parent
        depth = parent_manifest.schema.depth + 1
        schema = build_schema(ctx.family, cut, parent=(parent_id, parent_manifest.cut), depth=depth, max_chunk_bytes=store.chunk_bytes)
        return schema, SaveReport("", cut, "delta", depth)
    return build_schema(ctx.family, cut, max_chunk_bytes=store.chunk_bytes), SaveReport("", cut, "full", 0)


def _pick_parent(store: PackStore, chain: PrefixChain, ctx: _Context, max_depth: int, lease: Lease) -> tuple[Manifest, bytes] | None:
    """The deepest committed aligned strict prefix whose chain verifies, protected by the
    publisher's lease and read again after that. Nodes this process read as absent moments
    ago (the lookup before this save: ``packstore.INDEX_ABSENT``) are not read again: on S3
    that was one GET per 256 tokens (31 of a 74-request 8,192-token save). Skipping an entry
    committed meanwhile by another process costs only a shallower parent or a full cut."""
    nodes = [node for node in reversed(chain.nodes[:-1]) if node.reusable]
    if store._remote_index:
        nodes = [node for node in nodes if not INDEX_ABSENT.known_absent(store.path, node.node_id)]
    for node, mid in store._index_deepest_first(nodes):
        if isinstance(mid, StoreError):
            return None
        if mid is None:
            continue
        # protect the parent from gc first, then make sure it is still the committed one
        lease.protect([mid.hex()])
        try:
            if store._read_index(node.node_id) != mid:
                return None
            manifest = store.load_chain(mid)[0]  # never build on a chain that does not verify
        except StoreError:
            return None  # an unreadable parent: write a full cut rather than build on it
        if manifest.family != ctx.family or manifest.schema.depth + 1 > max_depth:
            return None
        return manifest, mid
    return None


def _salt_nonce(store: PackStore) -> tuple[bytes, bytes]:
    if not store.encrypted:
        return bytes(16), bytes(12)
    return secrets.token_bytes(16), secrets.token_bytes(12)


def _logits_object(store: PackStore, ctx: _Context, layout: CacheLayout, cut: int, mid: bytes, logits: bytes | memoryview) -> bytes:
    salt, nonce = _salt_nonce(store)
    chunk = encode_chunk(
        keys=store.keys,
        family_digest=ctx.family_digest,
        key=logits_key(layout),
        span=logits_span(layout, cut, prefix_only=not memoryview(logits).nbytes),
        plaintext=mid + bytes(logits),
        codec=C.CODEC_RAW,
        encrypted=store.encrypted,
        salt=salt,
        nonce=nonce,
    )
    return bytes(chunk.obj)


def _check_young(store: PackStore, started: float) -> None:
    """On a grace-period backend, refuse to commit a publication that took so long that gc
    may already consider the objects it wrote first as old garbage."""
    grace = store.env.gc_grace_s
    if grace and store.env.now() - started > grace / 2:
        raise StoreError("io", f"publication took longer than half the gc grace period ({grace:.0f} s): not committed")


def _commit_safely(store: PackStore, lease: Lease, seen: GcSeen | None, node_id: bytes, mid: bytes, started: float) -> bytes:
    """Commit the index entry unless a gc sweep beside this publication may have deleted
    an object of the cut's chain (S3; ``seen``: the gc epoch and sweep leases seen when the
    publication began, before it read anything).

    The cut is protected by this publisher's lease first: a sweep that reads the leases
    after that keeps its whole chain. A sweep that read them before either was alive when
    the publication began (its lease was listed then), or began since (the epoch changed),
    or is alive now (listed now). Then wait until those sweeps have ended and check that
    every object of the chain is still there; a sweep that ended before the publication
    began deleted nothing it read afterwards. docs/store.md "gc and leases" has the argument.
    """
    if seen is None:
        return _commit_index(store, node_id, mid)  # gc excludes publishers (POSIX lock)
    lease.protect([mid.hex()])
    now = store.env.gc_seen() or GcSeen(None, frozenset())
    sweeps = seen.sweeping | now.sweeping
    if sweeps or now.epoch != seen.epoch:
        _wait_for_gc(store, sweeps, deadline=started + store.env.gc_grace_s / 2)
        missing = _missing_objects(store, mid)
        if missing:
            raise _SweptUnder("locked", f"a gc sweep beside this publication removed {len(missing)} object(s) of its cut ({missing[0]}): not committed")
        _check_young(store, started)
        lease.check()
    return _commit_index(store, node_id, mid)


def _wait_for_gc(store: PackStore, sweeps: frozenset[str], *, deadline: float) -> None:
    """Wait until none of the named gc sweep leases is alive (a dead gc's lapses after two
    lease times); past ``deadline`` (on the store's clock) refuse the commit."""
    while True:
        live = sweeps & (store.env.gc_seen() or GcSeen(None, frozenset())).sweeping
        if not live:
            return
        left = deadline - store.env.now()
        if left <= 0:
            raise StoreError("locked", f"a gc sweep ({sorted(live)[0]}) outlasted half the gc grace period beside this publication: not committed")
        time.sleep(min(0.1, left))


def _missing_objects(store: PackStore, mid: bytes) -> list[str]:
    """Objects of the cut's chain (packs, chunks, its logits) that are not there (HEADs in
    parallel; a pack that does not load counts as missing with its whole chain)."""
    try:
        chain = store.load_chain(mid)
    except StoreError as exc:
        return [exc.message]
    names = sorted({chunk_name(ref.content_id) for manifest in chain for _key, _span, ref in manifest.chunk_refs()} | {logits_name(mid)})
    with ThreadPoolExecutor(max(4, store.env.io_parallelism)) as pool:
        found = list(pool.map(store.env.exists, names))
    return [name for name, there in zip(names, found) if not there]


def _commit_index(store: PackStore, node_id: bytes, mid: bytes) -> bytes:
    """Write the index entry (create, or replace an entry naming an incomplete cut) with a
    compare-and-swap. Returns the manifest id the entry holds afterwards."""
    name = index_name(node_id)
    data = mid.hex().encode() + b"\n"
    try:
        return _commit_index_cas(store, name, data, node_id, mid)
    finally:
        if store._remote_index:
            INDEX_ABSENT.present(store.path, node_id)  # whatever won, the node holds an entry (or may)


def _commit_index_cas(store: PackStore, name: str, data: bytes, node_id: bytes, mid: bytes) -> bytes:
    for _ in range(16):
        if store.env.write_if(name, data, None):
            return mid
        try:
            cur = store._read_index_versioned(node_id)
        except StoreError:
            got = store.env.read_versioned(name, max_bytes=MAX_INDEX_ENTRY_BYTES)  # malformed: replace it
            cur = (b"", got[1]) if got is not None else None
        if cur is None:
            continue  # removed meanwhile: try to create it again
        other, version = cur
        if other == mid or (other and store._complete(other)):
            return other
        if store.env.write_if(name, data, version):
            return mid
    raise StoreError("locked", f"index entry {node_id.hex()} kept changing under 16 compare-and-swap attempts")


# -- chunks ---------------------------------------------------------------------------------


def save_threads(store: PackStore) -> int:
    """Threads a save writes chunk objects on (write + fsync each): ``2 * store.workers``,
    so the disk always has as many objects in flight as in the store's plain write pattern,
    while ``store.workers`` more threads hash and encode the next chunks ahead of them
    (hashlib and the AEAD release the GIL on large buffers, and so do the system calls).
    One worker means one thread doing both: the crash tests number the steps of a save.
    ``store.save_writers`` sets another count (above one worker)"""
    if store.workers <= 1:
        return 1
    return max(1, store.save_writers) if store.save_writers else 2 * store.workers


def _write_chunks(store: PackStore, session: Any, ctx: _Context, schema: Any, report: SaveReport, cut: int) -> dict:
    refs: dict = {fs.key: [None] * len(rs.spans) for fs, rs in zip(ctx.family.states, schema.states)}
    jobs = [(fs, i, span) for fs, rs in zip(ctx.family.states, schema.states) for i, span in enumerate(rs.spans)]
    threads = save_threads(store)
    existing = _ExistingSeen()
    # Export from the engine on this thread (engines need not be thread-safe); hash and
    # encode on the hashing pool, which hands each object to the writing pool: a thread
    # that hashed, then wrote and fsynced, left the disk without its write meanwhile (on the
    # H200 the save ran at 0.65 of the write pattern on the same threads). Results are
    # collected as they complete (no head-of-line wait), at most 2 * threads chunks in
    # flight in both stages together (their export buffers are pinned on CUDA).
    with ThreadPoolExecutor(threads) as writers, ThreadPoolExecutor(store.workers if threads > 1 else 1) as hashers:
        staged = writers if threads > 1 else None
        flight = _InFlight()
        try:
            for (fs, i, span), (plaintext, release) in zip(jobs, _span_exports(store, session, jobs, cut)):
                flight.add(hashers.submit(_write_one_chunk, store, ctx, fs, i, span, plaintext, release, staged, existing), release)
                _advance(flight, refs, report, block=False)
                while len(flight.pending) >= 2 * threads:
                    _advance(flight, refs, report, block=True)
            while flight.pending:
                _advance(flight, refs, report, block=True)
        except BaseException:
            for fut, release in flight.pending.items():
                if fut.cancel() and release is not None:
                    release()  # never ran: its buffer goes back here
            raise
    return refs  # the chunk directory is committed with the pack (_make_durable)


class _InFlight:
    """A save's chunk futures in flight and the order they finished in. Each future puts
    itself on one queue when done, so taking the finished ones costs O(1) each;
    ``concurrent.futures.wait(FIRST_COMPLETED)`` instead locks every pending future to add
    and remove a waiter on every call (up to 4 x workers futures, a call per chunk), all
    under the GIL that the hashing and writing threads need back after every hash and
    request (py-spy --gil of an S3 save at 4 threads: 11 % of the GIL samples in that
    wake-up path)."""

    def __init__(self) -> None:
        self.pending: dict[Future, Any] = {}  # future -> its export buffer's release (or None)
        self._done: queue.SimpleQueue[Future] = queue.SimpleQueue()

    def add(self, fut: Future, release: Any) -> None:
        self.pending[fut] = release
        fut.add_done_callback(self._done.put)  # at once if it already finished

    def finished(self, *, block: bool) -> list[Future]:
        """The futures finished since the last call (``block``: wait for at least one)."""
        done = [self._done.get()] if block else []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done


def _advance(flight: _InFlight, refs: dict, report: SaveReport, *, block: bool) -> None:
    """Collect finished chunks; a hashed chunk whose write was queued (a Future) stays
    in flight as that write. ``block``: wait for at least one to finish."""
    for fut in flight.finished(block=block):
        del flight.pending[fut]
        result = fut.result()
        if isinstance(result, Future):
            flight.add(result, None)  # its export buffer was handed back before the write
        else:
            _record(result, refs, report)


def _span_plaintext(session: Any, layer: int, role: str, start: int, stop: int, cut: int) -> memoryview | bytes | bytearray:
    """Rows [start, stop) of a state at ``cut``; rows outside a windowed layer's window at
    the cut are zero (see mapping.py)."""
    lo, hi = session.layout.retained_range(layer, cut)
    a, b = max(start, lo), min(stop, hi)
    if a <= start and b >= stop:
        return session.export_rows(layer, role, start, stop)
    row = session.layout.layer(layer).row_bytes
    out = bytearray((stop - start) * row)
    if a < b:
        out[(a - start) * row : (b - start) * row] = session.export_rows(layer, role, a, b)
    return out


def _span_exports(store: PackStore, session: Any, jobs: list, cut: int) -> Iterator[tuple[Any, Any]]:
    """``(plaintext, release)`` per job, in order. Sessions offering ``export_spans``
    (the CUDA adapter: asynchronous copies through pinned buffers, running ahead of the
    hashing) get every span at once; ``release`` (or None) frees the buffer after use."""
    export_spans = session.export_spans if isinstance(session, SpanExport) else None
    if export_spans is None:
        for fs, _i, span in jobs:
            yield _span_plaintext(session, fs.key.layer, fs.key.name, span.token_start, span.token_start + span.token_count, cut), None
        return
    plan = []
    for fs, _i, span in jobs:
        start, stop = span.token_start, span.token_start + span.token_count
        lo, hi = session.layout.retained_range(fs.key.layer, cut)
        plan.append((fs.key.layer, fs.key.name, start, stop, max(start, lo), min(stop, hi)))
    exports = export_spans([(layer, role, a, b) for layer, role, _s, _e, a, b in plan if a < b], depth=2 * store.workers)
    try:
        for layer, _role, start, stop, a, b in plan:
            if a <= start and b >= stop:
                yield next(exports)
                continue
            # rows outside a windowed layer's window at the cut are zero (as _span_plaintext)
            row = session.layout.layer(layer).row_bytes
            out = bytearray((stop - start) * row)
            if a < b:
                view, release = next(exports)
                out[(a - start) * row : (b - start) * row] = view
                if release is not None:
                    release()
            yield out, None
    finally:
        exports.close()


def _record(result: tuple, refs: dict, report: SaveReport) -> None:
    key, index, ref, written, plaintext_bytes = result
    refs[key][index] = ref
    report.plaintext_bytes += plaintext_bytes
    if written:
        report.chunks_written += 1
        report.bytes_written += ref.object_bytes
    else:
        report.chunks_reused += 1


class _ExistingSeen:
    """Whether a create-only chunk write of this save found its object already there. Where
    the env skips the probe (S3), the chunks of one cut tend to be all new (a first save) or
    all stored (a republished cut, a full compaction over shared rows); once one PUT answered
    412 the rest of the save probes first, so a republication does not upload every chunk
    for nothing (measured: 32 stored chunks republished in 0.27 s probing, 0.37-0.54 s
    PUT-first)."""

    def __init__(self) -> None:
        self.seen = False


def _write_one_chunk(
    store: PackStore,
    ctx: _Context,
    fs: Any,
    index: int,
    span: Any,
    plaintext: Any,
    release: Any = None,
    writers: Any = None,
    existing: _ExistingSeen | None = None,
) -> tuple | Future:
    """Content id, reuse or encode, write: one chunk. ``release`` (a pinned export buffer's)
    runs as soon as the plaintext is no longer read: after encoding, before the write.
    With ``writers`` (a pool) the write is queued there and its Future returned."""
    try:
        content_id = chunk_content_id(
            store.keys.chunk_identity,
            store.tenant,
            ctx.family_digest,
            fs.key.layer,
            fs.key.name,
            span.token_start,
            span.token_count,
            span.plaintext_offset,
            plaintext,
        )
        name = chunk_name(content_id)
        if store.env.probe_before_create or (existing is not None and existing.seen):
            ref = _existing_ref(store, ctx, fs, span, name, content_id)
            if ref is not None:
                return fs.key, index, ref, False, span.plaintext_bytes
        salt, nonce = _salt_nonce(store)
        chunk = encode_chunk_parts(
            keys=store.keys,
            family_digest=ctx.family_digest,
            key=fs.key,
            span=span,
            plaintext=plaintext,
            codec=fs.codec,
            encrypted=store.encrypted,
            salt=salt,
            nonce=nonce,
            content_id=content_id,
        )
        # A raw chunk's payload part is the export buffer itself. A host export (a view of
        # the session's rows) is written straight from it, the parts gathered by one writev:
        # no joined copy. A pinned export buffer (release set) is joined into one object
        # first and handed back now, so the exporter can reuse it during write and fsync.
        body: Any = chunk.parts if release is None else b"".join(chunk.parts)
    finally:
        if release is not None:
            release()
    if writers is not None:
        return writers.submit(_store_chunk, store, ctx, fs, index, span, name, content_id, body, chunk.ref, existing)
    return _store_chunk(store, ctx, fs, index, span, name, content_id, body, chunk.ref, existing)


def _store_chunk(
    store: PackStore,
    ctx: _Context,
    fs: Any,
    index: int,
    span: Any,
    name: str,
    content_id: bytes,
    body: Any,
    ref: ChunkRef,
    existing: _ExistingSeen | None = None,
) -> tuple:
    """Write one encoded chunk object (create-only, durable but for its directory entry)."""
    if not store.env.write(name, body, create_only=True, batch=True):
        if existing is not None:
            existing.seen = True
        # another publisher created it meanwhile: adopt theirs if it verifies, else replace
        theirs = _existing_ref(store, ctx, fs, span, name, content_id)
        if theirs is not None:
            return fs.key, index, theirs, False, span.plaintext_bytes
        store.env.write(name, body, batch=True)
    return fs.key, index, ref, True, span.plaintext_bytes


def _existing_ref(store: PackStore, ctx: _Context, fs: Any, span: Any, name: str, content_id: bytes) -> ChunkRef | None:
    """Reuse a stored chunk with this content id (dedup across packs of the family), but
    only one that verifies completely for this span: a damaged object is never built on
    (it is replaced instead, which heals every cut naming it)."""
    try:
        obj = store.env.read(name)
    except ObjectMissing:
        return None
    if len(obj) < C.HEADER_BYTES:
        return None
    h = ChunkHeader.parse(obj)
    if h.content_id != content_id or h.object_bytes != len(obj) or h.key_epoch != store.epoch or h.encrypted != store.encrypted:
        return None  # damaged or foreign: write a fresh copy over it
    ref = ChunkRef(h.content_id, h.object_key, hashlib.sha256(obj).digest(), h.key_epoch, h.plaintext_bytes, len(obj))
    try:
        decode_chunk_one_pass(obj, ref=ref, span=span, tenant=store.tenant, family=ctx.family, key=fs.key, keys=store.keys, family_digest=ctx.family_digest)
    except FormatError:
        return None
    if store.env.gc_grace_s:
        _refresh_if_old(store, name, obj)
    return ref


def _refresh_if_old(store: PackStore, name: str, data: bytes | None = None) -> None:
    """Rewrite (same bytes) an object older than a quarter of the gc grace period, so that
    every object a new index entry references is young when the entry is written."""
    info = store.env.stat(name)
    if info is None or store.env.now() - info.mtime <= store.env.gc_grace_s / 4:
        return
    store.env.write(name, data if data is not None else store.env.read(name))
