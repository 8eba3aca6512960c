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
  store (page cache warm, as after a restart). The connectors' second processes run side
  by side and are measured prompt by prompt in turn, the order rotating (idle engines wait
  on stdin): on a shared machine the load moves over minutes, and one connector after the
  other gave the last one the quietest machine;
* the first processes of no connector, kvpack and ExampleConnector (cold, then warm in
  process) also run side by side, prompt by prompt in rotating order, so the cold overhead
  ratio compares engines measured in the same minutes; LMCache's first process runs after
  them (it needs its server);
* ``none_own_prefix_cache``: no connector, the same prompt again without resetting vLLM's
  own prefix cache: vLLM's floor for a prompt whose whole blocks are cached (it computes the
  tokens past the last full block; LMCache, which stores whole 256-token chunks, computes
  at least these).

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
    """The first process of a connector: each prompt cold, then again in the same process."""
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


def in_turns(prompts: dict[int, list[list[int]]], names: list[str]):
    """(length, index, prompt, engine name) for every prompt and engine, the engines' order
    rotating by one per prompt, so none of them is always measured first or last."""
    turn = 0
    for n, ps in prompts.items():
        for i, p in enumerate(ps):
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                yield n, i, p, name
            turn += 1


def run_first_interleaved(variants: list[tuple[str, dict, str | None]], prompts: dict, logs: str, core: int, results: dict, firsts: dict) -> None:
    """The first process of no connector, kvpack and ExampleConnector, side by side: prompt by
    prompt in turn, the order rotating, each engine measures the prompt cold and then again
    (``none``: with vLLM's own prefix cache kept, its floor; a connector: its cache reset, so
    the reuse is the connector's; kvpack only after its asynchronous save committed). The cold
    overhead goal compares kvpack's cold with no connector's, so both are measured in the same
    minutes: measured one engine after the other, load moving over minutes made that ratio
    swing from 0.9 to 1.65 between runs of the same code."""
    from kvpack.integrations.vllm.prefix import save_cuts
    from kvpack.testing.vllm_harness import Engine, stop_all

    engines = {name: Engine(cfg, os.path.join(logs, f"{name}-1.log"), core=core, python=python).start() for name, cfg, python in variants}
    stores = {name: cfg.get("extra", {}).get("kvpack.store") for name, cfg, _ in variants}
    saved = dict.fromkeys(engines, 0)
    try:
        # warm-up (the first forward costs), on a prompt sharing no prefix with the measured ones
        warm = prompts[min(prompts)][0][:300][::-1]
        for name, eng in engines.items():
            eng.generate([warm], max_tokens=1)
            if stores[name] is not None:
                saved[name] = len(save_cuts(len(warm), 0))  # 256-aligned cuts and the tail cut
                wait_saved(stores[name], saved[name])
        for n, i, p, name in in_turns(prompts, list(engines)):
            t, first = ttft(engines[name], p, name)
            results[n][f"{name}_cold"].append(t)
            firsts[n].add((i, first))
            if name == "none":
                (res,) = engines[name].generate([p], max_tokens=1, reset_prefix_cache=False)  # vLLM's own cache holds p's blocks
                results[n]["none_own_prefix_cache"].append(res["wall_s"])
                firsts[n].add((i, res["tokens"][0]))
                continue
            if stores[name] is not None:
                saved[name] += len(save_cuts(len(p), 0))  # no two prompts share a 256-token prefix
                wait_saved(stores[name], saved[name])
            t, first = ttft(engines[name], p, name)
            results[n][f"{name}_warm_in_process"].append(t)
            firsts[n].add((i, first))
    finally:
        stop_all(*engines.values())


def run_fresh_interleaved(variants: list[tuple[str, dict, str | None]], prompts: dict, logs: str, core: int, results: dict, firsts: dict) -> None:
    """Every connector's second process (same store), all started side by side and then
    measured prompt by prompt in turn, the order rotating per prompt: the machine's load
    (other jobs on a shared box) changes over minutes, and measuring one connector after the
    other gave whichever ran last the quieter machine. Idle engines wait on stdin; only the
    one being measured computes."""
    from kvpack.testing.vllm_harness import Engine, stop_all

    engines = {name: Engine(cfg, os.path.join(logs, f"{name}-2.log"), core=core, python=python).start() for name, cfg, python in variants}
    try:
        for eng in engines.values():
            eng.generate([prompts[min(prompts)][0][:300][::-1][1:]], max_tokens=1)  # warm-up, a prompt never stored
        for n, i, p, name in in_turns(prompts, list(engines)):
            t, first = ttft(engines[name], p, name)
            results[n][f"{name}_warm_fresh_process"].append(t)
            firsts[n].add((i, first))
        if "kvpack" in engines:
            m = engines["kvpack"].metrics()
            results["_kvpack_fresh_loads"] = m.get("kvpack_loads", 0)
            results["_kvpack_fresh_refusals"] = m.get("kvpack_refusals", 0)
    finally:
        stop_all(*engines.values())


