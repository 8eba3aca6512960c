"""The durable replay ledger (INTEROP.md C.9, INTEROP-C-ERRATA L3).

HMAC and mTLS prove *who* sent a transfer and *what* it contains; only this ledger proves *when*:
that a validly sealed transfer is not a replay of one already installed. It records, per
``key_id:epoch``, the highest generation ever reserved, and refuses anything at or below it.

File format (byte-compatible with the Rust receiver's ``serde_json::to_vec_pretty`` + ``"\\n"``)::

    {
      "highest_generation": {
        "<key_id>:<epoch>": <u64>
      }
    }

Rules:

* load: the file must be a regular, non-symlink file with no group/other mode bits (the same
  protected-file reader as key files); a missing file is created empty through the durable write
  pattern; unknown fields, duplicate keys and non-u64 values are refused;
* admission, in this order: degraded latch, generation 0, replay (``generation <= watermark``),
  epoch below the configured minimum (upstream checks the epoch after replay, L4);
* reservation (after the seal verified and every component prepared, before publication and
  ACK): admission again, then the new watermark is written with :func:`kvpack.durable.atomic_write`
  (temp O_EXCL 0600, write, fsync, rename, directory fsync). Only after that succeeds does the
  in-memory watermark move. If it fails the ledger *latches degraded*: every later admission is
  refused until the process restarts, because a durability layer that keeps going after failing
  to be durable would admit replays after the next crash;
* concurrency: one lock serialises admissions within the process; an exclusive ``flock`` on a
  sibling lock file refuses a second process (or a second open) on the same ledger, since two
  writers would each believe their own watermark.

The pure rules (:func:`admission_refusal`, :func:`encode_ledger`, :func:`decode_ledger`) are
separate from :class:`ReplayLedger`, which does the file I/O.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import threading
from collections.abc import Mapping

from ..durable import REAL_OPS, FileOps, atomic_write, ensure_dir
from ..errors import DurableIOError, SecurityError
from .secret_files import read_protected_file

U64_MAX = (1 << 64) - 1
#: Bound on the ledger file: one key_id:epoch entry is < 200 bytes; this allows ~80k of them.
LEDGER_MAX_BYTES = 16 << 20


# -- pure rules ---------------------------------------------------------------------------------


def ledger_key(key_id: str, epoch: int) -> str:
    """The map key of a counter space. ``key_id`` containing ':' would be ambiguous (L3)."""
    return f"{key_id}:{epoch}"


def _is_u64(value: object) -> bool:
    return type(value) is int and 0 <= value <= U64_MAX


def _check_admission_args(key_id: object, epoch: object, generation: object) -> None:
    if not isinstance(key_id, str) or not key_id:
        raise SecurityError("replay", f"key_id must be a non-empty string, got {key_id!r}")
    if not _is_u64(epoch):
        raise SecurityError("epoch", f"epoch must be a u64 integer, got {epoch!r}")
    if not _is_u64(generation):
        raise SecurityError("replay", f"generation must be a u64 integer, got {generation!r}")


def admission_refusal(
    highest: Mapping[str, int],
    key_id: str,
    epoch: int,
    generation: int,
    *,
    minimum_epoch: int,
    degraded: str | None,
) -> SecurityError | None:
    """Return the refusal for this admission, or None when it is admissible. Pure."""
    if degraded is not None:
        return SecurityError(
            "degraded",
            f"replay ledger latched degraded after a failed reservation ({degraded}); all "
            "traffic is refused until storage is repaired and the receiver restarts",
        )
    if generation == 0:
        return SecurityError("replay", "generation 0 is never admissible (ZeroGeneration)")
    watermark = highest.get(ledger_key(key_id, epoch))
    if watermark is not None and generation <= watermark:
        what = "replayed" if generation == watermark else "stale"
        return SecurityError(
            "replay",
            f"{what} generation {generation} for {ledger_key(key_id, epoch)}: the highest reserved generation is {watermark}",
        )
    if epoch < minimum_epoch:
        return SecurityError("epoch", f"HMAC epoch {epoch} is below the configured minimum {minimum_epoch}")
    return None


def encode_ledger(highest: Mapping[str, int]) -> bytes:
    """The exact bytes the Rust receiver writes: pretty JSON, sorted keys, trailing newline."""
    body = json.dumps(
        {"highest_generation": dict(sorted(highest.items()))},
        indent=2,
        sort_keys=True,
        ensure_ascii=False,
    )
    return body.encode("utf-8") + b"\n"


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def decode_ledger(data: bytes, *, source: str = "replay ledger") -> dict[str, int]:
    """Parse ledger bytes strictly (deny unknown fields, u64 values); return the watermarks."""
    try:
        obj = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_refuse_constant,
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise SecurityError("ledger", f"{source} is not valid ledger JSON: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != {"highest_generation"}:
        raise SecurityError("ledger", f"{source} must be an object with exactly the field 'highest_generation'")
    table = obj["highest_generation"]
    if not isinstance(table, dict):
        raise SecurityError("ledger", f"{source}: 'highest_generation' must be an object")
    for key, value in table.items():
        if not _is_u64(value):
            raise SecurityError("ledger", f"{source}: watermark for {key!r} must be a u64 integer, got {value!r}")
    return dict(table)


# -- the file-backed ledger -------------------------------------------------------------------------

_STALE_TEMP = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{16}\.tmp$")


class ReplayLedger:
    """A replay ledger file, opened exclusively by this process.

    Use :meth:`open`; call :meth:`admit` when a begin arrives and :meth:`reserve` after the seal
    verified and before anything is published or acknowledged. :meth:`close` releases the lock
    (a process exit releases it too).
    """

    def __init__(self, path: str, *, minimum_epoch: int, ops: FileOps, lock_fd: int, highest: dict[str, int]) -> None:
        self.path = path
        self.minimum_epoch = minimum_epoch
        self._ops = ops
        self._lock_fd = lock_fd
        self._highest = highest
        self._degraded: str | None = None
        self._mutex = threading.Lock()

    # -- opening -------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        minimum_epoch: int = 1,
        ops: FileOps = REAL_OPS,
    ) -> "ReplayLedger":
        """Lock, load (or create empty) the ledger at ``path``."""
        if not _is_u64(minimum_epoch) or minimum_epoch < 1:
            raise SecurityError("config", f"minimum_hmac_epoch must be >= 1, got {minimum_epoch!r}")
        target = os.path.abspath(os.fspath(path))
        directory, name = os.path.split(target)
        try:
            ensure_dir(directory, ops=ops)
        except DurableIOError as exc:
            raise SecurityError("ledger", f"cannot create ledger directory {directory!r}: {exc}") from exc
        lock_fd = _acquire_lock(os.path.join(directory, f".{name}.lock"), target)
        try:
            _remove_stale_temps(directory, name)
            if os.path.lexists(target):
                data = read_protected_file(target, what="replay ledger", max_size=LEDGER_MAX_BYTES, category="ledger")
                highest = decode_ledger(data, source=f"replay ledger {target!r}")
            else:
                highest = {}
                try:
                    atomic_write(target, encode_ledger(highest), ops=ops)
                except DurableIOError as exc:
                    raise SecurityError("ledger", f"cannot create the replay ledger {target!r}: {exc}") from exc
        except BaseException:
            os.close(lock_fd)
            raise
        return cls(target, minimum_epoch=minimum_epoch, ops=ops, lock_fd=lock_fd, highest=highest)

    # -- queries -------------------------------------------------------------------------------
    @property
    def degraded(self) -> str | None:
        """The reason the ledger latched degraded, or None while healthy."""
        return self._degraded

    def watermark(self, key_id: str, epoch: int) -> int | None:
        with self._mutex:
            return self._highest.get(ledger_key(key_id, epoch))

    def snapshot(self) -> dict[str, int]:
        with self._mutex:
            return dict(self._highest)

    # -- admission and reservation --------------------------------------------------------------
    def _refuse_if_inadmissible(self, key_id: str, epoch: int, generation: int) -> None:
        """The C.9 admission rules against the current state; call with the mutex held."""
        refusal = admission_refusal(
            self._highest,
            key_id,
            epoch,
            generation,
            minimum_epoch=self.minimum_epoch,
            degraded=self._degraded,
        )
        if refusal is not None:
            raise refusal

    def admit(self, key_id: str, epoch: int, generation: int) -> None:
        """Refuse (typed SecurityError) unless this generation may still be reserved."""
        self._ensure_open()
        _check_admission_args(key_id, epoch, generation)
        with self._mutex:
            self._refuse_if_inadmissible(key_id, epoch, generation)

    def reserve(self, key_id: str, epoch: int, generation: int) -> None:
        """Admit again and durably record ``generation`` as the new watermark.

        Returns only once the watermark is on disk (file and directory fsynced). Any failure
        latches the ledger degraded and raises ``SecurityError('degraded')``: the caller must not
        publish or acknowledge the transfer.
        """
        self._ensure_open()
        _check_admission_args(key_id, epoch, generation)
        with self._mutex:
            self._refuse_if_inadmissible(key_id, epoch, generation)
            proposed = dict(self._highest)
            proposed[ledger_key(key_id, epoch)] = generation
            try:
                atomic_write(self.path, encode_ledger(proposed), ops=self._ops)
            except Exception as exc:  # noqa: BLE001 - any failure to be durable latches
                self._degraded = f"{type(exc).__name__}: {exc}"
                raise SecurityError(
                    "degraded",
                    f"durable reservation of generation {generation} for "
                    f"{ledger_key(key_id, epoch)} failed ({exc}); the ledger is latched "
                    "degraded until restart",
                ) from exc
            self._highest = proposed

    # -- lifetime --------------------------------------------------------------------------------
    def _ensure_open(self) -> None:
        if self._lock_fd < 0:
            raise SecurityError("ledger", f"replay ledger {self.path!r} is closed")

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = -1

    def __enter__(self) -> "ReplayLedger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort for forgotten ledgers
        try:
            self.close()
        except Exception:
            pass


def _acquire_lock(lock_path: str, target: str) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(lock_path, flags, 0o600)
    except OSError as exc:
        raise SecurityError("ledger", f"cannot open ledger lock {lock_path!r}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = ""
        try:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            pass
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise SecurityError(
                "ledger",
                f"replay ledger {target!r} is already open in another process"
                + (f" (pid {holder})" if holder else "")
                + "; two writers would each trust their own watermark",
            ) from None
        raise SecurityError("ledger", f"cannot lock {lock_path!r}: {exc.strerror}") from None
    # The pid is informational only (for the refusal message above), hence not fsynced.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _remove_stale_temps(directory: str, name: str) -> None:
    """Remove temp files a crashed reservation left behind (we hold the lock, so none is live)."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in entries:
        match = _STALE_TEMP.match(entry)
        if match and match.group("name") == name:
            try:
                os.unlink(os.path.join(directory, entry))
            except OSError:
                pass
