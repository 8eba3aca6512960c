"""muse-tiny (the seed's Muse cache layout, f16) handed off through the real daemons.

For each position in ``--positions`` (default 4,096 and 32,768), on one enrolled loopback
cluster with three ``kvpack`` daemon subprocesses (a producer with a pack store and two
receivers, mutual TLS 1.3, ``--engine muse-tiny``):

* **prefill** (this process, one thread, the daemons' engine): the prompt's deepest
  256-aligned prefix, saved to the producer's store (``local_prefill_s``). A Muse producer
  can send nothing until the prefill is within one window of its end (the first SWA segment
  ends there, C.12 layer-major order), and the receiver waits at most ``timeout_ms`` (900 s,
  C.15) between frames: on a slow 2-core host a cold 32k prefill inside the producer would
  outlast it, so the producer restores this prefix (verified) and prefills the last chunk;
* **cold**: receiver A asks for the prompt (position + the boundary token); reported: the
  producer's reuse tier and prefilled tokens, the receiver's TTFT, ``payload_bytes``
  against the upstream Muse span-schedule arithmetic (``schedule_bytes``, must be equal),
  the SWA and NoPE shares;
* **warm (sealed rate)**: receiver B, holding nothing, asks for the same prompt extended by
  one token; the producer installs the prefix it just computed (its resident entry ends
  exactly there, so the windows are held) and prefills one token, so the transfer is almost
  all wire: ``sealed_gbps`` = payload / (ack - transfer start) from the producer's receipt,
  plus the receiver's verify/reserve/commit phases;
* **raw TLS ceiling**, in the same run: the same number of bytes through one TLS 1.3
  loopback connection with the cluster's certificates, 8 MiB writes, nothing else
  (``raw_tls_gbps``); ``sealed_vs_raw`` is the ratio.

Both ends share this machine's cores (2 on CI-sized hosts), so the rates are a lower bound
for separate machines. Prints ONE JSON line. The 32,768-token prefill of muse-tiny takes
tens of minutes on 2 busy cores; pass ``--positions 4096`` for a quick run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time

from kvpack.engine.registry import load_engine
from kvpack.handoff.schedule import class_bytes, muse_schedule_span
from kvpack.node.receiver import request_local
from kvpack.node.wire import identity_file_json
from kvpack.security.enroll import Cluster

ENGINE = ["--engine", "muse-tiny", "--threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompt_of(n: int, seed: int) -> list[int]:
    return [3 + (i * 7919 + seed * 104729) % 509 for i in range(n)]


class Daemon:
    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpack.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("{"):
            raise RuntimeError(f"daemon did not start: {args[0]}")
        self.ready = json.loads(line)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def raw_tls_gbps(node_dir: str, nbytes: int) -> float:
    """The same bytes through one loopback TLS 1.3 connection (the cluster's certificates)."""
    tls = os.path.join(node_dir, "tls")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    server_ctx.load_cert_chain(os.path.join(tls, "node.crt"), os.path.join(tls, "node.key"))
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    client_ctx.check_hostname = False
    client_ctx.verify_mode = ssl.CERT_NONE
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as chan:
            buf = bytearray(8 << 20)
            got = 0
            while got < nbytes:
                n = chan.recv_into(buf)
                if not n:
                    break
                got += n
            chan.sendall(b"k")
        done.set()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    block = os.urandom(8 << 20)
    with client_ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="bench") as chan:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            chan.sendall(memoryview(block)[: min(left, len(block))])
            left -= min(left, len(block))
        chan.recv(1)
        seconds = time.perf_counter() - t0
    done.wait(10)
    listener.close()
    return nbytes * 8 / seconds / 1e9


def seed_store(engine, store_dir: str, position: int) -> float:
    """Prefill the prompt's deepest aligned prefix the producer would reuse and save it
    (with its logits row) to the producer's store; returns the prefill seconds."""
    from kvpack.store import PackStore

    prompt = prompt_of(position + 1, position)
    limit = (position - 1) - (position - 1) % 256
    session = engine.new_session()
    t0 = time.perf_counter()
    session.prefill(prompt[:limit])
    seconds = time.perf_counter() - t0
    store = PackStore.open(store_dir) if os.path.exists(os.path.join(store_dir, "store.json")) else PackStore.init(store_dir)
    store.save(session)
    return seconds


