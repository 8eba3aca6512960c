"""Pinned-memory transfer paths between a KV cache on a CUDA device and the pack store.

The store hashes, encodes and writes on a thread pool; on a GPU the bytes it works on have to
cross PCIe first. These helpers keep that crossing off the critical path:

* **export** (:func:`export_spans`): for each requested span the token-major rows are made
  contiguous *on the device* (one transpose kernel), then copied device-to-host with
  ``non_blocking=True`` into a reusable pinned buffer, and an event is recorded. The
  generator runs ``depth`` spans ahead of its consumer, so the copies of later spans
  overlap the hashing and writing of earlier ones. Each item is ``(memoryview, release)``;
  the consumer calls ``release()`` once it no longer reads the view (the store does so when
  the chunk's write job finishes), which returns the pinned buffer to the pool.
* **restore** (:class:`RestoreStager`): a fixed set of slots, each a pinned host buffer
  large enough for one chunk object plus a device buffer for one chunk's plaintext. A store
  worker thread takes a slot, reads the chunk object file straight into the pinned buffer
  (``readv``, no intermediate copy), verifies it with the format's ``decode_chunk`` (any
  number of workers in parallel: hashlib and the AEAD release the GIL), and uploads the
  verified plaintext host-to-device on a side stream. The install then copies the rows from
  the device buffer into the head-major cache plane (a device-side transpose on the current
  stream, ordered after the upload by an event), and the slot is released; it is reused
  only after that copy has run.

Byte identity: the exported bytes are those of the same device tensor that
:meth:`EngineSession.export_rows` copies to the host, moved by a plain byte copy; the
restored plane receives exactly the verified plaintext bytes. Nothing here converts dtypes
(f16/bf16/f32 move as raw bytes). Every function also runs on CPU tensors (no streams, no
events, ordinary buffers), which is how the CI tests check this logic without a GPU.
"""

from __future__ import annotations

import os
import queue
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..errors import EngineError
from ..format import constants as C
from .lazy_torch import load_torch as _torch  # one lazy torch import for the engine side

#: Bytes of the largest chunk object (header, max frame, AEAD tag, alignment pad).
MAX_OBJECT_BYTES = C.MAX_CHUNK_OBJECT_BYTES
#: Bytes of the largest chunk plaintext.
MAX_PLAINTEXT_BYTES = C.MAX_CHUNK_PLAINTEXT


def _is_cuda(device: Any) -> bool:
    return getattr(device, "type", str(device)).startswith("cuda")


def _host_buffer(nbytes: int, pin: bool):
    torch = _torch()
    with torch.inference_mode(False):  # a normal tensor: it is written in place again and again
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _frombuffer(data):
    """A uint8 tensor over any buffer, read-only buffers included (never written through)."""
    torch = _torch()
    view = memoryview(data).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


class HostBufferPool:
    """Reusable host buffers of ``nbytes`` each, pinned when ``pin``; grows on demand up to
    ``limit`` buffers, then ``acquire`` waits for a ``release``."""

    def __init__(self, nbytes: int, *, pin: bool, limit: int = 512) -> None:
        self.nbytes = nbytes
        self.pin = pin
        self.limit = limit
        self._free: list = []
        self._count = 0
        self._cond = threading.Condition()

    @property
    def allocated(self) -> int:
        return self._count

    @property
    def idle(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, nbytes: int):
        """A buffer of at least ``nbytes``; oversized requests get a one-off buffer."""
        if nbytes > self.nbytes:
            return _host_buffer(nbytes, self.pin)
        with self._cond:
            while not self._free and self._count >= self.limit:
                self._cond.wait()
            if self._free:
                return self._free.pop()
            self._count += 1
        return _host_buffer(self.nbytes, self.pin)

    def release(self, buf) -> None:
        if buf.numel() != self.nbytes:
            return  # a one-off buffer: let it go
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


_POOLS: dict[tuple, Any] = {}
_POOLS_LOCK = threading.Lock()


