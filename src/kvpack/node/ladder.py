"""The reuse ladder of a node (seed 000 §26.4): live session, resident, durable, remote.

Before a decode node asks a producer to prefill a prompt it looks for KV it already holds:

1. **live** -- the node's live session, as far as its tokens were computed by prefill or
   installed (decoded continuation tokens are excluded: a cut reached one decode step at a
   time is not what a chunked prefill computes, docs/engine.md "History");
2. **resident** -- :class:`ResidentRadix`, an in-memory token radix of recently installed
   prompt prefixes, scoped by the engine's exact identity digest and bounded in bytes;
3. **durable** -- the node's :class:`~kvpack.store.PackStore` (``find_deepest_healing``);
4. **remote** -- the producer (a full or delta handoff).

:func:`kvpack.handoff.delta.classify_reuse` decides what a match is worth: a hit reaching
``prompt - 1`` serves locally (the receiver decodes the held-back boundary token itself); a
non-zero 256-aligned strict prefix from a *fetched* tier (resident, durable) **arms a delta**
(``prefix_cut``); anything else is a full transfer. Arming is a proposal: the producer may
still send a full transfer, and admission (``validate_prefix_cut``) re-verifies the held
tokens against the begin manifest before a single row is used.

A :class:`HeldPrefix` is what an armed delta (or a local serve) installs from: the held
token ids and a source with ``export_rows(layer, role, start, stop)``. The producer uses the
same radix and store to skip recomputing a prefix it has prefilled before, so its receipt's
``prefill_tokens`` counts only the suffix.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..errors import StoreError
from ..handoff.delta import ReuseAction, classify_reuse
from ..vocab import TOKEN_ALIGN, align_tokens_down, is_token_aligned

BLOCK = TOKEN_ALIGN


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in 256-token blocks first (tuple equality runs in C), then token by token.
    while i + BLOCK <= n and tuple(a[i : i + BLOCK]) == tuple(b[i : i + BLOCK]):
        i += BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i


def window_covers(layout, held_position: int, cut: int) -> bool:
    """Whether a cache at ``held_position`` still holds every row an install at ``cut``
    needs: always for full-attention layers (``cut <= held_position``); for a windowed
    layer the window ending at ``cut`` must not have slid out, which holds only when the
    held cache is no deeper than the window or ends exactly at the cut."""
    if not 0 < cut <= held_position:
        return False
    return all(layout.retained_range(s.index, held_position)[0] <= layout.retained_range(s.index, cut)[0] for s in layout.layers)


class _Parts:
    """One plane held as consecutive buffers by reference (a producer job's session whose
    prefix was lent by an earlier entry): a range inside one buffer is a view, a range
    across two is joined (a copy of that range only)."""

    __slots__ = ("parts", "offsets", "nbytes")

    def __init__(self, parts: list[memoryview]) -> None:
        self.parts = [p.toreadonly() for p in parts]
        self.offsets = []
        at = 0
        for p in self.parts:
            self.offsets.append(at)
            at += p.nbytes
        self.nbytes = at

    def __len__(self) -> int:
        return self.nbytes

    def slice(self, a: int, b: int) -> memoryview:
        pieces = []
        for off, p in zip(self.offsets, self.parts):
            lo, hi = max(a, off), min(b, off + p.nbytes)
            if lo < hi:
                pieces.append(p[lo - off : hi - off])
        if len(pieces) == 1:
            return pieces[0]
        return memoryview(b"".join(pieces))


class RowsSource:
    """The rows a session held at ``position`` for every ``(layer, role)`` plane, as bytes
    (a resident entry): ``[0, n)`` of full layers, the window ending at ``n`` of windowed
    ones (:meth:`retained_range`).

    Its rows never change (bytes, or views of a session nobody touches again): an install
    may take them by reference (``rows_immutable``, see :func:`kvpack.node.wire.copy_prefix`)."""

    rows_immutable = True

    def __init__(self, tokens: Sequence[int], planes: dict, row_bytes: dict, lows: Optional[dict] = None, layout=None) -> None:
        self.tokens = tuple(int(t) for t in tokens)
        self.planes = planes
        self.row_bytes = row_bytes
        self.lows = lows or {}
        self.layout = layout
        self.nbytes = sum(len(p) for p in planes.values())

    @property
    def position(self) -> int:
        return len(self.tokens)

    def retained_range(self, layer: int) -> tuple[int, int]:
        return self.lows.get(layer, 0), len(self.tokens)

    def covers(self, cut: int) -> bool:
        """An install at ``cut`` can take every row it needs before the cut from here."""
        return self.layout is None or window_covers(self.layout, self.position, cut)

    def export_rows(self, layer: int, role: str, start: int, stop: int) -> memoryview:
        lo = self.lows.get(layer, 0)
        if not lo <= start <= stop <= len(self.tokens):
            raise ValueError(f"rows [{start}, {stop}) outside the held [{lo}, {len(self.tokens)})")
        rb = self.row_bytes[layer]
        plane = self.planes[(layer, role)]
        if isinstance(plane, _Parts):
            return plane.slice((start - lo) * rb, (stop - lo) * rb)
        return memoryview(plane)[(start - lo) * rb : (stop - lo) * rb]

    @classmethod
    def capture(cls, session, n: int, *, last_use: bool = False) -> "RowsSource":
        """Copy the rows a cache at ``n`` holds out of a session: ``[0, n)`` of full layers
        (any ``n <= position``), the window ending at ``n`` of windowed layers (still held by
        the session only while it is at ``n``, or ``n`` lies within the first window).

        ``last_use``: the caller never touches ``session`` again (a producer job's session
        after its answer). A session whose ``export_rows`` views are never rewritten
        (``export_rows_stable``: the arrays engine) is then taken by reference -- no copy
        of the whole prompt into the resident tier; any other session is copied."""
        layout = session.layout
        keep_views = last_use and bool(getattr(session, "export_rows_stable", False))
        parts_of = getattr(session, "export_row_parts", None) if keep_views else None
        planes: dict = {}
        lows = {}
        for spec in layout.layers:
            lows[spec.index] = lo = layout.retained_range(spec.index, n)[0]
            for role in sorted(layout.roles):
                if parts_of is not None:
                    parts = parts_of(spec.index, role, lo, n)
                    planes[(spec.index, role)] = _Parts(parts) if len(parts) > 1 else (parts[0].toreadonly() if parts else b"")
                    continue
                rows = session.export_rows(spec.index, role, lo, n)
                planes[(spec.index, role)] = rows.toreadonly() if keep_views else bytes(rows)
        return cls(session.tokens[:n], planes, {s.index: s.row_bytes for s in layout.layers}, lows, layout)


@dataclass
class HeldPrefix:
    """KV a node holds for a prompt prefix: ``tokens`` and a source of their rows."""

    tier: str
    tokens: tuple[int, ...]
    source: Any  # export_rows(layer, role, start, stop); a durable hit: (hit, tokens)
    restore_s: float = 0.0

    @property
    def matched(self) -> int:
        return len(self.tokens)


class _Node:
    __slots__ = ("children", "entry")

    def __init__(self) -> None:
        self.children: dict[tuple, _Node] = {}
        self.entry: Optional[RowsSource] = None


class ResidentRadix:
    """In-memory radix of installed prompt prefixes, one tree per engine identity.

    Edges are 256-token blocks (the delta alignment), so every node is an armable cut; each
    node points at the most recent entry covering it. An entry also answers exact matches on
    its full length (for ``serve_local``). Entries are evicted least-recently-used once
    ``max_bytes`` is exceeded.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._entries: "OrderedDict[tuple, RowsSource]" = OrderedDict()  # (identity, tokens) -> entry
        self._roots: dict[bytes, _Node] = {}
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def insert(self, identity: bytes, entry: RowsSource) -> None:
        with self._lock:
            key = (identity, entry.tokens)
            self._entries.pop(key, None)
            self._entries[key] = entry
            while len(self._entries) > 1 and self.nbytes > self.max_bytes:
                self._entries.popitem(last=False)
            self._rebuild()

    def _rebuild(self) -> None:
        self._roots = {}
        for (identity, tokens), entry in self._entries.items():  # oldest first: newest wins
            node = self._roots.setdefault(identity, _Node())
            for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
                node = node.children.setdefault(tokens[i : i + BLOCK], _Node())
                node.entry = entry

    def lookup(self, identity: bytes, tokens: Sequence[int]) -> Optional[HeldPrefix]:
        """The deepest held prefix of ``tokens``: an exact entry covering ``len-1`` tokens, or
        the deepest 256-aligned node."""
        tokens = tuple(int(t) for t in tokens)
        with self._lock:
            best: Optional[HeldPrefix] = None
            want = len(tokens) - 1
            for (ident, etoks), entry in reversed(self._entries.items()):
                # Only where a prefill of exactly ``want`` tokens computes the same rows: the
                # entry ends there, or ``want`` is a chunk boundary (prefill chunks are
                # absolute multiples of 256, so rows past a boundary depend on where the
                # computing call ended; docs/engine.md "Determinism").
                if ident == identity and len(etoks) >= want > 0 and etoks[:want] == tokens[:want] and (len(etoks) == want or is_token_aligned(want)):
                    if not entry.covers(want):  # a windowed entry deeper than the cut
                        continue
                    self._entries.move_to_end((ident, etoks))
                    return HeldPrefix("resident", tokens[:want], entry)
            node = self._roots.get(identity)
            depth = 0
            while node is not None:
                child = node.children.get(tokens[depth : depth + BLOCK]) if depth + BLOCK <= len(tokens) else None
                if child is None:
                    break
                node, depth = child, depth + BLOCK
                if node.entry is not None and node.entry.covers(depth):
                    best = HeldPrefix("resident", tokens[:depth], node.entry)
            if best is None or best.matched < depth:
                # The newest entry of a node may be a windowed one that no longer holds the
                # window at that depth while an older one (ending there) does.
                best = self._covering(identity, tokens, depth, best)
            return best

    def _covering(self, identity: bytes, tokens: tuple[int, ...], depth: int, best: Optional[HeldPrefix]) -> Optional[HeldPrefix]:
        floor = 0 if best is None else best.matched
        for d in range(depth, floor, -BLOCK):
            for (ident, etoks), entry in reversed(self._entries.items()):
                if ident == identity and len(etoks) >= d and etoks[:d] == tokens[:d] and entry.covers(d):
                    return HeldPrefix("resident", tokens[:d], entry)
        return best


