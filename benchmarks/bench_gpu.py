"""Benchmark: the GPU path. TTFT restore-from-store vs recompute, against the verification
ceiling measured in the same run, and the sealed handoff rate over mTLS loopback.

Model: a randomly initialised Llama-3-8B-shaped ``LlamaForCausalLM`` (32 layers, 32 heads,
8 KV heads x 128, hidden 4096, intermediate 14336, vocab 128256), f16, sdpa, built directly
on the device (no download). Its weights digest is a digest of the *recipe* (config, seed,
torch version, device), not of the 16 GB of tensors: hashing those would cost ~15 s of
device time and changes nothing measured here. The flags shrink it for a CPU dry run.

For each prompt length N (``--tokens``), one JSON line with:

* ``recompute_engine_s``: TTFT by recomputing: engine prefill in absolute 256-token chunks
  (the deterministic path whose cache the store holds) + argmax of the last logits row;
* ``recompute_oneshot_s``: the same prompt in ONE forward (no chunking; the fastest
  recompute this model has; a different computation order, timing only);
* ``save_s``/``store_write_gbps``: PackStore.save of the whole cut (export via pinned
  buffers, two hash passes, write + fsync per chunk);
* ``restore_warm_s``/``restore_cold_s``: TTFT from the store: new session, find_deepest,
  verified restore (every chunk's object digest + content-id HMAC, every pack), install on
  the GPU, argmax of the restored logits row (no forward at all); the restored cache is
  checked bit for bit against the live one (outside the timing). Warm: page cache hot; cold:
  page cache dropped before the run (``cold_method`` says how);
* ``ceiling_s``: the verification ceiling: SHA-256 over every chunk object plus HMAC-SHA-256
  over every plaintext (the two hash passes the format requires) on ``workers`` threads
  over the same bytes in memory, plus the host-to-device copy of the KV bytes at the rate
  measured here from pinned memory; ``restore_over_ceiling`` = restore_warm_s / ceiling_s;
  ``verified_restore_over_hash_ceiling`` = hash-only ceiling time / chunk-phase time.

Then (``--handoff-tokens``, default 32768): one JSON line per stripe count for the sealed
Handoff V2 transfer of the real KV bytes of that prompt (4 MiB segments, deferred mode,
every payload hashed twice on each side, HMAC seal, ack), over mTLS 1.3 loopback with pinned
leaves, vs a raw TLS stream of the same bytes over the same kind of channel. ``stripes`` > 1
splits the segments over that many connections, each its own transfer. With the default
``--handoff-layout procs`` every stripe has its own sender and receiver process
(benchmarks/bench_handoff_procs.py); ``threads`` runs them as threads of this process.

The restore lines also carry the host-verify restore of the same cut
(``restore_warm_host_verify_s``) and, on CUDA, the GPU path's stages timed alone
(``stage_*``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import hmac
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import bench_handoff_procs  # benchmarks/ is on sys.path when run as a script
from bench_handoff_procs import make_pki


def add_model_arguments(ap) -> None:
    """The random Llama-3-8B-shaped model's options (build_model reads them); shared with the
    diagnostics that build the same model."""
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="f16", choices=["f16", "bf16", "f32"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seed", type=int, default=0)


def _emit(line: dict, out: str | None) -> None:
    text = json.dumps(line, sort_keys=True)
    print(text, flush=True)
    if out:
        with open(out, "a") as fh:
            fh.write(text + "\n")


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(args, torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvpack.engine.models import LoadedModel, tokenizer_digests

    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(args.tokens) + 256,
        rope_theta=500000.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to(device=args.device, dtype=dtype).eval()
    recipe = json.dumps({"config": cfg.to_dict(), "seed": args.seed, "torch": torch.__version__, "device": args.device}, sort_keys=True, default=str)
    tok, tpl = tokenizer_digests(None, cfg.vocab_size)
    return LoadedModel(
        name=f"random-llama3-8b-shape-seed{args.seed}" if args.layers == 32 else f"random-llama-{args.layers}l-seed{args.seed}",
        model=model,
        tokenizer=None,
        weights_digest=hashlib.sha256(b"recipe\0" + recipe.encode()).hexdigest(),
        tokenizer_digest=tok,
        chat_template_digest=tpl,
        weight_precision=f"random-init->{args.dtype}",
        source={"built": "in code, on the device", "weights_digest": "sha256 of the recipe, not of the tensors"},
    )


def drop_page_cache(store_path: str) -> str:
    """Empty the page cache of the store's files; returns the method that worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    os.sync()
    for root, _dirs, files in os.walk(store_path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise_dontneed"


def planes_equal(torch, a, b) -> bool:
    for layer, role in a.layout.states():
        x, _ = a._plane(layer, role)
        y, _ = b._plane(layer, role)
        if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            return False
    return torch.equal(a.last_logits.view(torch.int32), b.last_logits.view(torch.int32))


def copy_rates(torch, device, nbytes: int) -> tuple[float, float]:
    """(H2D, D2H) GB/s between a pinned host buffer and the device (median of 3)."""
    if device.type != "cuda":
        return float("inf"), float("inf")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for direction in ("h2d", "d2h"):
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if direction == "h2d":
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rates.append(nbytes / statistics.median(times[1:]) / 1e9)
    del host, dev
    return rates[0], rates[1]


def hash_ceiling(store, workers: int, repeat: int) -> tuple[float, int, int]:
    """Seconds for SHA-256 over every chunk object + HMAC-SHA-256 over every plaintext of the
    store, in memory, on ``workers`` threads (median). Returns (s, object bytes, plaintext bytes)."""
    from kvpack.format import constants as C
    from kvpack.format.chunk import ChunkHeader

    d = os.path.join(store.path, "chunks")
    objs = []
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as fh:
            obj = fh.read()
        h = ChunkHeader.parse(obj)
        objs.append((obj, C.HEADER_BYTES + C.CODEC_FRAME_HEADER_BYTES, h.plaintext_bytes))
    key = bytes(32)

    def one(item):
        obj, off, n = item
        view = memoryview(obj)
        hashlib.sha256(view).digest()
        hmac.new(key, view[off : off + n], hashlib.sha256).digest()

    times = []
    with ThreadPoolExecutor(workers) as pool:
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in pool.map(one, objs):
                pass
            times.append(time.perf_counter() - t0)
    obj_bytes = sum(len(o) for o, _, _ in objs)
    pt_bytes = sum(n for _, _, n in objs)
    del objs
    return statistics.median(times), obj_bytes, pt_bytes


def store_floors(args, store, line: dict, workers: int, h2d_gbps: float, cold: bool) -> None:
    """The floors of this cut, measured over its own files in this run (bench_limits):
    page cache -> pinned reads on ``workers`` threads (and cold reads of the same files),
    the GPU SHA-256 of as many messages of the cut's object size as a restore hashes, the
    pinned H2D copy of the KV bytes, and the store's durable write pattern for objects of
    this size without hashing. Adds ``floor_*`` fields and the ratios to them."""
    import bench_limits

    from kvpack.store.publish import save_threads

    d = os.path.join(store.path, "chunks")
    paths = [os.path.join(d, n) for n in sorted(os.listdir(d)) if not n.startswith(".")]
    sizes = sorted(os.path.getsize(p) for p in paths)
    typical = sizes[len(sizes) // 2]
    reads = bench_limits.read_floors(paths, workers, args.repeat, cold=cold)
    line.update({f"floor_{k}": v for k, v in reads.items()})
    h2d_s = line["kv_bytes"] / (h2d_gbps * 1e9)
    line["floor_h2d_s"] = round(h2d_s, 4)
    hashed = bench_limits.gpu_sha256(typical, 2 * len(paths))
    if hashed and "launch_s" in hashed:
        line["floor_gpu_hash_s"] = hashed["launch_s"]
        line["floor_gpu_hash_gbps"] = hashed["gbps"]
        line["floor_gpu_hash_message_bytes"] = typical
    parts = [reads["read_warm_s"], h2d_s, line.get("floor_gpu_hash_s", 0.0)]
    line["floor_s"] = round(max(parts), 4)
    line["restore_over_floor"] = round(line["restore_warm_s"] / line["floor_s"], 3)
    line["restore_over_serial_stages"] = round(line["restore_warm_s"] / sum(parts), 3)
    count = max(1, min(len(paths), (4 << 30) // typical))
    raw = bench_limits.durable_write_rate(os.path.join(args.store_dir, "rawwrite"), typical, count, save_threads(store))
    line.update({f"floor_{k}": v for k, v in raw.items()})
    line["store_object_write_gbps"] = round(line["store_bytes"] / line["save_s"] / 1e9, 3)
    line["save_over_raw_write"] = round(line["store_object_write_gbps"] / raw["write_gbps"], 3)


def bench_length(args, torch, engine, n: int, workers: int, h2d_gbps: float, d2h_gbps: float, keep_payload: bool):
    from transformers import DynamicCache

    from kvpack.store import PackStore

    device = engine.device
    g = torch.Generator().manual_seed(1000 + n)
    tokens = torch.randint(3, engine.layout.vocab_size, (n,), generator=g).tolist()
    line: dict = {"bench": "gpu_ttft", "tokens": n}

    # recompute: the engine's chunked prefill (this is also the cache we store)
    _sync(torch, device)
    t0 = time.perf_counter()
    s = engine.new_session()
    s.prefill(tokens)
    first = int(torch.argmax(s.last_logits).item())
    line["recompute_engine_s"] = round(time.perf_counter() - t0, 4)

    # recompute: one forward over the whole prompt
    if not args.skip_oneshot:
        try:
            x = torch.tensor([tokens], dtype=torch.long, device=device)
            _sync(torch, device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = engine.model(input_ids=x, past_key_values=DynamicCache(config=engine.config), use_cache=True, logits_to_keep=1)
                int(torch.argmax(out.logits[0, -1]).item())
            line["recompute_oneshot_s"] = round(time.perf_counter() - t0, 4)
            del out, x
        except (RuntimeError, MemoryError) as exc:  # pragma: no cover - out of device memory
            line["recompute_oneshot_s"] = None
            line["recompute_oneshot_error"] = str(exc)[:120]
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    root = os.path.join(args.store_dir, f"n{n}")
    shutil.rmtree(root, ignore_errors=True)
    store = PackStore.init(root, **({"chunk_bytes": args.chunk_bytes} if args.chunk_bytes else {}))
    store.workers = workers
    save = store.save(s)
    line["kv_bytes"] = save.plaintext_bytes
    line["store_bytes"] = save.bytes_written
    line["chunks"] = save.chunks_written
    line["save_s"] = round(save.seconds, 4)
    line["store_write_gbps"] = round(save.plaintext_bytes / save.seconds / 1e9, 3)
    line["chunk_bytes"] = store.chunk_bytes

    payload = None
    if keep_payload:  # the real KV bytes, for the handoff benchmark
        payload = bytearray(save.plaintext_bytes)
        reqs = []
        for layer, role in engine.layout.states():
            for a in range(0, n, args.segment_tokens):
                reqs.append((layer, role, a, min(n, a + args.segment_tokens)))
        pos = 0
        segs = []
        for (layer, role, a, b), (view, release) in zip(reqs, s.export_spans(reqs)):
            payload[pos : pos + view.nbytes] = view
            segs.append((layer, role, a, b, pos, view.nbytes))
            pos += view.nbytes
            if release:
                release()
        etype = "f32_le" if engine.layout.layer(0).dtype == "f32" else "f16_le"  # 2-byte elements for f16/bf16
        payload = (memoryview(payload)[:pos], segs, engine.layout.layer(0).row_elements, etype)

    def restore_once(check: bool):
        gc.collect()
        _sync(torch, device)
        t0 = time.perf_counter()
        r = engine.new_session()
        hit = store.find_deepest(tokens, engine.layout, engine.ids())
        rep = store.restore(hit, r, tokens)
        _sync(torch, device)
        tok = int(torch.argmax(r.last_logits).item())
        elapsed = time.perf_counter() - t0
        assert hit.cut == n and tok == first, "restored first token differs"
        if check:
            assert planes_equal(torch, s, r), "restored cache differs from the live one"
        del r
        return elapsed, rep

    # the default path (on CUDA: hashes on the device), then the host-verify path for comparison
    modes = ["auto", "host"] if device.type == "cuda" and n <= args.host_verify_max_tokens else ["auto"]
    results = {}
    for mode in modes:
        store.verify_on = mode
        warm = [restore_once(check=(i == 0)) for i in range(args.repeat)]
        results[mode] = warm
    store.verify_on = "auto"
    warm = results["auto"]
    line["restore_warm_s"] = round(statistics.median(t for t, _ in warm), 4)
    line["restore_warm_all_s"] = [round(t, 4) for t, _ in warm]
    line["restore_hashed_on"] = warm[0][1].hashed_on
    chunk_phase = statistics.median(rep.phases["chunks_s"] for _, rep in warm)
    typical = sorted(warm, key=lambda item: item[0])[len(warm) // 2][1]  # the median run's phases
    line["restore_phases_s"] = {k: round(v, 4) for k, v in typical.phases.items()}
    line["bytes_verified"] = warm[0][1].bytes_verified
    line["verified_restore_gbps"] = round(save.plaintext_bytes / line["restore_warm_s"] / 1e9, 3)
    if "host" in results:
        line["restore_warm_host_verify_s"] = round(statistics.median(t for t, _ in results["host"]), 4)
    line["bit_identical"] = True
    cold = not args.skip_cold and n <= args.cold_max_tokens
    if device.type == "cuda":  # warm and cold reads of these files: before the cold restore
        store_floors(args, store, line, workers, h2d_gbps, cold)
    if cold:
        line["cold_method"] = drop_page_cache(root)
        t_cold, _ = restore_once(check=False)
        line["restore_cold_s"] = round(t_cold, 4)
        if "floor_read_cold_s" in line:
            line["cold_restore_over_cold_read"] = round(line["floor_read_cold_s"] / line["restore_cold_s"], 3)
    if args.cpu_ceiling:  # the first rounds' goal: both hashes on the CPU cores, plus the H2D copy
        hash_s, _obj_bytes, pt_bytes = hash_ceiling(store, workers, args.repeat)
        ceiling = hash_s + pt_bytes / (h2d_gbps * 1e9)
        line["ceiling_hash_s"] = round(hash_s, 4)
        line["ceiling_s"] = round(ceiling, 4)
        line["restore_over_ceiling"] = round(line["restore_warm_s"] / ceiling, 3)
        line["verified_restore_over_hash_ceiling"] = round(hash_s / chunk_phase, 3)
    if line.get("recompute_oneshot_s"):
        line["prefill_over_oneshot"] = round(line["recompute_engine_s"] / line["recompute_oneshot_s"], 3)
    rec = min(v for v in (line["recompute_engine_s"], line.get("recompute_oneshot_s")) if v)
    line["speedup_vs_best_recompute_warm"] = round(rec / line["restore_warm_s"], 2)
    if "restore_cold_s" in line:
        line["speedup_vs_best_recompute_cold"] = round(rec / line["restore_cold_s"], 2)
    line["speedup_vs_engine_recompute_warm"] = round(line["recompute_engine_s"] / line["restore_warm_s"], 2)
    line.update(workers=workers, h2d_gbps=round(h2d_gbps, 2), d2h_gbps=round(d2h_gbps, 2), store_dir=args.store_dir)
    s = None  # drop the live cache before the next length
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(root, ignore_errors=True)
    return line, payload


# -- handoff over mTLS -------------------------------------------------------------------------


def open_pairs(server_ep, client_ep, count: int):
    from kvpack.security.tls import accept, connect, listen

    listener = listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    servers: list = []

    def acc():
        for _ in range(count):
            servers.append(accept(listener, server_ep))

    th = threading.Thread(target=acc)
    th.start()
    clients = [connect(client_ep, "127.0.0.1", port) for _ in range(count)]
    th.join()
    listener.close()
    return list(zip(clients, servers))


def _stripe_in_threads(pair, receive, send) -> None:
    """One stripe as two threads of this process: ``receive(server)`` beside ``send(client)``
    (bench_handoff_procs' sender and receiver bodies); the first failure is raised."""
    client, server = pair
    errors: list = []

    def guarded(fn, chan):
        try:
            fn(chan)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            client.close()  # unblock the peer
            server.close()

    rt = threading.Thread(target=guarded, args=(receive, server), daemon=True)
    rt.start()
    guarded(send, client)
    rt.join()
    if errors:
        raise errors[0]


def bench_handoff(args, payload_info, out: str | None) -> None:
    """``--handoff-layout threads``: every stripe's sender and receiver are threads of this
    process (the first round's layout, kept to show what the GIL costs), with the
    advance-per-record receive loop; the bodies are bench_handoff_procs'."""
    payload, segs, _elements, _etype = payload_info
    intents, position = bench_handoff_procs.segment_intents([(off, nbytes) for *_rest, off, nbytes in segs])
    tmp = tempfile.mkdtemp(prefix="kvpack-bench-pki-")
    server_ep, client_ep = make_pki(tmp)
    for stripes in args.stripes:
        groups = [intents[i::stripes] for i in range(stripes)]
        # sequences are per transfer; each stripe is its own transfer of its own segments
        rates = {}
        for kind in ("raw_tls", "sealed"):
            pairs = open_pairs(server_ep, client_ep, stripes)
            created = int(time.time() * 1000)
            errors: list = []

            def run(i, kind=kind, pairs=pairs, groups=groups, stripes=stripes, errors=errors, created=created):
                group, tid = groups[i], f"bench-{stripes}-{i}"
                share = sum(g[-1] for g in group)
                try:
                    if kind == "sealed":
                        _stripe_in_threads(
                            pairs[i],
                            lambda chan: bench_handoff_procs._sealed_receiver(chan, group, share, position, created, tid, "per-record"),
                            lambda chan: bench_handoff_procs._sealed_sender(chan, group, payload, position, created, tid),
                        )
                    else:
                        _stripe_in_threads(
                            pairs[i],
                            lambda chan: bench_handoff_procs._raw_receiver(chan, share),
                            lambda chan: bench_handoff_procs._raw_sender(chan, group, payload),
                        )
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(stripes)]
            t0 = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            elapsed = time.perf_counter() - t0
            for c, s in pairs:
                c.close()
                s.close()
            if errors:
                raise errors[0]
            rates[kind] = payload.nbytes / elapsed
        _emit(
            {
                "bench": "gpu_handoff",
                "stripes": stripes,
                "payload_bytes": payload.nbytes,
                "segments": len(segs),
                "segment_bytes": max(s[5] for s in segs),
                "tokens": position,
                "sealed_gbps": round(rates["sealed"] * 8 / 1e9, 2),
                "sealed_GBps": round(rates["sealed"] / 1e9, 3),
                "raw_tls_gbps": round(rates["raw_tls"] * 8 / 1e9, 2),
                "raw_tls_GBps": round(rates["raw_tls"] / 1e9, 3),
                "sealed_over_raw": round(rates["sealed"] / rates["raw_tls"], 3),
                "transport": "mTLS 1.3 loopback, pinned leaves, ALPN muser-kvpack-v2; handshakes outside the timing",
                "mode": "deferred (sender hashes per segment + running digest; receiver checks both, HMAC seal, ack)",
                "cpus": os.cpu_count(),
            },
            out,
        )
    shutil.rmtree(tmp, ignore_errors=True)


def bench_handoff_processes(args, payload_info, out: str | None) -> None:
    """The sealed handoff of the real KV bytes with one sender and one receiver process per
    stripe (benchmarks/bench_handoff_procs.py): the payload goes to a /dev/shm file that
    every process maps; the segments are the same (offset, size) pieces as the threaded run."""
    payload, segs, _elements, _etype = payload_info
    fd, path = tempfile.mkstemp(prefix="kvpack-kv-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
        bench_handoff_procs.run(path, [(off, nbytes) for *_rest, off, nbytes in segs], args.stripes, max(s[5] for s in segs), out)
    finally:
        os.unlink(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8192,32768,131072")
    add_model_arguments(ap)
    ap.add_argument("--repeat", type=int, default=2, help="warm restores (and ceiling passes) per length")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="store verify/hash threads")
    ap.add_argument("--store-dir", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--skip-oneshot", action="store_true")
    ap.add_argument("--cold-max-tokens", type=int, default=1 << 30, help="cold restore and cold reads only up to this length")
    ap.add_argument("--host-verify-max-tokens", type=int, default=8192, help="also time the host-verify restore up to this length")
    ap.add_argument("--cpu-ceiling", action="store_true", help="also time both hashes on the CPU cores (the first rounds' ceiling)")
    ap.add_argument("--chunk-bytes", type=int, default=None, help="store chunk size (default: the store's default)")
    ap.add_argument("--prefill-attention", default="auto", choices=["auto", "lower_right", "sdpa"])
    ap.add_argument(
        "--prefill-forward",
        default="auto",
        choices=["auto", "lean", "graphs", "model"],
        help="the adapter's per-chunk forward (kvpack.engine.lean_prefill, graph_prefill)",
    )
    ap.add_argument("--handoff-tokens", type=int, default=32768, help="prompt whose KV bytes the handoff moves (0: skip)")
    ap.add_argument("--segment-tokens", type=int, default=2048, help="handoff segment size in tokens")
    ap.add_argument("--stripes", default="1,2,4,8")
    ap.add_argument(
        "--handoff-layout",
        default="procs",
        choices=["procs", "threads"],
        help="procs: one sender and one receiver process per stripe (bench_handoff_procs, over the real KV bytes in /dev/shm); threads: every stripe a thread pair in this process",
    )
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = ap.parse_args(argv)
    args.tokens = [int(x) for x in args.tokens.split(",") if x]
    args.stripes = [int(x) for x in args.stripes.split(",") if x]
    args.store_dir = args.store_dir or tempfile.mkdtemp(prefix="kvpack-bench-gpu-")
    os.makedirs(args.store_dir, exist_ok=True)

    import torch
    import transformers

    from kvpack.engine.transformers_adapter import TransformersEngine

    device = torch.device(args.device)
    t0 = time.perf_counter()
    loaded = build_model(args, torch)
    engine = TransformersEngine(
        loaded,
        device=args.device,
        prefill_chunk_tokens=256,
        max_context=max(args.tokens) + 256,
        prefill_attention=args.prefill_attention,
        prefill_forward=args.prefill_forward,
    )
    build_s = time.perf_counter() - t0
    h2d, d2h = copy_rates(torch, device, 1 << 30)
    env = {
        "bench": "gpu_env",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "model": loaded.name,
        "dtype": args.dtype,
        "attn": str(engine.config._attn_implementation),
        "prefill_attention": engine.prefill_attention,
        "prefill_forward": engine.prefill_forward,
        "prefill_block_tokens": engine.block_tokens(),  # runs the block probe (bits vs the grid)
        "prefill_block_reason": engine.block_reason,
        "build_s": round(build_s, 2),
        "h2d_gbps_pinned": round(h2d, 2),
        "d2h_gbps_pinned": round(d2h, 2),
        "store_dir": args.store_dir,
    }
    try:
        env["store_fs"] = subprocess.run(["df", "-hT", args.store_dir], capture_output=True, text=True, timeout=10).stdout.splitlines()[-1]
    except Exception:  # noqa: BLE001 - informational only
        pass
    _emit(env, args.out)

    # warm-up: kernels for the shapes, the pinned pools, the store code paths
    from kvpack.store import PackStore

    warm = engine.new_session()
    warm.prefill(list(range(3, 3 + 512)))
    wstore = PackStore.init(os.path.join(args.store_dir, "warmup"))
    wstore.workers = args.workers
    wstore.save(warm)
    r = engine.new_session()
    wstore.restore(wstore.find_deepest(warm.tokens, engine.layout, engine.ids()), r, warm.tokens)
    del warm, r
    shutil.rmtree(wstore.path, ignore_errors=True)

    for n in args.tokens:
        want = bool(args.stripes) and n == args.handoff_tokens
        line, payload = bench_length(args, torch, engine, n, args.workers, h2d, d2h, keep_payload=want)
        _emit(line, args.out)
        if payload is not None:  # right away: a later, longer prompt may run out of time
            if args.handoff_layout == "procs":
                bench_handoff_processes(args, payload, args.out)
            else:
                bench_handoff(args, payload, args.out)
            del payload
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
