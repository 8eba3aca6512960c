"""The POSIX storage environment: a store directory on a local (or NFS-free) filesystem.

Every durable write goes through :mod:`kvpack.durable` (temp file O_EXCL 0600, write, fsync,
rename or link, directory fsync) and every system call, reads and listings included, through
its :class:`~kvpack.durable.FileOps`, so the fault-injecting layer
(:mod:`kvpack.testing.faults`) sees all of them. Leases are ``flock`` on ``<dir>/lock``:
publishers and restores share it, gc holds it exclusively, and the kernel drops it when a
holder dies, so no grace period is needed. Compare-and-swap on index entries holds an
exclusive ``flock`` on the index directory for the read-compare-rename.

This module must never interpret what it stores: names in, bytes out.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from ..durable import REAL_OPS, FileOps, atomic_write, durable_unlink, ensure_dir, sync_dir
from ..errors import DurableIOError, StoreError
from ..vocab import FileLock, LockHeld
from .env import GC, Buffer, Lease, ReadBuffer, ObjectInfo, ObjectMissing, StorageEnv

#: Top-level directories of a store (one per object kind).
SUBDIRS = ("chunks", "packs", "logits", "index", "quarantine")


class _FlockLease(Lease):
    def check(self) -> None:
        return None  # the kernel holds a flock until the descriptor closes


class PosixEnv(StorageEnv):
    """A store directory. ``ops`` is the system-call layer (tests pass a fault injector)."""

    def __init__(self, path: str, *, ops: FileOps = REAL_OPS, lock_timeout_s: float = 600.0) -> None:
        self.root = os.path.abspath(path)
        self.location = self.root
        self.ops = ops
        self.lock_timeout_s = lock_timeout_s
        self.io_parallelism = 0

    def _p(self, name: str) -> str:
        if name.startswith("/") or ".." in name.split("/"):
            raise StoreError("usage", f"object name {name!r} escapes the store")
        return os.path.join(self.root, *name.split("/"))

    # -- reads -------------------------------------------------------------------------------
    @contextmanager
    def _reading(self, name: str) -> Iterator[None]:
        """A missing file is ObjectMissing; any other read failure (EIO) one StoreError("io")."""
        try:
            yield
        except FileNotFoundError:
            raise ObjectMissing(errno.ENOENT, "no such object", name) from None
        except OSError as exc:
            raise StoreError("io", f"read {self._p(name)}: {exc.strerror or exc}") from None

    def read(self, name: str) -> bytes:
        with self._reading(name):
            return self.ops.read_file(self._p(name))

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        with self._reading(name):
            return self.ops.read_range(self._p(name), offset, length)

    def read_into(self, name: str, region: memoryview) -> tuple[ReadBuffer, int]:
        with self._reading(name):
            return self.ops.readinto(self._p(name), region)

    def stat(self, name: str) -> ObjectInfo | None:
        try:
            st = self.ops.stat(self._p(name))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError("io", f"stat {self._p(name)}: {exc.strerror or exc}") from None
        return ObjectInfo(name, st.st_size, st.st_mtime)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every file whose name starts with ``prefix``, walking into subdirectories."""
        directory, _, start = prefix.rpartition("/")
        try:
            entries = self.ops.listdir(self._p(directory) if directory else self.root)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise StoreError("io", f"list {self._p(directory)}: {exc.strerror or exc}") from None
        for entry in sorted(entries):
            if not entry.startswith(start):
                continue
            name = f"{directory}/{entry}" if directory else entry
            try:
                st = self.ops.stat(self._p(name))
            except FileNotFoundError:
                continue  # removed meanwhile
            except OSError as exc:
                raise StoreError("io", f"stat {self._p(name)}: {exc.strerror or exc}") from None
            if stat.S_ISDIR(st.st_mode):
                yield from self.list(name + "/")
            elif stat.S_ISREG(st.st_mode):
                yield ObjectInfo(name, st.st_size, st.st_mtime)

    # -- writes ------------------------------------------------------------------------------
    def write(self, name: str, data: Buffer | Iterable[Buffer], *, create_only: bool = False, batch: bool = False) -> bool:
        path = self._p(name)
        try:
            return atomic_write(path, data, ops=self.ops, mode=0o600, sync_dir=not batch, replace=not create_only)
        except DurableIOError as exc:
            # failing to create the temp file (nothing of ``data`` consumed yet) because its
            # directory is gone: made again below, once
            if exc.category != "open" or not isinstance(exc.__cause__, FileNotFoundError) or not self._remake_dir(path):
                raise
        return atomic_write(path, data, ops=self.ops, mode=0o600, sync_dir=not batch, replace=not create_only)

    def _remake_dir(self, path: str) -> bool:
        """Recreate the missing directory of ``path`` inside a store whose root still exists
        (an operator clearing ``quarantine/`` or ``index/`` with rm -r); False otherwise."""
        directory = os.path.dirname(path)
        if os.path.isdir(directory) or not os.path.isdir(self.root) or not directory.startswith(self.root + os.sep):
            return False
        ensure_dir(directory, ops=self.ops)
        return True

    def commit(self, prefix: str) -> None:
        sync_dir(self._p(prefix.rstrip("/")), ops=self.ops)

    def delete(self, name: str, *, if_version: str | None = None, batch: bool = False) -> bool:
        path = self._p(name)
        if if_version is not None:
            with self._cas_lock(name):
                if self._version(name) != if_version:
                    return False
                return durable_unlink(path, ops=self.ops)
        if batch:
            try:
                self.ops.unlink(path)
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise DurableIOError("rename", f"unlink {path}: {exc.strerror}") from exc
            return True
        return durable_unlink(path, ops=self.ops)

    def read_versioned(self, name: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        try:
            if max_bytes is None:
                data = self.read(name)
            else:
                data = self.read_range(name, 0, max_bytes + 1)
                if len(data) > max_bytes:
                    version = self._version(name)  # cut short: hashed blockwise, never held whole
                    return None if version is None else (data, version)
        except ObjectMissing:
            return None
        return data, hashlib.sha256(data).hexdigest()[:32]

    #: bytes per read when a version is hashed blockwise
    VERSION_BLOCK = 1 << 20

    def _version(self, name: str) -> str | None:
        """The version of ``name`` (SHA-256 of its bytes, as :meth:`read_versioned` gives
        it), hashed in blocks so an object of any size costs no more memory than a block;
        None if it does not exist."""
        h = hashlib.sha256()
        offset = 0
        try:
            while True:
                block = self.read_range(name, offset, self.VERSION_BLOCK)
                h.update(block)
                offset += len(block)
                if len(block) < self.VERSION_BLOCK:
                    return h.hexdigest()[:32]
        except ObjectMissing:
            return None

    def write_if(self, name: str, data: bytes, version: str | None) -> bool:
        with self._cas_lock(name):
            if self._version(name) != version:
                return False
            atomic_write(self._p(name), data, ops=self.ops, mode=0o600)
            return True

    @contextmanager
    def _cas_lock(self, name: str) -> Iterator[None]:
        """An exclusive flock on the object's directory for one read-compare-rename."""
        directory = os.path.dirname(self._p(name))
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            if not self._remake_dir(self._p(name)):
                raise StoreError("io", f"{directory} is missing") from None
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- leases ------------------------------------------------------------------------------
    @contextmanager
    def lease(self, purpose: str, *, protects: Sequence[str] = ()) -> Iterator[Lease]:
        lock = FileLock(self._p("lock"), shared=purpose != GC)  # gc alone, everyone else shares
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                lock.acquire()
                break
            except LockHeld:
                if time.monotonic() >= deadline:
                    raise StoreError("locked", f"{self.root}: another process held the store lock for {self.lock_timeout_s:.0f} s") from None
                time.sleep(0.005)
        try:
            yield _FlockLease()
        finally:
            lock.release()  # closing releases the flock

    @contextmanager
    def check_lease(self) -> Iterator[None]:
        """A shared flock through a read-only descriptor of the existing lock file, so gc
        (which locks exclusively) waits for the check; nothing is created or written. A store
        on a read-only mount or one the caller may not write takes it all the same (flock
        needs no write access); one without a lock file yet is checked without it."""
        try:
            fd = os.open(self._p("lock"), os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.ELOOP):
                raise StoreError("io", f"open {self._p('lock')}: {exc.strerror or exc}") from None
            fd = -1
        if fd < 0:
            yield None
            return
        try:
            deadline = time.monotonic() + self.lock_timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise StoreError("io", f"flock {self._p('lock')}: {exc.strerror or exc}") from None
                if time.monotonic() >= deadline:
                    raise StoreError("locked", f"{self.root}: another process held the store lock for {self.lock_timeout_s:.0f} s")
                time.sleep(0.005)
            yield None
        finally:
            os.close(fd)

    def now(self) -> float:
        return time.time()

    # -- lifecycle ---------------------------------------------------------------------------
    def setup(self) -> None:
        ensure_dir(self.root, ops=self.ops)
        for sub in SUBDIRS:
            ensure_dir(os.path.join(self.root, sub), ops=self.ops)

    def destroy_empty(self) -> None:
        """Remove the empty subdirectories and the lock file of a refused ``init``."""
        for name in ("lock",):
            try:
                os.unlink(os.path.join(self.root, name))
            except FileNotFoundError:
                pass
        for sub in SUBDIRS:
            try:
                os.rmdir(os.path.join(self.root, sub))
            except OSError:
                pass
