"""Restore pipelines: verified chunk objects into an engine's detached install.

The store decides *what* a cut needs (its pack chain, the chunk jobs) and where the bytes
are (a :class:`ChunkSource` over its storage environment); this module decides *how* they
reach the engine, which depends on the engine's install, not on the store:

* :class:`HostPipeline` -- workers read and fully verify each chunk, this thread installs
  the rows (any install; on CUDA through per-chunk pinned slots, ``install.stager``); with
  ``RestoreTuning.host_readers`` the workers are reader processes that write the verified
  rows into the install's shared planes (``SharedPlanes``);
* :class:`PlanePipeline` -- whole-plane staging (``install.plane_stager``): chunks of one
  (layer, role) are verified in place in one pinned buffer, the plane installed in one copy;
* :class:`DeviceVerifiedPipeline` -- the two long hashes on the device
  (``install.wave_ring``, :mod:`kvpack.engine.device_verify`).

:func:`install_chunks` is the one entry point; it picks the pipeline from the install's
capabilities and the :class:`RestoreTuning`. Every pipeline installs a chunk's rows only
after every check of INTEROP.md A.5 passed for it, and on any refusal hands back every
staging buffer it held and raises: the caller aborts the install, so nothing is installed.
This module never reads files or objects itself (only through the source) and never commits.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

from ..format import constants as C
from ..format.objects import ChunkRef, Manifest, Span, StateKey
from ..errors import StoreError
from .contract import DeviceVerification, PlaneStaging, SharedPlanes
from .lazy_torch import load_torch as _torch

Buffer = Union[bytes, memoryview]
#: Longest a restore waits for one batch of chunk reads and checks.
READ_DEADLINE_S = 300.0
_restore_ids = itertools.count(1)


def _one_pass_default() -> int:
    """64 KiB blocks where a restore has at most two threads, else one pass per hash. The
    one-pass verifier takes the GIL once per block: on the 16-core H200 host 16 threads
    verified 1.43 GB/s in blocks against 6.18 GB/s in two passes (diag_verify_threads,
    2026-12-02), while one thread gained (0.50 against 0.44) and 2 threads on the 2-core
    box gained 36-41 %."""
    from ..format.chunk import ONE_PASS_BLOCK

    return ONE_PASS_BLOCK if default_workers() <= 2 else 0


def _host_tail_default() -> int | None:
    value = os.environ.get("KVPACK_DEVICE_HOST_TAIL", "0")
    return None if value == "auto" else int(value)


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class ChunkJob:
    """One chunk object a restore needs and the rows ``[a, b)`` of it that are installed."""

    manifest: Manifest
    key: StateKey
    span: Span
    ref: ChunkRef
    a: int
    b: int


class ChunkSource(Protocol):
    """How a pipeline reads and verifies chunk objects (the store implements it)."""

    tenant: bytes
    keys: Any  # kvpack.format.keys.KeySchedule
    epoch: int
    family_digest: bytes

    def read_into(self, ref: ChunkRef, region: memoryview) -> tuple[Buffer, int]:
        """The object in ``region`` (or whole as bytes when larger); raises StoreError
        ("incomplete") when it is missing."""
        ...

    def read(self, ref: ChunkRef) -> bytes: ...

    def verify_args(self, job: ChunkJob) -> dict[str, Any]:
        """Keyword arguments of ``decode_chunk`` for this job."""
        ...

    def worker_reader(self) -> tuple[str, str, tuple] | None:
        """A picklable recipe ``(module, factory, args)`` whose result's ``read_into`` reads
        exactly like :meth:`read_into` in another process (reader processes), or None."""
        ...


@dataclass
class RestoreTuning:
    """Knobs of the pipelines (the store exposes them as attributes for compatibility)."""

    workers: int = field(default_factory=default_workers)
    #: whole-plane staging: "auto" on CUDA installs, "always" (tests), "never"
    plane_staging: str = "auto"
    #: where the long hashes run: "auto" (GPU when the kernel compiles), "host", "device"
    #: (forced; on a CPU install the same pipeline hashes with hashlib, as CI tests it)
    verify_on: str = field(default_factory=lambda: os.environ.get("KVPACK_VERIFY_ON", "auto"))
    #: device verify: waves in the ring (reads run ahead into free ones while older ones
    #: hash; spread over at most 8 streams), the staging they share (pinned host memory and
    #: as much device memory), and at most how many objects one wave holds (None: up to
    #: ``MAX_WAVE_CHUNKS``, packed by size; a number: that many of the largest objects each).
    #: 8 waves, not 16: on the H200 at most 4 waves hash at once whatever the stream count
    #: (a wave's digest copy waits for its kernel and holds the hardware queue it shares),
    #: so fewer, larger waves finish sooner (docs/bench/h200_20261202_wave_timeline.md)
    device_waves: int = 8
    device_staging_bytes: int = field(default_factory=lambda: int(os.environ.get("KVPACK_DEVICE_STAGING_BYTES", str(4 << 30))))
    wave_chunks: int | None = None
    #: device verify: read and check chunks in reader processes (kvpack.engine.chunk_readers):
    #: "auto" (GPU restores from plain POSIX stores), "always" (tests), "never" (threads)
    read_processes: str = field(default_factory=lambda: os.environ.get("KVPACK_READ_PROCESSES", "auto"))
    #: device verify: how the reads of a wave reach the reader processes: "table" (one
    #: message per worker per wave, a compact table of a contiguous slice, so every worker
    #: reads wave k before wave k + 1) or "items" (batches of per-chunk tuples to the least
    #: busy worker, the earlier protocol; kept to compare)
    read_submit: str = field(default_factory=lambda: os.environ.get("KVPACK_READ_SUBMIT", "table"))
    #: device verify: how many of the last chunks the host verifies while the device hashes
    #: the rest, in waves of their own after the device's (None or "auto" in
    #: KVPACK_DEVICE_HOST_TAIL: sized so the host work ends when the last kernel does,
    #: ``device_verify.host_tail_chunks``; 0: off)
    device_host_tail: int | None = field(default_factory=lambda: _host_tail_default())
    #: device verify: factor on the calibrated host tail (KVPACK_HOST_TAIL_SCALE), to try
    #: larger or smaller tails on a device without code changes
    device_host_tail_scale: float = field(default_factory=lambda: float(os.environ.get("KVPACK_HOST_TAIL_SCALE", "1.0")))
    #: host verification: bytes each of the two hashes reads in turn (one pass over the
    #: object, format.chunk.decode_chunk_one_pass); 0: one pass per hash. Smaller blocks stay
    #: in cache, larger ones take the GIL less often (many threads)
    one_pass_block: int = field(default_factory=lambda: int(os.environ.get("KVPACK_ONE_PASS_BLOCK", str(_one_pass_default()))))
    #: host verification: the workers install each verified chunk's rows themselves when the
    #: install takes disjoint rows from several threads (``concurrent_row_writes``); False:
    #: the restoring thread installs every chunk (the A/B of benchmarks/diag_restore_install.py).
    #: With one or two workers the restoring thread installs either way
    worker_installs: bool = True
    #: host verification: read and verify chunks in reader processes that write the verified
    #: rows straight into the install's shared planes (kvpack.engine.chunk_readers; installs
    #: with ``SharedPlanes``, plain POSIX stores): 0 (threads, the default: on the H200 host
    #: processes restored 0.93 of the threads' rate warm and 1.03 cold), "auto" (``workers``
    #: processes where there are at least :data:`HOST_READERS_MIN_CPUS` cores), N (N
    #: processes, forced: tests, benchmarks). KVPACK_HOST_READERS sets the default
    host_readers: int | str = field(default_factory=lambda: _host_readers_default())


#: Cores from which ``host_readers = "auto"`` restores in processes: with one interpreter the
#: reading threads' GIL hand-offs paced the warm restore on the 16-core H200 host (2,577
#: voluntary switches per GiB against 1,116 for read + both hashes on the same threads); on
#: the 2-core box two threads keep up with the hashes (docs/store.md, "How the host restore
#: reads").
HOST_READERS_MIN_CPUS = 8
#: "auto" never waits for workers to start (two took 0.95 s on the 2-core box, importing
#: kvpack and NumPy: more than threads need for a GiB): a restore of at least this many
#: object bytes starts them in the background and keeps its threads; later restores of the
#: process find them running. A one-shot command never pays the start.
HOST_READERS_START_BYTES = 64 << 20


def _host_readers_default() -> int | str:
    value = os.environ.get("KVPACK_HOST_READERS", "0")
    return value if value == "auto" else int(value)


@dataclass
class PipelineResult:
    verified: int
    nbytes: int
    hashed_on: dict[str, int]
    phases: dict[str, float] = field(default_factory=dict)
    pipeline: str = "host"


#: Most objects one wave holds when the tuning does not fix it (its job table and heads are
#: pinned too: 2 rows of 32 bytes and a 512-byte head per object).
MAX_WAVE_CHUNKS = 1024


def wave_geometry(tuning: RestoreTuning) -> dict[str, int]:
    """``wave_bytes`` and ``wave_chunks`` of the ring the tuning asks for: the staging split
    over the waves, or (``wave_chunks`` set) room for that many of the largest objects."""
    from .cuda import SLOT_BYTES

    if tuning.wave_chunks:
        return {"wave_bytes": tuning.wave_chunks * SLOT_BYTES, "wave_chunks": tuning.wave_chunks}
    wave_bytes = max(SLOT_BYTES, tuning.device_staging_bytes // max(1, tuning.device_waves) // C.ALIGNMENT * C.ALIGNMENT)
    return {"wave_bytes": wave_bytes, "wave_chunks": min(MAX_WAVE_CHUNKS, max(1, wave_bytes // (64 * 1024)))}


def install_chunks(jobs: list[ChunkJob], source: ChunkSource, install: Any, layout: Any, tuning: RestoreTuning) -> PipelineResult:
    """Verify every job's chunk and write its rows into ``install`` (not committed).

    The pipeline follows the install's typed capabilities (kvpack.engine.contract):
    DeviceVerification, then PlaneStaging, else plain host verification."""
    if tuning.verify_on != "host" and isinstance(install, DeviceVerification) and jobs:
        ring = install.wave_ring(**wave_geometry(tuning), waves=tuning.device_waves, force=tuning.verify_on == "device")
        if ring is not None:
            return DeviceVerifiedPipeline(source, install, layout, tuning, ring).run(jobs)
    if isinstance(install, PlaneStaging) and tuning.plane_staging != "never":
        planes = install.plane_stager(force=tuning.plane_staging == "always")
        if planes is not None:
            return PlanePipeline(source, install, layout, tuning, planes).run(jobs)
    return HostPipeline(source, install, layout, tuning).run(jobs)


@dataclass(frozen=True)
class CheckContext:
    """What :func:`check_chunk` needs besides the chunk: the restore's tenant, keys and
    family digest, the HMAC inner block of the content ids; for reader processes also the
    families of the chain and the store's reader recipe (picklable)."""

    tenant: bytes
    keys: Any
    epoch: int
    family_digest: bytes
    inner_pad: bytes
    families: tuple = ()
    reader: tuple | None = None

    def verify_args(self, ref: ChunkRef, span: Span, key: StateKey, family: Any) -> dict[str, Any]:
        return dict(ref=ref, span=span, tenant=self.tenant, family=family, key=key, keys=self.keys, family_digest=self.family_digest)


