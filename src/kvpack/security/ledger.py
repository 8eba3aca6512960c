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
  refused (category ``ledger_unavailable``: the node cannot currently prove freshness, which is
  not a replay and must not page as one) until the latch is cleared, because a durability layer
  that keeps going after failing to be durable would admit replays after the next crash;
* reordering (kvpack decision, docs/security.md): concurrent transfers of one producer finish
  out of generation order, so a strict "refuse anything at or below the watermark" would refuse
  every transfer that finished second. Within one process a generation *below* the watermark
  is still admissible when it is above the watermark the file held when the ledger was opened
  (the *floor*), within :data:`REORDER_WINDOW` of the watermark, and not reserved before in
  this process (an in-memory set). Such a reservation needs no write: the durable watermark
  is already above it, so after a restart the floor refuses it. Every generation is therefore
  reserved at most once, ever; only the order of reservation is relaxed, never replay
  protection. The window is opt-in (``ReplayLedger.open(..., strict=False)``, what the decode
  node does); the default keeps upstream's rule;
* deadlines: no wait for the ledger is unbounded. An admission or reservation waits for the
  lock at most ``io_deadline_s`` (:data:`LEDGER_IO_DEADLINE_S`), and a reservation's durable
  writes run on a helper thread it waits for at most as long; past that it is refused
  ``ledger_unavailable`` and nothing is reserved in memory. A write that did not return
  latches the ledger degraded (its outcome is unknown: the file may later hold the new
  watermark) and the latch cannot clear while that write is still outstanding; once it
  returns, the usual fresh probe clears it and the re-read keeps whatever the write left on
  disk. Reads for the status page (:meth:`ReplayLedger.snapshot`) take no lock;
* concurrency: one lock serialises admissions within the process; an exclusive ``flock`` on a
  sibling lock file refuses a second process (or a second open) on the same ledger, since two
  writers would each believe their own watermark;
* rollback detection (:mod:`.ledger_witness`): every reservation also records its watermark in
  ``<ledger>.witness`` (after the ledger is durable, so the witness never exceeds it; its rename
  becomes durable with the next reservation's directory fsync or at close, so after a power loss
  it may trail the ledger by one reservation). :meth:`ReplayLedger.open` refuses (``rollback``)
  a ledger that is missing, older or emptied against its witness, or a non-empty ledger without
  one. Recovery is an operator's act: a new HMAC epoch (enrollment ``--rotate``: older epochs are
  not compared, their seals are refused anyway) or :func:`reset_ledger` (``kvpack ledger
  reset``), which only moves watermarks forward and appends to ``<ledger>.resets.log``;
* the degraded latch clears without a restart through :meth:`ReplayLedger.clear_degraded`,
  given a fresh passing probe of the ledger's volume (:mod:`.probe`); it re-reads the file and
  refuses if it went backwards. The node daemons call it themselves (``kvpack.node.ledger_gate``):
  an admission that finds the ledger latched re-probes the volume (at most every few seconds)
  and the transfer proceeds once the probe passes, so freeing space heals the node.

The pure rules (:func:`admission_refusal`, :func:`encode_ledger`, :func:`decode_ledger`) are
separate from :class:`ReplayLedger`, which does the file I/O.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from ..durable import REAL_OPS, FileOps, atomic_write, call_with_deadline, ensure_dir, sync_dir
from ..errors import DurableIOError, SecurityError
from ..vocab import FileLock, LockHeld, StrictJsonError, strict_json_loads
from .ledger_witness import decode_witness, encode_witness, merge, rollback_refusal, witness_path
from .probe import PROBE_MAX_TAIL_MS, ProbeResult
from .secret_files import read_protected_file

log = logging.getLogger("kvpack.security.ledger")
RESET_LOG_SUFFIX = ".resets.log"

