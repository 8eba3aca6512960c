"""Restore staging for chunks whose two long hashes run on the device (the GPU verify path).

The store's restore reads chunk objects in *waves*. A wave owns one pinned host buffer and
one device buffer of ``wave_bytes``, into which its objects are packed back to back (each
slot 4096-aligned and as large as the object, or as its plaintext placed after the frame
header, whichever is larger), a job table with two rows per object, and a hash stream:

1. store workers read each object file into its host slot, run every CPU check of A.5 that
   does not need the long hashes (``format.chunk.decode_chunk_deferred``: header, padding,
   bindings, object key, frame) and write the object's two job rows (:meth:`Wave.set_jobs`);
   chunks that are not raw and unencrypted are decoded on the CPU instead, their plaintext
   is put where a raw frame's would be, and their job rows hash nothing;
2. :meth:`Wave.launch` queues, on the wave's stream, one host-to-device copy of the packed
   slots, one SHA-256 job per object (the object digest) and one per plaintext (the
   content-ID HMAC's inner hash, with the HMAC inner block and the A.2 prefix as the job's
   head), then the copy of the digests back to pinned memory;
3. :meth:`Wave.digests` waits for them; the store finishes each chunk's checks
   (``DeferredChunk.finish``) and only then installs its rows *from the device copy that
   was hashed*, with the install's transposing copy;
4. :meth:`Wave.release` returns the wave to the ring once those copies have run.

Waves are spread over at most :data:`MAX_STREAMS` streams (CUDA maps streams onto 8
hardware queues by default; more would only add false dependencies), so a wave hashes while
later waves are read and uploaded. The kernel's time is set by the longest message (each
message is hashed by one lane, see :mod:`.gpu_digest`): the store's chunk size is the restore's per-wave latency, and
the number of messages in flight is its hashing throughput.

On a CPU device (the CI tests) the same class runs with host tensors, no streams, and the
digests computed by hashlib from the job table's addresses (:func:`hash_jobs_on_host`):
the whole pipeline, its routing and its refusals are exercised without a GPU; only the
kernel itself needs one (tests/gpu). This module never reads files and never decides what
is verified: the pipeline in :mod:`kvpack.engine.restore` does.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import threading
from typing import Any

from ..format import constants as C
from . import gpu_digest
from .cuda import SLOT_BYTES, _pool_for  # one slot size for both staging paths
from .lazy_torch import load_torch as _torch

#: Where a raw frame's plaintext starts inside its object (header + frame header).
PLAINTEXT_OFFSET = C.HEADER_BYTES + C.CODEC_FRAME_HEADER_BYTES
#: Streams a ring spreads its waves over (the default number of CUDA hardware queues).
MAX_STREAMS = 8
#: Where the kernel writes a wave's digests: "mapped" (the default: straight into the wave's
#: pinned host rows, which CUDA maps into the device's address space, zeroed before each
#: launch so a kernel that wrote nothing can only fail the checks) or "copy" (device memory,
#: then a device-to-host copy queued after the kernel on the wave's stream). With "copy" on
#: the H200 at most 4 waves hashed at once: a digest copy waiting for its kernel held the copy
#: queue it shares, so wave k+4's upload started only when wave k's digests were back
#: (8k restore 0.177 s copy vs 0.130 s mapped, 32k 0.271 vs 0.236, one run, medians of 5;
#: docs/benchmarks.md). KVPACK_DIGESTS=copy selects the old way.
DIGESTS = os.environ.get("KVPACK_DIGESTS", "mapped")


def slot_bytes(object_bytes: int, plaintext_bytes: int) -> int:
    """Bytes a chunk takes in a wave: its object, or its plaintext placed after the frame
    header (a lossless chunk's plaintext is larger than its object), 4096-aligned."""
    need = max(object_bytes, PLAINTEXT_OFFSET + plaintext_bytes)
    return -(-need // C.ALIGNMENT) * C.ALIGNMENT


def write_job_rows(table, heads, i: int, slot_addr: int, heads_addr: int, object_bytes: int, plaintext_bytes: int, head: bytes) -> None:
    """The two job rows of slot ``i`` (numpy views of a wave's table and heads): the
    object's SHA-256 at ``slot_addr`` and ``head || plaintext`` after its frame header
    (both zero-length for a chunk verified on the host). ``heads_addr`` is the device
    address of ``heads`` row 0. Shared by the reading threads and processes."""
    import numpy as np

    if len(head) > gpu_digest.HEAD_BYTES:
        raise ValueError("job head too long")
    row = 2 * i
    table[row] = (slot_addr, 0, object_bytes, 0)
    table[row + 1] = (slot_addr + PLAINTEXT_OFFSET, heads_addr + (row + 1) * gpu_digest.HEAD_BYTES, plaintext_bytes, len(head))
    if head:
        heads[row + 1, : len(head)] = np.frombuffer(head, dtype=np.uint8)


def table_bytes(wave_chunks: int) -> int:
    """Bytes of one wave's job table plus heads (two jobs per object)."""
    return 2 * wave_chunks * (4 * 8 + gpu_digest.HEAD_BYTES)


class SharedStaging:
    """Host staging every wave of a ring lives in: one shared anonymous mapping (a memfd,
    so reader processes map the same pages, kvpack.engine.chunk_readers), registered with
    CUDA as pinned memory on a CUDA ring. Falls back to ordinary pinned memory (and no
    reader processes) where either step is unavailable; ``shared`` says which."""

    def __init__(self, nbytes: int, cuda: bool) -> None:
        import mmap
        import os

        torch = _torch()
        self.nbytes = nbytes
        self.fd = -1
        self.map: Any = None
        self.pinned = False
        try:
            fd = os.memfd_create("kvpack-staging", getattr(os, "MFD_CLOEXEC", 1))
        except (AttributeError, OSError):
            fd = -1
        if fd >= 0:
            try:
                os.ftruncate(fd, nbytes)
                self.map = mmap.mmap(fd, nbytes)
                self.fd = fd
            except OSError:
                os.close(fd)
        if self.map is not None:
            with torch.inference_mode(False):
                self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
            self.pinned = cuda and _register_pinned(self.tensor)
            if cuda and not self.pinned:  # unpinned copies would be slow: pinned, unshared
                self._drop_shared()
        if self.map is None:
            with torch.inference_mode(False):
                self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
            self.pinned = cuda

    @property
    def shared(self) -> bool:
        return self.fd >= 0

    def _drop_shared(self) -> None:
        import os

        del self.tensor
        self.map.close()
        os.close(self.fd)
        self.map, self.fd = None, -1


def _register_pinned(tensor) -> bool:
    """cudaHostRegister ``tensor``'s memory (page-aligned); True if CUDA now treats it as
    pinned memory (asynchronous host-to-device copies)."""
    torch = _torch()
    try:
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
        return int(err) == 0 and bool(tensor.is_pinned())
    except Exception:  # noqa: BLE001 - no runtime binding: fall back to pinned allocations
        return False


def hash_jobs_on_host(table, count: int) -> list[bytes]:
    """hashlib over the jobs of ``table`` (rows: body address, head address, body bytes,
    head bytes; host memory): the CPU twin of the kernel, for the CPU pipeline."""
    out = []
    for i in range(count):
        body, head, blen, hlen = (int(x) for x in table[i])
        h = hashlib.sha256()
        if hlen:
            h.update((ctypes.c_uint8 * hlen).from_address(head))
        if blen:
            h.update((ctypes.c_uint8 * blen).from_address(body))
        out.append(h.digest())
    return out


class Wave:
    """One ring entry: packed host and device slots for up to ``ring.wave_chunks`` chunk
    objects in ``ring.wave_bytes``, the job table for their two hashes each (rows ``2i``:
    object ``i``, ``2i + 1``: its content), a stream and the events that order them."""

    def __init__(self, ring: "WaveRing", index: int, segment: int, slot: int) -> None:
        import numpy as np

        torch = _torch()
        self.ring = ring
        cuda = ring.cuda
        jobs = 2 * ring.wave_chunks
        #: where this wave lives in the ring's shared staging: segment, data, job table, heads
        self.segment = segment
        self.base = slot * ring.wave_stride
        self.table_at = self.base + ring.wave_bytes
        self.heads_at = self.table_at + jobs * 32
        staging = ring.segments[segment].tensor
        with torch.inference_mode(False):
            self.host = staging[self.base : self.base + ring.wave_bytes]
            self.table = staging[self.table_at : self.heads_at].view(torch.int64).view(jobs, 4)
            self.heads = staging[self.heads_at : self.heads_at + jobs * gpu_digest.HEAD_BYTES].view(jobs, gpu_digest.HEAD_BYTES)
            self.dev = torch.empty(ring.wave_bytes, dtype=torch.uint8, device=ring.device)
            self.out_host = torch.zeros((jobs, 8), dtype=torch.int32, pin_memory=cuda)
            if cuda:
                self.table_dev = torch.empty_like(self.table, device=ring.device)
                self.heads_dev = torch.empty_like(self.heads, device=ring.device)
                self.out_dev = torch.empty((jobs, 8), dtype=torch.int32, device=ring.device)
        self.host_np = self.host.numpy()
        self.table_np = self.table.numpy()
        self.heads_np = self.heads.numpy()
        self.dev_base = self.dev.data_ptr()
        self.heads_base = self.heads_dev.data_ptr() if cuda else self.heads.data_ptr()
        self.offsets = np.zeros(ring.wave_chunks + 1, dtype=np.int64)
        self.sizes: list[int] = []
        self.starts: list[int] = [0]
        self.count = 0
        self.stream = ring.streams[index % len(ring.streams)] if cuda else None
        # torch is untyped (Any); the events exist exactly when the ring is on CUDA.
        self.hashed: Any = torch.cuda.Event() if cuda else None
        self.installed: Any = torch.cuda.Event() if cuda else None
        self._installed_pending = False
        self._launched = False
        self._hashed_jobs = 0  # job rows the last launch hashed
        self._host_digests = b""

    # -- step 0: the layout of this wave ------------------------------------------------------
    def plan(self, sizes: list[int]) -> None:
        """Pack slots of ``sizes`` bytes (see :func:`slot_bytes`) from offset 0."""
        import numpy as np

        if len(sizes) > self.ring.wave_chunks or sum(sizes) > self.ring.wave_bytes:
            raise ValueError("wave over capacity")
        self.count = len(sizes)
        self.sizes = list(sizes)
        self.offsets[0] = 0
        self.offsets[1 : self.count + 1] = np.cumsum(sizes, dtype=np.int64)
        self.starts = self.offsets[: self.count + 1].tolist()  # plain ints for the per-chunk paths
        self._launched = False

    @property
    def used_bytes(self) -> int:
        return int(self.offsets[self.count])

    # -- step 1: the workers --------------------------------------------------------------
    def slot_view(self, i: int) -> memoryview:
        """Writable host memory of slot ``i`` (a chunk object file is read into it)."""
        return memoryview(self.host_np)[self.starts[i] : self.starts[i + 1]]

    def set_jobs(self, i: int, object_bytes: int, plaintext_bytes: int, head: bytes) -> None:
        """The two job rows of slot ``i`` (:func:`write_job_rows`). Called by the worker
        that read slot ``i`` (rows of different slots are independent)."""
        write_job_rows(self.table_np, self.heads_np, i, self.dev_base + self.starts[i], self.heads_base, object_bytes, plaintext_bytes, head)

    def geometry(self) -> tuple[int, int, int, int, int, int]:
        """Where a reader process writes this wave: the staging segment, (data, table,
        heads) offsets in it, the device address of the data and of the heads."""
        return self.segment, self.base, self.table_at, self.heads_at, self.dev_base, self.heads_base

    # -- step 2: upload and hashing ----------------------------------------------------------
    def launch(self, hash_jobs: bool = True) -> None:
        """Upload the packed slots (one host-to-device copy) and queue the hashes of every
        job row. Every read of the wave must have finished. ``hash_jobs=False``: every chunk
        of the wave was verified on the host (a host tail, an encrypted store), so no kernel
        and no digest copy are queued; :meth:`digests` is then all zeros."""
        torch = _torch()
        jobs = 2 * self.count if hash_jobs else 0
        nbytes = self.used_bytes
        self._launched = True
        self._hashed_jobs = jobs
        if not self.ring.cuda:
            self.dev[:nbytes].copy_(self.host[:nbytes])
            self._host_digests = b"".join(hash_jobs_on_host(self.table_np, jobs))
            return
        mapped = DIGESTS == "mapped"
        if mapped and jobs:
            # the previous use of these rows has finished (_wait_reusable): clear them, so a
            # kernel that did not write can only fail the digest checks, never pass stale ones
            self.out_host[:jobs].zero_()
        with torch.cuda.stream(self.stream):
            if nbytes:
                self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
            if jobs:
                self.table_dev[:jobs].copy_(self.table[:jobs], non_blocking=True)
                self.heads_dev[:jobs].copy_(self.heads[:jobs], non_blocking=True)
                if mapped:  # pinned host rows: the kernel writes them over the bus
                    gpu_digest.launch(self.table_dev, self.out_host, jobs, stream=self.stream)
                else:
                    gpu_digest.launch(self.table_dev, self.out_dev, jobs, stream=self.stream)
                    self.out_host[:jobs].copy_(self.out_dev[:jobs], non_blocking=True)
            self.hashed.record(self.stream)

    # -- step 3: results and install -------------------------------------------------------
    def hashed_ready(self) -> bool:
        """Whether :meth:`digests` would return without waiting."""
        return True if not self.ring.cuda else self.hashed.query()

    def digests(self) -> bytes:
        """The 32-byte digests of the job rows, concatenated in row order (waits for the
        kernel): object ``i``'s at ``64 i``, its content's at ``64 i + 32``."""
        if not self._hashed_jobs:
            return bytes(64 * self.count)  # nothing hashed: digests no check can accept
        if not self.ring.cuda:
            return self._host_digests
        self.hashed.synchronize()
        return self.out_host[: 2 * self.count].numpy().view("uint32").astype(">u4").tobytes()

    def order_installs(self) -> None:
        """Make the current stream wait for this wave's uploads and hashes: the install
        copies queued after this read exactly the bytes that were hashed."""
        torch = _torch()
        if self.ring.cuda:
            torch.cuda.current_stream(self.ring.device).wait_event(self.hashed)

    def rows(self, i: int, offset: int, nbytes: int):
        """Device bytes ``[offset, offset + nbytes)`` of slot ``i``'s plaintext (call
        :meth:`order_installs` once before copying from them)."""
        lo = int(self.offsets[i]) + PLAINTEXT_OFFSET + offset
        return self.dev[lo : lo + nbytes]

    def evenly_spaced(self, first: int, count: int) -> bool:
        """Whether slots ``first .. first + count - 1`` are equally sized neighbours (one
        strided view covers them)."""
        size = self.sizes[first]
        return all(s == size for s in self.sizes[first : first + count])

    def row_blocks(self, first: int, count: int, offset: int, nbytes: int):
        """``count`` equal row blocks, slot ``first`` onwards, each ``[offset, offset +
        nbytes)`` of its slot's plaintext: a (count, nbytes) strided view, no copy. The
        slots must be :meth:`evenly_spaced`."""
        if not self.evenly_spaced(first, count):
            raise ValueError("row blocks over unevenly spaced slots")
        stride = int(self.offsets[first + 1] - self.offsets[first])
        lo = int(self.offsets[first]) + PLAINTEXT_OFFSET + offset
        return self.dev[lo:].as_strided((count, nbytes), (stride, 1))

    def release(self) -> None:
        """Back to the ring; reused only after the install copies queued so far have run."""
        torch = _torch()
        if self.ring.cuda:
            self.installed.record(torch.cuda.current_stream(self.ring.device))
            self._installed_pending = True
        self.ring._free.put(self)

    def _wait_reusable(self) -> None:
        if self._installed_pending:
            self.installed.synchronize()
            self._installed_pending = False
        if self.ring.cuda and self._launched:
            self.hashed.synchronize()  # a refused restore may leave a kernel reading the slots


class WaveRing:
    """``waves`` :class:`Wave` buffers of ``wave_bytes`` and at most ``wave_chunks`` objects
    each for one device, spread over at most :data:`MAX_STREAMS` streams (kept for reuse:
    pinning memory is slow)."""

    def __init__(self, device: Any, *, wave_bytes: int, wave_chunks: int, waves: int) -> None:
        torch = _torch()
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.wave_bytes = wave_bytes
        self.wave_chunks = wave_chunks
        self.wave_stride = -(-(wave_bytes + table_bytes(wave_chunks)) // C.ALIGNMENT) * C.ALIGNMENT
        self.streams: list[Any] = []
        self._free: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.waves = 0
        self.segments: list[SharedStaging] = []
        self._readers: Any = None
        self.grow(waves)

    def readers(self, processes: int) -> Any:
        """The reader processes of this ring's shared staging (started at first use; a
        ring that grew gets a new pool that maps every segment), or None where the
        staging is not shared (kvpack.engine.chunk_readers)."""
        if processes < 1 or not all(seg.shared for seg in self.segments):
            return None
        with self._lock:
            if self._readers is not None and self._readers.segments != len(self.segments):
                self._readers.close()
                self._readers = None
            if self._readers is None:
                from .chunk_readers import ReaderPool

                self._readers = ReaderPool([(seg.fd, seg.nbytes) for seg in self.segments], processes)
            self._readers.ensure(processes)
            return self._readers

    def grow(self, waves: int) -> None:
        torch = _torch()
        with self._lock:
            while self.cuda and len(self.streams) < min(waves, MAX_STREAMS):
                self.streams.append(torch.cuda.Stream(self.device))
            if self.waves < waves:  # one more staging segment for the new waves
                self.segments.append(SharedStaging((waves - self.waves) * self.wave_stride, self.cuda))
                for slot in range(waves - self.waves):
                    self._free.put(Wave(self, self.waves, len(self.segments) - 1, slot))
                    self.waves += 1

    def acquire(self, *, block: bool = True) -> Wave | None:
        """A free wave (waits for one; ``block=False`` returns None instead). Restores that
        share the ring must not block while holding waves: each installs its own oldest wave
        first (the restore pipeline does), so two concurrent restores cannot wait on each
        other."""
        try:
            wave = self._free.get(block=block)
        except queue.Empty:
            return None
        wave._wait_reusable()
        return wave


def wave_ring(device: Any, *, wave_chunks: int, waves: int, wave_bytes: int | None = None) -> WaveRing:
    """The process-wide ring for ``device`` and this wave size, with at least ``waves``
    waves. ``wave_bytes`` defaults to ``wave_chunks`` largest chunk objects."""
    device = _torch().device(device)
    nbytes = wave_bytes if wave_bytes is not None else wave_chunks * SLOT_BYTES
    ring = _pool_for("waves", device, (nbytes, wave_chunks), lambda: WaveRing(device, wave_bytes=nbytes, wave_chunks=wave_chunks, waves=waves))
    ring.grow(waves)
    return ring


_host_rate: list[float] = []


def host_sha256_rate() -> float:
    """Bytes per second one thread hashes with hashlib (measured once, over 4 MiB)."""
    if not _host_rate:
        import time

        data = bytes(4 << 20)
        hashlib.sha256(data[:4096]).digest()
        t0 = time.perf_counter()
        hashlib.sha256(data).digest()
        _host_rate.append(len(data) / max(time.perf_counter() - t0, 1e-6))
    return _host_rate[0]


#: Host-to-device copy rate assumed for a wave's upload (pinned staging; bench_limits
#: measured 55 GB/s on the H200): only the host tail's size depends on it.
H2D_BYTES_PER_S = 50e9
#: Page-cache read rate of one reader process assumed before any restore has measured it
#: (16 processes read 42 GB/s on the H200 host: docs/benchmarks.md).
READ_BYTES_PER_S = 2.5e9


def host_tail_chunks(
    ring: "WaveRing",
    workers: int,
    chunk_bytes: int,
    *,
    host_s_per_byte: float | None = None,
    upload_bytes: int = 0,
) -> int:
    """How many of a restore's last chunks the host should verify completely (read plus
    both hashes) so that it finishes when the device's last wave does.

    The last device wave's hashes end ``L`` = upload + kernel latency (set by the longest
    message) after its reads; meanwhile ``workers`` verify ``t`` tail chunks costing ``c``
    each (``host_s_per_byte`` measured by the reader processes, else a page-cache read plus
    two hashlib passes), so the two end together at ``t = L * workers / c``. Reading the
    tail instead of the device's chunks moves the device's last reads earlier by ``t`` reads,
    which the same equation already accounts for (``c`` includes the read)."""
    if not ring.cuda or chunk_bytes <= 0:
        return 0
    latency = gpu_digest.message_latency(ring.device, chunk_bytes) + upload_bytes / H2D_BYTES_PER_S
    if host_s_per_byte is None:
        per_chunk = chunk_bytes / READ_BYTES_PER_S + 2 * chunk_bytes / host_sha256_rate()
    else:
        per_chunk = chunk_bytes * host_s_per_byte
    return int(latency * max(workers, 1) / per_chunk)


def unavailable_reason(device: Any) -> str | None:
    """``None`` if restores on ``device`` can verify on it, else why not."""
    torch = _torch()
    if torch.device(device).type != "cuda":
        return "not a CUDA device"
    return gpu_digest.available(device)


__all__ = [
    "H2D_BYTES_PER_S",
    "MAX_STREAMS",
    "READ_BYTES_PER_S",
    "PLAINTEXT_OFFSET",
    "SLOT_BYTES",
    "Wave",
    "WaveRing",
    "hash_jobs_on_host",
    "host_sha256_rate",
    "host_tail_chunks",
    "slot_bytes",
    "unavailable_reason",
    "wave_ring",
]