def _pool_for(kind: str, device: Any, nbytes: Any, factory: Callable[[], Any]):
    key = (kind, str(device), nbytes)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = factory()
        return pool


def export_pool(device: Any, nbytes: int = MAX_PLAINTEXT_BYTES) -> HostBufferPool:
    """The process-wide export pool for ``device`` (pinned when it is a CUDA device)."""
    return _pool_for("export", device, nbytes, lambda: HostBufferPool(nbytes, pin=_is_cuda(device)))


def export_spans(
    session, requests: Iterable[tuple[int, str, int, int]], *, depth: int = 8, pool: HostBufferPool | None = None
) -> Iterator[tuple[memoryview, Callable[[], None]]]:
    """Export ``(layer, role, start, stop)`` spans of ``session`` in order, ``depth`` ahead.

    Yields ``(view, release)`` per request: ``view`` is the token-major wire bytes (equal to
    ``session.export_rows(layer, role, start, stop)``), valid until ``release()`` is called.
    Closing the generator early waits for the copies in flight and frees their buffers.
    """
    torch = _torch()
    device = session.engine.device
    cuda = _is_cuda(device)
    pool = pool or export_pool(device)
    depth = max(1, int(depth))
    inflight: deque = deque()

    def ready(item):
        dst, event, buf = item
        if event is not None:
            event.synchronize()
        view = memoryview(dst.numpy()) if dst.numel() else memoryview(b"")
        released = []

        def release() -> None:
            if not released:  # idempotent: a second call must not double-free the buffer
                released.append(True)
                pool.release(buf)

        return view, release

    try:
        for layer, role, start, stop in requests:
            rows = session.export_rows_tensor(layer, role, start, stop)
            n = rows.numel()
            buf = pool.acquire(n)
            dst = buf[:n]
            event = None
            if n:
                with torch.no_grad():
                    dst.copy_(rows, non_blocking=cuda)
            if cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
            inflight.append((dst, event, buf))
            while len(inflight) > depth:
                yield ready(inflight.popleft())
        while inflight:
            yield ready(inflight.popleft())
    finally:
        while inflight:  # closed early: the copies still target these buffers
            dst, event, buf = inflight.popleft()
            if event is not None:
                event.synchronize()
            pool.release(buf)


