"""Diagnostic (issue 20): where a 256-token prefill chunk's attention time goes on the device,
and what splitting the keys (split-KV) buys.

The graphs prefill (kvpack.engine.graph_prefill) runs each 256-query chunk's attention eagerly
with the lower-right causal flash kernel. On the H200 a chunk took 19 ms at 32k and 41 ms at
131k against 12 / 24 ms per 256 rows of one forward. The suspicion (docs/engine.md): a
256-query chunk gives the flash kernel 2 query blocks x 32 heads = 64 blocks for 132
multiprocessors. This script measures, for the 8B shape (32 query heads, 8 key/value heads,
head size 128, f16) and a chunk of 256 queries over prefixes of several lengths:

* ``lower_right``: what the adapter runs today (``fast_prefill.attend`` with the bias);
* ``flash_splits_N``: ``aten._flash_attention_forward`` called directly, bottom-right causal,
  with ``num_splits=N`` (``0``: the kernel's own heuristic);
* ``one_forward_per_chunk``: a causal flash forward over the whole ``prefix + 256`` rows
  divided by its 256-row chunks: what the same attention costs inside one forward;
* the seven projections of a layer at 256 rows against 4,096 rows (per 256 rows).

Each line gives the median ms per layer call over ``--iters`` CUDA-event timed calls, the
per-prefill estimate (x layers x chunks at that depth), and for the split variants whether
the output is bit-identical to ``lower_right`` and its largest absolute difference, and
whether two calls agree bit for bit (determinism).

``--e2e 32768,131072`` then prefills the bench_gpu model with the graphs forward, once per
``--e2e-splits`` value, with the chunk attention replaced by the split call (this script only),
and prints prefill seconds and the ratio to one forward: the end-to-end effect before anything
lands in the adapter.

    python3 benchmarks/diag_prefill_attention.py --prefixes 4096,16384,65536,130816 --e2e 32768,131072
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial

from bench_gpu import _emit, add_model_arguments, build_model


def _median_ms(torch, fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def flash_split(torch, q_bshd, k_bshd, v_bshd, scale: float, splits: int):
    """Bottom-right causal flash over (1, q, heads, d) queries and (1, kv, kv_heads, d) keys."""
    return torch.ops.aten._flash_attention_forward(
        q_bshd, k_bshd, v_bshd, None, None, q_bshd.shape[1], k_bshd.shape[1], 0.0, True, False, scale=scale, num_splits=splits or None
    )[0]


def micro(args, torch) -> None:
    from kvpack.engine import fast_prefill

    dev = "cuda"
    h, hkv, d, q_len = args.heads, args.kv_heads, args.head_dim, 256
    scale = d**-0.5
    gen = torch.Generator(device=dev).manual_seed(7)
    cap = max(args.prefixes) + q_len
    # the adapter's layouts: queries a transposed (1, q, heads, d) projection, keys a view of
    # a preallocated (1, kv_heads, capacity, d) buffer
    kbuf = torch.randn(1, hkv, cap, d, device=dev, dtype=torch.float16, generator=gen)
    vbuf = torch.randn(1, hkv, cap, d, device=dev, dtype=torch.float16, generator=gen)
    q_rows = torch.randn(1, q_len, h, d, device=dev, dtype=torch.float16, generator=gen)
    query = q_rows.transpose(1, 2)
    for prefix in args.prefixes:
        kv = prefix + q_len
        key, value = kbuf[:, :, :kv], vbuf[:, :, :kv]
        bias = fast_prefill.lower_right_bias(q_len, kv)
        base = fast_prefill.attend(query, key, value, scale, bias)
        line = {"bench": "diag_prefill_attention", "prefix": prefix, "layers": args.layers}
        line["lower_right_ms"] = round(_median_ms(torch, partial(fast_prefill.attend, query, key, value, scale, bias), args.iters), 4)
        kt, vt = key.transpose(1, 2), value.transpose(1, 2)
        for splits in args.splits:
            try:
                out = flash_split(torch, q_rows, kt, vt, scale, splits)
            except Exception as exc:  # an unsupported split count is a result, not a crash
                line[f"flash_splits_{splits}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            again = flash_split(torch, q_rows, kt, vt, scale, splits)
            ms = _median_ms(torch, partial(flash_split, torch, q_rows, kt, vt, scale, splits), args.iters)
            line[f"flash_splits_{splits}_ms"] = round(ms, 4)
            line[f"flash_splits_{splits}_bit_identical"] = bool(torch.equal(out, base))
            line[f"flash_splits_{splits}_max_abs_diff"] = float((out.float() - base.float()).abs().max())
            line[f"flash_splits_{splits}_deterministic"] = bool(torch.equal(out, again))
        # the same attention inside one forward: causal over all kv rows, per 256-row chunk
        if kv <= args.one_forward_max:
            qf = torch.randn(1, kv, h, d, device=dev, dtype=torch.float16, generator=gen)
            ms = _median_ms(torch, partial(flash_split, torch, qf, kt, vt, scale, 1), max(3, args.iters // 4))
            line["one_forward_per_chunk_ms"] = round(ms / (kv // q_len), 4)
            del qf
        line["lower_right_ms_per_chunk_all_layers"] = round(line["lower_right_ms"] * args.layers, 3)
        _emit(line, args.out)
    # projections: 256 rows against 4096 rows, per 256 rows
    hid, inter = args.hidden, args.intermediate
    shapes = {"q": (h * d, hid), "k": (hkv * d, hid), "v": (hkv * d, hid), "o": (hid, h * d), "gate": (inter, hid), "up": (inter, hid), "down": (hid, inter)}
    weights = {n: torch.randn(*s, device=dev, dtype=torch.float16, generator=gen) * 0.01 for n, s in shapes.items()}
    line = {"bench": "diag_prefill_attention", "summary": "projections"}
    for rows in (256, 4096):
        total = 0.0
        for w in weights.values():
            x = torch.randn(rows, w.shape[1], device=dev, dtype=torch.float16, generator=gen)
            total += _median_ms(torch, partial(torch.nn.functional.linear, x, w), args.iters)
        line[f"rows_{rows}_ms_per_256_rows"] = round(total * 256 / rows, 4)
    line["layer_256_over_4096"] = round(line["rows_256_ms_per_256_rows"] / line["rows_4096_ms_per_256_rows"], 3)
    _emit(line, args.out)


def e2e(args, torch) -> None:
    from kvpack.engine import fast_prefill
    from kvpack.engine.transformers_adapter import TransformersEngine

    original = fast_prefill._attend
    args.device = "cuda"
    loaded = build_model(args, torch)
    engine = TransformersEngine(
        loaded, device="cuda", prefill_chunk_tokens=256, max_context=max(args.e2e) + 256, prefill_attention="lower_right", prefill_forward="graphs"
    )
    current = {"splits": None}

    def patched(query, key, value, scaling, bias):
        if bias is None or current["splits"] is None:
            return original(query, key, value, scaling, bias)
        out = flash_split(torch, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scaling, current["splits"])
        return out  # already (1, q, heads, d)

    fast_prefill._attend = patched
    warm = engine.new_session()
    warm.prefill([3 + i % (args.vocab - 3) for i in range(1024)])
    del warm
    try:
        for n in args.e2e:
            tokens = [3 + (i * 7919) % (args.vocab - 3) for i in range(n)]
            x = torch.tensor([tokens], dtype=torch.long, device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                engine.model(input_ids=x, use_cache=False, logits_to_keep=1)
            torch.cuda.synchronize()
            one_s = time.perf_counter() - t0
            line = {"bench": "diag_prefill_attention", "summary": "e2e", "tokens": n, "one_forward_s": round(one_s, 4)}
            for splits in [None, *args.e2e_splits]:
                current["splits"] = splits
                best = None
                first = None
                repeatable = True
                name = "lower_right" if splits is None else f"splits_{splits}"
                for _ in range(args.e2e_repeats):
                    s = engine.new_session()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    try:
                        s.prefill(tokens)
                    except Exception as exc:
                        line[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                        break
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    # the last layer's newest rows and the logits row: a cheap repeatability check
                    mark = (s.cache.layers[-1].keys[:, :, n - 4096 : n].clone(), s.last_logits.clone())
                    if first is None:
                        first = mark
                    else:
                        repeatable = repeatable and torch.equal(first[0], mark[0]) and torch.equal(first[1], mark[1])
                    best = dt if best is None else min(best, dt)
                    del s
                if best is None:
                    continue
                line[f"{name}_s"] = round(best, 4)
                line[f"{name}_over_one_forward"] = round(best / one_s, 3)
                line[f"{name}_repeatable"] = bool(repeatable)
            _emit(line, args.out)
            torch.cuda.empty_cache()
    finally:
        fast_prefill._attend = original


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefixes", default="4096,16384,65536,130816")
    ap.add_argument("--splits", default="0,1,2,4,8,16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--one-forward-max", type=int, default=32768 + 256, help="largest kv for the one-forward comparison")
    ap.add_argument("--e2e", default="", help="prompt lengths for the end-to-end prefill (empty: skip)")
    ap.add_argument("--e2e-splits", default="0,4,8")
    ap.add_argument("--e2e-repeats", type=int, default=2)
    add_model_arguments(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.prefixes = [int(x) for x in args.prefixes.split(",") if x]
    args.splits = [int(x) for x in args.splits.split(",") if x]
    args.e2e = [int(x) for x in args.e2e.split(",") if x]
    args.e2e_splits = [int(x) for x in args.e2e_splits.split(",") if x]

    import torch

    if not torch.cuda.is_available():
        print("diag_prefill_attention needs CUDA", file=sys.stderr)
        return 2
    micro(args, torch)
    if args.e2e:
        e2e(args, torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
