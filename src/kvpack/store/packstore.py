"""The pack store: save a session's cut, find the deepest stored prefix, restore it verified,
and heal what fails verification -- on any storage environment (:mod:`.env`).

Layout (object names; docs/store.md)::

    store.json                 tenant name, key epoch, encryption flag, chunk size (no secrets)
    root.key                   32-byte root (0600; POSIX stores only, unless kept elsewhere)
    chunks/<content id>.kvchk  KVCHK1 chunk objects, content-addressed, shared by packs
    packs/<manifest id>.kvpkp  one KVPKP1 pack per cut (full, or delta against its parent)
    logits/<manifest id>.kvchk the exact final-logits row of that cut (a KVCHK1 object)
    index/<prefix node id>     the manifest id committed at that prefix-chain node
    quarantine/<time>-<id>.json receipts of cuts taken out of the index (verification failed)

Names are HMAC outputs (content ids, manifest ids, keyed prefix-chain node ids): no token id
or text appears in any name, object or log. Publication order is chunks -> pack and logits
-> index entry (:mod:`.publish`); the index entry is the commit point, written with a
compare-and-swap, so a crash anywhere leaves the previous generation intact and only
unreferenced objects behind (which ``gc`` removes, :mod:`.maintenance`).

This class holds the store's identity scoping, lookup and restore; the restore pipelines
themselves live with the engine side (:mod:`kvpack.engine.restore`). It never touches a
file or bucket except through its environment.
"""

from __future__ import annotations

import copy
import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..durable import REAL_OPS, FileOps
from ..engine.contract import CacheLayout, Engine, IdentityIds
from ..engine.restore import Buffer, ChunkJob, RestoreTuning, default_workers, install_chunks
from ..errors import DurableIOError, FormatError, StoreError
from ..format import constants as C
from ..format.chunk import ChunkHeader, decode_chunk, verify_chunk_standalone
from ..format.identity import PrefixChain, auxiliary_root, prefix_context
from ..format.keys import KeySchedule
from ..format.objects import ChunkRef, Family, Manifest, Span, StateKey
from ..format.pack import ManifestCache, decode_pack
from .env import RESTORE, ObjectMissing, StorageEnv, seconds_setting
from .mapping import LOGITS_NAME, family_for, logits_family, semantic_id, tenant_id

STORE_FORMAT = "kvpack-store"
STORE_VERSION = 1
#: Chunk plaintext size of a new store. 2 MiB, not the format's 4 MiB cap: a restore that
#: verifies on the GPU hashes one chunk object per GPU thread, so the chunk size is its
#: per-wave latency (about 30 ms per MiB on an H200) and sets the staging it needs in
#: flight, while every chunk also costs fixed host work (measured on the H200: 2 MiB restores
#: 8k tokens as fast as 1 MiB and 32k faster; docs/benchmarks.md, issue 20).
DEFAULT_CHUNK_BYTES = 2 << 20
#: the most bytes an index entry is read for (64 hex digits and a newline are 65): a longer
#: object under index/ is malformed, and a lookup never reads more of it
MAX_INDEX_ENTRY_BYTES = 128
#: a restore's whole deadline, seconds (``KVPACK_RESTORE_DEADLINE_S``; PackStore.restore_deadline_s):
#: on S3 every request of the restore -- its lease, packs, chunks, logits -- ends by then,
#: and a restore that has not finished refuses with ``io`` (the caller recomputes)
DEFAULT_RESTORE_DEADLINE_S = 120.0
#: a save's whole deadline, seconds (``KVPACK_SAVE_DEADLINE_S``; PackStore.save_deadline_s)
DEFAULT_SAVE_DEADLINE_S = 600.0
#: the whole deadline of ``verify``, ``repair``, ``forget`` and ``gc`` (seconds;
#: ``KVPACK_MAINTENANCE_DEADLINE_S``, the CLI's ``--deadline``; PackStore.maintenance_deadline_s)
DEFAULT_MAINTENANCE_DEADLINE_S = 3600.0
#: unreadable index entries in a row after which a lookup takes the storage for down and
#: stops (a miss): one bad entry still lets the shallower ones serve (find_deepest)
UNREADABLE_RUN = 3
#: plaintext bytes of a prefix cut's logits object: the manifest id alone, no row
PREFIX_MARKER_BYTES = 32
#: Parsed manifests shared by every store of this process (format.pack.ManifestCache: only
#: the parse of an authenticated plaintext with the same SHA-256 is reused; each pack file is
#: read and authenticated again on every load). A lookup and the load after it decode the
#: same chain, often through two PackStore objects (vLLM's scheduler and worker connectors).
#: A parsed manifest of a 30-layer model (60 states) holds ~130 KB of Python objects: 128 of
#: them (a 4,096-token prompt's chain is 17) are ~17 MB.
MANIFESTS = ManifestCache(128)


