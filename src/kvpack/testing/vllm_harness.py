"""One vLLM engine in a subprocess, driven by JSON lines (tests and benchmarks/bench_vllm.py).

vLLM takes about a minute to start on 2 cores and allocates its processes and memory for the
life of the engine, so tests run each engine configuration in its own process and talk to
it: ``python -m kvpack.testing.vllm_harness CONFIG_JSON`` prints ``READY`` once the engine
is up, then answers one JSON line per command read from stdin. Every answer line starts
with ``KVPACK-HARNESS `` (vLLM logs to the same streams).

Commands: ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": 32,
"reset_prefix_cache": true, "kv_transfer_params": {...} | null}`` -> token ids, text, TTFT and
the request's ``kv_transfer_params``; ``{"op": "metrics"}`` -> the ``vllm:kvpack_*``
counters; ``{"op": "quit"}``.

CONFIG: ``model``, ``dtype``, ``block_size``, ``max_model_len``, ``kv_cache_bytes``,
``connector`` (``null``, ``"kvpack"`` or ``"example"``), ``kv_role``, ``extra`` (the
connector's extra config), ``load_failure_policy``, ``single_process`` (default true:
scheduler and worker in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni``
executor; each extra vLLM process re-imports torch and vLLM, minutes on a loaded 2-core
machine; false runs vLLM's default engine-core and worker processes).

:class:`Engine` starts the subprocess bound to one core (``core``): vLLM's own variable
``VLLM_CPU_OMP_THREADS_BIND`` plus the OpenMP variables for the single-process mode, where
vLLM spawns no worker to apply them to.

This is a driver for tests; it never decides anything a test asserts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

TAG = "KVPACK-HARNESS "


def _kv_config(cfg: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    connector = cfg.get("connector")
    if connector is None:
        return None
    if connector == "kvpack":
        return KVTransferConfig(
            kv_connector="KvpackConnector",
            kv_connector_module_path="kvpack.integrations.vllm",
            kv_role=cfg.get("kv_role", "kv_both"),
            kv_load_failure_policy=cfg.get("load_failure_policy", "recompute"),
            kv_connector_extra_config=cfg.get("extra", {}),
        )
    if connector == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both", kv_connector_extra_config=cfg.get("extra", {}))
    if connector == "lmcache_mp":
        return KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both", kv_connector_extra_config=cfg.get("extra", {}))
    raise ValueError(f"unknown connector {connector!r}")


def _lmcache_environment_fix() -> None:
    """Let vLLM start beside LMCache's dependencies (the peer measured by bench_vllm.py).

    LMCache imports numba, hence llvmlite, whose ctypes library wrapper
    (``llvmlite.binding.ffi._lib_wrapper``) answers *every* attribute, ``__dict__``
    included, with a function wrapper; vLLM 0.32's CPU kernel-override scan
    (``vllm/triton_utils/dispatcher.py``, at worker start) calls ``vars(value).get(...)`` on
    every module attribute that has a ``__dict__`` and dies on it. Here dunder lookups on
    that wrapper raise ``AttributeError``, as on any object without them; nothing else of
    llvmlite or vLLM changes. Without llvmlite this does nothing."""
    try:
        from llvmlite.binding import ffi  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return
    cls = getattr(ffi, "_lib_wrapper", None)
    if cls is None or getattr(cls, "_kvpack_dunder_fix", False):
        return
    answer_all = cls.__getattr__

    def no_dunders(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return answer_all(self, name)

    cls.__getattr__ = no_dunders
    cls._kvpack_dunder_fix = True


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _reset_prefix_cache(llm: Any, timeout_s: float = 2.0) -> bool:
    """Empty vLLM's own prefix cache; False if it still refused after ``timeout_s``.

    vLLM refuses while blocks of finished requests are not freed yet, which a connector
    that holds them after a request makes happen; the next request may then reuse vLLM's
    own cache, and the measurement would not be the connector's. So this asks again for a
    moment, and the answer says whether it worked (bench_vllm counts refusals per variant:
    LMCache 0.5.6's multi-process connector kept 3-8 blocks unfreed for good in our runs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = llm.reset_prefix_cache()
        if done is not False or time.monotonic() > deadline:
            return done is not False
        time.sleep(0.05)


def _generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    results = []
    for ids in cmd["prompts"]:
        reset = None
        if cmd.get("reset_prefix_cache", True):
            reset = _reset_prefix_cache(llm)  # reuse must come from the connector, not vLLM's memory
        extra = {"kv_transfer_params": cmd["kv_transfer_params"]} if cmd.get("kv_transfer_params") else None
        sp = SamplingParams(temperature=0, max_tokens=int(cmd.get("max_tokens", 32)), ignore_eos=True, extra_args=extra)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": list(ids)}], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        metrics = getattr(out, "metrics", None)
        ttft = None
        if metrics is not None and getattr(metrics, "first_token_latency", None):
            ttft = float(metrics.first_token_latency)
        results.append(
            {
                "tokens": list(out.outputs[0].token_ids),
                "text": out.outputs[0].text,
                "wall_s": wall,
                "ttft_s": ttft,
                "kv_transfer_params": out.kv_transfer_params,
                "prefix_cache_reset": reset,
            }
        )
    return {"ok": True, "results": results}


def _metrics(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if "kvpack" not in m.name:
            continue
        value = getattr(m, "value", None)
        name = m.name.split(":", 1)[-1]
        if name == "kvpack_refusals_by_reason":
            name = f"{name}.{m.labels.get('reason')}"
        out[name] = out.get(name, 0) + (value or 0)
    return {"ok": True, "metrics": out}


# -- the driver side (no vLLM import) ---------------------------------------------------------


def vllm_python() -> str | None:
    """The Python that has vLLM: ``$KVPACK_VLLM_PYTHON`` or this one; None when neither."""
    import importlib.util

    env = os.environ.get("KVPACK_VLLM_PYTHON")
    if env:
        return env
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


class Engine:
    """A harness subprocess: ``Engine(cfg, log_path).start()``, then ``call(cmd)``."""

    def __init__(self, cfg: dict[str, Any], log_path: str, *, core: int = 0, env: dict[str, str] | None = None, python: str | None = None) -> None:
        self.cfg = cfg
        self.log_path = log_path
        self.env = {"VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1", "OMP_PLACES": "{%d}" % core, "OMP_PROC_BIND": "true", **(env or {})}
        self.python = python or vllm_python()
        self.proc: Any = None
        self._lines: Any = None
        self.ready: dict[str, Any] = {}

    def start(self) -> "Engine":
        import queue
        import subprocess
        import threading

        if self.python is None:
            raise RuntimeError("no Python with vLLM (set KVPACK_VLLM_PYTHON)")
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(self.env)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.python, "-m", "kvpack.testing.vllm_harness", json.dumps(self.cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        self._lines = queue.Queue()

        def pump() -> None:
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", "replace")
                if line.startswith(TAG):
                    self._lines.put(json.loads(line[len(TAG) :]))
                else:
                    self._log.write(raw)
            self._lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        return self

    def wait_ready(self, timeout_s: float = 1800.0) -> dict[str, Any]:
        self.ready = self._next(timeout_s)
        return self.ready

    def _next(self, timeout_s: float) -> dict[str, Any]:
        import queue

        try:
            got = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"vLLM harness gave no answer within {timeout_s:.0f} s (log: {self.log_path})") from None
        if got is None:
            raise RuntimeError(f"vLLM harness exited (rc={self.proc.poll()}; log: {self.log_path}):\n{self.log_tail()}")
        return got

    def log_tail(self, nbytes: int = 6000) -> str:
        """The end of the engine's log (pytest removes old temporary directories, so a
        failure message carries what killed the engine)."""
        try:
            self._log.flush()
            with open(self.log_path, "rb") as fh:
                fh.seek(max(0, os.path.getsize(self.log_path) - nbytes))
                return fh.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def call(self, cmd: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
        if not self.ready:
            self.wait_ready()
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        out = self._next(timeout_s)
        if not out.get("ok"):
            raise RuntimeError(f"vLLM harness refused {cmd.get('op')}: {out.get('error')} (log: {self.log_path})")
        return out

    def generate(self, prompts: list[list[int]], **kw: Any) -> list[dict[str, Any]]:
        return self.call({"op": "generate", "prompts": prompts, **kw})["results"]

    def metrics(self) -> dict[str, Any]:
        return self.call({"op": "metrics"})["metrics"]

    def request_stop(self) -> None:
        """Ask the engine to quit without waiting (:func:`stop_all` shuts several down at once)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write(b'{"op": "quit"}\n')
            self.proc.stdin.flush()
        except OSError:
            pass  # it is exiting already; stop() waits or kills

    def stop(self, timeout_s: float = 120.0) -> None:
        if self.proc is None:
            return
        self.request_stop()
        try:
            self.proc.wait(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - fall through to the kill below
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


def stop_all(*engines: "Engine | None", timeout_s: float = 120.0) -> None:
    """Shut engines down side by side: every one is asked to quit first, then each is waited
    for (vLLM's shutdown takes seconds per engine; one after the other they add up)."""
    live = [e for e in engines if e is not None]
    for e in live:
        e.request_stop()
    for e in live:
        e.stop(timeout_s)


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[0])
    if cfg.get("single_process", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cfg.get("connector") == "lmcache_mp":
        _lmcache_environment_fix()
    from vllm import LLM

    t0 = time.perf_counter()
    kw: dict[str, Any] = {}
    if cfg.get("block_size"):
        kw["block_size"] = int(cfg["block_size"])
    if cfg.get("single_process", True):
        kw["distributed_executor_backend"] = "uni"
    llm = LLM(
        model=cfg["model"],
        dtype=cfg.get("dtype", "float32"),
        max_model_len=int(cfg.get("max_model_len", 4096)),
        enforce_eager=True,
        kv_cache_memory_bytes=int(cfg.get("kv_cache_bytes", 256 << 20)),
        kv_transfer_config=_kv_config(cfg),
        disable_log_stats=False,
        **kw,
    )
    _say({"ready": True, "load_s": time.perf_counter() - t0, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "generate":
                _say(_generate(llm, cmd))
            elif cmd["op"] == "metrics":
                _say(_metrics(llm))
            else:
                _say({"ok": False, "error": f"unknown op {cmd['op']!r}"})
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which fails its test
            _say({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
