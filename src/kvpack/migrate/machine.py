"""The pure two-phase transfer state machine and status vocabulary (INTEROP.md D.4).

No I/O here: the orchestrators (:mod:`.decode_tier`, :mod:`.storage_tier`) ask this module what
is allowed and what to do next, and the journal (:mod:`.journal`) records the answer durably
before anything acts on it.

Statuses
--------
Outgoing: ``starting``, ``prepared``, ``transferring``, ``destination_committed``,
``destination_committed_source_retained``, ``completed``, ``ambiguous``, ``source_restored``,
``source_restored_remote_retained``. Incoming: ``prepared``, ``uploaded``, ``committed``.

The move invariant
------------------
The source is deleted only when ``destination_committed`` (or
``destination_committed_source_retained``) is on record (:func:`may_delete_source`). Every error
before that records ``ambiguous`` (:func:`failure_status`); an ambiguous transfer is resolved
only by *looking up* the destination's status (:func:`plan`), never by guessing. A status at or
past the destination commit is kept when a later step fails, with the error attached.
"""

from __future__ import annotations

from dataclasses import dataclass

STARTING = "starting"
PREPARED = "prepared"
TRANSFERRING = "transferring"
DESTINATION_COMMITTED = "destination_committed"
DESTINATION_COMMITTED_SOURCE_RETAINED = "destination_committed_source_retained"
COMPLETED = "completed"
AMBIGUOUS = "ambiguous"
SOURCE_RESTORED = "source_restored"
SOURCE_RESTORED_REMOTE_RETAINED = "source_restored_remote_retained"

UPLOADED = "uploaded"
COMMITTED = "committed"

OUTGOING_STATUSES = (
    STARTING,
    PREPARED,
    TRANSFERRING,
    DESTINATION_COMMITTED,
    DESTINATION_COMMITTED_SOURCE_RETAINED,
    COMPLETED,
    AMBIGUOUS,
    SOURCE_RESTORED,
    SOURCE_RESTORED_REMOTE_RETAINED,
)
INCOMING_STATUSES = (PREPARED, UPLOADED, COMMITTED)

#: Statuses a failure never overwrites (D.4 "Failure recording").
KEPT_ON_FAILURE = frozenset({COMPLETED, DESTINATION_COMMITTED, DESTINATION_COMMITTED_SOURCE_RETAINED, SOURCE_RESTORED, SOURCE_RESTORED_REMOTE_RETAINED})
#: The destination's durable commit is on record: the only statuses that allow a source delete.
DESTINATION_DURABLE = frozenset({DESTINATION_COMMITTED, DESTINATION_COMMITTED_SOURCE_RETAINED})

MODES = ("copy", "move")
TIERS = ("decode", "storage")

# Allowed outgoing transitions (export phase, then the storage restore phase).
_OUT = {
    STARTING: {PREPARED, AMBIGUOUS},
    PREPARED: {TRANSFERRING, AMBIGUOUS},
    TRANSFERRING: {DESTINATION_COMMITTED, AMBIGUOUS},
    AMBIGUOUS: {TRANSFERRING, DESTINATION_COMMITTED, AMBIGUOUS},
    DESTINATION_COMMITTED: {COMPLETED, DESTINATION_COMMITTED_SOURCE_RETAINED, SOURCE_RESTORED},
    DESTINATION_COMMITTED_SOURCE_RETAINED: {COMPLETED, DESTINATION_COMMITTED_SOURCE_RETAINED, SOURCE_RESTORED},
    COMPLETED: {SOURCE_RESTORED},
    SOURCE_RESTORED: {COMPLETED, SOURCE_RESTORED_REMOTE_RETAINED},
    SOURCE_RESTORED_REMOTE_RETAINED: {COMPLETED, SOURCE_RESTORED_REMOTE_RETAINED},
}
_IN = {PREPARED: {UPLOADED}, UPLOADED: {COMMITTED}, COMMITTED: set()}


class TransitionError(ValueError):
    """A transition the machine does not allow (a programming error in an orchestrator)."""


def check_transition(direction: str, old: str, new: str) -> None:
    table = _OUT if direction == "outgoing" else _IN
    if old == new and new in (AMBIGUOUS, DESTINATION_COMMITTED_SOURCE_RETAINED, SOURCE_RESTORED_REMOTE_RETAINED):
        return
    if new not in table.get(old, ()):
        raise TransitionError(f"{direction} transfer: {old} -> {new} is not allowed")


def failure_status(current: str) -> str:
    """What an error records: kept statuses stay (with the error attached), others become ambiguous."""
    return current if current in KEPT_ON_FAILURE else AMBIGUOUS


def may_delete_source(mode: str, status: str) -> bool:
    """The move invariant: only a move, and only once the destination's commit is on record."""
    return mode == "move" and status in DESTINATION_DURABLE


@dataclass(frozen=True)
class Step:
    """What the orchestrator must do next. ``offset`` is where an upload resumes."""

    action: str  # export | prepare | upload | commit | record_committed | delete_source | complete | done
    offset: int = 0


def plan(status: str, mode: str, *, have_payload: bool, destination: str | None, received: int = 0, size: int = 0) -> Step:
    """The next step of an export, from the journal status and the destination lookup.

    ``destination`` is the destination's own status for this transfer id (``None`` when it
    has no record of it, i.e. 404): the answer of a lookup, never an assumption.
    """
    if status in (COMPLETED, SOURCE_RESTORED, SOURCE_RESTORED_REMOTE_RETAINED):
        return Step("done")
    if status in DESTINATION_DURABLE:
        return Step("delete_source") if mode == "move" else Step("complete")
    if destination == COMMITTED:
        return Step("record_committed")
    if status == STARTING or not have_payload:
        return Step("export")
    if destination is None:
        return Step("prepare")
    if destination == PREPARED:
        return Step("upload", offset=received if 0 <= received <= size else 0)
    if destination == UPLOADED:
        return Step("commit")
    raise TransitionError(f"destination reports unknown status {destination!r}")
