"""A chunked prefill that costs about one forward: preallocated cache rows and lower-right
causal attention over the cached prefix (the transformers adapter's ``prefill_attention``).

The adapter prefills in absolute 256-token chunks (the bit-exactness contract, see
docs/engine.md). With transformers' ``DynamicCache`` and ``sdpa`` every chunk is slow twice
over: the cache grows by concatenation (each chunk copies every row so far), and a chunk's
queries need a mask over the prefix, which rules out the flash kernel, so ``sdpa`` repeats
the grouped key/value heads and runs a masked kernel. Here instead:

* :class:`PreallocatedLayer` (a ``DynamicLayer``) keeps its rows in a buffer with room to
  grow (reserved for the whole prompt before a prefill, grown geometrically by decode); a
  chunk's rows are copied in place and the layer hands out views of the rows so far;
* :func:`lower_right_attention` (registered with transformers as :data:`ATTENTION`) asks
  ``scaled_dot_product_attention`` for the lower-right causal pattern
  (``torch.nn.attention.bias.causal_lower_right``): query ``i`` of a chunk of ``q`` rows
  attends to key rows ``[0, kv - q + i]``. On CUDA in f16/bf16 that is the flash kernel with
  grouped heads natively; elsewhere the grouped heads are expanded and the mask is applied
  by whichever kernel takes it.

Same values in, same kernel, same order: a restored session (its planes installed as plain
tensors) and a live one (views of a larger buffer) compute the same bits, which the tests
check (restore + continue == uninterrupted prefill). The choice is part of the engine's
identity (the adapter records it in the engine ABI). This module never decides *where* a
chunk ends: the adapter's absolute chunk grid does.
"""

from __future__ import annotations

import warnings
from typing import Any

#: Name the attention function is registered under with transformers.
ATTENTION = "kvpack_lower_right"
#: Rows a decode-grown buffer gains at least (and a reservation is rounded up to).
GROW_ROWS = 256

_registered: list[bool] = []


def register() -> None:
    """Register :func:`lower_right_attention` with transformers (idempotent). A name that
    has no mask function makes transformers pass ``attention_mask=None``."""
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION, lower_right_attention)
        _registered.append(True)


def unsupported_reason(model: Any) -> str | None:
    """``None`` if the model can prefill this way, else why not: every layer must attend to
    the whole prefix (sliding windows keep their own mask) with ``sdpa`` semantics."""
    cfg = model.config
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"layer types {sorted(kinds)}: only full-attention models"
    if getattr(cfg, "sliding_window", None):
        return "a sliding window is configured"
    impl = str(getattr(cfg, "_attn_implementation", None))
    if impl not in ("sdpa", ATTENTION):
        return f"attention implementation {impl}: only sdpa"
    return None


def lower_right_attention(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any
):
    """transformers attention interface: ``query`` (1, heads, q, d) over ``key``/``value``
    (1, kv_heads, kv, d), causal aligned to the last key row. Returns (1, q, heads, d)."""
    if attention_mask is not None:
        raise RuntimeError("kvpack lower-right attention takes no mask (batch 1, no padding)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bias reports every kernel it could not use
        return attend(query, key, value, scaling, lower_right_bias(query.shape[2], key.shape[2])), None


def lower_right_bias(q_len: int, kv_len: int) -> Any:
    """The mask argument :func:`attend` takes for ``q_len`` queries over ``kv_len`` keys:
    ``None`` for one query (decode: it sees every cached row), else the lower-right causal
    bias. The lean prefill (kvpack.engine.lean_prefill) makes it once per chunk."""
    if q_len == 1:
        return None
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(q_len, kv_len)


def _attend(query: Any, key: Any, value: Any, scaling: float | None, bias: Any) -> Any:
    """The attention of :func:`attend`, returned as the kernel's output transposed to
    (1, q, heads, d) (not yet contiguous)."""
    import torch
    import torch.nn.functional as F

    groups = query.shape[1] // key.shape[1]
    native_gqa = query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16)
    if groups > 1 and not native_gqa:  # only the flash kernel takes grouped heads with this mask
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    gqa = groups > 1 and native_gqa
    if bias is None:
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, scale=scaling, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=0.0, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2)


