"""Where a node's commands run: over SSH (an onboarded node) or on this machine (an offline
node whose directory lives in the cluster directory, e.g. the admin's own receiver).

Both run the same ``kvpack`` subcommands with the same arguments, so the wizard never
branches on where a peer lives: it asks a :class:`NodeHost` to run ``kvpack node-local
...``, ``kvpack probe-volume ...`` or ``kvpack request ...`` with a deadline, and gets the
exit status and bounded output back. A refusal printed by the remote CLI (``kvpack:
<category>: <message>``) comes back as an :class:`~kvpack.errors.OnboardError` that keeps
the category when it is one of onboarding's.

Nothing here decides what to run; the argv is always built by the caller from fixed parts.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import OnboardError
from .ssh import Completed, SshTarget, run_bounded


class NodeHost(Protocol):
    """Runs kvpack subcommands on one node."""

    name: str
    node_dir: str  # the node directory on that machine (absolute once known)

    def where(self) -> str: ...

    def kvpack(self, args: list[str], *, stdin: bytes | None = None, timeout_s: float = 120.0) -> Completed: ...


@dataclass
class SshHost:
    name: str
    node_dir: str
    target: SshTarget
    remote_kvpack: tuple[str, ...] = ("kvpack",)

    def where(self) -> str:
        return f"{self.target.user}@{self.target.host}:{self.target.port}"

    def kvpack(self, args: list[str], *, stdin: bytes | None = None, timeout_s: float = 120.0) -> Completed:
        return self.target.run([*self.remote_kvpack, *args], stdin=stdin, timeout_s=timeout_s)


@dataclass
class LocalHost:
    name: str
    node_dir: str

    def where(self) -> str:
        return "local"

    def kvpack(self, args: list[str], *, stdin: bytes | None = None, timeout_s: float = 120.0) -> Completed:
        env = dict(os.environ)
        env.pop("KVPACK_FAILPOINTS", None)  # failure points are for the wizard itself
        return run_bounded([sys.executable, "-m", "kvpack.cli", *args], stdin=stdin, timeout_s=timeout_s, env=env)


def refusal_of(host: NodeHost, args: list[str], done: Completed) -> OnboardError:
    """The typed error of a failed remote kvpack command."""
    err = done.stderr.decode(errors="replace").strip()
    what = " ".join(args[:2])
    for line in reversed(err.splitlines()):
        # the CLI's error contract: one line "kvpack: <category>: <message>" (older builds
        # printed "refused <category>: <message>")
        prefix = "kvpack: " if line.startswith("kvpack: ") else "refused " if line.startswith("refused ") else None
        if prefix is not None:
            category, _, message = line[len(prefix) :].partition(": ")
            if category in OnboardError.CATEGORIES:
                return OnboardError(category, f"{host.name} ({host.where()}): {message}")
            return OnboardError("ssh", f"{host.name} ({host.where()}): kvpack {what} refused {category}: {message}")
    tail = err.splitlines()[-1][:500] if err else "no message"
    return OnboardError("ssh", f"{host.name} ({host.where()}): kvpack {what} exited {done.returncode}: {tail}")


def run_json(
    host: NodeHost, args: list[str], *, stdin: bytes | None = None, timeout_s: float = 120.0, ok_codes: tuple[int, ...] = (0,), replay: Completed | None = None
) -> Any:
    """Run ``kvpack *args`` on ``host`` (or take ``replay``, an already finished run of it);
    return the JSON object on its last stdout line."""
    done = replay if replay is not None else host.kvpack(args, stdin=stdin, timeout_s=timeout_s)
    if done.returncode not in ok_codes:
        raise refusal_of(host, args, done)
    lines = [ln for ln in done.stdout.decode(errors="replace").splitlines() if ln.strip()]
    if not lines:
        raise OnboardError("ssh", f"{host.name}: kvpack {' '.join(args[:2])} printed nothing (exit {done.returncode})")
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise OnboardError("ssh", f"{host.name}: kvpack {' '.join(args[:2])} did not print JSON: {lines[-1][:200]!r}") from None
