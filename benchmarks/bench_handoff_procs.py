"""Benchmark: sealed Handoff V2 striped over N mTLS connections, one OS process per side.

``bench_gpu --handoff`` runs every stripe as threads of ONE Python process (sender and
receiver too), so the GIL serialises the Python work of all stripes. Here every stripe is
one sender process and one receiver process (``multiprocessing``, ``spawn`` context by
default), so stripes run in parallel on separate cores:

* each stripe is one sealed *deferred* Handoff V2 transfer of its share of the segments
  (dealt round-robin, ``groups = [segs[i::stripes] ...]``, as bench_gpu does), with its own
  transfer id and sequences 0..k-1, over its own mTLS 1.3 loopback connection (pinned
  leaves, ALPN ``muser-kvpack-v2``, ``kvpack.security.tls`` listen/accept/connect);
* the sender process hashes and frames on its main thread (``Sender.send_segment``; the
  per-segment and running SHA-256 run concurrently inside it) while a writer thread
  ``sendall``s the framed buffers (TLS encrypt), like bench_gpu's ``sealed_stripe``;
* the receiver process fills the whole ``Receiver.wanted()`` view (the rest of the current
  frame phase: preamble, header, or up to 256 KiB of a large payload, which the receiver
  hashes while the next bytes arrive) with a tight ``recv_into`` loop and then calls
  ``Receiver.advance`` once per view, instead of once per 16 KiB TLS record; the sink counts (``CountingSink``) and the replay gate is in memory
  (``--receiver-loop per-record`` restores bench_gpu's advance-per-recv loop, for comparison);
* the payload is a file every process maps read-only (``MAP_POPULATE``: page tables are
  filled before the start signal): ``--payload-file`` (e.g. real KV bytes) or
  ``--payload-mib`` random bytes written to /dev/shm and removed at exit;
* process start-up, imports, mapping and the TLS handshakes all happen before the start
  signal. Timing runs from the start signal (one Event for all processes) until the last
  receiver has committed (and written its ack) and the last sender has read its ack, on the
  system-wide monotonic clock;
* the peer figure is a raw TLS stream of the same bytes with the same layout (one sender
  process and one receiver process per stripe, same shares, same connection setup).

Segments carry Llama-like intents: 32 layers x (``nope_key``, ``nope_value``), f16, 8 KV
heads x 128 = 1,024 elements per token (2 KiB per token), planes in (layer, role) order, each
plane cut into ``segment_bytes`` pieces (2,048 tokens at 4 MiB). The prompt length of the
manifest is the plane length. An explicit segment list is spread over the planes in order.

One JSON line per stripe count. Correctness is checked in every run (each receiver reaches
Committed with total bytes == its share, the sink committed all of them, each sender read a
matching ack, raw receivers got every byte); any failure raises and exits non-zero.

    python benchmarks/bench_handoff_procs.py --payload-mib 4096 --stripes 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import queue
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # handoff_doubles, in spawned children too

# Imported here, not in the workers: a spawned child imports all of it before the start signal.
from handoff_doubles import KEY, CountingSink, MemoryLedger  # noqa: E402

from kvpack.handoff.events import Ack  # noqa: E402
from kvpack.handoff.manifest import PROTOCOL, BeginManifestV2, ComponentV2, ExactIdentityV1, HmacRef  # noqa: E402
from kvpack.handoff.receiver import Committed, Receiver, ReceiverConfig  # noqa: E402
from kvpack.handoff.schedule import SpanSegment  # noqa: E402
from kvpack.handoff.sender import Sender  # noqa: E402
from kvpack.security import tls  # noqa: E402

LAYOUT = "one sender process and one receiver process per stripe"
LAYERS = 32
ROLES = ("nope_key", "nope_value")
ELEMENTS = 8 * 128  # Llama-3-8B: 8 KV heads x 128
ETYPE = "f16_le"
ELEMENT_BYTES = 2
SOCKET_TIMEOUT_S = 300.0


def _emit(line: dict, out: str | None) -> None:
    text = json.dumps(line, sort_keys=True)
    print(text, flush=True)
    if out:
        with open(out, "a") as fh:
            fh.write(text + "\n")


# -- layout -------------------------------------------------------------------------------------


def llama_segments(payload_bytes: int, segment_bytes: int, elements: int = ELEMENTS, layers: int = LAYERS) -> list[tuple[int, int]]:
    """(offset, nbytes) pieces of a payload laid out as ``layers`` x 2 planes of equal token
    count, each plane cut into ``segment_bytes`` pieces (the last piece of a plane may be
    shorter). A tail that does not make a whole token in every plane is left out."""
    token_bytes = elements * ELEMENT_BYTES
    if segment_bytes < token_bytes or segment_bytes % token_bytes:
        raise ValueError(f"segment_bytes must be a positive multiple of {token_bytes} (one token)")
    planes = layers * len(ROLES)
    tokens = payload_bytes // (planes * token_bytes)
    if tokens == 0:
        raise ValueError(f"payload of {payload_bytes} bytes is less than one token per plane")
    seg_tokens = segment_bytes // token_bytes
    out = []
    off = 0
    for _plane in range(planes):
        for a in range(0, tokens, seg_tokens):
            n = (min(tokens, a + seg_tokens) - a) * token_bytes
            out.append((off, n))
            off += n
    return out


def segment_intents(segments: list[tuple[int, int]], elements: int = ELEMENTS, layers: int = LAYERS) -> tuple[list[tuple], int]:
    """Llama-like intents for ``segments`` in payload order: consecutive runs of segments fill
    the planes (layer 0 key, layer 0 value, layer 1 key, ...) with contiguous token ranges.
    Returns ([(layer, role, start, count, offset, nbytes)], prompt length)."""
    token_bytes = elements * ELEMENT_BYTES
    planes = layers * len(ROLES)
    cursor = [0] * planes
    out = []
    for k, (off, n) in enumerate(segments):
        if n <= 0 or n % token_bytes:
            raise ValueError(f"segment {k} ({n} bytes) is not a whole number of {token_bytes}-byte tokens")
        plane = k * planes // len(segments)
        start = cursor[plane]
        cursor[plane] += n // token_bytes
        out.append((plane // len(ROLES), ROLES[plane % len(ROLES)], start, n // token_bytes, off, n))
    return out, max(cursor)


# -- PKI (also used by bench_gpu) ------------------------------------------------------------------


def make_pki(root: str):
    from kvpack.durable import atomic_write
    from kvpack.security import enroll as pki

    ca_key, ca_cert = pki.make_ca("bench CA")
    ca_path = os.path.join(root, "ca.crt")
    atomic_write(ca_path, pki.cert_pem(ca_cert), mode=0o644)
    leaves = {}
    for name in ("producer", "receiver"):
        key = pki.generate_key()
        cert = pki.issue_leaf(ca_key, ca_cert, pki.make_csr(key, name), [name, *pki.LOOPBACK_SANS])
        kp, cp = os.path.join(root, f"{name}.key"), os.path.join(root, f"{name}.crt")
        atomic_write(kp, pki.key_pem(key), mode=0o600)
        atomic_write(cp, pki.cert_pem(cert), mode=0o644)
        leaves[name] = (cp, kp, pki.cert_sha256(cert))
    server = tls.TlsEndpoint(leaves["receiver"][0], leaves["receiver"][1], ca_path, frozenset([leaves["producer"][2]]), tls.DATA_ALPN, None)
    client = tls.TlsEndpoint(leaves["producer"][0], leaves["producer"][1], ca_path, frozenset([leaves["receiver"][2]]), tls.DATA_ALPN, "localhost")
    return server, client


def _manifest(tid: str, position: int, created: int):
    identity = ExactIdentityV1("a" * 64, "b" * 64, "c" * 64, "m", "d" * 64, "t", "e" * 64)
    return BeginManifestV2(
        protocol=PROTOCOL,
        transfer_id=tid,
        generation=1,
        created_unix_ms=created,
        expires_unix_ms=created + 900_000,
        identity=identity,
        prompt_token_ids=tuple(i % 50_000 for i in range(position)),
        multimodal=None,
        hmac=HmacRef("bench", 1),
        components=(ComponentV2("target", "target_kv", True, "f" * 64),),
        deferred_segments=True,
    )


# -- child processes ------------------------------------------------------------------------------


def _map_payload(path: str) -> memoryview:
    """Read-only shared mapping of the payload, page tables filled now (not in the timing)."""
    with open(path, "rb") as fh:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fh.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
    return memoryview(mm)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _fill(recv_into, view: memoryview) -> int:
    """recv_into until ``view`` is full or EOF: one Python step per TLS record, nothing else."""
    want = len(view)
    got = 0
    while got < want:
        k = recv_into(view[got:])
        if not k:
            break
        got += k
    return got


class _Profile:
    """Optional cProfile of the timed region of one child (main thread only)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.prof = None

    def __enter__(self):
        if self.path:
            import cProfile

            self.prof = cProfile.Profile()
            self.prof.enable()
        return self

    def __exit__(self, *exc) -> None:
        if self.prof is not None:
            self.prof.disable()
            self.prof.dump_stats(self.path)


