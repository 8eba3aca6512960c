"""Diagnostic (issue 20): does a larger physical prefill chunk change a single bit of the cache?

The transformers adapter prefills in absolute 256-token chunks so that a session restored at
any 256-aligned cut and prefilling the rest runs exactly the forwards an uninterrupted prefill
runs (docs/engine.md, "Determinism"). On the H200 that costs ~2x one forward at 32k, mostly
per-chunk launch overhead. A larger chunk keeps that contract only if every row's K/V (and
the last logits row) come out bit-identical whichever chunk the row was computed in. This
script measures exactly that on the device, for the 8B-shaped random model of bench_gpu:

* for each chunk size C it prefills the same prompt on the absolute C grid (the adapter's own
  ``prefill``, with ``prefill_chunk_tokens`` set past its 256 check for this experiment only)
  and compares every plane and the logits row with the 256-grid session, bit for bit;
* ``one_forward_s`` is the whole prompt as one forward (the recompute peer of bench_gpu);
* ``host_issue_s`` is when the host had issued the last chunk (before the final synchronise).

One JSON line per (tokens, chunk): prefill seconds, ratio to one forward, and
``bit_identical_to_256`` with the first differing layer if any. Evidence, not proof: kernel
choices can change with shapes this run does not cover.

    python3 benchmarks/diag_prefill_chunks.py --tokens 32768,131072 --chunks 256,1024,2048,4096
"""

from __future__ import annotations

import argparse
import sys
import time

from bench_gpu import _emit, add_model_arguments, build_model


def _planes(session, torch):
    out = []
    for layer in session.cache.layers:
        out.append((layer.keys, layer.values))
    return out


def _compare(base, other, torch) -> tuple[bool, int | None]:
    for i, ((bk, bv), (ok, ov)) in enumerate(zip(base, other)):
        rows = bk.shape[2]
        if ok.shape[2] != rows or not torch.equal(bk, ok[:, :, :rows]) or not torch.equal(bv, ov[:, :, :rows]):
            return False, i
    return True, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="32768")
    ap.add_argument("--chunks", default="256,1024,2048,4096")
    add_model_arguments(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.tokens = [int(x) for x in args.tokens.split(",") if x]
    chunks = [int(x) for x in args.chunks.split(",") if x]

    import torch

    from kvpack.engine.transformers_adapter import TransformersEngine

    loaded = build_model(args, torch)
    engine = TransformersEngine(loaded, device=args.device, prefill_chunk_tokens=256, max_context=max(args.tokens) + 256)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    warm = engine.new_session()
    warm.prefill([3 + i % (args.vocab - 3) for i in range(1024)])
    del warm

    for n in args.tokens:
        tokens = [3 + (i * 7919) % (args.vocab - 3) for i in range(n)]
        one = engine.new_session()
        one.cache.layers  # noqa: B018 - the session's cache exists before timing
        x = torch.tensor([tokens], dtype=torch.long, device=engine.device)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = engine.model(input_ids=x, use_cache=False, logits_to_keep=1)
        sync()
        one_s = time.perf_counter() - t0
        one_logits = out.logits[0, -1].float()
        del out, one
        base = None
        base_logits = None
        for c in chunks:
            engine.prefill_chunk_tokens = c  # this experiment only: the adapter refuses C > 256
            s = engine.new_session()
            sync()
            t0 = time.perf_counter()
            s.prefill(tokens)
            queued = time.perf_counter() - t0
            sync()
            dt = time.perf_counter() - t0
            line = {"bench": "diag_prefill_chunks", "tokens": n, "chunk": c, "prefill_s": round(dt, 4), "one_forward_s": round(one_s, 4)}
            # the host's time to issue every chunk: close to prefill_s means the GPU waited
            # for launches (per-chunk Python and kernel launch overhead), not the reverse
            line["host_issue_s"] = round(queued, 4)
            line["prefill_over_one_forward"] = round(dt / one_s, 3)
            if base is None:
                base, base_logits, base_session = _planes(s, torch), s.last_logits, s
                line["bit_identical_to_256"] = True
                line["one_forward_logits_identical"] = bool(torch.equal(base_logits, one_logits))
            else:
                same, first = _compare(base, _planes(s, torch), torch)
                line["bit_identical_to_256"] = bool(same and torch.equal(base_logits, s.last_logits))
                line["planes_identical"] = same
                line["logits_identical"] = bool(torch.equal(base_logits, s.last_logits))
                line["first_differing_layer"] = first
                del s
            _emit(line, args.out)
        del base, base_logits, base_session
        engine.prefill_chunk_tokens = 256
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