def one_position(position: int, socks: dict[str, str], tmp: str) -> dict:
    prompt = prompt_of(position + 1, position)
    schedule = muse_schedule_span(position, 0)
    expected = sum(s.byte_len for s in schedule)
    t0 = time.perf_counter()
    cold = request_local(socks["a"], {"tokens": prompt, "max_new_tokens": 4}, timeout=3600)
    cold_s = time.perf_counter() - t0
    if not cold.get("ok"):
        raise RuntimeError(f"cold request failed: {cold}")
    warm = request_local(socks["b"], {"tokens": prompt + [7], "max_new_tokens": 4}, timeout=3600)
    if not warm.get("ok"):
        raise RuntimeError(f"warm request failed: {warm}")
    tc, tw = cold["result"]["transfer"], warm["result"]["transfer"]
    pc, pw = tc["producer_receipt"], tw["producer_receipt"]
    sealed_s = (pw["transfer_acked_unix_ns"] - pw["transfer_start_unix_ns"]) / 1e9
    raw = raw_tls_gbps(os.path.join(tmp, "cluster", "nodes", "prefill-a"), tw["payload_bytes"])
    sealed = tw["payload_bytes"] * 8 / sealed_s / 1e9
    shares = class_bytes(schedule)
    return {
        "position": position,
        "schedule_bytes": expected,
        "payload_bytes": tc["payload_bytes"],
        "payload_equals_schedule": tc["payload_bytes"] == expected and tw["payload_bytes"] == sum(x.byte_len for x in muse_schedule_span(position + 1, 0)),
        "segments": len(schedule),
        "swa_bytes": shares.get("swa", 0),
        "nope_bytes": shares.get("nope", 0),
        "cold_producer_prefill_tokens": pc["prefill_tokens"],
        "cold_producer_prefill_s": round((pc["prefill_end_unix_ns"] - pc["prefill_start_unix_ns"]) / 1e9, 3),
        "cold_request_s": round(cold_s, 3),
        "cold_ttft_s": cold["result"]["ttft_s"],
        "warm_prefill_tokens": pw["prefill_tokens"],
        "sealed_transfer_s": round(sealed_s, 4),
        "sealed_gbps": round(sealed, 3),
        "raw_tls_gbps": round(raw, 3),
        "sealed_vs_raw": round(sealed / raw, 3),
        "receiver_phases_s": tw["durations_s"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--positions", default="4096,32768", help="cached positions (prompt length minus the boundary token)")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="kvpack-bench-muse-")
    engine = load_engine("muse-tiny")  # the identity file: the same spec and threads as the daemons
    c = Cluster.init(os.path.join(tmp, "cluster"), identity=identity_file_json(engine))
    for name in ("decode-a", "decode-b"):
        c.enroll_node(name, "receiver", listen=f"127.0.0.1:{free_port()}")
    c.enroll_node("prefill-a", "producer", control_listen=f"127.0.0.1:{free_port()}")
    socks = {k: os.path.join(tempfile.mkdtemp(prefix="kvb-"), f"{k}.sock") for k in ("a", "b")}
    positions = [int(x) for x in args.positions.split(",") if x]
    store_dir = os.path.join(tmp, "producer-store")
    prefill_s = {p: seed_store(engine, store_dir, p) for p in positions}
    daemons = [Daemon(["producer", "--config", c.producer_config_path("prefill-a"), *ENGINE, "--store", store_dir, "--no-metrics"])]
    for k, name in (("a", "decode-a"), ("b", "decode-b")):
        cfg = c.receiver_config_path(name, "prefill-a")
        daemons.append(Daemon(["receiver", "--config", cfg, *ENGINE, "--no-store", "--no-metrics", "--socket", socks[k]]))
    out: dict = {"bench": "muse_nodes", "engine": "muse-tiny", "threads": 1, "cpus": os.cpu_count(), "positions": []}
    try:
        for position in positions:
            cell = one_position(position, socks, tmp)
            cell["local_prefill_s"] = round(prefill_s[position], 3)
            cell["local_prefill_tokens_per_s"] = round((position - 1 - (position - 1) % 256) / prefill_s[position], 1)
            out["positions"].append(cell)
    finally:
        for d in daemons:
            d.stop()
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