U64_MAX = (1 << 64) - 1
#: How far below the watermark a generation may still be admitted within one process: the
#: decode node serves several transfers of one producer at once (concurrent requests, the
#: stripes of one request), and they finish out of generation order. See "Reordering" in the
#: module docstring.
REORDER_WINDOW = 4096
#: Bound on the ledger file: one key_id:epoch entry is < 200 bytes; this allows ~80k of them.
LEDGER_MAX_BYTES = 16 << 20
#: How long an admission waits for the ledger (its lock, a reservation's durable writes) before
#: it is refused ``ledger_unavailable``: a hung ledger volume (an fsync that never returns)
#: costs requests this long, never a thread or the node (see "Deadlines" in the docstring).
LEDGER_IO_DEADLINE_S = 5.0


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
    floor: Mapping[str, int] | None = None,
    reserved: Mapping[str, set[int]] | None = None,
    window: int = REORDER_WINDOW,
) -> SecurityError | None:
    """Return the refusal for this admission, or None when it is admissible. Pure.

    Without ``floor``/``reserved`` the rule is upstream's: refuse anything at or below the
    watermark. With them (the reordering window) a generation below the watermark is
    admissible when it is above ``floor``, within ``window`` of the watermark and not in
    ``reserved``."""
    if degraded is not None:
        return SecurityError(
            "ledger_unavailable",
            f"replay ledger latched degraded after a failed reservation ({degraded}); transfers "
            "are refused until a fresh probe of its volume passes (repair or free the volume)",
        )
    if generation == 0:
        return SecurityError("replay", "generation 0 is never admissible (ZeroGeneration)")
    key = ledger_key(key_id, epoch)
    watermark = highest.get(key)
    if watermark is not None and generation <= watermark and not _reorderable(key, generation, watermark, floor, reserved, window):
        what = "replayed" if generation == watermark or (reserved is not None and generation in reserved.get(key, ())) else "stale"
        return SecurityError(
            "replay",
            f"{what} generation {generation} for {ledger_key(key_id, epoch)}: the highest reserved generation is {watermark}",
        )
    if epoch < minimum_epoch:
        return SecurityError("epoch", f"HMAC epoch {epoch} is below the configured minimum {minimum_epoch}")
    return None


def _reorderable(key: str, generation: int, watermark: int, floor: Mapping[str, int] | None, reserved: Mapping[str, set[int]] | None, window: int) -> bool:
    if floor is None or reserved is None:
        return False
    return generation > floor.get(key, 0) and generation > watermark - window and generation not in reserved.get(key, ())


def encode_ledger(highest: Mapping[str, int]) -> bytes:
    """The exact bytes the Rust receiver writes: pretty JSON, sorted keys, trailing newline."""
    body = json.dumps(
        {"highest_generation": dict(sorted(highest.items()))},
        indent=2,
        sort_keys=True,
        ensure_ascii=False,
    )
    return body.encode("utf-8") + b"\n"


