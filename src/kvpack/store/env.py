"""The storage environment under the pack store (LevelDB ``Env`` / SQLite VFS style).

:class:`~kvpack.store.packstore.PackStore` never touches files or buckets itself: every read,
durable write, listing, delete, compare-and-swap and lease goes through one
:class:`StorageEnv`. Two backends implement it: :mod:`.posix` (a directory; durability through
:mod:`kvpack.durable`, flock leases) and :mod:`.s3` (an S3-compatible bucket; conditional
writes, lease objects and a gc grace period). A new backend is one module implementing this
class plus its run of the store test suite.

Names are relative, ``/``-separated keys such as ``chunks/<hex>.kvchk``; a backend maps them
onto paths or object keys. This module holds the vocabulary only and must never do I/O.

Semantics every backend guarantees (the store's crash and concurrency arguments rest on them):

* ``write`` is atomic and durable once it returns (POSIX: temp file, fsync, rename, and the
  directory fsync unless ``batch``; then ``commit`` makes a batch durable). Readers see the
  old object or the new one, never a mix.
* ``write(create_only=True)`` never replaces an existing object (returns False instead):
  content-addressed objects are immutable, so two publishers of one chunk cannot swap its
  bytes under a manifest that already names their digest.
* ``write_if`` is a compare-and-swap on the object's version token (``None``: must not exist);
  two writers racing on one index entry never both succeed.
* ``list`` after a completed ``write`` shows the object (read-after-write consistency).
* ``lease`` keeps gc away from what it protects (see :class:`Lease`).
* Where gc runs beside publishers (S3), gc holds a *sweep* lease from before it reads the
  leases until its last delete, and rewrites a gc epoch object when it takes it;
  :meth:`StorageEnv.gc_seen` shows both to a publisher, which commits only when no sweep
  could have missed its cut (docs/store.md "gc and leases").
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Union

from ..errors import StoreError

Buffer = Union[bytes, bytearray, memoryview]
#: what a read hands back (a view of the caller's region, or bytes)
ReadBuffer = Union[bytes, memoryview]

#: Lease purposes. ``publish`` and ``restore`` may run together; ``gc`` keeps both away from
#: what it deletes (POSIX: an exclusive flock; S3: the grace period plus restore leases).
PUBLISH, RESTORE, GC = "publish", "restore", "gc"


class ObjectMissing(FileNotFoundError):
    """The named object does not exist (a FileNotFoundError, so callers can treat both alike)."""


@dataclass(frozen=True)
class GcSeen:
    """What a publisher saw of gc at one moment: the version of the gc epoch object (every
    sweep rewrites it before it reads the leases; None if no sweep ever ran) and the names
    of the sweep leases alive then."""

    epoch: str | None
    sweeping: frozenset[str]


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int
    mtime: float  # seconds since the epoch, as the backend records it
    version: str | None = None  # the token write_if compares (S3: the ETag)


class Lease(abc.ABC):
    """A held lease: ``check`` raises StoreError("locked") if it is no longer valid (expired
    or lost); ``protect`` adds manifest ids (hex) gc must keep while it is held."""

    @abc.abstractmethod
    def check(self) -> None: ...

    def protect(self, manifest_ids: Sequence[str]) -> None:
        """Backends whose gc excludes every lease holder (POSIX flock) need not record it."""
        return None


class StorageEnv(abc.ABC):
    """Object storage as the pack store needs it (see the module docstring for guarantees)."""

    #: a human-readable location: a directory path or ``s3://bucket/prefix``
    location: str
    #: seconds an unreferenced object must be old before gc may delete it (0: gc excludes
    #: every publisher and restore with a lock instead)
    gc_grace_s: float = 0.0
    #: threads worth running reads on (network backends want more than CPU count)
    io_parallelism: int = 0
    #: whether a save looks for an existing chunk object before encoding and writing it.
    #: True where the look is a cheap local open and a wasted write costs a write + fsync
    #: (POSIX); False where it is a round trip per chunk (S3): the create-only write itself
    #: answers "exists" (412) and the save then verifies and adopts -- or replaces -- the
    #: stored object exactly as after a probe (kvpack.store.publish._store_chunk)
    probe_before_create: bool = True

    # -- reads -------------------------------------------------------------------------------
    @abc.abstractmethod
    def read(self, name: str) -> bytes:
        """The whole object; raises :class:`ObjectMissing`."""

    @abc.abstractmethod
    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` (fewer at the end of the object)."""

    @abc.abstractmethod
    def read_into(self, name: str, region: memoryview) -> tuple[ReadBuffer, int]:
        """Read the whole object into ``region``: ``(view of region, n)``; an object larger
        than ``region`` comes back whole as bytes (a decoder then refuses it)."""

    @abc.abstractmethod
    def stat(self, name: str) -> ObjectInfo | None:
        """Size, time and version of an object, or None if it does not exist."""

    def exists(self, name: str) -> bool:
        return self.stat(name) is not None

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose name starts with ``prefix`` (e.g. ``"chunks/"``), any order."""

    # -- writes ------------------------------------------------------------------------------
    @abc.abstractmethod
    def write(self, name: str, data: Buffer | Iterable[Buffer], *, create_only: bool = False, batch: bool = False) -> bool:
        """Atomically and durably store ``data`` as ``name``. ``create_only``: leave an
        existing object alone and return False. ``batch``: durability may wait for
        :meth:`commit` of the object's directory (POSIX directory fsync)."""

    def commit(self, prefix: str) -> None:
        """Make every ``batch`` write under ``prefix`` durable (no-op where writes already are)."""
        return None

    @abc.abstractmethod
    def delete(self, name: str, *, if_version: str | None = None, batch: bool = False) -> bool:
        """Remove ``name`` durably; False if it did not exist (or ``if_version`` differs).
        ``batch``: durability may wait for :meth:`commit` (gc deleting many objects)."""

    @abc.abstractmethod
    def read_versioned(self, name: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        """``(data, version)`` of a small object (an index entry), or None. ``max_bytes``:
        read no more than ``max_bytes + 1`` bytes into memory; an object larger than
        ``max_bytes`` comes back cut short, with the version of the whole object (its reader
        refuses it as malformed and may still remove it with a compare-and-swap; the bound
        keeps a damaged or hostile multi-GB "entry" out of memory)."""

    @abc.abstractmethod
    def write_if(self, name: str, data: bytes, version: str | None) -> bool:
        """Compare-and-swap: store ``data`` only if the object's version is ``version``
        (``None``: only if it does not exist). False when another writer got there first."""

    # -- leases and time ---------------------------------------------------------------------
    @abc.abstractmethod
    def lease(self, purpose: str, *, protects: Sequence[str] = ()) -> AbstractContextManager[Lease]:
        """Hold a lease for ``purpose`` (PUBLISH, RESTORE or GC). ``protects``: manifest ids
        (hex) gc must treat as live while the lease is held, even if no index entry names
        them any more. Waits (bounded) for a conflicting holder; raises StoreError("locked")."""

    def for_lookup(self) -> "StorageEnv":
        """The environment a lookup's small reads go through (index entries, the existence
        of a cut's pack and logits objects, a logits header): a network backend answers with
        short timeouts and few retries there, so a server that hangs costs a lookup seconds
        before the caller recomputes, not minutes. Default: this environment."""
        return self

    def with_deadline(self, deadline: float) -> "StorageEnv":
        """This environment with every request bounded by ``deadline`` (``time.monotonic()``
        seconds): what a restore and a save read and write through, so a storage server that
        hangs costs them their deadline, not minutes per request (S3: per-request timeouts
        derived from what is left; past it a request refuses with ``io`` at once). Default:
        this environment (a POSIX read or write blocked in the kernel cannot be abandoned;
        the store checks the deadline between its steps instead)."""
        return self

    def check_lease(self) -> AbstractContextManager[None]:
        """What a read-only check (``verify``) holds while it reads: never a write to the
        store, so a check works with read-only credentials or on a read-only mount. Default
        (S3): nothing at all. A check that races gc may then see a cut's objects vanish; it
        re-reads that cut's index entry before it reports a problem, and a cut no longer
        indexed was withdrawn, not damaged (:func:`kvpack.store.maintenance.verify`)."""
        return nullcontext(None)

    def protected(self) -> set[str]:
        """Manifest ids (hex) protected by live leases of other processes (gc reads this
        after its mark phase)."""
        return set()

    def sweeping(self) -> AbstractContextManager[Lease | None]:
        """Held by gc from before it reads the leases until its last delete (S3: a sweep lease
        ``leases/gc-*`` and a new gc epoch). Backends whose gc lease already excludes every
        publisher (POSIX flock) hold nothing here."""
        return nullcontext(None)

    def gc_seen(self) -> GcSeen | None:
        """The gc epoch and the live sweep leases, in that order (None where gc excludes
        publishers with a lock: then a publisher never needs to look)."""
        return None

    @abc.abstractmethod
    def now(self) -> float:
        """The clock object times are compared with (seconds since the epoch)."""

    def sweep_incomplete(self, older_than: float) -> int:
        """Abort uploads a crashed writer left unfinished before ``older_than`` (S3
        multipart uploads); returns how many. Backends without such state return 0."""
        return 0

    def setup(self) -> None:
        """Create what an empty store needs (directories, the bucket check)."""
        return None

    def destroy_empty(self) -> None:
        """Undo :meth:`setup` of a store that holds nothing yet (a refused ``init``)."""
        return None

    def close(self) -> None:
        """Release connections (the env is unusable afterwards)."""
        return None


def seconds_setting(name: str, default: float) -> float:
    """A positive finite number of seconds from the environment variable ``name``, else
    ``default``; anything else refuses (``usage``) rather than meaning no deadline."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise StoreError("usage", f"{name}={raw!r} is not a positive number of seconds")
    return value
