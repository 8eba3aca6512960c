"""Shared helpers for store tests: a small windowed layout on the NumPy adapter."""

from __future__ import annotations

import os

from kvpack.engine.arrays import ArrayEngine, array_layout
from kvpack.store import PackStore

LAYOUT = array_layout(layers=4, kv_heads=2, head_dim=8, windowed={1: 40, 3: 100})
TOKENS = [(i * 7 + 3) % 64 for i in range(1200)]


def engine(**kw) -> ArrayEngine:
    return ArrayEngine(LAYOUT, **kw)


def new_store(tmp_path, name="store", **kw) -> PackStore:
    kw.setdefault("chunk_bytes", 4096)
    return PackStore.init(os.path.join(tmp_path, name), **kw)


def session_with(eng, tokens, store=None, chunk=256):
    s = eng.new_session()
    s.prefill(tokens, chunk_size=chunk, on_chunk=(lambda ss: store.save(ss)) if store is not None else None)
    return s
