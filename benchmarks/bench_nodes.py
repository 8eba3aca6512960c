"""Benchmark: the node tier through the real daemons (``kvpack producer`` -> ``kvpack receiver``
subprocesses on loopback, mutual TLS, the arrays engine), against peers measured in the same run.

Part 1, ``sessions`` (one JSON line per concurrency in ``--sessions``, default 1,4,16): that
many clients each send ``--requests`` distinct prompts of ``--session-tokens`` tokens over the
decode node's local API at once (every request a full handoff: plan, control request,
prefill, sealed transfer, verified install, boundary token, ``--decode`` greedy tokens).
Reported: aggregate payload Gbps (payload bytes of every transfer / wall time of the round)
and p50/p99 request latency, each as a ratio to the one-session round of the same run.

Part 2, ``handoff`` (one JSON line per stripe count in ``--stripes``, default 1,2,4,8): a
*resident producer*: one warm-up request of a ``--handoff-mib`` prompt lets the producer keep
its cache resident; each measured request is that prompt plus two new tokens, so the
producer prefills only the last chunk and ships the rest from memory, while the decode node
(resident tier off, one slot) must take a full transfer. Reported: payload Gbps over the
receiver's wire phase (first stripe admitted -> install committed) and over the whole request,
vs a raw TLS stream of the same bytes and vs benchmarks/bench_handoff_procs.py's sealed
stripes (one process per stripe per side) on a payload of the same size and segment size,
both run by this script in the same run (``--no-peers`` skips them).

CPU: each measured handoff request also reports the CPU seconds (user + system, from
/proc) the producer and receiver daemons spent on it -- from the request until both went
idle again, so the producer's remembering after its answer counts -- with their system
part (``*_sys_cpu_s``: fresh pages faulted in show there), and
``cpu_vs_procs_one_stripe``: both daemons' CPU per payload byte over bench_handoff_procs'
sender + receiver CPU per byte at one stripe. On a shared small host, where other jobs move
the Gbps figures, this ratio is the steadier one.

TLS fronts: ``--tls-fronts 0,auto`` runs the handoff part once per setting of the decode
node's ``--tls-fronts`` (its TLS front processes, kvpack.node.tls_front; 0 = TLS in the
daemon's process), each line recording the setting and the count the receiver reported
(``tls_fronts``). The receiver's CPU includes its fronts' (``receiver_fronts_cpu_s`` is
their part). The peers run once per invocation.

Goals (issue 14, H200 host, 16 cores): one stream through the daemons >= 0.9 of the
benchmark's single sealed stripe (>= 6.5 Gbps), >= 20 Gbps at 4 stripes; sessions: aggregate
Gbps grows with concurrency while p50 stays near one session's.

    python benchmarks/bench_nodes.py                                        # 2 cores: small sizes
    python benchmarks/bench_nodes.py --handoff-mib 4096 --session-tokens 1024 --sessions 1,4,16 --stripes 1,2,4,8
    python benchmarks/bench_nodes.py --handoff-mib 4096 --repeat 3 --stripes 1,4 --skip-sessions --tls-fronts 0,auto
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvpack.node.common import load_engine  # noqa: E402
from kvpack.node.local_api import request_local  # noqa: E402
from kvpack.node.wire import TileGeometry, identity_file_json  # noqa: E402
from kvpack.security.enroll import Cluster  # noqa: E402


def _emit(line: dict, out: str | None) -> None:
    text = json.dumps(line, sort_keys=True)
    print(text, flush=True)
    if out:
        with open(out, "a") as fh:
            fh.write(text + "\n")


class Daemon:
    """A ``kvpack`` daemon subprocess; waits for its one ready line."""

    def __init__(self, args: list[str], log_path: str) -> None:
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpack.cli", *args], stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.ready: dict = {}

    def wait_ready(self, timeout: float = 300.0) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: see {self.log.name}")
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                line = self.proc.stdout.readline()
                if line.startswith("{"):
                    return json.loads(line)
        raise RuntimeError(f"daemon not ready in {timeout} s: see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _cluster(root: str, engine) -> Cluster:
    # the enrolled addresses are placeholders: the daemons listen on port 0 (--listen,
    # --control-listen) and the receiver is told the port its producer reported
    c = Cluster.init(root, identity=identity_file_json(engine))
    c.enroll_node("decode-a", "receiver", listen="127.0.0.1:9")
    c.enroll_node("prefill-a", "producer", control_listen="127.0.0.1:9")
    return c


def _start(args, root: str, cluster: Cluster, decode_slots: int, resident_mib: int, tls_fronts: str = "auto") -> tuple[Daemon, Daemon, str]:
    common = ["--engine", args.engine, "--no-store", "--no-metrics"]
    producer = Daemon(
        [
            "producer",
            "--config",
            cluster.producer_config_path("prefill-a"),
            *common,
            "--control-listen",
            "127.0.0.1:0",
            "--prefill-slots",
            str(max(args.sessions_list)),
            "--max-stripes",
            "16",
        ],
        os.path.join(root, "producer.log"),
    )
    try:
        control_port = producer.wait_ready()["control_port"]
    except BaseException:
        producer.stop()
        raise
    sock = os.path.join(tempfile.mkdtemp(prefix="kvbn-"), "r.sock")
    receiver = Daemon(
        [
            "receiver",
            "--config",
            cluster.receiver_config_path("decode-a", "prefill-a"),
            *common,
            "--listen",
            "127.0.0.1:0",
            "--producer-control",
            f"127.0.0.1:{control_port}",
            "--socket",
            sock,
            "--decode-slots",
            str(decode_slots),
            "--resident-mib",
            str(resident_mib),
            "--tls-fronts",
            tls_fronts,
        ],
        os.path.join(root, "receiver.log"),
    )
    try:
        receiver.ready = receiver.wait_ready()
    except BaseException:
        receiver.stop()
        producer.stop()
        raise
    return producer, receiver, sock


def _request(sock: str, tokens: list[int], decode: int, stripes: int = 1) -> tuple[float, dict]:
    t0 = time.perf_counter()
    reply = request_local(sock, {"tokens": tokens, "max_new_tokens": decode, "stripes": stripes}, timeout=1800)
    dt = time.perf_counter() - t0
    if not reply.get("ok"):
        raise RuntimeError(f"request failed: {reply.get('error')}")
    return dt, reply["result"]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))]


class _Round:
    """One round of ``n`` concurrent sessions: latencies and payload bytes of every request."""

    def __init__(self, sock: str, prompts: list[list[int]], requests: int, decode: int) -> None:
        self.sock, self.prompts, self.requests, self.decode = sock, prompts, requests, decode
        self.lat: list[float] = []
        self.payload = 0
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()

    def client(self, k: int) -> None:
        try:
            for j in range(self.requests):
                dt, res = _request(self.sock, self.prompts[k * self.requests + j], self.decode)
                with self.lock:
                    self.lat.append(dt)
                    self.payload += (res.get("transfer") or {}).get("payload_bytes", 0)
        except Exception as exc:  # noqa: BLE001 - reported by run()
            self.errors.append(exc)

    def run(self, n: int) -> float:
        threads = [threading.Thread(target=self.client, args=(k,)) for k in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.errors:
            raise RuntimeError(f"{len(self.errors)} clients failed: {self.errors[0]}")
        return time.perf_counter() - t0


def bench_sessions(args, sock: str, out: str | None) -> None:
    rng = random.Random(7)
    base: dict = {}
    for n in args.sessions_list:
        prompts = [[rng.randrange(1, 60000) for _ in range(args.session_tokens)] for _ in range(n * args.requests)]
        rnd = _Round(sock, prompts, args.requests, args.decode)
        wall = rnd.run(n)
        lat = rnd.lat
        gbps = rnd.payload * 8 / wall / 1e9
        p50, p99 = statistics.median(lat), _pct(lat, 0.99)
        if not base:
            base = {"gbps": gbps, "p50": p50, "p99": p99}
        _emit(
            {
                "bench": "nodes_sessions",
                "sessions": n,
                "requests": len(lat),
                "session_tokens": args.session_tokens,
                "payload_bytes": rnd.payload,
                "wall_s": round(wall, 3),
                "aggregate_payload_gbps": round(gbps, 3),
                "p50_s": round(p50, 4),
                "p99_s": round(p99, 4),
                "gbps_vs_one_session": round(gbps / base["gbps"], 3),
                "p50_vs_one_session": round(p50 / base["p50"], 3),
                "p99_vs_one_session": round(p99 / base["p99"], 3),
                "engine": args.engine,
                "cpus": os.cpu_count(),
            },
            out,
        )


def _wire_s(result: dict) -> float:
    """Receiver wire phase of a (possibly striped) transfer: first admission to commit."""
    t = result.get("transfer") or {}
    stamps = t.get("timestamps") or {}
    if "admitted_unix_ns" in stamps and "committed_unix_ns" in stamps:
        return (stamps["committed_unix_ns"] - stamps["admitted_unix_ns"]) / 1e9
    return float((t.get("durations_s") or {}).get("wire", 0.0))


def _phases(result: dict) -> dict:
    """A request's time by phase: the receiver's (control, wire and after), the producer's
    (from its C.14 receipt: prefill, first segment, last ack), in seconds."""
    t = result.get("transfer") or {}
    prod = t.get("producer_receipt") or {}
    out = {k: result.get(k) for k in ("ttft_s", "boundary_s", "decode_s")}
    out["control_s"] = t.get("control_s")
    out.update({f"receiver_{k}": v for k, v in (t.get("durations_s") or {}).items() if k != "wire"})
    start = prod.get("transfer_start_unix_ns")
    if start:
        for key, name in (
            ("prefill_start_unix_ns", "prefill_start"),
            ("prefill_end_unix_ns", "prefill_end"),
            ("first_segment_sent_unix_ns", "first_segment"),
            ("transfer_acked_unix_ns", "acked"),
        ):
            if prod.get(key):
                out[f"producer_{name}_s"] = round((prod[key] - start) / 1e9, 4)
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0.0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _sys_s(pid: int) -> float:
    """System CPU seconds of a process so far (page faults, zero-filling, socket work)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[12]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _children(pid: int) -> list[int]:
    """Child processes of ``pid`` (the receiver's TLS fronts), from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _settle(pids: list[int], quiet_s: float = 0.3, limit_s: float = 60.0) -> list[float]:
    """Wait until the processes are idle (under 20 ms of CPU in ``quiet_s``); their CPU."""
    end = time.monotonic() + limit_s
    last = [_cpu_s(p) for p in pids]
    while time.monotonic() < end:
        time.sleep(quiet_s)
        now = [_cpu_s(p) for p in pids]
        if sum(now) - sum(last) < 0.02:
            return now
        last = now
    return last


def bench_handoff(args, sock: str, engine, out: str | None, pids: list[int] | None = None, fronts: tuple[str, int] = ("auto", 0)) -> list[dict]:
    """``pids``: producer, receiver, then the receiver's fronts (their CPU counts as the
    receiver's); ``fronts``: the --tls-fronts setting and the count the receiver runs."""
    pids = pids or []
    geometry = TileGeometry.of(engine.layout)
    per_token = geometry.tile_bytes(1)
    tokens = max(512, (args.handoff_mib << 20) // per_token)
    rng = random.Random(11)
    prompt = [rng.randrange(1, 60000) for _ in range(tokens)]
    _request(sock, prompt + [5, 6], 1)  # warm-up: the producer keeps the prompt resident
    # a second full transfer: the decode node's install alternates between two plane sets
    # (the new install is filled while the live session still holds the last one); the
    # arrays engine recycles both from then on (kvpack.engine.arrays.PlanePool), as a
    # serving engine's preallocated KV memory -- no fresh pages faulted in per transfer
    _request(sock, prompt + [8, 6], 1)
    lines = []
    for k, stripes in enumerate(args.stripes_list):
        runs = []
        for rep in range(args.repeat):
            # the token after the resident prompt differs in every request: the decode
            # node's live session (prompt + the previous request's next token) is then no
            # prefix of it, so every measured request takes a full transfer, never local reuse
            cpu0 = _settle(pids)
            sys0 = [_sys_s(p) for p in pids]
            dt, res = _request(sock, prompt + [100 + k * args.repeat + rep, 7], 1, stripes)
            used = [b - a for a, b in zip(cpu0, _settle(pids))]
            used_sys = [_sys_s(p) - a for p, a in zip(pids, sys0)]
            # producer, receiver + its fronts, the same two system parts, the fronts alone
            cpu = [used[0], sum(used[1:]), used_sys[0], sum(used_sys[1:]), sum(used[2:])] if pids else []
            t = res.get("transfer") or {}
            if not t.get("payload_bytes") or (res.get("plan") or {}).get("action") not in (None, "full_transfer"):
                raise RuntimeError(f"request {k}/{rep} was not a full transfer: plan {res.get('plan')}")
            runs.append(
                (dt, _wire_s(res), t.get("payload_bytes", 0), t.get("stripes", 1), (t.get("producer_receipt") or {}).get("prefill_tokens"), _phases(res), cpu)
            )
        dt = statistics.median(r[0] for r in runs)
        wire = statistics.median(r[1] for r in runs)
        payload = runs[0][2]
        lines.append(
            {
                "bench": "nodes_handoff",
                "stripes": stripes,
                "stripes_used": runs[0][3],
                "payload_bytes": payload,
                "tokens": tokens,
                "producer_prefill_tokens": runs[0][4],
                "wire_s": round(wire, 4),
                "request_s": round(dt, 4),
                "wire_gbps": round(payload * 8 / wire / 1e9, 3) if wire else None,
                "request_gbps": round(payload * 8 / dt / 1e9, 3),
                "repeat": args.repeat,
                "phases_s": runs[len(runs) // 2][5],  # where the request's time went (one run)
                "producer_cpu_s": round(statistics.median(r[6][0] for r in runs), 3) if pids else None,
                "receiver_cpu_s": round(statistics.median(r[6][1] for r in runs), 3) if pids else None,
                # the system part of each (fresh pages faulted in show here)
                "producer_sys_cpu_s": round(statistics.median(r[6][2] for r in runs), 3) if pids else None,
                "receiver_sys_cpu_s": round(statistics.median(r[6][3] for r in runs), 3) if pids else None,
                "receiver_fronts_cpu_s": round(statistics.median(r[6][4] for r in runs), 3) if pids else None,
                "tls_fronts_setting": fronts[0],
                "tls_fronts": fronts[1],
                "segments_in_place": (res.get("transfer") or {}).get("segments_in_place"),
                "engine": args.engine,
                "tile_bytes": geometry.tile_bytes(256),
                "cpus": os.cpu_count(),
            }
        )
    return lines


def peers(args, payload_bytes: int, tile_bytes: int) -> dict[int, dict]:
    """bench_handoff_procs on the same payload size and segment size, same run."""
    import bench_handoff_procs as procs

    fd, path = tempfile.mkstemp(prefix="kvpack-bench-nodes-", dir=args.payload_dir)
    try:
        import numpy as np

        rng = np.random.default_rng(0)
        step = 64 << 20
        with os.fdopen(fd, "wb") as fh:
            for left in range(payload_bytes, 0, -step):
                fh.write(rng.integers(0, 256, size=min(step, left), dtype=np.uint8).tobytes())
        segs = [(off, min(tile_bytes, payload_bytes - off)) for off in range(0, payload_bytes, tile_bytes)]
        segs = [(off, n - n % 2048) for off, n in segs if n >= 2048]
        # bench_handoff_procs needs a segment per stripe: a payload of fewer tiles than a
        # stripe count is compared with as many stripes as it has tiles (as the daemons,
        # which put tile j on stripe j mod k, leave the extra stripes empty)
        counts = sorted({min(n, len(segs)) for n in args.stripes_list})
        lines = procs.run(path, segs, counts, tile_bytes, None, timeout=args.timeout)
    finally:
        os.unlink(path)
    by_count = {line["stripes"]: line for line in lines}
    return {n: by_count[min(n, len(segs))] for n in args.stripes_list}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="arrays:32:8:128", help="engine spec of both daemons (default arrays:32:8:128)")
    ap.add_argument("--sessions", default="1,4,16", help="concurrent sessions per round (default 1,4,16)")
    ap.add_argument("--requests", type=int, default=2, help="requests per session per round (default 2)")
    ap.add_argument("--session-tokens", type=int, default=128, help="prompt tokens of each session request (default 128)")
    ap.add_argument("--decode", type=int, default=4, help="tokens decoded per request (default 4)")
    ap.add_argument("--stripes", default="1,2,4,8", help="stripe counts of the handoff part (default 1,2,4,8)")
    ap.add_argument("--handoff-mib", type=int, default=256, help="handoff payload size (default 256 MiB; the GPU host: 4096)")
    ap.add_argument("--repeat", type=int, default=3, help="handoff requests per stripe count; the median is reported")
    ap.add_argument("--no-peers", action="store_true", help="skip the raw TLS / bench_handoff_procs peers")
    ap.add_argument("--skip-sessions", action="store_true")
    ap.add_argument("--skip-handoff", action="store_true")
    ap.add_argument("--payload-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", help="also append the JSON lines to this file")
    ap.add_argument(
        "--tls-fronts",
        default="auto",
        help="the decode node's --tls-fronts; a list (e.g. 0,auto) runs the handoff part once per value (default auto)",
    )
    args = ap.parse_args(argv)
    args.sessions_list = [int(x) for x in args.sessions.split(",") if x.strip()]
    args.stripes_list = [int(x) for x in args.stripes.split(",") if x.strip()]
    args.fronts_list = [x.strip() for x in args.tls_fronts.split(",") if x.strip()] or ["auto"]
    engine = load_engine(args.engine)
    root = tempfile.mkdtemp(prefix="kvpack-bench-nodes-")
    try:
        cluster = _cluster(os.path.join(root, "cluster"), engine)
        if not args.skip_sessions:
            producer, receiver, sock = _start(args, root, cluster, max(args.sessions_list), 0, args.fronts_list[0])
            try:
                bench_sessions(args, sock, args.out)
            finally:
                receiver.stop()
                producer.stop()
        if not args.skip_handoff:
            lines = []
            for setting in args.fronts_list:
                producer, receiver, sock = _start(args, root, cluster, 1, 0, setting)
                try:
                    pids = [producer.proc.pid, receiver.proc.pid, *_children(receiver.proc.pid)]
                    fronts = (setting, int(receiver.ready.get("tls_fronts") or 0))
                    lines += bench_handoff(args, sock, engine, args.out, pids, fronts)
                finally:
                    receiver.stop()
                    producer.stop()
            ref = {} if args.no_peers else peers(args, lines[0]["payload_bytes"], lines[0]["tile_bytes"])
            one = ref.get(1, {}).get("sealed_gbps")
            one_cpu = ref.get(1, {}).get("sealed_cpu_s")
            one_bytes = ref.get(1, {}).get("payload_bytes")
            for line in lines:
                if one_cpu and one_bytes and line.get("producer_cpu_s") is not None:
                    daemons = (line["producer_cpu_s"] + line["receiver_cpu_s"]) / line["payload_bytes"]
                    line.update(procs_one_stripe_cpu_s=one_cpu, cpu_vs_procs_one_stripe=round(daemons / (one_cpu / one_bytes), 3))
                p = ref.get(line["stripes"], {})
                line.update(
                    procs_stripes=p.get("stripes"),
                    procs_sealed_gbps=p.get("sealed_gbps"),
                    raw_tls_gbps=p.get("raw_tls_gbps"),
                    wire_vs_procs_sealed=round(line["wire_gbps"] / p["sealed_gbps"], 3) if p.get("sealed_gbps") and line["wire_gbps"] else None,
                    wire_vs_raw_tls=round(line["wire_gbps"] / p["raw_tls_gbps"], 3) if p.get("raw_tls_gbps") and line["wire_gbps"] else None,
                    wire_vs_procs_one_stripe=round(line["wire_gbps"] / one, 3) if one and line["wire_gbps"] else None,
                )
                _emit(line, args.out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
