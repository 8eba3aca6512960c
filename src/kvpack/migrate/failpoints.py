"""Named failure points for the executed failure-mode matrix (docs/failure-modes.md).

A failure point is a named place in the transfer code where a test can make the process die
or fail *for real*: ``KVPACK_FAILPOINTS="name=action;name2=action"`` in the environment of a
node process. Actions:

* ``kill``: the process sends itself SIGKILL (no cleanup, no reply, exactly a crash);
* ``error``: the step raises ``MigrationError("transport", "injected ...")`` as an I/O
  failure would (e.g. a failed delete);
* ``lost``: used where a reply arrives: the reply is discarded and the step fails as if the
  connection had dropped after the peer acted (a lost reply);
* ``kill@N``: for byte-counting points (uploads), SIGKILL once N bytes have been handed to
  the connection.

Unset (production), every point is a no-op: one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

from ..errors import MigrationError

ENV = "KVPACK_FAILPOINTS"


def _table() -> dict[str, str]:
    raw = os.environ.get(ENV, "")
    out = {}
    for item in raw.split(";"):
        if "=" in item:
            name, action = item.split("=", 1)
            out[name.strip()] = action.strip()
    return out


def action(name: str) -> str | None:
    return _table().get(name)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def hit(name: str) -> None:
    """Run the failure configured for ``name`` (``kill`` or ``error``), if any."""
    act = action(name)
    if act is None:
        return
    if act == "kill":
        die()
    if act in ("error", "lost"):
        raise MigrationError("transport", f"injected failure at {name}")


def byte_threshold(name: str) -> int | None:
    """N of a ``kill@N`` action at ``name``; None when not configured."""
    act = action(name)
    if act and act.startswith("kill@"):
        return int(act[5:])
    return None
