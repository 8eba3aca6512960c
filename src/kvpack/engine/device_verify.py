"""Restore staging for chunks whose two long hashes run on the device (the GPU verify path).

The store's restore reads chunk objects in *waves* of up to ``wave_chunks`` objects. A
wave owns one pinned host buffer and one device buffer of ``wave_chunks`` object slots, a
job table, and its own hash stream:

1. store workers read each object file into its host slot, run every CPU check of A.5 that
   does not need the long hashes (``format.chunk.decode_chunk_deferred``: header, padding,
   bindings, object key, frame); chunks that are not raw and unencrypted are decoded on
   the CPU instead and their plaintext is put where a raw frame's would be;
2. :meth:`Wave.launch` queues, on the wave's own stream, one host-to-device copy of the
   wave's slots (the *whole objects*), one SHA-256 job per object (the object digest) and
   one per plaintext (the content-ID HMAC's inner hash, with the HMAC inner block and the
   A.2 prefix as the job's head), then the copy of the digests back to pinned memory;
3. :meth:`Wave.digests` waits for them; the store finishes each chunk's checks
   (``DeferredChunk.finish``) and only then installs its rows *from the device copy that
   was hashed*, with the install's transposing copy;
4. :meth:`Wave.release` returns the wave to the ring once those copies have run.

Waves run on separate streams, so a wave hashes while later waves are read and uploaded.
The kernel's time is set by the longest message (one 4 MiB chunk object per thread), not
by the number of messages, which is why independent waves overlap so well.

On a CPU device (the CI tests) the same class runs with host tensors, no streams, and the
digests computed by hashlib from the job table's addresses (:func:`hash_jobs_on_host`):
the whole pipeline, its routing and its refusals are exercised without a GPU; only the
kernel itself needs one (tests/gpu).
"""

from __future__ import annotations

import ctypes
import hashlib
import queue
import threading
from typing import Any

from ..format import constants as C
from . import gpu_digest
from .cuda import SLOT_BYTES, _pool_for  # one slot size for both staging paths
from .lazy_torch import load_torch as _torch

#: Where a raw frame's plaintext starts inside its object (header + frame header).
PLAINTEXT_OFFSET = C.HEADER_BYTES + C.CODEC_FRAME_HEADER_BYTES


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
    """One ring entry: host and device slots for ``capacity`` chunk objects, the job table
    for their ``2 * capacity`` hashes, a stream and the events that order them."""

    def __init__(self, ring: "WaveRing", capacity: int) -> None:
        torch = _torch()
        self.ring = ring
        self.capacity = capacity
        cuda = ring.cuda
        with torch.inference_mode(False):
            self.host = torch.empty(capacity * SLOT_BYTES, dtype=torch.uint8, pin_memory=cuda)
            self.dev = torch.empty(capacity * SLOT_BYTES, dtype=torch.uint8, device=ring.device)
            jobs = 2 * capacity
            self.table = torch.zeros((jobs, 4), dtype=torch.int64, pin_memory=cuda)
            self.heads = torch.zeros((jobs, gpu_digest.HEAD_BYTES), dtype=torch.uint8, pin_memory=cuda)
            self.out_host = torch.zeros((jobs, 8), dtype=torch.int32, pin_memory=cuda)
            if cuda:
                self.table_dev = torch.empty_like(self.table, device=ring.device)
                self.heads_dev = torch.empty_like(self.heads, device=ring.device)
                self.out_dev = torch.empty((jobs, 8), dtype=torch.int32, device=ring.device)
        self.host_np = self.host.numpy()
        self.stream = torch.cuda.Stream(ring.device) if cuda else None
        # torch is untyped (Any); the events exist exactly when the ring is on CUDA.
        self.hashed: Any = torch.cuda.Event() if cuda else None
        self.installed: Any = torch.cuda.Event() if cuda else None
        self._installed_pending = False
        self._count = 0
        self._host_digests: list[bytes] = []

    # -- step 1: the workers --------------------------------------------------------------
    def slot_view(self, i: int) -> memoryview:
        """Writable host memory of slot ``i`` (a chunk object file is read into it)."""
        return memoryview(self.host_np)[i * SLOT_BYTES : (i + 1) * SLOT_BYTES]

    def place_plaintext(self, i: int, plaintext) -> None:
        """Put a plaintext verified on the host (encrypted or lossless chunk) into host slot
        ``i`` where a raw frame's plaintext would be; it travels with the wave's upload."""
        import numpy as np

        arr = np.frombuffer(plaintext, dtype=np.uint8)
        lo = i * SLOT_BYTES + PLAINTEXT_OFFSET
        if arr.size and arr.ctypes.data == self.host_np.ctypes.data + lo:
            return  # a raw chunk verified in its slot: its plaintext is already there
        self.host_np[lo : lo + arr.size] = arr

    # -- step 2: upload and hashing ----------------------------------------------------------
    def launch(self, used: int, objects: list[tuple[int, int]], contents: list[tuple[int, int, bytes]]) -> None:
        """Upload the first ``used`` slots (one host-to-device copy) and queue the hashes:
        ``objects`` = (slot, object bytes) for the object digests, ``contents`` = (slot,
        plaintext bytes, head) for the content-ID inner hashes. Every read of the wave must
        have finished."""
        import numpy as np

        torch = _torch()
        n_obj = len(objects)
        self._count = count = n_obj + len(contents)
        base = self.dev.data_ptr()
        head_base = self.heads_dev.data_ptr() if self.ring.cuda else self.heads.data_ptr()
        table = self.table.numpy()
        if count:
            slots = np.array([i for i, _ in objects] + [i for i, _, _ in contents], dtype=np.int64)
            table[:count, 0] = base + slots * SLOT_BYTES
            table[n_obj:count, 0] += PLAINTEXT_OFFSET
            table[:count, 1] = head_base + np.arange(count, dtype=np.int64) * gpu_digest.HEAD_BYTES
            table[:count, 2] = [n for _, n in objects] + [n for _, n, _ in contents]
            table[:n_obj, 3] = 0
            heads = self.heads.numpy()
            for j, (_i, _n, head) in enumerate(contents, start=n_obj):
                if len(head) > gpu_digest.HEAD_BYTES:
                    raise ValueError("job head too long")
                heads[j, : len(head)] = np.frombuffer(head, dtype=np.uint8)
                table[j, 3] = len(head)
        nbytes = used * SLOT_BYTES
        if not self.ring.cuda:
            self.dev[:nbytes].copy_(self.host[:nbytes])
            self._host_digests = hash_jobs_on_host(table, count)
            return
        with torch.cuda.stream(self.stream):
            self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
            if count:
                self.table_dev[:count].copy_(self.table[:count], non_blocking=True)
                self.heads_dev[:count].copy_(self.heads[:count], non_blocking=True)
                gpu_digest.launch(self.table_dev, self.out_dev, count, stream=self.stream)
                self.out_host[:count].copy_(self.out_dev[:count], non_blocking=True)
            self.hashed.record(self.stream)

    # -- step 3: results and install -------------------------------------------------------
    def hashed_ready(self) -> bool:
        """Whether :meth:`digests` would return without waiting."""
        return True if not self.ring.cuda else self.hashed.query()

    def digests(self) -> list[bytes]:
        """The digests of the launched jobs, in launch order (waits for the kernel)."""
        if not self.ring.cuda:
            return self._host_digests
        self.hashed.synchronize()
        words = self.out_host[: self._count].numpy().view("uint32")
        raw = words.astype(">u4").tobytes()
        return [raw[32 * j : 32 * j + 32] for j in range(self._count)]

    def order_installs(self) -> None:
        """Make the current stream wait for this wave's uploads and hashes: the install
        copies queued after this read exactly the bytes that were hashed."""
        torch = _torch()
        if self.ring.cuda:
            torch.cuda.current_stream(self.ring.device).wait_event(self.hashed)

    def rows(self, i: int, offset: int, nbytes: int):
        """Device bytes ``[offset, offset + nbytes)`` of slot ``i``'s plaintext (call
        :meth:`order_installs` once before copying from them)."""
        lo = i * SLOT_BYTES + PLAINTEXT_OFFSET + offset
        return self.dev[lo : lo + nbytes]

    def row_blocks(self, first: int, count: int, offset: int, nbytes: int):
        """``count`` equal row blocks, slot ``first`` onwards, each ``[offset, offset +
        nbytes)`` of its slot's plaintext: a (count, nbytes) strided view, no copy."""
        lo = first * SLOT_BYTES + PLAINTEXT_OFFSET + offset
        return self.dev[lo:].as_strided((count, nbytes), (SLOT_BYTES, 1))

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
        if self.ring.cuda:
            self.hashed.synchronize()  # a refused restore may leave a kernel reading the slots


