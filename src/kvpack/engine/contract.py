"""The engine adapter contract: cache layout, states, exact identity (no torch here).

kvpack never interprets KV values. An adapter tells it three things, and this module is the
vocabulary for them:

* **Layout** (:class:`CacheLayout`): per layer, its class (``full`` span or ``windowed``),
  the rows a windowed layer retains, KV heads, head dim, dtype (production-v1 wire values
  f16=6, bf16=7, f32=8) and position encoding. A *state* is one ``(layer, role)`` plane,
  role ``"k"`` or ``"v"``, exported and installed as **token-major** rows: row ``t`` is the
  ``kv_heads * head_dim`` elements of absolute token ``t`` (heads outer, head-dim inner),
  little-endian. The token axis of a state is axis 0 of the plane ``[tokens, heads*head_dim]``.
  The exact final-logits row is one more plane (role ``"logits"`` at the synthetic layer
  ``len(layers)``), ``vocab_size`` f32 values, so generation resumes with no forward pass.
* **Retention** (:meth:`CacheLayout.retained_range`): a full-span layer at position ``P``
  holds rows ``[0, P)``; a windowed layer holds ``[max(0, P - window_tokens), P)``.
* **Identity** (:class:`EngineIdentity`): everything that changes the bits of the cache or
  of the logits computed from it. It produces the five Id32 of production-v1's
  SemanticModelId and the three Id32 of the representation family (engine_cache_abi,
  topology, shard_map). Any change to any field changes at least one of those bytes, so a
  cache written under another identity is unreachable: a miss, never a best-effort restore.

Canonical encoding (what is hashed)
-----------------------------------
Each Id32 is ``SHA256(b"kvpack/engine/v1/" + component + b"\\0" + canonical_json(obj))``
where ``canonical_json`` is JSON with keys sorted by code point, separators ``,`` and ``:``,
ASCII only (``ensure_ascii``), no whitespace, and **no JSON floats**: every float is replaced
by the string ``"f64:" + 16 lowercase hex digits`` of its IEEE-754 binary64 bit pattern
(big-endian hex of the u64), so ``1e-5`` and ``9.999999747378752e-06`` hash differently and
no decimal formatting or parser can blur a constant. Tuples encode as lists, ``None`` as
``null``; any other type is refused. The components and their objects are documented on
:meth:`EngineIdentity.components` and in docs/engine.md.

The contract in code
--------------------
:class:`Engine`, :class:`Session` and :class:`Install` are the ``typing.Protocol`` s every
adapter implements (transformers, NumPy arrays, vLLM); :class:`SpanExport`,
:class:`PlaneStaging`, :class:`DeviceVerification` and :class:`SharedPlanes` are optional capabilities. They are
``runtime_checkable``: the store and the nodes ask ``isinstance(x, PlaneStaging)``, never
``hasattr``, so a capability is one named, documented set of methods. This module must
never import torch or an engine: it is the vocabulary, not an implementation.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Callable, Generator, Iterable, Optional, Protocol, Sequence, runtime_checkable

from ..errors import EngineError

ROLES: tuple[str, ...] = ("k", "v")
LOGITS_ROLE = "logits"

# production-v1 DType wire values (INTEROP.md A.0) and their widths in bytes.
DTYPE_WIRE: dict[str, int] = {"f16": 6, "bf16": 7, "f32": 8}
DTYPE_WIDTH: dict[str, int] = {"f16": 2, "bf16": 2, "f32": 4}

LAYER_FULL = "full"
LAYER_WINDOWED = "windowed"

ENGINE_DOMAIN = b"kvpack/engine/v1/"


# --------------------------------------------------------------------------------------------
# canonical encoding


def f64_bits(value: float) -> str:
    """``"f64:<16 hex>"``: the exact IEEE-754 binary64 bit pattern of ``value``."""
    return "f64:" + struct.pack(">d", float(value)).hex()


def _canon(obj: Any) -> Any:
    # bool is checked before int because it is an int subclass, and must stay true/false.
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return f64_bits(obj)
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise EngineError("identity", f"canonical JSON keys must be strings, got {type(k).__name__}")
            out[k] = _canon(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [_canon(v) for v in obj]
    raise EngineError("identity", f"type {type(obj).__name__} has no canonical encoding")


def canonical_json(obj: Any) -> bytes:
    """The canonical bytes hashed for identities (see the module docstring)."""
    return json.dumps(_canon(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def id32(component: str, obj: Any) -> bytes:
    """Domain-separated SHA-256 of the canonical JSON of ``obj``."""
    return hashlib.sha256(ENGINE_DOMAIN + component.encode("ascii") + b"\0" + canonical_json(obj)).digest()


# --------------------------------------------------------------------------------------------
# layout


@dataclass(frozen=True)
class LayerSpec:
    """One layer's cache geometry.

    ``window_tokens`` is the number of trailing rows a windowed layer *retains* (0 for full
    layers); ``attention_window`` is the model's own window parameter (for HF sliding
    attention a query at ``p`` sees ``[p - W + 1, p]``, so the cache keeps ``W - 1`` rows).
    """

    index: int
    kind: str  # LAYER_FULL or LAYER_WINDOWED
    kv_heads: int
    head_dim: int
    dtype: str  # key of DTYPE_WIRE
    position: str  # "rope" or "nope": whether rows are bound to their absolute position
    window_tokens: int = 0
    attention_window: int = 0

    def __post_init__(self) -> None:
        if self.kind not in (LAYER_FULL, LAYER_WINDOWED):
            raise EngineError("layout", f"layer {self.index}: unknown class {self.kind!r}")
        if self.dtype not in DTYPE_WIRE:
            raise EngineError("unsupported", f"layer {self.index}: dtype {self.dtype!r} has no wire value")
        if self.kv_heads <= 0 or self.head_dim <= 0:
            raise EngineError("layout", f"layer {self.index}: empty geometry")
        if (self.kind == LAYER_WINDOWED) != (self.window_tokens > 0):
            raise EngineError("layout", f"layer {self.index}: window_tokens must be > 0 exactly for windowed layers")

    @property
    def row_elements(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.row_elements * DTYPE_WIDTH[self.dtype]

    @property
    def dtype_wire(self) -> int:
        return DTYPE_WIRE[self.dtype]

    def retained_range(self, position: int) -> tuple[int, int]:
        """Absolute rows ``[lo, position)`` this layer holds when ``position`` tokens are cached."""
        if position < 0:
            raise EngineError("layout", "negative position")
        if self.kind == LAYER_WINDOWED:
            return max(0, position - self.window_tokens), position
        return 0, position

    def canonical(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "dtype_wire": self.dtype_wire,
            "position": self.position,
            "window_tokens": self.window_tokens,
            "attention_window": self.attention_window,
        }


@dataclass(frozen=True)
class CacheLayout:
    """The whole cache: layers in order, roles, the logits plane, byte order."""

    layers: tuple[LayerSpec, ...]
    vocab_size: int
    roles: tuple[str, ...] = ROLES
    token_axis: int = 0  # of the token-major plane [tokens, heads*head_dim]
    byte_order: str = "little"

    def __post_init__(self) -> None:
        if not self.layers:
            raise EngineError("layout", "no layers")
        for i, spec in enumerate(self.layers):
            if spec.index != i:
                raise EngineError("layout", f"layer {i} carries index {spec.index}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def logits_layer(self) -> int:
        """Synthetic layer index of the exact final-logits plane (after the last real layer)."""
        return len(self.layers)

    @property
    def logits_bytes(self) -> int:
        return self.vocab_size * 4

    def layer(self, index: int) -> LayerSpec:
        if not isinstance(index, int) or not 0 <= index < len(self.layers):
            raise EngineError("layout", f"no layer {index!r} (model has {len(self.layers)})")
        return self.layers[index]

    def check_role(self, role: str) -> None:
        if role not in self.roles:
            raise EngineError("layout", f"unknown role {role!r}")

    def states(self) -> list[tuple[int, str]]:
        """Every KV state in canonical order (layer, then role name)."""
        return [(spec.index, role) for spec in self.layers for role in sorted(self.roles)]

    def retained_range(self, layer: int, position: int) -> tuple[int, int]:
        return self.layer(layer).retained_range(position)

    def windowed_layers(self) -> list[int]:
        return [s.index for s in self.layers if s.kind == LAYER_WINDOWED]

    def canonical(self) -> dict[str, Any]:
        return {
            "layers": [s.canonical() for s in self.layers],
            "vocab_size": self.vocab_size,
            "roles": list(self.roles),
            "token_axis": self.token_axis,
            "byte_order": self.byte_order,
            "row_order": "token-major; heads outer, head_dim inner",
            "logits": {"layer": self.logits_layer, "role": LOGITS_ROLE, "dtype": "f32", "elements": self.vocab_size},
        }


# --------------------------------------------------------------------------------------------
# identity


@dataclass(frozen=True)
class IdentityIds:
    """The eight Id32 an identity produces: SemanticModelId (5) then the family's three."""

    weights_config: bytes
    adapters: bytes
    tokenizer_template: bytes
    position_semantics: bytes
    qualified_math: bytes
    engine_cache_abi: bytes
    topology: bytes
    shard_map: bytes

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != 32:
                raise EngineError("identity", f"{name} must be 32 bytes")

    def semantic_model_id(self) -> tuple[bytes, bytes, bytes, bytes, bytes]:
        """The five Id32 in production-v1 order (INTEROP.md A.2)."""
        return (self.weights_config, self.adapters, self.tokenizer_template, self.position_semantics, self.qualified_math)

    def semantic_model_id_bytes(self) -> bytes:
        """The 160-byte SemanticModelId encoding."""
        return b"".join(self.semantic_model_id())

    def family_ids(self) -> tuple[bytes, bytes, bytes]:
        """(engine_cache_abi, topology, shard_map) for the KVFAM1 family."""
        return (self.engine_cache_abi, self.topology, self.shard_map)

    def encode(self) -> bytes:
        return self.semantic_model_id_bytes() + b"".join(self.family_ids())

    def digest(self) -> bytes:
        """One Id32 binding all eight (what a resident index would scope its keys by)."""
        return hashlib.sha256(ENGINE_DOMAIN + b"identity\0" + self.encode()).digest()


