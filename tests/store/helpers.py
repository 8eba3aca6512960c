"""Shared helpers for store tests: a small windowed layout on the NumPy adapter, and the two
storage backends the suite runs against."""

from __future__ import annotations

import os
import secrets

from kvpack.engine.arrays import ArrayEngine, array_layout
from kvpack.store import PackStore

LAYOUT = array_layout(layers=4, kv_heads=2, head_dim=8, windowed={1: 40, 3: 100})
TOKENS = [(i * 7 + 3) % 64 for i in range(1200)]
BUCKET = "kvpack-tests"


def engine(**kw) -> ArrayEngine:
    return ArrayEngine(LAYOUT, **kw)


class PosixBackend:
    """A directory. ``host_readers``: the stores' ``RestoreTuning.host_readers`` (None: the
    default), so the suite also runs with host restores in reader processes forced on."""

    name = "posix"

    def __init__(self, host_readers: int | None = None) -> None:
        self.host_readers = host_readers

    def _tuned(self, store: PackStore) -> PackStore:
        if self.host_readers is not None:
            store.host_readers = self.host_readers
        return store

    def new(self, tmp_path, name="store", **kw) -> PackStore:
        kw.setdefault("chunk_bytes", 4096)
        return self._tuned(PackStore.init(os.path.join(tmp_path, name), **kw))

    def reopen(self, store: PackStore, **kw) -> PackStore:
        return self._tuned(PackStore.open(store.path, **kw))


class S3Backend:
    """Each store gets its own prefix in one bucket of the session's SeaweedFS server."""

    name = "s3"

    def __init__(self, server, gc_grace_s: float = 0.0) -> None:
        self.server = server
        self.gc_grace_s = gc_grace_s
        self.keys: dict[str, str] = {}

    def env(self, location: str):
        from kvpack.store.s3 import S3Env

        return S3Env.from_url(location, endpoint=self.server.endpoint, credentials_file=self.server.credentials_file, gc_grace_s=self.gc_grace_s)

    def new(self, tmp_path, name="store", **kw) -> PackStore:
        kw.setdefault("chunk_bytes", 4096)
        kw.setdefault("root_key_file", os.path.join(tmp_path, f"{name}.key"))
        location = f"s3://{BUCKET}/{name}-{secrets.token_hex(6)}"
        store = PackStore.init(self.env(location), **kw)
        self.keys[store.path] = kw["root_key_file"]
        return store

    def reopen(self, store: PackStore, **kw) -> PackStore:
        kw.pop("ops", None)  # the fault-injecting file layer is POSIX only
        kw.setdefault("root_key_file", self.keys[store.path])
        return PackStore.open(self.env(store.path), **kw)


def new_store(tmp_path, name="store", backend=None, **kw) -> PackStore:
    return (backend or PosixBackend()).new(tmp_path, name, **kw)


def session_with(eng, tokens, store=None, chunk=256):
    s = eng.new_session()
    s.prefill(tokens, chunk_size=chunk, on_chunk=(lambda ss: store.save(ss)) if store is not None else None)
    return s


def names(store: PackStore, prefix: str) -> list[str]:
    """Object names under a prefix (e.g. "chunks/"), whatever the backend."""
    return sorted(i.name for i in store.env.list(prefix) if not i.name.rpartition("/")[2].startswith("."))


def flip(store: PackStore, name: str, offset: int, mask: int = 1) -> None:
    """Flip bits of one stored object in place (bypassing every create-only rule)."""
    data = bytearray(store.env.read(name))
    data[offset % len(data)] ^= mask
    store.env.write(name, bytes(data))


def files(root: str) -> dict[str, bytes]:
    """Every file under a store directory (relative path: bytes): compared before and after
    a refused operation to prove it changed nothing."""
    out = {}
    for directory, _dirs, found in os.walk(root):
        for name in found:
            with open(os.path.join(directory, name), "rb") as fh:
                out[os.path.relpath(os.path.join(directory, name), root)] = fh.read()
    return out