class IndexAbsence:
    """Index entries a read of this process found absent, and when (``time.monotonic()``
    at the start of that read), per (store location, node id): the parent pick of a save
    that follows its lookup (every consumer looks up before it computes and saves) skips
    the nodes the lookup just found empty, instead of reading each of them again (an
    8,192-token save: 31 index GETs on S3).

    A hint, never a verdict: it only decides which entries a save's parent pick reads, and
    a parent found is still protected by the publisher's lease, read again and its chain
    verified. A node committed since the read (by another process) is skipped for at most
    ``ttl_s``: the save then builds on a shallower parent or writes a full cut, both as
    correct as a delta on the deepest one. A commit of this process marks its node present
    (``present``), and an absence read that started before such a mark is not recorded, so
    this process's own saves (checkpoints one after another) see their parents."""

    def __init__(self, ttl_s: float, size: int) -> None:
        self.ttl_s = ttl_s
        self.size = size
        self._seen: OrderedDict[tuple[str, bytes], tuple[bool, float]] = OrderedDict()  # -> (absent, when)
        self._lock = threading.Lock()

    def _put(self, key: tuple[str, bytes], absent: bool, when: float) -> None:
        self._seen[key] = (absent, when)
        self._seen.move_to_end(key)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)

    def absent(self, location: str, node_id: bytes, started: float) -> None:
        """A read that started at ``started`` found no entry at ``node_id``."""
        key = (location, node_id)
        with self._lock:
            cur = self._seen.get(key)
            if cur is not None and not cur[0] and cur[1] >= started:
                return  # committed here after that read began: the read is stale
            self._put(key, True, started)

    def present(self, location: str, node_id: bytes) -> None:
        """This process committed (or found) an entry at ``node_id``."""
        with self._lock:
            self._put((location, node_id), False, time.monotonic())

    def known_absent(self, location: str, node_id: bytes) -> bool:
        """Whether a read of this process found the entry absent within ``ttl_s``."""
        with self._lock:
            cur = self._seen.get((location, node_id))
        return cur is not None and cur[0] and time.monotonic() - cur[1] <= self.ttl_s


#: seconds an index entry read as absent lets a save's parent pick skip it (IndexAbsence):
#: the lookup, the prefill of the rest and the save of one request fit in it
INDEX_ABSENT_TTL_S = 60.0
#: index entries read as absent by this process that are remembered (node ids: a
#: 32,768-token prompt has 128, so this covers the lookups of 128 such prompts)
INDEX_ABSENT = IndexAbsence(INDEX_ABSENT_TTL_S, 16384)


def chunk_name(content_id: bytes) -> str:
    return f"chunks/{content_id.hex()}.kvchk"


def pack_name(manifest_id: bytes) -> str:
    return f"packs/{manifest_id.hex()}.kvpkp"


def logits_name(manifest_id: bytes) -> str:
    return f"logits/{manifest_id.hex()}.kvchk"


def index_name(node_id: bytes) -> str:
    return f"index/{node_id.hex()}"


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
    #: seconds of the save's steps: ``lookup_s`` (lease, gc epoch, the cut's own index
    #: entry), ``plan_s`` (the parent pick: one index read per 256-token node on a miss),
    #: ``chunks_s`` (hash, encode, write every chunk), ``durable_s`` (chunk directory, pack,
    #: logits), ``commit_s`` (the index entry); empty for an ``existing`` cut
    phases: dict[str, float] = field(default_factory=dict)


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


class CutWithdrawn(StoreError):
    """A restore found objects of its cut gone and the cut's index entry no longer naming
    it: the cut was forgotten (or replaced) while the restore ran, and gc removed what only
    it referenced. A miss (category ``miss``), not damage: nothing is quarantined and the
    live session is untouched."""

    def __init__(self, hit: "Hit", why: str) -> None:
        super().__init__("miss", f"cut {hit.manifest_id.hex()} was withdrawn from the index while the restore ran ({why})")
        self.hit = hit


@dataclass(frozen=True)
class Unreadable:
    """An index entry a lookup passed over because reading it -- or looking at its cut's
    pack and final-logits objects -- failed with an I/O error (EIO, an S3 5xx, a timeout, a
    server that is down): ``error`` is that ``StoreError("io")``. A miss for the caller
    (it recomputes), never a verdict on the stored bytes: nothing is quarantined or deleted,
    and the entry serves again once the storage reads."""

    node_id: bytes
    error: StoreError


