"""Diagnostic: N TLS receive streams as threads of one process vs one process each.

Why it exists (issue 14): through the node daemons, stripes made a handoff *slower* on the
16-core H200 host (6.2 / 5.9 / 5.3 / 4.1 Gbps at 1 / 2 / 4 / 8 stripes), while
bench_handoff_procs, one process per stripe, scaled (7.9 / 13.1 / 19.9 / 23.0). The
suspect: Python's ``ssl`` returns at most one 16 KiB TLS record per ``recv_into``, and each
call releases and retakes the GIL; with several receiving threads in one process the
thread that just released the GIL usually takes it back before a woken thread runs, so the
others wait (the "convoy" of CPython's GIL), and the aggregate stays near one stream.

This isolates that: the senders are always one process per stream (``sendall`` of large
buffers: one GIL release per megabyte, never the bottleneck); the receivers read with the
node's loop shape (one ``recv_into`` per TLS record into a reused 1 MiB buffer) either as
``threads`` (N threads of one process, as ``kvpack receiver`` does today) or ``procs``
(N processes). ``--switch-ms`` also tries other ``sys.setswitchinterval`` values in the
receiving process. One JSON line per (mode, stripes, switch): aggregate Gbps, the
receivers' CPU seconds per GiB, ``first_stream_done_share`` (when the first stream finished,
as a share of the whole: near 1 when the streams share the host fairly, near 1/N when they
take turns) and ``threads_vs_procs`` (threads' Gbps over procs' Gbps, same run); and, with no
network at all, ``sha256_pieces``: N threads vs N processes hashing in 16 KiB calls (one TLS
record's worth of GIL-free work between two GIL retakes) and in 1 MiB calls (the contrast).

    python benchmarks/diag_stripe_gil.py --mib 512 --stripes 1,4          # 2-core box
    python benchmarks/diag_stripe_gil.py --mib 4096 --stripes 1,2,4,8     # H200 host

``--modes relay`` adds the design of the receiver's TLS front processes: each stream's TLS
terminated in a process of its own that relays plaintext over AF_UNIX in batches of up to
1 MiB to threads of one process, which read it with large ``recv_into`` calls;
``--hash-passes 2`` makes every receiving thread hash what it read twice (the receiver's
segment hash and running digest), in every mode. ``--modes fronts`` runs the shipped
code instead of that sketch: threads of one process behind the node's transport
``Listener`` with one TLS front process per stream (kvpack.node.tls_front, the decode
node's ``--tls-fronts``); its CPU is the receiving process's plus its fronts'.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_handoff_procs import make_pki  # noqa: E402

from kvpack.security import tls  # noqa: E402

RECORD_LOOP_BUF = 1 << 20
SEND_BUF = 8 << 20
TIMEOUT_S = 300.0


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _receive(chan, share: int, hash_passes: int = 0) -> None:
    """The node receiver's read shape: one recv_into per TLS record (or per relayed batch),
    a 1 MiB view filled, then ``hash_passes`` SHA-256 passes over it (the receiver's segment
    hash and running digest)."""
    buf = memoryview(bytearray(RECORD_LOOP_BUF))
    recv_into = chan.sock.recv_into if hasattr(chan, "sock") else chan.recv_into
    hashers = [hashlib.sha256() for _ in range(hash_passes)]
    left = share
    while left:
        want = min(left, len(buf))
        got = 0
        while got < want:
            k = recv_into(buf[got:want])
            if not k:
                raise RuntimeError(f"EOF with {left - got} bytes missing")
            got += k
        for h in hashers:
            h.update(buf[:got])
        left -= got
    chan.sendall(b"k")


def _receive_all(streams, share: int, hash_passes: int, start) -> tuple[list[float], float]:
    """After the start signal, every stream read on a thread of its own: when each ended
    (monotonic) and the process's CPU seconds meanwhile."""
    if not start.wait(TIMEOUT_S):
        raise RuntimeError("no start")
    c0 = _cpu()
    errors: list = []
    ends: list[float] = []

    def run(stream) -> None:
        try:
            _receive(stream, share, hash_passes)
            ends.append(time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(stream,)) for stream in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return ends, _cpu() - c0