def decode_ledger(data: bytes, *, source: str = "replay ledger") -> dict[str, int]:
    """Parse ledger bytes strictly (deny unknown fields, u64 values); return the watermarks."""
    try:
        obj = strict_json_loads(data)
    except StrictJsonError as exc:
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
    """A replay ledger file and its rollback witness, opened exclusively by this process.

    Use :meth:`open`; call :meth:`admit` when a begin arrives and :meth:`reserve` after the seal
    verified and before anything is published or acknowledged. :meth:`close` releases the lock
    (a process exit releases it too).
    """

    def __init__(
        self,
        path: str,
        *,
        minimum_epoch: int,
        ops: FileOps,
        lock: FileLock,
        highest: dict[str, int],
        witness: Optional[dict[str, int]] = None,
        strict: bool = True,
        io_deadline_s: float = LEDGER_IO_DEADLINE_S,
    ) -> None:
        self.path = path
        self.io_deadline_s = io_deadline_s
        #: a ledger write that did not return within the deadline (it latched the ledger)
        self._stuck: Optional[threading.Thread] = None
        self.minimum_epoch = minimum_epoch
        self._ops = ops
        self._lock = lock
        self._highest = highest
        self._witness = dict(highest) if witness is None else witness
        self._degraded: str | None = None
        self._mutex = threading.Lock()
        #: the reordering window (module docstring): the watermarks the file held at open,
        #: and the generations reserved in this process near the watermark
        self.strict = strict
        self._floor = dict(highest)
        self._reserved: dict[str, set[int]] = {}

    # -- opening -------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        minimum_epoch: int = 1,
        ops: FileOps = REAL_OPS,
        strict: bool = True,
        io_deadline_s: float = LEDGER_IO_DEADLINE_S,
    ) -> "ReplayLedger":
        """Lock, load (or create empty) the ledger at ``path``; refuse a rolled-back one.
        ``strict`` (the default): upstream's rule; False opens the reordering window (the
        decode node, which serves concurrent transfers of one producer)."""
        if not _is_u64(minimum_epoch) or minimum_epoch < 1:
            raise SecurityError("config", f"minimum_hmac_epoch must be >= 1, got {minimum_epoch!r}")
        target = os.path.abspath(os.fspath(path))
        directory, name = os.path.split(target)
        try:
            ensure_dir(directory, ops=ops)
        except DurableIOError as exc:
            raise SecurityError("ledger", f"cannot create ledger directory {directory!r}: {exc}") from exc
        lock = _acquire_lock(os.path.join(directory, f".{name}.lock"), target)
        try:
            _remove_stale_temps(directory, name)
            highest, witness = _load_checked(target, minimum_epoch, ops)
        except BaseException:
            lock.release()
            raise
        return cls(target, minimum_epoch=minimum_epoch, ops=ops, lock=lock, highest=highest, witness=witness, strict=strict, io_deadline_s=io_deadline_s)

    # -- queries -------------------------------------------------------------------------------
    @property
    def degraded(self) -> str | None:
        """The reason the ledger latched degraded, or None while healthy."""
        return self._degraded

    # The maps are replaced, never changed in place, so reading one takes no lock: a status
    # page never waits behind a reservation stuck on a hung volume.
    def watermark(self, key_id: str, epoch: int) -> int | None:
        return self._highest.get(ledger_key(key_id, epoch))

    def snapshot(self) -> dict[str, int]:
        return dict(self._highest)

    def witness_snapshot(self) -> dict[str, int]:
        return dict(self._witness)

    @property
    def io_outstanding(self) -> bool:
        """True while a ledger write that outlived its deadline has not returned."""
        stuck = self._stuck
        return stuck is not None and stuck.is_alive()

    def wait_io(self, timeout: float) -> bool:
        """Wait at most ``timeout`` for an outstanding (stuck) write to return."""
        stuck = self._stuck
        if stuck is not None:
            stuck.join(timeout)
        return not self.io_outstanding

    def _locked(self, what: str) -> None:
        """Take the mutex within the deadline, or refuse ``ledger_unavailable``."""
        if not self._mutex.acquire(timeout=max(0.0, self.io_deadline_s)):
            raise SecurityError(
                "ledger_unavailable",
                f"replay ledger {self.path!r} busy for {self.io_deadline_s:g} s ({what}): a reservation's write has not returned (hung ledger volume?)",
            )

    def _durable(self, fn: Any, what: str) -> None:
        """Run the ledger's durable writes within the deadline (mutex held). A write that
        does not return latches the ledger and raises ``ledger_unavailable``."""
        if self.io_outstanding:
            raise SecurityError("ledger_unavailable", f"an earlier write to replay ledger {self.path!r} has not returned (hung ledger volume)")
        stuck = call_with_deadline(fn, self.io_deadline_s, name="kvpack-ledger-io")
        if stuck is not None:
            self._stuck = stuck
            self._degraded = f"{what} did not return within {self.io_deadline_s:g} s (hung ledger volume)"
            log.error("replay ledger %s: %s; latched degraded", self.path, self._degraded)
            raise SecurityError(
                "ledger_unavailable",
                f"replay ledger {self.path!r}: {self._degraded}; the ledger is latched degraded until the write returns and a fresh volume probe passes",
            )

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
            floor=None if self.strict else self._floor,
            reserved=None if self.strict else self._reserved,
        )
        if refusal is not None:
            raise refusal

    def admit(self, key_id: str, epoch: int, generation: int) -> None:
        """Refuse (typed SecurityError) unless this generation may still be reserved."""
        self._ensure_open()
        _check_admission_args(key_id, epoch, generation)
        self._locked("admission")
        try:
            self._refuse_if_inadmissible(key_id, epoch, generation)
        finally:
            self._mutex.release()

    def reserve(self, key_id: str, epoch: int, generation: int) -> None:
        """Admit again and durably record ``generation`` as the new watermark.

        Returns only once the watermark is on disk (file and directory fsynced) and the witness
        records it (its rename made durable by the next directory fsync). Any failure latches the
        ledger degraded and raises ``SecurityError('ledger_unavailable')``: the caller must not publish or
        acknowledge the transfer. Bounded: the lock within ``io_deadline_s``, the writes within
        ``io_deadline_s`` (a write that does not return latches, see "Deadlines").
        """
        self._ensure_open()
        _check_admission_args(key_id, epoch, generation)
        self._locked("reservation")
        try:
            self._reserve_locked(key_id, epoch, generation)
        finally:
            self._mutex.release()

    def _reserve_locked(self, key_id: str, epoch: int, generation: int) -> None:
        self._refuse_if_inadmissible(key_id, epoch, generation)
        key = ledger_key(key_id, epoch)
        watermark = self._highest.get(key)
        if watermark is not None and generation <= watermark:
            # inside the reordering window: the durable watermark already covers it
            self._remember(key, generation, watermark)
            return
        proposed = dict(self._highest)
        proposed[key] = generation
        witness = merge(self._witness, proposed)
        steps: list[str] = []

        def write() -> None:
            atomic_write(self.path, encode_ledger(proposed), ops=self._ops)
            steps.append("ledger")
            # After the ledger, never before: the witness must not exceed the durable ledger.
            atomic_write(witness_path(self.path), encode_witness(os.path.basename(self.path), witness), ops=self._ops, sync_dir=False)
            steps.append("witness")

        try:
            try:
                self._durable(write, f"the reservation of generation {generation} for {key}")
            finally:
                # what reached the disk moves the in-memory state (never what did not)
                if "ledger" in steps:
                    self._highest = proposed
                if "witness" in steps:
                    self._witness = witness
            self._remember(key, generation, generation)
        except SecurityError:
            raise  # a hung write: latched by _durable
        except Exception as exc:  # noqa: BLE001 - any failure to be durable latches
            self._degraded = f"{type(exc).__name__}: {exc}"
            raise SecurityError(
                "ledger_unavailable",
                f"durable reservation of generation {generation} for "
                f"{ledger_key(key_id, epoch)} failed ({exc}); the ledger is latched "
                "degraded until restart or a fresh volume probe (clear_degraded)",
            ) from exc

    def _remember(self, key: str, generation: int, watermark: int) -> None:
        """Record a reservation for the reordering window; forget what fell out of it."""
        if self.strict:
            return
        kept = {g for g in self._reserved.get(key, ()) if g > watermark - REORDER_WINDOW}
        kept.add(generation)
        self._reserved[key] = kept

    def clear_degraded(self, probe: ProbeResult, *, max_tail_ms: float = PROBE_MAX_TAIL_MS) -> None:
        """Lift the degraded latch without a restart, given a *fresh, passing* probe of this
        ledger's directory (the hook the node tier calls after re-probing its volume).

        The file is re-read first: a failed reservation may have left the new watermark on disk
        (rename done, directory fsync failed), and that higher value is kept; a file *below* what
        this process reserved refuses (``rollback``) and stays latched. The witness is rewritten
        durably. Nothing is done while healthy.
        """
        self._ensure_open()
        directory = os.path.dirname(self.path)
        if probe.directory != directory or not probe.samples_ms or probe.max_ms > max_tail_ms:
            raise SecurityError("volume", f"clear_degraded needs a passing probe of {directory!r} (got {probe.directory!r}, worst {probe.max_ms:.1f} ms)")
        self._locked("clearing the degraded latch")
        try:
            self._clear_locked()
        finally:
            self._mutex.release()

    def _clear_locked(self) -> None:
        if self._degraded is None:
            return
        if self.io_outstanding:
            raise SecurityError("ledger_unavailable", f"a write to replay ledger {self.path!r} has still not returned; the ledger stays degraded")
        on_disk = read_ledger_file(self.path)
        refusal = rollback_refusal(on_disk, self._highest, minimum_epoch=1, ledger_path=self.path)
        if refusal is not None:
            raise refusal
        highest = merge(self._highest, on_disk or {})
        witness = merge(self._witness, highest)
        try:
            self._durable(
                lambda: atomic_write(witness_path(self.path), encode_witness(os.path.basename(self.path), witness), ops=self._ops), "the witness rewrite"
            )
        except DurableIOError as exc:
            raise SecurityError("ledger_unavailable", f"the ledger volume still fails ({exc}); the ledger stays degraded") from exc
        log.warning("replay ledger %s: degraded latch cleared after a passing volume probe (was: %s)", self.path, self._degraded)
        self._highest, self._witness, self._degraded = highest, witness, None

    # -- lifetime --------------------------------------------------------------------------------
    def _ensure_open(self) -> None:
        if not self._lock.held:
            raise SecurityError("ledger", f"replay ledger {self.path!r} is closed")

    def close(self) -> None:
        if self._lock.held:
            try:
                if not self.io_outstanding:  # the last witness rename; a hung volume costs the deadline
                    call_with_deadline(lambda: sync_dir(os.path.dirname(self.path), ops=self._ops), self.io_deadline_s, name="kvpack-ledger-io")
            except DurableIOError:
                pass  # it trails by one reservation at worst (a lower bound stays a lower bound)
            finally:
                self._lock.release()  # closing the descriptor releases the flock

    def __enter__(self) -> "ReplayLedger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort for forgotten ledgers
        try:
            self._lock.release()
        except Exception:
            pass


