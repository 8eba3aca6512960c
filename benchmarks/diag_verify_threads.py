"""Diagnostic: verified-chunk throughput vs the raw two-hash ceiling at several thread counts.

Builds N 4 MiB chunk objects in memory and writes them to --dir, then measures with T
threads: (a) the ceiling (SHA-256 + HMAC-SHA-256 over the plaintext), (b) decode_chunk over
in-memory objects, (c) file read + decode_chunk, (d)/(e) the same with the host restore's
one-pass verifier (``decode_chunk_one_pass``, ``--block`` bytes per hash turn; (e) reads into
a reused buffer per thread). Prints one JSON line. Used to locate the
restore bottleneck on many-core hosts (GIL-held Python per chunk vs hashing vs I/O).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvpack.format import KeySchedule, StateKey, decode_chunk
from kvpack.format.build import build_schema
from kvpack.format.chunk import ONE_PASS_BLOCK, decode_chunk_one_pass, encode_chunk
from kvpack.format.objects import Family, FamilyState


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--threads", default="1,4,8,16")
    ap.add_argument("--dir", default="/tmp/kvdiag")
    ap.add_argument("--block", type=int, default=ONE_PASS_BLOCK, help="decode_chunk_one_pass block bytes (the *_one_pass rows)")
    args = ap.parse_args()
    state = FamilyState(key=StateKey(0, "k"), dtype=6, codec=1, dims=(0, 8, 128), token_axis=0, elements_per_token=1024)
    family = Family(bytes([2]) * 32, bytes([3]) * 32, bytes([4]) * 32, (state,))
    digest = family.digest()
    tokens = args.chunks * 2048
    schema = build_schema(family, tokens)
    keys = KeySchedule.derive(bytes([9]) * 32, bytes([1]) * 32, 1)
    rng = np.random.default_rng(1)
    plain = [rng.integers(0, 255, 4 << 20, dtype=np.uint8).tobytes() for _ in range(min(args.chunks, 64))]
    spans = schema.states[0].spans
    chunks = [encode_chunk(keys=keys, family_digest=digest, key=state.key, span=s, plaintext=plain[i % len(plain)], codec=1) for i, s in enumerate(spans)]
    os.makedirs(args.dir, exist_ok=True)
    paths = []
    for i, c in enumerate(chunks):
        p = os.path.join(args.dir, f"{i}.kvchk")
        with open(p, "wb") as fh:
            fh.write(c.obj)
        paths.append(p)
    total = sum(s.plaintext_bytes for s in spans)
    out = {"bench": "diag_verify_threads", "chunks": len(spans), "bytes": total, "cpus": os.cpu_count(), "one_pass_block": args.block, "rows": []}
    buffers = threading.local()
    for t in [int(x) for x in args.threads.split(",")]:
        pool = ThreadPoolExecutor(t)

        def ceiling(i):
            d = plain[i % len(plain)]
            hashlib.sha256(d).digest()
            hmac.new(b"k" * 32, d, hashlib.sha256).digest()

        def verify(i):
            c = chunks[i]
            decode_chunk(c.obj, ref=c.ref, span=spans[i], tenant=keys.tenant, family=family, key=state.key, keys=keys, family_digest=digest)

        def read_verify(i):
            with open(paths[i], "rb") as fh:
                obj = fh.read()
            c = chunks[i]
            decode_chunk(obj, ref=c.ref, span=spans[i], tenant=keys.tenant, family=family, key=state.key, keys=keys, family_digest=digest)

        def verify_one_pass(i):
            c = chunks[i]
            decode_chunk_one_pass(
                c.obj, ref=c.ref, span=spans[i], tenant=keys.tenant, family=family, key=state.key, keys=keys, family_digest=digest, block=args.block
            )

        def read_verify_one_pass(i):
            # as the host restore: read into a reused buffer (one per thread), one-pass verify
            buf = buffers.__dict__.setdefault("buf", bytearray(len(chunks[0].obj)))
            c = chunks[i]
            with open(paths[i], "rb", buffering=0) as fh:
                n = fh.readinto(buf)
            decode_chunk_one_pass(
                memoryview(buf)[:n],
                ref=c.ref,
                span=spans[i],
                tenant=keys.tenant,
                family=family,
                key=state.key,
                keys=keys,
                family_digest=digest,
                block=args.block,
            )

        row = {"threads": t}
        variants = (
            ("ceiling", ceiling),
            ("verify", verify),
            ("read_verify", read_verify),
            ("verify_one_pass", verify_one_pass),
            ("read_verify_one_pass", read_verify_one_pass),
        )
        for name, fn in variants:
            list(pool.map(fn, range(min(8, len(spans)))))  # warm
            t0 = time.perf_counter()
            list(pool.map(fn, range(len(spans))))
            row[f"{name}_gbps"] = round(total / (time.perf_counter() - t0) / 1e9, 2)
        out["rows"].append(row)
        pool.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
