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
import logging
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from ..durable import REAL_OPS, FileOps, atomic_write, durable_unlink, ensure_dir, sync_dir
from ..errors import DurableIOError, StoreError
from ..vocab import FileLock, LockHeld
from .env import GC, seconds_setting, Buffer, Lease, ReadBuffer, ObjectInfo, ObjectMissing, StorageEnv

#: Top-level directories of a store (one per object kind).
SUBDIRS = ("chunks", "packs", "logits", "index", "quarantine")
#: how long ``gc`` waits for the exclusive store lock before it refuses (``locked``), seconds
#: (``KVPACK_GC_WAIT_S``, ``kvpack store gc --wait``)
DEFAULT_GC_WAIT_S = 600.0
#: a gc waiting for the lock holds this file exclusively: restores and publishers that come
#: later wait for it before they take the store lock shared, so a gc is never starved by a
#: stream of overlapping restores (it gets the lock once those already holding it finish)
GC_PENDING = "gc.pending"
#: seconds between a waiting gc's progress lines
GC_WAIT_REPORT_S = 10.0
#: how long restores and publishers queue behind a pending gc, counted from when the gc
#: began waiting (the mtime of GC_PENDING, which the gc stamps) -- not from each one's own
#: arrival: past it they take the lock shared without waiting, so a gc stuck behind one hung
#: holder stalls the others once, by at most this, never by its whole wait (seconds;
#: PosixEnv.gc_yield_s). Restores and saves that each last less than this cannot starve a gc.
GC_YIELD_S = 30.0
#: those that went ahead of a pending gc hold this file shared while they hold the lock; when
#: every holder of the lock is one of them (the holder the gc was stuck behind has gone), the
#: gc stamps GC_PENDING again and they queue once more, so a gc is not starved by a relay of
#: holders that each went ahead of it (see docs/store.md "gc and leases")
GC_BYPASS = "gc.bypass"

log = logging.getLogger("kvpack.store")


def lock_holders(path: str) -> list[int]:
    """Pids holding a flock on ``path`` (from /proc/locks; empty where that is unreadable):
    what a waiting gc names in its progress line and its refusal."""
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            lines = fh.read(1 << 20).splitlines()
    except OSError:
        return []
    want = f":{st.st_ino}"
    pids: list[int] = []
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].endswith(want) and fields[4].isdigit():
            pid = int(fields[4])
            if pid not in pids:
                pids.append(pid)
    return pids


def flock_count(path: str) -> int | None:
    """How many flocks are held on ``path`` (every holder and every shared lease counts once;
    waiters do not), from /proc/locks; None where that is unreadable."""
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            lines = fh.read(1 << 20).splitlines()
    except FileNotFoundError:
        return 0 if os.path.exists("/proc/locks") else None
    except OSError:
        return None
    want = f":{st.st_ino}"
    return sum(1 for line in lines if "->" not in line.split() and len(line.split()) >= 6 and line.split()[1] == "FLOCK" and line.split()[5].endswith(want))