# -- loading, with the rollback check -------------------------------------------------------------


def read_ledger_file(target: str) -> Optional[dict[str, int]]:
    """The ledger's watermarks, or None when there is no file (refusals as at open)."""
    if not os.path.lexists(target):
        return None
    data = read_protected_file(target, what="replay ledger", max_size=LEDGER_MAX_BYTES, category="ledger")
    return decode_ledger(data, source=f"replay ledger {target!r}")


def read_witness_file(target: str) -> Optional[dict[str, int]]:
    """The witness of the ledger at ``target``, or None when there is none."""
    wpath = witness_path(target)
    if not os.path.lexists(wpath):
        return None
    data = read_protected_file(wpath, what="replay ledger witness", max_size=LEDGER_MAX_BYTES, category="ledger")
    return decode_witness(data, os.path.basename(target), source=f"ledger witness {wpath!r}")


def _write(path: str, data: bytes, ops: FileOps, what: str) -> None:
    try:
        atomic_write(path, data, ops=ops)
    except DurableIOError as exc:
        raise SecurityError("ledger", f"cannot write the {what} {path!r}: {exc}") from exc


def _load_checked(target: str, minimum_epoch: int, ops: FileOps) -> tuple[dict[str, int], dict[str, int]]:
    """Read ledger and witness, refuse a rollback, create what is missing (witness first, so a
    crash in between leaves an empty witness, which proves nothing and refuses nothing)."""
    ledger = read_ledger_file(target)
    witness = read_witness_file(target)
    refusal = rollback_refusal(ledger, witness, minimum_epoch=minimum_epoch, ledger_path=target)
    if refusal is not None:
        raise refusal
    name = os.path.basename(target)
    if witness is None:
        witness = {}
        _write(witness_path(target), encode_witness(name, witness), ops, "replay ledger witness")
    if ledger is None:
        ledger = {}
        _write(target, encode_ledger(ledger), ops, "replay ledger")
    merged = merge(witness, ledger)
    if merged != witness:  # the witness trailed (a crash before its rename was durable)
        _write(witness_path(target), encode_witness(name, merged), ops, "replay ledger witness")
    return ledger, merged