def place_plaintext(region: memoryview, plaintext: Buffer) -> None:
    """Put a plaintext verified on the host where a raw frame's plaintext sits in its slot
    (``region``): a raw chunk checked in place is already there, no copy."""
    import numpy as np

    from .device_verify import PLAINTEXT_OFFSET

    arr = np.frombuffer(plaintext, dtype=np.uint8)
    dst = np.frombuffer(region, dtype=np.uint8)
    if arr.size and arr.ctypes.data == dst.ctypes.data + PLAINTEXT_OFFSET:
        return
    if PLAINTEXT_OFFSET + arr.size > dst.size:
        raise ValueError("plaintext larger than its slot")
    dst[PLAINTEXT_OFFSET : PLAINTEXT_OFFSET + arr.size] = arr


def check_chunk(
    read_into: Any, ref: ChunkRef, span: Span, key: StateKey, verify_args: dict, region: memoryview, on_host: bool, ctx: CheckContext
) -> tuple[Any, bytes, int]:
    """Read one chunk object into its slot ``region`` and run every A.5 check the host runs
    for the GPU verify path: ``(DeferredChunk, job head, object bytes)`` for a raw
    unencrypted chunk whose two long hashes the device will compute (the checks before the
    object digest raise here exactly as ``decode_chunk``'s), or ``(None, b"", n)`` for one
    verified completely here (encrypted, lossless, odd, or ``on_host``: the restore's host
    tail) whose plaintext now sits where a raw frame's would. Raises on refusal. Run by the
    reading threads and by the reader processes alike."""
    from ..format.chunk import decode_chunk_deferred, decode_chunk_one_pass
    from ..format.identity import chunk_content_prefix
    from .gpu_digest import HEAD_BYTES

    obj, n = read_into(ref, region)
    if not on_host and n == ref.object_bytes and isinstance(obj, memoryview) and ref.key_epoch == ctx.epoch:
        head = ctx.inner_pad + chunk_content_prefix(
            ctx.tenant, ctx.family_digest, key.layer, key.name, span.token_start, span.token_count, span.plaintext_offset, span.plaintext_bytes
        )
        if len(head) <= HEAD_BYTES:
            try:
                deferred = decode_chunk_deferred(obj, **verify_args)
            except ValueError:
                deferred = None  # not raw and unencrypted: decoded below
            if deferred is not None:
                return deferred, head, n
    place_plaintext(region, decode_chunk_one_pass(obj, **verify_args))
    return None, b"", n


