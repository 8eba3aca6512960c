"""Resumable payload uploads, destination side (beyond upstream, where a drop restarts at 0).

Why it exists: a dropped multi-GB upload should resume where the destination's disk provably
holds the bytes, without weakening the final check. What it must never do: trust bytes past
the durable offset, let two uploads write one transfer's partial file, or answer 5xx for a
client's misbehaviour.

``PUT /__kvpack/v1/session-transfers/{id}/payload`` streams into ``.<id>.incoming`` (0600).
**One writer per transfer**: an upload takes the transfer's single-writer claim first; a
second concurrent upload of the same transfer is answered 409 ``conflict`` at once and touches
nothing (the source retries or reconciles).

**Durable offset, bounded lag.** Progress is made durable at checkpoints: once
``checkpoint_bytes`` (default 4 MiB) have been written since the last one, or
``checkpoint_interval_s`` (default 1 s) have passed with bytes written, the partial file is
fsynced and ``received`` recorded in the journal (atomic, durable); when the connection drops
mid-body (also when the API's body idle timeout closes it) it fsyncs and records what it holds.
So after a crash of the destination, ``received`` trails the bytes it had read by less than
``checkpoint_bytes`` plus one network read, and by at most ``checkpoint_interval_s`` of
reading; bytes still in socket buffers were never read and are simply sent again. ``received``
is always a prefix the disk really holds.

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
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Optional

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from ..durable import sync_dir
from ..errors import MigrationError
from . import failpoints
from . import machine as M
from .journal import view

_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


class PayloadError(MigrationError):
    """A payload refusal with its HTTP status (413 too long, 400 short or mismatched, 409)."""

    def __init__(self, http_status: int, category: str, message: str) -> None:
        super().__init__(category, message)
        self.http_status = http_status


def parse_content_range(value: Optional[str], total: int) -> int:
    if value is None:
        return 0
    m = _RANGE.fullmatch(value)
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


async def receive_payload(svc: Any, tid: str, headers: Mapping[str, str], blocks: AsyncIterator[bytes]) -> dict[str, Any]:
    """Stream ``blocks`` (the request body) into the transfer's partial file; see the module
    docstring. ``headers``: ``content-range`` and ``content-length`` are read."""
    if not svc.claim_upload(tid):
        raise PayloadError(409, "conflict", f"an upload of transfer {tid} is already in progress; retry after it ends")
    try:
        return await _receive(svc, tid, headers, blocks)
    finally:
        svc.release_upload(tid)


async def _receive(svc: Any, tid: str, headers: Mapping[str, str], blocks: AsyncIterator[bytes]) -> dict[str, Any]:
    j = svc.journals
    rec = j.require(tid)
    if rec.direction != "incoming":
        raise PayloadError(409, "conflict", f"transfer {tid} is not incoming")
    if rec.status != M.PREPARED:
        raise PayloadError(409, "conflict", f"transfer {tid} is {rec.status}; payload already received")
    total = rec.bytes
    start = parse_content_range(headers.get("content-range"), total)
    durable = rec.received
    if start != 0 and start != durable:
        raise PayloadError(409, "conflict", f"resume offset {start} is not the durable offset {durable}")
    length = headers.get("content-length")
    if length is not None and length.isdigit() and start + int(length) > total:
        raise PayloadError(413, "usage", f"body of {length} bytes from {start} exceeds the prepared {total} bytes")
    upload = _Upload(svc, rec, start)
    try:
        await upload.stream(blocks)
    finally:
        os.close(upload.fd)
    if upload.pos < total:
        upload.rec = await run_in_threadpool(j.note, upload.rec, f"short body at {upload.pos}", received=upload.pos)
        raise PayloadError(400, "integrity", f"short body: {upload.pos} of {total} bytes (durable; resume from {upload.pos})")
    return await run_in_threadpool(_publish, svc, upload.rec, start)


class _Upload:
    """One upload's partial file and its checkpoints."""

    def __init__(self, svc: Any, rec: M.TransferRecord, start: int) -> None:
        self.svc, self.rec, self.start = svc, rec, start
        self.durable_at_start = rec.received
        self.ops = svc.journals.ops  # the durable-I/O seam (kvpack.durable.FileOps)
        self.partial = svc.journals.incoming_path(rec.id)
        self.pos = start
        self.every_bytes = svc.cfg.checkpoint_bytes
        self.every_s = svc.cfg.checkpoint_interval_s
        self.kill_at = failpoints.byte_threshold("dest.upload")
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        self.fd = os.open(self.partial, flags, 0o600)
        # Bytes past the durable offset were never acknowledged: drop them before appending.
        os.ftruncate(self.fd, start)
        os.lseek(self.fd, start, os.SEEK_SET)

    async def checkpoint(self, why: str) -> None:
        self.ops.fsync(self.fd)
        self.rec = await run_in_threadpool(self.svc.journals.note, self.rec, why, received=self.pos)

    async def stream(self, blocks: AsyncIterator[bytes]) -> None:
        total = self.rec.bytes
        if self.start == 0 and self.rec.received:
            await self.checkpoint("upload restarted from 0")
        since, last = 0, time.monotonic()
        try:
            async for block in blocks:
                if not block:
                    continue
                if self.pos + len(block) > total:
                    raise PayloadError(413, "usage", f"body exceeds the prepared {total} bytes")
                self.ops.write(self.fd, block)
                self.pos += len(block)
                since += len(block)
                if self.kill_at is not None and self.pos >= self.kill_at:
                    failpoints.die()  # the destination dies mid-upload (matrix row)
                if since >= self.every_bytes or (since and time.monotonic() - last >= self.every_s):
                    await self.checkpoint(f"checkpoint at {self.pos}")
                    since, last = 0, time.monotonic()
        except (ClientDisconnect, ConnectionError):
            await self.checkpoint(f"client disconnected at {self.pos}")
            raise PayloadError(400, "usage", f"client disconnected at {self.pos} of {total} bytes (durable; resume from {self.pos})") from None
        except PayloadError as exc:
            if exc.http_status == 413:
                keep = self.durable_at_start if self.start else 0
                os.ftruncate(self.fd, keep)
                self.pos = keep
                self.rec = await run_in_threadpool(self.svc.journals.note, self.rec, "body too long", received=keep)
            raise
        self.ops.fsync(self.fd)


def _publish(svc: Any, rec: M.TransferRecord, start: int) -> dict[str, Any]:
    """Whole-file size and SHA-256 from disk, then rename and record ``uploaded``."""
    j = svc.journals
    partial = j.incoming_path(rec.id)
    size, digest = _hash_file(partial)
    if size != rec.bytes or digest != rec.sha256:
        os.unlink(partial)
        j.note(rec, "payload size or SHA-256 mismatch; discarded", received=0)
        raise PayloadError(400, "integrity", "payload size or SHA-256 does not match the prepared values")
    j.ops.rename(partial, j.payload_path(rec.id))
    sync_dir(j.dir, ops=j.ops)
    text = f"payload verified ({rec.bytes} bytes, resumed from {start})" if start else "payload verified"
    return view(j.transition(rec, M.UPLOADED, text, received=rec.bytes))