_POOL: list[ThreadPoolExecutor] = []


def _hash_pool() -> ThreadPoolExecutor:
    """This child process's hashing pool, passed to the handoff core as its executor (the core
    starts no threads of its own). A benchmark child is one process per stripe: one pool each."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(4, thread_name_prefix="bench-hash"))
    return _POOL[0]


def _sealed_receiver(chan, group, share: int, position: int, created: int, tid: str, loop: str = "fill") -> dict:
    sink = CountingSink()
    receiver = Receiver(
        ReceiverConfig(key=KEY, key_id="bench", minimum_epoch=1, layout=None), sink, MemoryLedger(), now_unix_ms=created + 1, hash_executor=_hash_pool()
    )
    committed = None
    if loop == "fill":
        recv_into = chan.sock.recv_into  # the verified SSLSocket: no per-record channel wrapper
        while True:
            dst = receiver.wanted()  # the rest of the current phase (a large payload: at most 256 KiB of it)
            want = len(dst)
            if not want:
                break
            got = _fill(recv_into, dst)
            if got:
                for eff in receiver.advance(got):
                    if isinstance(eff, Committed):
                        chan.sendall(eff.ack)
                        committed = eff
            if got < want:
                receiver.eof()  # raises: the stream ended before the seal
                break
    else:  # "per-record": advance after every recv_into (bench_gpu's and the node receiver's loop)
        while True:
            dst = receiver.wanted()
            if not len(dst):
                break
            n = chan.recv_into(dst)
            if n == 0:
                receiver.eof()
                break
            for eff in receiver.advance(n):
                if isinstance(eff, Committed):
                    chan.sendall(eff.ack)
                    committed = eff
    if committed is None or receiver.error is not None:
        raise RuntimeError(f"{tid}: receiver did not commit ({receiver.error})")
    if committed.total_bytes != share or sink.bytes != share or not sink.committed or committed.segment_count != len(group):
        raise RuntimeError(
            f"{tid}: committed {committed.total_bytes} bytes / {committed.segment_count} segments, sink {sink.bytes} committed={sink.committed}; expected {share} / {len(group)}"
        )
    if committed.transfer_id != tid:
        raise RuntimeError(f"{tid}: committed transfer {committed.transfer_id}")
    return {"bytes": committed.total_bytes, "segments": committed.segment_count}


def _sealed_sender(chan, group, payload: memoryview, position: int, created: int, tid: str) -> dict:
    sender = Sender(_manifest(tid, position, created), KEY, hash_executor=_hash_pool())
    q: queue.Queue = queue.Queue(maxsize=8)  # hashing/framing || TLS encrypt + send
    errors: list = []

    def write():
        try:
            while (bufs := q.get()) is not None:
                for b in bufs:
                    chan.sendall(b)
        except BaseException as exc:
            errors.append(exc)
            while q.get() is not None:  # keep the producer from blocking
                pass

    wt = threading.Thread(target=write, daemon=True)
    wt.start()
    try:
        q.put(sender.begin())
        for seq, (layer, role, start, count, off, nbytes) in enumerate(group):
            intent = SpanSegment(seq, "target", role, layer, start, count, ETYPE, ELEMENTS)
            q.put(sender.send_segment(payload[off : off + nbytes], intent))
        q.put(sender.seal())
    finally:
        q.put(None)
    wt.join()
    if errors:
        raise errors[0]
    ack = None
    while ack is None:
        data = chan.recv(65536)
        if not data:
            raise RuntimeError(f"{tid}: receiver closed without an ack")
        ack = sender.receive_data(data)
    if not isinstance(ack, Ack) or ack.transfer_id != tid:
        raise RuntimeError(f"{tid}: bad ack {ack!r}")
    return {"bytes": sender.bytes_sent, "segments": sender.segments_sent}


def _raw_receiver(chan, share: int) -> dict:
    buf = memoryview(bytearray(min(share, 8 << 20)))
    recv_into = chan.sock.recv_into
    left = share
    while left:
        want = min(left, len(buf))
        got = _fill(recv_into, buf[:want])
        left -= got
        if got < want:
            raise RuntimeError(f"raw receiver: EOF with {left} of {share} bytes missing")
    chan.sendall(b"k")
    return {"bytes": share}


def _raw_sender(chan, group, payload: memoryview) -> dict:
    for *_intent, off, nbytes in group:
        chan.sendall(payload[off : off + nbytes])
    if chan.recv(1) != b"k":
        raise RuntimeError("raw sender: no ack")
    return {"bytes": sum(g[-1] for g in group)}


def _child(role: str, kind: str, index: int, spec: dict, link, events, start, profile: str | None) -> None:
    """Entry point of one child process: connect, report ready, wait, run, report."""
    try:
        group = spec["group"]
        share = sum(g[-1] for g in group)
        payload = _map_payload(spec["payload_path"]) if role == "sender" else None
        if role == "receiver":
            listener = tls.listen("127.0.0.1", 0)
            link.send(listener.getsockname()[1])
            chan = tls.accept(listener, spec["server_ep"])
            listener.close()
        else:
            port = link.recv()
            chan = tls.connect(spec["client_ep"], "127.0.0.1", port)
        chan.settimeout(SOCKET_TIMEOUT_S)
        events.put(("ready", role, index, None))
        if not start.wait(SOCKET_TIMEOUT_S):
            raise RuntimeError("no start signal")
        c0 = _cpu()
        with _Profile(profile):
            if kind == "sealed" and role == "receiver":
                res = _sealed_receiver(chan, group, share, spec["position"], spec["created"], spec["tid"], spec["receiver_loop"])
            elif kind == "sealed":
                res = _sealed_sender(chan, group, payload, spec["position"], spec["created"], spec["tid"])
            elif role == "receiver":
                res = _raw_receiver(chan, share)
            else:
                res = _raw_sender(chan, group, payload)
        res["end"] = time.monotonic()
        res["cpu_s"] = _cpu() - c0
        events.put(("done", role, index, res))
        if role == "receiver":  # let the sender read the ack before our close
            try:
                chan.recv(1)
            except Exception:  # noqa: BLE001 - the peer closing any way is fine here
                pass
        chan.close()
    except BaseException:
        events.put(("error", role, index, traceback.format_exc()))
        sys.exit(1)


# -- parent ---------------------------------------------------------------------------------------


def _next_event(events, procs, timeout: float):
    """The next child message; fails fast if a child died without reporting (e.g. killed)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return events.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with {dead[0].exitcode} without reporting") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"no word from the children for {timeout:.0f} s") from None