@dataclass
class Lookup:
    """What :meth:`PackStore.lookup_restore` did: the cut restored (or None: a miss), the
    receipts of cuts it quarantined on the way, how many cuts it found were withdrawn
    (forgotten or replaced) while it restored them (:class:`CutWithdrawn`), and the index
    entries it passed over because the storage failed to read them (:class:`Unreadable`,
    one per entry)."""

    hit: Hit | None
    report: RestoreReport | None
    quarantined: list[dict] = field(default_factory=list)
    withdrawn: int = 0
    unreadable: list[Unreadable] = field(default_factory=list)


@dataclass
class _Context:
    layout: CacheLayout
    ids: IdentityIds
    family: Family
    family_digest: bytes
    aux_root: bytes
    prefix_context: bytes


class _EnvChunks:
    """The :class:`kvpack.engine.restore.ChunkSource` of one restore: chunk objects read
    through the store's environment and verified under its keys."""

    def __init__(self, store: "PackStore", ctx: _Context) -> None:
        self.env = store.env
        self.tenant = store.tenant
        self.keys = store.keys
        self.epoch = store.epoch
        self.family_digest = ctx.family_digest

    def read(self, ref: ChunkRef) -> bytes:
        try:
            return self.env.read(chunk_name(ref.content_id))
        except ObjectMissing:
            raise StoreError("incomplete", f"chunk {ref.content_id.hex()} is missing") from None

    def read_into(self, ref: ChunkRef, region: memoryview) -> tuple[Buffer, int]:
        try:
            return self.env.read_into(chunk_name(ref.content_id), region)
        except ObjectMissing:
            raise StoreError("incomplete", f"chunk {ref.content_id.hex()} is missing") from None

    def verify_args(self, job: ChunkJob) -> dict[str, Any]:
        return dict(ref=job.ref, span=job.span, tenant=self.tenant, family=job.manifest.family, key=job.key, keys=self.keys, family_digest=self.family_digest)

    def worker_reader(self) -> tuple[str, str, tuple] | None:
        """The recipe of :func:`posix_chunk_reader` for a plain POSIX store (reader
        processes read the same files); None for other backends and for a fault-injecting
        file layer, whose reads must stay in this process."""
        from .posix import PosixEnv

        if isinstance(self.env, PosixEnv) and type(self.env.ops) is FileOps:
            return ("kvpack.store.packstore", "posix_chunk_reader", (self.env.root,))
        return None


class _PosixChunkReader:
    """``_EnvChunks.read_into`` of a POSIX store, rebuilt in a reader process."""

    def __init__(self, root: str) -> None:
        from .posix import PosixEnv

        self.env = PosixEnv(root)

    def read_into(self, ref: ChunkRef, region: memoryview) -> tuple[Buffer, int]:
        try:
            return self.env.read_into(chunk_name(ref.content_id), region)
        except ObjectMissing:
            raise StoreError("incomplete", f"chunk {ref.content_id.hex()} is missing") from None


def posix_chunk_reader(root: str) -> _PosixChunkReader:
    """Factory named by ``_EnvChunks.worker_reader`` (kvpack.engine.chunk_readers)."""
    return _PosixChunkReader(root)


def _tuning_attribute(name: str) -> property:
    """A PackStore attribute that reads and sets a :class:`RestoreTuning` field."""
    return property(lambda self: getattr(self.tuning, name), lambda self, value: setattr(self.tuning, name, value))


