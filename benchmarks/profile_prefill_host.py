"""Where a 256-token prefill chunk's host time goes, per prefill forward (issue 20).

Runs the adapter's chunked prefill under cProfile for each ``prefill_forward`` and splits the
time of one chunk into torch built-ins (``torch._C`` functions and tensor methods: the op
calls themselves, dispatch included, and on a CPU their compute) and everything else (Python:
transformers' plumbing, module calls, the adapter, kvpack's attention and cache layer). On a
CPU with the tiny-hidden proxy the op calls stand in for the kernel launches a GPU pays, and
the rest is the plumbing a lean forward can remove. One JSON line, both forwards from the same
run, plus the ten functions with the most own time per forward.

cProfile inflates Python time (it pays per call), so the line also has each forward's wall
time per chunk without any profiler (fastest of ``--repeats``, the forwards interleaved) and
the time of the prefill's attention calls alone (same shapes, every layer and chunk, timed
apart): on a CPU the attention is a real kernel whose time grows with the prefix, while on
the GPU its host cost is a launch. ``*_host_ms_per_chunk`` is the wall time without the
attention: what the proxy says the rest of a chunk costs the host.

    python3 benchmarks/profile_prefill_host.py --device cpu --dtype f32 --hidden 64 --heads 4 \\
        --kv-heads 2 --head-dim 16 --intermediate 128 --vocab 512 --tokens 1024
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

from bench_gpu import _emit, add_model_arguments, build_model


def _is_torch_builtin(func: tuple[str, int, str]) -> bool:
    filename, _, name = func
    return filename == "~" and ("torch" in name or "Tensor" in name or "method '" in name)


def _attention_seconds(torch, args, n: int, chunks: int, repeats: int) -> float:
    """The attention calls of one prefill alone (kvpack.engine.fast_prefill.attend with the
    chunk's lower-right bias, every layer, every chunk, random operands of the prefill's
    shapes and dtype): the same for both forwards; the fastest of ``repeats``."""
    import warnings

    from kvpack.engine.fast_prefill import attend, lower_right_bias

    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    g = torch.Generator().manual_seed(0)
    best = float("inf")
    shapes = []
    for j in range(chunks):
        q_len = min(256, n - 256 * j)
        kv_len = 256 * j + q_len
        q = torch.randn((1, args.heads, q_len, args.head_dim), generator=g).to(device=args.device, dtype=dtype)
        kv = torch.randn((1, args.kv_heads, kv_len, args.head_dim), generator=g).to(device=args.device, dtype=dtype)
        shapes.append((q, kv, lower_right_bias(q_len, kv_len)))
    scaling = args.head_dim**-0.5
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for q, kv, bias in shapes:
                for _layer in range(args.layers):
                    attend(q, kv, kv, scaling, bias)
            best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024")
    ap.add_argument("--forwards", default="model,lean")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    add_model_arguments(ap)
    args = ap.parse_args(argv)
    args.tokens = [int(args.tokens)]
    n = args.tokens[0]

    import torch

    from kvpack.engine.transformers_adapter import TransformersEngine

    loaded = build_model(args, torch)
    tokens = [3 + (i * 7919) % (args.vocab - 3) for i in range(n)]
    chunks = -(-n // 256)
    line: dict = {"bench": "profile_prefill_host", "tokens": n, "chunks": chunks, "layers": args.layers, "device": args.device, "threads": args.threads}
    engines = {}
    for forward in [x for x in args.forwards.split(",") if x]:
        engine = engines[forward] = TransformersEngine(
            loaded,
            device=args.device,
            threads=args.threads,
            prefill_chunk_tokens=256,
            max_context=n + 256,
            prefill_attention="lower_right",
            prefill_forward=forward,
        )
        engine.new_session().prefill(tokens[:512])  # warm
        session = engine.new_session()
        profile = cProfile.Profile()
        profile.enable()
        session.prefill(tokens)
        profile.disable()
        stats = pstats.Stats(profile)
        total = builtin = 0.0
        calls = python_calls = 0
        rows = []
        for func, (_cc, nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            total += tt
            if _is_torch_builtin(func):
                builtin += tt
                calls += nc
            elif func[0] != "~":
                python_calls += nc
            rows.append((tt, func))
        rows.sort(reverse=True)
        line[f"{forward}_ms_per_chunk"] = round(total / chunks * 1000, 3)
        line[f"{forward}_torch_op_ms_per_chunk"] = round(builtin / chunks * 1000, 3)
        line[f"{forward}_python_ms_per_chunk"] = round((total - builtin) / chunks * 1000, 3)
        line[f"{forward}_torch_calls_per_chunk"] = round(calls / chunks)
        # counts do not depend on the machine's load: the plumbing a chunk pays for
        line[f"{forward}_python_calls_per_chunk"] = round(python_calls / chunks)
        line[f"{forward}_top"] = [
            f"{func[0].split('site-packages/')[-1].split('src/')[-1]}:{func[1]}({func[2]}) {tt / chunks * 1000:.2f}ms" for tt, func in rows[:10]
        ]
    wall = {name: float("inf") for name in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            session = engine.new_session()
            t0 = time.perf_counter()
            session.prefill(tokens)
            wall[name] = min(wall[name], time.perf_counter() - t0)
    attention_s = _attention_seconds(torch, args, n, chunks, args.repeats)
    for name in engines:
        line[f"{name}_wall_ms_per_chunk"] = round(wall[name] / chunks * 1000, 3)
        line[f"{name}_host_ms_per_chunk"] = round((wall[name] - attention_s) / chunks * 1000, 3)
    line["attention_ms_per_chunk"] = round(attention_s / chunks * 1000, 3)
    if "model_host_ms_per_chunk" in line and "lean_host_ms_per_chunk" in line:
        line["host_model_over_lean"] = round(line["model_host_ms_per_chunk"] / max(line["lean_host_ms_per_chunk"], 1e-9), 2)
        line["wall_model_over_lean"] = round(line["model_wall_ms_per_chunk"] / max(line["lean_wall_ms_per_chunk"], 1e-9), 2)
    if "model_python_ms_per_chunk" in line and "lean_python_ms_per_chunk" in line:
        line["python_model_over_lean"] = round(line["model_python_ms_per_chunk"] / max(line["lean_python_ms_per_chunk"], 1e-9), 2)
    _emit(line, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