def _acquire_lock(lock_path: str, target: str) -> FileLock:
    # The holder's pid goes into the lock file (informational, not fsynced) so that a refused
    # second opener can name it.
    lock = FileLock(lock_path, record_pid=True)
    try:
        return lock.acquire()
    except LockHeld as exc:
        raise SecurityError(
            "locked",
            f"replay ledger {target!r} is already open in another process"
            + (f" (pid {exc.holder_pid})" if exc.holder_pid else "")
            + "; two writers would each trust their own watermark",
        ) from None
    except OSError as exc:
        raise SecurityError("ledger", f"cannot open or lock ledger lock {lock_path!r}: {exc.strerror}") from None


def _remove_stale_temps(directory: str, name: str) -> None:
    """Remove temp files a crashed write left behind (we hold the lock, so none is live)."""
    ours = {name, name + ".witness", name + RESET_LOG_SUFFIX}
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in entries:
        match = _STALE_TEMP.fullmatch(entry)
        if match and match.group("name") in ours:
            try:
                os.unlink(os.path.join(directory, entry))
            except OSError:
                pass


# -- the operator's forward-only reset ----------------------------------------------------------------


def _read_leniently(read: Any, target: str, notes: list[str]) -> dict[str, int]:
    """A reset must work on a damaged ledger or witness: unreadable counts as empty (and is
    logged); the operator's --min-generation is the floor then."""
    try:
        return read(target) or {}
    except SecurityError as exc:
        notes.append(f"{exc.category}: {exc.message}")
        return {}


