"""How an engine's cache maps onto production-v1 objects (a project decision; the spec is
silent, see docs/store.md).

* Tenant Id32 = ``SHA256("kvpack/v1/tenant\\0" || tenant name)``.
* SemanticModelId = the engine identity's five Id32; the family's abi/topology/shard ids are
  its other three, so any identity change moves every key (a miss, never a wrong restore).
* One family state per (layer, role): key ``(layer, "k"|"v")``, dims ``(token, heads*head_dim)``,
  token axis 0, contiguous, direct, the plane's dtype. Full-span layers use the raw codec.
  Windowed layers use the lossless codec and a cut's rows *outside the window are zero*: the
  production-v1 manifest describes rows ``[0, cut)`` of every state, a windowed layer only
  retains its window, and PackBits stores an all-zero 4 MiB span in ~64 KiB. Restore reads
  and installs only the window.
* The exact final-logits row is a KVCHK1 chunk object of its own (state key
  ``(layers, "logits")``, span ``(cut-1, 1, 0, 32 + 4*vocab)``) whose plaintext is the
  manifest id followed by the f32 row: the content id (keyed HMAC over position and
  plaintext) binds it to that very manifest.
* A *prefix cut* (saved by engines that never expose the row at a cut, vLLM) has the same
  object with the manifest id alone as plaintext (span ``(cut-1, 1, 0, 32)``): every committed
  cut keeps one authenticated object bound to its manifest, and a full cut cannot be turned
  into a prefix cut (or back) without the keys.
"""

from __future__ import annotations

import hashlib

from ..engine.contract import LAYER_WINDOWED, CacheLayout, IdentityIds
from ..format import constants as C
from ..format.identity import SemanticModelId
from ..format.objects import Family, FamilyState, Span, StateKey

LOGITS_NAME = "logits"


def tenant_id(name: str) -> bytes:
    return hashlib.sha256(b"kvpack/v1/tenant\0" + name.encode("utf-8")).digest()


def semantic_id(ids: IdentityIds) -> SemanticModelId:
    return SemanticModelId(*ids.semantic_model_id())


def family_for(layout: CacheLayout, ids: IdentityIds) -> Family:
    states = []
    for spec in layout.layers:
        codec = C.CODEC_LOSSLESS if spec.kind == LAYER_WINDOWED else C.CODEC_RAW
        for role in sorted(layout.roles):
            states.append(
                FamilyState(
                    key=StateKey(spec.index, role),
                    dtype=spec.dtype_wire,
                    codec=codec,
                    dims=(0, spec.row_elements),
                    token_axis=0,
                    elements_per_token=spec.row_elements,
                )
            )
    abi, topology, shard = ids.family_ids()
    return Family(engine_cache_abi=abi, topology=topology, shard_map=shard, states=tuple(states))


def logits_key(layout: CacheLayout) -> StateKey:
    return StateKey(layout.logits_layer, LOGITS_NAME)


def logits_span(layout: CacheLayout, cut: int, *, prefix_only: bool = False) -> Span:
    """The logits object's span; a prefix cut's object (no row) holds the manifest id only."""
    return Span(cut - 1, 1, 0, 32 + (0 if prefix_only else layout.logits_bytes))


def logits_family(layer: int, plaintext_bytes: int, family: Family) -> Family:
    """The family extended by the logits state, used to verify the logits chunk object."""
    state = FamilyState(
        key=StateKey(layer, LOGITS_NAME), dtype=1, codec=C.CODEC_RAW, dims=(0, plaintext_bytes), token_axis=0, elements_per_token=plaintext_bytes
    )
    return Family(family.engine_cache_abi, family.topology, family.shard_map, family.states + (state,), family.mode, family.page_size_tokens)
