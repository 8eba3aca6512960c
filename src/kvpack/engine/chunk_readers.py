"""Reader processes: chunk objects read into the restore's shared staging and checked there,
each worker in its own interpreter (its own GIL).

A verified GPU restore reads thousands of chunk object files. Every read is several system
calls and each of them releases and retakes the GIL; with a dozen reading threads in one
interpreter those handoffs, not the copies, set the pace (on the H200 host about 0.3 ms per
1 MiB chunk whatever the thread count: docs/benchmarks.md). Here each worker is a separate
Python process that maps the ring's staging (a memfd, kvpack.engine.device_verify
.SharedStaging), reads each object of a batch into its slot, runs every host check that does
not need the long hashes (:func:`kvpack.engine.restore.check_chunk`, the very function the
reading threads run) and writes the object's two GPU job rows. The parent gets one small
message per batch back: per object the content id and any held refusal, or that it was
verified completely on the host, or the first refusal of the batch (raised in the parent).

Workers read through a picklable recipe the store provides for plain POSIX stores only
(``ChunkSource.worker_reader``); any other store (S3, a fault-injecting file layer) keeps the
reading threads. A worker that dies fails its batches with ``StoreError("io")``: the restore
refuses and installs nothing; the next batch starts a new worker. This module never decides
what is verified and never touches the device.

Protocol (pipes, parent -> worker): ``("ctx", id, ctx)`` once per restore and worker, then
``("batch", task, ctx id, geometry, items)`` (an item is the slot and the chunk's ref, span
and state key as plain values: :meth:`kvpack.engine.restore.DeviceVerifiedPipeline
.submit_reads`); worker -> parent: ``("ok", task, results)`` or
``("err", task, exception)``. Frames are an 8-byte length and a pickle; both ends are this
module, started by this process.
"""

from __future__ import annotations

import itertools
import os
import pickle
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Any

_LEN = struct.Struct("<Q")
#: Contexts a worker keeps (concurrent restores each have one).
_KEEP_CTX = 8


def _read_frame(stream) -> Any:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    size = _LEN.unpack(head)[0]
    body = stream.read(size)
    if len(body) < size:
        return None
    return pickle.loads(body)


def _write_frame(stream, message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LEN.pack(len(body)) + body)
    stream.flush()


# -- the worker ----------------------------------------------------------------------------


def _reader_from(recipe: tuple[str, str, tuple]) -> Any:
    import importlib

    module, name, args = recipe
    return getattr(importlib.import_module(module), name)(*args)


def _run_batch(maps: list, ctx: Any, reader: Any, geometry: tuple, items: list) -> list:
    import numpy as np

    from ..format.objects import ChunkRef, Span, StateKey
    from .device_verify import write_job_rows
    from .gpu_digest import HEAD_BYTES
    from .restore import check_chunk

    segment, base, table_at, heads_at, dev_base, heads_base = geometry
    mem = maps[segment]
    jobs = (heads_at - table_at) // 32  # two int64 x 4 rows per object
    table = np.frombuffer(mem, dtype=np.int64, count=jobs * 4, offset=table_at).reshape(jobs, 4)
    heads = np.frombuffer(mem, dtype=np.uint8, count=jobs * HEAD_BYTES, offset=heads_at).reshape(jobs, HEAD_BYTES)
    view = memoryview(mem)
    results: list = []
    for item in items:
        i, offset, size = item[0:3]
        ref, span, key = ChunkRef(*item[3:9]), Span(*item[9:13]), StateKey(item[13], item[14])
        family, on_host = item[15], item[16]
        region = view[base + offset : base + offset + size]
        verify_args = ctx.verify_args(ref, span, key, ctx.families[family])
        deferred, head, n = check_chunk(reader.read_into, ref, span, key, verify_args, region, on_host, ctx)
        if deferred is None:
            write_job_rows(table, heads, i, dev_base + offset, heads_base, 0, 0, b"")
            results.append(None)
        else:
            write_job_rows(table, heads, i, dev_base + offset, heads_base, n, span.plaintext_bytes, head)
            results.append((deferred.content_id, deferred.held))
    return results


