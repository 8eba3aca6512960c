"""The Hugging Face transformers adapter: DynamicCache <-> kvpack states, bit-exactly.

Mapping (transformers 5.19): ``DynamicCache.layers[i]`` is a ``DynamicLayer`` (full span) or
a ``DynamicSlidingWindowLayer`` (windowed). Each holds ``keys``/``values`` of shape
``[batch=1, kv_heads, rows, head_dim]``. A full layer at position ``P`` holds rows
``[0, P)``. A sliding layer with window ``W`` holds the last ``W - 1`` rows
``[max(0, P - W + 1), P)`` (a query at ``p`` attends to ``[p - W + 1, p]``, so ``W - 1`` past
rows suffice) and counts absolute positions in ``cumulative_length``, which drives the
attention mask and must therefore be restored as ``P``, not as the number of rows.

The state plane of ``(layer, role)`` is token-major: ``keys[0].transpose(0, 1)`` gives
``[rows, kv_heads, head_dim]``, exported as contiguous little-endian bytes.

Determinism (what "same computation order" means here, see docs/engine.md):

* Prefill runs in chunks whose boundaries are *absolute* multiples of
  ``prefill_chunk_tokens`` (which must divide 256). A session restored at a 256-aligned
  cut and prefilling the suffix therefore runs exactly the forwards an uninterrupted
  prefill runs for those tokens.
* Every forward computes logits for its last token only (``logits_to_keep=1``); decode
  is one token per forward, greedy ``argmax`` of the float32 last-logits row.
* The thread count is fixed when the engine is built (``threads=``) and is part of the
  engine ABI, so a cache computed with a different count is a different identity.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import EngineError
from .contract import cache_digest as contract_cache_digest
from .contract import state_digest as contract_state_digest
from .contract import (
    LAYER_FULL,
    LAYER_WINDOWED,
    CacheLayout,
    EngineIdentity,
    IdentityIds,
    InstallContext,
    LayerSpec,
)
from ..vocab import TOKEN_ALIGN
from .lazy_torch import load_torch as _torch
from .models import LoadedModel, canonical_config, config_floats

ADAPTER_NAME = "kvpack.engine.transformers_adapter"
ADAPTER_VERSION = 1
REUSE_BLOCK_TOKENS = TOKEN_ALIGN  # reusable cuts are multiples of kvpack's one token alignment

#: Environment override of ``prefill_forward="auto"``: ``lean``, ``graphs`` or ``model``.
PREFILL_FORWARD_ENV = "KVPACK_PREFILL_FORWARD"

#: Environment override of ``prefill_block_chunks=None``: grid chunks per block prefill call.
PREFILL_BLOCK_ENV = "KVPACK_PREFILL_BLOCK_CHUNKS"

#: Grid chunks a block prefill takes at once on CUDA by default (1,024 rows of 256: the
#: projections' rate at 1,024 rows is ~0.43 of their cost at 256, docs/engine.md).
DEFAULT_CUDA_BLOCK_CHUNKS = 4

_TORCH_TO_WIRE = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}

# Which layers run without positions (NoPE), per model family. Unknown families are refused
# rather than guessed: a wrong position class would make a windowed restore look valid.
_NOPE_RULES: dict[str, Callable[[str], bool]] = {
    "llama": lambda layer_type: False,
    # Cohere2 applies rotary embeddings only in layers with a sliding window.
    "cohere2": lambda layer_type: layer_type == "full_attention",
}


def _wire_dtype(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _TORCH_TO_WIRE:
        raise EngineError("unsupported", f"cache dtype {name} has no production-v1 wire value")
    return _TORCH_TO_WIRE[name]


#: longest a forward waits for engines of other process-wide settings to finish theirs
SETTINGS_WAIT_S = 600.0


class _ProcessSettings:
    """Forwards of engines whose process-wide settings differ never overlap.

    An engine's identity records torch's thread count and, on CUDA, the GEMM library; a
    forward must compute under both. The GEMM library is global to the process
    (``torch.backends.cuda.preferred_blas_library``; the thread count is per thread under
    OpenMP builds, global under others). Each engine puts them back before a forward, but
    with two engines of different settings forwarding in two threads, one could change
    them under the other mid-forward (rows computed by another GEMM library: bits its
    identity does not promise). So a forward holds the settings it needs: engines of the
    same settings run concurrently, an engine of other settings waits until they are done
    (at most ``SETTINGS_WAIT_S``; while it waits, new forwards of the held settings wait
    behind it, so a steady stream of them cannot starve it), and a thread that already
    holds other settings is refused rather than deadlocked."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._key: tuple | None = None
        self._active = 0
        self._waiters: dict[int, tuple] = {}  # ticket (arrival order) -> settings, of waiting forwards
        self._tickets = itertools.count()
        self._mine = threading.local()

    def _must_wait(self, key: tuple, ticket: int) -> bool:
        if self._active and self._key != key:
            return True
        # behind every forward of other settings that asked first: the first in line always
        # goes once the forwards in progress are done, so no one waits forever
        return any(other != key and earlier < ticket for earlier, other in self._waiters.items())

    def hold(self, key: tuple, apply: Callable[[], None]) -> "_Held":
        return _Held(self, key, apply)

    def _enter(self, key: tuple, apply: Callable[[], None]) -> None:
        held = getattr(self._mine, "stack", None)
        if held is None:
            held = self._mine.stack = []
        if held and held[-1] != key:
            raise EngineError(
                "unsupported", f"a forward under process settings {key} inside one under {held[-1]} in the same thread (threads, CUDA GEMM library)"
            )
        deadline = time.monotonic() + SETTINGS_WAIT_S
        with self._cond:
            if not held:  # a nested forward already holds these settings: it never waits
                ticket = next(self._tickets)
                self._waiters[ticket] = key
                try:
                    while self._must_wait(key, ticket):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise EngineError("unsupported", f"engines of other process settings than {key} held the process for {SETTINGS_WAIT_S:g} s")
                        self._cond.wait(left)
                finally:
                    del self._waiters[ticket]
                    self._cond.notify_all()  # the next in line may go now that this one left the line
            apply()
            self._key = key
            self._active += 1
        held.append(key)

    def _exit(self) -> None:
        self._mine.stack.pop()
        with self._cond:
            self._active -= 1
            if not self._active:
                self._key = None
                self._cond.notify_all()


