"""Benchmark: production-v1 chunk write and verified read vs the hashing ceiling and safetensors.

A state of --mib MiB (default 256) in 4 MiB chunks is encoded (frame, content id, object key,
object digest, AEAD where enabled) and then verified-read (structure, object digest, header
digest, object key, AEAD, frame decode, content-id recompute), in memory, with --threads
workers (default: all cores). In the same run:

* the ceiling: SHA-256 plus HMAC-SHA-256 over the same bytes with the same thread count (the
  two hash passes that a verified read cannot avoid);
* safetensors save/load of the same tensors (in memory), the usual peer format.

Prints ONE JSON line. Figures are medians of --repeat runs; ratios are read/ceiling.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvpack.format import KeySchedule, StateKey, decode_chunk
from kvpack.format.build import build_schema
from kvpack.format.chunk import encode_chunk
from kvpack.format.objects import Family, FamilyState

CHUNK = 4 * 1024 * 1024


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    total = args.mib * 1024 * 1024
    rng = np.random.default_rng(7)
    # f16 rows of 8 heads x 64 dims = 1 KiB per token: 4 MiB chunks hold 4,096 tokens
    tokens = total // 1024
    data = rng.standard_normal(total // 2, dtype=np.float32).astype(np.float16)
    buf = memoryview(data.view(np.uint8))
    state = FamilyState(key=StateKey(0, "k"), dtype=6, codec=1, dims=(0, 8, 64), token_axis=0, elements_per_token=512)
    family = Family(bytes([2]) * 32, bytes([3]) * 32, bytes([4]) * 32, (state,))
    fam_digest = family.digest()
    schema = build_schema(family, tokens)
    spans = schema.states[0].spans
    keys = KeySchedule.derive(bytes([9]) * 32, bytes([1]) * 32, 1)
    pool = ThreadPoolExecutor(args.threads)

    results: dict[str, object] = {}
    for encrypted in (False, True):
        mode = "encrypted" if encrypted else "plain"

        # each closure binds this round's mode and chunk list (default arguments): pool.map
        # runs them while this iteration is current, but the binding makes that explicit
        def write_one(i: int, encrypted: bool = encrypted):
            span = spans[i]
            piece = buf[span.plaintext_offset : span.plaintext_offset + span.plaintext_bytes]
            salt = i.to_bytes(16, "little") if encrypted else bytes(16)
            nonce = i.to_bytes(12, "little") if encrypted else bytes(12)
            return encode_chunk(
                keys=keys, family_digest=fam_digest, key=state.key, span=span, plaintext=piece, codec=1, encrypted=encrypted, salt=salt, nonce=nonce
            )

        chunks: list = []

        def write_all(chunks: list = chunks):
            chunks[:] = list(pool.map(write_one, range(len(spans))))

        t_write = _median_time(write_all, args.repeat)

        def read_one(i: int, chunks: list = chunks):
            c = chunks[i]
            out = decode_chunk(c.obj, ref=c.ref, span=spans[i], tenant=keys.tenant, family=family, key=state.key, keys=keys, family_digest=fam_digest)
            assert len(out) == spans[i].plaintext_bytes
            return out

        def read_all():
            for _ in pool.map(read_one, range(len(spans))):
                pass

        t_read = _median_time(read_all, args.repeat)
        results[f"{mode}_write_gbps"] = round(total / t_write / 1e9, 3)
        results[f"{mode}_read_gbps"] = round(total / t_read / 1e9, 3)
        results[f"_{mode}_read_s"] = t_read

    def ceiling_one(i: int):
        span = spans[i]
        piece = buf[span.plaintext_offset : span.plaintext_offset + span.plaintext_bytes]
        hashlib.sha256(piece).digest()
        hmac.new(b"k" * 32, piece, hashlib.sha256).digest()

    def ceiling_all():
        for _ in pool.map(ceiling_one, range(len(spans))):
            pass

    t_ceiling = _median_time(ceiling_all, args.repeat)

    import safetensors.numpy as stn

    tensors = {f"layer{i}": np.asarray(data[i * CHUNK // 2 : (i + 1) * CHUNK // 2]) for i in range(len(spans))}
    blob: list[bytes] = []
    t_st_save = _median_time(lambda: blob.__setitem__(slice(None), [stn.save(tensors)]), args.repeat)
    t_st_load = _median_time(lambda: stn.load(blob[0]), args.repeat)

    line = {
        "bench": "format",
        "bytes": total,
        "chunk_bytes": CHUNK,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "plain_write_gbps": results["plain_write_gbps"],
        "plain_read_gbps": results["plain_read_gbps"],
        "encrypted_write_gbps": results["encrypted_write_gbps"],
        "encrypted_read_gbps": results["encrypted_read_gbps"],
        "ceiling_sha256_hmac_gbps": round(total / t_ceiling / 1e9, 3),
        "plain_read_over_ceiling": round(t_ceiling / results["_plain_read_s"], 3),
        "encrypted_read_over_ceiling": round(t_ceiling / results["_encrypted_read_s"], 3),
        "safetensors_save_gbps": round(total / t_st_save / 1e9, 3),
        "safetensors_load_gbps": round(total / t_st_load / 1e9, 3),
        "note": "in-memory; safetensors does no integrity check",
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
