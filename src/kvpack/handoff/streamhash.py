"""Hashing a segment payload while it is still arriving (receiver side, C.6 / C.8 step 5).

A segment costs the receiver two SHA-256 passes over its payload: the segment's own digest
(checked against its descriptor) and the running payload digest (over all payload bytes in
wire order). Run after the whole payload has been read, they serialise with reading it
(TLS decryption): a stream then moves at about 1 / (1/decrypt + 1/hash). A
:class:`PayloadStream` instead takes each completed range of the payload buffer as the
driver reports it and hashes it off the receiving thread, so the next ``recv_into`` (and
its decryption) overlaps the hashing of the bytes before it:

* two *lanes*, one per digest, each hashing the buffer strictly front to back; a lane runs
  on the driver's executor (:mod:`.hashing`) only while it has work, hashes everything
  reported since its last update in one call (so a lane that falls behind catches up in
  large updates), and with a thread pool the two lanes run concurrently, so the two passes
  cost one hash of wall time (with the default inline executor each range is hashed on the
  receiving thread as it is reported: the same digests, no overlap);
* hashlib releases the GIL for large updates, so the receiving thread keeps reading;
* :meth:`PayloadStream.digest` waits for both lanes, so once it returns nothing reads the
  payload buffer any more and the decoder may reuse it for the next frame;
* the running digest is continued from a *copy* of the accumulator's hash, so the
  accumulator changes only when the receiver adopts it, at the very step where it fed the
  running digest before (the protocol's order of checks and their effects do not change).

The payload may also be a :class:`~.target.PayloadTarget` (read straight into a sink's
destination pieces): the lanes then hash the same byte ranges piece by piece.

Nothing here touches sockets or starts threads: the receiver state machine feeds it offsets
of its own buffer, and the executor is a parameter.

It must never let a lane read the buffer after :meth:`PayloadStream.digest` returned or the
stream was cancelled.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Optional

from .hashing import INLINE
from .target import PayloadTarget

if TYPE_CHECKING:
    from hashlib import _Hash


class _Lane:
    """Feeds ``view[:target]`` into one hash, in order, on at most one executor thread at a time.

    The driver only moves ``target`` forward; a drain hashes everything between what it
    already hashed and the current target as one slice, so a lane that falls behind (a
    fast source) catches up in large updates instead of paying a hand-off per range.
    """

    __slots__ = ("_hash", "_view", "_executor", "_lock", "_done", "_target", "_busy", "_idle", "_error", "_cancelled")

    def __init__(self, h: _Hash, view: PayloadTarget, executor: Executor) -> None:
        self._hash = h
        self._view = view
        self._executor = executor
        self._lock = threading.Lock()
        self._done = 0  # bytes hashed (written by the draining thread only)
        self._target = 0
        self._busy = False
        self._idle = threading.Event()
        self._idle.set()
        self._error: Optional[BaseException] = None
        self._cancelled = False

    def advance_to(self, stop: int) -> None:
        with self._lock:
            if self._cancelled or stop <= self._target:
                return
            self._target = stop
            if self._busy:
                return  # the running drain picks it up
            self._busy = True
            self._idle.clear()
        try:
            self._executor.submit(self._drain)
        except BaseException:
            with self._lock:
                self._cancelled = True
                self._busy = False
                self._idle.set()
            raise

    def _drain(self) -> None:
        update = self._hash.update
        view = self._view
        single = view.pieces[0] if len(view.pieces) == 1 else None
        while True:
            with self._lock:
                a, b = self._done, self._target
                if self._cancelled or self._error is not None or a >= b:
                    self._busy = False
                    self._idle.set()
                    return
            try:
                if single is not None:
                    update(single[a:b])
                else:
                    for piece in view.slices(a, b):
                        update(piece)
            except BaseException as exc:  # reported by wait(); the stream is then unusable
                self._error = exc
            self._done = b

    def wait(self) -> None:
        self._idle.wait()
        if self._error is not None:
            raise self._error
        if self._cancelled:
            raise RuntimeError("hash lane cancelled")

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True


class PayloadStream:
    """The two digests of one segment payload, fed range by range as it arrives.

    ``view`` is the whole payload buffer or target (filled front to back by the driver);
    ``running`` is the accumulator's running payload hash, which is copied, never updated.
    Call :meth:`feed` with the number of bytes filled so far (it hashes only complete
    ranges of at least ``chunk`` bytes unless ``final``), then :meth:`digest` once the
    payload is complete. The buffer must not be overwritten before :meth:`digest` returned
    (or the stream was cancelled and is no longer used).
    """

    __slots__ = ("view", "chunk", "segment_hash", "running_hash", "fed", "filled", "_lanes", "_done")

    def __init__(self, view: "memoryview | PayloadTarget", running: _Hash, chunk: int, executor: Executor = INLINE) -> None:
        if chunk < 1:
            raise ValueError("chunk must be positive")
        self.view = view
        pieces = PayloadTarget.of(view)
        self.chunk = chunk
        self.segment_hash = hashlib.sha256()
        self.running_hash = running.copy()
        self.fed = 0  # bytes of view handed to the lanes
        self.filled = 0  # bytes of view the driver reported filled
        self._lanes = (_Lane(self.segment_hash, pieces, executor), _Lane(self.running_hash, pieces, executor))
        self._done = False

    def room(self) -> int:
        """How many bytes the driver should fill before reporting again (up to the next
        chunk boundary), so hashing starts while the rest of the payload is in flight."""
        return max(1, self.fed + self.chunk - self.filled)

    def feed(self, filled: int, *, final: bool = False) -> None:
        """``filled`` bytes of the payload are in: queue ``[fed, filled)`` if it is at least
        one chunk (or ``final``)."""
        if filled > self.view.nbytes or filled < self.filled:
            raise ValueError("payload progress out of range")
        self.filled = filled
        if filled - self.fed >= self.chunk or (final and filled > self.fed):
            self.fed = filled
            for lane in self._lanes:
                lane.advance_to(filled)

    def digest(self) -> str:
        """Queue the rest, wait for both lanes and return the segment's SHA-256 (hex).

        After this returns no lane reads the payload buffer any more; ``running_hash`` then
        covers the running digest's earlier bytes plus this whole payload.
        """
        if not self._done:
            self.feed(self.view.nbytes, final=True)
            if self.fed != self.view.nbytes:  # pragma: no cover - feed covers it
                raise ValueError("payload incomplete")
            for lane in self._lanes:
                lane.wait()
            self._done = True
        return self.segment_hash.hexdigest()

    def cancel(self) -> None:
        """Drop queued ranges (a refusal or abort); a range already being hashed finishes on
        its executor thread, reading a buffer the closed receiver will not write again."""
        for lane in self._lanes:
            lane.cancel()
