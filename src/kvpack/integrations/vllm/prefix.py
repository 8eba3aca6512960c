"""The verified prefix store behind the vLLM connector: what to load, what to save, and the
two store operations, with no vLLM types in sight (the connector translates).

Scheduler side (:class:`PrefixPlanner`): for a new request, find the deepest stored prefix
cut of its prompt under this engine's exact identity, check the cut's pack chain (manifests
authenticated and linked) and that every chunk file it needs is present with its recorded
size, and plan to load rows ``[local, hi)``: ``local`` is what vLLM already holds (block
aligned), ``hi`` the cut clipped so vLLM still computes the prompt's last token (vLLM needs
one computed token to sample from; its scheduler takes a load ending inside a block). Saves
are planned at every multiple of 256 up to the prompt's last one that is not stored yet, so a
later prompt sharing any 256-aligned prefix finds it, plus a final *tail cut* of the prompt
minus its last token, so the same prompt again computes one token, not up to 256 (each cut a
delta on the previous 256-aligned one: the keyed prefix chain indexes each cut; the tail cut
is the chain's final node, found only by a prompt of exactly one more token that shares it).

Worker side: :func:`load_prefix` verifies every byte of the planned chunks (PackStore's healing
restore: pack chain, object digests, AEAD, frames, content ids, the prefix marker; a cut
failing verification is quarantined) into a staging buffer and only then scatters the rows
into vLLM's blocks; :func:`capture` copies the rows to
save out of the blocks (so vLLM may reuse them at once) and :func:`publish` writes the cuts
(PackStore.save, ``prefix_only``).

Never: write a block before the whole load verified; let a refusal escape as anything but a
typed error (the connector turns it into a miss); keep a reference into vLLM's blocks after
:func:`capture` returns.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...engine.contract import CacheLayout, IdentityIds
from ...errors import EngineError, KvpackError, StoreError
from ...format.constants import PREFIX_BLOCK_TOKENS
from ...store.mapping import semantic_id
from ...store.packstore import Hit, PackStore, RestoreReport, SaveReport, chunk_name
from .paged import BlockStaging, PagedKV

#: prefix cuts are 256-aligned: the keyed prefix chain's reusable nodes (production-v1)
CUT_TOKENS = PREFIX_BLOCK_TOKENS


@dataclass(frozen=True)
class LoadSpec:
    """Load rows ``[lo, hi)`` of the stored cut into the request's blocks."""

    req_id: str
    tokens: tuple[int, ...]  # the prompt up to the cut: the restore re-derives the chain from it
    manifest_id: bytes
    node_id: bytes
    cut: int
    lo: int
    hi: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SaveSpec:
    """Publish the ``cuts`` (ascending: 256-aligned ones, then maybe the tail cut) of the
    request's prompt."""

    req_id: str
    tokens: tuple[int, ...]  # the prompt up to the deepest cut
    cuts: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass
class LoadPlan:
    """What a lookup found: ``stored`` is the deepest stored cut (even when nothing is loaded)."""

    stored: int
    hit: Hit | None = None
    lo: int = 0
    hi: int = 0
    refusals: list[str] = field(default_factory=list)  # stored cuts that failed the checks (quarantined)

    @property
    def tokens_to_load(self) -> int:
        return max(0, self.hi - self.lo)


def tail_cut(prompt_len: int) -> int | None:
    """The prompt minus its last token, when that is not already a 256-aligned cut (nor
    covered by the cut at ``prompt_len`` itself, which a load clips to the same rows)."""
    return prompt_len - 1 if prompt_len % CUT_TOKENS not in (0, 1) else None


def save_cuts(prompt_len: int, stored: int) -> tuple[int, ...]:
    """The cuts of a prompt not yet stored (deepest stored cut ``stored``), ascending: each
    multiple of 256 and the tail cut (:func:`tail_cut`)."""
    top = prompt_len - prompt_len % CUT_TOKENS
    cuts = list(range(stored - stored % CUT_TOKENS + CUT_TOKENS, top + 1, CUT_TOKENS))
    tail = tail_cut(prompt_len)
    if tail is not None and tail > stored:
        cuts.append(tail)  # above every 256-aligned cut of the prompt (prompt_len % 256 >= 2)
    return tuple(cuts)


