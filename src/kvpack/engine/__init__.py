"""Engine adapters: map an engine's KV cache to kvpack states and back, bit-exactly.

:mod:`.contract` (no torch) defines layouts, states and the exact identity;
:mod:`.transformers_adapter` drives Hugging Face transformers; :mod:`.models` loads the
bundled SmolLM2 GGUF and builds small random Cohere2/Llama models. Heavy modules are not
imported here so that ``import kvpack.engine`` stays cheap.
"""

from .contract import (
    DTYPE_WIRE,
    LAYER_FULL,
    LAYER_WINDOWED,
    LOGITS_ROLE,
    ROLES,
    CacheLayout,
    EngineIdentity,
    IdentityIds,
    LayerSpec,
    canonical_json,
    f64_bits,
    id32,
)

__all__ = [
    "DTYPE_WIRE",
    "LAYER_FULL",
    "LAYER_WINDOWED",
    "LOGITS_ROLE",
    "ROLES",
    "CacheLayout",
    "EngineIdentity",
    "IdentityIds",
    "LayerSpec",
    "canonical_json",
    "f64_bits",
    "id32",
]
