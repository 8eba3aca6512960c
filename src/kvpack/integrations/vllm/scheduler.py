"""The connector's scheduler half: which requests load a stored prefix, which save one.

vLLM asks, for each new request, how many tokens beyond its local prefix cache the connector
can supply (:meth:`SchedulerSide.matched_tokens`); the answer is a verified plan from
:class:`~.prefix.PrefixPlanner`, loaded synchronously before the request's first forward.
Each step, :meth:`SchedulerSide.build` lists the loads of newly scheduled requests and the
saves of requests whose prefill reaches their deepest cut in that step (the 256-aligned
cuts and the tail cut, :func:`~.prefix.save_cuts`).

A lookup waits (vLLM's "ask again later", bounded by ``save_wait_s``) while a save of a
prefix it shares is still being written, so a repeated prompt finds what the previous one
saved instead of computing and saving it again.

Never: claim tokens that were not found under this exact identity with every needed chunk
present; let a store error escape into vLLM's scheduler (a lookup that fails is a miss).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...engine.contract import EngineIdentity
from ...store.packstore import PackStore
from .meta import KvpackMetadata, KvpackWorkerMeta
from .prefix import CUT_TOKENS, LoadPlan, LoadSpec, PrefixPlanner, SaveSpec, save_cuts
from .settings import Settings
from .stats import KvpackStats

log = logging.getLogger("kvpack.vllm")


@dataclass
class _Tracked:
    """A request the scheduler half follows from admission to its save."""

    prompt: list[int]
    plan: LoadPlan
    cuts: tuple[int, ...]  # cuts to save once the prefill reaches cuts[-1]
    blocks: list[int] = field(default_factory=list)
    load_pending: bool = False
    save_emitted: bool = False


def open_store(path: str, root_key_file: str | None = None) -> PackStore:
    """Open the pack store, creating it when missing (two processes may race to create it)."""
    from ...errors import StoreError

    try:
        return PackStore.open(path, root_key_file=root_key_file)
    except StoreError as exc:
        if exc.category != "no_store":  # anything else (wrong key, damaged store.json) refuses
            raise
    try:
        return PackStore.init(path, root_key_file=root_key_file)
    except StoreError as exc:
        if exc.category != "usage":
            raise
        return PackStore.open(path, root_key_file=root_key_file)


def common_prefix(a: list[int], b: tuple[int, ...] | list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


class SchedulerSide:
    def __init__(self, settings: Settings, identity: EngineIdentity, block_size: int, store: PackStore | None) -> None:
        self.settings = settings
        self.identity = identity
        self.ids = identity.ids()
        self.block_size = block_size
        self.store = store
        self.planner = PrefixPlanner(store, identity.layout, self.ids, block_size) if store is not None else None
        self.stats = KvpackStats()
        self._tracked: dict[str, _Tracked] = {}
        # saves emitted and not yet reported finished: (tokens, deepest cut, emitted at)
        self._inflight: dict[str, tuple[tuple[int, ...], int, float]] = {}
        self._waiting_since: dict[str, float] = {}

    # -- lookups ------------------------------------------------------------------------------
    def matched_tokens(self, req_id: str, prompt: list[int] | None, local: int) -> tuple[int | None, bool]:
        if self.planner is None or not prompt:
            return 0, False
        tracked = self._tracked.get(req_id)
        if tracked is None or tracked.plan.lo != local:
            try:
                plan = self.planner.lookup(prompt, local)
            except Exception as exc:  # noqa: BLE001 - a failing lookup is a miss, never a scheduler crash
                log.warning("kvpack: lookup failed, treated as a miss: %s", exc)
                plan = LoadPlan(stored=0, refusals=[f"lookup_{type(exc).__name__}"])
            if self._should_wait(req_id, prompt, plan):
                return None, False
            first = tracked is None
            tracked = _Tracked(prompt=list(prompt), plan=plan, cuts=save_cuts(len(prompt), plan.stored))
            self._tracked[req_id] = tracked
            if first:
                self._count_lookup(plan)
        return tracked.plan.tokens_to_load, False

    def _count_lookup(self, plan: LoadPlan) -> None:
        self.stats.add("lookups")
        for reason in plan.refusals:
            self.stats.refusal(reason)
            log.warning("kvpack: a stored prefix was refused (%s) and quarantined; recomputing", reason)
        self.stats.add("hits" if plan.tokens_to_load else "misses")

    def _should_wait(self, req_id: str, prompt: list[int], plan: LoadPlan) -> bool:
        """Whether a save still being written would give this prompt a deeper prefix."""
        now = time.monotonic()
        gain = 0
        for tokens, deepest, emitted in self._inflight.values():
            if now - emitted > self.settings.save_wait_s:
                continue
            shared = min(common_prefix(prompt, tokens), deepest)
            if shared == deepest and deepest == len(prompt) - 1:
                gain = max(gain, deepest)  # the tail cut of this very prompt
            else:
                gain = max(gain, shared - shared % CUT_TOKENS)
        if gain <= plan.stored:
            self._waiting_since.pop(req_id, None)
            return False
        since = self._waiting_since.setdefault(req_id, now)
        if now - since > self.settings.save_wait_s:
            self._waiting_since.pop(req_id, None)
            return False
        return True

    def after_alloc(self, req_id: str, block_ids: list[int], num_external: int) -> None:
        tracked = self._tracked.get(req_id)
        if tracked is None:
            return
        tracked.load_pending = num_external > 0
        if num_external > 0 and num_external != tracked.plan.tokens_to_load:
            # vLLM took fewer tokens than planned (never more): load only what it allocated
            tracked.plan.hi = tracked.plan.lo + num_external

    # -- per step -----------------------------------------------------------------------------
    def build(self, so: Any) -> KvpackMetadata:
        meta = KvpackMetadata(ids=self.ids.encode(), block_size=self.block_size)
        for new in so.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.blocks = list(new.block_ids[0])
            if tracked.load_pending:
                plan = tracked.plan
                assert plan.hit is not None
                meta.loads.append(
                    LoadSpec(
                        new.req_id,
                        tuple(tracked.prompt[: plan.hit.cut]),
                        plan.hit.manifest_id,
                        plan.hit.node_id,
                        plan.hit.cut,
                        plan.lo,
                        plan.hi,
                        tuple(tracked.blocks),
                    )
                )
                tracked.load_pending = False
            self._maybe_save(meta, new.req_id, tracked, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.blocks = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                tracked.blocks.extend(new_blocks[0])
            self._maybe_save(meta, req_id, tracked, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _maybe_save(self, meta: KvpackMetadata, req_id: str, tracked: _Tracked, computed_after: int) -> None:
        if self.settings.save == "off" or tracked.save_emitted or not tracked.cuts or computed_after < tracked.cuts[-1]:
            return
        deepest = tracked.cuts[-1]
        nblocks = -(-deepest // self.block_size)
        if len(tracked.blocks) < nblocks:
            return
        tokens = tuple(tracked.prompt[:deepest])
        meta.saves.append(SaveSpec(req_id, tokens, tracked.cuts, tuple(tracked.blocks[:nblocks])))
        tracked.save_emitted = True
        self._inflight[req_id] = (tokens, deepest, time.monotonic())

    def worker_output(self, worker_meta: Any) -> None:
        if not isinstance(worker_meta, KvpackWorkerMeta):
            return
        for req_id in worker_meta.saved:
            self._inflight.pop(req_id, None)
        for req_id in worker_meta.resave:
            # its load failed: vLLM recomputes it, and the save is planned again from scratch
            self._inflight.pop(req_id, None)
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                self._prune(tracked.prompt)
                tracked.plan = LoadPlan(stored=0)
                tracked.cuts = save_cuts(len(tracked.prompt), 0)
                tracked.save_emitted = False

    def _prune(self, prompt: list[int]) -> None:
        """After a refused load: take the prompt's stored cuts that no longer check out of
        the index, so the save after the recompute writes them again.

        The worker's verification quarantined the cut it loaded and deleted the damaged
        object, which may belong to an ancestor of that cut (a tail cut is a delta on the
        256-aligned cut below it); the ancestor's index entry still names a pack whose chunk
        is gone, and a save finds an indexed cut "existing". A lookup checks every chunk the
        deepest remaining cut needs and quarantines what fails, shallower and shallower."""
        if self.planner is None:
            return
        try:
            plan = self.planner.lookup(prompt, 0)
        except Exception as exc:  # noqa: BLE001 - best effort: the next lookup checks again
            log.warning("kvpack: checking the stored cuts after a refused load failed: %s", exc)
            return
        for reason in plan.refusals:
            self.stats.refusal(reason)

    def finished(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)
        self._waiting_since.pop(req_id, None)

    def take_stats(self) -> KvpackStats | None:
        return self.stats.take()