def worker_main(argv: list[str]) -> int:
    """A worker: ``argv`` = fd:bytes of each staging segment (inherited descriptors)."""
    import mmap

    maps = []
    for spec in argv:
        fd, nbytes = (int(x) for x in spec.split(":"))
        maps.append(mmap.mmap(fd, nbytes))
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    ctxs: dict[int, tuple[Any, Any]] = {}
    while True:
        message = _read_frame(inp)
        if message is None:
            return 0  # the parent closed the pipe (or exited)
        if message[0] == "ctx":
            _kind, cid, ctx = message
            ctxs[cid] = (ctx, _reader_from(ctx.reader))
            while len(ctxs) > _KEEP_CTX:
                del ctxs[min(ctxs)]
            continue
        _kind, task, cid, geometry, items = message
        try:
            ctx, reader = ctxs[cid]
            reply: tuple = ("ok", task, _run_batch(maps, ctx, reader, geometry, items))
        except BaseException as exc:  # a refusal (or a bug): the parent raises it
            reply = ("err", task, exc)
        try:
            _write_frame(out, reply)
        except (pickle.PicklingError, TypeError, AttributeError):
            from ..errors import StoreError

            _write_frame(out, ("err", task, StoreError("io", f"chunk reader: {type(reply[2]).__name__}: {reply[2]}")))


# -- the parent ----------------------------------------------------------------------------


class _Worker:
    def __init__(self, pool: "ReaderPool") -> None:
        fds = tuple(fd for fd, _n in pool.segment_fds)
        env = dict(os.environ)
        # the child imports kvpack exactly as this process does (scripts add paths at run time)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        args = [f"{fd}:{n}" for fd, n in pool.segment_fds]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from kvpack.engine.chunk_readers import worker_main; sys.exit(worker_main(sys.argv[1:]))", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=fds,
            env=env,
        )
        self.pool = pool
        self.lock = threading.Lock()
        self.pending: dict[int, Future] = {}
        self.sent_ctx: set[int] = set()
        self.alive = True
        self.thread = threading.Thread(target=self._receive, name="kvpack-chunk-reader", daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        stream = self.proc.stdout
        while True:
            try:
                message = _read_frame(stream)
            except Exception:  # noqa: BLE001 - a torn frame: the worker is gone
                message = None
            if message is None:
                break
            kind, task, payload = message
            with self.lock:
                fut = self.pending.pop(task, None)
            if fut is None:
                continue
            if kind == "ok":
                fut.set_result(payload)
            else:
                fut.set_exception(payload)
        self._fail("a chunk reader process exited")

    def _fail(self, why: str) -> None:
        from ..errors import StoreError

        with self.lock:
            self.alive = False
            pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(StoreError("io", why))

    def submit(self, task: int, cid: int, ctx: Any, geometry: tuple, items: list) -> Future:
        fut: Future = Future()
        with self.lock:
            if not self.alive:
                raise BrokenPipeError
            self.pending[task] = fut
            try:
                if cid not in self.sent_ctx:
                    _write_frame(self.proc.stdin, ("ctx", cid, ctx))
                    self.sent_ctx.add(cid)
                    if len(self.sent_ctx) > _KEEP_CTX:
                        self.sent_ctx.discard(min(self.sent_ctx))
                _write_frame(self.proc.stdin, ("batch", task, cid, geometry, items))
            except (BrokenPipeError, OSError, ValueError):
                self.pending.pop(task, None)
                self.alive = False
                raise BrokenPipeError from None
        return fut

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ReaderPool:
    """Worker processes mapping the staging ``segments`` ((fd, bytes) each), started on
    demand; ``submit`` sends a batch to the least busy live worker."""

    def __init__(self, segments: list[tuple[int, int]], processes: int) -> None:
        self.segment_fds = list(segments)
        self.segments = len(segments)
        self.workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._tasks = itertools.count()
        self.ensure(processes)

    def ensure(self, processes: int) -> None:
        with self._lock:
            self.workers = [w for w in self.workers if w.alive]
            while len(self.workers) < processes:
                self.workers.append(_Worker(self))

    def submit(self, cid: int, ctx: Any, geometry: tuple, items: list) -> Future:
        """Read and check ``items`` of the wave at ``geometry`` in a worker: a Future of
        one result per item (None: verified on the host; else (content id, held refusal))."""
        for _attempt in range(2):
            with self._lock:
                live = [w for w in self.workers if w.alive]
            if live:
                worker = min(live, key=lambda w: len(w.pending))
                try:
                    return worker.submit(next(self._tasks), cid, ctx, geometry, items)
                except BrokenPipeError:
                    pass
            self.ensure(max(1, len(self.workers)))
        from ..errors import StoreError

        raise StoreError("io", "no chunk reader process could be started")

    def close(self) -> None:
        with self._lock:
            workers, self.workers = self.workers, []
        for w in workers:
            w.close()


__all__ = ["ReaderPool", "worker_main"]
