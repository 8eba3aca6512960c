"""Resumable payload uploads, destination side (beyond upstream, where a drop restarts at 0).

``PUT /__kvpack/v1/session-transfers/{id}/payload`` streams into ``.<id>.incoming`` (0600).
The destination makes progress durable at checkpoints: every ``checkpoint_bytes`` it fsyncs
the file and records ``received`` in the journal (atomic, durable), and when the connection
drops mid-body it fsyncs and records what it holds. ``received`` is therefore always a prefix
the disk really holds.

A source resumes by asking ``GET .../payload`` for ``received`` and sending
``Content-Range: bytes START-END/TOTAL`` with ``START == received`` (anything else is refused
409, naming the offset). The destination truncates the partial file to ``received`` before
appending, so bytes written after the last durable point are never trusted.

The final check is unchanged by resuming: once the file holds exactly ``bytes`` bytes it is
fsynced and its size and SHA-256 are recomputed **from disk over the whole file** and compared
with the prepared values; a mismatch discards the partial file (``received`` back to 0) and
answers 400 ``transfer_payload_error``. Only then is it renamed to ``<id>.payload``, the
directory fsynced, and the status set to ``uploaded``.
"""

from __future__ import annotations

import hashlib
import os
import re

from ..errors import MigrationError
from . import machine as M
from .journal import view

_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


class PayloadError(MigrationError):
    """A payload refusal with its HTTP status (413 too long, 400 short or mismatched)."""

    def __init__(self, http_status: int, category: str, message: str) -> None:
        super().__init__(category, message)
        self.http_status = http_status


def parse_content_range(value: str | None, total: int) -> int:
    if value is None:
        return 0
    m = _RANGE.match(value)
    if not m:
        raise PayloadError(400, "usage", "Content-Range must be 'bytes START-END/TOTAL'")
    start, end, size = (int(x) for x in m.groups())
    if size != total or end != total - 1 or start > end:
        raise PayloadError(400, "usage", f"Content-Range must cover START..{total - 1} of {total}")
    return start


def _hash_file(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(4 * 1024 * 1024)
            if not block:
                return n, h.hexdigest()
            h.update(block)
            n += len(block)


async def receive_payload(svc, tid: str, request) -> dict:
    """Stream the request body into the transfer's partial file; see the module docstring."""
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect

    j = svc.journals
    ops = j.ops  # the durable-I/O seam (kvpack.durable.FileOps): writes, fsyncs, rename
    rec = j.require(tid)
    if rec["direction"] != "incoming":
        raise PayloadError(409, "conflict", f"transfer {tid} is not incoming")
    if rec["status"] != M.PREPARED:
        raise PayloadError(409, "conflict", f"transfer {tid} is {rec['status']}; payload already received")
    total = int(rec["bytes"])
    start = parse_content_range(request.headers.get("content-range"), total)
    durable = int(rec.get("received", 0))
    if start != 0 and start != durable:
        raise PayloadError(409, "conflict", f"resume offset {start} is not the durable offset {durable}")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and start + int(length) > total:
        raise PayloadError(413, "usage", f"body of {length} bytes from {start} exceeds the prepared {total} bytes")
    partial = j.incoming_path(tid)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(partial, flags, 0o600)
    pos = start
    try:
        # Bytes past the durable offset were never acknowledged: drop them before appending.
        os.ftruncate(fd, start)
        os.lseek(fd, start, os.SEEK_SET)
        if start == 0 and durable:
            rec["received"] = 0
            j.save(rec)
        since = 0
        try:
            async for block in request.stream():
                if not block:
                    continue
                if pos + len(block) > total:
                    raise PayloadError(413, "usage", f"body exceeds the prepared {total} bytes")
                ops.write(fd, block)
                pos += len(block)
                since += len(block)
                if since >= svc.cfg.checkpoint_bytes:
                    ops.fsync(fd)
                    rec["received"] = pos
                    await run_in_threadpool(j.save, rec)
                    since = 0
        except ClientDisconnect:
            ops.fsync(fd)
            rec["received"] = pos
            j.save(rec)
            raise PayloadError(400, "usage", f"client disconnected at {pos} of {total} bytes (durable; resume from {pos})") from None
        ops.fsync(fd)
    except PayloadError as exc:
        if exc.http_status == 413:
            os.ftruncate(fd, durable if start else 0)
            rec["received"] = durable if start else 0
            j.save(rec)
        raise
    finally:
        os.close(fd)
    if pos < total:
        rec["received"] = pos
        j.save(rec)
        raise PayloadError(400, "integrity", f"short body: {pos} of {total} bytes (durable; resume from {pos})")
    size, digest = await run_in_threadpool(_hash_file, partial)
    if size != total or digest != rec["sha256"]:
        os.unlink(partial)
        rec["received"] = 0
        j.save(rec)
        raise PayloadError(400, "integrity", "payload size or SHA-256 does not match the prepared values")

    def publish() -> dict:
        from ..durable import sync_dir

        ops.rename(partial, j.payload_path(tid))
        sync_dir(j.dir, ops=ops)
        j.transition(rec, M.UPLOADED, f"payload verified ({total} bytes, resumed from {start})" if start else "payload verified", received=total)
        return view(rec)

    return await run_in_threadpool(publish)
