"""A segment payload read straight into its destination (receiver side, scatter-gather).

Why it exists: a decode node's install keeps a tile's bytes in several places -- a segment
of the arrays engine is 64 contiguous plane pieces, one per ``(layer, role)``. Reading the
payload into one staging buffer and copying it into those pieces afterwards costs a copy
of the whole cache (and, on fresh install memory, its first-touch page faults) on the
receiving side. A :class:`PayloadTarget` lists the destination pieces; the frame decoder
hands them out to ``recv_into`` in order, and the hash lanes read them from there.

What stays the same: the bytes are checked exactly as before -- the segment digest against
its descriptor, the running payload digest, the seal -- before the sink counts a single row
as written. The pieces belong to a *detached* install that only ``commit`` publishes, so
bytes that fail a check were written where nothing reads them, and the refusal aborts the
install (its planes are released with it). A sink hands out a target only after the
receiver's admission checks passed for that segment (state, sequence, descriptor,
schedule slot, length): a peer's declared length never picks the destination.

Nothing here touches sockets or threads: plain bookkeeping over ``memoryview`` pieces.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence


class PayloadTarget:
    """Writable destination pieces of one payload, filled front to back.

    ``token`` is the sink's own handle (e.g. the descriptor it was made for), returned to
    the sink with the verified segment so it can count the rows as written.
    """

    __slots__ = ("pieces", "offsets", "nbytes", "token")

    def __init__(self, pieces: Sequence[memoryview], token: object = None) -> None:
        out = []
        offsets = []
        total = 0
        for piece in pieces:
            view = memoryview(piece)
            view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            if not view.nbytes:
                continue
            offsets.append(total)
            out.append(view)
            total += view.nbytes
        self.pieces: tuple[memoryview, ...] = tuple(out)
        self.offsets: tuple[int, ...] = tuple(offsets)
        self.nbytes = total
        self.token = token

    @classmethod
    def of(cls, view: "memoryview | PayloadTarget") -> "PayloadTarget":
        """A target over one contiguous buffer (or the target itself)."""
        return view if isinstance(view, PayloadTarget) else cls((view,))

    def remaining(self, filled: int) -> memoryview:
        """The rest of the piece that byte ``filled`` falls in (empty once full)."""
        if filled >= self.nbytes:
            return memoryview(b"")
        i = bisect_right(self.offsets, filled) - 1
        return self.pieces[i][filled - self.offsets[i] :]

    def slices(self, start: int, stop: int) -> Iterator[memoryview]:
        """The bytes ``[start, stop)`` as views of the pieces, in order."""
        if start >= stop:
            return
        i = bisect_right(self.offsets, start) - 1
        while start < stop and i < len(self.pieces):
            base = self.offsets[i]
            piece = self.pieces[i]
            end = min(stop, base + piece.nbytes)
            yield piece[start - base : end - base]
            start = end
            i += 1

    def tobytes(self) -> bytes:
        return b"".join(p.tobytes() for p in self.pieces)


__all__ = ["PayloadTarget"]
