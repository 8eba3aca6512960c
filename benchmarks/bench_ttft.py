"""Benchmark: time to first token with the KV cache restored from the pack store versus
recomputing prefill, for the bundled SmolLM2-135M-Instruct on the CPU.

For each prompt length N (default 1,024, 4,096 and 8,192 tokens):

* recompute: a fresh session prefills N tokens (chunked as the engine does) and takes the
  argmax of the last logits row: that is the first token;
* restore: a fresh session asks the store for the deepest cut, verifies every byte (pack
  HMAC, chunk digests, content ids) and installs it, then takes the argmax of the restored
  logits row (no forward pass at all);
* both first tokens must be equal (and the restored cache digest equal to the computed one).

Prints ONE JSON line with per-length medians (``--repeat``) and the speedup ratios. The page
cache is warm (the store was just written); ``--store-dir`` lets you put the store on
another disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,4096,8192")
    ap.add_argument("--repeat", type=int, default=3, help="restore repetitions (recompute runs once per length: it is the slow side)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--store-dir")
    ap.add_argument("--encrypt", action="store_true")
    args = ap.parse_args()

    import torch

    from kvpack.engine.models import load_smollm2
    from kvpack.engine.transformers_adapter import TransformersEngine
    from kvpack.store import PackStore

    engine = TransformersEngine(load_smollm2(), threads=args.threads, prefill_chunk_tokens=256)
    root = args.store_dir or tempfile.mkdtemp(prefix="kvpack-bench-ttft-")
    store = PackStore.init(os.path.join(root, "store"), encrypted=args.encrypt)
    gen = torch.Generator().manual_seed(11)
    # warm-up: the first forward of a process pays one-time costs
    warm = engine.new_session()
    warm.prefill(torch.randint(100, 40000, (256,), generator=gen).tolist())

    results = []
    for n in [int(x) for x in args.tokens.split(",")]:
        tokens = torch.randint(100, 40000, (n,), generator=gen).tolist()
        t0 = time.perf_counter()
        s = engine.new_session()
        s.prefill(tokens)
        first_recompute = int(torch.argmax(s.last_logits))
        recompute_s = time.perf_counter() - t0
        digest = s.cache_digest()
        save = store.save(s)
        del s
        restore_times, verified = [], 0
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            r = engine.new_session()
            hit = store.find_deepest(tokens, engine.layout, engine.identity.ids())
            report = store.restore(hit, r, tokens)
            first_restore = int(torch.argmax(r.last_logits))
            restore_times.append(time.perf_counter() - t0)
            verified = report.bytes_verified
            assert first_restore == first_recompute and hit.cut == n
        assert r.cache_digest() == digest
        restore_s = statistics.median(restore_times)
        results.append(
            {
                "tokens": n,
                "kv_bytes": save.plaintext_bytes,
                "recompute_ttft_s": round(recompute_s, 4),
                "restore_ttft_s": round(restore_s, 4),
                "speedup": round(recompute_s / restore_s, 1),
                "restore_gbps": round(verified / restore_s / 1e9, 3),
                "save_gbps": round(save.plaintext_bytes / save.seconds / 1e9, 3),
            }
        )
    print(
        json.dumps(
            {
                "bench": "ttft",
                "model": "SmolLM2-135M-Instruct (GGUF Q4_1 -> f32)",
                "device": "cpu",
                "threads": engine.threads,
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "encrypted": args.encrypt,
                "page_cache": "warm",
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