@dataclass(frozen=True)
class EngineIdentity:
    """Everything that decides the bits of a cache and of the logits computed from it.

    Field values are plain data (str/int/bool/float/None, lists and string-keyed dicts);
    floats are only ever hashed as their f64 bit patterns.
    """

    model_name: str
    weights_digest: str  # hex SHA-256 over the loaded tensors (names, dtypes, shapes, bytes)
    config: Mapping[str, Any]  # model config with volatile keys removed
    tokenizer_digest: str
    chat_template_digest: str
    context_policy: Mapping[str, Any]  # max context, prefill chunking, overflow rule
    adapter: Mapping[str, Any]  # fine-tuning adapter (LoRA ...) or {"name": "none"}
    weight_precision: str  # e.g. "gguf:MOSTLY_Q4_1->float32"
    engine_abi: Mapping[str, Any]  # torch/transformers versions, attention impl, cache class, device, threads
    scalars: Mapping[str, float]  # scalar-math constants, hashed as f64 bit patterns
    layout: CacheLayout
    rope: Mapping[str, Any] = field(default_factory=dict)  # non-scalar rope description (type, which layers)

    def __post_init__(self) -> None:
        for name, value in self.scalars.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise EngineError("identity", f"scalar {name!r} is not a number")
            if isinstance(value, float) and math.isnan(value):
                # NaN payloads are legal bit patterns, but a NaN constant is a model bug.
                raise EngineError("identity", f"scalar {name!r} is NaN")

    def components(self) -> dict[str, Any]:
        """The object hashed for each Id32, by component name (documented contract)."""
        scalars = {k: float(v) for k, v in self.scalars.items()}
        layer_positions = [
            {"kind": s.kind, "position": s.position, "window_tokens": s.window_tokens, "attention_window": s.attention_window} for s in self.layout.layers
        ]
        return {
            "weights-config": {
                "model_name": self.model_name,
                "weights_digest": self.weights_digest,
                "config": self.config,
                "weight_precision": self.weight_precision,
            },
            "adapters": {"adapter": self.adapter},
            "tokenizer-template": {
                "tokenizer_digest": self.tokenizer_digest,
                "chat_template_digest": self.chat_template_digest,
            },
            "position-semantics": {
                "context_policy": self.context_policy,
                "layers": layer_positions,
                "rope": self.rope,
            },
            "qualified-math": {
                "scalars": scalars,
                "engine_abi": self.engine_abi,
                "weight_precision": self.weight_precision,
                "dtypes": sorted({s.dtype for s in self.layout.layers}),
                "logits_dtype": "f32",
            },
            "engine-cache-abi": {
                "engine_abi": self.engine_abi,
                "roles": list(self.layout.roles),
                "token_axis": self.layout.token_axis,
                "byte_order": self.layout.byte_order,
                "row_order": "token-major; heads outer, head_dim inner",
            },
            "topology": self.layout.canonical(),
            # One process holds every layer and head: the single-shard map. A tensor- or
            # pipeline-parallel adapter must describe its split here.
            "shard-map": {"shards": 1, "tensor_parallel": 1, "pipeline_parallel": 1, "layers": [0, self.layout.num_layers]},
        }

    def ids(self) -> IdentityIds:
        c = self.components()
        return IdentityIds(
            weights_config=id32("weights-config", c["weights-config"]),
            adapters=id32("adapters", c["adapters"]),
            tokenizer_template=id32("tokenizer-template", c["tokenizer-template"]),
            position_semantics=id32("position-semantics", c["position-semantics"]),
            qualified_math=id32("qualified-math", c["qualified-math"]),
            engine_cache_abi=id32("engine-cache-abi", c["engine-cache-abi"]),
            topology=id32("topology", c["topology"]),
            shard_map=id32("shard-map", c["shard-map"]),
        )

    def semantic_model_id(self) -> tuple[bytes, bytes, bytes, bytes, bytes]:
        return self.ids().semantic_model_id()

    def semantic_model_id_bytes(self) -> bytes:
        return self.ids().semantic_model_id_bytes()

    def family_ids(self) -> tuple[bytes, bytes, bytes]:
        return self.ids().family_ids()

    def digest(self) -> bytes:
        return self.ids().digest()

    def replace(self, **changes: Any) -> "EngineIdentity":
        """A copy with some fields changed (identity tests, adapters deriving variants)."""
        import dataclasses

        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------