class _Held:
    def __init__(self, settings: _ProcessSettings, key: tuple, apply: Callable[[], None]) -> None:
        self._settings, self._key, self._apply = settings, key, apply

    def __enter__(self) -> None:
        self._settings._enter(self._key, self._apply)

    def __exit__(self, *exc: object) -> None:
        self._settings._exit()


PROCESS_SETTINGS = _ProcessSettings()


class TransformersEngine:
    """A loaded model plus its layout, identity and determinism settings.

    ``threads``: if given, ``torch.set_num_threads(threads)`` (process-wide) before anything
    runs; the count in effect is recorded in the engine ABI either way.
    ``device``: ``"cpu"`` (default) or ``"cuda"``; CUDA is refused cleanly when absent.
    ``prefill_attention``: ``"lower_right"`` runs prefill chunks with preallocated cache rows
    and lower-right causal attention (kvpack.engine.fast_prefill: the flash kernel on CUDA,
    no cache concatenation); ``"sdpa"`` keeps transformers' own path; ``"auto"`` (default)
    is ``lower_right`` on CUDA for models it supports. Recorded in the engine ABI.
    ``prefill_forward``: ``"lean"`` runs each prefill chunk through
    kvpack.engine.lean_prefill (transformers' Llama ops without its per-call plumbing, the
    same bits; needs ``prefill_attention`` ``lower_right``); ``"graphs"`` also replays full
    chunks as CUDA graphs between the attention calls (kvpack.engine.graph_prefill; on a CPU
    the same segments run eagerly); ``"model"`` calls the model's forward; ``"auto"``
    (default) is ``$KVPACK_PREFILL_FORWARD`` when set, else, where the lean forward is
    supported, ``graphs`` on CUDA (``lean`` if the rotary frequencies change per forward) and
    ``lean`` elsewhere. Recorded in the engine ABI.
    ``prefill_block_chunks``: with the lean or graphs forward, a prompt's full chunks are
    forwarded this many at a time: the row-wise work (norms, projections, MLP) over all their
    rows in one call each, every chunk's attention exactly as the grid makes it. Before the
    first use the engine prefills a probe prompt both ways and compares every plane and
    logits row bit for bit; if anything differs it keeps one chunk at a time
    (``block_reason`` says why). So the cut bits, and the identity, are the grid's. ``None``
    (default): ``$KVPACK_PREFILL_BLOCK_CHUNKS`` when set, else 4 on CUDA and 1 elsewhere.
    ``cuda_blas``: the GEMM library of every forward on CUDA, process-wide
    (``torch.backends.cuda.preferred_blas_library``), put back before each forward and
    recorded in the engine ABI: ``"auto"`` (default) is ``cublaslt``, whose kernels compute a
    row alike at any row count on the H200 (blocks need that); ``cublas`` is torch's default.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        prefill_chunk_tokens: int = 256,
        threads: int | None = None,
        device: str = "cpu",
        max_context: int | None = None,
        adapter: dict[str, Any] | None = None,
        prefill_attention: str = "auto",
        prefill_forward: str = "auto",
        prefill_block_chunks: int | None = None,
        cuda_blas: str = "auto",
    ) -> None:
        torch = _torch()
        if sys.byteorder != "little":
            # Export is a raw memory view; a big-endian host would need a byte swap per element.
            raise EngineError("unsupported", "big-endian hosts are not supported")
        if prefill_chunk_tokens <= 0 or REUSE_BLOCK_TOKENS % prefill_chunk_tokens != 0:
            raise EngineError(
                "unsupported",
                f"prefill_chunk_tokens={prefill_chunk_tokens} must divide {REUSE_BLOCK_TOKENS}, so every reusable cut is a chunk boundary",
            )
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineError("unsupported", "CUDA requested but not available")
        if threads is not None:
            torch.set_num_threads(int(threads))
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = torch.device(device)
        self.model.to(self.device)
        self.model.eval()
        self.cuda_blas = self._choose_cuda_blas(cuda_blas)
        self.config = self.model.config
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefill_attention = self._choose_prefill_attention(prefill_attention)
        self.prefill_forward = self._choose_prefill_forward(prefill_forward)
        self._segmented_lock = threading.Lock()
        self.block_chunks = self._choose_block_chunks(prefill_block_chunks)
        self.block_reason: str | None = None  # why blocks were turned off, after the probe
        self._block_checked = self.block_chunks <= 1
        self._block_lock = threading.Lock()
        self.threads = torch.get_num_threads()
        self.assert_process_settings()
        self.max_context = int(max_context or getattr(self.config, "max_position_embeddings", 0) or 0)
        if self.max_context <= 0:
            raise EngineError("model", "model config has no max_position_embeddings; pass max_context")
        self.layout = self._derive_layout()
        self.identity = self._derive_identity(adapter or {"name": "none"})
        self._ids = self.identity.ids()

    def _choose_prefill_attention(self, wanted: str) -> str:
        from . import fast_prefill

        if wanted not in ("auto", "lower_right", "sdpa"):
            raise EngineError("unsupported", f"prefill_attention {wanted!r}: auto, lower_right or sdpa")
        reason = fast_prefill.unsupported_reason(self.model)
        if wanted == "auto":
            wanted = "lower_right" if self.device.type == "cuda" and reason is None else "sdpa"
        if wanted == "lower_right":
            if reason is not None:
                raise EngineError("unsupported", f"prefill_attention lower_right: {reason}")
            fast_prefill.register()
            self.config._attn_implementation = fast_prefill.ATTENTION
        return wanted

    def _choose_prefill_forward(self, wanted: str) -> str:
        from . import lean_prefill

        if wanted == "auto":
            # The environment lets one run A/B both paths without code changes (bench_gpu,
            # diag_prefill_chunks on the H200).
            wanted = os.environ.get(PREFILL_FORWARD_ENV, "") or "auto"
        if wanted not in ("auto", "lean", "graphs", "model"):
            raise EngineError("unsupported", f"prefill_forward {wanted!r}: auto, lean, graphs or model")
        from .graph_prefill import unsupported_reason as graph_reason

        reason = lean_prefill.unsupported_reason(self.model, self.prefill_attention)
        if wanted == "auto":
            if reason is not None:
                return "model"
            # On CUDA the graphs replay the lean forward's own kernels (bit-identical: the
            # GPU suite checks every plane) with ~4 launches per layer instead of ~40; on a
            # CPU there is nothing to capture, so the lean forward runs as it is.
            return "graphs" if self.device.type == "cuda" and graph_reason(self.model) is None else "lean"
        if wanted == "graphs" and reason is None:
            reason = graph_reason(self.model)
        if wanted != "model" and reason is not None:
            raise EngineError("unsupported", f"prefill_forward {wanted}: {reason}")
        return wanted

    def _choose_cuda_blas(self, wanted: str) -> str | None:
        """The GEMM library every forward of a CUDA engine runs on (``None`` off CUDA)."""
        if wanted not in ("auto", "cublaslt", "cublas"):
            raise EngineError("unsupported", f"cuda_blas {wanted!r}: auto, cublaslt or cublas")
        if self.device.type != "cuda":
            return None
        # cuBLASLt computes a row of a projection the same way at 256 and at 1,024+ rows on
        # the H200 for every shape of the 8B model; cuBLAS does not for k/v (f16) and down
        # (benchmarks/diag_block_rows.py). Block prefill needs the former.
        return "cublaslt" if wanted == "auto" else wanted

    def assert_process_settings(self) -> None:
        """Put back the process-wide settings this engine's identity records (torch's thread
        count; on CUDA the GEMM library) before a forward: another engine or library in the
        process may have changed them, and computing under an identity that is no longer
        true would break bit-exactness silently."""
        torch = _torch()
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if self.cuda_blas is not None and str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower() != self.cuda_blas:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.backends.cuda.preferred_blas_library(self.cuda_blas)

    def process_settings(self) -> "_Held":
        """Hold this engine's process-wide settings for a forward (:class:`_ProcessSettings`)."""
        return PROCESS_SETTINGS.hold((self.threads, self.cuda_blas), self.assert_process_settings)

    def _choose_block_chunks(self, wanted: int | None) -> int:
        if wanted is None:
            raw = os.environ.get(PREFILL_BLOCK_ENV, "")
            if raw:
                try:
                    wanted = int(raw)
                except ValueError:
                    raise EngineError("unsupported", f"{PREFILL_BLOCK_ENV}={raw!r}: a whole number of chunks") from None
            else:
                wanted = DEFAULT_CUDA_BLOCK_CHUNKS if self.device.type == "cuda" else 1
        if isinstance(wanted, bool) or not isinstance(wanted, int) or not 1 <= wanted <= 64:
            raise EngineError("unsupported", f"prefill_block_chunks {wanted!r}: a whole number from 1 to 64")
        if self.prefill_forward not in ("lean", "graphs"):
            return 1  # the model's own forward takes one chunk at a time
        return wanted

    def block_tokens(self) -> int:
        """Tokens of one block prefill call (the grid chunk when blocks are off), after the
        engine's one-time probe that blocks compute the grid's bits on this device."""
        if not self._block_checked:
            with self._block_lock:
                if not self._block_checked:
                    self._probe_blocks()
                    self._block_checked = True
        return self.prefill_chunk_tokens * self.block_chunks

    def prepare(self) -> None:
        """Run now the one-time check a first prefill would otherwise pay (the block probe:
        two prefills of up to 2,304 tokens on a CUDA engine). The daemons call it at start,
        so the first request's TTFT is a prefill's, not a prefill's plus the probe's."""
        self.block_tokens()

    def _probe_blocks(self) -> None:
        """Prefill a probe prompt in blocks and one chunk at a time; keep blocks only if
        every plane and every chunk's logits row agree bit for bit.

        The kernels a block runs are chosen by shape (rows, hidden sizes, dtype), never by
        values, and the probe runs exactly the shapes a prefill runs (a block from position
        0, a block after a block, a single chunk after them): rows that came out the same for
        every value here are computed in the same order for any values."""
        torch = _torch()
        chunk = self.prefill_chunk_tokens
        block = chunk * self.block_chunks
        length = min(2 * block + chunk, self.max_context)
        if length < block:
            self.block_chunks, self.block_reason = 1, f"max_context {self.max_context} is shorter than one block of {block} tokens"
            return
        gen = torch.Generator().manual_seed(20261203)
        probe = torch.randint(0, self.layout.vocab_size, (length,), generator=gen).tolist()
        seen: dict[str, list[Any]] = {}
        for mode in ("grid", "blocks"):
            session = self.new_session()
            rows: list[Any] = []
            session._block_override = mode == "blocks"

            def keep(s: "EngineSession", rows: list[Any] = rows) -> None:
                assert s.last_logits is not None  # every chunk leaves its logits row
                rows.append(s.last_logits.clone())

            session.prefill(probe, on_chunk=keep)
            planes = [t for layer in session.cache.layers for t in (layer.keys, layer.values)]
            seen[mode] = rows + planes
        same = len(seen["grid"]) == len(seen["blocks"]) and all(a.shape == b.shape and bool(torch.equal(a, b)) for a, b in zip(seen["grid"], seen["blocks"]))
        if not same:
            self.block_reason = f"blocks of {self.block_chunks} chunks did not reproduce the grid's bits on this device"
            self.block_chunks = 1
            warnings.warn(f"kvpack: {self.block_reason}; prefilling one chunk at a time", RuntimeWarning, stacklevel=2)

    def segmented_block(self, plan: Any, tokens: int) -> Any:
        """The graphs runner of a block of ``tokens`` (several grid chunks), kept like
        :meth:`segmented_chunk`'s."""
        from .graph_prefill import SegmentedChunk, same_plan

        with self._segmented_lock:
            runner = getattr(self, "_segmented_block", None)
            if runner is None or runner.n != tokens or runner.grid != self.prefill_chunk_tokens or not same_plan(runner.plan, plan):
                runner = SegmentedChunk(plan, tokens, self.device, capture=self.device.type == "cuda", grid_tokens=self.prefill_chunk_tokens)
                self._segmented_block = runner
            return runner

    def segmented_chunk(self, plan: Any) -> Any:
        """The full-chunk graph runner of ``prefill_forward="graphs"``
        (kvpack.engine.graph_prefill), built (and on CUDA captured) on first use and again
        whenever the model's tensors are not the ones it was built for, or the chunk size
        changed (diag_prefill_chunks tries other grids on one engine)."""
        from .graph_prefill import SegmentedChunk, same_plan

        with self._segmented_lock:  # sessions prefilling at once share one runner
            runner = getattr(self, "_segmented", None)
            if runner is None or runner.n != self.prefill_chunk_tokens or not same_plan(runner.plan, plan):
                runner = SegmentedChunk(plan, self.prefill_chunk_tokens, self.device, capture=self.device.type == "cuda")
                self._segmented = runner
            return runner

    # -- layout ---------------------------------------------------------------------------

    def session_cache(self):
        """The cache a session computes into: ``new_cache()``, with preallocated layers
        when ``prefill_attention`` is ``lower_right`` (kvpack.engine.fast_prefill)."""
        cache = self.new_cache()
        if self.prefill_attention == "lower_right":
            from .fast_prefill import preallocated_layer_class

            layer = preallocated_layer_class()
            cache.layers = [layer() for _ in range(self.layout.num_layers)]
        return cache

    def new_cache(self):
        """An empty ``DynamicCache`` with the model's per-layer classes."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def _derive_layout(self) -> CacheLayout:
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        cfg = self.config
        model_type = getattr(cfg, "model_type", "")
        if model_type not in _NOPE_RULES:
            raise EngineError("unsupported", f"model type {model_type!r} has no position-class rule in this adapter")
        n_layers = int(cfg.num_hidden_layers)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers)
        dtype = _wire_dtype(self.model.dtype)
        cache = self.new_cache()
        if len(cache.layers) not in (0, n_layers):
            raise EngineError("layout", f"cache has {len(cache.layers)} layers, config {n_layers}")
        specs = []
        for i in range(n_layers):
            ltype = layer_types[i]
            # The cache class the model will really use is the authority; the config's layer
            # type must agree with it (a silent disagreement would ship the wrong rows).
            layer_obj = cache.layers[i] if cache.layers else DynamicLayer()
            sliding = isinstance(layer_obj, DynamicSlidingWindowLayer)
            if sliding != (ltype == "sliding_attention"):
                raise EngineError("layout", f"layer {i}: config type {ltype} but cache class {type(layer_obj).__name__}")
            if type(layer_obj) not in (DynamicLayer, DynamicSlidingWindowLayer):
                raise EngineError("unsupported", f"layer {i}: cache class {type(layer_obj).__name__}")
            position = "nope" if _NOPE_RULES[model_type](ltype) else "rope"
            if isinstance(layer_obj, DynamicSlidingWindowLayer):
                window = int(layer_obj.sliding_window)
                if window != int(cfg.sliding_window) or window < 2:
                    raise EngineError("layout", f"layer {i}: window {window} disagrees with config")
                specs.append(LayerSpec(i, LAYER_WINDOWED, kv_heads, head_dim, dtype, position, window_tokens=window - 1, attention_window=window))
            else:
                specs.append(LayerSpec(i, LAYER_FULL, kv_heads, head_dim, dtype, position))
        return CacheLayout(layers=tuple(specs), vocab_size=int(cfg.vocab_size))

    # -- identity -------------------------------------------------------------------------

    def _scalars(self) -> dict[str, float]:
        """Scalar-math constants: every float in the config plus the live module constants.

        The live values are read from the modules that compute (attention scaling, rotary
        attention scaling, logit scale), because a config and the running code can disagree
        (the seed's K4 caught two such regressions).
        """
        out: dict[str, float] = {}
        config_floats("config", canonical_config(self.config), out)
        base = getattr(self.model, "model", self.model)
        for i, layer in enumerate(getattr(base, "layers", [])):
            attn = getattr(layer, "self_attn", None)
            if attn is not None and hasattr(attn, "scaling"):
                out[f"live.layers[{i}].attn.scaling"] = float(attn.scaling)
        rotary = getattr(base, "rotary_emb", None)
        if rotary is not None and hasattr(rotary, "attention_scaling"):
            out["live.rotary.attention_scaling"] = float(rotary.attention_scaling)
        if hasattr(self.model, "logit_scale") and isinstance(self.model.logit_scale, (int, float)):
            out["live.logit_scale"] = float(self.model.logit_scale)
        return out

    def _rope(self) -> dict[str, Any]:
        torch = _torch()
        base = getattr(self.model, "model", self.model)
        rotary = getattr(base, "rotary_emb", None)
        desc: dict[str, Any] = {"rope_layers": [s.index for s in self.layout.layers if s.position == "rope"]}
        if rotary is not None and hasattr(rotary, "inv_freq"):
            inv = rotary.inv_freq.detach().to("cpu", torch.float32).contiguous()
            # The exact frequencies used, not just theta: catches a theta/config mismatch too.
            desc["inv_freq_sha256"] = hashlib.sha256(inv.view(torch.uint8).numpy()).hexdigest()
            desc["rope_type"] = str(getattr(rotary, "rope_type", "default"))
        return desc

    def _engine_abi(self) -> dict[str, Any]:
        torch = _torch()
        import transformers
        from transformers.cache_utils import DynamicCache

        abi: dict[str, Any] = {
            "adapter": ADAPTER_NAME,
            "adapter_version": ADAPTER_VERSION,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "attn_implementation": str(getattr(self.config, "_attn_implementation", None)),
            "cache_class": f"{DynamicCache.__module__}.{DynamicCache.__qualname__}",
            "layer_classes": sorted({type(l).__name__ for l in self.new_cache().layers}) or ["DynamicLayer"],
            "model_class": type(self.model).__name__,
            "device": self.device.type,
            "threads": self.threads,
            "compute_dtype": str(self.model.dtype).replace("torch.", ""),
            "byte_order": sys.byteorder,
            "forward": "logits_to_keep=1; greedy argmax over float32 logits",
        }
        if self.prefill_attention == "lower_right":  # absent otherwise: identities made before it stay valid
            abi["prefill"] = "kvpack lower-right causal attention over preallocated cache rows"
        if self.prefill_forward == "lean":  # absent otherwise, like "prefill"
            from .lean_prefill import ABI_RECORD

            abi["prefill_forward"] = ABI_RECORD
        elif self.prefill_forward == "graphs":
            from .graph_prefill import ABI_RECORD as GRAPHS_RECORD

            abi["prefill_forward"] = GRAPHS_RECORD
        if self.device.type == "cuda":
            abi["cuda_blas"] = self.cuda_blas
            abi["cuda"] = str(torch.version.cuda)
            abi["device_name"] = torch.cuda.get_device_name(self.device)
        return abi

    def _derive_identity(self, adapter: dict[str, Any]) -> EngineIdentity:
        return EngineIdentity(
            model_name=self.loaded.name,
            weights_digest=self.loaded.weights_digest,
            config=canonical_config(self.config),
            tokenizer_digest=self.loaded.tokenizer_digest,
            chat_template_digest=self.loaded.chat_template_digest,
            context_policy={
                "max_context": self.max_context,
                "prefill_chunk_tokens": self.prefill_chunk_tokens,
                "chunk_alignment": "absolute",
                "overflow": "refuse",
                "batch": 1,
            },
            adapter=adapter,
            weight_precision=self.loaded.weight_precision,
            engine_abi=self._engine_abi(),
            scalars=self._scalars(),
            layout=self.layout,
            rope=self._rope(),
        )

    def ids(self) -> IdentityIds:
        return self._ids

    def check_identity(self, expected: EngineIdentity | IdentityIds) -> None:
        """EngineError(identity) naming every Id32 that differs from this engine's."""
        other = expected.ids() if isinstance(expected, EngineIdentity) else expected
        if not isinstance(other, IdentityIds):
            raise EngineError("identity", f"expected an EngineIdentity or IdentityIds, got {type(expected).__name__}")
        if other != self._ids:
            differing = [n for n in IdentityIds.__dataclass_fields__ if getattr(other, n) != getattr(self._ids, n)]
            raise EngineError("identity", "identity mismatch in " + ", ".join(differing))

    # -- sessions -------------------------------------------------------------------------

    def new_session(self) -> "EngineSession":
        return EngineSession(self)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added beyond the tokenizer's defaults)."""
        if self.tokenizer is None:
            raise EngineError("model", f"{self.loaded.name} has no tokenizer")
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise EngineError("model", f"{self.loaded.name} has no tokenizer")
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


class EngineSession:
    """One sequence: the tokens so far, the live cache, and the exact last-logits row.

    ``last_logits`` is the float32 logits row of the last token processed (the row the next
    greedy token is chosen from); it is ``None`` after installing a prefix without logits.
    """

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine
        self.layout = engine.layout
        self.tokens: list[int] = []
        self.cache = engine.session_cache()
        self.last_logits = None
        self._block_override: bool | None = None  # the engine's block probe forces either way

    @property
    def position(self) -> int:
        return len(self.tokens)

    # -- compute --------------------------------------------------------------------------

    def _check_tokens(self, token_ids: Iterable[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        vocab = self.layout.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise EngineError("model", f"token id outside [0, {vocab})")
        if self.position + len(ids) > self.engine.max_context:
            raise EngineError("unsupported", f"context would exceed {self.engine.max_context} tokens")
        return ids

    def _upload(self, ids: list[int]) -> Any:
        """``ids`` as a (1, n) tensor on the engine's device, copied without waiting for the
        device: ``torch.tensor(ids, device="cuda")`` copies from pageable memory, which
        synchronises the stream, so a prefill that built each chunk's ids that way waited
        for every earlier chunk's kernels before it could issue the next chunk (the host
        and the GPU took turns instead of overlapping). From pinned memory the copy is
        queued like any kernel."""
        torch = _torch()
        host = torch.tensor([ids], dtype=torch.long)
        if self.engine.device.type != "cuda":
            return host.to(self.engine.device)
        return host.pin_memory().to(self.engine.device, non_blocking=True)

    def _forward(self, ids: list[int], *, lean: Any = None, device_ids: Any = None) -> None:
        """Forward ``ids`` after the tokens so far; ``lean`` (a kvpack.engine.lean_prefill
        plan) runs them through the lean forward instead of the model's (the same bits).
        ``device_ids``: ``ids`` already on the device as a ``(1, n)`` long tensor."""
        torch = _torch()
        with self.engine.process_settings(), torch.inference_mode():
            x = device_ids if device_ids is not None else torch.tensor([ids], dtype=torch.long, device=self.engine.device)
            if lean is not None and self.engine.prefill_forward == "graphs" and len(ids) == self.engine.prefill_chunk_tokens:
                logits = self.engine.segmented_chunk(lean).forward(self.cache.layers, x, self.position)
            elif lean is not None:
                from .lean_prefill import forward_chunk

                logits = forward_chunk(lean, self.cache.layers, x, self.position)
            else:
                logits = self.engine.model(input_ids=x, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
        self.tokens.extend(ids)
        self.last_logits = logits[0, -1].float()

    def _lean_plan(self) -> Any:
        """The lean forward's plan for this prefill (kvpack.engine.lean_prefill), or ``None``
        when the engine runs the model's forward. Refuses if forward hooks were added to the
        model since the engine was built: the lean forward would skip them."""
        if self.engine.prefill_forward not in ("lean", "graphs"):
            return None
        from .lean_prefill import hooks_reason, plan

        reason = hooks_reason(self.engine.model)
        if reason is not None:
            raise EngineError("unsupported", f"prefill_forward lean: {reason}; build the engine with prefill_forward='model'")
        return plan(self.engine.model)

    def prefill(
        self,
        token_ids: Sequence[int],
        chunk_size: int | None = None,
        on_chunk: Callable[["EngineSession"], None] | None = None,
    ) -> None:
        """Append ``token_ids``, forwarding them in absolute-aligned chunks.

        Chunk boundaries are the multiples of ``chunk_size`` (the engine's
        ``prefill_chunk_tokens``; another value is refused because the chunking is part of
        the identity). ``on_chunk(session)`` runs after each chunk, e.g. to save the cut
        while a windowed layer still holds the window that ends there.
        """
        chunk = self.engine.prefill_chunk_tokens
        if chunk_size is not None and chunk_size != chunk:
            raise EngineError("identity", f"chunk_size {chunk_size} differs from the engine's prefill_chunk_tokens {chunk}")
        ids = self._check_tokens(token_ids)
        lean = self._lean_plan()
        for layer in self.cache.layers:  # preallocated rows: room for the whole prompt at once
            if hasattr(layer, "reserve"):
                layer.reserve(self.position + len(ids))
        block = self._block_tokens(lean)
        on_device = self._upload(ids)  # one copy for the whole prompt, not one per chunk
        i = 0
        while i < len(ids):
            pos = self.position
            if block and pos % chunk == 0 and len(ids) - i >= block:
                self._forward_block(ids[i : i + block], lean, on_device[:, i : i + block], on_chunk)
                i += block
                continue
            stop = min((pos // chunk + 1) * chunk - pos, len(ids) - i)
            self._forward(ids[i : i + stop], lean=lean, device_ids=on_device[:, i : i + stop])
            i += stop
            if on_chunk is not None:
                on_chunk(self)

    def _block_tokens(self, lean: Any) -> int:
        """Tokens per block prefill call for this prefill, 0 for one chunk at a time."""
        if lean is None or self._block_override is False:
            return 0
        engine = self.engine
        block = engine.prefill_chunk_tokens * engine.block_chunks if self._block_override else engine.block_tokens()
        return block if block > engine.prefill_chunk_tokens else 0

    def _forward_block(self, ids: list[int], lean: Any, device_ids: Any, on_chunk: Callable[["EngineSession"], None] | None) -> None:
        """Forward a block of whole grid chunks (TransformersEngine ``prefill_block_chunks``),
        then show the session chunk by chunk: each chunk's tokens, logits row and cache rows,
        with ``on_chunk`` after each, as the grid leaves them (the block's later rows are
        written but not yet the layers' rows)."""
        torch = _torch()
        n = self.engine.prefill_chunk_tokens
        past = self.position
        layers = self.cache.layers
        try:
            with self.engine.process_settings(), torch.inference_mode():
                if self.engine.prefill_forward == "graphs":
                    rows = self.engine.segmented_block(lean, len(ids)).forward_block(layers, device_ids, past)
                else:
                    from .lean_prefill import forward_block

                    rows = forward_block(lean, layers, device_ids, past, n)
        except BaseException:
            for layer in layers:  # layers the block reached hide its rows again
                if layer.get_seq_length() > past:
                    layer.show(past)
            raise
        for b, logits in enumerate(rows):
            end = past + (b + 1) * n
            if on_chunk is not None:
                for layer in layers:
                    layer.show(end)
            self.tokens.extend(ids[b * n : (b + 1) * n])
            self.last_logits = logits[0, -1].float()
            if on_chunk is not None:
                on_chunk(self)

    def decode_greedy(self, n: int, stop_token_ids: Iterable[int] = ()):
        """Generate up to ``n`` tokens greedily from ``last_logits``.

        Returns ``(tokens, logits)``: ``logits[i]`` is the float32 row token ``i`` was chosen
        from. Each token is forwarded, so afterwards the cache, ``tokens`` and
        ``last_logits`` are consistent and the session can be exported at its new position.
        Stops after emitting a token in ``stop_token_ids``.
        """
        torch = _torch()
        if self.last_logits is None:
            raise EngineError("install", "no final logits at this cut: prefill at least one token first")
        stops = {int(t) for t in stop_token_ids}
        out_tokens: list[int] = []
        out_logits = []
        for _ in range(n):
            logits = self.last_logits
            token = int(torch.argmax(logits).item())
            self._check_tokens([token])
            out_tokens.append(token)
            out_logits.append(logits)
            self._forward([token])
            if token in stops:
                break
        return out_tokens, out_logits

    # -- export ---------------------------------------------------------------------------

    def retained_range(self, layer: int) -> tuple[int, int]:
        """Absolute rows ``[lo, position)`` the live cache holds for ``layer``."""
        return self.layout.retained_range(layer, self.position)

    def _plane(self, layer: int, role: str):
        """The live ``[1, heads, rows, head_dim]`` tensor, checked against the layout."""
        self.layout.check_role(role)
        spec = self.layout.layer(layer)
        cache_layer = self.cache.layers[layer]
        t = cache_layer.keys if role == "k" else cache_layer.values
        lo, hi = spec.retained_range(self.position)
        expected = (1, spec.kv_heads, hi - lo, spec.head_dim)
        if t is None or tuple(t.shape) != expected:
            got = None if t is None else tuple(t.shape)
            raise EngineError("layout", f"layer {layer} {role}: live shape {got}, layout expects {expected}")
        if _wire_dtype(t.dtype) != spec.dtype:
            raise EngineError("layout", f"layer {layer} {role}: live dtype {t.dtype}, layout {spec.dtype}")
        if spec.kind == LAYER_WINDOWED and getattr(cache_layer, "cumulative_length", None) != self.position:
            raise EngineError("layout", f"layer {layer}: cumulative length disagrees with the session position")
        return t, lo

    def export_rows_tensor(self, layer: int, role: str, start: int, stop: int):
        """Rows ``[start, stop)`` of one state as a flat contiguous ``uint8`` tensor of
        token-major wire bytes, on the session's device (the transpose runs there).

        Same checks as :meth:`export_rows`, which is this tensor copied to the host."""
        torch = _torch()
        spec = self.layout.layer(layer)
        self.layout.check_role(role)
        if not 0 <= start <= stop <= self.position:
            raise EngineError("layout", f"rows [{start}, {stop}) outside [0, {self.position})")
        if start == stop:
            return torch.empty(0, dtype=torch.uint8, device=self.engine.device)
        t, lo = self._plane(layer, role)
        if start < lo:
            raise EngineError("layout", f"layer {layer} retains rows [{lo}, {self.position}); row {start} was evicted")
        with torch.inference_mode():
            rows = t[0, :, start - lo : stop - lo, :].transpose(0, 1).contiguous()
            flat = rows.reshape(-1).view(torch.uint8)
        if flat.numel() != (stop - start) * spec.row_bytes:  # pragma: no cover - geometry guard
            raise EngineError("layout", "exported byte count disagrees with the layout")
        return flat

    def export_rows(self, layer: int, role: str, start: int, stop: int) -> memoryview:
        """Rows ``[start, stop)`` (absolute token positions) of one state, token-major bytes.

        The result is a flat ``memoryview`` over a fresh contiguous CPU tensor in the wire
        dtype, little-endian, ``(stop - start) * row_bytes`` long. For a windowed layer the
        range must lie inside :meth:`retained_range`; asking for evicted rows is refused.
        """
        flat = self.export_rows_tensor(layer, role, start, stop)
        if flat.numel() == 0:
            return memoryview(b"")
        if flat.device.type != "cpu":
            flat = flat.cpu()
        return memoryview(flat.numpy())

    def export_spans(self, requests, *, depth: int = 8):
        """Export many ``(layer, role, start, stop)`` spans in order: yields ``(view, release)``
        with ``view`` equal to :meth:`export_rows` of the span. On CUDA the device-to-host
        copies go through pinned buffers, ``depth`` spans ahead of the consumer, who calls
        ``release()`` once done with the view (kvpack.engine.cuda); on the CPU ``release``
        is ``None``."""
        if self.engine.device.type == "cuda":
            from .cuda import export_spans

            return export_spans(self, requests, depth=depth)
        return ((self.export_rows(*req), None) for req in requests)

    def export_logits(self) -> memoryview:
        """The exact last-logits row: ``vocab_size`` float32 little-endian values."""
        torch = _torch()
        if self.last_logits is None:
            raise EngineError("install", "no final logits at this cut")
        with torch.inference_mode():
            row = self.last_logits.detach().to("cpu", torch.float32).contiguous()
        return memoryview(row.view(torch.uint8).numpy())

    def state_digest(self, layer: int, role: str) -> bytes:
        """SHA-256 of the retained rows of one state in wire form (for restore proofs)."""
        return contract_state_digest(self, layer, role)

    def cache_digest(self) -> bytes:
        """SHA-256 over the position, every state digest and the logits (contract.cache_digest)."""
        return contract_cache_digest(self)

    # -- install --------------------------------------------------------------------------

    def begin_install(self, cut: int, token_ids: Sequence[int], identity: EngineIdentity | IdentityIds) -> "DetachedInstall":
        """Start filling a detached cache for the cut ``[0, cut)``; the live session is untouched.

        ``identity`` is what the stored cache claims to be; any difference from this engine's
        identity refuses with EngineError(identity) before anything is allocated.
        """
        self.engine.check_identity(identity)
        return DetachedInstall(self, cut, token_ids)


class DetachedInstall(InstallContext):
    """A cache being filled beside the live one; it replaces the live cache only on commit.

    Rows arrive per ``(layer, role)`` as token-major wire bytes for absolute ranges; each row
    of :meth:`required_range` must be written exactly once. ``commit`` checks completeness
    and then swaps tokens, cache and logits in one step; ``abort`` (or any refusal) leaves
    the live session as it was.
    """

    def __init__(self, session: EngineSession, cut: int, token_ids: Sequence[int]) -> None:
        torch = _torch()
        import numpy as np

        layout = session.layout
        ids = [int(t) for t in token_ids]
        if cut <= 0 or cut > session.engine.max_context:
            raise EngineError("install", f"cut {cut} outside [1, {session.engine.max_context}]")
        if len(ids) != cut:
            raise EngineError("install", f"{len(ids)} token ids for a cut of {cut}")
        if any(t < 0 or t >= layout.vocab_size for t in ids):
            raise EngineError("install", "token id outside the vocabulary")
        self.session = session
        self.layout = layout
        self.cut = cut
        self.tokens = ids
        self.state = "open"
        self._logits = None
        device = session.engine.device
        dtypes = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
        self._planes: dict[tuple[int, str], Any] = {}
        self._written: dict[tuple[int, str], Any] = {}
        for spec in layout.layers:
            lo, hi = spec.retained_range(cut)
            for role in layout.roles:
                self._planes[(spec.index, role)] = torch.empty((1, spec.kv_heads, hi - lo, spec.head_dim), dtype=dtypes[spec.dtype], device=device)
                self._written[(spec.index, role)] = np.zeros(hi - lo, dtype=bool)
        self._torch_dtypes = dtypes

    def required_range(self, layer: int) -> tuple[int, int]:
        """Absolute rows of ``layer`` this install needs: ``[0, cut)`` or the window ending at cut."""
        return self.layout.retained_range(layer, self.cut)

    def _check_open(self) -> None:
        if self.state != "open":
            raise EngineError("install", f"install already {self.state}")

    def stager(self, slots: int):
        """Restore staging for the store on a CUDA device (pinned host buffers, device
        buffers, a copy stream: kvpack.engine.cuda.RestoreStager), or ``None`` on the CPU."""
        device = self.session.engine.device
        if device.type != "cuda":
            return None
        from .cuda import restore_stager

        return restore_stager(device, slots)

    def plane_stager(self, *, force: bool = False):
        """Whole-plane restore staging (kvpack.engine.cuda.PlaneStager) on a CUDA device, or
        ``None`` on the CPU (``force`` returns one on the CPU too, for tests)."""
        device = self.session.engine.device
        if device.type != "cuda" and not force:
            return None
        from .cuda import plane_stager

        return plane_stager(device)

    def wave_ring(self, *, wave_chunks: int, waves: int, force: bool = False, wave_bytes: int | None = None):
        """Staging for a restore verified on the device (kvpack.engine.device_verify): on a
        CUDA device whose GPU SHA-256 kernel compiles, or anywhere with ``force`` (on the
        CPU the same pipeline then hashes with hashlib); otherwise ``None``."""
        from .device_verify import unavailable_reason, wave_ring

        device = self.session.engine.device
        if device.type == "cuda":
            if unavailable_reason(device) is not None:
                return None
        elif not force:
            return None
        return wave_ring(device, wave_chunks=wave_chunks, waves=waves, wave_bytes=wave_bytes)

    def write_rows(self, layer: int, role: str, start: int, data) -> None:
        """Copy token-major wire rows starting at absolute row ``start`` into the detached cache.

        ``data`` is any buffer (bytes, memoryview, bytearray); it is read in place through
        ``torch.frombuffer`` and copied once, transposing to the cache's head-major layout.
        ``data`` may also be a flat ``uint8`` tensor on the install's device (a staged upload,
        kvpack.engine.cuda): the transposing copy then runs on the device.
        """
        torch = _torch()
        self._check_open()
        spec = self.layout.layer(layer)
        self.layout.check_role(role)
        staged = isinstance(data, torch.Tensor)
        if staged:
            if data.dtype != torch.uint8 or data.dim() != 1 or data.device != self._planes[(layer, role)].device:
                raise EngineError("layout", "staged rows must be a flat uint8 tensor on the install's device")
            nbytes = data.numel()
        else:
            view = memoryview(data).cast("B")
            nbytes = view.nbytes
        n = self._claim(spec, role, start, nbytes)
        if n == 0:
            return
        if staged:
            src = data.view(self._torch_dtypes[spec.dtype])
        else:
            with warnings.catch_warnings():
                # frombuffer warns on read-only buffers (bytes); we only ever read from it.
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(view, dtype=self._torch_dtypes[spec.dtype], count=n * spec.row_elements)
        src = src.view(n, spec.kv_heads, spec.head_dim).transpose(0, 1)
        lo = spec.retained_range(self.cut)[0]
        with torch.no_grad():
            self._planes[(layer, role)][0, :, start - lo : start - lo + n, :].copy_(src)
        self._written[(layer, role)][start - lo : start - lo + n] = True

    def write_row_blocks(self, layer: int, role: str, start: int, blocks) -> None:
        """Like :meth:`write_rows` for ``blocks``, a 2-D ``uint8`` tensor on the install's
        device (``count`` blocks of equal size, any block stride): the blocks' rows are
        consecutive from absolute row ``start``. One transposing copy for all of them (the
        device-verify restore installs a wave's chunks of one plane this way)."""
        torch = _torch()
        self._check_open()
        spec = self.layout.layer(layer)
        self.layout.check_role(role)
        plane = self._planes[(layer, role)]
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.device != plane.device:
            raise EngineError("layout", "row blocks must be a 2-D uint8 tensor on the install's device")
        count, block_bytes = blocks.shape
        if block_bytes % spec.row_bytes:
            raise EngineError("layout", f"{block_bytes} bytes is not a whole number of {spec.row_bytes}-byte rows")
        n = self._claim(spec, role, start, count * block_bytes)
        if n == 0:
            return
        per = block_bytes // spec.row_bytes
        src = blocks.view(self._torch_dtypes[spec.dtype]).view(count, per, spec.kv_heads, spec.head_dim).permute(2, 0, 1, 3)
        lo = spec.retained_range(self.cut)[0]
        with torch.no_grad():
            plane[0, :, start - lo : start - lo + n, :].view(spec.kv_heads, count, per, spec.head_dim).copy_(src)
        self._written[(layer, role)][start - lo : start - lo + n] = True

    def _claim(self, spec, role: str, start: int, nbytes: int) -> int:
        """Check that ``nbytes`` of rows from ``start`` fit the needed range and were not
        written yet; returns the row count (the caller marks them written after copying)."""
        if nbytes % spec.row_bytes:
            raise EngineError("layout", f"{nbytes} bytes is not a whole number of {spec.row_bytes}-byte rows")
        n = nbytes // spec.row_bytes
        lo, hi = spec.retained_range(self.cut)
        if start < lo or start + n > hi:
            raise EngineError("layout", f"layer {spec.index} rows [{start}, {start + n}) outside the needed [{lo}, {hi})")
        written = self._written[(spec.index, role)]
        if written[start - lo : start - lo + n].any():
            raise EngineError("install", f"layer {spec.index} {role}: rows written twice")
        return n

    def write_logits(self, data) -> None:
        """The exact final-logits row at the cut (``vocab_size`` f32 LE values)."""
        torch = _torch()
        self._check_open()
        view = memoryview(data).cast("B")
        if view.nbytes != self.layout.logits_bytes:
            raise EngineError("layout", f"logits row is {view.nbytes} bytes, expected {self.layout.logits_bytes}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            row = torch.frombuffer(view, dtype=torch.float32).clone()
        self._logits = row.to(self.session.engine.device)

    def missing(self) -> list[tuple[int, str, int]]:
        """(layer, role, rows still missing) for every incomplete state."""
        out = []
        for (layer, role), written in self._written.items():
            left = int((~written).sum())
            if left:
                out.append((layer, role, left))
        return out

    def commit(self, *, require_logits: bool = True) -> None:
        """Make the detached cache live. Refuses (installing nothing) if incomplete.

        ``require_logits=False`` is for a prefix that will be extended by prefill before
        any token is generated; the session then has no ``last_logits`` until it does.
        """
        from transformers.cache_utils import DynamicSlidingWindowLayer

        self._check_open()
        gaps = self.missing()
        if gaps:
            layer, role, left = gaps[0]
            raise EngineError("install", f"{len(gaps)} states incomplete (layer {layer} {role}: {left} rows missing)")
        if require_logits and self._logits is None:
            raise EngineError("install", "no final-logits row: a cut without it cannot resume generation")
        cache = self.session.engine.session_cache()
        if len(cache.layers) != self.layout.num_layers:
            # A config without per-layer types gives a lazily grown cache; make the layers now.
            from transformers.cache_utils import DynamicLayer

            cache.layers = [DynamicLayer() for _ in range(self.layout.num_layers)]
        for spec, layer_obj in zip(self.layout.layers, cache.layers):
            k = self._planes[(spec.index, "k")]
            v = self._planes[(spec.index, "v")]
            sliding = isinstance(layer_obj, DynamicSlidingWindowLayer)
            if sliding != (spec.kind == LAYER_WINDOWED):
                raise EngineError("layout", f"layer {spec.index}: cache class disagrees with the layout")
            if hasattr(layer_obj, "adopt"):  # preallocated rows (kvpack.engine.fast_prefill)
                layer_obj.adopt(k, v)
            else:
                layer_obj.lazy_initialization(k, v)
                layer_obj.keys, layer_obj.values = k, v
            if sliding:
                # Absolute position, not row count: it drives the sliding-window mask offset.
                layer_obj.cumulative_length = self.cut
        # Everything that can fail has been checked; the swap below cannot half-happen.
        session = self.session
        session.cache = cache
        session.tokens = list(self.tokens)
        session.last_logits = self._logits
        self.state = "committed"
        self._planes = {}

    def abort(self) -> None:
        """Drop the detached cache; the live session is untouched."""
        if self.state == "open":
            self.state = "aborted"
            self._planes = {}


def transfer_cut(source: EngineSession, target: EngineSession, cut: int | None = None, *, with_logits: bool = True) -> None:
    """Copy the cut ``[0, cut)`` of ``source`` into ``target`` through a DetachedInstall.

    A helper for tests and in-process moves; the store does the same through its packs.
    ``cut`` defaults to the source position. For a windowed layer the window ending at the
    cut must still be retained by the source (so ``cut`` is the source position unless the
    model has no windowed layers).
    """
    cut = source.position if cut is None else cut
    install = target.begin_install(cut, source.tokens[:cut], source.engine.identity)
    try:
        for layer, role in source.layout.states():
            lo, hi = install.required_range(layer)
            install.write_rows(layer, role, lo, source.export_rows(layer, role, lo, hi))
        if with_logits:
            if cut != source.position:
                raise EngineError("install", "final logits exist only at the source position")
            install.write_logits(source.export_logits())
        install.commit(require_logits=with_logits)
    except BaseException:
        install.abort()
        raise


__all__ = [
    "TransformersEngine",
    "EngineSession",
    "DetachedInstall",
    "transfer_cut",
]