class PackStore:
    """One store (a directory or a bucket prefix) for one tenant and key epoch."""

    # restore-pipeline knobs, kept as store attributes (tests and benchmarks set them)
    workers = _tuning_attribute("workers")
    plane_staging = _tuning_attribute("plane_staging")
    verify_on = _tuning_attribute("verify_on")
    device_waves = _tuning_attribute("device_waves")
    device_staging_bytes = _tuning_attribute("device_staging_bytes")
    wave_chunks = _tuning_attribute("wave_chunks")
    device_host_tail = _tuning_attribute("device_host_tail")
    read_processes = _tuning_attribute("read_processes")
    host_readers = _tuning_attribute("host_readers")

    def __init__(self, env: StorageEnv, config: dict, root: bytes) -> None:
        self.env = env
        self.path = env.location
        self.config = config
        self.tenant_name = config["tenant"]
        self.tenant = tenant_id(self.tenant_name)
        self.epoch = int(config["key_epoch"])
        self.encrypted = bool(config["encrypted"])
        self.chunk_bytes = int(config.get("chunk_bytes", DEFAULT_CHUNK_BYTES))
        self.keys = KeySchedule.derive(root, self.tenant, self.epoch)
        # hashing/AEAD/reads run on this many threads; 1 makes the I/O order deterministic
        self.tuning = RestoreTuning(workers=max(default_workers(), env.io_parallelism))
        #: restores of this handle that ended as a :class:`CutWithdrawn` miss (a counter
        #: for the daemons' and the benchmarks' reports; never reset here)
        self.withdrawn_restores = 0
        #: index entries lookups of this handle passed over because the storage failed to
        #: read them or their cut's objects (:class:`Unreadable`; a counter like
        #: ``withdrawn_restores``, never reset here)
        self.unreadable_entries = 0
        #: threads a save writes chunk objects on (None: ``2 * workers``, see
        #: :func:`kvpack.store.publish.save_threads`); benchmarks compare counts with it
        self.save_writers: int | None = None
        #: whole-operation deadlines (seconds) of a restore and a save: see
        #: DEFAULT_RESTORE_DEADLINE_S and :meth:`StorageEnv.with_deadline`
        self.restore_deadline_s = seconds_setting("KVPACK_RESTORE_DEADLINE_S", DEFAULT_RESTORE_DEADLINE_S)
        self.save_deadline_s = seconds_setting("KVPACK_SAVE_DEADLINE_S", DEFAULT_SAVE_DEADLINE_S)
        self.maintenance_deadline_s = seconds_setting("KVPACK_MAINTENANCE_DEADLINE_S", DEFAULT_MAINTENANCE_DEADLINE_S)

    @property
    def ops(self) -> FileOps:
        return getattr(self.env, "ops", REAL_OPS)

    # -- opening (kvpack.store.location does the parsing and the refusals) -------------------
    @classmethod
    def init(cls, location: str | StorageEnv, **kw: Any) -> "PackStore":
        from .location import init_store

        return init_store(location, **kw)

    @classmethod
    def open(cls, location: str | StorageEnv, **kw: Any) -> "PackStore":
        from .location import open_store

        return open_store(location, **kw)

    def close(self) -> None:
        self.env.close()

    def _bounded(self, seconds: float) -> "PackStore":
        """A view of this store whose environment bounds every request by a deadline
        ``seconds`` from now (:meth:`StorageEnv.with_deadline`); this store where the
        environment cannot (POSIX)."""
        env = self.env.with_deadline(time.monotonic() + seconds)
        if env is self.env:
            return self
        view = copy.copy(self)
        view.env = env
        return view

    # -- names (POSIX paths kept for tools and tests that damage files on purpose) -----------
    def _p(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    def chunk_path(self, content_id: bytes) -> str:
        return self._p(chunk_name(content_id))

    def pack_path(self, manifest_id: bytes) -> str:
        return self._p(pack_name(manifest_id))

    def logits_path(self, manifest_id: bytes) -> str:
        return self._p(logits_name(manifest_id))

    def index_path(self, node_id: bytes) -> str:
        return self._p(index_name(node_id))

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

    def _read_index_versioned(self, node_id: bytes, env: StorageEnv | None = None) -> tuple[bytes, str] | None:
        """``(manifest id, version)`` of an index entry, or None; malformed entries refuse.
        On a network backend an absent entry is remembered for a while (:data:`INDEX_ABSENT`:
        a save's parent pick skips what its lookup just read)."""
        started = time.monotonic()
        got = (env or self.env).read_versioned(index_name(node_id), max_bytes=MAX_INDEX_ENTRY_BYTES)
        if got is None:
            if self._remote_index:
                INDEX_ABSENT.absent(self.path, node_id, started)
            return None
        text, version = got
        if len(text) > MAX_INDEX_ENTRY_BYTES:
            raise StoreError("corrupt", f"index entry {node_id.hex()} is malformed (more than {MAX_INDEX_ENTRY_BYTES} bytes)")
        try:
            mid = bytes.fromhex(text.strip().decode())
        except (ValueError, UnicodeDecodeError):
            raise StoreError("corrupt", f"index entry {node_id.hex()} is malformed") from None
        if len(mid) != 32:
            raise StoreError("corrupt", f"index entry {node_id.hex()} is malformed")
        return mid, version

    @property
    def _remote_index(self) -> bool:
        """Whether an index read is a round trip worth saving (a backend reading entries in
        parallel batches, S3), not a local open (POSIX: the saves read afresh)."""
        return self.env.io_parallelism > 1

    def _read_index(self, node_id: bytes, env: StorageEnv | None = None) -> bytes | None:
        got = self._read_index_versioned(node_id, env)
        return None if got is None else got[0]

    def _index_deepest_first(self, nodes: Sequence[Any], env: StorageEnv | None = None) -> Iterator[tuple[Any, bytes | None | StoreError]]:
        """``(node, manifest id or None, or the StoreError reading the entry raised)`` for each
        of ``nodes`` (deepest first), in that order. On a network backend the entries are
        fetched ahead in parallel batches of 1, 2, 4, ... up to ``io_parallelism``: a lookup
        that misses reads one entry per 256 tokens, and one round trip after another made a
        miss on a 32k prompt 128 sequential GETs (now 12 rounds); a hit at the deepest node
        still costs one GET, and one k nodes shallower at most 2k."""
        batch = self.env.io_parallelism
        if batch <= 1:
            for node in nodes:
                try:
                    yield node, self._read_index(node.node_id, env)
                except StoreError as exc:
                    yield node, exc
            return

        def fetch(node: Any) -> bytes | None | StoreError:
            try:
                return self._read_index(node.node_id, env)
            except StoreError as exc:
                return exc

        pool = ThreadPoolExecutor(batch, thread_name_prefix="kvpack-index")
        try:
            at, size = 0, 1
            while at < len(nodes):
                part = nodes[at : at + size]
                yield from zip(part, pool.map(fetch, part))
                at, size = at + size, min(2 * size, batch)
        finally:
            # a caller that stopped early (a hit, or storage that is down) does not wait for
            # the reads of the batch still in flight: they finish on their own
            pool.shutdown(wait=False, cancel_futures=True)

    def _complete(self, mid: bytes, env: StorageEnv | None = None) -> bool:
        """The cut's pack and final-logits object both exist (cheap; not a verification)."""
        env = env or self.env
        return env.exists(pack_name(mid)) and env.exists(logits_name(mid))

    # -- lookup ----------------------------------------------------------------------------
    def find_deepest(
        self,
        tokens: Sequence[int],
        layout: CacheLayout,
        ids: IdentityIds,
        aux: Sequence[tuple[bytes, bytes]] = (),
        *,
        require_logits: bool = True,
        incomplete: list[tuple[bytes, bytes | None]] | None = None,
        unreadable: list[Unreadable] | None = None,
    ) -> Hit | None:
        """The deepest committed cut reusable for ``tokens`` under this exact identity:
        a 256-aligned prefix, or the whole token sequence. ``None`` is a miss.

        ``require_logits=False`` also offers *prefix cuts* (saved with ``prefix_only``: no
        final-logits row, installable only as a prefix that the engine extends).
        ``incomplete``: gets ``(node id, manifest id)`` of each deeper entry skipped because
        its cut's pack or logits object is missing, and ``(node id, None)`` of each malformed
        one (:meth:`lookup_restore` quarantines them).

        An entry the storage fails to read -- the entry itself, or the existence and header
        checks of its cut's pack and logits objects (EIO, an S3 5xx or timeout, the server
        down) -- is passed over like a miss, never taken for damage: it is counted in
        ``unreadable_entries`` and appended to ``unreadable`` (:class:`Unreadable`), and the
        next shallower entry is tried. After :data:`UNREADABLE_RUN` unreadable entries in a
        row the storage is taken to be down and the lookup stops there (a miss; the entries
        below are not read): with the S3 server gone every read spends the client's retries,
        and a 32k-token prompt has 128 entries. A malformed entry is ``corrupt`` (damage); an
        unreadable one says nothing about the stored bytes."""
        if not tokens:
            return None
        ctx = self.context(layout, ids, aux)
        chain = self._chain(ctx, tokens)
        nodes = [node for node in reversed(chain.nodes) if node.reusable or node.cumulative_count == len(tokens)]

        run = 0  # consecutive entries the storage failed to read

        def passed_over(node_id: bytes, exc: StoreError) -> bool:
            """Count it; True once the storage looks down (stop reading: a miss)."""
            nonlocal run
            self.unreadable_entries += 1
            if unreadable is not None:
                unreadable.append(Unreadable(node_id, exc))
            run += 1
            return run >= UNREADABLE_RUN

        quick = self.env.for_lookup()  # short timeouts on a network backend (a hung server)
        for node, mid in self._index_deepest_first(nodes, quick):
            if isinstance(mid, StoreError):
                if mid.category != "corrupt":
                    if passed_over(node.node_id, mid):  # the storage failed: not a verdict
                        return None
                    continue
                run = 0
                if incomplete is not None:
                    incomplete.append((node.node_id, None))  # malformed: quarantined too
                continue  # neither is a hit
            if mid is None:
                run = 0
                continue
            try:
                complete = self._complete(mid, quick)
                prefix_cut = complete and require_logits and self._is_prefix_cut(mid, quick)
            except StoreError as exc:
                if passed_over(node.node_id, exc):
                    return None
                continue
            run = 0
            if not complete:
                if incomplete is not None:
                    incomplete.append((node.node_id, mid))
                continue
            if prefix_cut:
                continue
            return Hit(mid, node.cumulative_count, node.node_id)
        return None

    def _is_prefix_cut(self, mid: bytes, env: StorageEnv | None = None) -> bool:
        """Whether the cut's logits object is a prefix marker (its plaintext is the manifest
        id alone). Reads the fixed header only; an unreadable object is not a prefix cut here
        (restore verifies it and refuses)."""
        try:
            head = (env or self.env).read_range(logits_name(mid), 0, C.HEADER_BYTES)
            return len(head) == C.HEADER_BYTES and ChunkHeader.parse(head).plaintext_bytes == PREFIX_MARKER_BYTES
        except (ObjectMissing, FormatError):
            return False
        except OSError as exc:  # not the env's: env reads raise StoreError("io") (find_deepest: Unreadable)
            raise StoreError("io", f"read {logits_name(mid)}: {exc.strerror or exc}") from None

    # -- save (kvpack.store.publish) ---------------------------------------------------------
    def save(self, session: Any, **kw: Any) -> SaveReport:
        """Publish a cut of the session: chunks, pack, final logits, then the index entry
        (see :func:`kvpack.store.publish.save`)."""
        from .publish import save

        return save(self._bounded(self.save_deadline_s), session, **kw)

    # -- restore ---------------------------------------------------------------------------
    def load_chain(self, manifest_id: bytes) -> list[Manifest]:
        """The verified pack chain of a cut, newest first, down to its full manifest."""
        chain: list[Manifest] = []
        mid = manifest_id
        while True:
            try:
                data = self.env.read(pack_name(mid))
            except ObjectMissing:
                raise StoreError("incomplete", f"pack {mid.hex()} is missing") from None
            try:
                manifest, plain = decode_pack(data, self.keys, manifests=MANIFESTS)
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

    def check_binding(self, node_id: bytes, manifest_id: bytes, top: Manifest) -> None:
        """The index entry at ``node_id`` may only name a manifest of that very cut."""
        if top.cut.token_root != node_id:
            raise StoreError("corrupt", f"index entry {node_id.hex()} names manifest {manifest_id.hex()} of another cut")

    def restore(self, hit: Hit, session: Any, tokens: Sequence[int], *, aux: Sequence[tuple[bytes, bytes]] = (), require_logits: bool = True) -> RestoreReport:
        """Verify every byte of the cut (packs, chunks, logits) and install it atomically.

        Any mismatch refuses with StoreError and the live session is left untouched. A prefix
        cut (no logits row) is a ``miss`` unless ``require_logits=False``; it is then committed
        with ``install.commit(require_logits=False)``. A cut whose objects went missing
        because it was forgotten (or replaced) while the restore ran is a
        :class:`CutWithdrawn` miss, not ``incomplete``."""
        try:
            return self._restore(hit, session, tokens, aux=aux, require_logits=require_logits)
        except StoreError as exc:
            if exc.category != "incomplete" or not self._withdrawn(hit):
                raise
            self.withdrawn_restores += 1
            raise CutWithdrawn(hit, exc.message) from None

    def _withdrawn(self, hit: Hit) -> bool:
        """Whether ``hit``'s index entry no longer names its cut (gone, or another cut). A
        malformed entry is not a withdrawal: the refusal stands (healing quarantines it)."""
        try:
            return self._read_index(hit.node_id) != hit.manifest_id
        except StoreError:
            return False

    def _restore(self, hit: Hit, session: Any, tokens: Sequence[int], *, aux: Sequence[tuple[bytes, bytes]], require_logits: bool) -> RestoreReport:
        t0 = time.perf_counter()
        layout: CacheLayout = session.layout
        ids = _engine_ids(session)
        ctx = self.context(layout, ids, aux)
        if len(tokens) < hit.cut:
            raise StoreError("usage", f"{len(tokens)} tokens for a cut of {hit.cut}")
        if self._chain(ctx, tokens[: hit.cut]).token_root != hit.node_id:
            raise StoreError("miss", "the tokens do not lead to this cut")
        # every request of the restore (lease included) ends by its deadline: a hung server
        # refuses it (io) within restore_deadline_s and a few seconds, and the caller recomputes
        store = self._bounded(self.restore_deadline_s)
        with store.env.lease(RESTORE, protects=[hit.manifest_id.hex()]):
            chain = store.load_chain(hit.manifest_id)
            top = chain[0]
            if top.cut.token_root != hit.node_id or top.cut.token_count != hit.cut or top.cut.aux_root != ctx.aux_root:
                raise StoreError("corrupt", "stored cut does not match its index entry")
            if top.family != ctx.family or top.semantic != semantic_id(ids):
                raise StoreError("miss", "stored cut was written under another identity")
            t_packs = time.perf_counter()
            install = session.begin_install(hit.cut, list(tokens[: hit.cut]), session.engine.identity)
            try:
                result = install_chunks(self._jobs(chain, install), _EnvChunks(store, ctx), install, layout, self.tuning)
                t_chunks = time.perf_counter()
                logits = store._read_logits(hit.manifest_id, top)
                if logits:
                    install.write_logits(logits)
                    install.commit()
                elif require_logits:
                    # a miss, not a damaged cut: healing callers must not quarantine it
                    raise StoreError("miss", f"cut {hit.manifest_id.hex()} is a prefix cut (saved without its final-logits row)")
                else:
                    install.commit(require_logits=False)
            except BaseException as exc:
                install.abort()
                if isinstance(exc, FormatError):
                    raise _corrupt("cut", exc) from None
                raise
        t1 = time.perf_counter()
        phases = {"packs_s": t_packs - t0, "chunks_s": t_chunks - t_packs, "logits_commit_s": t1 - t_chunks, **result.phases}
        return RestoreReport(hit.manifest_id.hex(), hit.cut, len(chain), result.verified, result.nbytes, t1 - t0, phases, result.hashed_on)

    @staticmethod
    def _jobs(chain: list[Manifest], install: Any) -> list[ChunkJob]:
        """The chunks a restore installs: spans wholly outside a windowed layer's window at
        the cut are not even read."""
        jobs = []
        for manifest in chain:
            for key, span, ref in manifest.chunk_refs():
                lo, hi = install.required_range(key.layer)
                a, b = max(span.token_start, lo), min(span.token_start + span.token_count, hi)
                if a < b:
                    jobs.append(ChunkJob(manifest, key, span, ref, a, b))
        return jobs

    def _read_logits(self, mid: bytes, manifest: Manifest) -> bytes:
        """Verify the final-logits object of the cut ``mid`` and return the f32 row bytes."""
        try:
            obj = self.env.read(logits_name(mid))
        except ObjectMissing:
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
        return bytes(plaintext[32:])

    # -- healing (kvpack.store.maintenance) ----------------------------------------------------
    def find_deepest_healing(
        self,
        tokens: Sequence[int],
        layout: CacheLayout,
        ids: IdentityIds,
        aux: Sequence[tuple[bytes, bytes]] = (),
        *,
        require_logits: bool = True,
        quarantined: list[dict] | None = None,
        unreadable: list[Unreadable] | None = None,
    ) -> Hit | None:
        """:meth:`find_deepest`, and every index entry it had to pass over as damaged -- one
        naming a cut whose pack or logits object is gone (the index entry is written last),
        or a malformed one -- is quarantined with a receipt (appended to ``quarantined``):
        damage, not only a miss. Used by :meth:`lookup_restore`, the daemons' ladder and the
        vLLM connector, so each lookup leaves the index cleaner than it found it.

        Entries the storage failed to read are passed over and never quarantined
        (:class:`Unreadable`, appended to ``unreadable``); so is a damaged entry whose
        quarantine itself fails to read or write (the storage went away meanwhile): the
        lookup still answers, and the entry is healed by a later lookup."""
        incomplete: list[tuple[bytes, bytes | None]] = []
        hit = self.find_deepest(tokens, layout, ids, aux, require_logits=require_logits, incomplete=incomplete, unreadable=unreadable)
        if incomplete:
            from .maintenance import quarantine_incomplete

            receipts = []
            healer = self._bounded(self.restore_deadline_s)  # a hung server costs the lookup its deadline
            for node, mid in incomplete:
                try:
                    receipt = quarantine_incomplete(healer, node, mid)
                except (StoreError, DurableIOError) as exc:
                    if isinstance(exc, StoreError) and exc.category in ("corrupt", "incomplete"):
                        raise
                    err = exc if isinstance(exc, StoreError) else StoreError("io", exc.message)
                    self.unreadable_entries += 1
                    if unreadable is not None:
                        unreadable.append(Unreadable(node, err))
                    continue
                if receipt is not None:
                    receipts.append(receipt)
            if quarantined is not None:
                quarantined.extend(receipts)
        return hit

    def restore_healing(
        self, hit: Hit, session: Any, tokens: Sequence[int], *, aux: Sequence[tuple[bytes, bytes]] = (), require_logits: bool = True
    ) -> tuple[RestoreReport | None, dict | None]:
        """:meth:`restore`, except that a cut failing verification (``corrupt`` or
        ``incomplete``) is quarantined with a receipt and comes back as a miss
        ``(None, receipt)``; the live session is untouched either way. Other refusals (I/O,
        lock, usage) propagate: they say nothing about the stored bytes."""
        report, receipt, _withdrawn = self._restore_healing(hit, session, tokens, aux=aux, require_logits=require_logits)
        return report, receipt

    def _restore_healing(
        self, hit: Hit, session: Any, tokens: Sequence[int], *, aux: Sequence[tuple[bytes, bytes]], require_logits: bool
    ) -> tuple[RestoreReport | None, dict | None, bool]:
        """:meth:`restore_healing`, also saying whether the miss was a :class:`CutWithdrawn`."""
        try:
            return self.restore(hit, session, tokens, aux=aux, require_logits=require_logits), None, False
        except CutWithdrawn:
            return None, None, True
        except StoreError as exc:
            if exc.category == "miss":
                return None, None, False
            if exc.category not in ("corrupt", "incomplete"):
                raise
            from .maintenance import quarantine_after_refusal

            # bounded like the restore: a server that stops answering mid-quarantine ends it
            # (io: the lookup's miss) within the deadline; what it did so far is a crash
            # mid-quarantine, which the order of its steps already makes safe
            return None, quarantine_after_refusal(self._bounded(self.restore_deadline_s), hit, exc), False

    def lookup_restore(
        self,
        tokens: Sequence[int],
        session: Any,
        *,
        aux: Sequence[tuple[bytes, bytes]] = (),
        max_attempts: int = 4,
        layout: Any = None,
        ids: Any = None,
        require_logits: bool = True,
    ) -> Lookup:
        """The one lookup every consumer uses (generate, the daemons' ladder, the vLLM
        connector): find the deepest cut, restore it verified, and treat a cut that fails
        verification as a miss -- quarantined with a receipt, then the next shallower cut is
        tried. A cut forgotten while it was being restored (:class:`CutWithdrawn`) is a miss
        too, counted in ``Lookup.withdrawn``, and the lookup goes on with the next cut. An
        index entry the storage fails to read is passed over, never quarantined
        (``Lookup.unreadable``); so is the cut found when restoring it fails with an I/O
        error (``io``: EIO, or a server that did not answer within the restore's deadline,
        ``restore_deadline_s``): the lookup then ends as a miss, the live session untouched.
        The caller recomputes what was not restored and republishes it.
        ``require_logits=False`` also takes prefix cuts (engines that compute the next row)."""
        layout = layout if layout is not None else session.layout
        ids = ids if ids is not None else _engine_ids(session)
        quarantined: list[dict] = []
        withdrawn = 0
        unreadable: dict[bytes, Unreadable] = {}  # per entry: every attempt reads them again
        for _ in range(max_attempts):
            passed: list[Unreadable] = []
            hit = self.find_deepest_healing(tokens, layout, ids, aux, require_logits=require_logits, quarantined=quarantined, unreadable=passed)
            for u in passed:
                unreadable.setdefault(u.node_id, u)
            if hit is None:
                break
            try:
                report, receipt, was_withdrawn = self._restore_healing(hit, session, tokens, aux=aux, require_logits=require_logits)
            except StoreError as exc:
                if exc.category != "io":
                    raise
                # the storage failed (EIO, a server that hangs past the restore's deadline):
                # a miss the caller recomputes, the entry reported like one the lookup could
                # not read; no shallower cut is tried (the same storage serves it)
                self.unreadable_entries += 1
                unreadable.setdefault(hit.node_id, Unreadable(hit.node_id, exc))
                break
            if report is not None:
                return Lookup(hit, report, quarantined, withdrawn, list(unreadable.values()))
            if was_withdrawn:
                withdrawn += 1  # forgotten while restoring: a shallower cut may still serve
                continue
            if receipt is None:
                break  # a plain miss (identity, a prefix cut)
            quarantined.append(receipt)
            quarantined.extend(receipt.get("ancestors", ()))  # parents sharing its damage
        return Lookup(None, None, quarantined, withdrawn, list(unreadable.values()))

    def ls(self) -> list[dict]:
        from .maintenance import ls

        return ls(self)

    def verify(self, *, read_data: bool = True) -> dict:
        from .maintenance import verify

        return verify(self, read_data=read_data)

    def repair(self) -> dict:
        from .maintenance import repair

        return repair(self)

    def forget(self, manifest_id: bytes) -> dict:
        from .maintenance import forget

        return forget(self, manifest_id)

    def gc(self) -> dict:
        from .maintenance import gc

        return gc(self)

    def index_entries(self, problems: list[str] | None = None) -> list[tuple[bytes, bytes]]:
        from .maintenance import index_entries

        return index_entries(self, problems)


def _engine_ids(session: Any) -> IdentityIds:
    """The session engine's identity ids (cached by engines that offer ``ids()``)."""
    engine = session.engine
    return engine.ids() if isinstance(engine, Engine) else engine.identity.ids()


def _corrupt(what: str, exc: FormatError) -> StoreError:
    err = StoreError("corrupt", f"{what}: refused {exc.category}: {exc.message}")
    err.format_category = exc.category  # type: ignore[attr-defined]
    return err