class PrefixPlanner:
    """Scheduler-side lookups (cheap: the index, the authenticated packs, file sizes)."""

    def __init__(self, store: PackStore, layout: CacheLayout, ids: IdentityIds, block_size: int) -> None:
        if block_size <= 0:
            raise EngineError("layout", "block size must be positive")
        self.store = store
        self.layout = layout
        self.ids = ids
        self.block_size = block_size
        self._ctx = store.context(layout, ids)

    def lookup(self, prompt: Sequence[int], local: int, max_attempts: int = 6) -> LoadPlan:
        """Plan the load for a prompt of which vLLM already holds ``local`` tokens.

        A stored cut that fails the checks is quarantined (kvpack.store.maintenance: a receipt,
        the index entry removed, objects wrong for their own name deleted) and the next
        shallower cut is tried, like the store's own healing lookup; what is not loaded is
        computed by vLLM and saved again."""
        limit = len(prompt) - 1  # vLLM computes the last token (it samples from its logits)
        refusals: list[str] = []
        for _ in range(max_attempts):
            hit = self._deepest(prompt)
            if hit is None:
                break
            plan = LoadPlan(stored=hit.cut, refusals=refusals)
            hi = min(hit.cut, limit)
            if hi <= local:
                return plan  # nothing beyond what vLLM holds
            try:
                self._check(hit, local, hi)
            except (StoreError, EngineError, OSError) as exc:
                refusals.append(refusal_reason(exc))
                if not self._quarantine(hit, exc):
                    break
                continue
            plan.hit, plan.lo, plan.hi = hit, local, hi
            return plan
        return LoadPlan(stored=0, refusals=refusals)

    def _deepest(self, prompt: Sequence[int]) -> Hit | None:
        """The stored cut covering most of ``prompt[:-1]``: the tail cut of this very prompt
        (the chain's final node at ``len - 1``) or the deepest 256-aligned cut, which may lie
        at ``len`` itself (saved by a longer prompt; the load clips it)."""
        find = self.store.find_deepest_healing  # damaged entries it passes over are quarantined
        best = find(prompt[:-1], self.layout, self.ids, require_logits=False) if len(prompt) > 1 else None
        if best is not None and best.cut == len(prompt) - 1:
            return best
        whole = find(prompt, self.layout, self.ids, require_logits=False)
        if whole is not None and (best is None or min(whole.cut, len(prompt) - 1) > best.cut):
            return whole
        return best

    def _quarantine(self, hit: Hit, exc: BaseException) -> bool:
        """Take a cut that failed its checks out of the index; False if it is still there."""
        from ...store.maintenance import quarantine_after_refusal

        if not isinstance(exc, StoreError) or exc.category not in ("corrupt", "incomplete"):
            return False
        try:
            receipt = quarantine_after_refusal(self.store, hit, exc)
        except Exception:  # noqa: BLE001 - quarantine is best effort; the cut is a miss either way
            return False
        return bool(receipt and receipt.get("index_entry_removed"))

    def _check(self, hit: Hit, lo: int, hi: int) -> None:
        chain = self.store.load_chain(hit.manifest_id)  # every pack authenticated, parents linked
        top = chain[0]
        if top.cut.token_root != hit.node_id or top.cut.token_count != hit.cut:
            raise StoreError("corrupt", "stored cut does not match its index entry")
        if top.family != self._ctx.family or top.semantic != semantic_id(self.ids):
            raise StoreError("miss", "stored cut was written under another identity")
        for manifest in chain:
            for _key, span, ref in manifest.chunk_refs():
                if span.token_start >= hi or span.token_start + span.token_count <= lo:
                    continue
                # through the store's environment: a path of an S3 store is no file (os.stat
                # of it made every healthy cut "incomplete", and the planner quarantined it)
                info = self.store.env.stat(chunk_name(ref.content_id))
                if info is None:
                    raise StoreError("incomplete", f"chunk {ref.content_id.hex()} is missing")
                size = info.size
                if size != ref.object_bytes:
                    raise StoreError("corrupt", f"chunk {ref.content_id.hex()} has {size} bytes, its pack says {ref.object_bytes}")