def _decode(source: ChunkSource, job: ChunkJob, obj: Buffer, tuning: RestoreTuning) -> Buffer:
    """Every A.5 check of ``decode_chunk``, the two long hashes in one pass (raw chunks)."""
    from ..format.chunk import decode_chunk_one_pass

    return decode_chunk_one_pass(obj, **source.verify_args(job), block=tuning.one_pass_block)


class ReadBuffers:
    """Reusable read buffers of a host restore, one per chunk in flight: each object is read
    into one (``readinto``) and verified there, and its plaintext view is installed from it,
    so a restore allocates (and page-faults) a window of buffers, not one per chunk. Never
    blocks: a restore that holds them all gets a fresh one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self) -> bytearray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return bytearray(self.size)

    def give(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)


def _row_bytes(layout: Any, job: ChunkJob) -> tuple[int, int]:
    """The byte range of the job's installed rows ``[a, b)`` within its chunk's plaintext."""
    row = layout.layer(job.key.layer).row_bytes
    return (job.a - job.span.token_start) * row, (job.b - job.span.token_start) * row


class HostPipeline:
    """Workers read and verify; the rows are installed in job order (bounded window) by this
    thread, or -- when the install takes disjoint rows from several threads at once
    (``concurrent_row_writes``) and more than two workers run -- by the worker that verified
    the chunk, right after its checks passed, so the install copy scales with the workers instead of running on one
    thread (on the 16-core H200 host the warm restore ran at 0.32 of "read + both hashes"
    with the copy here). Refusals are still raised in job order here (the first refused job
    in job order is the refusal), and this returns only after every worker stopped, so
    nothing writes into an install the caller aborts. With reader processes
    (:meth:`reader_processes`) the same holds for :meth:`run_processes`."""

    #: most chunks one reader-process batch holds (``run_processes``)
    HOST_BATCH = 8

    def __init__(self, source: ChunkSource, install: Any, layout: Any, tuning: RestoreTuning) -> None:
        self.source, self.install, self.layout, self.tuning = source, install, layout, tuning
        self.verified = self.nbytes = 0
        # On a CUDA install chunk objects are read into pinned slots, verified there and
        # uploaded by the workers; this thread only queues the device-side copies.
        self.stager = install.stager(2 * tuning.workers + 2) if isinstance(install, PlaneStaging) else None
        self.buffers: ReadBuffers | None = None
        # Up to two workers the restoring thread's copies keep up with them (a 4 MiB copy
        # takes 0.3-0.6 ms on the 2-core box, a worker's verification of it ~5 ms) and run
        # beside them as one more thread (128 MiB warm restores there: 0.41 vs 0.29 GB/s at
        # one worker, 0.37 vs 0.33 and 0.55 vs 0.49 at two); with many workers that one
        # thread -- the copies and its GIL turns -- paced the restore (2.27 GB/s at 16 on the
        # H200 host against 7.04 for read + both hashes)
        self.install_in_workers = (
            tuning.worker_installs and tuning.workers > 2 and self.stager is None and getattr(install, "concurrent_row_writes", False) is True
        )

    def verify_one(self, job: ChunkJob) -> Any:
        """``(plaintext view, read buffer)``; None when this worker installed the rows
        itself; with a stager the slot holding the plaintext (upload started)."""
        if self.stager is None:
            assert self.buffers is not None
            buf = self.buffers.take()
            try:
                obj, _n = self.source.read_into(job.ref, memoryview(buf)[: job.ref.object_bytes])
                plaintext = _decode(self.source, job, obj, self.tuning)
                if not self.install_in_workers:
                    return plaintext, buf
                lo_byte, hi_byte = _row_bytes(self.layout, job)
                self.install.write_rows(job.key.layer, job.key.name, job.a, memoryview(plaintext)[lo_byte:hi_byte])
                del plaintext, obj  # views of buf: it is reused only once nothing refers to it
            except BaseException:
                self.buffers.give(buf)
                raise
            self.buffers.give(buf)
            return None
        slot = self.stager.acquire()
        try:
            obj, _n = self.source.read_into(job.ref, slot.host_region())
            slot.upload(_decode(self.source, job, obj, self.tuning))
            return slot
        except BaseException:
            slot.release()
            raise

    def drain(self, fut: Future, job: ChunkJob) -> None:
        result = fut.result()
        if result is not None:  # else its worker installed the rows
            self.install_rows(job, result)
        self.verified += 1
        self.nbytes += job.ref.object_bytes

    def install_rows(self, job: ChunkJob, result: Any) -> None:
        lo_byte, hi_byte = _row_bytes(self.layout, job)
        if self.stager is None:
            plaintext, buf = result
            try:
                self.install.write_rows(job.key.layer, job.key.name, job.a, memoryview(plaintext)[lo_byte:hi_byte])
            finally:
                del plaintext  # a view of buf: buf is reused only once nothing refers to it here
                self.release(result)
        else:
            try:
                self.install.write_rows(job.key.layer, job.key.name, job.a, result.rows(lo_byte, hi_byte - lo_byte))
            finally:
                result.release()

    def release(self, result: Any) -> None:
        """Hand back what a finished ``verify_one`` holds."""
        if result is None:
            return
        if self.stager is not None:
            result.release()
        elif self.buffers is not None:
            self.buffers.give(result[1])

    def threads(self) -> int:
        """Worker threads: ``tuning.workers``, but one core is left to the restoring thread
        (and the interpreter's hand-offs) when the workers install and would otherwise take
        every core: on the 16-core H200 host 15 installing workers restored 5.53 GB/s
        against 4.94 for 16 (benchmarks/diag_restore_install.py, same call, same files)."""
        cpus = os.cpu_count() or 1
        if self.install_in_workers and cpus > 2 and self.tuning.workers >= cpus:
            return cpus - 1
        return self.tuning.workers

    def reader_processes(self, jobs: list[ChunkJob]) -> int:
        """How many reader processes this restore uses (``tuning.host_readers``); 0: the
        threads. Only installs whose planes can be shared (``SharedPlanes``; not a CUDA
        install's staging) and stores whose reads a process can repeat (``worker_reader``:
        plain POSIX; S3 and a fault-injecting file layer keep the threads). "auto": on at
        least :data:`HOST_READERS_MIN_CPUS` cores, once the workers run (see
        :data:`HOST_READERS_START_BYTES`)."""
        from . import chunk_readers

        mode = self.tuning.host_readers
        if mode in (0, "0") or self.stager is not None or not isinstance(self.install, SharedPlanes):
            return 0
        if getattr(self.source, "worker_reader", lambda: None)() is None:
            return 0
        if mode != "auto":
            return max(0, int(mode))
        if (os.cpu_count() or 1) < HOST_READERS_MIN_CPUS:
            return 0
        if chunk_readers.running_host_readers() is not None:
            return self.tuning.workers
        if sum(job.ref.object_bytes for job in jobs) >= HOST_READERS_START_BYTES:
            chunk_readers.start_host_readers(self.tuning.workers)
        return 0

    def run_processes(self, jobs: list[ChunkJob], processes: int) -> PipelineResult:
        """Every job read, verified completely and installed by a reader process
        (``chunk_readers.host_readers``): its rows are claimed here (``claim_shared_rows``)
        and the worker copies the verified plaintext's rows into the shared plane after the
        last check passed; this thread marks them landed in job order. The first refusal in
        job order raises; before raising, every batch sent has ended (or its worker was
        killed), so nothing writes into the install the caller aborts."""
        from ..format.chunk import ONE_PASS_BLOCK
        from .chunk_readers import host_readers

        t0 = time.perf_counter()
        pool = host_readers(processes)
        families: list[Any] = []
        family_index: dict[int, int] = {}
        arenas: dict[int, tuple] = {}
        items = []
        for job in jobs:
            if id(job.manifest) not in family_index:
                family_index[id(job.manifest)] = len(families)
                families.append(job.manifest.family)
            arena, offset = self.install.claim_shared_rows(job.key.layer, job.key.name, job.a, job.b - job.a)
            arenas[arena[0]] = arena
            lo_byte, hi_byte = _row_bytes(self.layout, job)
            r, sp = job.ref, job.span
            # plain values, not the dataclasses (pickled per batch)
            items.append(
                (r.content_id, r.object_key, r.object_digest, r.key_epoch, r.plaintext_bytes, r.object_bytes)
                + (sp.token_start, sp.token_count, sp.plaintext_offset, sp.plaintext_bytes, job.key.layer, job.key.name)
                + (family_index[id(job.manifest)], arena[0], offset, lo_byte, hi_byte)
            )
        src = self.source
        ctx = CheckContext(src.tenant, src.keys, src.epoch, src.family_digest, b"", tuple(families), src.worker_reader())
        cid, specs = next(_restore_ids), tuple(arenas.values())
        # about four batches per worker, dealt round robin: batch i to worker i mod N, so a
        # restore into a recycled arena has each worker write the pages it wrote last time
        # (a page a process first writes through its own mapping is a page fault: 256 MiB
        # written through a fresh mapping took 0.22 s against 0.04 s on the 2-core box),
        # and batches finish about in job order, the order they are raised in. A worker
        # verifies in one process, one thread: both hashes from one pass over each 64 KiB
        # block (ONE_PASS_BLOCK, cache-resident) -- no GIL to hand over
        batch = max(1, min(self.HOST_BATCH, -(-len(jobs) // (4 * processes))))
        ranges = [(lo, min(lo + batch, len(jobs))) for lo in range(0, len(jobs), batch)]
        t_plan = time.perf_counter()
        futs: list[Future] = []
        try:
            for i, (lo, hi) in enumerate(ranges):
                futs.append(pool.submit_host(i, cid, ctx, specs, ONE_PASS_BLOCK, items[lo:hi]))
            for (lo, hi), fut in zip(ranges, futs):
                try:
                    fut.result(timeout=READ_DEADLINE_S)  # the batch's first refusal raises
                except FutureTimeout:
                    pool.kill()  # a late write into an aborted (recycled) install is impossible then
                    raise StoreError("io", f"chunk reads did not finish within {READ_DEADLINE_S:.0f} s") from None
                for job in jobs[lo:hi]:
                    self.install.rows_landed(job.key.layer, job.key.name, job.a, job.b - job.a)
                    self.verified += 1
                    self.nbytes += job.ref.object_bytes
        except BaseException:
            # a worker may still be writing into the install: let it end (the workers skip
            # the batches after a refused one)
            pool.refused(cid, -1)  # every batch before the one raised here has passed
            for fut in futs:
                if not fut.done():
                    try:
                        fut.exception(timeout=READ_DEADLINE_S)
                    except FutureTimeout:
                        pool.kill()
                    except Exception:  # noqa: BLE001 - only waiting for it to end
                        pass
            raise
        finally:
            pool.finished(cid)
        phases = {"host_plan_s": round(t_plan - t0, 4), "host_read_processes": processes}
        return PipelineResult(self.verified, self.nbytes, {"host": self.verified}, phases, pipeline="host_processes")

    def run(self, jobs: list[ChunkJob]) -> PipelineResult:
        processes = self.reader_processes(jobs) if jobs else 0
        if processes and self.install.share_planes():
            return self.run_processes(jobs, processes)
        # The window bounds what finished results hold (a read buffer or a staging slot each)
        # until this thread installs them; a chunk its worker installed holds nothing, so
        # then every job is queued at once and the workers never wait for this thread (only
        # the jobs running hold buffers; after a refusal the queued ones are cancelled)
        window = len(jobs) if self.install_in_workers else 2 * self.tuning.workers
        if jobs and self.stager is None:
            self.buffers = ReadBuffers(max(job.ref.object_bytes for job in jobs))
        pending: deque[tuple[Future, ChunkJob]] = deque()
        with ThreadPoolExecutor(self.threads()) as pool:
            try:
                for job in jobs:
                    pending.append((pool.submit(self.verify_one, job), job))
                    if len(pending) >= window:
                        self.drain(*pending.popleft())
                while pending:
                    self.drain(*pending.popleft())
            finally:
                for fut, _job in pending:  # refused midway: hand back what is still held
                    if not fut.cancel() and fut.exception() is None:
                        self.release(fut.result())
        return PipelineResult(self.verified, self.nbytes, {"host": self.verified}, {"host_read_processes": 0}, pipeline="host")


class PlanePipeline:
    """Restore by whole planes (kvpack.engine.cuda.PlaneStager): workers read each chunk
    object into its slot of one pinned buffer per (layer, role), verify it in place and
    queue the copy of its rows to the device plane; each complete plane is installed with
    one transposing copy."""

    def __init__(self, source: ChunkSource, install: Any, layout: Any, tuning: RestoreTuning, stager: Any) -> None:
        self.source, self.install, self.layout, self.tuning, self.stager = source, install, layout, tuning, stager
        self.verified = self.nbytes = 0
        self.held: list[Any] = []

    def verify_into(self, job: ChunkJob, item: Any, view: Any, slot: int, dev: Any, lo: int, row: int) -> int:
        from .cuda import SLOT_BYTES

        obj, _n = self.source.read_into(job.ref, memoryview(view)[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES])
        plaintext = _decode(self.source, job, obj, self.tuning)
        self.stager.copy_rows(item, plaintext, (job.a - job.span.token_start) * row, (job.b - job.a) * row, dev, (job.a - lo) * row)
        return job.ref.object_bytes

    def finish_plane(self, entry: tuple) -> None:
        (layer, role, lo), item, dev, futs = entry
        for fut in futs:
            self.nbytes += fut.result()
            self.verified += 1
        self.install.write_rows(layer, role, lo, self.stager.finish(item, dev))
        self.held.remove(item)
        self.stager.release(item)

    def run(self, jobs: list[ChunkJob]) -> PipelineResult:
        by_plane: dict[tuple[int, str], list[ChunkJob]] = {}
        for job in jobs:
            by_plane.setdefault((job.key.layer, job.key.name), []).append(job)
        # planes complete in order: keep enough chunks queued that the pool never drains
        # while the oldest plane waits for its last chunk (bounded: the host slots are pinned)
        window = 6 * self.tuning.workers
        queued: deque[tuple] = deque()
        try:
            with ThreadPoolExecutor(self.tuning.workers) as pool:
                try:
                    for (layer, role), plane_jobs in by_plane.items():
                        lo, hi = self.install.required_range(layer)
                        row = self.layout.layer(layer).row_bytes
                        item, view = self.stager.host_slots(len(plane_jobs))
                        self.held.append(item)
                        dev = self.stager.device_plane((hi - lo) * row)
                        futs = [pool.submit(self.verify_into, job, item, view, i, dev, lo, row) for i, job in enumerate(plane_jobs)]
                        queued.append(((layer, role, lo), item, dev, futs))
                        while queued and sum(len(q[3]) for q in queued) > window:
                            self.finish_plane(queued.popleft())
                    while queued:
                        self.finish_plane(queued.popleft())
                except BaseException:
                    for entry in queued:  # refused midway: drop what has not started
                        for fut in entry[3]:
                            fut.cancel()
                    raise
        finally:
            # the pool has shut down: no worker writes into these buffers any more
            if self.held and self.stager.cuda:
                self.stager.copy_stream.synchronize()  # nor does a queued copy read them
            for item in self.held:
                self.stager.release(item)
        return PipelineResult(self.verified, self.nbytes, {"host": len(jobs)}, pipeline="planes")


class _Timeline:
    """Per-wave timestamps of one device-verified restore (host clock, and CUDA timing
    events for the upload and hash), appended as one JSON line to the file named by
    ``KVPACK_RESTORE_TIMELINE``: a profiling aid for benchmarks, off by default."""

    def __init__(self, path: str, ring: Any) -> None:
        self.path, self.ring = path, ring
        self.t0 = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.events: dict[int, tuple] = {}  # row number -> CUDA timing events
        self.current: dict[int, int] = {}  # id(wave) -> its row in this restore (waves are reused)
        self.ref: Any = None
        if ring.cuda:
            torch = _torch()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()

    @classmethod
    def open(cls, ring: Any) -> "_Timeline | None":
        path = os.environ.get("KVPACK_RESTORE_TIMELINE")
        return cls(path, ring) if path else None

    def _now(self) -> float:
        return round(time.perf_counter() - self.t0, 5)

    def submitted(self, wave: Any, futs: list, t_submit: float, count: int) -> None:
        key = self.current[id(wave)] = len(self.rows)
        row = {"wave": key, "chunks": count, "submit": round(t_submit - self.t0, 5), "submitted": self._now()}
        self.rows.append(row)
        pending = [len(futs)]
        lock = threading.Lock()

        def done(_f: Future) -> None:
            with lock:
                pending[0] -= 1
                if pending[0] == 0:
                    row["reads_done"] = self._now()

        for f in futs:
            f.add_done_callback(done)

    def mark(self, wave: Any, name: str) -> None:
        if id(wave) in self.current:
            self.rows[self.current[id(wave)]][name] = self._now()

    def launching(self, wave: Any) -> None:
        self.mark(wave, "launch")
        if self.ring.cuda:
            torch = _torch()
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record(wave.stream)
            self.events[self.current[id(wave)]] = ev

    def launched(self, wave: Any) -> None:
        self.mark(wave, "launched")
        key = self.current.get(id(wave))
        if key in self.events:
            self.events[key][1].record(wave.stream)

    def write(self) -> None:
        import json

        if self.ref is not None:
            _torch().cuda.synchronize()
            for key, (start, queued) in self.events.items():
                row = self.rows[key]
                row["gpu_upload_start"] = round(self.ref.elapsed_time(start) / 1e3, 5)
                row["gpu_queued_done"] = round(self.ref.elapsed_time(queued) / 1e3, 5)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(self.rows, sort_keys=True) + "\n")


class DeviceVerifiedPipeline:
    """Restore with the two long hashes on the device (kvpack.engine.device_verify).

    The jobs are cut into waves (consecutive jobs, packed by size into one ring entry; a
    small restore still gets at least ``MIN_WAVES`` so its reads overlap its hashing).
    Workers read batches of a wave's objects into their slots and run every other check of
    A.5 there (``decode_chunk_deferred``), writing each object's two job rows; a wave whose
    reads are all done is uploaded whole and hashed on the device (:meth:`pump`); each
    chunk is installed from the hashed device copy only after ``DeferredChunk.finish``
    accepted its digests, one transposing copy per run of a plane's evenly spaced chunks."""

    #: waves a restore is spread over at least (each hashes while later ones are read)
    MIN_WAVES = 8
    #: most objects one worker task reads and checks: a wave is split into about one task
    #: per worker (each message costs the installing thread a pickle and a pipe write)
    BATCH = 32

    def __init__(self, source: ChunkSource, install: Any, layout: Any, tuning: RestoreTuning, ring: Any) -> None:
        from ..format.identity import hmac_sha256_pads

        self.source, self.install, self.layout, self.tuning, self.ring = source, install, layout, tuning, ring
        self.waves = tuning.device_waves
        self.inner_pad, self.outer_pad = hmac_sha256_pads(source.keys.chunk_identity)
        #: SHA-256 state after the HMAC outer block: each content id's finish copies it
        self.outer_hash = hashlib.sha256(self.outer_pad)
        self.ctx = CheckContext(source.tenant, source.keys, source.epoch, source.family_digest, self.inner_pad)
        self.readers: Any = None
        self.ctx_id = next(_restore_ids)
        self.family_index: dict[int, int] = {}
        self.verified = self.nbytes = 0
        self.hashed_on = {"device": 0, "host": 0}
        # where this thread's time goes (reported in RestoreReport.phases as device_*_s)
        self.spent = {
            "device_plan_s": 0.0,
            "device_submit_s": 0.0,
            "device_wait_reads_s": 0.0,
            "device_launch_s": 0.0,
            "device_wait_hash_s": 0.0,
            "device_check_s": 0.0,
            "device_install_s": 0.0,
        }
        #: per-wave timestamps when KVPACK_RESTORE_TIMELINE names a file (a diagnostic)
        self.timeline: Any = _Timeline.open(ring)
        self.reading: deque[tuple] = deque()  # (wave, jobs, futures): reads queued, in order
        self.launched: deque[tuple] = deque()  # hashes queued, in order
        self.held: list[Any] = []
        self.state_names: dict[str, int] = {}  # state name -> its index in wave slices
        self.planned: list[tuple] = []  # (wave, jobs, first job index): taken, reads not yet sent
        self.pool: Any = None  # the reading threads (when there are no reader processes)
        self.first_host = 0  # the first job of the host tail
        self.worker_turn = 0  # the worker that gets the first slice of the next wave

    def read_one(self, job: ChunkJob, wave: Any, i: int, on_host: bool) -> Any:
        """The DeferredChunk of slot ``i`` (its job rows written), or None when it was
        verified completely here; raises on refusal (:func:`check_chunk`)."""
        deferred, head, n = check_chunk(self.source.read_into, job.ref, job.span, job.key, self.source.verify_args(job), wave.slot_view(i), on_host, self.ctx)
        if deferred is None:
            wave.set_jobs(i, 0, 0, b"")
        else:
            wave.set_jobs(i, n, job.span.plaintext_bytes, head)
        return deferred

    def read_batch(self, wave: Any, jobs: list[ChunkJob], first: int, stop: int, first_host: int, offset: int) -> list[Any]:
        return [self.read_one(jobs[i], wave, i, offset + i >= first_host) for i in range(first, stop)]

    def submit_reads(self, pool: Any, wave: Any, group: list[ChunkJob], start: int, first_host: int) -> list[Future]:
        """Futures of the wave's reads and host checks, in batches of per-chunk items: on
        the reader processes when there are any (least busy first), else on the threads."""
        batch = max(1, min(self.BATCH, -(-len(group) // self.tuning.workers)))
        if self.readers is None:
            return [pool.submit(self.read_batch, wave, group, lo, min(lo + batch, len(group)), first_host, start) for lo in range(0, len(group), batch)]
        geometry = wave.geometry()
        futs = []
        for lo in range(0, len(group), batch):
            items = []
            for i in range(lo, min(lo + batch, len(group))):
                job = group[i]
                r, sp = job.ref, job.span
                # plain values, not the dataclasses: pickling them is most of this loop's cost
                items.append(
                    (i, wave.starts[i], wave.sizes[i])
                    + (r.content_id, r.object_key, r.object_digest, r.key_epoch, r.plaintext_bytes, r.object_bytes)
                    + (sp.token_start, sp.token_count, sp.plaintext_offset, sp.plaintext_bytes, job.key.layer, job.key.name)
                    + (self.family_index[id(job.manifest)], start + i >= first_host)
                )
            futs.append(self.readers.submit(self.ctx_id, self.ctx, geometry, items))
        return futs

    def wave_slices(self, wave: Any, group: list[ChunkJob], start: int, first_host: int, workers: int) -> list[Any]:
        """The wave cut into ``workers`` contiguous slices (chunk_readers.WaveSlice): one
        pass over its jobs in Python, the rest plain bytes."""
        from array import array

        from .chunk_readers import SLICE_COLUMNS, SLICE_ID_BYTES, WaveSlice

        n = len(group)
        names, families = self.state_names, self.family_index
        flat, ids = array("q"), bytearray()
        for job in group:
            r, sp, key = job.ref, job.span, job.key
            name = names.setdefault(key.name, len(names))
            flat.extend(
                (
                    r.key_epoch,
                    r.plaintext_bytes,
                    r.object_bytes,
                    sp.token_start,
                    sp.token_count,
                    sp.plaintext_offset,
                    sp.plaintext_bytes,
                    key.layer,
                    name,
                    families[id(job.manifest)],
                )
            )
            ids += r.content_id + r.object_key + r.object_digest
        rows, offsets = memoryview(flat).cast("B"), memoryview(wave.offsets).cast("B")
        row_bytes = 8 * len(SLICE_COLUMNS)
        name_list = tuple(names)
        per = -(-n // max(1, workers))
        host_from = first_host - start  # relative to the wave
        return [
            WaveSlice(
                lo,
                bytes(offsets[8 * lo : 8 * (min(lo + per, n) + 1)]),
                bytes(rows[row_bytes * lo : row_bytes * (lo + per)]),
                bytes(ids[SLICE_ID_BYTES * lo : SLICE_ID_BYTES * (lo + per)]),
                name_list,
                host_from - lo,
            )
            for lo in range(0, n, per)
        ]

    def submit_planned(self) -> None:
        """Start the reads of the ``planned`` waves ((wave, jobs, first job index) each, in
        order) and queue them for launch. With reader processes and ``read_submit =
        "table"``, every worker gets one message with its slice of each of these waves (a
        worker serves them in order and answers each slice as it is done); otherwise each
        wave is submitted on its own (:meth:`submit_reads`)."""
        planned, pool, first_host = self.planned, self.pool, self.first_host
        if not planned:
            return
        t_submit = time.perf_counter()
        if self.readers is None or self.tuning.read_submit != "table":
            entries = [(wave, group, self.submit_reads(pool, wave, group, start, first_host)) for wave, group, start in planned]
        else:
            workers = max(1, self.readers.live())
            per_worker: dict[int, list[tuple]] = {}
            owners = []  # per wave: (worker, position in its message) of each slice
            for wave, group, start in planned:
                geometry, mine = wave.geometry(), []
                for w, part in enumerate(self.wave_slices(wave, group, start, first_host, workers)):
                    parts = per_worker.setdefault((self.worker_turn + w) % workers, [])
                    mine.append(((self.worker_turn + w) % workers, len(parts)))
                    parts.append((geometry, part))
                self.worker_turn += len(mine)  # small waves: the next one starts on the next worker
                owners.append(mine)
            futs = {w: self.readers.submit_slices(w, self.ctx_id, self.ctx, parts) for w, parts in per_worker.items()}
            entries = [(wave, group, [futs[w][k] for w, k in mine]) for (wave, group, _start), mine in zip(planned, owners)]
        self.reading.extend(entries)
        self.spent["device_submit_s"] += time.perf_counter() - t_submit
        if self.timeline is not None:
            for wave, group, wave_futs in entries:
                self.timeline.submitted(wave, wave_futs, t_submit, len(group))
        planned.clear()

    def launch_wave(self, entry: tuple) -> None:
        wave, _jobs, futs = entry
        t0 = time.perf_counter()
        for f in futs:
            try:
                f.result(timeout=READ_DEADLINE_S)  # raises the first refusal
            except FutureTimeout:
                raise StoreError("io", f"chunk reads did not finish within {READ_DEADLINE_S:.0f} s") from None
        t1 = time.perf_counter()
        self.spent["device_wait_reads_s"] += t1 - t0
        if self.timeline is not None:
            self.timeline.launching(wave)
        # a wave verified wholly on the host (host tail, encrypted chunks) queues no kernel
        wave.launch(hash_jobs=any(r is not None for f in futs for r in f.result()))
        if self.timeline is not None:
            self.timeline.launched(wave)
        self.launched.append(entry)
        self.spent["device_launch_s"] += time.perf_counter() - t1

    def check_wave(self, wave: Any, jobs: list[ChunkJob], results: list) -> None:
        """Finish the deferred checks of a hashed wave with the device's digests (a reader
        process sent (content id, held refusal) for a DeferredChunk)."""
        from ..format.chunk import DeferredChunk, ExternalDigests
        from ..format.identity import hmac_sha256_finish
        from .device_verify import PLAINTEXT_OFFSET

        t0 = time.perf_counter()
        digests = wave.digests()
        outer = self.outer_hash
        on_device = 0
        for i, deferred in enumerate(results):
            if deferred is None:
                self.hashed_on["host"] += 1
                continue
            on_device += 1
            at = 64 * i
            if type(deferred) is tuple:
                content_id, held = deferred
                # the common case, a chunk whose every check passes, without building the
                # DeferredChunk: the same comparisons (object digest, nothing held, content id)
                if held is None and digests[at : at + 32] == jobs[i].ref.object_digest:
                    finished = outer.copy()
                    finished.update(digests[at + 32 : at + 64])
                    if finished.digest() == content_id:
                        continue
                # a refusal: DeferredChunk.finish raises the one decode_chunk would, in its order
                plaintext = wave.slot_view(i)[PLAINTEXT_OFFSET : PLAINTEXT_OFFSET + jobs[i].span.plaintext_bytes]
                deferred = DeferredChunk(jobs[i].ref.object_digest, content_id, plaintext, held)
            deferred.finish(ExternalDigests(digests[at : at + 32], hmac_sha256_finish(self.outer_pad, digests[at + 32 : at + 64])))
        self.hashed_on["device"] += on_device
        self.spent["device_check_s"] += time.perf_counter() - t0

    def install_wave(self, entry: tuple) -> None:
        wave, wave_jobs, futs = entry
        self.check_wave(wave, wave_jobs, [r for f in futs for r in f.result(timeout=READ_DEADLINE_S)])
        t1 = time.perf_counter()
        wave.order_installs()
        i = 0
        while i < len(wave_jobs):  # one copy per run of a plane's evenly spaced chunks
            job = wave_jobs[i]
            row = self.layout.layer(job.key.layer).row_bytes
            lo_byte, size = (job.a - job.span.token_start) * row, (job.b - job.a) * row
            j, end = i + 1, job.b
            while j < len(wave_jobs):
                nxt = wave_jobs[j]
                same_plane = (nxt.key.layer, nxt.key.name) == (job.key.layer, job.key.name)
                if not same_plane or nxt.a != end or (nxt.a - nxt.span.token_start) * row != lo_byte or (nxt.b - nxt.a) * row != size:
                    break
                if wave.sizes[j] != wave.sizes[i]:  # one strided view covers the run
                    break
                end, j = nxt.b, j + 1
            if j - i == 1:
                self.install.write_rows(job.key.layer, job.key.name, job.a, wave.rows(i, lo_byte, size))
            else:
                self.install.write_row_blocks(job.key.layer, job.key.name, job.a, wave.row_blocks(i, j - i, lo_byte, size))
            for done in wave_jobs[i:j]:
                self.verified += 1
                self.nbytes += done.ref.object_bytes
            i = j
        self.spent["device_install_s"] += time.perf_counter() - t1

    def pump(self) -> None:
        """Queue the hashes of every wave whose reads are all done (never blocks)."""
        while self.reading and all(f.done() for f in self.reading[0][2]):
            self.launch_wave(self.reading.popleft())

    def install_oldest(self) -> None:
        self.submit_planned()  # a wave waiting to be read may be the oldest
        if not self.launched:
            self.launch_wave(self.reading.popleft())  # waits for its reads
        entry = self.launched.popleft()
        t0 = time.perf_counter()
        while not entry[0].hashed_ready():  # keep later waves hashing meanwhile
            self.pump()
            time.sleep(0.0002)
        self.spent["device_wait_hash_s"] += time.perf_counter() - t0
        if self.timeline is not None:
            self.timeline.mark(entry[0], "hash_seen")
        self.install_wave(entry)
        if self.timeline is not None:
            self.timeline.mark(entry[0], "install_queued")
        self.held.remove(entry[0])
        entry[0].release()

    def can_take_wave(self) -> bool:
        """Whether :meth:`take_wave` would return at once (a hint: other restores share
        the ring)."""
        return len(self.held) < self.waves and not self.ring._free.empty()

    def take_wave(self) -> Any:
        """A free wave of the (shared) ring, installing our oldest while none is free: never
        wait holding waves another restore may need."""
        if len(self.held) >= self.waves:  # our share is in use: install our oldest first
            self.install_oldest()
        wave = self.ring.acquire(block=False)
        while wave is None and self.held:
            self.install_oldest()
            wave = self.ring.acquire(block=False)
        if wave is None:
            wave = self.ring.acquire()  # we hold none: whoever does will release them
        self.held.append(wave)
        return wave

    def reader_processes(self, jobs: list[ChunkJob]) -> Any:
        """The ring's reader processes when this restore may use them (see
        ``RestoreTuning.read_processes``), with the context they check under; else None."""
        mode = self.tuning.read_processes
        recipe = getattr(self.source, "worker_reader", lambda: None)()
        if mode == "never" or recipe is None or (mode == "auto" and not self.ring.cuda):
            return None
        families: list[Any] = []
        for job in jobs:
            if id(job.manifest) not in self.family_index:
                self.family_index[id(job.manifest)] = len(families)
                families.append(job.manifest.family)
        self.ctx = CheckContext(self.ctx.tenant, self.ctx.keys, self.ctx.epoch, self.ctx.family_digest, self.inner_pad, tuple(families), recipe)
        return self.ring.readers(self.tuning.workers)

    def plan_waves(self, sizes: list[int], split: int | None = None) -> list[tuple[int, int]]:
        """Consecutive ``[start, stop)`` job ranges, each fitting one wave (``sizes`` are
        slot bytes, none larger than a wave), at least ``MIN_WAVES`` of them when there are
        that many jobs; a new wave starts at job ``split`` (the host tail: a wave hashed on
        the device never waits for the slower reads of chunks verified on the host)."""
        target_bytes = min(self.ring.wave_bytes, max(max(sizes), -(-sum(sizes) // self.MIN_WAVES)))
        target_count = min(self.ring.wave_chunks, max(1, -(-len(sizes) // self.MIN_WAVES)))
        ranges, start, used = [], 0, 0
        for i, size in enumerate(sizes):
            if i > start and (used + size > target_bytes or i - start >= target_count or i == split):
                ranges.append((start, i))
                start, used = i, 0
            used += size
        ranges.append((start, len(sizes)))
        return ranges

    def host_tail(self, jobs: list[ChunkJob], sizes: list[int]) -> int:
        """How many of the last jobs the host verifies (``RestoreTuning.device_host_tail``;
        None: :func:`~kvpack.engine.device_verify.host_tail_chunks` from the kernel latency,
        one wave's upload and what a host-verified chunk has cost the reader processes)."""
        from .device_verify import host_tail_chunks

        tail = self.tuning.device_host_tail
        if tail is None:
            workers = self.readers.live() if self.readers is not None else self.tuning.workers
            per_byte = self.readers.host_seconds_per_byte() if self.readers is not None else None
            upload = min(self.ring.wave_bytes, -(-sum(sizes) // self.MIN_WAVES))
            tail = host_tail_chunks(
                self.ring,
                workers,
                max(job.ref.object_bytes for job in jobs),
                host_s_per_byte=per_byte,
                upload_bytes=upload,
            )
            tail = int(tail * self.tuning.device_host_tail_scale)
        return min(max(tail, 0), len(jobs))

    def run(self, jobs: list[ChunkJob]) -> PipelineResult:
        from .device_verify import slot_bytes

        t_plan = time.perf_counter()
        self.readers = self.reader_processes(jobs)
        # an object larger than a wave can hold gets a minimal slot: its read comes back
        # whole as bytes and its checks refuse it
        sizes = [slot_bytes(job.ref.object_bytes, job.span.plaintext_bytes) for job in jobs]
        sizes = [s if s <= self.ring.wave_bytes else slot_bytes(0, 0) for s in sizes]
        first_host = len(jobs) - self.host_tail(jobs, sizes)
        ranges = self.plan_waves(sizes, first_host)
        self.spent["device_plan_s"] += time.perf_counter() - t_plan
        try:
            with ThreadPoolExecutor(self.tuning.workers if self.readers is None else 1) as pool:
                try:
                    self.pool, self.first_host = pool, first_host
                    for start, stop in ranges:
                        if not self.can_take_wave():
                            self.submit_planned()  # taking a wave may wait: read what is planned
                        self.pump()
                        wave = self.take_wave()
                        wave.plan(sizes[start:stop])
                        self.planned.append((wave, jobs[start:stop], start))
                        # wave slices go out together (one message per worker), except the
                        # first wave's, sent at once so the reads start while the rest is planned
                        if self.readers is None or self.tuning.read_submit != "table" or not (self.reading or self.launched):
                            self.submit_planned()
                    self.submit_planned()
                    while self.reading or self.launched:
                        self.install_oldest()
                except BaseException:
                    for _wave, _jobs, futs in self.reading:
                        for fut in futs:
                            if self.readers is None:
                                fut.cancel()
                    if self.readers is not None:  # a reader process may still write into the waves
                        for _wave, _jobs, futs in list(self.reading) + list(self.launched):
                            for fut in futs:
                                if not fut.done():
                                    try:
                                        fut.exception(timeout=READ_DEADLINE_S)
                                    except Exception:  # noqa: BLE001 - only waiting for it to end
                                        pass
                    raise
        finally:
            # the pool has shut down: no worker writes into these buffers any more
            for wave in self.held:
                wave.release()
        if self.timeline is not None:
            self.timeline.write()
        phases: dict[str, float] = {k: round(v, 4) for k, v in self.spent.items()}
        phases.update(
            device_waves=len(ranges),
            device_ring=self.waves,
            device_read_processes=len(self.readers.workers) if self.readers else 0,
            device_host_tail=len(jobs) - first_host,
        )
        return PipelineResult(self.verified, self.nbytes, self.hashed_on, phases, pipeline="device")
