"""The filesystem pack store: save a session's cut, find the deepest stored prefix, restore it
verified, check the repository, collect garbage.

Layout of a store directory (docs/store.md)::

    store.json                 tenant name, key epoch, encryption flag, chunk size (no secrets)
    root.key                   32-byte root (0600) unless kept elsewhere (--root-key-file)
    chunks/<content id>.kvchk  KVCHK1 chunk objects, content-addressed, shared by packs
    packs/<manifest id>.kvpkp  one KVPKP1 pack per cut (full, or delta against its parent)
    logits/<manifest id>.kvchk the exact final-logits row of that cut (a KVCHK1 object)
    index/<prefix node id>     the manifest id committed at that prefix-chain node
    lock                       flock: publishers shared, gc exclusive

Names are HMAC outputs (content ids, manifest ids, keyed prefix-chain node ids): no token id
or text appears in any path, file or log. Publication order is chunks -> pack -> logits ->
index entry, each through :mod:`kvpack.durable`; the index entry is the commit point, so a
crash anywhere leaves the previous generation intact and only unreferenced files behind
(which ``gc`` removes).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ..durable import REAL_OPS, FileOps, atomic_write, durable_unlink, ensure_dir, sync_dir
from ..engine.contract import CacheLayout, IdentityIds
from ..errors import FormatError, StoreError
from ..format import constants as C
from ..format.build import build_schema
from ..format.chunk import ChunkHeader, decode_chunk, encode_chunk
from ..format.identity import InputCutId, PrefixChain, auxiliary_root, chunk_content_id, prefix_context
from ..format.keys import KeySchedule
from ..format.objects import ChunkRef, Family, Manifest, PayloadState, Span, StateKey
from ..format.pack import decode_pack, encode_pack
from ..rootkey import create_root_key, load_root_key
from .mapping import LOGITS_NAME, family_for, logits_family, logits_key, logits_span, semantic_id, tenant_id

STORE_FORMAT = "kvpack-store"
STORE_VERSION = 1
DEFAULT_CHUNK_BYTES = C.MAX_CHUNK_PLAINTEXT


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class Hit:
    """A committed cut that is a prefix of the queried tokens."""

    manifest_id: bytes
    cut: int
    node_id: bytes


@dataclass
class SaveReport:
    manifest_id: str
    cut: int
    kind: str  # "full" | "delta" | "existing"
    depth: int
    chunks_written: int = 0
    chunks_reused: int = 0
    bytes_written: int = 0
    plaintext_bytes: int = 0
    seconds: float = 0.0


@dataclass
class RestoreReport:
    manifest_id: str
    cut: int
    packs: int
    chunks_verified: int
    bytes_verified: int
    seconds: float
    phases: dict = field(default_factory=dict)
    #: chunks whose object digest and content ID were computed on the "device" or "host"
    hashed_on: dict = field(default_factory=dict)


@dataclass
class _Context:
    layout: CacheLayout
    ids: IdentityIds
    family: Family
    family_digest: bytes
    aux_root: bytes
    prefix_context: bytes


class PackStore:
    """One store directory for one tenant and key epoch."""

    def __init__(self, path: str, config: dict, root: bytes, *, ops: FileOps = REAL_OPS) -> None:
        self.path = os.path.abspath(path)
        self.config = config
        self.ops = ops
        self.tenant_name = config["tenant"]
        self.tenant = tenant_id(self.tenant_name)
        self.epoch = int(config["key_epoch"])
        self.encrypted = bool(config["encrypted"])
        self.chunk_bytes = int(config.get("chunk_bytes", DEFAULT_CHUNK_BYTES))
        self.keys = KeySchedule.derive(root, self.tenant, self.epoch)
        # hashing/AEAD/writes run on this many threads; 1 makes the I/O order deterministic
        self.workers = _workers()
        # restore staging by whole planes: "auto" on CUDA installs, "always" (tests), "never"
        self.plane_staging = "auto"
        # where a restore's two long hashes run: "auto" (on the GPU when the install is on
        # a CUDA device and the kernel compiles), "host", or "device" (forced; on a CPU
        # install the same pipeline runs with hashlib, which is how CI tests it)
        self.verify_on = os.environ.get("KVPACK_VERIFY_ON", "auto")
        # device verify: waves in flight (each on its own stream; at most 8, the default
        # number of hardware queues CUDA maps streams onto: more would serialise), the pinned
        # + device staging they share, and (None: derived from both) objects per wave
        self.device_waves = 8
        self.device_staging_bytes = int(os.environ.get("KVPACK_DEVICE_STAGING_BYTES", str(4 << 30)))
        self.wave_chunks: int | None = None
        # device verify: how many of a restore's last chunks the host threads verify while the
        # device hashes the rest; None = as many as the workers verify in one kernel latency.
        # Off by default: on the H200 it helped some runs and not others (docs/benchmarks.md)
        self.device_host_tail: int | None = 0

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def init(
        cls,
        path: str,
        *,
        tenant: str = "default",
        encrypted: bool = False,
        root_key_file: str | None = None,
        key_epoch: int = 1,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        ops: FileOps = REAL_OPS,
    ) -> "PackStore":
        path = os.path.abspath(path)
        if os.path.exists(os.path.join(path, "store.json")):
            raise StoreError("usage", f"{path} already holds a store")
        if not 1 <= chunk_bytes <= C.MAX_CHUNK_PLAINTEXT:
            raise StoreError("usage", "chunk size must be 1..4 MiB")
        ensure_dir(path, ops=ops)
        for sub in ("chunks", "packs", "logits", "index"):
            ensure_dir(os.path.join(path, sub), ops=ops)
        if root_key_file is None:
            key_path = os.path.join(path, "root.key")
            create_root_key(key_path)
            key_ref = "root.key"
        else:
            key_ref = os.path.abspath(root_key_file)
            if not os.path.exists(key_ref):
                create_root_key(key_ref)
        config = {
            "format": STORE_FORMAT,
            "version": STORE_VERSION,
            "tenant": tenant,
            "key_epoch": key_epoch,
            "encrypted": encrypted,
            "chunk_bytes": chunk_bytes,
            "root_key_file": key_ref,
        }
        atomic_write(os.path.join(path, "store.json"), json.dumps(config, indent=2, sort_keys=True).encode() + b"\n", ops=ops, mode=0o600)
        return cls.open(path, ops=ops)

    @classmethod
    def open(cls, path: str, *, root_key_file: str | None = None, ops: FileOps = REAL_OPS) -> "PackStore":
        path = os.path.abspath(path)
        try:
            with open(os.path.join(path, "store.json"), "rb") as fh:
                config = json.loads(fh.read())
        except FileNotFoundError:
            raise StoreError("usage", f"{path} is not a kvpack store (no store.json); run 'kvpack store init'") from None
        except (OSError, ValueError) as exc:
            raise StoreError("corrupt", f"{path}/store.json unreadable: {exc}") from None
        if config.get("format") != STORE_FORMAT or config.get("version") != STORE_VERSION:
            raise StoreError("corrupt", f"{path}/store.json: unknown store format/version")
        key_path = root_key_file or config.get("root_key_file") or "root.key"
        if not os.path.isabs(key_path):
            key_path = os.path.join(path, key_path)
        from ..errors import SecurityError

        try:
            root = load_root_key(key_path)
        except SecurityError as exc:
            raise StoreError("key", exc.message) from None
        return cls(path, config, root, ops=ops)

    # -- paths and locking -----------------------------------------------------------------
    def _p(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    def chunk_path(self, content_id: bytes) -> str:
        return self._p("chunks", content_id.hex() + ".kvchk")

    def pack_path(self, manifest_id: bytes) -> str:
        return self._p("packs", manifest_id.hex() + ".kvpkp")

    def logits_path(self, manifest_id: bytes) -> str:
        return self._p("logits", manifest_id.hex() + ".kvchk")

    def index_path(self, node_id: bytes) -> str:
        return self._p("index", node_id.hex())

    @contextmanager
    def _lock(self, exclusive: bool) -> Iterator[None]:
        fd = os.open(self._p("lock"), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    # -- identity scoping ------------------------------------------------------------------
    def context(self, layout: CacheLayout, ids: IdentityIds, aux: Sequence[tuple[bytes, bytes]] = ()) -> _Context:
        family = family_for(layout, ids)
        digest = family.digest()
        aux_root = auxiliary_root(self.keys.prefix, self.tenant, list(aux))
        ctx = prefix_context(self.keys.prefix, self.tenant, semantic_id(ids).digest(), digest, aux_root)
        return _Context(layout, ids, family, digest, aux_root, ctx)

    def _chain(self, ctx: _Context, tokens: Sequence[int]) -> PrefixChain:
        chain = PrefixChain(self.keys.prefix, ctx.prefix_context)
        chain.extend(np.asarray(tokens, dtype=np.int64))
        return chain

    def _read_index(self, node_id: bytes) -> bytes | None:
        try:
            with open(self.index_path(node_id), "rb") as fh:
                text = fh.read().strip()
        except FileNotFoundError:
            return None
        try:
            mid = bytes.fromhex(text.decode())
        except ValueError:
            raise StoreError("corrupt", f"index entry {node_id.hex()} is malformed") from None
        if len(mid) != 32:
            raise StoreError("corrupt", f"index entry {node_id.hex()} is malformed")
        return mid

    # -- lookup ----------------------------------------------------------------------------
    def find_deepest(self, tokens: Sequence[int], layout: CacheLayout, ids: IdentityIds, aux: Sequence[tuple[bytes, bytes]] = ()) -> Hit | None:
        """The deepest committed cut reusable for ``tokens`` under this exact identity:
        a 256-aligned prefix, or the whole token sequence. ``None`` is a miss."""
        if not tokens:
            return None
        ctx = self.context(layout, ids, aux)
        chain = self._chain(ctx, tokens)
        for node in reversed(chain.nodes):
            if not (node.reusable or node.cumulative_count == len(tokens)):
                continue
            mid = self._read_index(node.node_id)
            if mid is not None and os.path.exists(self.pack_path(mid)) and os.path.exists(self.logits_path(mid)):
                return Hit(mid, node.cumulative_count, node.node_id)
        return None

    # -- save ------------------------------------------------------------------------------
    def save(
        self,
        session,
        *,
        cut: int | None = None,
        logits: bytes | memoryview | None = None,
        aux: Sequence[tuple[bytes, bytes]] = (),
        max_delta_depth: int = C.MAX_DELTA_DEPTH,
    ) -> SaveReport:
        """Publish a cut of the session: chunks, pack, final logits, then the index entry.

        By default the cut is the session's position and its logits are the session's last
        row. An earlier ``cut`` may be saved with the ``logits`` row captured at that point
        (e.g. at each 256-token boundary during prefill), provided every layer still holds
        the rows the cut needs (always true for full-span layers).
        """
        t0 = time.perf_counter()
        layout: CacheLayout = session.layout
        ids = _engine_ids(session)
        cut = session.position if cut is None else cut
        if not 0 < cut <= session.position:
            raise StoreError("usage", f"cannot save cut {cut} of a session at position {session.position}")
        if logits is None:
            if cut != session.position:
                raise StoreError("incomplete", "an earlier cut needs the logits row captured at that cut")
            logits = session.export_logits()  # refuse early: a cut without its logits is never written
        if memoryview(logits).nbytes != layout.logits_bytes:
            raise StoreError("incomplete", "final-logits row has the wrong size")
        for spec in layout.layers:
            need_lo = spec.retained_range(cut)[0]
            if need_lo < cut and session.layout.retained_range(spec.index, session.position)[0] > need_lo:
                raise StoreError("usage", f"layer {spec.index} no longer holds the window of cut {cut}")
        ctx = self.context(layout, ids, aux)
        chain = self._chain(ctx, session.tokens[:cut])
        node = chain.nodes[-1]
        cut_id = InputCutId(node.node_id, ctx.aux_root, cut)
        with self._lock(exclusive=False):
            existing = self._read_index(node.node_id)
            if existing is not None and os.path.exists(self.pack_path(existing)) and os.path.exists(self.logits_path(existing)):
                return SaveReport(existing.hex(), cut, "existing", -1, seconds=time.perf_counter() - t0)
            parent = self._pick_parent(chain, ctx, max_delta_depth)
            if parent is not None:
                parent_manifest, parent_id = parent
                depth = parent_manifest.schema.depth + 1
                schema = build_schema(ctx.family, cut, parent=(parent_id, parent_manifest.cut), depth=depth, max_chunk_bytes=self.chunk_bytes)
            else:
                depth = 0
                schema = build_schema(ctx.family, cut, max_chunk_bytes=self.chunk_bytes)
            report = SaveReport("", cut, "delta" if parent else "full", depth)
            refs = self._write_chunks(session, ctx, schema, report, cut)
            payload = tuple(PayloadState(fs.key, tuple(refs[fs.key])) for fs in ctx.family.states)
            manifest = Manifest(self.tenant, self.epoch, semantic_id(ids), cut_id, ctx.family, schema, payload)
            mbytes = manifest.encode()
            mid = manifest.manifest_id(mbytes)
            salt, nonce = self._salt_nonce()
            pack = encode_pack(manifest, self.keys, encrypted=self.encrypted, salt=salt, nonce=nonce, manifest_bytes=mbytes)
            atomic_write(self.pack_path(mid), pack, ops=self.ops, mode=0o600)
            lkey = logits_key(layout)
            lspan = logits_span(layout, cut)
            salt, nonce = self._salt_nonce()
            lchunk = encode_chunk(
                keys=self.keys,
                family_digest=ctx.family_digest,
                key=lkey,
                span=lspan,
                plaintext=mid + bytes(logits),
                codec=C.CODEC_RAW,
                encrypted=self.encrypted,
                salt=salt,
                nonce=nonce,
            )
            atomic_write(self.logits_path(mid), lchunk.obj, ops=self.ops, mode=0o600)
            # the commit point: from here on the cut is findable
            atomic_write(self.index_path(node.node_id), mid.hex().encode() + b"\n", ops=self.ops, mode=0o600)
        report.manifest_id = mid.hex()
        report.bytes_written += len(pack) + len(lchunk.obj)
        report.seconds = time.perf_counter() - t0
        return report

    def _salt_nonce(self) -> tuple[bytes, bytes]:
        if not self.encrypted:
            return bytes(16), bytes(12)
        return secrets.token_bytes(16), secrets.token_bytes(12)

    def _pick_parent(self, chain: PrefixChain, ctx: _Context, max_depth: int):
        """The deepest committed aligned strict prefix, if a delta on it stays within depth."""
        for node in reversed(chain.nodes[:-1]):
            if not node.reusable:
                continue
            mid = self._read_index(node.node_id)
            if mid is None:
                continue
            try:
                with open(self.pack_path(mid), "rb") as fh:
                    manifest, _ = decode_pack(fh.read(), self.keys)
            except (OSError, FormatError):
                return None  # an unreadable parent: write a full cut rather than build on it
            if manifest.family != ctx.family or manifest.schema.depth + 1 > max_depth:
                return None
            return manifest, mid
        return None

    def _span_plaintext(self, session, layer: int, role: str, start: int, stop: int, cut: int) -> memoryview | bytes | bytearray:
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

    def _write_chunks(self, session, ctx: _Context, schema, report: SaveReport, cut: int) -> dict:
        refs: dict = {fs.key: [None] * len(rs.spans) for fs, rs in zip(ctx.family.states, schema.states)}
        jobs = [(fs, i, span) for fs, rs in zip(ctx.family.states, schema.states) for i, span in enumerate(rs.spans)]
        # export from the engine on this thread (engines need not be thread-safe), hash and
        # write on the pool (hashlib and the AEAD release the GIL on large buffers)
        with ThreadPoolExecutor(self.workers) as pool:
            pending: list[Future] = []
            for (fs, i, span), (plaintext, release) in zip(jobs, self._span_exports(session, jobs, cut)):
                fut = pool.submit(self._write_one_chunk, ctx, fs, i, span, plaintext)
                if release is not None:  # a pinned export buffer: reusable once the job is done

                    def release_when_done(_fut: Future, release: Callable[[], None] = release) -> None:
                        release()

                    fut.add_done_callback(release_when_done)
                pending.append(fut)
                if len(pending) >= 2 * self.workers:
                    self._collect(pending.pop(0), refs, report)
            for fut in pending:
                self._collect(fut, refs, report)
        sync_dir(self._p("chunks"), ops=self.ops)
        return refs

    def _span_exports(self, session, jobs, cut: int):
        """``(plaintext, release)`` per job, in order. Sessions offering ``export_spans``
        (the CUDA adapter: asynchronous copies through pinned buffers, running ahead of the
        hashing) get every span at once; ``release`` (or None) frees the buffer after use."""
        export_spans = getattr(session, "export_spans", None)
        if export_spans is None:
            for fs, _i, span in jobs:
                yield self._span_plaintext(session, fs.key.layer, fs.key.name, span.token_start, span.token_start + span.token_count, cut), None
            return
        plan = []
        for fs, _i, span in jobs:
            start, stop = span.token_start, span.token_start + span.token_count
            lo, hi = session.layout.retained_range(fs.key.layer, cut)
            plan.append((fs.key.layer, fs.key.name, start, stop, max(start, lo), min(stop, hi)))
        exports = export_spans([(layer, role, a, b) for layer, role, _s, _e, a, b in plan if a < b], depth=2 * self.workers)
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

    @staticmethod
    def _collect(fut: Future, refs: dict, report: SaveReport) -> None:
        key, index, ref, written, plaintext_bytes = fut.result()
        refs[key][index] = ref
        report.plaintext_bytes += plaintext_bytes
        if written:
            report.chunks_written += 1
            report.bytes_written += ref.object_bytes
        else:
            report.chunks_reused += 1

    def _write_one_chunk(self, ctx: _Context, fs, index: int, span, plaintext):
        content_id = chunk_content_id(
            self.keys.chunk_identity,
            self.tenant,
            ctx.family_digest,
            fs.key.layer,
            fs.key.name,
            span.token_start,
            span.token_count,
            span.plaintext_offset,
            plaintext,
        )
        path = self.chunk_path(content_id)
        ref = self._existing_ref(path, content_id)
        if ref is not None:
            return fs.key, index, ref, False, span.plaintext_bytes
        salt, nonce = self._salt_nonce()
        chunk = encode_chunk(
            keys=self.keys,
            family_digest=ctx.family_digest,
            key=fs.key,
            span=span,
            plaintext=plaintext,
            codec=fs.codec,
            encrypted=self.encrypted,
            salt=salt,
            nonce=nonce,
            content_id=content_id,
        )
        atomic_write(path, chunk.obj, ops=self.ops, mode=0o600, sync_dir=False)
        return fs.key, index, chunk.ref, True, span.plaintext_bytes

    def _existing_ref(self, path: str, content_id: bytes) -> ChunkRef | None:
        """Reuse a stored chunk with this content id (dedup across packs of the family).

        Only the ref is derived here; every byte is verified again at restore."""
        try:
            with open(path, "rb") as fh:
                obj = fh.read()
        except FileNotFoundError:
            return None
        if len(obj) < C.HEADER_BYTES:
            return None
        h = ChunkHeader.parse(obj)
        if h.content_id != content_id or h.object_bytes != len(obj) or h.key_epoch != self.epoch or h.encrypted != self.encrypted:
            return None  # damaged or foreign: write a fresh copy over it
        return ChunkRef(h.content_id, h.object_key, hashlib.sha256(obj).digest(), h.key_epoch, h.plaintext_bytes, len(obj))

    # -- restore ---------------------------------------------------------------------------
    def load_chain(self, manifest_id: bytes) -> list[Manifest]:
        """The verified pack chain of a cut, newest first, down to its full manifest."""
        chain: list[Manifest] = []
        mid = manifest_id
        while True:
            try:
                with open(self.pack_path(mid), "rb") as fh:
                    data = fh.read()
            except FileNotFoundError:
                raise StoreError("incomplete", f"pack {mid.hex()} is missing") from None
            try:
                manifest, plain = decode_pack(data, self.keys)
            except FormatError as exc:
                raise _corrupt(f"pack {mid.hex()}", exc) from None
            if manifest.manifest_id(plain) != mid:
                raise StoreError("corrupt", f"pack {mid.hex()} holds another manifest")
            if chain:
                child = chain[-1].schema.parent
                if child is None or child.cut != manifest.cut:
                    raise StoreError("corrupt", f"pack {mid.hex()} is not the parent its child names")
            chain.append(manifest)
            parent = manifest.schema.parent
            if parent is None:
                return chain
            if len(chain) > C.MAX_DELTA_DEPTH + 1:
                raise StoreError("corrupt", "delta chain deeper than the format allows")
            mid = parent.manifest_id

    def restore(self, hit: Hit, session, tokens: Sequence[int], *, aux: Sequence[tuple[bytes, bytes]] = ()) -> RestoreReport:
        """Verify every byte of the cut (packs, chunks, logits) and install it atomically.

        Any mismatch refuses with StoreError and the live session is left untouched."""
        t0 = time.perf_counter()
        layout: CacheLayout = session.layout
        ids = _engine_ids(session)
        ctx = self.context(layout, ids, aux)
        if len(tokens) < hit.cut:
            raise StoreError("usage", f"{len(tokens)} tokens for a cut of {hit.cut}")
        chain_nodes = self._chain(ctx, tokens[: hit.cut])
        if chain_nodes.token_root != hit.node_id:
            raise StoreError("miss", "the tokens do not lead to this cut")
        with self._lock(exclusive=False):
            chain = self.load_chain(hit.manifest_id)
            top = chain[0]
            if top.cut.token_root != hit.node_id or top.cut.token_count != hit.cut or top.cut.aux_root != ctx.aux_root:
                raise StoreError("corrupt", "stored cut does not match its index entry")
            if top.family != ctx.family or top.semantic != semantic_id(ids):
                raise StoreError("miss", "stored cut was written under another identity")
            t_packs = time.perf_counter()
            install = session.begin_install(hit.cut, list(tokens[: hit.cut]), session.engine.identity)
            try:
                verified, nbytes, hashed_on = self._install_chunks(chain, ctx, install, hit.cut)
                t_chunks = time.perf_counter()
                logits = self._read_logits(hit.manifest_id, top)
                install.write_logits(logits)
                install.commit()
            except BaseException as exc:
                install.abort()
                if isinstance(exc, FormatError):
                    raise _corrupt("cut", exc) from None
                raise
        t1 = time.perf_counter()
        return RestoreReport(
            hit.manifest_id.hex(),
            hit.cut,
            len(chain),
            verified,
            nbytes,
            t1 - t0,
            {"packs_s": t_packs - t0, "chunks_s": t_chunks - t_packs, "logits_commit_s": t1 - t_chunks, **self.__dict__.pop("_last_device_phases", {})},
            hashed_on,
        )

    def _install_chunks(self, chain: list[Manifest], ctx: _Context, install, cut: int) -> tuple[int, int, dict]:
        jobs = []
        for manifest in chain:
            for key, span, ref in manifest.chunk_refs():
                lo, hi = install.required_range(key.layer)
                a, b = max(span.token_start, lo), min(span.token_start + span.token_count, hi)
                if a < b:  # spans wholly outside a windowed layer's window are not even read
                    jobs.append((manifest, key, span, ref, a, b))
        if self.verify_on != "host" and hasattr(install, "wave_ring") and jobs:
            capacity = self.wave_chunks or max(1, self.device_staging_bytes // (self.device_waves * C.MAX_CHUNK_OBJECT_BYTES))
            ring = install.wave_ring(wave_chunks=capacity, waves=self.device_waves, force=self.verify_on == "device")
            if ring is not None:
                return self._install_device_verified(jobs, ctx, install, ring, self.device_waves)
        planes = None
        if hasattr(install, "plane_stager"):
            planes = install.plane_stager(force=self.plane_staging == "always") if self.plane_staging != "never" else None
        if planes is not None:
            return (*self._install_planes(jobs, ctx, install, planes), {"host": len(jobs)})
        verified = nbytes = 0
        window = 2 * self.workers
        # On a CUDA install: chunk files are read into pinned slots, verified there and
        # uploaded by the workers; this thread only queues the device-side copies.
        stager = install.stager(window + 2) if hasattr(install, "stager") else None
        with ThreadPoolExecutor(self.workers) as pool:
            pending: list[tuple[Future, tuple]] = []

            def drain(item) -> None:
                nonlocal verified, nbytes
                fut, (manifest, key, span, ref, a, b) = item
                result = fut.result()
                row = ctx.layout.layer(key.layer).row_bytes
                lo_byte, hi_byte = (a - span.token_start) * row, (b - span.token_start) * row
                if stager is None:
                    install.write_rows(key.layer, key.name, a, memoryview(result)[lo_byte:hi_byte])
                else:
                    try:
                        install.write_rows(key.layer, key.name, a, result.rows(lo_byte, hi_byte - lo_byte))
                    finally:
                        result.release()
                verified += 1
                nbytes += ref.object_bytes

            try:
                for job in jobs:
                    pending.append((pool.submit(self._verify_chunk, job[0], job[1], job[2], job[3], ctx, stager), job))
                    if len(pending) >= window:
                        drain(pending.pop(0))
                while pending:
                    drain(pending.pop(0))
            finally:
                if stager is not None:  # refused midway: hand back the slots still held
                    for fut, _job in pending:
                        if fut.exception() is None:
                            fut.result().release()
        return verified, nbytes, {"host": verified}

    def _install_planes(self, jobs: list, ctx: _Context, install, stager) -> tuple[int, int]:
        """Restore by whole planes (kvpack.engine.cuda.PlaneStager): workers read each chunk
        object into its slot of one pinned buffer per (layer, role), verify it in place and
        queue the copy of its rows to the device plane; each complete plane is installed
        with one transposing copy."""
        from ..engine.cuda import SLOT_BYTES

        by_plane: dict[tuple[int, str], list] = {}
        for job in jobs:
            by_plane.setdefault((job[1].layer, job[1].name), []).append(job)
        verified = nbytes = 0
        # planes complete in order: keep enough chunks queued that the pool never drains
        # while the oldest plane waits for its last chunk (bounded: the host slots are pinned)
        window = 6 * self.workers

        def verify_into(job, item, view, slot: int, dev, lo: int, row: int) -> int:
            manifest, key, span, ref, a, b = job
            obj, _n = self._read_chunk_into(ref, memoryview(view)[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES])
            plaintext = decode_chunk(
                obj, ref=ref, span=span, tenant=self.tenant, family=manifest.family, key=key, keys=self.keys, family_digest=ctx.family_digest
            )
            stager.copy_rows(item, plaintext, (a - span.token_start) * row, (b - a) * row, dev, (a - lo) * row)
            return ref.object_bytes

        held: list = []
        queued: list[tuple[tuple, object, object, list[Future]]] = []

        def finish_plane(entry) -> None:
            nonlocal verified, nbytes
            (layer, role, lo), item, dev, futs = entry
            for fut in futs:
                nbytes += fut.result()
                verified += 1
            install.write_rows(layer, role, lo, stager.finish(item, dev))
            held.remove(item)
            stager.release(item)

        try:
            with ThreadPoolExecutor(self.workers) as pool:
                try:
                    for (layer, role), plane_jobs in by_plane.items():
                        lo, hi = install.required_range(layer)
                        row = ctx.layout.layer(layer).row_bytes
                        item, view = stager.host_slots(len(plane_jobs))
                        held.append(item)
                        dev = stager.device_plane((hi - lo) * row)
                        futs = [pool.submit(verify_into, job, item, view, i, dev, lo, row) for i, job in enumerate(plane_jobs)]
                        queued.append(((layer, role, lo), item, dev, futs))
                        while queued and sum(len(q[3]) for q in queued) > window:
                            finish_plane(queued.pop(0))
                    while queued:
                        finish_plane(queued.pop(0))
                except BaseException:
                    for entry in queued:  # refused midway: drop what has not started
                        for fut in entry[3]:
                            fut.cancel()
                    raise
        finally:
            # the pool has shut down: no worker writes into these buffers any more
            if held and stager.cuda:
                stager.copy_stream.synchronize()  # nor does a queued copy read them
            for item in held:
                stager.release(item)
        return verified, nbytes

    def _install_device_verified(self, jobs: list, ctx: _Context, install, ring, waves: int) -> tuple[int, int, dict]:
        """Restore with the two long hashes on the device (kvpack.engine.device_verify).

        Workers read each object into its wave slot and run every other check of A.5 there
        (``decode_chunk_deferred``); the wave's objects are uploaded whole and hashed on the
        device; each chunk is installed from the hashed device copy only after
        ``DeferredChunk.finish`` accepted its digests. A wave of ``wave_chunks`` objects is
        in flight per ring entry; ``waves`` entries overlap reading, hashing and install."""
        from ..engine.device_verify import SLOT_BYTES, host_tail_chunks
        from ..engine.gpu_digest import HEAD_BYTES
        from ..format.chunk import ExternalDigests, decode_chunk_deferred, deferrable
        from ..format.identity import chunk_content_prefix, hmac_sha256_finish, hmac_sha256_pads

        inner_pad, outer_pad = hmac_sha256_pads(self.keys.chunk_identity)
        verified = nbytes = 0
        hashed_on = {"device": 0, "host": 0}
        # where this thread's time goes (reported in RestoreReport.phases as device_*_s)
        spent = {"device_wait_reads_s": 0.0, "device_launch_s": 0.0, "device_wait_hash_s": 0.0, "device_check_s": 0.0, "device_install_s": 0.0}

        tail = self.device_host_tail
        if tail is None:
            tail = host_tail_chunks(ring, self.workers, max(job[3].object_bytes for job in jobs))
        first_host = len(jobs) - min(tail, len(jobs))

        def read(job, wave, i: int, on_host: bool):
            """-> ("deferred", DeferredChunk, head) or ("host", None, None); raises on refusal.
            ``on_host``: verify completely here (the restore's tail, see ``device_host_tail``)."""
            manifest, key, span, ref, a, b = job
            obj, n = self._read_chunk_into(ref, wave.slot_view(i))
            verify_args = dict(ref=ref, span=span, tenant=self.tenant, family=manifest.family, key=key, keys=self.keys, family_digest=ctx.family_digest)
            if not on_host and n < SLOT_BYTES and ref.key_epoch == self.epoch and deferrable(obj):
                head = inner_pad + chunk_content_prefix(
                    self.tenant, ctx.family_digest, key.layer, key.name, span.token_start, span.token_count, span.plaintext_offset, span.plaintext_bytes
                )
                if len(head) <= HEAD_BYTES:
                    return "deferred", decode_chunk_deferred(obj, **verify_args), head
            plaintext = decode_chunk(obj, **verify_args)  # encrypted, lossless, odd, or the tail
            wave.place_plaintext(i, plaintext)  # a raw plaintext is already in place: no copy
            return "host", None, None

        def launch_wave(entry) -> None:
            wave, wave_jobs, futs = entry
            t0 = time.perf_counter()
            results = [f.result() for f in futs]
            t1 = time.perf_counter()
            spent["device_wait_reads_s"] += t1 - t0
            deferred = [(i, r) for i, r in enumerate(results) if r[0] == "deferred"]
            wave.launch(
                len(wave_jobs),
                [(i, wave_jobs[i][3].object_bytes) for i, _ in deferred],
                [(i, wave_jobs[i][2].plaintext_bytes, r[2]) for i, r in deferred],
            )
            entry_launched.append(entry)
            spent["device_launch_s"] += time.perf_counter() - t1

        def install_wave(entry) -> None:
            nonlocal verified, nbytes
            wave, wave_jobs, futs = entry
            results = [f.result() for f in futs]
            deferred = [i for i, r in enumerate(results) if r[0] == "deferred"]
            hashed_on["device"] += len(deferred)
            hashed_on["host"] += len(results) - len(deferred)
            t0 = time.perf_counter()
            digests = wave.digests()
            m = len(deferred)
            for k, i in enumerate(deferred):
                results[i][1].finish(ExternalDigests(digests[k], hmac_sha256_finish(outer_pad, digests[m + k])))
            t1 = time.perf_counter()
            spent["device_check_s"] += t1 - t0
            wave.order_installs()
            i = 0
            while i < len(wave_jobs):  # one copy per run of consecutive rows of one plane
                _manifest, key, span, ref, a, b = wave_jobs[i]
                row = ctx.layout.layer(key.layer).row_bytes
                lo_byte, size = (a - span.token_start) * row, (b - a) * row
                j, end = i + 1, b
                while j < len(wave_jobs):
                    _m, k2, s2, _r, a2, b2 = wave_jobs[j]
                    if (k2.layer, k2.name) != (key.layer, key.name) or a2 != end or (a2 - s2.token_start) * row != lo_byte or (b2 - a2) * row != size:
                        break
                    end, j = b2, j + 1
                if j - i == 1:
                    install.write_rows(key.layer, key.name, a, wave.rows(i, lo_byte, size))
                else:
                    install.write_row_blocks(key.layer, key.name, a, wave.row_blocks(i, j - i, lo_byte, size))
                for _m, _k, _s, r, _a, _b in wave_jobs[i:j]:
                    verified += 1
                    nbytes += r.object_bytes
                i = j
            spent["device_install_s"] += time.perf_counter() - t1

        # spread the chunks over all the waves in flight (a small restore still overlaps its
        # reads with its hashing), never more than a wave holds
        per_wave = min(ring.wave_chunks, -(-len(jobs) // waves))
        starts = list(range(0, len(jobs), per_wave))
        groups = [jobs[k : k + per_wave] for k in starts]
        reading: list = []  # (wave, jobs, futures): reads queued, in order
        entry_launched: list = []  # hashes queued, in order
        held: list = []

        def pump() -> None:
            """Queue the hashes of every wave whose reads are all done (never blocks)."""
            while reading and all(f.done() for f in reading[0][2]):
                launch_wave(reading.pop(0))

        def install_oldest() -> None:
            if not entry_launched:
                launch_wave(reading.pop(0))  # waits for its reads
            entry = entry_launched.pop(0)
            t0 = time.perf_counter()
            while not entry[0].hashed_ready():  # keep later waves hashing meanwhile
                pump()
                time.sleep(0.0002)
            spent["device_wait_hash_s"] += time.perf_counter() - t0
            install_wave(entry)
            held.remove(entry[0])
            entry[0].release()

        try:
            with ThreadPoolExecutor(self.workers) as pool:
                try:
                    for start, group in zip(starts, groups):
                        pump()
                        if len(held) >= waves:  # our share is in use: install our oldest first
                            install_oldest()
                        wave = ring.acquire(block=False)
                        while wave is None and held:  # the ring is shared: never wait holding waves
                            install_oldest()
                            wave = ring.acquire(block=False)
                        if wave is None:
                            wave = ring.acquire()  # we hold none: whoever does will release them
                        held.append(wave)
                        reading.append((wave, group, [pool.submit(read, job, wave, i, start + i >= first_host) for i, job in enumerate(group)]))
                    while reading or entry_launched:
                        install_oldest()
                except BaseException:
                    for _wave, _jobs, futs in reading:
                        for fut in futs:
                            fut.cancel()
                    raise
        finally:
            # the pool has shut down: no worker writes into these buffers any more
            for wave in held:
                wave.release()
        self._last_device_phases = {k: round(v, 4) for k, v in spent.items()}
        self._last_device_phases.update(device_waves=len(groups), device_ring=waves)
        return verified, nbytes, hashed_on

    def _read_chunk_into(self, ref: ChunkRef, region: memoryview) -> tuple[bytes | memoryview, int]:
        """Read a chunk object file into ``region`` (a staging slot as large as the largest
        chunk object). Returns the object (a view of the slot) and its length; a file larger
        than the slot is returned whole as bytes, for the decoder to refuse."""
        try:
            with open(self.chunk_path(ref.content_id), "rb", buffering=0) as fh:
                n = 0
                while n < len(region):
                    got = fh.readinto(region[n:])
                    if not got:
                        break
                    n += got
                if n == len(region):
                    return region.tobytes() + fh.read(), n
                return region[:n], n
        except FileNotFoundError:
            raise StoreError("incomplete", f"chunk {ref.content_id.hex()} is missing") from None

    def _verify_chunk(self, manifest: Manifest, key, span, ref: ChunkRef, ctx: _Context, stager=None):
        """The verified plaintext of a chunk, or with a ``stager`` the staging slot holding it
        (read into pinned memory, verified in place, upload to the device started)."""
        slot = stager.acquire() if stager is not None else None
        try:
            obj = None
            try:
                if slot is not None:
                    obj = slot.read_file(self.chunk_path(ref.content_id))
                if obj is None:  # no stager, or a file too large for any chunk (refused below)
                    with open(self.chunk_path(ref.content_id), "rb") as fh:
                        obj = fh.read()
            except FileNotFoundError:
                raise StoreError("incomplete", f"chunk {ref.content_id.hex()} is missing") from None
            plaintext = decode_chunk(
                obj, ref=ref, span=span, tenant=self.tenant, family=manifest.family, key=key, keys=self.keys, family_digest=ctx.family_digest
            )
            if slot is None:
                return plaintext
            slot.upload(plaintext)
            return slot
        except BaseException:
            if slot is not None:
                slot.release()
            raise

    def _read_logits(self, mid: bytes, manifest: Manifest) -> bytes | memoryview:
        """Verify the final-logits object of the cut ``mid`` and return the f32 row bytes."""
        from ..format.chunk import verify_chunk_standalone

        try:
            with open(self.logits_path(mid), "rb") as fh:
                obj = fh.read()
        except FileNotFoundError:
            raise StoreError("incomplete", f"cut {mid.hex()} has no final-logits object") from None
        header, _ = verify_chunk_standalone(obj, self.keys)  # structure, header digest, key, AEAD
        layer = max(s.key.layer for s in manifest.family.states) + 1
        span = Span(manifest.cut.token_count - 1, 1, 0, header.plaintext_bytes)
        ref = ChunkRef(header.content_id, header.object_key, hashlib.sha256(obj).digest(), self.epoch, span.plaintext_bytes, len(obj))
        family = logits_family(layer, header.plaintext_bytes, manifest.family)
        plaintext = decode_chunk(
            obj,
            ref=ref,
            span=span,
            tenant=self.tenant,
            family=family,
            key=StateKey(layer, LOGITS_NAME),
            keys=self.keys,
            family_digest=manifest.family.digest(),
        )
        if plaintext[:32] != mid:
            raise StoreError("corrupt", f"final-logits object of {mid.hex()} belongs to another cut")
        return plaintext[32:]

    # -- listing, checking, garbage collection ------------------------------------------------
    def index_entries(self, problems: list[str] | None = None) -> list[tuple[bytes, bytes]]:
        """(node id, manifest id) of every well-formed index entry; malformed ones are
        reported into ``problems`` when given (and otherwise skipped)."""
        out = []
        for name in sorted(os.listdir(self._p("index"))):
            if name.startswith("."):
                continue
            try:
                node = bytes.fromhex(name)
                mid = self._read_index(node)
            except (ValueError, StoreError) as exc:
                if problems is not None:
                    problems.append(f"index entry {name}: {exc}")
                continue
            if mid is not None:
                out.append((node, mid))
        return out

    def ls(self) -> list[dict]:
        rows: list[dict[str, object]] = []
        for _node, mid in self.index_entries():
            try:
                chain = self.load_chain(mid)
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
                    "has_logits": os.path.exists(self.logits_path(mid)),
                }
            )
        return rows

    def verify(self, *, read_data: bool = True) -> dict:
        """Check every indexed cut: packs (always), and with ``read_data`` every chunk and
        logits object byte by byte (restic-style ``check --read-data``)."""
        problems: list[str] = []
        cuts = chunks = 0
        seen: set[bytes] = set()
        with self._lock(exclusive=False):
            for _node, mid in self.index_entries(problems):
                try:
                    chain = self.load_chain(mid)
                    cuts += 1
                    for manifest in chain:
                        for key, span, ref in manifest.chunk_refs():
                            if ref.content_id in seen:
                                continue
                            path = self.chunk_path(ref.content_id)
                            if not read_data:
                                if not os.path.exists(path) or os.path.getsize(path) != ref.object_bytes:
                                    problems.append(f"chunk {ref.content_id.hex()}: missing or wrong size")
                            else:
                                with open(path, "rb") as fh:
                                    decode_chunk(fh.read(), ref=ref, span=span, tenant=self.tenant, family=manifest.family, key=key, keys=self.keys)
                            seen.add(ref.content_id)
                            chunks += 1
                    if read_data:
                        self._read_logits(mid, chain[0])
                    elif not os.path.exists(self.logits_path(mid)):
                        problems.append(f"cut {mid.hex()}: no final-logits object")
                except FileNotFoundError as exc:
                    problems.append(f"cut {mid.hex()}: {exc.strerror}: {exc.filename}")
                except FormatError as exc:
                    problems.append(f"cut {mid.hex()}: refused {exc.category}: {exc.message}")
                except StoreError as exc:
                    problems.append(f"cut {mid.hex()}: {exc.category}: {exc.message}")
        return {"cuts": cuts, "chunks_checked": chunks, "problems": problems, "ok": not problems}

    def gc(self) -> dict:
        """Remove what no indexed cut references. Runs under the exclusive lock, so it never
        races a publication (publishers hold the shared lock from first chunk to index entry)."""
        removed = {"chunks": 0, "packs": 0, "logits": 0, "index": 0, "temp": 0, "bytes": 0}
        with self._lock(exclusive=True):
            live_packs: set[str] = set()
            live_chunks: set[str] = set()
            for node, mid in self.index_entries():
                try:
                    chain = self.load_chain(mid)
                except StoreError:
                    # an entry whose cut cannot be loaded is useless: drop the entry, keep files
                    # until nothing references them
                    durable_unlink(self.index_path(node), ops=self.ops)
                    removed["index"] += 1
                    continue
                for manifest in chain:
                    live_packs.add(manifest.manifest_id().hex())
                    for _key, _span, ref in manifest.chunk_refs():
                        live_chunks.add(ref.content_id.hex())
            for sub, live, suffix, label in (
                ("chunks", live_chunks, ".kvchk", "chunks"),
                ("packs", live_packs, ".kvpkp", "packs"),
                ("logits", live_packs, ".kvchk", "logits"),
            ):
                directory = self._p(sub)
                for name in os.listdir(directory):
                    path = os.path.join(directory, name)
                    if name.startswith(".") and name.endswith(".tmp"):
                        removed["bytes"] += os.path.getsize(path)
                        os.unlink(path)
                        removed["temp"] += 1
                        continue
                    if name.endswith(suffix) and name[: -len(suffix)] not in live:
                        removed["bytes"] += os.path.getsize(path)
                        os.unlink(path)
                        removed[label] += 1
                sync_dir(directory, ops=self.ops)
        return removed


def _engine_ids(session) -> IdentityIds:
    """The session engine's identity ids (cached by engines that offer ``ids()``)."""
    engine = session.engine
    return engine.ids() if hasattr(engine, "ids") else engine.identity.ids()


def _corrupt(what: str, exc: FormatError) -> StoreError:
    err = StoreError("corrupt", f"{what}: refused {exc.category}: {exc.message}")
    err.format_category = exc.category  # type: ignore[attr-defined]
    return err