@dataclass
class Plan:
    """What the ladder decided for one prompt."""

    action: ReuseAction
    tier: str  # tier of the held prefix ("none" when nothing matched)
    matched: int
    held: Optional[HeldPrefix]
    lookup_s: float

    @property
    def prefix_cut(self) -> int:
        return self.matched if self.action is ReuseAction.ARM_DELTA else 0

    def to_json(self) -> dict:
        return {"action": self.action.value, "tier": self.tier, "matched": self.matched, "prefix_cut": self.prefix_cut, "lookup_s": round(self.lookup_s, 6)}


class DurableMiss(StoreError):
    """The durable tier's cut failed verification: it was quarantined (``receipt``) and is a
    miss. The caller plans again (the store no longer offers it) and recomputes."""

    def __init__(self, receipt: dict | None) -> None:
        super().__init__("miss", "stored cut failed verification and was quarantined")
        self.receipt = receipt


class Ladder:
    """Decode-node reuse ladder over (live, resident, durable); remote is the fallback."""

    def __init__(self, engine, resident: ResidentRadix, store=None) -> None:
        self.engine = engine
        self.identity = engine.identity.ids().digest()
        self.resident = resident
        self.store = store

    def plan(self, tokens: Sequence[int], live_session=None, live_prefilled: int = 0, *, durable: bool = True) -> Plan:
        """The cheapest way to the prompt; ``durable=False`` leaves the store out (its
        storage just failed a restore: the request recomputes instead of trying it again)."""
        t0 = time.perf_counter()
        tokens = [int(t) for t in tokens]
        p = len(tokens)
        candidates: list[HeldPrefix] = []
        if live_session is not None and live_prefilled:
            m = common_prefix(live_session.tokens[:live_prefilled], tokens)
            if m != live_prefilled:  # same rule as the resident exact match
                m = align_tokens_down(m)
            if m:
                candidates.append(HeldPrefix("live", tuple(tokens[:m]), live_session))
        res = self.resident.lookup(self.identity, tokens)
        if res is not None:
            candidates.append(res)
        if self.store is not None and durable:
            # index entries passed over as damaged are quarantined on the way (a receipt each)
            hit = self.store.find_deepest_healing(tokens, self.engine.layout, self.engine.identity.ids())
            if hit is not None:
                candidates.append(HeldPrefix("durable", tuple(tokens[: hit.cut]), (hit, tuple(tokens[: hit.cut]))))
        # 1. anything reaching prompt-1 serves locally (live first: it costs nothing)
        for c in candidates:
            if classify_reuse(c.matched, p, c.tier) is ReuseAction.SERVE_LOCAL and self._holds(c, min(c.matched, p - 1)):
                return Plan(ReuseAction.SERVE_LOCAL, c.tier, c.matched, c, time.perf_counter() - t0)
        # 2. the deepest aligned prefix of a fetched tier arms a delta
        best: Optional[Plan] = None
        for c in candidates:
            if c.tier == "live":
                continue
            aligned = align_tokens_down(c.matched)
            if aligned and classify_reuse(aligned, p, c.tier) is ReuseAction.ARM_DELTA and self._holds(c, aligned):
                if best is None or aligned > best.matched:
                    held = HeldPrefix(c.tier, tuple(tokens[:aligned]), c.source)
                    best = Plan(ReuseAction.ARM_DELTA, c.tier, aligned, held, 0.0)
        if best is not None:
            best.lookup_s = time.perf_counter() - t0
            return best
        return Plan(ReuseAction.FULL_TRANSFER, "none", 0, None, time.perf_counter() - t0)

    def _holds(self, c: HeldPrefix, cut: int) -> bool:
        """The candidate still holds every row an install at ``cut`` needs (windowed layers:
        the window ending at the cut; see :func:`window_covers`)."""
        if c.tier == "durable":
            assert isinstance(c.source, tuple)  # (hit, tokens): restored exactly at hit.cut
            position = c.source[0].cut
        else:
            position = c.source.position  # a live session or a RowsSource
        return window_covers(self.engine.layout, position, cut)

    def materialize(self, held: HeldPrefix):
        """A row source for ``held``: durable hits are restored (verified) into a scratch
        session first; other tiers already are one."""
        if held.tier != "durable":
            return held.source
        if isinstance(held.source, tuple) and held.source[0] == "restored":
            return held.source[1]  # already restored (verified) by the receiver
        t0 = time.perf_counter()
        scratch = self.engine.new_session()
        # a durable hit's source is the (hit, tokens) pair its restore needs (see ``plan``)
        assert isinstance(held.source, tuple)
        hit, hit_tokens = held.source
        self.restore_durable(hit, scratch, list(hit_tokens))
        held.restore_s = time.perf_counter() - t0
        return scratch

    def restore_durable(self, hit, session, tokens) -> None:
        """Restore a durable hit verified; a cut that fails verification is quarantined by
        the store and raises :class:`DurableMiss` (the live session is untouched)."""
        report, receipt = self.store.restore_healing(hit, session, tokens)
        if report is None:
            raise DurableMiss(receipt)
