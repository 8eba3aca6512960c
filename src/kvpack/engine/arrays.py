"""A NumPy engine adapter: KV planes held as plain arrays.

It implements the same session protocol as the transformers adapter (``export_rows``,
``export_logits``, ``begin_install`` -> detached install with ``write_rows`` / ``commit`` /
``abort``) for engines that hand kvpack raw arrays, and it is what the store's crash and GC
loops run in their many short-lived subprocesses (no model load). Its "forward pass" is a
deterministic function of (layer, role, position, token), so two sessions fed the same tokens
hold the same bytes, whatever the chunking.
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import sys
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from ..errors import EngineError
from .contract import DTYPE_WIDTH, LAYER_FULL, LAYER_WINDOWED, ArenaSpec, CacheLayout, EngineIdentity, IdentityIds, InstallContext, LayerSpec
from .contract import cache_digest as contract_cache_digest
from .contract import state_digest as contract_state_digest


def array_layout(
    layers: int = 4, kv_heads: int = 2, head_dim: int = 8, dtype: str = "f32", windowed: dict[int, int] | None = None, vocab: int = 64
) -> CacheLayout:
    windowed = windowed or {}
    specs = []
    for i in range(layers):
        w = windowed.get(i, 0)
        specs.append(
            LayerSpec(
                i, LAYER_WINDOWED if w else LAYER_FULL, kv_heads, head_dim, dtype, "rope" if w else "nope", window_tokens=w, attention_window=w + 1 if w else 0
            )
        )
    return CacheLayout(tuple(specs), vocab_size=vocab)


def _default_pool_bytes() -> int:
    """A quarter of physical memory (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return 0


class SharedArena:
    """A memfd mapped into this process that other processes (the host restore's reader
    processes) map too, by :meth:`spec`: ``/proc/<pid>/fd/<fd>`` (a memfd has no name in the
    file system and vanishes with its last reference: nothing leaks if this process dies).
    Kept for the life of the process (the pool reuses it), so the path stays valid."""

    _ids = itertools.count(1)

    def __init__(self, nbytes: int) -> None:
        fd = os.memfd_create("kvpack-planes", getattr(os, "MFD_CLOEXEC", 1))
        try:
            os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.nbytes, self.id = fd, nbytes, next(self._ids)

    def spec(self) -> ArenaSpec:
        return (self.id, f"/proc/{os.getpid()}/fd/{self.fd}", self.nbytes)


class PlanePool:
    """Install planes recycled from installs nothing references any more.

    Why it exists: a fresh ``np.empty`` of a large plane is fresh pages from the kernel, and
    the first write to each page (the TLS decryption of a handoff landing in the install's
    rows) faults and zero-fills it: on the 2-core dev box ``clear_page`` was 49 % of the
    receiver daemon's samples during a 512 MiB handoff (perf, docs/bench/nodes_profile.md,
    round 4), on the connection's thread. A serving engine allocates its KV memory once (a
    block pool); this pool gives the arrays engine the same steady state: an install's plane
    is carved from a buffer an earlier install used, once nothing holds a view of it.

    Recycling is decided by reference count: the pool keeps every buffer (*root*) it made and
    reuses one only while the pool's own list is its sole referrer. Every NumPy view, slice,
    ``memoryview`` or ``np.frombuffer`` of a plane keeps a reference to its root, so a root in
    use by a session, a resident tier, an export or a payload target is never handed out
    again; bytes are never rewritten under a reader. Reused rows hold an earlier session's
    bytes, exactly as ``np.empty`` promises nothing: an install refuses to commit unless
    every needed row was written, and spare rows are written before they are read.

    Bounded: roots total at most ``limit_bytes`` (then planes are plain ``np.empty``);
    planes under ``min_bytes`` are never pooled. Sizes are rounded up to 8 classes per
    power of two (at most 12.5 % slack) so installs of similar length share roots.
    """

    def __init__(self, limit_bytes: int, min_bytes: int = 1 << 20) -> None:
        self.limit_bytes = max(0, int(limit_bytes))
        self.min_bytes = max(1, int(min_bytes))
        self._lock = threading.Lock()
        self._roots: dict[int, list[np.ndarray]] = {}
        # shared arenas (a whole install's planes in one memfd): (root, arena) per size class
        self._arenas: dict[int, list[tuple[np.ndarray, SharedArena]]] = {}
        self.held_bytes = 0
        self.reused = 0  # planes carved from a recycled root
        self.made = 0  # roots allocated
        # the count of a root only the pool's list holds, read the way empty() reads it
        # (measured, not assumed: interpreters differ in the references a call adds)
        probe = [np.empty(1, np.uint8)]
        self._idle_refs = sys.getrefcount(probe[0])

    @staticmethod
    def size_class(nbytes: int) -> int:
        step = 1 << max(0, nbytes.bit_length() - 4)
        return -(-nbytes // step) * step

    def empty(self, shape: tuple[int, int]) -> np.ndarray:
        """An uninitialised uint8 array of ``shape`` (rows, row bytes)."""
        rows, width = shape
        nbytes = rows * width
        if nbytes < self.min_bytes or self.limit_bytes == 0:
            return np.empty(shape, np.uint8)
        size = self.size_class(nbytes)
        with self._lock:
            roots = self._roots.setdefault(size, [])
            for i in range(len(roots)):
                if sys.getrefcount(roots[i]) == self._idle_refs:  # no view of it exists
                    self.reused += 1
                    return roots[i][:nbytes].reshape(shape)
            if self.held_bytes + size > self.limit_bytes:
                return np.empty(shape, np.uint8)
            root = np.empty(size, np.uint8)
            roots.append(root)
            self.held_bytes += size
            self.made += 1
            return root[:nbytes].reshape(shape)

    def shared(self, nbytes: int) -> tuple[np.ndarray, ArenaSpec] | None:
        """``nbytes`` of uninitialised uint8 in shared memory (a :class:`SharedArena`,
        recycled exactly like a root: once no view of it exists) and where other processes
        find it; None when the pool is off, full, or the platform has no memfd. Any size is
        pooled (an arena holds a whole install, small or not)."""
        if self.limit_bytes == 0 or not hasattr(os, "memfd_create"):
            return None
        size = self.size_class(max(1, nbytes))
        with self._lock:
            arenas = self._arenas.setdefault(size, [])
            for i in range(len(arenas)):  # indexed: a loop variable would be one more reference
                if sys.getrefcount(arenas[i][0]) == self._idle_refs:
                    self.reused += 1
                    return arenas[i][0][:nbytes], arenas[i][1].spec()
            if self.held_bytes + size > self.limit_bytes:
                return None
            try:
                arena = SharedArena(size)
            except OSError:
                return None
            root = np.frombuffer(arena.map, np.uint8)
            arenas.append((root, arena))
            self.held_bytes += size
            self.made += 1
            return root[:nbytes], arena.spec()

    def stats(self) -> dict[str, int]:
        with self._lock:
            roots = sum(len(r) for r in self._roots.values()) + sum(len(a) for a in self._arenas.values())
            return {"held_bytes": self.held_bytes, "roots": roots, "made": self.made, "reused": self.reused}


class ArrayEngine:
    #: The chunk grid callers use for aligned prefill (the rows do not depend on chunking).
    prefill_chunk_tokens = 256

    def __init__(
        self,
        layout: CacheLayout,
        *,
        name: str = "arrays",
        scalars: dict[str, float] | None = None,
        max_context: int = 1 << 20,
        plane_pool_bytes: int | None = None,
    ) -> None:
        self.layout = layout
        self.max_context = max_context
        #: install planes are recycled through this (``plane_pool_bytes``: default a quarter
        #: of physical memory; 0 turns recycling off)
        self.planes = PlanePool(_default_pool_bytes() if plane_pool_bytes is None else plane_pool_bytes)
        self.identity = EngineIdentity(
            model_name=name,
            weights_digest=hashlib.sha256(name.encode()).hexdigest(),
            config={"kind": "arrays"},
            tokenizer_digest=hashlib.sha256(b"identity-tokenizer").hexdigest(),
            chat_template_digest=hashlib.sha256(b"").hexdigest(),
            context_policy={"max_context": max_context},
            adapter={"name": "none"},
            weight_precision="exact",
            engine_abi={"engine": "kvpack.engine.arrays", "version": 2},
            scalars=dict(scalars or {"scale": 1.0}),
            layout=layout,
        )
        self._ids = self.identity.ids()

    def ids(self) -> IdentityIds:
        return self._ids

    def check_identity(self, expected: EngineIdentity | IdentityIds) -> None:
        ids = expected.ids() if isinstance(expected, EngineIdentity) else expected
        if ids != self.ids():
            raise EngineError("identity", "stored cache was written under another engine identity")

    def new_session(self) -> "ArraySession":
        return ArraySession(self)


#: lane masks that clear the top exponent bit of each float element: every row is finite
_FINITE_MASK = {2: np.uint16(0xBBFF), 4: np.uint32(0xBF7FFFFF)}


def _rows(spec: LayerSpec, role: str, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Deterministic token-major rows (uint8 view) for the given absolute positions.

    Two passes over the output (a broadcast add of a per-row and a per-lane term, wrapping in
    the element's width, then a mask keeping float planes finite): a prefill chunk costs
    about what copying its rows costs, so the engine never bounds a transfer benchmark.
    """
    n = positions.size
    width = DTYPE_WIDTH[spec.dtype]
    floats = width in (2, 4) and spec.row_bytes % width == 0
    lane_type = {2: np.uint16, 4: np.uint32}[width] if floats else np.uint8
    lanes = spec.row_bytes // np.dtype(lane_type).itemsize
    base = positions.astype(np.uint64) * np.uint64(0x9E3779B1) + tokens.astype(np.uint64) * np.uint64(0x85EBCA77)
    base ^= np.uint64(spec.index * 2 + (1 if role == "v" else 0)) * np.uint64(0xC2B2AE3D)
    row_term = ((base * np.uint64(2654435761)) >> np.uint64(16)).astype(lane_type)
    lane_term = (np.arange(lanes, dtype=np.uint64) * np.uint64(40503)).astype(lane_type)
    out = np.add(row_term[:, None], lane_term[None, :], dtype=lane_type)
    if floats:
        out &= _FINITE_MASK[width]
    return out.view(np.uint8).reshape(n, spec.row_bytes)


class _Plane:
    """One ``(layer, role)`` plane: a row buffer with spare capacity and the absolute position
    of its first row. Rows are appended in place, so a prefill in chunks costs one copy per
    row (amortised), never the ``np.concatenate`` of everything so far per chunk (quadratic).

    A buffer is never rewritten in place once rows are stored: growing or dropping rows that
    slid out of a window allocates a new buffer, so a view handed out by ``export_rows``
    keeps the bytes it had.

    ``head``: the plane's first rows as an immutable buffer taken by reference (a resident
    prefix installed with ``ArrayInstall.share_rows``: no copy); ``buf`` then holds the rows
    after them. A range across the two is concatenated (a copy of that range only); rows
    sliding out of a window fold both back into one buffer.
    """

    __slots__ = ("buf", "base", "rows", "head")

    def __init__(self, row_bytes: int, capacity: int = 0, base: int = 0) -> None:
        self.buf = np.empty((capacity, row_bytes), np.uint8)
        self.base = base  # absolute position of the first row (of head, when there is one)
        self.rows = 0  # valid rows: absolute [base, base + rows), head included
        self.head: np.ndarray | None = None

    @classmethod
    def adopt(cls, buf: np.ndarray, base: int, rows: int | None = None) -> "_Plane":
        """A plane over ``buf`` whose first ``rows`` rows (default: all) are valid; the rest
        is spare capacity the next appends fill without a copy."""
        plane = cls(buf.shape[1])
        plane.buf, plane.base, plane.rows = buf, base, buf.shape[0] if rows is None else rows
        return plane

    @classmethod
    def over_head(cls, head: np.ndarray, base: int, spare: int) -> "_Plane":
        """A plane whose rows are ``head`` (by reference), with ``spare`` rows to append."""
        plane = cls(head.shape[1], spare, base)
        plane.head, plane.rows = head, head.shape[0]
        return plane

    def view(self, start: int, stop: int) -> np.ndarray:
        head = self.head
        if head is None:
            return self.buf[start - self.base : stop - self.base]
        split = self.base + head.shape[0]
        if stop <= split:
            return head[start - self.base : stop - self.base]
        if start >= split:
            return self.buf[start - split : stop - split]
        return np.concatenate((head[start - self.base :], self.buf[: stop - split]))

    def parts(self, start: int, stop: int) -> list[np.ndarray]:
        """Rows ``[start, stop)`` as views, one per buffer they lie in (head, tail): no copy."""
        head = self.head
        split = self.base if head is None else self.base + head.shape[0]
        if head is None or start >= split or stop <= split:
            return [self.view(start, stop)]
        return [head[start - self.base :], self.buf[: stop - split]]

    def _fold(self) -> None:
        """Head and tail back into one buffer (rows are about to slide out of a window)."""
        assert self.head is not None
        tail = self.rows - self.head.shape[0]
        self.buf = np.concatenate((self.head, self.buf[:tail]))
        self.head = None

    def append(self, rows: np.ndarray, keep_from: int, reserve_to: int) -> None:
        """Append ``rows`` at ``base + rows``; rows before ``keep_from`` may be dropped;
        capacity for absolute positions up to ``reserve_to`` is allocated in one go."""
        start = self.base + self.rows
        end = start + rows.shape[0]
        if self.head is not None:
            if min(keep_from, start) > self.base:
                self._fold()
            else:
                split = self.base + self.head.shape[0]
                tail = start - split
                if end - split > self.buf.shape[0]:
                    fresh = np.empty((max(end, reserve_to) - split + max(tail, 64), self.buf.shape[1]), np.uint8)
                    fresh[:tail] = self.buf[:tail]
                    self.buf = fresh
                self.buf[tail : end - split] = rows
                self.rows += rows.shape[0]
                return
        if end - self.base > self.buf.shape[0]:
            keep = max(self.base, min(keep_from, start))
            need = max(end, reserve_to) - keep
            # geometric growth: decode appends one row at a time in amortised O(1)
            capacity = max(need, 2 * (start - keep), 64)
            fresh = np.empty((capacity, self.buf.shape[1]), np.uint8)
            fresh[: start - keep] = self.buf[keep - self.base : start - self.base]
            self.buf, self.base, self.rows = fresh, keep, start - keep
        self.buf[start - self.base : end - self.base] = rows
        self.rows += rows.shape[0]


class ArraySession:
    #: a view from ``export_rows`` keeps its bytes: stored rows are never rewritten in place
    #: (see ``_Plane``), so a caller done with the session may keep the views, not copies
    export_rows_stable = True

    def __init__(self, engine: ArrayEngine) -> None:
        self.engine = engine
        self.layout = engine.layout
        self.tokens: list[int] = []
        self._planes: dict[tuple[int, str], _Plane] = {(s.index, r): _Plane(s.row_bytes) for s in self.layout.layers for r in self.layout.roles}
        # SHA-256 of the token ids so far (<u4), continued per chunk: the logits seed
        self._token_hash = hashlib.sha256()
        self.last_logits: np.ndarray | None = None

    @property
    def position(self) -> int:
        return len(self.tokens)

    def prefill(self, token_ids: Sequence[int], chunk_size: int | None = None, on_chunk=None) -> None:
        ids = [int(t) for t in token_ids]
        step = chunk_size or max(1, len(ids))
        end = self.position + len(ids)  # planes are sized for the whole prompt up front
        i = 0
        while i < len(ids):
            pos = self.position
            n = min(len(ids) - i, (pos // step + 1) * step - pos)
            self._append(ids[i : i + n], end)
            i += n
            if on_chunk is not None:
                on_chunk(self)

    def _append(self, ids: list[int], reserve_to: int) -> None:
        start = self.position
        positions = np.arange(start, start + len(ids))
        toks = np.asarray(ids, dtype=np.int64)
        self.tokens.extend(ids)
        for spec in self.layout.layers:
            lo, _hi = spec.retained_range(self.position)
            # a windowed plane never needs more than its window plus this chunk
            reserve = reserve_to if spec.kind != LAYER_WINDOWED else min(reserve_to, self.position + spec.window_tokens)
            for role in self.layout.roles:
                self._planes[(spec.index, role)].append(_rows(spec, role, positions, toks), lo, reserve)
        self._token_hash.update(np.asarray(ids, dtype="<u4").tobytes())
        rng = np.random.default_rng(int.from_bytes(self._token_hash.digest()[:8], "little"))
        self.last_logits = rng.standard_normal(self.layout.vocab_size).astype(np.float32)

    def _adopt(
        self,
        planes: dict[tuple[int, str], np.ndarray],
        tokens: list[int],
        logits: np.ndarray | None,
        shared: dict[tuple[int, str], tuple[np.ndarray, int]] | None = None,
    ) -> None:
        """Take an install's planes (retained rows at ``tokens``' length first, then spare
        rows) as the live cache; ``shared`` planes are ``(immutable rows taken by reference,
        spare rows to allocate after them)``."""
        position = len(tokens)
        planes_of = {}
        for key, buf in planes.items():
            lo, hi = self.layout.retained_range(key[0], position)
            planes_of[key] = _Plane.adopt(buf, lo, hi - lo)
        for key, (head, spare) in (shared or {}).items():
            planes_of[key] = _Plane.over_head(head, self.layout.retained_range(key[0], position)[0], spare)
        self._planes = planes_of
        self.tokens = list(tokens)
        self._token_hash = hashlib.sha256(np.asarray(self.tokens, dtype="<u4").tobytes())
        self.last_logits = logits

    def decode_greedy(self, n: int, stop_token_ids: Iterable[int] = ()) -> tuple[list[int], list[np.ndarray]]:
        """Greedy decode ``n`` tokens (first maximum of the f32 row); returns (tokens, rows)."""
        if self.last_logits is None:
            raise EngineError("install", "no final logits at this cut: prefill at least one token first")
        stops = {int(t) for t in stop_token_ids}
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        for _ in range(n):
            row = np.asarray(self.last_logits, dtype=np.float32)
            token = int(np.argmax(row))
            tokens.append(token)
            rows.append(row.copy())
            self.prefill([token])
            if token in stops:
                break
        return tokens, rows

    def retained_range(self, layer: int) -> tuple[int, int]:
        return self.layout.retained_range(layer, self.position)

    def export_rows(self, layer: int, role: str, start: int, stop: int) -> memoryview:
        lo, hi = self.retained_range(layer)
        if not lo <= start <= stop <= hi:
            raise EngineError("layout", f"rows [{start}, {stop}) outside retained [{lo}, {hi})")
        if start == stop:
            return memoryview(b"")
        return np.ascontiguousarray(self._planes[(layer, role)].view(start, stop)).data.cast("B")

    def export_row_parts(self, layer: int, role: str, start: int, stop: int) -> list[memoryview]:
        """``export_rows`` without joining: a range across a plane's lent head and its own
        rows comes back as two views (in order), so a caller done with the session keeps
        both by reference instead of a copy of the range."""
        lo, hi = self.retained_range(layer)
        if not lo <= start <= stop <= hi:
            raise EngineError("layout", f"rows [{start}, {stop}) outside retained [{lo}, {hi})")
        return [p.data.cast("B") for p in self._planes[(layer, role)].parts(start, stop) if p.shape[0]]

    def export_logits(self) -> memoryview:
        if self.last_logits is None:
            raise EngineError("install", "no final logits at this cut")
        return self.last_logits.astype("<f4").data.cast("B")

    def state_digest(self, layer: int, role: str) -> bytes:
        """SHA-256 of the retained rows of one state in wire form (for restore proofs)."""
        return contract_state_digest(self, layer, role)

    def cache_digest(self) -> bytes:
        """SHA-256 over the position, every state digest and the logits (contract.cache_digest)."""
        return contract_cache_digest(self)

    def begin_install(self, cut: int, token_ids: Sequence[int], identity) -> "ArrayInstall":
        self.engine.check_identity(identity)
        return ArrayInstall(self, cut, token_ids)


#: spare rows an install's planes get beyond the rows it needs (plus 1/16 of those)
_INSTALL_SPARE_ROWS = 256


class ArrayInstall(InstallContext):
    #: writes of disjoint rows may run on several threads at once (a striped handoff's
    #: connections): each touches only its own slices of the planes and of ``_written``
    concurrent_row_writes = True

    def __init__(self, session: ArraySession, cut: int, token_ids: Sequence[int]) -> None:
        if len(token_ids) != cut or cut <= 0:
            raise EngineError("install", f"{len(token_ids)} token ids for a cut of {cut}")
        self.session = session
        self.layout = session.layout
        self.cut = cut
        self.tokens = [int(t) for t in token_ids]
        self.state = "open"
        self._logits: np.ndarray | None = None
        # a plane's buffer is made on its first write (a plane lent by share_rows never needs
        # one); uninitialised: commit refuses unless every needed row was written, and spare
        # rows are written by an append before anything reads them -- no zero-fill pass
        self._planes: dict[tuple[int, str], np.ndarray] = {}
        self._shapes: dict[tuple[int, str], tuple[int, int]] = {}
        self._alloc = threading.Lock()  # stripes may claim rows of one plane at once
        self._written = {}
        self._claimed = {}  # rows handed out by claim_rows, not yet landed
        self._shared: dict[tuple[int, str], np.ndarray] = {}  # planes taken by reference (share_rows)
        # share_planes: the shared arena every plane lies in, and each plane's byte offset there
        self._arena: ArenaSpec | None = None
        self._arena_offsets: dict[tuple[int, str], int] = {}
        for spec in self.layout.layers:
            lo, hi = spec.retained_range(cut)
            # spare rows after the needed ones: the boundary token, a last prefill chunk and
            # the first decode steps append in place after the commit, instead of copying
            # the whole cache into a larger buffer (pages never touched cost nothing)
            spare = _INSTALL_SPARE_ROWS + (hi - lo) // 16
            for role in self.layout.roles:
                self._shapes[(spec.index, role)] = (hi - lo + spare, spec.row_bytes)
                self._written[(spec.index, role)] = np.zeros(hi - lo, dtype=bool)
                self._claimed[(spec.index, role)] = np.zeros(hi - lo, dtype=bool)

    def required_range(self, layer: int) -> tuple[int, int]:
        return self.layout.retained_range(layer, self.cut)

    def write_rows(self, layer: int, role: str, start: int, data) -> None:
        if self.state != "open":
            raise EngineError("install", f"install already {self.state}")
        spec = self.layout.layer(layer)
        view = np.frombuffer(data, dtype=np.uint8)
        if view.size % spec.row_bytes:
            raise EngineError("layout", "not a whole number of rows")
        n = view.size // spec.row_bytes
        lo, hi = spec.retained_range(self.cut)
        if start < lo or start + n > hi:
            raise EngineError("layout", f"rows [{start}, {start + n}) outside the needed [{lo}, {hi})")
        written = self._written[(layer, role)]
        if written[start - lo : start - lo + n].any() or self._claimed[(layer, role)][start - lo : start - lo + n].any():
            raise EngineError("install", "rows written twice")
        self._plane((layer, role))[start - lo : start - lo + n] = view.reshape(n, spec.row_bytes)
        written[start - lo : start - lo + n] = True

    def _plane(self, key: tuple[int, str]) -> np.ndarray:
        buf = self._planes.get(key)
        if buf is None:
            with self._alloc:
                buf = self._planes.get(key)
                if buf is None:
                    buf = self._planes[key] = self.session.engine.planes.empty(self._shapes[key])
        return buf

    def share_rows(self, layer: int, role: str, start: int, data) -> bool:
        """Take a plane's whole needed range by reference instead of copying it -- only for
        rows that never change (a resident prefix: ``copy_prefix`` asks when its source says
        so). False (nothing done: copy them) unless ``data`` is exactly the needed range."""
        if self.state != "open":
            raise EngineError("install", f"install already {self.state}")
        spec = self.layout.layer(layer)
        view = np.frombuffer(data, dtype=np.uint8)
        lo, hi = spec.retained_range(self.cut)
        if view.size % spec.row_bytes or start != lo or view.size // spec.row_bytes != hi - lo:
            return False
        if self._written[(layer, role)].any() or self._claimed[(layer, role)].any():
            raise EngineError("install", "rows written twice")
        self._shared[(layer, role)] = view.reshape(hi - lo, spec.row_bytes)
        self._written[(layer, role)][:] = True
        return True

    def claim_rows(self, layer: int, role: str, start: int, n: int) -> memoryview:
        """A writable view of rows ``[start, start + n)`` of one plane, for a verifier to
        read a payload straight into (no staging copy). The rows count as written only
        once :meth:`rows_landed` says their bytes verified; claimed rows are refused to
        every other claim and write, so two segments never share a row."""
        if self.state != "open":
            raise EngineError("install", f"install already {self.state}")
        spec = self.layout.layer(layer)
        lo, hi = spec.retained_range(self.cut)
        if n <= 0 or start < lo or start + n > hi:
            raise EngineError("layout", f"rows [{start}, {start + n}) outside the needed [{lo}, {hi})")
        a, b = start - lo, start - lo + n
        claimed, written = self._claimed[(layer, role)], self._written[(layer, role)]
        if claimed[a:b].any() or written[a:b].any():
            raise EngineError("install", "rows written twice")
        claimed[a:b] = True
        return self._plane((layer, role))[a:b].data.cast("B")

    def rows_landed(self, layer: int, role: str, start: int, n: int) -> None:
        """The bytes of claimed rows verified: they now count as written."""
        if self.state != "open":
            raise EngineError("install", f"install already {self.state}")
        lo, _hi = self.layout.retained_range(layer, self.cut)
        a, b = start - lo, start - lo + n
        claimed = self._claimed[(layer, role)]
        if a < 0 or b > claimed.size or not claimed[a:b].all():
            raise EngineError("install", f"rows [{start}, {start + n}) of layer {layer} {role} were not claimed")
        self._written[(layer, role)][a:b] = True
        claimed[a:b] = False

    def share_planes(self) -> bool:
        """Put every plane in one shared arena of the engine's pool (kvpack.engine.contract
        .SharedPlanes), so reader processes write verified rows straight into them. Only
        before any plane exists; False (nothing changed) when the pool cannot hold it."""
        if self.state != "open" or self._planes or self._shared or self._arena is not None:
            return False
        offsets, total = {}, 0
        for key, (rows, width) in self._shapes.items():
            offsets[key] = total
            total += -(-(rows * width) // 4096) * 4096  # each plane page-aligned
        got = self.session.engine.planes.shared(total)
        if got is None:
            return False
        root, spec = got
        for key, (rows, width) in self._shapes.items():
            self._planes[key] = root[offsets[key] : offsets[key] + rows * width].reshape(rows, width)
        self._arena, self._arena_offsets = spec, offsets
        return True

    def claim_shared_rows(self, layer: int, role: str, start: int, n: int) -> tuple[ArenaSpec, int]:
        """:meth:`claim_rows` for another process: the arena and the byte offset of row
        ``start`` in it (after :meth:`share_planes`)."""
        if self._arena is None:
            raise EngineError("install", "the planes are not shared (share_planes first)")
        self.claim_rows(layer, role, start, n)
        spec = self.layout.layer(layer)
        lo = spec.retained_range(self.cut)[0]
        return self._arena, self._arena_offsets[(layer, role)] + (start - lo) * spec.row_bytes

    def write_logits(self, data) -> None:
        view = np.frombuffer(data, dtype="<f4")
        if view.size != self.layout.vocab_size:
            raise EngineError("layout", "logits row size")
        self._logits = view.astype(np.float32)

    def missing(self):
        return [(layer, role, int((~w).sum())) for (layer, role), w in self._written.items() if (~w).any()]

    def commit(self, *, require_logits: bool = True) -> None:
        if self.state != "open":
            raise EngineError("install", f"install already {self.state}")
        if self.missing():
            raise EngineError("install", f"{len(self.missing())} states incomplete")
        if require_logits and self._logits is None:
            raise EngineError("install", "no final-logits row")
        spare = {key: rows - self._shared[key].shape[0] for key, (rows, _w) in self._shapes.items() if key in self._shared}
        planes = {key: self._plane(key) for key in self._shapes if key not in self._shared}
        self.session._adopt(planes, self.tokens, self._logits, {key: (head, spare[key]) for key, head in self._shared.items()})
        self.state = "committed"
        # the session owns the planes now: a committed install that something still holds
        # (a transfer's record) must not keep them alive once the session moves on
        self._planes = {}
        self._shared = {}

    def abort(self) -> None:
        if self.state == "open":
            # the planes are released (claimed rows may hold bytes that failed their checks:
            # nothing published them, and nothing reads them after this)
            self.state = "aborted"
            self._planes = {}
            self._shared = {}


__all__ = ["ArrayEngine", "ArraySession", "ArrayInstall", "PlanePool", "SharedArena", "array_layout", "LAYER_WINDOWED"]