def refusal_reason(exc: BaseException) -> str:
    """The category a refusal is counted under (the format category for a damaged object)."""
    if isinstance(exc, KvpackError):
        return getattr(exc, "format_category", None) or exc.category
    return type(exc).__name__


# --------------------------------------------------------------------------------------------
# worker side


class _Identity:
    """What PackStore asks of a session's engine that is not a whole kvpack ``Engine``:
    ``session.engine.identity.ids()``, and the identity it hands back to ``begin_install``
    (this object itself: the ids are all a vLLM request's blocks are bound to)."""

    def __init__(self, ids: IdentityIds) -> None:
        self._ids = ids

    @property
    def identity(self) -> "_Identity":
        return self

    def ids(self) -> IdentityIds:
        return self._ids


_FROMBUFFER_WARNED = False


def _read_only_tensor(mv: memoryview, dtype: Any) -> Any:
    """A tensor view of verified bytes (only ever read). torch warns once per process that a
    read-only buffer makes a writable tensor; that one warning is silenced here, without
    paying for a ``catch_warnings`` block on every chunk."""
    global _FROMBUFFER_WARNED
    import torch

    if _FROMBUFFER_WARNED or not mv.readonly:
        return torch.frombuffer(mv, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = torch.frombuffer(mv, dtype=dtype)
    _FROMBUFFER_WARNED = True
    return out


class _PagedInstall:
    """Verified rows ``[lo, hi)`` are staged here, already in vLLM's block interior
    (:class:`~.paged.BlockStaging`: each chunk's transposing copy runs as it is verified,
    beside the hashing threads); ``commit`` copies whole blocks into the cache."""

    def __init__(self, paged: PagedKV, layout: CacheLayout, spec: LoadSpec) -> None:
        self.paged, self.layout, self.spec = paged, layout, spec
        self.staging: BlockStaging | None = paged.staging(spec.block_ids, spec.lo, spec.hi)
        self.written = {(s.index, role): 0 for s in layout.layers for role in ("k", "v")}
        self.closed = False

    def required_range(self, layer: int) -> tuple[int, int]:
        self.layout.layer(layer)
        return self.spec.lo, self.spec.hi

    def write_rows(self, layer: int, role: str, start: int, data: Any) -> None:
        if self.closed or self.staging is None:
            raise EngineError("install", "install is closed")
        spec = self.layout.layer(layer)
        mv = memoryview(data).cast("B")
        if mv.nbytes % spec.row_bytes:
            raise EngineError("layout", f"{mv.nbytes} bytes is not a whole number of rows")
        n = mv.nbytes // spec.row_bytes
        if role not in ("k", "v") or start < self.spec.lo or start + n > self.spec.hi:
            raise EngineError("layout", f"rows [{start}, {start + n}) of {role!r} fall outside [{self.spec.lo}, {self.spec.hi})")
        rows = _read_only_tensor(mv, self.paged.torch_dtype).view(n, spec.row_elements)
        self.staging.write(layer, 0 if role == "k" else 1, start, rows)
        self.written[(layer, role)] += n

    def write_logits(self, data: Any) -> None:
        raise EngineError("install", "vLLM prefix loads carry no logits row")

    def missing(self) -> list[tuple[int, str, int]]:
        want = self.spec.hi - self.spec.lo
        return [(layer, role, want - n) for (layer, role), n in self.written.items() if n != want]

    def commit(self, *, require_logits: bool = False) -> None:
        if require_logits:
            raise EngineError("install", "vLLM prefix loads carry no logits row")
        if self.closed or self.staging is None:
            raise EngineError("install", "install is closed")
        gaps = self.missing()
        if gaps:
            raise EngineError("install", f"{len(gaps)} planes incomplete (first: layer {gaps[0][0]} {gaps[0][1]})")
        for layer in range(self.layout.num_layers):
            self.staging.commit(layer)
        self.closed = True
        self.staging = None

    def abort(self) -> None:
        self.closed = True
        if self.staging is not None:
            self.staging.discard()
        self.staging = None


class _PagedTarget:
    """The 'session' PackStore.restore installs into: vLLM's blocks of one request."""

    def __init__(self, paged: PagedKV, layout: CacheLayout, ids: IdentityIds, spec: LoadSpec) -> None:
        self.paged, self.layout, self.spec = paged, layout, spec
        self.engine = _Identity(ids)

    def begin_install(self, cut: int, token_ids: Sequence[int], identity: Any) -> _PagedInstall:
        if identity is not self.engine.identity or cut != self.spec.cut:
            raise EngineError("identity", "install for another identity or cut")
        return _PagedInstall(self.paged, self.layout, self.spec)


def load_prefix(store: PackStore, paged: PagedKV, layout: CacheLayout, ids: IdentityIds, spec: LoadSpec) -> RestoreReport:
    """Verify rows ``[spec.lo, spec.hi)`` of the stored cut completely, then write them into
    the request's blocks. Raises (StoreError / EngineError) with no block written on refusal."""
    if not (0 <= spec.lo < spec.hi <= spec.cut and spec.lo % paged.geometry.block_size == 0):
        raise EngineError("layout", f"load range [{spec.lo}, {spec.hi}) of cut {spec.cut} is not block aligned")
    target = _PagedTarget(paged, layout, ids, spec)
    report, receipt = store.restore_healing(Hit(spec.manifest_id, spec.cut, spec.node_id), target, spec.tokens, require_logits=False)
    if report is None:
        if receipt is not None:  # quarantined: the receipt names what failed
            raise StoreError("corrupt", "; ".join(receipt.get("problems", []))[:500] or "stored cut failed verification")
        raise StoreError("miss", "the stored cut moved before it could be loaded")
    return report


@dataclass
class CapturedPrefix:
    """Rows ``[0, position)`` of every layer, copied out of vLLM's blocks: a read-only
    session for PackStore.save."""

    layout: CacheLayout
    engine: _Identity
    tokens: list[int]
    planes: list[Any] = field(repr=False)  # per layer: contiguous [2, position, row] tensors

    @property
    def position(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(int(p.numel()) * int(p.element_size()) for p in self.planes)

    def export_rows(self, layer: int, role: str, start: int, stop: int) -> memoryview:
        import torch

        if role not in ("k", "v") or not 0 <= start < stop <= self.position:
            raise EngineError("layout", f"rows [{start}, {stop}) of {role!r} are not captured")
        rows = self.planes[layer][0 if role == "k" else 1, start:stop]  # contiguous: whole rows
        return memoryview(rows.view(torch.uint8).numpy()).cast("B")

    def export_logits(self) -> memoryview:
        raise StoreError("incomplete", "vLLM exposes no logits row at a prefix cut")


def capture(paged: PagedKV, layout: CacheLayout, ids: IdentityIds, spec: SaveSpec) -> CapturedPrefix:
    """Copy rows ``[0, deepest cut)`` of every layer out of the request's blocks."""
    n = spec.cuts[-1]
    if len(spec.tokens) != n:
        raise EngineError("layout", f"{len(spec.tokens)} tokens for a capture of {n} rows")
    planes = [paged.gather(layer, spec.block_ids, 0, n) for layer in range(layout.num_layers)]
    return CapturedPrefix(layout, _Identity(ids), list(spec.tokens), planes)


def publish(store: PackStore, captured: CapturedPrefix, cuts: Sequence[int]) -> list[SaveReport]:
    """Publish the cuts in ascending order (each a delta on the one before)."""
    return [store.save(captured, cut=c, prefix_only=True) for c in cuts]