def _holders_text(path: str) -> str:
    pids = lock_holders(path)
    return f"held by pid {', '.join(map(str, pids))}" if pids else "holder unknown"


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
        #: how long gc waits for the exclusive lock, and where its progress lines go
        #: (default: the ``kvpack.store`` logger; the CLI prints them on stderr)
        self.gc_wait_s = seconds_setting("KVPACK_GC_WAIT_S", DEFAULT_GC_WAIT_S)
        self.on_wait: Callable[[str], None] | None = None
        self.gc_yield_s = GC_YIELD_S
        self._nested = threading.local()  # shared leases this thread holds
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
        if purpose == GC:
            with self._gc_lock():
                yield _FlockLease()
            return
        depth = getattr(self._nested, "depth", 0)
        # a lease nested in one this thread holds never waits for a gc: that gc waits for us
        went_ahead = not depth and self._wait_for_pending_gc()
        lock = FileLock(self._p("lock"), shared=True)  # gc alone, everyone else shares
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                lock.acquire()
                break
            except LockHeld:
                if time.monotonic() >= deadline:
                    raise StoreError("locked", f"{self.root}: another process held the store lock for {self.lock_timeout_s:.0f} s") from None
                time.sleep(0.005)
        bypass = FileLock(self._p(GC_BYPASS), shared=True)
        if went_ahead:
            try:  # after the lock, released before it: never more of these than such holders
                bypass.acquire()
            except (OSError, LockHeld):
                pass  # the gc then does not stamp again: it waits as before
        self._nested.depth = depth + 1
        try:
            yield _FlockLease()
        finally:
            self._nested.depth = depth
            bypass.release()
            lock.release()  # closing releases the flock

    def _wait_for_pending_gc(self) -> bool:
        """Wait while a gc holds GC_PENDING (a shared flock taken and dropped at once) and its
        turn is open: until ``gc_yield_s`` after the gc stamped the file (its mtime), and never
        longer than that from now. Before the store lock, so a gc waiting for the holders in
        flight is not overtaken by new ones; past its turn this lease goes ahead at once (the gc
        is stuck behind something else: a hung holder must not stall every restore) and says
        so (True: hold GC_BYPASS). A store without the file (no gc ever waited, or a read-only
        store) has nothing pending."""
        try:
            fd = os.open(self._p(GC_PENDING), os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            deadline = time.monotonic() + min(self.gc_yield_s, self.lock_timeout_s)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return False
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        return False  # a pending marker we cannot lock stops nobody
                try:
                    turn_left = os.fstat(fd).st_mtime + self.gc_yield_s - time.time()
                except OSError:
                    turn_left = 0.0
                if turn_left <= 0 or time.monotonic() >= deadline:
                    return True
                time.sleep(0.005)
        finally:
            os.close(fd)

    def _say(self, line: str) -> None:
        (self.on_wait or log.warning)(line)

    @contextmanager
    def _gc_lock(self) -> Iterator[None]:
        """GC_PENDING exclusively, then the store lock exclusively, each waited for up to
        ``gc_wait_s`` in all; one progress line when the wait starts (naming the holders),
        one every GC_WAIT_REPORT_S, and a one-line ``locked`` refusal past the deadline."""
        deadline = time.monotonic() + self.gc_wait_s
        pending = FileLock(self._p(GC_PENDING))
        lock = FileLock(self._p("lock"))
        waited_since: float | None = None
        next_report = 0.0
        turn = 0.0  # when this gc last stamped GC_PENDING (monotonic)
        turn_open = True
        stuck_on_others = False  # when the turn ended, a holder that had not gone ahead held the lock
        try:
            for held in (pending, lock):
                while True:
                    try:
                        held.acquire()
                        if held is pending:
                            self._stamp(pending)
                            turn = time.monotonic()
                        break
                    except LockHeld:
                        now = time.monotonic()
                        if held is lock and now - turn >= self.gc_yield_s:
                            others = self._others_holding()
                            if turn_open:  # the turn just ended: new leases go ahead now
                                turn_open = False
                                stuck_on_others = bool(others)
                            elif stuck_on_others and others == 0:
                                # the holders this gc was stuck behind have gone and every
                                # holder now went ahead of it: one more turn, they finish
                                # (each is shorter than a turn, or it is stuck once more)
                                self._stamp(pending)
                                turn, turn_open = now, True
                        what = "another gc" if held is pending else "restores, saves or checks"
                        if now >= deadline:
                            raise StoreError(
                                "locked",
                                f"{self.root}: gc waited {self.gc_wait_s:g} s for the store lock ({what}, {_holders_text(held.path)}); "
                                "nothing was removed (raise --wait / KVPACK_GC_WAIT_S, or retry when the store is idle)",
                            ) from None
                        if waited_since is None:
                            waited_since = now
                        if now >= next_report:
                            self._say(
                                f"gc: waiting for the store lock of {self.root} ({what}, {_holders_text(held.path)}; "
                                f"{now - waited_since:.0f} s of at most {self.gc_wait_s:g} s; new restores and saves wait behind this gc during its turn)"
                            )
                            next_report = now + GC_WAIT_REPORT_S
                        time.sleep(0.005)
            yield
        finally:
            lock.release()
            pending.release()

    def _stamp(self, pending: FileLock) -> None:
        """Open the restores' turn behind this gc: GC_PENDING's mtime is now."""
        try:
            os.utime(pending.fd)
        except OSError:
            pass  # then leases wait for their own gc_yield_s at most, as the mtime allows

    def _others_holding(self) -> int | None:
        """How many holders of the store lock did not go ahead of this gc (hold no
        GC_BYPASS): those it was waiting for when its turn ended. None: /proc/locks unreadable
        (then no second turn)."""
        held, ahead = flock_count(self._p("lock")), flock_count(self._p(GC_BYPASS))
        return None if held is None or ahead is None else max(0, held - ahead)

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
        for name in ("lock", GC_PENDING, GC_BYPASS):
            try:
                os.unlink(os.path.join(self.root, name))
            except FileNotFoundError:
                pass
        for sub in SUBDIRS:
            try:
                os.rmdir(os.path.join(self.root, sub))
            except OSError:
                pass
