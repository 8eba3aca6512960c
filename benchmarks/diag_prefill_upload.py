"""Diagnostic (issue 20): does copying each prefill chunk's token ids to the GPU serialise the
chunked prefill?

``torch.tensor(ids, device="cuda")`` copies from pageable memory and so synchronises the
stream: before 3716b67 every 256-token chunk did that, so the host waited for all earlier
chunks' kernels before issuing the next. The adapter now uploads the prompt once from pinned
memory (``EngineSession._upload``). This runs both, alternated, on the 8B-shaped random
model of bench_gpu, and checks the caches are bit-identical. ``host_issue_s`` (the host's
time to issue every chunk) equal to ``prefill_s`` in *both* variants means the per-chunk
host work, not the copy, sets the pace.

    python3 benchmarks/diag_prefill_upload.py --tokens 32768,131072
"""

from __future__ import annotations

import argparse
import sys
import time

from bench_gpu import _emit, add_model_arguments, build_model


def per_chunk_copy_prefill(session, token_ids) -> None:
    """The prefill loop as it was before 3716b67: each chunk's ids copied on their own."""
    chunk = session.engine.prefill_chunk_tokens
    ids = session._check_tokens(token_ids)
    for layer in session.cache.layers:
        if hasattr(layer, "reserve"):
            layer.reserve(session.position + len(ids))
    i = 0
    while i < len(ids):
        pos = session.position
        stop = min((pos // chunk + 1) * chunk - pos, len(ids) - i)
        session._forward(ids[i : i + stop])
        i += stop


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="32768")
    ap.add_argument("--repeat", type=int, default=2)
    add_model_arguments(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.tokens = [int(x) for x in args.tokens.split(",") if x]

    import torch

    from kvpack.engine.transformers_adapter import TransformersEngine

    loaded = build_model(args, torch)
    engine = TransformersEngine(loaded, device=args.device, prefill_chunk_tokens=256, max_context=max(args.tokens + [1024]) + 256)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    warm = engine.new_session()
    warm.prefill([3 + i % (args.vocab - 3) for i in range(1024)])
    del warm
    variants = {"ids_once": lambda s, t: s.prefill(t), "per_chunk_copy": per_chunk_copy_prefill}
    for n in args.tokens:
        tokens = [3 + (i * 7919) % (args.vocab - 3) for i in range(n)]
        runs: dict[str, list] = {name: [] for name in variants}
        caches = {}
        for _ in range(args.repeat):
            for name, run in variants.items():
                s = engine.new_session()
                sync()
                t0 = time.perf_counter()
                run(s, tokens)
                issued = time.perf_counter() - t0
                sync()
                runs[name].append({"prefill_s": round(time.perf_counter() - t0, 4), "host_issue_s": round(issued, 4)})
                caches[name] = ([(layer.keys, layer.values) for layer in s.cache.layers], s.last_logits)
        a, b = caches["ids_once"], caches["per_chunk_copy"]
        same = all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a[0], b[0])) and torch.equal(a[1], b[1])
        _emit({"bench": "diag_prefill_upload", "tokens": n, "runs": runs, "bit_identical": bool(same)}, args.out)
        del caches, a, b
    return 0


if __name__ == "__main__":
    sys.exit(main())
