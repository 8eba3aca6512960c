"""The one place that builds engines from a spec string (``--engine SPEC`` everywhere).

Every entry point -- the node daemons, ``kvpack identity``, the store CLI and
``kvpack generate``, migration nodes, the demo and the benchmarks -- calls
:func:`load_engine`, so a spec means the same engine (and therefore the same exact
identity) wherever it is typed. Specs:

==========================  ================================================================
``smollm2``                 SmolLM2-135M-Instruct from the bundled GGUF (transformers, f32)
``muse-tiny``               seeded random Cohere2 with the seed's Muse cache layout (f16):
                            52 layers, 13 NoPE full-attention + 39 sliding-window (2,048)
``arrays:L:H:D[:DTYPE]``    the NumPy adapter: L full-attention layers of H KV heads x D
                            head dim, DTYPE ``f32`` (default), ``f16`` or ``bf16``; no model
==========================  ================================================================

``threads`` is part of an engine's identity (docs/engine.md, "Determinism"); ``None``
takes the spec's default (:func:`default_threads`), so two nodes started with the same spec
and no ``--threads`` agree. This module must never load a model at import time, and never
build an engine any other way than the functions below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import EngineError
from .contract import DTYPE_WIRE, Engine

#: The default thread count per named spec. SmolLM2's matrices are large enough for two
#: threads to pay; muse-tiny's hidden size is 64, so its GEMMs are tiny and a second
#: thread mostly adds synchronisation (docs/engine.md, "muse-tiny").
DEFAULT_THREADS = {"smollm2": 2, "muse-tiny": 1}
ARRAYS_DEFAULT = (4, 2, 8, "f32")
SPEC_HELP = "smollm2 (default), muse-tiny, or arrays:L:H:D[:f32|f16|bf16] (NumPy adapter, no model)"


@dataclass(frozen=True)
class EngineSpec:
    """A parsed ``--engine`` value."""

    name: str  # "smollm2", "muse-tiny" or "arrays"
    text: str  # the spec as typed (canonical form)
    arrays: Optional[tuple[int, int, int, str]] = None  # layers, kv heads, head dim, dtype

    @property
    def tokenizes(self) -> bool:
        """Whether the engine turns text into tokens (the bundled SmolLM2 only): muse-tiny and
        the arrays engine take token ids (the node daemons' requests), not a text prompt."""
        return self.name == "smollm2"


def parse_spec(spec: str) -> EngineSpec:
    """Parse ``spec``; EngineError(``unsupported``) for anything not listed above."""
    spec = (spec or "").strip()
    if spec in DEFAULT_THREADS:
        return EngineSpec(spec, spec)
    if spec == "arrays" or spec.startswith("arrays:"):
        parts = spec.split(":")[1:]
        if len(parts) > 4:
            raise EngineError("unsupported", f"engine spec {spec!r}: arrays takes at most L:H:D:DTYPE")
        dtype = ARRAYS_DEFAULT[3]
        if len(parts) == 4:
            dtype = parts.pop()
            if dtype not in DTYPE_WIRE:
                raise EngineError("unsupported", f"engine spec {spec!r}: dtype must be one of {sorted(DTYPE_WIRE)}")
        try:
            dims = [int(p) for p in parts]
        except ValueError:
            raise EngineError("unsupported", f"engine spec {spec!r}: L, H and D must be integers") from None
        defaults = [ARRAYS_DEFAULT[0], ARRAYS_DEFAULT[1], ARRAYS_DEFAULT[2]]
        layers, heads, dim = (dims + defaults[len(dims) :])[:3]
        if min(layers, heads, dim) <= 0:
            raise EngineError("unsupported", f"engine spec {spec!r}: L, H and D must be positive")
        text = f"arrays:{layers}:{heads}:{dim}" + ("" if dtype == "f32" else f":{dtype}")
        return EngineSpec("arrays", text, (layers, heads, dim, dtype))
    raise EngineError("unsupported", f"unknown engine {spec!r}: {SPEC_HELP}")


def default_threads(spec: str) -> int:
    """The thread count a spec runs with when none is given (NumPy: 1, it has no threads)."""
    return DEFAULT_THREADS.get(parse_spec(spec).name, 1)


def arrays_engine(layers: int, kv_heads: int, head_dim: int, dtype: str = "f32", *, vocab: int = 64, name: Optional[str] = None) -> Any:
    """The NumPy adapter with ``layers`` full-attention layers (the ``arrays:`` spec)."""
    from .arrays import ArrayEngine, array_layout

    layout = array_layout(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, vocab=vocab)
    if name is None:
        name = f"arrays-{layers}x{kv_heads}x{head_dim}" + ("" if dtype == "f32" else f"-{dtype}")
    return ArrayEngine(layout, name=name)


def load_engine(spec: str = "smollm2", *, threads: Optional[int] = None, device: str = "cpu") -> Engine:
    """Build the engine ``spec`` names (see the module docstring).

    ``threads`` (``None``: :func:`default_threads`) and ``device`` apply to the
    transformers engines; the NumPy adapter ignores both.
    """
    parsed = parse_spec(spec)
    if parsed.name == "arrays":
        assert parsed.arrays is not None
        layers, heads, dim, dtype = parsed.arrays
        engine: Engine = arrays_engine(layers, heads, dim, dtype)
        return engine
    from .transformers_adapter import TransformersEngine

    n = DEFAULT_THREADS[parsed.name] if threads is None else int(threads)
    if parsed.name == "smollm2":
        from .models import load_smollm2

        return TransformersEngine(load_smollm2(), threads=n, prefill_chunk_tokens=256, device=device)
    from .muse import MUSE_MAX_CONTEXT, load_muse_tiny

    return TransformersEngine(load_muse_tiny(), threads=n, prefill_chunk_tokens=256, device=device, max_context=MUSE_MAX_CONTEXT)


__all__ = ["DEFAULT_THREADS", "SPEC_HELP", "EngineSpec", "arrays_engine", "default_threads", "load_engine", "parse_spec"]