# session proofs (shared by every adapter, so digests compare across adapters and processes)


def state_digest(session: Any, layer: int, role: str) -> bytes:
    """SHA-256 of the rows a session retains for one state, in wire form."""
    lo, hi = session.retained_range(layer)
    return hashlib.sha256(session.export_rows(layer, role, lo, hi)).digest()


def cache_digest(session: Any) -> bytes:
    """SHA-256 over the position, every state digest in canonical order and the logits row:
    equal digests mean a restored cache is byte-identical to the saved one."""
    h = hashlib.sha256(b"kvpack/engine/v1/session-cache\0")
    h.update(session.position.to_bytes(8, "little"))
    for layer, role in session.layout.states():
        h.update(state_digest(session, layer, role))
    if session.last_logits is not None:
        h.update(hashlib.sha256(session.export_logits()).digest())
    return h.digest()


# --------------------------------------------------------------------------------------------
# the adapter contract as Protocols (docs/engine.md, "The contract in code")


@runtime_checkable
class Install(Protocol):
    """A detached cache being filled for the cut ``[0, cut)``; live only after ``commit``.

    Obtained from :meth:`Session.begin_install` (the *begin*), it is a context manager:
    leaving the ``with`` block without a successful ``commit`` aborts, so an exception
    anywhere in the fill can never leave a half-written cache behind::

        with session.begin_install(cut, tokens, identity) as install:
            for layer, role in layout.states():
                install.write_rows(layer, role, *install.required_range(layer)[:1], rows)
            install.commit(require_logits=False)

    ``write_rows`` takes token-major wire bytes for absolute rows (any order, any split,
    each row of :meth:`required_range` exactly once); ``commit`` refuses an incomplete fill
    and then swaps tokens, cache and logits in one step; ``abort`` drops the fill and leaves
    the live session untouched. ``state`` is ``"open"``, ``"committed"`` or ``"aborted"``.
    """

    cut: int
    state: str

    def required_range(self, layer: int) -> tuple[int, int]: ...
    def write_rows(self, layer: int, role: str, start: int, data: Any) -> None: ...
    def write_logits(self, data: Any) -> None: ...
    def missing(self) -> list[tuple[int, str, int]]: ...
    def commit(self, *, require_logits: bool = True) -> None: ...
    def abort(self) -> None: ...
    def __enter__(self) -> "Install": ...
    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None: ...