class WaveRing:
    """``waves`` :class:`Wave` buffers of ``wave_chunks`` slots for one device (kept for
    reuse: pinning memory is slow)."""

    def __init__(self, device: Any, *, wave_chunks: int, waves: int) -> None:
        torch = _torch()
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.wave_chunks = wave_chunks
        self._free: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.waves = 0
        self.grow(waves)

    def grow(self, waves: int) -> None:
        with self._lock:
            while self.waves < waves:
                self._free.put(Wave(self, self.wave_chunks))
                self.waves += 1

    def acquire(self, *, block: bool = True) -> Wave | None:
        """A free wave (waits for one; ``block=False`` returns None instead). Restores that
        share the ring must not block while holding waves: each installs its own oldest wave
        first (PackStore does), so two concurrent restores cannot wait on each other."""
        try:
            wave = self._free.get(block=block)
        except queue.Empty:
            return None
        wave._wait_reusable()
        return wave


def wave_ring(device: Any, *, wave_chunks: int, waves: int) -> WaveRing:
    """The process-wide ring for ``device`` and this wave size, with at least ``waves`` waves."""
    device = _torch().device(device)
    ring = _pool_for("waves", device, wave_chunks, lambda: WaveRing(device, wave_chunks=wave_chunks, waves=waves))
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


def host_tail_chunks(ring: "WaveRing", workers: int, chunk_bytes: int) -> int:
    """How many chunks the host threads can verify completely (two hash passes each) in
    the time the device needs to hash one wave after its upload: giving the restore's
    last chunks to the host hides the kernel's latency behind them."""
    if not ring.cuda or chunk_bytes <= 0:
        return 0
    latency = gpu_digest.message_latency(ring.device, chunk_bytes)
    per_chunk = 2 * chunk_bytes / host_sha256_rate()
    return int(latency * max(workers, 1) / per_chunk)


def unavailable_reason(device: Any) -> str | None:
    """``None`` if restores on ``device`` can verify on it, else why not."""
    torch = _torch()
    if torch.device(device).type != "cuda":
        return "not a CUDA device"
    return gpu_digest.available(device)


__all__ = ["PLAINTEXT_OFFSET", "SLOT_BYTES", "Wave", "WaveRing", "hash_jobs_on_host", "host_sha256_rate", "host_tail_chunks", "unavailable_reason", "wave_ring"]
