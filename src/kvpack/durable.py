"""The one durable-I/O seam: every durable write in kvpack goes through this module.

Pattern (DESIGN.md principle 4): create a temporary file next to the target with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, write everything, ``fsync`` it, rename it
over the target, then ``fsync`` the directory so the rename itself is durable. A crash at any
point leaves either the old file or the new one, never a mix.

All system calls go through a :class:`FileOps` object so tests can substitute a
fault-injecting layer (:mod:`kvpack.testing.faults`) that fails fsync with EIO, loses
unsynced writes, or crashes at step N.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Optional, Union

from .errors import DurableIOError

Buffer = Union[bytes, bytearray, memoryview]


#: buffers one writev call takes at most (POSIX IOV_MAX is at least 16; Linux allows 1024)
_IOV_MAX = 64


class FileOps:
    """Real system calls. Subclassed by the fault-injecting test layer."""

    def open_excl(self, path: str, mode: int) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        return os.open(path, flags, mode)

    def write(self, fd: int, data: Buffer | Sequence[Buffer]) -> None:
        """Write all of ``data``: one buffer, or a sequence of buffers gathered with
        ``writev`` (one object built from parts -- header, payload, padding -- is written
        without first joining the parts into one more copy)."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data).cast("B")
            while view:
                written = os.write(fd, view)
                view = view[written:]
            return
        views = [v for v in (memoryview(p).cast("B") for p in data) if v.nbytes]
        while views:
            written = os.writev(fd, views[:_IOV_MAX])
            while views and written >= views[0].nbytes:
                written -= views[0].nbytes
                views.pop(0)
            if written:
                views[0] = views[0][written:]

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def link(self, src: str, dst: str) -> None:
        """Create ``dst`` as a new name of ``src``; fails with EEXIST if ``dst`` exists (the
        create-only publication of an immutable object)."""
        os.link(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(path, mode)

    # -- reads (not durability points; the fault layer can fail or corrupt them) -------------
    def read_file(self, path: str) -> bytes:
        with open(path, "rb", buffering=0) as fh:
            return fh.read()

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        with open(path, "rb", buffering=0) as fh:
            return os.pread(fh.fileno(), length, offset)

    def readinto(self, path: str, region: memoryview) -> tuple[bytes | memoryview, int]:
        """Read a whole file into ``region``: ``(view of region, n)``; a file larger than the
        region comes back whole as bytes (for a decoder to refuse). Plain descriptor calls:
        a restore reads thousands of chunk objects through here."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            n = 0
            while n < len(region):
                got = os.readv(fd, [region[n:]])
                if not got:
                    break
                n += got
            if n == len(region):
                rest = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
                if rest:
                    return region.tobytes() + rest, n + len(rest)
            return region[:n], n
        finally:
            os.close(fd)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def stat(self, path: str) -> os.stat_result:
        return os.stat(path)


REAL_OPS = FileOps()


def temp_path_for(path: str) -> str:
    """A fresh temporary name in the target's directory (same filesystem, so rename is atomic)."""
    directory, name = os.path.split(path)
    return os.path.join(directory or ".", f".{name}.{secrets.token_hex(8)}.tmp")


def atomic_write(
    path: str | os.PathLike[str],
    data: Buffer | Iterable[Buffer],
    *,
    ops: FileOps = REAL_OPS,
    mode: int = 0o600,
    sync_dir: bool = True,
    replace: bool = True,
) -> bool:
    """Durably replace ``path`` with ``data`` (one buffer, or an iterable of buffers that
    are the parts of one object: written with one gathered ``FileOps.write``, one step).

    With ``replace=False`` the target is created only if it does not exist (``link`` instead
    of ``rename``): returns False, writing nothing, when it already exists.

    Raises :class:`DurableIOError` naming the step that failed. On failure the temporary file
    is removed (best effort) and the target is untouched.
    """
    target = os.fspath(path)
    tmp = temp_path_for(target)
    step = "open"
    fd = -1
    try:
        fd = ops.open_excl(tmp, mode)
        step = "write"
        ops.write(fd, data if isinstance(data, (bytes, bytearray, memoryview)) else tuple(data))
        step = "fsync"
        ops.fsync(fd)
        ops.close(fd)
        fd = -1
        step = "rename"
        if replace:
            ops.rename(tmp, target)
            tmp = ""
        else:
            try:
                ops.link(tmp, target)
            except FileExistsError:
                return False  # the finally clause removes the temp file
        if sync_dir:
            step = "dirsync"
            ops.fsync_dir(os.path.dirname(target) or ".")
        return True
    except OSError as exc:
        raise DurableIOError(step, f"{target}: {os.strerror(exc.errno or errno.EIO)}") from exc
    finally:
        if fd >= 0:
            try:
                ops.close(fd)
            except OSError:
                pass
        if tmp:
            try:
                ops.unlink(tmp)
            except OSError:
                pass


def sync_dir(path: str | os.PathLike[str], *, ops: FileOps = REAL_OPS) -> None:
    """fsync a directory, e.g. once after a batch of renames written with ``sync_dir=False``."""
    target = os.fspath(path)
    try:
        ops.fsync_dir(target)
    except OSError as exc:
        raise DurableIOError("dirsync", f"{target}: {os.strerror(exc.errno or errno.EIO)}") from exc


def durable_unlink(path: str | os.PathLike[str], *, ops: FileOps = REAL_OPS) -> bool:
    """Remove ``path`` and make the removal durable. Returns False if it did not exist."""
    target = os.fspath(path)
    try:
        ops.unlink(target)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise DurableIOError("rename", f"unlink {target}: {exc.strerror}") from exc
    try:
        ops.fsync_dir(os.path.dirname(target) or ".")
    except OSError as exc:
        raise DurableIOError("dirsync", f"{target}: {exc.strerror}") from exc
    return True


def ensure_dir(path: str | os.PathLike[str], *, mode: int = 0o700, ops: FileOps = REAL_OPS) -> None:
    """Create ``path`` (and parents) if missing, fsyncing each parent so the entry is durable."""
    target = os.path.abspath(os.fspath(path))
    if os.path.isdir(target):
        return
    parent = os.path.dirname(target)
    if parent != target:
        ensure_dir(parent, mode=mode, ops=ops)
    try:
        ops.mkdir(target, mode)
    except FileExistsError:
        return
    except OSError as exc:
        raise DurableIOError("open", f"mkdir {target}: {exc.strerror}") from exc
    try:
        ops.fsync_dir(parent)
    except OSError as exc:
        raise DurableIOError("dirsync", f"{parent}: {exc.strerror}") from exc


def call_with_deadline(fn: Callable[[], None], deadline_s: float, *, name: str = "kvpack-durable-io") -> Optional[threading.Thread]:
    """Run ``fn`` (durable I/O) on a daemon thread and wait for it at most ``deadline_s``.

    Returns None once it finished (re-raising what it raised, ``BaseException`` included),
    or the thread still running when the deadline passed: a disk that stopped answering (an
    fsync that never returns) holds that thread, never the caller. The caller decides what
    an unfinished write means (the replay ledger latches degraded); a daemon thread never
    holds the process's exit."""
    box: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    if not done.wait(max(0.0, deadline_s)):
        return thread
    if box:
        raise box[0]
    return None