class InstallContext:
    """The context-manager half of :class:`Install` for adapters to inherit: ``__exit__``
    aborts an install that is still open (an exception, or a block left without commit)."""

    state: str

    def abort(self) -> None:  # pragma: no cover - every adapter overrides it
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if self.state == "open":
            self.abort()


@runtime_checkable
class Session(Protocol):
    """One live sequence of an engine: tokens, cache and the exact last-logits row.

    ``prefill`` forwards tokens in the engine's absolute-aligned chunks (``on_chunk`` runs
    after each chunk, while windowed layers still hold the window ending there);
    ``decode_greedy`` returns ``(tokens, logits rows)``; ``export_rows`` gives token-major
    wire bytes of retained rows; ``begin_install`` opens a detached :class:`Install`.
    ``last_logits`` is ``None`` after installing a prefix without its logits row.
    """

    engine: Any
    layout: CacheLayout
    tokens: list[int]
    last_logits: Any

    @property
    def position(self) -> int: ...
    def prefill(self, token_ids: Sequence[int], chunk_size: Optional[int] = None, on_chunk: Optional[Callable[[Any], None]] = None) -> None: ...
    def decode_greedy(self, n: int, stop_token_ids: Iterable[int] = ()) -> tuple[list[int], list[Any]]: ...
    def retained_range(self, layer: int) -> tuple[int, int]: ...
    def export_rows(self, layer: int, role: str, start: int, stop: int) -> memoryview: ...
    def export_logits(self) -> memoryview: ...
    def state_digest(self, layer: int, role: str) -> bytes: ...
    def cache_digest(self) -> bytes: ...
    def begin_install(self, cut: int, token_ids: Sequence[int], identity: "EngineIdentity | IdentityIds") -> Install: ...


