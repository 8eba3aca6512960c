"""Diagnostic (issue 20): where a 256-token prefill chunk's attention time goes on the device,
and what splitting the keys (split-KV) buys.

The graphs prefill (kvpack.engine.graph_prefill) runs each 256-query chunk's attention eagerly
with the lower-right causal flash kernel. On the H200 a chunk took 19 ms at 32k and 41 ms at
131k against 12 / 24 ms per 256 rows of one forward. The suspicion (docs/engine.md): a
256-query chunk gives the flash kernel 2 query blocks x 32 heads = 64 blocks for 132
multiprocessors. This script measures, for the 8B shape (32 query heads, 8 key/value heads,
head size 128, f16) and a chunk of 256 queries over prefixes of several lengths:

* ``lower_right``: what the adapter runs today (``fast_prefill.attend`` with the bias);
* ``flash_splits_N``: the prefix keys cut into ``N`` pieces, each attended by the flash kernel
  (``aten._flash_attention_forward``, one batched call), the chunk's own rows by a causal
  call, merged by log-sum-exp (``0``: one bottom-right causal flash call, which is what
  ``lower_right`` dispatches to);
* ``one_forward_per_chunk``: a causal flash forward over the whole ``prefix + 256`` rows
  divided by its 256-row chunks: what the same attention costs inside one forward;
* the seven projections of a layer at 256, 512, 1,024 and 4,096 rows (per 256 rows), as
  seven GEMMs and as four (q/k/v and gate/up fused over concatenated weights).

Each line gives the median ms per layer call over ``--iters`` CUDA-event timed calls, the
chunk's attention over all layers, and for the split variants whether
the output is bit-identical to ``lower_right`` and its largest absolute difference, and
whether two calls agree bit for bit (determinism).

Measured on the H200 (docs/engine.md, "Split-KV, measured and dropped";
``docs/bench/h200_round6_20261202_prefill_attention_micro.jsonl``): splitting is slower than
the one lower-right call at every prefix measured (4k to 128k): the extra calls and the merge
cost more than the pieces gain. What a chunk loses against one forward: its projections run
at ~0.4 of their 4,096-row rate with 256 rows, and its attention costs ~2.5x its share of one
forward's.

    python3 benchmarks/diag_prefill_attention.py --prefixes 4096,16384,32512,65536,130816 --splits 0,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

from bench_gpu import _emit, add_model_arguments


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


def _flash(torch, q_bshd, k_bshd, v_bshd, scale: float, causal: bool):
    """``aten._flash_attention_forward``: (B, q, heads, d) queries over (B, kv, kv_heads, d)
    keys (causal: bottom-right aligned). Returns (output, logsumexp (B, heads, q) float32)."""
    got = torch.ops.aten._flash_attention_forward(q_bshd, k_bshd, v_bshd, None, None, q_bshd.shape[1], k_bshd.shape[1], 0.0, causal, False, scale=scale)
    return got[0], got[1]


def _combine(torch, outs, lses):
    """Merge partial attentions over disjoint key ranges by their log-sum-exps."""
    lse = torch.stack([x.reshape(-1, *x.shape[-2:]) for x in lses])  # (P, B', heads, q)
    top = lse.amax(dim=0, keepdim=True)
    w = torch.exp(lse - top)
    w = w / w.sum(dim=0, keepdim=True)
    acc = None
    for i, o in enumerate(outs):
        term = o.float() * w[i].transpose(-1, -2).unsqueeze(-1)  # (B', q, heads, 1)
        acc = term if acc is None else acc + term
    return acc.to(outs[0].dtype)


def flash_split(torch, q_bshd, k_bshd, v_bshd, scale: float, splits: int):
    """The chunk's attention with its prefix keys cut into ``splits`` pieces (0: one
    bottom-right causal flash call, what the adapter's bias dispatches to): equal 256-aligned
    pieces in one batched non-causal call, the rest of the prefix in a second, the chunk's own
    rows (the causal square) in a third; merged by log-sum-exp."""
    if not splits:
        return _flash(torch, q_bshd, k_bshd, v_bshd, scale, True)[0]
    q_len, kv = q_bshd.shape[1], k_bshd.shape[1]
    prefix = kv - q_len
    piece = (prefix // splits) // 256 * 256
    outs, lses = [], []
    if piece:
        b, _, hkv, d = k_bshd.shape
        st = k_bshd.stride()
        kb = k_bshd.as_strided((splits, piece, hkv, d), (piece * st[1], st[1], st[2], st[3]))
        vb = v_bshd.as_strided((splits, piece, hkv, d), (piece * v_bshd.stride()[1], *v_bshd.stride()[1:]))
        qb = q_bshd.expand(splits, *q_bshd.shape[1:]).contiguous()
        o, lse = _flash(torch, qb, kb, vb, scale, False)
        outs.extend(o[i : i + 1] for i in range(splits))
        lses.extend(lse[i : i + 1] for i in range(splits))
    done = piece * splits
    if done < prefix:
        o, lse = _flash(torch, q_bshd, k_bshd[:, done:prefix], v_bshd[:, done:prefix], scale, False)
        outs.append(o)
        lses.append(lse)
    o, lse = _flash(torch, q_bshd, k_bshd[:, prefix:], v_bshd[:, prefix:], scale, True)
    outs.append(o)
    lses.append(lse)
    return _combine(torch, outs, lses)


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
            ms = _median_ms(torch, partial(flash_split, torch, qf, kt, vt, scale, 0), max(3, args.iters // 4))
            line["one_forward_per_chunk_ms"] = round(ms / (kv // q_len), 4)
            del qf
        line["lower_right_ms_per_chunk_all_layers"] = round(line["lower_right_ms"] * args.layers, 3)
        _emit(line, args.out)
    # projections: 256 rows against 4096 rows, per 256 rows
    hid, inter = args.hidden, args.intermediate
    shapes = {"q": (h * d, hid), "k": (hkv * d, hid), "v": (hkv * d, hid), "o": (hid, h * d), "gate": (inter, hid), "up": (inter, hid), "down": (hid, inter)}
    weights = {n: torch.randn(*s, device=dev, dtype=torch.float16, generator=gen) * 0.01 for n, s in shapes.items()}
    line = {"bench": "diag_prefill_attention", "summary": "projections"}
    # the same FLOPs with q/k/v and gate/up each as one GEMM over concatenated weights (what a
    # fused forward would run; other bits, so another identity)
    fused = {
        "qkv": torch.cat([weights["q"], weights["k"], weights["v"]]),
        "o": weights["o"],
        "gate_up": torch.cat([weights["gate"], weights["up"]]),
        "down": weights["down"],
    }
    for rows in (256, 512, 1024, 4096):
        for name, group in (("", weights), ("fused_", fused)):
            total = 0.0
            for w in group.values():
                x = torch.randn(rows, w.shape[1], device=dev, dtype=torch.float16, generator=gen)
                total += _median_ms(torch, partial(torch.nn.functional.linear, x, w), args.iters)
            line[f"{name}rows_{rows}_ms_per_256_rows"] = round(total * 256 / rows, 4)
    line["layer_256_over_4096"] = round(line["rows_256_ms_per_256_rows"] / line["rows_4096_ms_per_256_rows"], 3)
    line["fused_256_over_256"] = round(line["fused_rows_256_ms_per_256_rows"] / line["rows_256_ms_per_256_rows"], 3)
    _emit(line, args.out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefixes", default="4096,16384,65536,130816")
    ap.add_argument("--splits", default="0,2,4,8,16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--one-forward-max", type=int, default=32768 + 256, help="largest kv for the one-forward comparison")
    add_model_arguments(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.prefixes = [int(x) for x in args.prefixes.split(",") if x]
    args.splits = [int(x) for x in args.splits.split(",") if x]

    import torch

    if not torch.cuda.is_available():
        print("diag_prefill_attention needs CUDA", file=sys.stderr)
        return 2
    micro(args, torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