def _relay_proc(path: str, share: int, server_ep, ports, events, start) -> None:
    """One TLS front: terminates one stream and relays its plaintext over AF_UNIX in
    batches of up to 1 MiB (the design of the receiver's TLS front processes)."""
    try:
        import socket

        ls = tls.listen("127.0.0.1", 0)
        ports.put(ls.getsockname()[1])
        chan = tls.accept(ls, server_ep)
        chan.settimeout(TIMEOUT_S)
        uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        uds.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        uds.connect(path)
        uds.settimeout(TIMEOUT_S)
        events.put(("ready", 1))
        if not start.wait(TIMEOUT_S):
            raise RuntimeError("no start")
        c0 = _cpu()
        buf = memoryview(bytearray(RECORD_LOOP_BUF))
        recv_into = chan.sock.recv_into
        left = share
        while left:
            want = min(left, len(buf))
            got = 0
            while got < want:
                k = recv_into(buf[got:want])
                if not k:
                    raise RuntimeError("EOF")
                got += k
                if not chan.sock.pending():
                    break  # nothing decrypted waiting: hand over what we have
            uds.sendall(buf[:got])
            left -= got
        if uds.recv(1) != b"k":
            raise RuntimeError("no ack from the relay's reader")
        chan.sendall(b"k")
        events.put(("done", ([], _cpu() - c0)))
        try:
            chan.recv(1)
        except Exception:  # noqa: BLE001 - the peer closing is fine
            pass
        chan.close()
        uds.close()
    except BaseException:
        events.put(("error", traceback.format_exc()))


def _relay_receiver_proc(n: int, share: int, hash_passes: int, paths, events, start) -> None:
    """The daemon side of the relay mode: ``n`` threads of one process each reading one
    relayed stream from AF_UNIX with large recv_into calls."""
    try:
        import socket

        tmp = tempfile.mkdtemp(prefix="kvpack-relay-")
        listeners = []
        for i in range(n):
            path = os.path.join(tmp, f"s{i}")
            ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            ls.bind(path)
            ls.listen(1)
            listeners.append(ls)
            paths.put(path)
        conns = []
        for ls in listeners:
            c, _ = ls.accept()
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            c.settimeout(TIMEOUT_S)
            conns.append(c)
        events.put(("ready", n))
        events.put(("done", _receive_all(conns, share, hash_passes, start)))
        for c in conns:
            c.close()
    except BaseException:
        events.put(("error", traceback.format_exc()))


def _receiver_proc(n: int, share: int, server_ep, switch_s: float, hash_passes: int, ports, events, start) -> None:
    """One process receiving ``n`` streams on ``n`` threads (n == 1: the procs mode)."""
    try:
        sys.setswitchinterval(switch_s)
        listeners = [tls.listen("127.0.0.1", 0) for _ in range(n)]
        for ls in listeners:
            ports.put(ls.getsockname()[1])
        chans = [tls.accept(ls, server_ep) for ls in listeners]
        for ch in chans:
            ch.settimeout(TIMEOUT_S)
        events.put(("ready", n))
        events.put(("done", _receive_all(chans, share, hash_passes, start)))
        for ch in chans:
            try:
                ch.recv(1)
            except Exception:  # noqa: BLE001 - the peer closing is fine
                pass
            ch.close()
    except BaseException:
        events.put(("error", traceback.format_exc()))


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _fronted_receiver_proc(n: int, share: int, server_ep, switch_s: float, hash_passes: int, ports, events, start) -> None:
    """One process receiving ``n`` streams on ``n`` worker threads of the node's transport
    Listener whose TLS runs in ``n`` front processes (``kvpack receiver --tls-fronts n``)."""
    from kvpack.node.receipts import RefusalLog
    from kvpack.node.tls_front import FrontPool
    from kvpack.node.transport import Limits, Listener, bind_tcp

    try:
        sys.setswitchinterval(switch_s)
        lock = threading.Lock()
        arrived: list = []
        ends: list[float] = []
        errors: list = []
        go = threading.Event()
        all_in = threading.Event()

        def serve(ch) -> None:
            with lock:
                arrived.append(ch)
                if len(arrived) == n:
                    all_in.set()
            go.wait(TIMEOUT_S)
            try:
                ch.settimeout(TIMEOUT_S)
                _receive(ch, share, hash_passes)
                ends.append(time.monotonic())
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                errors.append(exc)
            try:
                ch.recv(1)
            except Exception:  # noqa: BLE001 - the peer closing is fine
                pass

        pool = FrontPool("diag", server_ep, n, 10.0).start()
        sock = bind_tcp("127.0.0.1", 0, "diag listener")
        lst = Listener(
            "diag", sock, server_ep, tls.server_context(server_ep), serve, limits=Limits(handshake_s=10.0), refusals=RefusalLog("diag"), fronts=pool
        ).start()
        for _ in range(n):
            ports.put(lst.port)
        if not all_in.wait(TIMEOUT_S):
            raise RuntimeError("not every stream arrived")
        events.put(("ready", n))
        if not start.wait(TIMEOUT_S):
            raise RuntimeError("no start")
        pids = pool.pids()
        c0 = _cpu() + sum(_proc_cpu(p) for p in pids)
        go.set()
        while len(ends) + len(errors) < n:
            time.sleep(0.005)
        cpu = _cpu() + sum(_proc_cpu(p) for p in pids) - c0
        if errors:
            raise errors[0]
        events.put(("done", (list(ends), cpu)))
        lst.stop()
    except BaseException:
        events.put(("error", traceback.format_exc()))


