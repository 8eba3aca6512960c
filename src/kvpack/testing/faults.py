"""A fault-injecting :class:`~kvpack.durable.FileOps` for crash-safety tests.

It performs real system calls in a real directory, and keeps a model of what the kernel has
made durable so far:

* file contents become durable at ``fsync(fd)``;
* directory entries (creations, renames, unlinks, mkdirs) become durable at ``fsync_dir``.

``crash_at=N`` simulates power loss *before* step N: every non-durable effect is undone on
disk (unsynced contents are rolled back to their last synced bytes, unsynced renames,
creations and unlinks are reverted in reverse order), then :class:`SimulatedCrash` is raised.
``SimulatedCrash`` derives from BaseException so that production code's ``except OSError`` /
``except Exception`` cleanup paths do not run, exactly like a killed process.

``fail`` makes chosen steps raise ``OSError(EIO)`` instead (e.g. EIO on fsync); ``errno_``
picks another error (``ENOSPC`` for a full disk); ``delays`` adds latency to an operation
kind (e.g. a slow directory fsync for the volume probe). ``hang_ops`` makes chosen kinds
*hang*: the calling thread blocks in that step (a stuck fsync, a disk that stopped
answering) until :meth:`FaultyOps.release` -- :attr:`FaultyOps.hanging` is set once a
thread is blocked there, so a test waits for the hang instead of sleeping.

Reads and listings (``read``, ``list``, ``stat``) are not durability points and never count
as steps, but they go through the same layer: ``fail_reads`` (a set of kinds, or a predicate
on ``(kind, path)``) makes them raise ``OSError(EIO)`` like a failing disk, and
``corrupt_reads`` (``(path, data) -> data``) hands back silently damaged bytes.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections.abc import Callable, Container, Sequence

from ..durable import Buffer, FileOps


class SimulatedCrash(BaseException):
    """The simulated machine lost power; nothing after this point ran."""


class FaultyOps(FileOps):
    def __init__(
        self,
        *,
        crash_at: int | None = None,
        fail: Callable[[int, str], bool] | None = None,
        fail_ops: Container[str] = (),
        delays: dict[str, float] | None = None,
        errno_: int = errno.EIO,
        fail_reads: Container[str] | Callable[[str, str], bool] = (),
        corrupt_reads: Callable[[str, bytes], bytes] | None = None,
        hang_ops: Container[str] = (),
    ) -> None:
        self.crash_at = crash_at
        self.hang_ops = hang_ops
        #: set while (and after) a thread is blocked in a hung step
        self.hanging = threading.Event()
        self._released = threading.Event()
        self.errno = errno_
        self._fail_reads = fail_reads
        self._corrupt_reads = corrupt_reads
        self.reads: list[tuple[str, str]] = []
        self._fail = fail
        self._fail_ops = fail_ops
        self.delays = dict(delays or {})
        self.steps = 0
        self.log: list[str] = []
        self.crashed = False
        self._fd_path: dict[int, str] = {}
        # path -> content that is durable for it (b"" for a fresh file)
        self._dirty: dict[str, bytes] = {}
        # non-durable directory operations, in order: (dir, op, args...)
        self._pending: list[tuple] = []

    def release(self) -> None:
        """The hung disk answers again: every thread blocked in a hung step returns (and
        later steps of those kinds no longer hang)."""
        self._released.set()

    # -- bookkeeping -------------------------------------------------------------------------
    def _step(self, name: str) -> None:
        if self.crashed:
            raise SimulatedCrash("machine already crashed")
        self.steps += 1
        self.log.append(name)
        if self.crash_at is not None and self.steps >= self.crash_at:
            self.crash()
            raise SimulatedCrash(f"crash before step {self.steps} ({name})")
        delay = self.delays.get(name)
        if delay:
            time.sleep(delay)
        if name in self.hang_ops and not self._released.is_set():
            self.hanging.set()
            self._released.wait()  # the disk stopped answering: no timeout, like the syscall
        if name in self._fail_ops or (self._fail is not None and self._fail(self.steps, name)):
            raise OSError(self.errno, os.strerror(self.errno))

    def _read_fault(self, kind: str, path: str) -> None:
        if self.crashed:
            raise SimulatedCrash("machine already crashed")
        self.reads.append((kind, path))
        fail = self._fail_reads
        if (callable(fail) and fail(kind, path)) or (not callable(fail) and kind in fail):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    @staticmethod
    def _dir(path: str) -> str:
        return os.path.dirname(os.path.abspath(path))

    @staticmethod
    def _read_or_none(path: str) -> bytes | None:
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except (FileNotFoundError, IsADirectoryError):
            return None

    @staticmethod
    def _mode_or_none(path: str) -> int | None:
        try:
            return os.lstat(path).st_mode & 0o7777
        except FileNotFoundError:
            return None

    @staticmethod
    def _put(path: str, content: bytes, mode: int | None = None) -> None:
        with open(path, "wb") as fh:
            fh.write(content)
        # A restored file is the old inode as far as the model goes: it keeps its old permission
        # bits (open() would otherwise create it with the umask default, e.g. 0644).
        if mode is not None:
            os.chmod(path, mode)

    # -- FileOps ----------------------------------------------------------------------------
    def open_excl(self, path: str, mode: int) -> int:
        self._step("open")
        fd = super().open_excl(path, mode)
        path = os.path.abspath(path)
        self._fd_path[fd] = path
        self._dirty[path] = b""
        self._pending.append((self._dir(path), "create", path))
        return fd

    def write(self, fd: int, data: Buffer | Sequence[Buffer]) -> None:
        self._step("write")
        super().write(fd, data)

    def fsync(self, fd: int) -> None:
        self._step("fsync")
        super().fsync(fd)
        self._dirty.pop(self._fd_path.get(fd, ""), None)

    def close(self, fd: int) -> None:
        # close is not a durability point and never fails in the model; not a step.
        self._fd_path.pop(fd, None)
        super().close(fd)

    def rename(self, src: str, dst: str) -> None:
        self._step("rename")
        src, dst = os.path.abspath(src), os.path.abspath(dst)
        prior = self._read_or_none(dst)
        prior_mode = self._mode_or_none(dst)
        super().rename(src, dst)
        if src in self._dirty:
            self._dirty[dst] = self._dirty.pop(src)
        self._pending.append((self._dir(dst), "rename", src, dst, prior, prior_mode))

    def fsync_dir(self, path: str) -> None:
        self._step("dirsync")
        super().fsync_dir(path)
        directory = os.path.abspath(path)
        self._pending = [p for p in self._pending if p[0] != directory]

    def unlink(self, path: str) -> None:
        self._step("unlink")
        path = os.path.abspath(path)
        content = self._read_or_none(path)
        mode = self._mode_or_none(path)
        super().unlink(path)
        self._dirty.pop(path, None)
        if content is not None:
            self._pending.append((self._dir(path), "unlink", path, content, mode))

    def link(self, src: str, dst: str) -> None:
        self._step("link")
        src, dst = os.path.abspath(src), os.path.abspath(dst)
        super().link(src, dst)
        if src in self._dirty:
            self._dirty[dst] = self._dirty[src]
        self._pending.append((self._dir(dst), "create", dst))

    # -- reads: never steps, but they can fail or lie ---------------------------------------
    def read_file(self, path: str) -> bytes:
        self._read_fault("read", path)
        data = super().read_file(path)
        return self._corrupt_reads(path, data) if self._corrupt_reads is not None else data

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        self._read_fault("read", path)
        data = super().read_range(path, offset, length)
        # bounded reads (index entries, headers, blockwise versions) see the hook too
        return self._corrupt_reads(path, data) if self._corrupt_reads is not None else data

    def readinto(self, path: str, region: memoryview):
        self._read_fault("read", path)
        if self._corrupt_reads is None:
            return super().readinto(path, region)
        data = self._corrupt_reads(path, super().read_file(path))
        if len(data) > len(region):
            return data, len(data)
        region[: len(data)] = data
        return region[: len(data)], len(data)

    def listdir(self, path: str) -> list[str]:
        self._read_fault("list", path)
        return super().listdir(path)

    def stat(self, path: str) -> os.stat_result:
        self._read_fault("stat", path)
        return super().stat(path)

    def mkdir(self, path: str, mode: int) -> None:
        self._step("mkdir")
        super().mkdir(path, mode)
        self._pending.append((self._dir(path), "mkdir", os.path.abspath(path)))

    # -- power loss ---------------------------------------------------------------------------
    def crash(self) -> None:
        """Undo every effect the kernel had not yet made durable."""
        self.crashed = True
        for path, durable in self._dirty.items():
            if os.path.exists(path):
                self._put(path, durable)
        for entry in reversed(self._pending):
            op = entry[1]
            if op == "create":
                if os.path.exists(entry[2]):
                    os.unlink(entry[2])
            elif op == "rename":
                _, _, src, dst, prior, prior_mode = entry
                if os.path.exists(dst):
                    os.rename(dst, src)
                if prior is not None:
                    self._put(dst, prior, prior_mode)
            elif op == "unlink":
                self._put(entry[2], entry[3], entry[4])
            elif op == "mkdir":
                shutil.rmtree(entry[2], ignore_errors=True)
        self._dirty.clear()
        self._pending.clear()
        for fd in list(self._fd_path):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fd_path.clear()


class LoggingChunkReader:
    """A POSIX store's reader-process recipe target (``_EnvChunks.worker_reader``) that
    appends each chunk it reads to ``log_path`` (one content id per line) and sleeps
    ``delay_s`` before reading any chunk but ``fast`` (a content id): tests see which reads
    reader processes made after a refusal."""

    def __init__(self, root: str, log_path: str, delay_s: float, fast: bytes) -> None:
        from ..store.packstore import posix_chunk_reader

        self.inner = posix_chunk_reader(root)
        self.log_path, self.delay_s, self.fast = log_path, delay_s, fast

    def read_into(self, ref, region):
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, ref.content_id.hex().encode() + b"\n")
        finally:
            os.close(fd)
        if ref.content_id != self.fast:
            time.sleep(self.delay_s)
        return self.inner.read_into(ref, region)
