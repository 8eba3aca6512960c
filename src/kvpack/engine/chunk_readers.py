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

The host restore (no device) uses the same workers (:func:`host_readers`, one pool per
process, no staging): a worker reads each object of a batch into its own buffer, verifies
it completely (``format.chunk.decode_chunk_one_pass``, the function the reading threads
run) and only then copies the rows the restore installs straight into the install's planes,
which live in a shared arena (a memfd the worker maps by its ``/proc/<pid>/fd`` path:
``kvpack.engine.arrays.SharedArena``). Nothing comes back but "done" or the refusal.

Workers read through a picklable recipe the store provides for plain POSIX stores only
(``ChunkSource.worker_reader``); any other store (S3, a fault-injecting file layer) keeps the
reading threads. A worker that dies fails its batches with ``StoreError("io")``: the restore
refuses and installs nothing; the next batch starts a new worker. This module never decides
what is verified and never touches the device.

Protocol (pipes, parent -> worker): ``("ctx", id, ctx)`` once per restore and worker, then
either ``("batch", task, ctx id, geometry, items)`` (an item is the slot and the chunk's ref,
span and state key as plain values, one tuple per chunk: ``RestoreTuning.read_submit =
"items"``) or ``("slices", ctx id, [(task, geometry, slice), ...])`` (``"table"``, the
default: one message per worker for every wave the restore could take without waiting, each
:class:`WaveSlice` a compact table of consecutive slots of one wave: offsets, one int64 row
and 96 id bytes per chunk as plain bytes, so neither end builds or pickles per-chunk Python
objects); worker -> parent, one frame per task as it finishes: ``("ok", task, results)`` or
``("ok", task, results, timing)`` (a wave slice: seconds and bytes spent on chunks left to
the device and on chunks verified here, which size the restore's host tail) or
``("err", task, exception)``. Each worker serves its pipe and its slices in order, so a
restore that gives every worker one contiguous slice of each wave has its waves read in wave
order. Host restores send ``("arena", spec)`` once per worker and arena (mapped before the
batches that need it) and ``("host", task, ctx id, batch index, one-pass block, items)`` (an item: the
chunk's ref, span and state key as plain values, its family, then the arena, the byte offset
of its first installed row there and the byte range ``[lo, hi)`` of its plaintext that is
installed); the reply is ``("ok", task, [None, ...])`` or ``("err", task, exception)``;
a shared control page says, per restore, from which batch on the workers skip (a batch
was refused).
Frames are an 8-byte length and a pickle; both ends are this module, started by this
process.
"""

from __future__ import annotations

import itertools
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
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


#: int64 columns of a :class:`WaveSlice` row, in order
SLICE_COLUMNS = (
    "key_epoch",
    "ref_plaintext_bytes",
    "object_bytes",
    "token_start",
    "token_count",
    "plaintext_offset",
    "plaintext_bytes",
    "layer",
    "name",
    "family",
)
#: id bytes per chunk in a :class:`WaveSlice`: content id, object key, object digest
SLICE_ID_BYTES = 96


@dataclass
class WaveSlice:
    """Consecutive slots ``first .. first + n - 1`` of one wave, as plain bytes: ``starts``
    (n + 1 int64 slot offsets, the last one the end of the last slot), ``rows`` (n rows of
    len(:data:`SLICE_COLUMNS`) int64), ``ids`` (n x :data:`SLICE_ID_BYTES` bytes), the
    state names the rows index, and ``host_from``: slots from this one on (relative to
    ``first``) are verified completely here (the restore's host tail)."""

    first: int
    starts: bytes
    rows: bytes
    ids: bytes
    names: tuple[str, ...]
    host_from: int


def _views(maps: list, geometry: tuple) -> tuple:
    import numpy as np

    from .gpu_digest import HEAD_BYTES

    segment, base, table_at, heads_at, dev_base, heads_base = geometry
    mem = maps[segment]
    jobs = (heads_at - table_at) // 32  # two int64 x 4 rows per object
    table = np.frombuffer(mem, dtype=np.int64, count=jobs * 4, offset=table_at).reshape(jobs, 4)
    heads = np.frombuffer(mem, dtype=np.uint8, count=jobs * HEAD_BYTES, offset=heads_at).reshape(jobs, HEAD_BYTES)
    return memoryview(mem), table, heads


def _check_slot(view, table, heads, geometry: tuple, ctx: Any, reader: Any, i: int, offset: int, size: int, ref, span, key, family: int, on_host: bool) -> Any:
    """Read and check one chunk into slot ``i``, write its two job rows: None (verified
    here) or (content id, held refusal) for the device to finish."""
    from .device_verify import write_job_rows
    from .restore import check_chunk

    _segment, base, _table_at, _heads_at, dev_base, heads_base = geometry
    region = view[base + offset : base + offset + size]
    verify_args = ctx.verify_args(ref, span, key, ctx.families[family])
    deferred, head, n = check_chunk(reader.read_into, ref, span, key, verify_args, region, on_host, ctx)
    if deferred is None:
        write_job_rows(table, heads, i, dev_base + offset, heads_base, 0, 0, b"")
        return None
    write_job_rows(table, heads, i, dev_base + offset, heads_base, n, span.plaintext_bytes, head)
    return (deferred.content_id, deferred.held)


def _run_batch(maps: list, ctx: Any, reader: Any, geometry: tuple, items: list) -> list:
    from ..format.objects import ChunkRef, Span, StateKey

    view, table, heads = _views(maps, geometry)
    results: list = []
    for item in items:
        i, offset, size = item[0:3]
        ref, span, key = ChunkRef(*item[3:9]), Span(*item[9:13]), StateKey(item[13], item[14])
        results.append(_check_slot(view, table, heads, geometry, ctx, reader, i, offset, size, ref, span, key, item[15], item[16]))
    return results


def _run_wave_slice(maps: list, ctx: Any, reader: Any, geometry: tuple, part: WaveSlice) -> tuple[list, tuple]:
    """The slots of ``part``: their results, and (seconds, bytes) spent on chunks left to
    the device, then on chunks verified here."""
    from ..format.objects import ChunkRef, Span, StateKey

    view, table, heads = _views(maps, geometry)
    starts = memoryview(part.starts).cast("q").tolist()
    flat = memoryview(part.rows).cast("q").tolist()
    width = len(SLICE_COLUMNS)
    ids = part.ids
    results: list = []
    spent = [0.0, 0, 0.0, 0]
    for j in range(len(starts) - 1):
        epoch, ref_plain, obj_bytes, t_start, t_count, p_off, p_bytes, layer, name, family = flat[width * j : width * (j + 1)]
        at = SLICE_ID_BYTES * j
        ref = ChunkRef(ids[at : at + 32], ids[at + 32 : at + 64], ids[at + 64 : at + 96], epoch, ref_plain, obj_bytes)
        span, key = Span(t_start, t_count, p_off, p_bytes), StateKey(layer, part.names[name])
        t0 = time.perf_counter()
        result = _check_slot(
            view, table, heads, geometry, ctx, reader, part.first + j, starts[j], starts[j + 1] - starts[j], ref, span, key, family, j >= part.host_from
        )
        k = 0 if result is not None else 2
        spent[k] += time.perf_counter() - t0
        spent[k + 1] += obj_bytes
        results.append(result)
    return results, tuple(spent)


class _HostRun:
    """What a worker keeps for host batches: the install arenas it mapped (by arena id) and
    one read buffer, reused for every object (a batch runs one object at a time)."""

    def __init__(self) -> None:
        self.arenas: dict[int, Any] = {}
        self.buffer = bytearray(0)

    def map(self, arena_id: int, path: str, nbytes: int) -> None:
        """Map an arena; a failure is kept and raised (as io) by the batches that need it."""
        import mmap

        try:
            fd = os.open(path, os.O_RDWR)
            try:
                self.arenas[arena_id] = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)  # the mapping keeps the memory
        except OSError as exc:
            self.arenas[arena_id] = exc

    def arena(self, arena_id: int) -> Any:
        mapped = self.arenas.get(arena_id)
        if mapped is None or isinstance(mapped, OSError):
            from ..errors import StoreError

            raise StoreError("io", f"chunk reader: cannot map the install's arena {arena_id}: {mapped}")
        return mapped

    def region(self, nbytes: int) -> memoryview:
        if len(self.buffer) < nbytes:
            self.buffer = bytearray(nbytes)
        return memoryview(self.buffer)[:nbytes]


#: int64 slots of the host pool's control page, one per restore (its context id modulo
#: this): 0, or 2 + the index of the first batch of that restore known to be refused (1:
#: the restore failed otherwise, every batch not yet read is skipped)
CONTROL_SLOTS = 512


def _run_host_batch(host: _HostRun, control: Any, cid: int, index: int, ctx: Any, reader: Any, block: int, items: list) -> list:
    """Read, verify completely (every check of A.5, both long hashes: ``decode_chunk_one_pass``,
    the function the reading threads run) and install each item's rows, in order: the rows
    ``[lo, hi)`` of its plaintext are copied to their arena offset only after every check
    passed. The first refusal raises (the parent raises it; later items are not read). A
    batch after one of its restore's batches that was refused (``control``) is skipped: the
    restore refuses anyway, with the first refusal in job order, which is never this one."""
    from ..errors import StoreError
    from ..format.chunk import decode_chunk_one_pass
    from ..format.objects import ChunkRef, Span, StateKey

    for item in items:
        refused = control[cid % CONTROL_SLOTS] if control is not None else 0
        if refused and index > refused - 2:
            raise StoreError("io", "chunk reader: skipped, an earlier batch of this restore was refused")
        ref, span, key = ChunkRef(*item[0:6]), Span(*item[6:10]), StateKey(item[10], item[11])
        family, arena_id, offset, lo, hi = item[12:17]
        obj, _n = reader.read_into(ref, host.region(ref.object_bytes))
        plaintext = memoryview(decode_chunk_one_pass(obj, **ctx.verify_args(ref, span, key, ctx.families[family]), block=block)).cast("B")
        host.arena(arena_id)[offset : offset + hi - lo] = plaintext[lo:hi]
        del plaintext, obj  # views of the read buffer, reused by the next item
    return [None] * len(items)


def worker_main(argv: list[str]) -> int:
    """A worker: ``argv`` = fd:bytes of each staging segment (inherited descriptors)."""
    import mmap

    maps = []
    for spec in argv:
        fd, nbytes = (int(x) for x in spec.split(":"))
        maps.append(mmap.mmap(fd, nbytes))
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    ctxs: dict[int, tuple[Any, Any]] = {}
    host = _HostRun()
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
        if message[0] == "arena":
            host.map(*message[1])
            continue
        if message[0] == "probe":  # can this worker map an arena of the parent?
            _kind, task, arena_id = message
            try:
                host.arena(arena_id)
                reply: tuple = ("ok", task, None)
            except BaseException as exc:  # noqa: BLE001 - the answer is the refusal
                reply = ("err", task, exc)
            host.arenas.pop(arena_id, None)  # the probe's arena is closed after it
            _write_frame(out, reply)
            continue
        if message[0] == "host":
            _kind, task, cid, index, block, items = message
            control = memoryview(maps[0]).cast("q") if maps else None  # the host pool's control page

            def run(_maps, ctx, reader, blk, work, cid=cid, index=index, control=control):
                return _run_host_batch(host, control, cid, index, ctx, reader, blk, work)

            _serve(out, ctxs, maps, task, cid, block, items, run)
            continue
        if message[0] == "slices":  # one reply per slice, each as soon as it is done
            _kind, cid, parts = message
            for task, geometry, part in parts:
                _serve(out, ctxs, maps, task, cid, geometry, part, _run_wave_slice)
        else:
            _kind, task, cid, geometry, items = message
            _serve(out, ctxs, maps, task, cid, geometry, items, _run_batch)


def _serve(out, ctxs: dict, maps: list, task: int, cid: int, geometry: tuple, work: Any, run: Any) -> None:
    """Run one task and write its reply: its results (and any timing), or its refusal."""
    try:
        ctx, reader = ctxs[cid]
        done = run(maps, ctx, reader, geometry, work)
        reply: tuple = ("ok", task, *done) if isinstance(done, tuple) else ("ok", task, done)
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
        self.sent_arenas: set[int] = set()
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
            kind, task, payload, *timing = message
            if timing:
                self.pool.record(timing[0])
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

    def submit(self, tasks: list[int], cid: int, ctx: Any, message: tuple, arenas: tuple = ()) -> list[Future]:
        """Send ``message`` (after the restore's context and any install ``arenas`` this
        worker has not mapped yet, once each) and a Future per task."""
        futs: list[Future] = [Future() for _ in tasks]
        with self.lock:
            if not self.alive:
                raise BrokenPipeError
            self.pending.update(zip(tasks, futs))
            try:
                if ctx is not None and cid not in self.sent_ctx:  # (a probe has no context)
                    _write_frame(self.proc.stdin, ("ctx", cid, ctx))
                    self.sent_ctx.add(cid)
                    if len(self.sent_ctx) > _KEEP_CTX:
                        self.sent_ctx.discard(min(self.sent_ctx))
                for arena in arenas:
                    if arena[0] not in self.sent_arenas:  # arenas live as long as this process
                        _write_frame(self.proc.stdin, ("arena", arena))
                        self.sent_arenas.add(arena[0])
                _write_frame(self.proc.stdin, message)
            except (BrokenPipeError, OSError, ValueError):
                for task in tasks:
                    self.pending.pop(task, None)
                self.alive = False
                raise BrokenPipeError from None
        return futs

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
        #: seconds and bytes the workers spent on chunks left to the device, then on chunks
        #: verified completely in a worker (wave slices only): what a host tail costs here
        self.timing = [0.0, 0, 0.0, 0]
        #: the host pool's control page (its first segment), else None
        self.control: Any = None
        #: whether every worker mapped a probe arena (:func:`start_host_readers`; None: not
        #: probed -- a pool started by a forced restore)
        self.arenas_mappable: bool | None = None
        self.ensure(processes)

    def record(self, spent: tuple) -> None:
        with self._lock:
            for k, v in enumerate(spent):
                self.timing[k] += v

    def host_seconds_per_byte(self) -> float | None:
        """Seconds one worker has taken per object byte to read and verify a chunk
        completely (a host tail chunk), over every wave slice so far; None before any."""
        with self._lock:
            seconds, nbytes = self.timing[2], self.timing[3]
        return seconds / nbytes if nbytes else None

    def live(self) -> int:
        with self._lock:
            return sum(1 for w in self.workers if w.alive)

    def ensure(self, processes: int) -> None:
        with self._lock:
            self.workers = [w for w in self.workers if w.alive]
            while len(self.workers) < processes:
                self.workers.append(_Worker(self))

    def submit(self, cid: int, ctx: Any, geometry: tuple, items: list) -> Future:
        """Read and check ``items`` of the wave at ``geometry`` in the least busy worker: a
        Future of one result per item (None: verified on the host; else (content id, held
        refusal))."""
        return self._send(None, cid, ctx, 1, lambda tasks: ("batch", tasks[0], cid, geometry, items))[0]

    def submit_host(self, index: int, cid: int, ctx: Any, arenas: tuple, block: int, items: list) -> Future:
        """Read, verify completely and install ``items`` (batch ``index`` of the host restore
        ``cid``: one tuple per chunk, see :func:`_run_host_batch`) in live worker number
        ``index`` (modulo the live workers), which maps the install ``arenas`` first: a
        Future that raises the batch's first refusal. A refusal makes the workers skip the
        restore's later batches (:meth:`refused`)."""
        fut = self._send(index, cid, ctx, 1, lambda tasks: ("host", tasks[0], cid, index, block, items), arenas)[0]

        def on_done(f: Future) -> None:
            if f.exception() is not None:
                self.refused(cid, index)

        fut.add_done_callback(on_done)
        return fut

    def refused(self, cid: int, index: int) -> None:
        """Batch ``index`` of restore ``cid`` was refused: the workers skip its later
        batches (-1: the restore failed otherwise, they skip every batch not yet read)."""
        if self.control is None:
            return
        with self._lock:
            slot = cid % CONTROL_SLOTS
            if not self.control[slot] or index + 2 < self.control[slot]:
                self.control[slot] = index + 2

    def finished(self, cid: int) -> None:
        """Restore ``cid`` has no batch left in any worker: its control slot is free."""
        if self.control is not None:
            with self._lock:
                self.control[cid % CONTROL_SLOTS] = 0

    def pids(self) -> list[int]:
        """Process ids of the live workers (benchmarks read their CPU time and switches)."""
        with self._lock:
            return [w.proc.pid for w in self.workers if w.alive]

    def kill(self) -> None:
        """Stop every worker now (a task past its deadline must never write later)."""
        with self._lock:
            workers, self.workers = self.workers, []
        for w in workers:
            w.proc.kill()
            w.proc.wait()
            w.thread.join(timeout=5)

    def submit_slices(self, worker_index: int, cid: int, ctx: Any, parts: list[tuple[tuple, WaveSlice]]) -> list[Future]:
        """``parts`` ((geometry, :class:`WaveSlice`) each, in wave order) in one message to
        live worker number ``worker_index`` (modulo the live workers), which serves them
        in order and replies to each as it is done: a Future per part, as :meth:`submit`."""
        return self._send(worker_index, cid, ctx, len(parts), lambda tasks: ("slices", cid, [(t, g, p) for t, (g, p) in zip(tasks, parts)]))

    def _send(self, worker_index: int | None, cid: int, ctx: Any, count: int, message: Any, arenas: tuple = ()) -> list[Future]:
        for _attempt in range(2):
            with self._lock:
                live = [w for w in self.workers if w.alive]
            if live:
                worker = min(live, key=lambda w: len(w.pending)) if worker_index is None else live[worker_index % len(live)]
                tasks = [next(self._tasks) for _ in range(count)]
                try:
                    return worker.submit(tasks, cid, ctx, message(tasks), arenas)
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


_host_pool: ReaderPool | None = None
_host_pool_lock = threading.Lock()


def host_readers(processes: int) -> ReaderPool:
    """The process-wide reader processes of host restores (no staging: they write into the
    installs' shared arenas; their one segment is a control page, :data:`CONTROL_SLOTS`),
    at least ``processes`` live ones; started at first use."""
    global _host_pool
    import mmap

    with _host_pool_lock:
        if _host_pool is None:
            fd = os.memfd_create("kvpack-host-readers", getattr(os, "MFD_CLOEXEC", 1))
            os.ftruncate(fd, 8 * CONTROL_SLOTS)
            page = mmap.mmap(fd, 8 * CONTROL_SLOTS)
            _host_pool = ReaderPool([(fd, 8 * CONTROL_SLOTS)], processes)
            _host_pool.control = memoryview(page).cast("q")
        _host_pool.ensure(processes)
        return _host_pool


def host_pool() -> ReaderPool | None:
    """The host restores' pool when it has live workers (never starts one)."""
    with _host_pool_lock:
        pool = _host_pool
    return pool if pool is not None and pool.live() else None


def running_host_readers() -> ReaderPool | None:
    """:func:`host_pool` once its workers mapped a probe arena (:func:`start_host_readers`):
    the pool ``"auto"`` may use."""
    pool = host_pool()
    return pool if pool is not None and pool.arenas_mappable is True else None


def _probe_arenas(pool: ReaderPool) -> bool:
    """Whether every live worker maps a one-page arena of this process (by its
    ``/proc/<pid>/fd`` path: where /proc hides other processes' descriptors, none can)."""
    from .arrays import SharedArena
    from .restore import READ_DEADLINE_S

    arena = SharedArena(4096)
    try:
        futs = [pool._send(i, 0, None, 1, lambda tasks: ("probe", tasks[0], arena.id), (arena.spec(),))[0] for i in range(pool.live())]
        return all(f.exception(timeout=READ_DEADLINE_S) is None for f in futs)
    except Exception:  # noqa: BLE001 - a worker that cannot even be asked: not usable
        return False
    finally:
        arena.map.close()
        os.close(arena.fd)


def _start_and_probe(processes: int) -> None:
    pool = host_readers(processes)
    pool.arenas_mappable = _probe_arenas(pool)


def start_host_readers(processes: int) -> None:
    """Start the host restores' workers on a background thread, then check that they map
    an arena of this process (``"auto"`` never uses workers that cannot: restores keep
    their threads); a restore that does not wait for them keeps its threads, the next one
    finds them running."""
    threading.Thread(target=_start_and_probe, args=(processes,), name="kvpack-host-readers-start", daemon=True).start()


__all__ = [
    "CONTROL_SLOTS",
    "SLICE_COLUMNS",
    "SLICE_ID_BYTES",
    "ReaderPool",
    "WaveSlice",
    "host_pool",
    "host_readers",
    "running_host_readers",
    "start_host_readers",
    "worker_main",
]