@runtime_checkable
class Engine(Protocol):
    """A loaded model: its cache layout, exact identity, context bound and sessions.

    ``check_identity`` refuses (EngineError ``identity``) a claimed identity that differs in
    any Id32; ``ids()`` is the cached :class:`IdentityIds` of ``identity``.
    ``prefill_chunk_tokens`` is the absolute chunk grid of ``Session.prefill`` (it divides
    256, so every reusable cut is a chunk boundary).
    """

    layout: CacheLayout
    identity: EngineIdentity
    max_context: int
    prefill_chunk_tokens: int

    def ids(self) -> IdentityIds: ...
    def check_identity(self, expected: "EngineIdentity | IdentityIds") -> None: ...
    def new_session(self) -> Session: ...


@runtime_checkable
class TextEngine(Protocol):
    """Optional: an engine with a tokenizer (prompts as text, chat templates)."""

    tokenizer: Any

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: Sequence[int]) -> str: ...


@runtime_checkable
class SpanExport(Protocol):
    """Optional (sessions): export many ``(layer, role, start, stop)`` spans at once.

    Yields ``(view, release)`` per span in order, ``view`` equal to ``export_rows`` of the
    span; ``release`` (or ``None``) returns a pinned buffer once the consumer is done.
    The CUDA adapter runs its device-to-host copies ``depth`` spans ahead of the consumer.
    """

    def export_spans(
        self, requests: Iterable[tuple[int, str, int, int]], *, depth: int = 8
    ) -> Generator[tuple[memoryview, Optional[Callable[[], None]]], None, None]: ...


@runtime_checkable
class PlaneStaging(Protocol):
    """Optional (installs): host-to-device restore staging.

    ``stager(slots)`` gives per-chunk staging (pinned host slots, device buffers, a copy
    stream) and ``plane_stager()`` whole-plane staging; each returns ``None`` where it does
    not apply (a CPU install), so a capable install can still decline.
    """

    def stager(self, slots: int) -> Any: ...
    def plane_stager(self, *, force: bool = False) -> Any: ...


@runtime_checkable
class DeviceVerification(Protocol):
    """Optional (installs): verify restored chunks on the device (kvpack.engine.device_verify).

    ``wave_ring`` gives the staging ring the GPU SHA-256 runs on (``None`` when no kernel);
    ``write_row_blocks`` installs a wave's verified rows of one plane with one copy.
    """

    def wave_ring(self, *, wave_chunks: int, waves: int, force: bool = False, wave_bytes: int | None = None) -> Any: ...
    def write_row_blocks(self, layer: int, role: str, start: int, blocks: Any) -> None: ...


#: Where another process finds a shared plane arena: ``(arena id, path it opens, bytes)``
#: (the path is ``/proc/<pid>/fd/<fd>`` of a memfd; the id is unique within this process).
ArenaSpec = tuple[int, str, int]


@runtime_checkable
class SharedPlanes(Protocol):
    """Optional (installs): planes in shared memory that other processes write rows into
    (the host restore's reader processes, kvpack.engine.chunk_readers).

    ``share_planes()`` puts every plane of the install in one shared arena (only before any
    row is written; False, nothing changed, where it cannot); ``claim_shared_rows`` claims
    rows as ``claim_rows`` does and says where they lie in the arena (spec, byte offset);
    the claimed rows count as written only after ``rows_landed`` (their bytes verified).
    """

    def share_planes(self) -> bool: ...
    def claim_shared_rows(self, layer: int, role: str, start: int, n: int) -> tuple[ArenaSpec, int]: ...
    def rows_landed(self, layer: int, role: str, start: int, n: int) -> None: ...