def attend(query: Any, key: Any, value: Any, scaling: float | None, bias: Any) -> Any:
    """:func:`lower_right_attention`'s computation with the bias given (callers silence the
    bias's kernel warnings). Returns (1, q, heads, d), contiguous."""
    return _attend(query, key, value, scaling, bias).contiguous()


def attend_into(out: Any, query: Any, key: Any, value: Any, scaling: float | None, bias: Any) -> None:
    """:func:`attend` writing into ``out`` (1, q, heads, d), contiguous: the same copy as
    ``contiguous()``, into a buffer that stays put (kvpack.engine.graph_prefill)."""
    out.copy_(_attend(query, key, value, scaling, bias))


def _dynamic_layer() -> type:
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


class _PreallocatedBase:
    """Mixin body of :class:`PreallocatedLayer` (kept apart so that importing this module
    does not import transformers)."""

    keys: Any
    values: Any
    is_initialized: bool

    def _setup(self) -> None:
        self._kbuf: Any = None
        self._vbuf: Any = None
        self._rows = 0
        self._written = 0  # rows written from 0 (a block prefill writes ahead of ``_rows``)
        self._reserved = 0

    def reserve(self, rows: int) -> None:
        """Room for at least ``rows`` rows before the next update (a prefill reserves the
        whole prompt, so its chunks never reallocate)."""
        self._reserved = max(self._reserved, -(-rows // GROW_ROWS) * GROW_ROWS)

    def _ensure(self, rows: int, like: Any) -> None:
        import torch

        cap = 0 if self._kbuf is None else self._kbuf.shape[-2]
        if rows <= cap:
            return
        new_cap = max(rows, self._reserved, cap + max(GROW_ROWS, cap // 4))
        shape = (like.shape[0], like.shape[1], new_cap, like.shape[3])
        kbuf = torch.empty(shape, dtype=like.dtype, device=like.device)
        vbuf = torch.empty(shape, dtype=like.dtype, device=like.device)
        if self._rows:
            kbuf[:, :, : self._rows].copy_(self._kbuf[:, :, : self._rows])
            vbuf[:, :, : self._rows].copy_(self._vbuf[:, :, : self._rows])
        self._kbuf, self._vbuf = kbuf, vbuf
        self._written = self._rows  # rows written ahead of ``_rows`` were not copied

    def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self._rows, key_states.shape[-2]
        self._ensure(n + m, key_states)
        self._kbuf[:, :, n : n + m].copy_(key_states)
        self._vbuf[:, :, n : n + m].copy_(value_states)
        self._rows = self._written = n + m
        self.keys = self._kbuf[:, :, : self._rows]
        self.values = self._vbuf[:, :, : self._rows]
        return self.keys, self.values

    def show(self, rows: int) -> None:
        """Make the first ``rows`` written rows this layer's rows: a block prefill writes
        several chunks' rows at once, then shows each chunk's cut in turn. Rows past it stay
        written, unseen, until shown again or overwritten by the next update."""
        if not 0 <= rows <= self._written:
            from ..errors import EngineError

            raise EngineError("layout", f"cannot show {rows} rows: {self._written} written")
        self._rows = rows
        if self._kbuf is not None:
            self.keys = self._kbuf[:, :, :rows]
            self.values = self._vbuf[:, :, :rows]

    def adopt(self, keys: Any, values: Any) -> None:
        """Take installed planes (1, kv_heads, rows, d) as this layer's rows (no copy; the
        first later update grows them)."""
        self.lazy_initialization(keys, values)
        self._kbuf, self._vbuf, self._rows = keys, values, keys.shape[-2]
        self._written = self._rows
        self.keys, self.values = keys, values

    def get_seq_length(self, *args: Any) -> int:
        return self._rows if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvpack sessions never crop a cache")


_layer_class: list[type] = []


def preallocated_layer_class() -> type:
    """``PreallocatedLayer``: a transformers ``DynamicLayer`` with preallocated rows."""
    if not _layer_class:
        base = _dynamic_layer()

        class PreallocatedLayer(_PreallocatedBase, base):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                super().__init__()
                self._setup()

        _layer_class.append(PreallocatedLayer)
    return _layer_class[0]


__all__ = [
    "ATTENTION",
    "GROW_ROWS",
    "attend",
    "attend_into",
    "lower_right_attention",
    "lower_right_bias",
    "preallocated_layer_class",
    "register",
    "unsupported_reason",
]
