"""The pure two-phase transfer state machine: typed transfer records, transitions, the move
invariant, the commit invariant and the reconciliation plan (INTEROP.md D.4).

Why it exists: every decision about a session transfer -- may this status follow that one, may
the source be deleted, may this commit install a session, what must a reconcile do next -- is
made here, from values passed in, so it can be tested exhaustively (hypothesis drives
interleavings of two transfers of one session plus decodes in ``tests/migrate``). What it must
never do: I/O of any kind (files, sockets, clocks, randomness). Times arrive as arguments; the
journal (:mod:`.journal`) records the records this module returns *before* anything acts on
them, and the orchestrators (:mod:`.transfer`, :mod:`.service`) perform the effects.

Statuses
--------
Outgoing: ``starting``, ``prepared``, ``transferring``, ``destination_committed``,
``destination_committed_source_retained``, ``completed``, ``ambiguous``, ``conflict``,
``source_restored``, ``source_restored_remote_retained``. Incoming: ``prepared``,
``uploaded``, ``committed``, ``conflict``.

The move invariant
------------------
The source is deleted only when ``destination_committed`` (or
``destination_committed_source_retained``) is on record (:func:`may_delete_source`). Every error
before that records ``ambiguous`` (:func:`failure_status`); an ambiguous transfer is resolved
only by *looking up* the destination's status (:func:`plan`), never by guessing. A status at or
past the destination commit is kept when a later step fails, with the error attached.

The commit invariant
--------------------
A destination installs a session only if its state for that session id is exactly the state
the transfer's prepare recorded (:class:`TransferRecord.expected`: :data:`ABSENT`, or a
:class:`Held` revision and bundle digest). Anything else -- the session was installed by
another transfer, decoded here, created here -- makes the commit a **conflict**
(:func:`commit_decision`): 409 ``conflict``, the incoming record ends ``conflict`` (final; its
payload is discarded, so it can never be installed later) and the source records ``conflict``
too (final, never ``ambiguous``: the destination has answered). A source in ``conflict`` keeps
its session, unfenced; nothing was installed at the destination.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Literal, Optional, Union


class Status(str, enum.Enum):
    """Every status a transfer record can hold (the JSON value is the enum value)."""

    STARTING = "starting"
    PREPARED = "prepared"
    TRANSFERRING = "transferring"
    DESTINATION_COMMITTED = "destination_committed"
    DESTINATION_COMMITTED_SOURCE_RETAINED = "destination_committed_source_retained"
    COMPLETED = "completed"
    AMBIGUOUS = "ambiguous"
    CONFLICT = "conflict"
    SOURCE_RESTORED = "source_restored"
    SOURCE_RESTORED_REMOTE_RETAINED = "source_restored_remote_retained"
    UPLOADED = "uploaded"
    COMMITTED = "committed"

    def __str__(self) -> str:
        return self.value


STARTING = Status.STARTING
PREPARED = Status.PREPARED
TRANSFERRING = Status.TRANSFERRING
DESTINATION_COMMITTED = Status.DESTINATION_COMMITTED
DESTINATION_COMMITTED_SOURCE_RETAINED = Status.DESTINATION_COMMITTED_SOURCE_RETAINED
COMPLETED = Status.COMPLETED
AMBIGUOUS = Status.AMBIGUOUS
CONFLICT = Status.CONFLICT
SOURCE_RESTORED = Status.SOURCE_RESTORED
SOURCE_RESTORED_REMOTE_RETAINED = Status.SOURCE_RESTORED_REMOTE_RETAINED
UPLOADED = Status.UPLOADED
COMMITTED = Status.COMMITTED

Direction = Literal["outgoing", "incoming"]
Mode = Literal["copy", "move"]
Tier = Literal["decode", "storage"]
Phase = Literal["export", "restore-pending", "restore"]

OUTGOING_STATUSES = (
    STARTING,
    PREPARED,
    TRANSFERRING,
    DESTINATION_COMMITTED,
    DESTINATION_COMMITTED_SOURCE_RETAINED,
    COMPLETED,
    AMBIGUOUS,
    CONFLICT,
    SOURCE_RESTORED,
    SOURCE_RESTORED_REMOTE_RETAINED,
)
INCOMING_STATUSES = (PREPARED, UPLOADED, COMMITTED, CONFLICT)

#: Statuses a failure never overwrites (D.4 "Failure recording"); ``conflict`` is the
#: destination's final answer and stays too.
KEPT_ON_FAILURE = frozenset(
    {COMPLETED, DESTINATION_COMMITTED, DESTINATION_COMMITTED_SOURCE_RETAINED, SOURCE_RESTORED, SOURCE_RESTORED_REMOTE_RETAINED, CONFLICT}
)
#: The destination's durable commit is on record: the only statuses that allow a source delete.
DESTINATION_DURABLE = frozenset({DESTINATION_COMMITTED, DESTINATION_COMMITTED_SOURCE_RETAINED})
#: An outgoing move in one of these statuses (export phase) fences its session at the source.
FENCING = frozenset({STARTING, PREPARED, TRANSFERRING, AMBIGUOUS, DESTINATION_COMMITTED, DESTINATION_COMMITTED_SOURCE_RETAINED})

MODES: tuple[Mode, ...] = ("copy", "move")
TIERS: tuple[Tier, ...] = ("decode", "storage")
HISTORY_LIMIT = 64

# Allowed outgoing transitions (export phase, then the storage restore phase).
_OUT: dict[Status, frozenset[Status]] = {
    STARTING: frozenset({PREPARED, AMBIGUOUS}),
    PREPARED: frozenset({TRANSFERRING, AMBIGUOUS}),
    TRANSFERRING: frozenset({DESTINATION_COMMITTED, AMBIGUOUS, CONFLICT}),
    AMBIGUOUS: frozenset({TRANSFERRING, DESTINATION_COMMITTED, AMBIGUOUS, CONFLICT}),
    CONFLICT: frozenset(),
    DESTINATION_COMMITTED: frozenset({COMPLETED, DESTINATION_COMMITTED_SOURCE_RETAINED, SOURCE_RESTORED}),
    DESTINATION_COMMITTED_SOURCE_RETAINED: frozenset({COMPLETED, DESTINATION_COMMITTED_SOURCE_RETAINED, SOURCE_RESTORED}),
    COMPLETED: frozenset({SOURCE_RESTORED}),
    SOURCE_RESTORED: frozenset({COMPLETED, SOURCE_RESTORED_REMOTE_RETAINED}),
    SOURCE_RESTORED_REMOTE_RETAINED: frozenset({COMPLETED, SOURCE_RESTORED_REMOTE_RETAINED}),
}
_IN: dict[Status, frozenset[Status]] = {
    PREPARED: frozenset({UPLOADED}),
    UPLOADED: frozenset({COMMITTED, CONFLICT}),
    COMMITTED: frozenset(),
    CONFLICT: frozenset(),
}
#: Statuses that may be recorded again over themselves (a repeated error, a re-run).
_REPEATABLE = frozenset({AMBIGUOUS, DESTINATION_COMMITTED_SOURCE_RETAINED, SOURCE_RESTORED_REMOTE_RETAINED, CONFLICT})


class TransitionError(ValueError):
    """A transition the machine does not allow (a programming error in an orchestrator)."""


# -- the destination's state of a session id -------------------------------------------------------


@dataclass(frozen=True)
class Absent:
    """No session of that id is held (nor being installed)."""


@dataclass(frozen=True)
class Held:
    """A session of that id is held at ``revision``; ``bundle_sha256`` is its committed bundle."""

    revision: int
    bundle_sha256: str


SessionState = Union[Absent, Held]
ABSENT = Absent()


# -- the typed record ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Material:
    """What an incoming prepare binds a transfer id to; a re-prepare must match it exactly."""

    session_id: str
    source: str
    mode: Mode
    tier: Tier
    bytes: int
    sha256: str
    transport_key: str
    model_sha256: str
    tokenizer_sha256: str
    template_sha256: str
    layout_abi: str
    engine_identity_sha256: str
    dflash_identity_sha256: Optional[str]
    vision_projector_sha256: Optional[str]
    vision_preprocessing_sha256: Optional[str]


@dataclass(frozen=True)
class HistoryEntry:
    status: Status
    note: str
    t: float


@dataclass(frozen=True)
class TransferRecord:
    """One transfer as its journal holds it. Immutable: every change returns a new record.

    Outgoing records use ``phase`` and ``transport_key`` (the key the source sealed with);
    incoming ones ``received`` (durable upload offset), ``installed``, ``material`` and
    ``expected`` (the destination's state of the session id when prepare ran).
    """

    id: str
    session_id: str
    direction: Direction
    mode: Mode
    tier: Tier
    destination: str  # outgoing: the destination; incoming: the source label
    status: Status
    bytes: int = 0
    sha256: str = ""
    source_deleted: bool = False
    last_error: Optional[str] = None
    transport_key: Optional[str] = None
    phase: Phase = "export"
    received: int = 0
    installed: bool = False
    material: Optional[Material] = None
    expected: Optional[SessionState] = None
    history: tuple[HistoryEntry, ...] = ()
    created: float = 0.0
    updated: float = 0.0


def new_outgoing(tid: str, session_id: str, mode: Mode, tier: Tier, destination: str, *, now: float) -> TransferRecord:
    return TransferRecord(
        id=tid,
        session_id=session_id,
        direction="outgoing",
        mode=mode,
        tier=tier,
        destination=destination,
        status=STARTING,
        history=(HistoryEntry(STARTING, "created", now),),
        created=now,
    )


def new_incoming(tid: str, material: Material, expected: SessionState, *, now: float) -> TransferRecord:
    return TransferRecord(
        id=tid,
        session_id=material.session_id,
        direction="incoming",
        mode=material.mode,
        tier=material.tier,
        destination=material.source,
        status=PREPARED,
        bytes=material.bytes,
        sha256=material.sha256,
        transport_key=material.transport_key,
        material=material,
        expected=expected,
        history=(HistoryEntry(PREPARED, "created", now),),
        created=now,
    )


# -- transitions -----------------------------------------------------------------------------------------


def check_transition(direction: Direction, old: Status, new: Status) -> None:
    table = _OUT if direction == "outgoing" else _IN
    if old == new and new in _REPEATABLE:
        return
    if new not in table.get(old, frozenset()):
        raise TransitionError(f"{direction} transfer: {old} -> {new} is not allowed")


def _log(rec: TransferRecord, status: Status, text: str, now: float) -> tuple[HistoryEntry, ...]:
    return (*rec.history, HistoryEntry(status, text, now))[-HISTORY_LIMIT:]


def transition(rec: TransferRecord, status: Status, text: str, *, now: float, **changes: object) -> TransferRecord:
    """``rec`` moved to ``status`` (checked against the tables), with ``changes`` applied."""
    check_transition(rec.direction, rec.status, status)
    return replace(rec, status=status, history=_log(rec, status, text, now), **changes)  # type: ignore[arg-type]


def note(rec: TransferRecord, text: str, *, now: float, **changes: object) -> TransferRecord:
    """``rec`` with a history note and ``changes`` but the same status."""
    return replace(rec, history=_log(rec, rec.status, text, now), **changes)  # type: ignore[arg-type]


def failure_status(current: Status) -> Status:
    """What an error records: kept statuses stay (with the error attached), others become ambiguous."""
    return current if current in KEPT_ON_FAILURE else AMBIGUOUS


def record_failure(rec: TransferRecord, error: str, *, now: float) -> TransferRecord:
    """D.4 failure recording: kept statuses keep, others become ``ambiguous``; error attached."""
    status = failure_status(rec.status)
    if status != rec.status:
        check_transition(rec.direction, rec.status, status)
    return replace(rec, status=status, last_error=error, history=_log(rec, status, f"error: {error}", now))


def may_delete_source(mode: Mode, status: Status) -> bool:
    """The move invariant: only a move, and only once the destination's commit is on record."""
    return mode == "move" and status in DESTINATION_DURABLE


def fences(rec: TransferRecord) -> bool:
    """Does ``rec`` fence its session at the source (an unfinished outgoing move)?"""
    return rec.direction == "outgoing" and rec.mode == "move" and rec.phase == "export" and rec.status in FENCING


# -- the destination side: prepare and commit decisions -----------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What the destination must do. ``verdict``: ``create`` / ``existing`` / ``proceed`` /
    ``finish_install`` / ``refuse``; a refusal names its error category and reason."""

    verdict: Literal["create", "existing", "proceed", "finish_install", "refuse"]
    category: str = ""
    reason: str = ""


def prepare_decision(existing: Optional[TransferRecord], material: Material, observed: SessionState) -> Decision:
    """An incoming prepare: idempotent for the same material, else refused or created.

    ``observed`` is the destination's state of the session id now; a new transfer records it
    as its expectation. A session already held here is refused (a copy never replaces a session
    that may have diverged: revisions alone cannot prove the held one is an ancestor).
    """
    if existing is not None:
        if existing.direction != "incoming" or existing.material != material:
            return Decision("refuse", "conflict", f"transfer {existing.id} is already bound to other material")
        return Decision("existing")
    if observed != ABSENT:
        return Decision("refuse", "conflict", f"session {material.session_id} already exists on this node")
    return Decision("create")


def commit_decision(rec: TransferRecord, observed: SessionState) -> Decision:
    """An incoming commit, judged against the destination's state of the session id now."""
    if rec.direction != "incoming":
        return Decision("refuse", "conflict", f"transfer {rec.id} is not incoming")
    if rec.status == COMMITTED:
        return Decision("existing") if rec.installed else Decision("finish_install")
    if rec.status == CONFLICT:
        return Decision("refuse", "conflict", rec.last_error or f"transfer {rec.id} conflicted with the session held here")
    if rec.status != UPLOADED:
        return Decision("refuse", "state", f"transfer {rec.id} is {rec.status}, not uploaded")
    if observed != rec.expected:
        return Decision(
            "refuse", "conflict", f"session {rec.session_id} is {describe(observed)} here, but prepare recorded {describe(rec.expected)}; not overwritten"
        )
    return Decision("proceed")


def install_decision(observed: SessionState) -> Literal["install", "already"]:
    """After the commit point (journal ``committed``, session not yet written): install unless
    the session is already there (a crash between writing it and recording ``installed``;
    nothing but this commit can create it once the commit point is on record)."""
    if isinstance(observed, Held):
        return "already"
    return "install"


def describe(state: Optional[SessionState]) -> str:
    if isinstance(state, Held):
        return f"held at revision {state.revision} (bundle {state.bundle_sha256[:12]})"
    return "absent"


# -- the source side: the reconciliation plan ------------------------------------------------------------

Action = Literal["export", "prepare", "upload", "commit", "record_committed", "record_conflict", "delete_source", "complete", "done"]


@dataclass(frozen=True)
class Step:
    """What the orchestrator must do next. ``offset`` is where an upload resumes."""

    action: Action
    offset: int = 0


def plan(status: Status, mode: Mode, *, have_payload: bool, destination: Optional[Status], received: int = 0, size: int = 0) -> Step:
    """The next step of an export, from the journal status and the destination lookup.

    ``destination`` is the destination's own status for this transfer id (``None`` when it
    has no record of it, i.e. 404): the answer of a lookup, never an assumption.
    """
    if status in (COMPLETED, SOURCE_RESTORED, SOURCE_RESTORED_REMOTE_RETAINED, CONFLICT):
        return Step("done")
    if status in DESTINATION_DURABLE:
        return Step("delete_source") if mode == "move" else Step("complete")
    if destination == COMMITTED:
        return Step("record_committed")
    if destination == CONFLICT:
        return Step("record_conflict")
    if status == STARTING or not have_payload:
        return Step("export")
    if destination is None:
        return Step("prepare")
    if destination == PREPARED:
        return Step("upload", offset=received if 0 <= received <= size else 0)
    if destination == UPLOADED:
        return Step("commit")
    raise TransitionError(f"destination reports unknown status {destination!r}")
