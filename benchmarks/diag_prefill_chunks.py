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

One JSON line per (tokens, forward, chunk): prefill seconds, ratio to one forward, and
``bit_identical_to_256`` with the first differing layer if any. Evidence, not proof: kernel
choices can change with shapes this run does not cover.

``--forwards model,lean,graphs`` runs every chunk size through each of the adapter's
per-chunk forwards (``prefill_forward``: the model's own forward, kvpack.engine.lean_prefill,
its CUDA-graph segments kvpack.engine.graph_prefill), each
compared bit for bit with the first forward's 256 grid, and adds one ``forward_ab`` line per
length with both forwards' prefill and host-issue time per 256-token chunk from the same run.

    python3 benchmarks/diag_prefill_chunks.py --tokens 32768,131072 --chunks 256,1024,2048,4096
    python3 benchmarks/diag_prefill_chunks.py --tokens 32768,131072 --chunks 256 --forwards model,lean,graphs
    python3 benchmarks/diag_prefill_chunks.py --tokens 32768,131072 --chunks 256 --forwards graphs@1,graphs@4,graphs@8

The host-overhead proxy on a CPU (tiny hidden size, 32 layers: a chunk's time is mostly Python
and dispatch; docs/bench/prefill_host_profile.md):

    python3 benchmarks/diag_prefill_chunks.py --device cpu --dtype f32 --hidden 64 --heads 4 \
        --kv-heads 2 --head-dim 16 --intermediate 128 --vocab 512 --prefill-attention lower_right \
        --tokens 2048 --chunks 256 --forwards model,lean --repeats 5
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


def _timed_prefills(engines, chunks, tokens, repeats, sync):
    """Yields ``(engine, chunk, prefill_s, host_issue_s, session)`` per (chunk, engine): the
    fastest of ``repeats`` prefills, the engines' repeats interleaved so that a shared
    machine's load falls on every forward alike."""
    for c in chunks:
        best: dict[int, tuple] = {}
        for _ in range(max(1, repeats)):
            for i, engine in enumerate(engines):
                engine.prefill_chunk_tokens = c  # this experiment only: the adapter refuses C > 256
                s = engine.new_session()
                sync()
                t0 = time.perf_counter()
                s.prefill(tokens)
                queued = time.perf_counter() - t0
                sync()
                dt = time.perf_counter() - t0
                engine.prefill_chunk_tokens = 256
                if i not in best or dt < best[i][0]:
                    best[i] = (dt, queued, s)
                del s
        for i, engine in enumerate(engines):
            dt, queued, s = best.pop(i)
            yield engine, c, dt, queued, s
            del s


def _forward_ab(n: int, one_s: float, per_forward: dict[str, dict]) -> dict:
    """One line comparing the per-chunk forwards on the 256 grid, from the same run: each
    forward's prefill and host-issue time per chunk, and the model forward's time over the lean
    one (``model_over_lean``, > 1 when the lean forward is faster)."""
    chunks = -(-n // 256)
    line: dict = {"bench": "diag_prefill_chunks", "summary": "forward_ab", "tokens": n, "chunks": chunks, "one_forward_s": round(one_s, 4)}
    for name, got in per_forward.items():
        line[f"{name}_prefill_s"] = round(got["prefill_s"], 4)
        line[f"{name}_ms_per_chunk"] = round(got["prefill_s"] / chunks * 1000, 3)
        line[f"{name}_host_issue_ms_per_chunk"] = round(got["host_issue_s"] / chunks * 1000, 3)
        line[f"{name}_over_one_forward"] = round(got["prefill_s"] / one_s, 3)
        line[f"{name}_bit_identical"] = bool(got.get("bit_identical", True))
    for other in ("lean", "graphs"):
        if "model" in per_forward and other in per_forward:
            line[f"model_over_{other}"] = round(per_forward["model"]["prefill_s"] / per_forward[other]["prefill_s"], 3)
            line[f"model_over_{other}_host_issue"] = round(per_forward["model"]["host_issue_s"] / per_forward[other]["host_issue_s"], 3)
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="32768")
    ap.add_argument("--chunks", default="256,1024,2048,4096")
    ap.add_argument(
        "--forwards",
        default="auto",
        help="comma list of prefill_forward values (auto, lean, graphs, model), each optionally @K: K grid chunks per block call (prefill_block_chunks)",
    )
    ap.add_argument("--prefill-attention", default="auto", choices=["auto", "lower_right", "sdpa"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=1, help="prefills per (forward, chunk); the fastest is reported")
    add_model_arguments(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.tokens = [int(x) for x in args.tokens.split(",") if x]
    chunks = [int(x) for x in args.chunks.split(",") if x]
    forwards = [x for x in args.forwards.split(",") if x]

    import torch

    from kvpack.engine.transformers_adapter import TransformersEngine

    loaded = build_model(args, torch)
    engines = []
    labels: dict[int, str] = {}
    for item in forwards:
        forward, _, blocks = item.partition("@")
        engine = TransformersEngine(
            loaded,
            device=args.device,
            prefill_chunk_tokens=256,
            max_context=max(args.tokens) + 256,
            prefill_attention=args.prefill_attention,
            prefill_forward=forward,
            prefill_block_chunks=int(blocks) if blocks else None,
            threads=args.threads,
        )
        engines.append(engine)
        labels[id(engine)] = item
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for engine in engines:
        warm = engine.new_session()
        warm.prefill([3 + i % (args.vocab - 3) for i in range(1024)])
        del warm
    engine = engines[0]

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
        per_forward: dict[str, dict] = {}
        for engine, c, dt, queued, s in _timed_prefills(engines, chunks, tokens, args.repeats, sync):
            line = {"bench": "diag_prefill_chunks", "tokens": n, "chunk": c, "prefill_s": round(dt, 4), "one_forward_s": round(one_s, 4)}
            label = labels[id(engine)]
            line["forward"] = label
            line["block_chunks"] = engine.block_chunks
            line["block_reason"] = engine.block_reason
            if c == 256:
                per_forward[label] = {"prefill_s": dt, "host_issue_s": queued}
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
                if c == 256:
                    per_forward[label]["bit_identical"] = line["bit_identical_to_256"]
                del s
            _emit(line, args.out)
        if len(per_forward) > 1:
            _emit(_forward_ab(n, one_s, per_forward), args.out)
        del base, base_logits, base_session
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
