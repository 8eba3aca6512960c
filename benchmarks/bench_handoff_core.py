"""Handoff V2 core throughput: sender -> in-memory bytes -> receiver vs the two-hash ceiling.

Builds a deferred-mode (production mode) Muse transfer of about ``--bytes`` of payload
(the real Muse span schedule for the smallest 512-aligned position reaching that size:
full 6,815,744-byte NoPE tiles plus the SWA window groups), then times, in one run:

* sender: every segment hashed (descriptor digest) and framed, payloads by reference,
  written into one in-memory wire buffer, plus the seal;
* receiver: the wire buffer fed through ``wanted()``/``advance()`` (the ``recv_into`` path),
  every segment length- and SHA-256-checked, the running payload digest, schedule
  witness, seal digests and HMAC, ledger reserve and sink commit (a sink that keeps only
  counts, so memory shows the receiver's own footprint);
* ceiling: SHA-256 twice over the same payload bytes (the receiver's irreducible work:
  one per-segment digest and one running payload digest).

Prints ONE JSON line. ``ratio`` is receiver GB/s over ceiling GB/s (goal >= 0.8). The
end-to-end figures put both sides' work (four SHA-256 passes: two per side) against the
same two-hash ceiling, serially and pipelined in two threads.
``receiver_peak_extra_bytes`` is the tracemalloc peak of a second, traced receive pass
(the wire buffer it reads from is allocated before and not counted; the parsed begin
manifest with its prompt token ids is included).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import struct
import sys
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

from kvpack.handoff.hashing import INLINE
from kvpack.handoff.manifest import PROTOCOL, BeginManifestV2, ComponentV2, ExactIdentityV1, HmacRef
from kvpack.handoff.receiver import Receiver, ReceiverConfig
from kvpack.handoff.schedule import MUSE, muse_intents, payload_bytes
from kvpack.handoff.sender import Sender

from handoff_doubles import KEY, CountingSink, MemoryLedger as Ledger  # noqa: E402 - benchmarks/ is on sys.path

TILE_BYTES = 6_815_744


def position_for(target: int) -> int:
    position = 512
    while payload_bytes(muse_intents(position)) < target:
        position += 512
    return position


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1 << 30, help="approximate payload bytes (default 1 GiB)")
    ap.add_argument(
        "--hash-threads", type=int, default=4, help="threads of the hashing pool passed to sender and receiver (default 4; 0 = the core's inline default)"
    )
    args = ap.parse_args(argv)
    # The handoff core hashes on the executor its driver passes (kvpack.handoff.hashing).
    executor = ThreadPoolExecutor(args.hash_threads, thread_name_prefix="bench-hash") if args.hash_threads > 0 else INLINE

    position = position_for(args.bytes)
    intents = muse_intents(position)
    total = payload_bytes(intents)
    # Four distinct random tiles reused round-robin: same hashing cost as fresh data,
    # without holding a second GiB of source bytes.
    pool = [memoryview(os.urandom(TILE_BYTES)) for _ in range(4)]
    payloads = [pool[i % 4][: seg.byte_len] for i, seg in enumerate(intents)]

    identity = ExactIdentityV1("a" * 64, "b" * 64, "c" * 64, "m", "d" * 64, "t", "e" * 64)
    created = 1_700_000_000_000
    manifest = BeginManifestV2(
        protocol=PROTOCOL,
        transfer_id="bench-1",
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

    # Sender -> in-memory wire bytes.
    wire = bytearray()
    t0 = time.perf_counter()
    sender = Sender(manifest, KEY, hash_executor=executor)
    for buf in sender.begin():
        wire += buf
    for seg, payload in zip(intents, payloads):
        for buf in sender.send_segment(payload, seg):
            wire += buf
    for buf in sender.seal():
        wire += buf
    t_send = time.perf_counter() - t0

    # Receiver, through the zero-copy recv_into path. Timed without tracemalloc (its
    # allocation hooks cost ~30 % here); a second, traced pass measures memory.
    src = memoryview(wire)

    def receive(traced: bool):
        sink = CountingSink()
        if traced:
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        receiver = Receiver(
            ReceiverConfig(key=KEY, key_id="bench", minimum_epoch=1, layout=MUSE),
            sink,
            Ledger(),
            now_unix_ms=created + 1,
            hash_executor=executor,
        )
        pos = 0
        effects = []
        while pos < len(src):
            dst = receiver.wanted()
            n = min(len(dst), len(src) - pos)
            dst[:n] = src[pos : pos + n]
            pos += n
            effects.extend(receiver.advance(n))
        elapsed = time.perf_counter() - t0
        peak = 0
        if traced:
            peak = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
        assert sink.committed and effects[-1].total_bytes == total
        return elapsed, peak, effects[-1]

    t_recv, _, committed = receive(traced=False)
    _, peak, _ = receive(traced=True)
    assert sender.receive_data(committed.ack).generation == 1

    # Ceiling: SHA-256 twice over the same payload bytes, read from the same wire buffer.
    views = []
    pos = 0
    while pos < len(src):
        hlen, plen = struct.unpack_from("<IQ", src, pos + 8)
        pos += 20 + hlen
        if plen:
            views.append(src[pos : pos + plen])
        pos += plen
    assert sum(v.nbytes for v in views) == total
    t0 = time.perf_counter()
    running = hashlib.sha256()
    for p in views:
        hashlib.sha256(p).digest()
        running.update(p)
    running.digest()
    t_ceiling = time.perf_counter() - t0

    # Pipelined end to end: sender and receiver in two threads joined by a bounded queue
    # of wire chunks (as on two hosts; hashlib releases the GIL on large buffers).
    def pipelined() -> float:
        q: queue.Queue = queue.Queue(maxsize=4)
        sink = CountingSink()
        receiver = Receiver(
            ReceiverConfig(key=KEY, key_id="bench", minimum_epoch=1, layout=MUSE),
            sink,
            Ledger(),
            now_unix_ms=created + 1,
            hash_executor=executor,
        )

        def produce():
            s = Sender(manifest, KEY, hash_executor=executor)
            q.put(b"".join(s.begin()))
            for seg, payload in zip(intents, payloads):
                for buf in s.send_segment(payload, seg):
                    q.put(buf)
            q.put(b"".join(s.seal()))
            q.put(None)

        t0 = time.perf_counter()
        th = threading.Thread(target=produce)
        th.start()
        while (chunk := q.get()) is not None:
            receiver.receive_data(chunk)
        th.join()
        assert sink.committed
        return time.perf_counter() - t0

    t_pipe = pipelined()

    gb = total / 1e9
    result = {
        "bench": "handoff_core",
        "mode": "deferred",
        "position": position,
        "segments": len(intents),
        "full_tiles": sum(1 for p in payloads if p.nbytes == TILE_BYTES),
        "payload_bytes": total,
        "wire_bytes": len(wire),
        "sender_gbps": round(gb / t_send, 3),
        "receiver_gbps": round(gb / t_recv, 3),
        "end_to_end_gbps": round(gb / (t_send + t_recv), 3),
        "ceiling_two_hash_gbps": round(gb / t_ceiling, 3),
        "ratio": round(t_ceiling / t_recv, 3),
        "ratio_end_to_end_serial": round(t_ceiling / (t_send + t_recv), 3),
        "pipelined_end_to_end_gbps": round(gb / t_pipe, 3),
        "ratio_end_to_end_pipelined": round(t_ceiling / t_pipe, 3),
        "receiver_peak_extra_bytes": peak,
        "receiver_peak_extra_tiles": round(peak / TILE_BYTES, 2),
        "hash_threads": args.hash_threads,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