class StagingSlot:
    """One chunk's worth of restore staging: a (pinned) host buffer and a device buffer."""

    def __init__(self, stager: "RestoreStager") -> None:
        torch = _torch()
        self.stager = stager
        self.host = _host_buffer(stager.host_bytes, stager.cuda)
        self._host_view = memoryview(self.host.numpy())
        self._host_addr = self.host.data_ptr()
        with torch.inference_mode(False):
            self.device_buf = torch.empty(stager.device_bytes, dtype=torch.uint8, device=stager.device)
        # torch is untyped (Any); the events exist exactly when the stager is on CUDA.
        self.uploaded_event: Any = torch.cuda.Event() if stager.cuda else None
        self.done_event: Any = torch.cuda.Event() if stager.cuda else None
        self._done_recorded = False
        self.nbytes = 0
        self.in_place = False

    def _wait_reusable(self) -> None:
        if self._done_recorded:
            self.done_event.synchronize()  # the install's copy out of device_buf has run
            self._done_recorded = False

    def host_region(self) -> memoryview:
        """The (pinned) host buffer as a writable view, for a storage backend to read a chunk
        object into (``StorageEnv.read_into``)."""
        return self._host_view[: self.stager.host_bytes]

    def read_file(self, path: str) -> memoryview | None:
        """Read a whole chunk object file into the host buffer; ``None`` if the file is
        larger than any valid chunk object (the caller reads it normally and the decoder
        refuses it). Raises FileNotFoundError like ``open``."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            if size > self.stager.host_bytes:
                return None
            view = self._host_view
            got = 0
            while got < size:
                n = os.readv(fd, [view[got:size]])
                if n == 0:
                    break  # shrank under us: the decoder sees the short object and refuses
                got += n
            return view[:got]
        finally:
            os.close(fd)

    def upload(self, plaintext) -> None:
        """Start the host-to-device copy of verified ``plaintext`` into ``device_buf``.

        If ``plaintext`` is a view into this slot's host buffer (a raw unencrypted chunk
        decoded in place) it is uploaded from there; otherwise (a decoded copy) it is first
        copied into the host buffer, which the verified object no longer needs."""
        torch = _torch()
        import numpy as np

        arr = np.frombuffer(plaintext, dtype=np.uint8)
        n = arr.nbytes
        if n > self.stager.device_bytes:
            raise EngineError("layout", f"chunk plaintext of {n} bytes exceeds the staging slot")
        addr = arr.ctypes.data if n else 0
        offset = addr - self._host_addr
        self.in_place = n > 0 and 0 <= offset and offset + n <= self.host.numel()
        if self.in_place:
            src = self.host[offset : offset + n]
        else:
            src = self.host[:n]
            if n:
                src.copy_(_frombuffer(arr))
        self.nbytes = n
        if not n:
            return
        if self.stager.cuda:
            stream = self.stager.copy_stream
            with torch.cuda.stream(stream):
                self.device_buf[:n].copy_(src, non_blocking=True)
                self.uploaded_event.record(stream)
        else:
            self.device_buf[:n].copy_(src)

    def rows(self, offset: int, nbytes: int):
        """Bytes ``[offset, offset + nbytes)`` of the uploaded plaintext as a flat uint8 tensor
        on the device; the current stream is made to wait for the upload first."""
        torch = _torch()
        if not 0 <= offset <= offset + nbytes <= self.nbytes:
            raise EngineError("layout", f"staged rows [{offset}, {offset + nbytes}) outside [0, {self.nbytes})")
        if self.stager.cuda:
            torch.cuda.current_stream(self.stager.device).wait_event(self.uploaded_event)
        return self.device_buf[offset : offset + nbytes]

    def release(self) -> None:
        """Give the slot back; it is reused once the work queued on the current stream so far
        (the install's copy out of ``device_buf``) has run."""
        torch = _torch()
        if self.stager.cuda:
            self.done_event.record(torch.cuda.current_stream(self.stager.device))
            self._done_recorded = True
        self.nbytes = 0
        self.stager._release(self)


class RestoreStager:
    """A pool of :class:`StagingSlot` for one device; ``acquire`` blocks while all are taken.

    Thread-safe: store workers ``acquire``, ``read_file``, verify and ``upload``; the thread
    that installs calls ``rows`` and ``release``."""

    def __init__(self, device: Any, *, slots: int, host_bytes: int = MAX_OBJECT_BYTES, device_bytes: int = MAX_PLAINTEXT_BYTES) -> None:
        torch = _torch()
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.host_bytes = host_bytes
        self.device_bytes = device_bytes
        self.copy_stream: Any = torch.cuda.Stream(self.device) if self.cuda else None
        self._free: queue.LifoQueue = queue.LifoQueue()
        self._lock = threading.Lock()
        self.slots = 0
        self.grow(slots)

    def grow(self, slots: int) -> None:
        with self._lock:
            while self.slots < slots:
                self._free.put(StagingSlot(self))
                self.slots += 1

    @property
    def idle(self) -> int:
        return self._free.qsize()

    def acquire(self) -> StagingSlot:
        slot = self._free.get()
        slot._wait_reusable()
        return slot

    def _release(self, slot: StagingSlot) -> None:
        self._free.put(slot)

    def synchronize(self) -> None:
        """Wait until every slot's queued work has run (e.g. before freeing the planes)."""
        if self.cuda:
            self.copy_stream.synchronize()


#: Bytes of one chunk-object slot in a plane's staging buffer (4096-aligned).
SLOT_BYTES = -(-MAX_OBJECT_BYTES // 4096) * 4096


class PlaneStager:
    """Restore staging by whole planes (the default on CUDA installs).

    For one (layer, role) state the store's workers read each chunk object file into its own
    slot of one pinned host buffer, verify it *there* (a raw chunk's plaintext is a view into
    the slot: hashed in place, never copied by the CPU) and queue a host-to-device copy of
    the needed rows into one device buffer for the plane. Once every chunk of the plane is
    verified, the plane is installed with a single transposing copy. Each byte thus leaves
    the page cache once, is hashed twice in place and crosses PCIe once; device calls per
    chunk are a slice and a copy.

    Host buffers are pooled by size (pinning memory is slow) and reused only after the copies
    that read them have run (one event per buffer)."""

    def __init__(self, device: Any) -> None:
        torch = _torch()
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.copy_stream: Any = torch.cuda.Stream(self.device) if self.cuda else None
        self._free: dict[int, list] = {}
        self._lock = threading.Lock()

    def host_slots(self, count: int):
        """A host buffer of ``count`` object slots (pinned on CUDA) and its numpy view."""
        nbytes = count * SLOT_BYTES
        with self._lock:
            free = self._free.get(nbytes)
            item = free.pop() if free else None
        if item is None:
            buf = _host_buffer(nbytes, self.cuda)
            event = _torch().cuda.Event() if self.cuda else None
            item = [buf, event, False]
        buf, event, recorded = item
        if recorded:
            event.synchronize()  # the copies that last read this buffer have run
            item[2] = False
        return item, buf.numpy()

    def device_plane(self, nbytes: int):
        """The device buffer a plane's rows are gathered into (flat uint8)."""
        torch = _torch()
        with torch.inference_mode(False):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_rows(self, item, plaintext, start: int, nbytes: int, dev, dev_offset: int) -> None:
        """Queue the copy of ``plaintext[start:start+nbytes]`` to ``dev[dev_offset:]``.

        A view into this item's (pinned) buffer is copied asynchronously on the copy stream;
        a decoded copy (lossless or encrypted chunk) is copied synchronously."""
        import numpy as np

        torch = _torch()
        if nbytes == 0:
            return
        arr = np.frombuffer(plaintext, dtype=np.uint8)[start : start + nbytes]
        host = item[0]
        offset = arr.__array_interface__["data"][0] - host.data_ptr()
        target = dev[dev_offset : dev_offset + nbytes]
        if 0 <= offset and offset + nbytes <= host.numel():
            src, pinned = host[offset : offset + nbytes], True
        else:
            src, pinned = _frombuffer(arr), False
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                target.copy_(src, non_blocking=pinned)
        else:
            target.copy_(src)

    def finish(self, item, dev):
        """All copies of a plane are queued: make the current stream wait for them and mark
        the host buffer as in use until they have run. Returns ``dev``."""
        torch = _torch()
        if self.cuda:
            item[1].record(self.copy_stream)
            item[2] = True
            current = torch.cuda.current_stream(self.device)
            current.wait_event(item[1])
            dev.record_stream(current)
        return dev

    def release(self, item) -> None:
        """Return a host buffer to the pool (reuse waits for its copies, see ``finish``)."""
        with self._lock:
            self._free.setdefault(item[0].numel(), []).append(item)


def plane_stager(device: Any) -> PlaneStager:
    """The process-wide plane stager for ``device`` (kept: its pinned buffers are reused)."""
    return _pool_for("planes", device, 0, lambda: PlaneStager(device))


def restore_stager(device: Any, slots: int) -> RestoreStager:
    """The process-wide stager for ``device`` with at least ``slots`` slots (kept for reuse:
    pinning memory is slow, and a restore needs it again)."""
    stager = _pool_for("restore", device, MAX_OBJECT_BYTES, lambda: RestoreStager(device, slots=slots))
    stager.grow(slots)
    return stager


__all__ = [
    "HostBufferPool",
    "PlaneStager",
    "plane_stager",
    "RestoreStager",
    "StagingSlot",
    "export_pool",
    "export_spans",
    "restore_stager",
]