class LMCacheServer:
    """LMCache's multi-process mode: an ``lmcache server`` (its memory is the cache, so it
    outlives the vLLM processes; bound to the other core) for vLLM's LMCacheMPConnector."""

    def __init__(self, python: str, work: str, core: int) -> None:
        import socket

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            self.port = sk.getsockname()[1]
        self.python, self.work = python, work
        self.other = 1 - core if (os.cpu_count() or 1) > 1 else core
        self.proc = None
        self.log = None

    def start(self) -> str | None:
        """None once it listens, else why not."""
        import shutil
        import socket
        import subprocess

        server_bin = os.path.join(os.path.dirname(self.python), "lmcache")
        cmd = [server_bin, "server", "--host", "127.0.0.1", "--port", str(self.port), "--chunk-size", "256", "--l1-size-gb", "2"]
        cmd += ["--eviction-policy", "LRU", "--supported-transfer-mode", "lmcache_driven", "--disable-observability"]
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", str(self.other), *cmd]
        self.log = open(os.path.join(self.work, "lmcache-server.log"), "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log, env=dict(os.environ, LMCACHE_DISABLE_BANNER="1"))
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                return f"not measured: the lmcache server exited (rc {self.proc.returncode}; log {self.work}/lmcache-server.log)"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return None
            except OSError:
                if time.monotonic() > deadline:
                    return "not measured: the lmcache server did not listen within 300 s"
                time.sleep(1)

    def config(self, base: dict) -> dict:
        extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port, "lmcache.mp.mp_transfer_mode": "lmcache_driven"}
        return {**base, "connector": "lmcache_mp", "extra": extra}

    def note(self) -> str:
        return (
            f"LMCache 0.5.6 multi-process (lmcache server on core {self.other}, LRU, LMCacheMPConnector, lmcache_driven, 256-token chunks, "
            "cache in server memory; vLLM started with llvmlite's ctypes wrapper hiding dunder attributes, see vllm_harness._lmcache_environment_fix)"
        )

    def stop(self) -> None:
        import subprocess

        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.log is not None:
            self.log.close()


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
        "first_process_order": "none, kvpack and ExampleConnector side by side, cold then again, prompt by prompt in rotating order (LMCache after them: its server)",
        "fresh_process_order": "connectors' second processes side by side, measured prompt by prompt in rotating order",
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

    from kvpack.testing.vllm_harness import vllm_python

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
            "none_own_prefix_cache",
            "kvpack_cold",
            "kvpack_warm_in_process",
            "kvpack_warm_fresh_process",
            "example_cold",
            "example_warm_in_process",
            "example_warm_fresh_process",
        ):
            results[n][key] = []
    firsts: dict = {n: set() for n in lengths}

    store = os.path.join(work, "kvpack-store")
    kvpack_cfg = {**base, "connector": "kvpack", "extra": {"kvpack.store": store}}
    first: list[tuple[str, dict, str | None]] = [("none", {**base, "connector": None}, None), ("kvpack", kvpack_cfg, None)]
    fresh: list[tuple[str, dict, str | None]] = [("kvpack", kvpack_cfg, None)]
    if not args.skip_example:
        shared = os.path.join(work, "example-store")
        os.makedirs(shared, exist_ok=True)
        example_cfg = {**base, "connector": "example", "extra": {"shared_storage_path": shared}}
        first.append(("example", example_cfg, None))
        fresh.append(("example", example_cfg, None))
    run_first_interleaved(first, prompts, work, args.core, results, firsts)

    lmcache_note = "not measured: run with --lmcache-python (a separate environment with vLLM and lmcache==0.5.6)"
    server = LMCacheServer(args.lmcache_python, work, args.core) if args.lmcache_python else None
    try:
        if server is not None:
            failed = server.start()
            if failed is None:
                for n in prompts:
                    for key in ("lmcache_cold", "lmcache_warm_in_process", "lmcache_warm_fresh_process"):
                        results[n][key] = []
                try:
                    run_connector("lmcache", lambda: server.config(base), prompts, work, args.core, results, firsts, python=args.lmcache_python)
                    fresh.append(("lmcache", server.config(base), args.lmcache_python))
                    lmcache_note = server.note()
                except Exception as exc:  # noqa: BLE001 - the line says why instead of failing the run
                    lmcache_note = f"not measured: {type(exc).__name__}: {str(exc)[:300]}"
            else:
                lmcache_note = failed
        run_fresh_interleaved(fresh, prompts, work, args.core, results, firsts)
    finally:
        if server is not None:
            server.stop()

    for n in lengths:
        line = summary_line(n, results, firsts, repeat=args.repeat, core=args.core, model=model, lmcache_note=lmcache_note, load_start=load_start)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
