"""Benchmark: vLLM's time to first token with kvpack's connector versus no connector, vLLM's
own ExampleConnector and (where it runs) LMCache, on the same engine and core binding.

For each prompt length (default ~1,000 and ~1,900 tokens), SmolLM2 under vLLM (CPU, fp32,
block size 128, ``max_tokens=1``: the wall time of one request is its TTFT):

* ``none_cold``: no connector;
* ``<connector>_cold``: a prompt the connector has never seen (kvpack: a miss, then the rows
  are copied out and published; ExampleConnector: a miss, then one safetensors file per layer);
* ``<connector>_warm_in_process``: the same prompt again in the same engine, vLLM's own
  prefix cache reset first, so the reuse is the connector's (kvpack: after its save
  committed: every 256-token cut and the tail cut, so vLLM computes only the last token);
* ``<connector>_warm_fresh_process``: the same prompt in a new vLLM process on the same
  store (page cache warm, as after a restart).

Every engine runs alone, single-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``uni``
executor) and bound to the same core with one OpenMP thread (explicitly: on 2 cores vLLM's
automatic binding reserves a core for any connector and would leave none). Medians of
``--repeat`` distinct prompts per length. Each length prints ONE JSON line: the TTFTs, the
ratios against the peers measured in the same run, whether all variants produced the same
first token, and why LMCache was or was not measured.

    python3 benchmarks/bench_vllm.py [--lengths 1000,1900] [--repeat 3] [--core 0]
        [--lmcache-python /path/to/venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

BINDING = "VLLM_CPU_OMP_THREADS_BIND={core}, OMP_NUM_THREADS=1, OMP_PLACES={{{core}}} (explicit: on 2 cores a connector makes vLLM reserve one more core)"


def prompts_for(tokenizer, length: int, repeat: int) -> list[list[int]]:
    """``repeat`` prompts of ``length`` tokens, no two sharing even their first 256 tokens
    (across lengths too): every cold request is really cold for every connector."""
    out = []
    for r in range(repeat):
        body, i = "", 0
        while True:
            body += f"Record {length}.{r}.{i}: the cache of keys and values that attention computed is the state a server can keep instead of computing again. "
            i += 1
            ids = tokenizer(body)["input_ids"]
            if len(ids) >= length:
                out.append(list(ids[:length]))
                break
    return out


RESET_REFUSED: dict[str, int] = {}  # variant -> requests measured with vLLM's own prefix cache not emptied


def ttft(engine, prompt: list[int], variant: str = "") -> tuple[float, int]:
    (res,) = engine.generate([prompt], max_tokens=1)
    if res.get("prefix_cache_reset") is False:
        RESET_REFUSED[variant] = RESET_REFUSED.get(variant, 0) + 1
    return res["wall_s"], res["tokens"][0]


def wait_saved(store_dir: str, cuts: int, timeout_s: float = 600.0) -> None:
    """Until the store holds ``cuts`` committed cuts (kvpack saves asynchronously; the index
    entry is a save's commit point, and the connector's counters reach vLLM's metrics only
    with a later engine step, so the store itself is asked)."""
    from kvpack.store import PackStore

    deadline = time.monotonic() + timeout_s
    while len(PackStore.open(store_dir).index_entries()) < cuts:
        if time.monotonic() > deadline:
            raise TimeoutError("kvpack saves did not finish")
        time.sleep(0.5)


def run_connector(
    name: str,
    cfg_for,
    prompts: dict[int, list[list[int]]],
    logs: str,
    core: int,
    results: dict,
    firsts: dict,
    python: str | None = None,
    store_dir: str | None = None,
) -> None:
    from kvpack.integrations.vllm.prefix import save_cuts
    from kvpack.testing.vllm_harness import Engine

    eng = Engine(cfg_for(), os.path.join(logs, f"{name}-1.log"), core=core, python=python).start()
    try:
        # warm-up (the first forward costs), on a prompt sharing no prefix with the measured ones
        warm = prompts[min(prompts)][0][:300][::-1]
        eng.generate([warm], max_tokens=1)
        saved = len(save_cuts(len(warm), 0))  # 256-aligned cuts and the tail cut
        if store_dir is not None:
            wait_saved(store_dir, saved)
        for n, ps in prompts.items():
            for i, p in enumerate(ps):
                t, first = ttft(eng, p, name)
                results[n][f"{name}_cold"].append(t)
                firsts[n].add((i, first))
                if store_dir is not None:
                    saved += len(save_cuts(len(p), 0))  # no two prompts share a 256-token prefix
                    wait_saved(store_dir, saved)
                t, first = ttft(eng, p, name)
                results[n][f"{name}_warm_in_process"].append(t)
                firsts[n].add((i, first))
    finally:
        eng.stop()
    eng = Engine(cfg_for(), os.path.join(logs, f"{name}-2.log"), core=core, python=python).start()
    try:
        eng.generate([prompts[min(prompts)][0][:300][::-1][1:]], max_tokens=1)  # warm-up, a prompt never stored
        for n, ps in prompts.items():
            for i, p in enumerate(ps):
                t, first = ttft(eng, p, name)
                results[n][f"{name}_warm_fresh_process"].append(t)
                firsts[n].add((i, first))
        if name == "kvpack":
            m = eng.metrics()
            results["_kvpack_fresh_loads"] = m.get("kvpack_loads", 0)
            results["_kvpack_fresh_refusals"] = m.get("kvpack_refusals", 0)
    finally:
        eng.stop()


def run_lmcache(python: str, base: dict, prompts: dict, work: str, core: int, results: dict, firsts: dict) -> str:
    """LMCache's multi-process mode: an ``lmcache server`` (its memory is the cache, so it
    outlives the vLLM processes) and vLLM's LMCacheMPConnector. Returns the line's note."""
    import shutil
    import socket
    import subprocess

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    server_bin = os.path.join(os.path.dirname(python), "lmcache")
    other = 1 - core if (os.cpu_count() or 1) > 1 else core
    cmd = [server_bin, "server", "--host", "127.0.0.1", "--port", str(port), "--chunk-size", "256", "--l1-size-gb", "2"]
    cmd += ["--eviction-policy", "LRU", "--supported-transfer-mode", "lmcache_driven", "--disable-observability"]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(other), *cmd]
    log = open(os.path.join(work, "lmcache-server.log"), "ab")
    server = subprocess.Popen(cmd, stdout=log, stderr=log, env=dict(os.environ, LMCACHE_DISABLE_BANNER="1"))
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                return f"not measured: the lmcache server exited (rc {server.returncode}; log {work}/lmcache-server.log)"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    return "not measured: the lmcache server did not listen within 300 s"
                time.sleep(1)
        extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port, "lmcache.mp.mp_transfer_mode": "lmcache_driven"}
        for n in prompts:
            for key in ("lmcache_cold", "lmcache_warm_in_process", "lmcache_warm_fresh_process"):
                results[n][key] = []
        try:
            run_connector("lmcache", lambda: {**base, "connector": "lmcache_mp", "extra": extra}, prompts, work, core, results, firsts, python=python)
        except Exception as exc:  # noqa: BLE001 - the line says why instead of failing the run
            return f"not measured: {type(exc).__name__}: {str(exc)[:300]}"
        return (
            f"LMCache 0.5.6 multi-process (lmcache server on core {other}, LRU, LMCacheMPConnector, lmcache_driven, 256-token chunks, "
            "cache in server memory; vLLM started with llvmlite's ctypes wrapper hiding dunder attributes, see vllm_harness._lmcache_environment_fix)"
        )
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def summary_line(n: int, results: dict, firsts: dict, *, repeat: int, core: int, model: str, lmcache_note: str, load_start: float) -> dict:
    """The one JSON line of a prompt length: medians, ratios against the peers of this run."""
    med = {k: round(statistics.median(v), 4) for k, v in results[n].items() if v}

    def ratio(a: str, b: str) -> float | None:
        return round(med[a] / med[b], 4) if a in med and b in med else None

    return {
        "bench": "vllm",
        "prompt_tokens": n,
        "repeat": repeat,
        "model": os.path.basename(model.rstrip("/")),
        "engine": "vLLM 0.32.0 CPU, fp32, block 128, single-process (uni executor), max_tokens=1 (wall time = TTFT)",
        "binding": BINDING.format(core=core),
        "ttft_s": med,
        "ratios": {
            "kvpack_cold_over_none": ratio("kvpack_cold", "none_cold"),
            "kvpack_fresh_over_example_fresh": ratio("kvpack_warm_fresh_process", "example_warm_fresh_process"),
            "kvpack_warm_over_example_warm": ratio("kvpack_warm_in_process", "example_warm_in_process"),
            "kvpack_fresh_over_none_cold": ratio("kvpack_warm_fresh_process", "none_cold"),
            "kvpack_fresh_over_lmcache_fresh": ratio("kvpack_warm_fresh_process", "lmcache_warm_fresh_process"),
        },
        "goal": {"cold_overhead_at_most": 1.10, "fresh_vs_example_at_most": 1.0, "fresh_vs_lmcache_below": 1.0},
        "first_tokens_equal": len(firsts[n]) == len({i for i, _ in firsts[n]}),  # one first token per prompt
        "kvpack_fresh_process_loads": results.get("_kvpack_fresh_loads"),
        "kvpack_refusals": results.get("_kvpack_fresh_refusals"),
        "verified": "kvpack: every stored byte of a load (pack HMAC, chunk SHA-256, keyed content ids) and the exact identity; ExampleConnector: nothing",
        "lmcache": lmcache_note,
        "prefix_cache_reset_refused": dict(RESET_REFUSED),  # requests where vLLM's own cache could not be emptied (30 s)
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "load_avg_1m_start": load_start, "load_avg_1m": round(os.getloadavg()[0], 2)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1000,1900")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--model", help="checkpoint directory (default: the SmolLM2 conversion cache)")
    ap.add_argument("--workdir", help="stores and logs (default: a temporary directory)")
    ap.add_argument("--skip-example", action="store_true")
    ap.add_argument(
        "--lmcache-python",
        help="a Python with vLLM and LMCache 0.5.6 (its own environment: LMCache's requirements change numpy); "
        "LMCache then runs as 'lmcache server' + LMCacheMPConnector (lmcache_driven), the server bound to the other core",
    )
    args = ap.parse_args()
    load_start = round(os.getloadavg()[0], 2)

    from transformers import AutoTokenizer

    from kvpack.testing.vllm_harness import Engine, vllm_python

    if vllm_python() is None:
        print(json.dumps({"bench": "vllm", "skipped": "vLLM is not installed (scripts/install.sh; or KVPACK_VLLM_PYTHON)"}))
        return
    model = args.model
    if model is None:
        from kvpack.engine.models import load_smollm2

        model = load_smollm2().source["cache_dir"]
    work = args.workdir or tempfile.mkdtemp(prefix="kvpack-bench-vllm-")
    os.makedirs(work, exist_ok=True)  # a --workdir that does not exist yet
    tok = AutoTokenizer.from_pretrained(model)
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = {n: prompts_for(tok, n, args.repeat) for n in lengths}
    base = {"model": model, "dtype": "float32", "max_model_len": 4096, "kv_cache_bytes": 512 << 20, "block_size": 128}
    results: dict = {n: {} for n in lengths}
    for n in lengths:
        for key in (
            "none_cold",
            "kvpack_cold",
            "kvpack_warm_in_process",
            "kvpack_warm_fresh_process",
            "example_cold",
            "example_warm_in_process",
            "example_warm_fresh_process",
        ):
            results[n][key] = []
    firsts: dict = {n: set() for n in lengths}

    eng = Engine({**base, "connector": None}, os.path.join(work, "none.log"), core=args.core).start()
    try:
        eng.generate([prompts[lengths[0]][0][:300]], max_tokens=1)
        for n, ps in prompts.items():
            for i, p in enumerate(ps):
                t, first = ttft(eng, p, "none")
                results[n]["none_cold"].append(t)
                firsts[n].add((i, first))
    finally:
        eng.stop()

    store = os.path.join(work, "kvpack-store")
    run_connector(
        "kvpack", lambda: {**base, "connector": "kvpack", "extra": {"kvpack.store": store}}, prompts, work, args.core, results, firsts, store_dir=store
    )
    if not args.skip_example:
        shared = os.path.join(work, "example-store")
        os.makedirs(shared, exist_ok=True)
        run_connector("example", lambda: {**base, "connector": "example", "extra": {"shared_storage_path": shared}}, prompts, work, args.core, results, firsts)

    lmcache_note = "not measured: run with --lmcache-python (a separate environment with vLLM and lmcache==0.5.6)"
    if args.lmcache_python:
        lmcache_note = run_lmcache(args.lmcache_python, base, prompts, work, args.core, results, firsts)

    for n in lengths:
        line = summary_line(n, results, firsts, repeat=args.repeat, core=args.core, model=model, lmcache_note=lmcache_note, load_start=load_start)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
