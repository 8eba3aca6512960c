"""Restore pipelines: verified chunk objects into an engine's detached install.

The store decides *what* a cut needs (its pack chain, the chunk jobs) and where the bytes
are (a :class:`ChunkSource` over its storage environment); this module decides *how* they
reach the engine, which depends on the engine's install, not on the store:

* :class:`HostPipeline` -- workers read and fully verify each chunk, this thread installs
  the rows (any install; on CUDA through per-chunk pinned slots, ``install.stager``);
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

import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

from ..format import constants as C
from ..format.objects import ChunkRef, Manifest, Span, StateKey
from .contract import DeviceVerification, PlaneStaging

Buffer = Union[bytes, memoryview]


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


@dataclass
class RestoreTuning:
    """Knobs of the pipelines (the store exposes them as attributes for compatibility)."""

    workers: int = field(default_factory=default_workers)
    #: whole-plane staging: "auto" on CUDA installs, "always" (tests), "never"
    plane_staging: str = "auto"
    #: where the long hashes run: "auto" (GPU when the kernel compiles), "host", "device"
    #: (forced; on a CPU install the same pipeline hashes with hashlib, as CI tests it)
    verify_on: str = field(default_factory=lambda: os.environ.get("KVPACK_VERIFY_ON", "auto"))
    #: device verify: waves in flight (each on its own stream; at most 8, the number of
    #: hardware queues CUDA maps streams onto), staging they share, objects per wave
    device_waves: int = 8
    device_staging_bytes: int = field(default_factory=lambda: int(os.environ.get("KVPACK_DEVICE_STAGING_BYTES", str(4 << 30))))
    wave_chunks: int | None = None
    #: device verify: how many of the last chunks the host verifies while the device hashes
    #: the rest (None: as many as the workers verify in one kernel latency; 0: off)
    device_host_tail: int | None = 0


@dataclass
class PipelineResult:
    verified: int
    nbytes: int
    hashed_on: dict[str, int]
    phases: dict[str, float] = field(default_factory=dict)
    pipeline: str = "host"


def install_chunks(jobs: list[ChunkJob], source: ChunkSource, install: Any, layout: Any, tuning: RestoreTuning) -> PipelineResult:
    """Verify every job's chunk and write its rows into ``install`` (not committed).

    The pipeline follows the install's typed capabilities (kvpack.engine.contract):
    DeviceVerification, then PlaneStaging, else plain host verification."""
    if tuning.verify_on != "host" and isinstance(install, DeviceVerification) and jobs:
        capacity = tuning.wave_chunks or max(1, tuning.device_staging_bytes // (tuning.device_waves * C.MAX_CHUNK_OBJECT_BYTES))
        ring = install.wave_ring(wave_chunks=capacity, waves=tuning.device_waves, force=tuning.verify_on == "device")
        if ring is not None:
            return DeviceVerifiedPipeline(source, install, layout, tuning, ring).run(jobs)
    if isinstance(install, PlaneStaging) and tuning.plane_staging != "never":
        planes = install.plane_stager(force=tuning.plane_staging == "always")
        if planes is not None:
            return PlanePipeline(source, install, layout, tuning, planes).run(jobs)
    return HostPipeline(source, install, layout, tuning).run(jobs)


def _decode(source: ChunkSource, job: ChunkJob, obj: Buffer) -> Buffer:
    from ..format.chunk import decode_chunk

    return decode_chunk(obj, **source.verify_args(job))


class HostPipeline:
    """Workers read and verify; this thread installs in job order (bounded window)."""

    def __init__(self, source: ChunkSource, install: Any, layout: Any, tuning: RestoreTuning) -> None:
        self.source, self.install, self.layout, self.tuning = source, install, layout, tuning
        self.verified = self.nbytes = 0
        # On a CUDA install chunk objects are read into pinned slots, verified there and
        # uploaded by the workers; this thread only queues the device-side copies.
        self.stager = install.stager(2 * tuning.workers + 2) if isinstance(install, PlaneStaging) else None

    def verify_one(self, job: ChunkJob) -> Any:
        """The verified plaintext, or with a stager the slot holding it (upload started)."""
        slot = self.stager.acquire() if self.stager is not None else None
        try:
            if slot is None:
                return _decode(self.source, job, self.source.read(job.ref))
            obj, _n = self.source.read_into(job.ref, slot.host_region())
            slot.upload(_decode(self.source, job, obj))
            return slot
        except BaseException:
            if slot is not None:
                slot.release()
            raise

    def drain(self, fut: Future, job: ChunkJob) -> None:
        result = fut.result()
        row = self.layout.layer(job.key.layer).row_bytes
        lo_byte, hi_byte = (job.a - job.span.token_start) * row, (job.b - job.span.token_start) * row
        if self.stager is None:
            self.install.write_rows(job.key.layer, job.key.name, job.a, memoryview(result)[lo_byte:hi_byte])
        else:
            try:
                self.install.write_rows(job.key.layer, job.key.name, job.a, result.rows(lo_byte, hi_byte - lo_byte))
            finally:
                result.release()
        self.verified += 1
        self.nbytes += job.ref.object_bytes

    def run(self, jobs: list[ChunkJob]) -> PipelineResult:
        window = 2 * self.tuning.workers
        pending: deque[tuple[Future, ChunkJob]] = deque()
        with ThreadPoolExecutor(self.tuning.workers) as pool:
            try:
                for job in jobs:
                    pending.append((pool.submit(self.verify_one, job), job))
                    if len(pending) >= window:
                        self.drain(*pending.popleft())
                while pending:
                    self.drain(*pending.popleft())
            finally:
                if self.stager is not None:  # refused midway: hand back the slots still held
                    for fut, _job in pending:
                        if fut.exception() is None:
                            fut.result().release()
        return PipelineResult(self.verified, self.nbytes, {"host": self.verified}, pipeline="host")


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
        plaintext = _decode(self.source, job, obj)
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


class DeviceVerifiedPipeline:
    """Restore with the two long hashes on the device (kvpack.engine.device_verify).

    Workers read each object into its wave slot and run every other check of A.5 there
    (``decode_chunk_deferred``); the wave's objects are uploaded whole and hashed on the
    device; each chunk is installed from the hashed device copy only after
    ``DeferredChunk.finish`` accepted its digests. A wave of ``wave_chunks`` objects is in
    flight per ring entry; ``waves`` entries overlap reading, hashing and install."""

    def __init__(self, source: ChunkSource, install: Any, layout: Any, tuning: RestoreTuning, ring: Any) -> None:
        from ..format.identity import hmac_sha256_pads

        self.source, self.install, self.layout, self.tuning, self.ring = source, install, layout, tuning, ring
        self.waves = tuning.device_waves
        self.inner_pad, self.outer_pad = hmac_sha256_pads(source.keys.chunk_identity)
        self.verified = self.nbytes = 0
        self.hashed_on = {"device": 0, "host": 0}
        # where this thread's time goes (reported in RestoreReport.phases as device_*_s)
        self.spent = {"device_wait_reads_s": 0.0, "device_launch_s": 0.0, "device_wait_hash_s": 0.0, "device_check_s": 0.0, "device_install_s": 0.0}
        self.reading: deque[tuple] = deque()  # (wave, jobs, futures): reads queued, in order
        self.launched: deque[tuple] = deque()  # hashes queued, in order
        self.held: list[Any] = []

    def read(self, job: ChunkJob, wave: Any, i: int, on_host: bool) -> tuple[str, Any, Any]:
        """-> ("deferred", DeferredChunk, head) or ("host", None, None); raises on refusal.
        ``on_host``: verify completely here (the restore's tail, see ``device_host_tail``)."""
        from ..format.chunk import decode_chunk_deferred, deferrable
        from ..format.identity import chunk_content_prefix
        from .device_verify import SLOT_BYTES
        from .gpu_digest import HEAD_BYTES

        obj, n = self.source.read_into(job.ref, wave.slot_view(i))
        verify_args = self.source.verify_args(job)
        if not on_host and n < SLOT_BYTES and job.ref.key_epoch == self.source.epoch and deferrable(obj):
            s = job.span
            head = self.inner_pad + chunk_content_prefix(
                self.source.tenant, self.source.family_digest, job.key.layer, job.key.name, s.token_start, s.token_count, s.plaintext_offset, s.plaintext_bytes
            )
            if len(head) <= HEAD_BYTES:
                return "deferred", decode_chunk_deferred(obj, **verify_args), head
        from ..format.chunk import decode_chunk

        plaintext = decode_chunk(obj, **verify_args)  # encrypted, lossless, odd, or the tail
        wave.place_plaintext(i, plaintext)  # a raw plaintext is already in place: no copy
        return "host", None, None

    def launch_wave(self, entry: tuple) -> None:
        wave, wave_jobs, futs = entry
        t0 = time.perf_counter()
        results = [f.result() for f in futs]
        t1 = time.perf_counter()
        self.spent["device_wait_reads_s"] += t1 - t0
        deferred = [(i, r) for i, r in enumerate(results) if r[0] == "deferred"]
        wave.launch(
            len(wave_jobs),
            [(i, wave_jobs[i].ref.object_bytes) for i, _ in deferred],
            [(i, wave_jobs[i].span.plaintext_bytes, r[2]) for i, r in deferred],
        )
        self.launched.append(entry)
        self.spent["device_launch_s"] += time.perf_counter() - t1

    def check_wave(self, wave: Any, results: list) -> None:
        """Finish the deferred checks of a hashed wave with the device's digests."""
        from ..format.chunk import ExternalDigests
        from ..format.identity import hmac_sha256_finish

        deferred = [i for i, r in enumerate(results) if r[0] == "deferred"]
        self.hashed_on["device"] += len(deferred)
        self.hashed_on["host"] += len(results) - len(deferred)
        t0 = time.perf_counter()
        digests = wave.digests()
        m = len(deferred)
        for k, i in enumerate(deferred):
            results[i][1].finish(ExternalDigests(digests[k], hmac_sha256_finish(self.outer_pad, digests[m + k])))
        self.spent["device_check_s"] += time.perf_counter() - t0

    def install_wave(self, entry: tuple) -> None:
        wave, wave_jobs, futs = entry
        self.check_wave(wave, [f.result() for f in futs])
        t1 = time.perf_counter()
        wave.order_installs()
        i = 0
        while i < len(wave_jobs):  # one copy per run of consecutive rows of one plane
            job = wave_jobs[i]
            row = self.layout.layer(job.key.layer).row_bytes
            lo_byte, size = (job.a - job.span.token_start) * row, (job.b - job.a) * row
            j, end = i + 1, job.b
            while j < len(wave_jobs):
                nxt = wave_jobs[j]
                same_plane = (nxt.key.layer, nxt.key.name) == (job.key.layer, job.key.name)
                if not same_plane or nxt.a != end or (nxt.a - nxt.span.token_start) * row != lo_byte or (nxt.b - nxt.a) * row != size:
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
        if not self.launched:
            self.launch_wave(self.reading.popleft())  # waits for its reads
        entry = self.launched.popleft()
        t0 = time.perf_counter()
        while not entry[0].hashed_ready():  # keep later waves hashing meanwhile
            self.pump()
            time.sleep(0.0002)
        self.spent["device_wait_hash_s"] += time.perf_counter() - t0
        self.install_wave(entry)
        self.held.remove(entry[0])
        entry[0].release()

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

    def run(self, jobs: list[ChunkJob]) -> PipelineResult:
        from .device_verify import host_tail_chunks

        tail = self.tuning.device_host_tail
        if tail is None:
            tail = host_tail_chunks(self.ring, self.tuning.workers, max(job.ref.object_bytes for job in jobs))
        first_host = len(jobs) - min(tail, len(jobs))
        # spread the chunks over all the waves in flight (a small restore still overlaps its
        # reads with its hashing), never more than a wave holds
        per_wave = min(self.ring.wave_chunks, -(-len(jobs) // self.waves))
        starts = list(range(0, len(jobs), per_wave))
        try:
            with ThreadPoolExecutor(self.tuning.workers) as pool:
                try:
                    for start in starts:
                        group = jobs[start : start + per_wave]
                        self.pump()
                        wave = self.take_wave()
                        futs = [pool.submit(self.read, job, wave, i, start + i >= first_host) for i, job in enumerate(group)]
                        self.reading.append((wave, group, futs))
                    while self.reading or self.launched:
                        self.install_oldest()
                except BaseException:
                    for _wave, _jobs, futs in self.reading:
                        for fut in futs:
                            fut.cancel()
                    raise
        finally:
            # the pool has shut down: no worker writes into these buffers any more
            for wave in self.held:
                wave.release()
        phases: dict[str, float] = {k: round(v, 4) for k, v in self.spent.items()}
        phases.update(device_waves=len(starts), device_ring=self.waves)
        return PipelineResult(self.verified, self.nbytes, self.hashed_on, phases, pipeline="device")