def reset_ledger(
    path: str | os.PathLike[str],
    *,
    min_generation: int,
    spaces: Sequence[str] = (),
    reason: str = "",
    ops: FileOps = REAL_OPS,
) -> dict[str, Any]:
    """Move watermarks forward, never back: each named counter space (default: every one in
    the ledger or its witness) becomes ``max(ledger, witness, min_generation)``. Writes the
    ledger, then its witness, then appends one JSON line to ``<ledger>.resets.log``; refuses
    while a receiver holds the ledger. Returns what it did (also the log line)."""
    if not _is_u64(min_generation) or min_generation < 1:
        raise SecurityError("config", f"--min-generation must be a u64 >= 1, got {min_generation!r}")
    target = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(target)
    if not os.path.isdir(directory):
        raise SecurityError("ledger", f"ledger directory {directory!r} does not exist")
    lock = _acquire_lock(os.path.join(directory, f".{name}.lock"), target)
    try:
        _remove_stale_temps(directory, name)
        notes: list[str] = []
        before = _read_leniently(read_ledger_file, target, notes)
        witness = _read_leniently(read_witness_file, target, notes)
        chosen = sorted(set(spaces) or set(before) | set(witness))
        if not chosen:
            raise SecurityError("config", "the ledger and its witness name no counter space: give one with --key KEY_ID:EPOCH")
        after = dict(before)
        for space in chosen:
            after[space] = max(before.get(space, 0), witness.get(space, 0), min_generation)
        entry = {
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "pid": os.getpid(),
            "user": _user(),
            "ledger": target,
            "min_generation": min_generation,
            "spaces": chosen,
            "before": before,
            "witness_before": witness,
            "after": after,
            "reason": reason,
            "notes": notes,
        }
        _write(target, encode_ledger(after), ops, "replay ledger")
        _write(witness_path(target), encode_witness(name, merge(witness, after)), ops, "replay ledger witness")
        _append_log(target + RESET_LOG_SUFFIX, entry, ops)
        log.warning("replay ledger %s reset forward: %s", target, json.dumps(entry, sort_keys=True))
        return entry
    finally:
        lock.release()


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name is not a reason to refuse a reset
        return f"uid {os.getuid()}"


def _append_log(log_path: str, entry: dict[str, Any], ops: FileOps) -> None:
    old = b""
    if os.path.lexists(log_path):
        old = read_protected_file(log_path, what="ledger reset log", max_size=LEDGER_MAX_BYTES, category="ledger")
    _write(log_path, old + json.dumps(entry, sort_keys=True).encode() + b"\n", ops, "ledger reset log")