def _sender_proc(port: int, share: int, client_ep, events, start) -> None:
    try:
        chan = tls.connect(client_ep, "127.0.0.1", port)
        chan.settimeout(TIMEOUT_S)
        data = memoryview(os.urandom(SEND_BUF))
        events.put(("ready", 1))
        if not start.wait(TIMEOUT_S):
            raise RuntimeError("no start")
        left = share
        while left:
            k = min(left, len(data))
            chan.sendall(data[:k])
            left -= k
        if chan.recv(1) != b"k":
            raise RuntimeError("no ack")
        chan.close()
    except BaseException:
        events.put(("error", traceback.format_exc()))


def _hash_pieces(total: int, piece: int, start) -> None:
    buf = memoryview(bytearray(piece))
    h = hashlib.sha256()
    start.wait()  # a barrier: every worker ready, and the parent's clock starts
    for _ in range(total // piece):
        h.update(buf)  # hashlib releases the GIL for each piece (over 2 KiB)


def short_releases(ctx, workers: int, total: int, piece: int) -> dict:
    """No network: ``workers`` threads vs processes each hashing ``total`` bytes in calls of
    ``piece`` bytes -- a 16 KiB piece is one TLS record's worth of GIL-free C work between two
    GIL retakes, as the receiver's ``recv_into`` loop; 1 MiB pieces are the contrast. Timed
    from a start signal the workers wait for (process start-up is not counted)."""
    out = {}
    for mode in ("threads", "procs"):
        start = threading.Barrier(workers + 1) if mode == "threads" else ctx.Barrier(workers + 1)
        if mode == "threads":
            runners = [threading.Thread(target=_hash_pieces, args=(total, piece, start)) for _ in range(workers)]
        else:
            runners = [ctx.Process(target=_hash_pieces, args=(total, piece, start)) for _ in range(workers)]
        for r in runners:
            r.start()
        start.wait(TIMEOUT_S)
        t0 = time.perf_counter()
        for r in runners:
            r.join()
        out[mode] = workers * total / (time.perf_counter() - t0) / 1e9
    return {"threads_gbs": round(out["threads"], 3), "procs_gbs": round(out["procs"], 3), "threads_vs_procs": round(out["threads"] / out["procs"], 3)}


def one(ctx, mode: str, stripes: int, total: int, endpoints, switch_s: float, hash_passes: int = 0) -> dict:
    server_ep, client_ep = endpoints
    share = total // stripes
    ports, events, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = []
    receivers = stripes if mode == "procs" else 1
    try:
        if mode == "relay":
            paths = ctx.Queue()
            p = ctx.Process(target=_relay_receiver_proc, args=(stripes, share, hash_passes, paths, events, start), daemon=True)
            p.start()
            procs.append(p)
            for _ in range(stripes):
                p = ctx.Process(target=_relay_proc, args=(paths.get(timeout=TIMEOUT_S), share, server_ep, ports, events, start), daemon=True)
                p.start()
                procs.append(p)
            receivers = stripes + 1  # the relays report their CPU too
        else:
            target = _fronted_receiver_proc if mode == "fronts" else _receiver_proc
            for _ in range(receivers):
                p = ctx.Process(target=target, args=(stripes // receivers, share, server_ep, switch_s, hash_passes, ports, events, start), daemon=True)
                p.start()
                procs.append(p)
        for _ in range(stripes):
            p = ctx.Process(target=_sender_proc, args=(ports.get(timeout=TIMEOUT_S), share, client_ep, events, start), daemon=True)
            p.start()
            procs.append(p)
        ready = 0
        while ready < receivers + stripes:
            kind, val = events.get(timeout=TIMEOUT_S)
            if kind == "error":
                raise RuntimeError(val)
            ready += 1
        t0 = time.monotonic()
        start.set()
        ends: list[float] = []
        cpu, reports = 0.0, 0
        while reports < receivers:
            kind, val = events.get(timeout=TIMEOUT_S)
            if kind == "error":
                raise RuntimeError(val)
            ends.extend(val[0])
            cpu += val[1]
            reports += 1
        for p in procs:
            p.join(TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    elapsed = max(ends) - t0
    nbytes = share * stripes
    # streams of equal size that share the host fairly end together; a convoy (one thread
    # keeps the GIL while its socket has data) ends them one after the other
    first = min(ends) - t0
    return {
        "gbps": round(nbytes * 8 / elapsed / 1e9, 3),
        "receiver_cpu_s_per_gib": round(cpu / (nbytes / (1 << 30)), 3),
        "elapsed_s": round(elapsed, 3),
        "first_stream_done_share": round(first / elapsed, 3),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="payload per stripe count (split over the stripes)")
    ap.add_argument("--stripes", default="1,4")
    ap.add_argument("--switch-ms", default="5", help="sys.setswitchinterval values (ms) tried for the receivers (default 5, CPython's)")
    ap.add_argument("--repeat", type=int, default=1, help="alternated runs per case; the best is reported")
    ap.add_argument(
        "--modes",
        default="threads,procs",
        help="threads, procs, relay (TLS terminated in one front process per stream, plaintext relayed over AF_UNIX to threads of one process), "
        "fronts (the same through kvpack.node.tls_front and the transport Listener)",
    )
    ap.add_argument("--hash-passes", type=int, default=0, help="SHA-256 passes the receiving threads make over each MiB (the node receiver makes 2)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    ctx = mp.get_context("spawn")
    root = tempfile.mkdtemp(prefix="kvpack-diag-gil-")
    endpoints = make_pki(root)
    total = args.mib << 20
    for stripes in [int(s) for s in args.stripes.split(",")]:
        for switch_ms in [float(s) for s in args.switch_ms.split(",")]:
            best: dict[str, dict] = {}
            for _ in range(args.repeat):
                for mode in modes:
                    r = one(ctx, mode, stripes, total, endpoints, switch_ms / 1000.0, args.hash_passes)
                    if mode not in best or r["gbps"] > best[mode]["gbps"]:
                        best[mode] = r
            hashing = {f"{piece >> 10}k": short_releases(ctx, stripes, 256 << 20, piece) for piece in (16 << 10, 1 << 20)}
            line = {
                "bench": "diag_stripe_gil",
                "sha256_pieces": hashing,
                "cpus": os.cpu_count(),
                "stripes": stripes,
                "switch_ms": switch_ms,
                "payload_bytes": total,
                "hash_passes": args.hash_passes,
            }
            line.update(best)
            if "procs" in best:
                for mode in best:
                    if mode != "procs":
                        line[f"{mode}_vs_procs"] = round(best[mode]["gbps"] / best["procs"]["gbps"], 3)
            text = json.dumps(line, sort_keys=True)
            print(text, flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
