"""Diagnostic (issue 20): which of a layer's row-wise ops compute a row the same way at
``k * 256`` rows as at 256 rows on this device (the block prefill's premise,
TransformersEngine ``prefill_block_chunks``), and what each costs per 256 rows both ways.

For the 8B shape (hidden 4,096, q 4,096, k/v 1,024, MLP 14,336) in f16 and bf16, each
projection (``F.linear``), the RMS norm and SiLU-gate are run over ``rows`` random rows at
once and over each 256-row slice alone; a line per (dtype, op, rows, blas setting) says
whether every slice is bit-identical and the median ms per 256 rows both ways. Settings:
``default``; ``no_reduced`` (``allow_fp16/bf16_reduced_precision_reduction = False``);
``cublaslt`` (``torch.backends.cuda.preferred_blas_library("cublaslt")``).

    python3 benchmarks/diag_block_rows.py --rows 512,1024,2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial


def _ms(torch, fn, iters=9):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="512,1024,2048")
    ap.add_argument("--settings", default="default,no_reduced,cublaslt")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print(json.dumps({"diag": "block_rows", "skipped": "no CUDA"}))
        return 0
    from kvpack.engine.lean_prefill import _Norm, rms_norm

    dev = torch.device("cuda")
    shapes = {"q": (4096, 4096), "k": (4096, 1024), "o": (4096, 4096), "gate": (4096, 14336), "down": (14336, 4096)}
    gen = torch.Generator(device=dev).manual_seed(3)
    for dtype in (torch.float16, torch.bfloat16):
        for setting in args.settings.split(","):
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = setting != "no_reduced"
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = setting != "no_reduced"
            torch.backends.cuda.preferred_blas_library("cublaslt" if setting == "cublaslt" else "cublas")
            for rows in [int(r) for r in args.rows.split(",")]:
                for name, (k, n) in shapes.items():
                    w = (torch.randn(n, k, generator=gen, device=dev) * 0.02).to(dtype)
                    x = torch.randn(1, rows, k, generator=gen, device=dev).to(dtype)
                    whole = F.linear(x, w)
                    same = all(torch.equal(whole[:, i : i + 256], F.linear(x[:, i : i + 256].contiguous(), w)) for i in range(0, rows, 256))
                    big = _ms(torch, partial(F.linear, x, w)) / (rows // 256)
                    small = _ms(torch, partial(F.linear, x[:, :256].contiguous(), w))
                    print(
                        json.dumps(
                            {
                                "diag": "block_rows",
                                "dtype": str(dtype)[6:],
                                "setting": setting,
                                "op": name,
                                "rows": rows,
                                "identical": same,
                                "ms_per_256_block": round(big, 4),
                                "ms_per_256_grid": round(small, 4),
                            }
                        ),
                        flush=True,
                    )
                if setting == "default":
                    x = torch.randn(1, rows, 4096, generator=gen, device=dev).to(dtype)
                    norm = _Norm(torch.randn(4096, generator=gen, device=dev).to(dtype), 1e-5)
                    whole = rms_norm(x, norm)
                    same = all(torch.equal(whole[:, i : i + 256], rms_norm(x[:, i : i + 256].contiguous(), norm)) for i in range(0, rows, 256))
                    print(
                        json.dumps({"diag": "block_rows", "dtype": str(dtype)[6:], "setting": setting, "op": "rms_norm", "rows": rows, "identical": same}),
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