def _one_run(
    ctx, kind: str, groups, payload_path: str, position: int, endpoints, tag: str, profile_dir: str | None, timeout: float, receiver_loop: str
) -> dict:
    server_ep, client_ep = endpoints
    stripes = len(groups)
    events = ctx.Queue()
    start = ctx.Event()
    created = int(time.time() * 1000)
    procs = []
    try:
        for i, group in enumerate(groups):
            spec = {
                "group": group,
                "payload_path": payload_path,
                "position": position,
                "created": created,
                "tid": f"bench-{tag}-{stripes}-{i}",
                "server_ep": server_ep,
                "client_ep": client_ep,
                "receiver_loop": receiver_loop,
            }
            a, b = ctx.Pipe()
            for role, link in (("receiver", a), ("sender", b)):
                prof = os.path.join(profile_dir, f"{kind}-{stripes}-{role}-{i}.prof") if profile_dir else None
                p = ctx.Process(target=_child, args=(role, kind, i, spec, link, events, start, prof), name=f"{kind}-{role}-{i}", daemon=True)
                p.start()
                procs.append(p)
        ready = 0
        while ready < 2 * stripes:
            msg = _next_event(events, procs, timeout)
            if msg[0] == "error":
                raise RuntimeError(f"{kind} {msg[1]} {msg[2]} failed during set-up:\n{msg[3]}")
            ready += 1
        t0 = time.monotonic()
        start.set()
        results: dict = {}
        while len(results) < 2 * stripes:
            msg = _next_event(events, procs, timeout)
            if msg[0] == "error":
                raise RuntimeError(f"{kind} {msg[1]} {msg[2]} failed:\n{msg[3]}")
            results[(msg[1], msg[2])] = msg[3]
        for p in procs:
            p.join(timeout)
            if p.exitcode != 0:
                raise RuntimeError(f"{p.name} exited with {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    total = 0
    for i, group in enumerate(groups):
        share = sum(g[-1] for g in group)
        for role in ("sender", "receiver"):
            if results[(role, i)]["bytes"] != share:
                raise RuntimeError(f"{kind} {role} {i}: {results[(role, i)]['bytes']} bytes, share {share}")
        if kind == "sealed" and results[("receiver", i)]["segments"] != len(group):
            raise RuntimeError(f"sealed receiver {i}: segment count")
        total += share
    elapsed = max(r["end"] for r in results.values()) - t0
    return {
        "elapsed": elapsed,
        "bytes": total,
        "cpu_sender": sum(r["cpu_s"] for (role, _i), r in results.items() if role == "sender"),
        "cpu_receiver": sum(r["cpu_s"] for (role, _i), r in results.items() if role == "receiver"),
    }


def run(
    payload_path: str,
    segments: list[tuple[int, int]] | None,
    stripes: list[int],
    segment_bytes: int,
    out: str | None,
    *,
    repeat: int = 1,
    context: str = "spawn",
    profile_dir: str | None = None,
    timeout: float = 600.0,
    receiver_loop: str = "fill",
) -> list[dict]:
    """Sealed and raw TLS rates with one sender and one receiver process per stripe.

    ``segments``: (offset, nbytes) pieces of the payload file, each a whole number of
    2 KiB tokens; None lays the file out as 32 layers x 2 roles cut into ``segment_bytes``.
    Emits and returns one dict per stripe count; raises on any failure."""
    size = os.path.getsize(payload_path)
    if segments is None:
        segments = llama_segments(size, segment_bytes)
    if any(off < 0 or off + n > size for off, n in segments):
        raise ValueError("a segment lies outside the payload file")
    segs, position = segment_intents(list(segments))
    payload_bytes = sum(s[-1] for s in segs)
    ctx = mp.get_context(context)
    pki_dir = tempfile.mkdtemp(prefix="kvpack-bench-pki-")
    lines = []
    try:
        endpoints = make_pki(pki_dir)
        for n in stripes:
            if n < 1 or n > len(segs):
                raise ValueError(f"{n} stripes for {len(segs)} segments")
            groups = [segs[i::n] for i in range(n)]  # sequences are per transfer
            runs: dict = {"raw_tls": [], "sealed": []}
            for rep in range(repeat):
                for kind in ("raw_tls", "sealed"):
                    r = _one_run(ctx, kind, groups, payload_path, position, endpoints, f"r{rep}", profile_dir, timeout, receiver_loop)
                    if r["bytes"] != payload_bytes:
                        raise RuntimeError(f"{kind}: {r['bytes']} of {payload_bytes} bytes moved")
                    runs[kind].append(r)
            med = {k: statistics.median(payload_bytes / r["elapsed"] for r in v) for k, v in runs.items()}
            cpu = {k: statistics.median(r["cpu_sender"] + r["cpu_receiver"] for r in v) for k, v in runs.items()}
            line = {
                "bench": "handoff_procs",
                "stripes": n,
                "payload_bytes": payload_bytes,
                "segments": len(segs),
                "segment_bytes": max(s[-1] for s in segs),
                "tokens": position,
                "sealed_gbps": round(med["sealed"] * 8 / 1e9, 2),
                "sealed_GBps": round(med["sealed"] / 1e9, 3),
                "raw_tls_gbps": round(med["raw_tls"] * 8 / 1e9, 2),
                "raw_tls_GBps": round(med["raw_tls"] / 1e9, 3),
                "sealed_over_raw": round(med["sealed"] / med["raw_tls"], 3),
                "sealed_cpu_s": round(cpu["sealed"], 3),
                "sealed_sender_cpu_s": round(statistics.median(r["cpu_sender"] for r in runs["sealed"]), 3),
                "sealed_receiver_cpu_s": round(statistics.median(r["cpu_receiver"] for r in runs["sealed"]), 3),
                "raw_tls_cpu_s": round(cpu["raw_tls"], 3),
                "repeat": repeat,
                "cpus": os.cpu_count(),
                "layout": LAYOUT,
                "transport": "mTLS 1.3 loopback, pinned leaves, ALPN muser-kvpack-v2; start-up and handshakes outside the timing",
                "mode": "deferred (sender hashes per segment + running digest; receiver checks both, HMAC seal, ack)",
                "mp_context": context,
                "receiver_loop": receiver_loop,
            }
            _emit(line, out)
            lines.append(line)
    finally:
        shutil.rmtree(pki_dir, ignore_errors=True)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--payload-file", help="an existing payload file (e.g. real KV bytes), mapped read-only")
    src.add_argument("--payload-mib", type=int, default=1024, help="random payload of this size in /dev/shm (default 1024)")
    ap.add_argument("--payload-dir", default="/dev/shm", help="where --payload-mib writes its file (default /dev/shm)")
    ap.add_argument("--segment-mib", type=float, default=4.0, help="segment size (default 4 MiB = 2,048 Llama tokens)")
    ap.add_argument("--stripes", default="1,2,4,8", help="comma-separated stripe counts (default 1,2,4,8)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per stripe count and kind; the median rate is reported")
    ap.add_argument("--mp-context", default="spawn", choices=("spawn", "forkserver"))
    ap.add_argument(
        "--receiver-loop",
        default="fill",
        choices=("fill", "per-record"),
        help="fill: recv_into until the wanted() view is full, then one advance (default); per-record: advance after every recv_into",
    )
    ap.add_argument("--profile-dir", help="dump a cProfile of every child's timed region (main thread) here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one step of a run")
    ap.add_argument("--out", help="also append the JSON lines to this file")
    args = ap.parse_args(argv)
    stripes = [int(s) for s in args.stripes.split(",") if s.strip()]
    segment_bytes = int(args.segment_mib * (1 << 20))
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
    made = None
    try:
        if args.payload_file:
            path = args.payload_file
        else:
            import numpy as np

            fd, made = tempfile.mkstemp(prefix="kvpack-handoff-payload-", dir=args.payload_dir)
            rng = np.random.default_rng(0)
            step = 64 << 20
            with os.fdopen(fd, "wb") as fh:
                for left in range(args.payload_mib << 20, 0, -step):
                    fh.write(rng.integers(0, 256, size=min(step, left), dtype=np.uint8).tobytes())
            path = made
        run(
            path,
            None,
            stripes,
            segment_bytes,
            args.out,
            repeat=args.repeat,
            context=args.mp_context,
            profile_dir=args.profile_dir,
            timeout=args.timeout,
            receiver_loop=args.receiver_loop,
        )
    finally:
        if made:
            os.unlink(made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
