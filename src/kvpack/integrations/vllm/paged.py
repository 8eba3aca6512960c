"""vLLM's paged CPU KV cache, read and written as kvpack's token-major planes.

vLLM (CPU attention backend ``CPU_ATTN``, in-block ISA ``vec``/``vec16``) hands a connector one
tensor per attention layer, ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, all views
into one buffer. The attention kernels split each (block, head) region in two halves of
``block_size * head_dim`` elements: the first holds K **transposed**, ``[head_dim,
block_size]`` (element ``d * block_size + t``: the kernel reads K a dimension at a time), the
second holds V token-major, ``[block_size, head_dim]`` (``cpu_attn_reshape_and_cache``;
:func:`kvpack.integrations.vllm.worker.check_block_layout` proves this against the kernel at
start-up and the connector refuses to run where it does not hold).

kvpack exchanges a state ``(layer, role)`` as token-major rows: row ``t`` holds the
``kv_heads * head_dim`` elements of token ``t``, heads outer (docs/engine.md). This module
converts between the two with one gather and one transposing copy per plane (``index_select``
over the block table, ``permute``), never a Python loop over tokens, and it checks every
geometry fact it relies on before touching a byte: a tensor that is not exactly this shape
is refused (``EngineError("layout")``), never reinterpreted.

It must never write into a block that is not named by the caller's block table, and never
write a slot of a partial block beyond the caller's row range.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import EngineError

#: the layer-name pattern of decoder-only models in vLLM (``model.layers.{i}.self_attn.attn``)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")

_TORCH_TO_WIRE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}

#: the in-block layout this module reads and writes (bound into the engine identity)
BLOCK_INTERIOR = "per (block, head): K as [head_dim, block_size] (transposed), then V as [block_size, head_dim]"


def layer_order(names: Sequence[str]) -> list[str]:
    """Layer names sorted by their layer index; refuses names without one or duplicates."""
    indexed = []
    for name in names:
        m = _LAYER_INDEX.search(name)
        if m is None:
            raise EngineError("layout", f"KV cache layer {name!r} has no layer index")
        indexed.append((int(m.group(1)), name))
    indexed.sort()
    if [i for i, _ in indexed] != list(range(len(indexed))):
        raise EngineError("layout", f"KV cache layers are not 0..{len(indexed) - 1}: {[i for i, _ in indexed]}")
    return [name for _, name in indexed]


@dataclass(frozen=True)
class PagedGeometry:
    """What the connector relies on about vLLM's KV tensors."""

    num_layers: int
    num_blocks: int
    kv_heads: int
    block_size: int
    head_dim: int
    dtype: str  # "f32" | "f16" | "bf16"

    @property
    def row_elements(self) -> int:
        return self.kv_heads * self.head_dim

    def canonical(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "kv_heads": self.kv_heads,
            "block_size": self.block_size,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_interior": BLOCK_INTERIOR,
        }


class PagedKV:
    """The registered layer tensors, in layer order, as ``[blocks, heads, 2, block_size, head_dim]``."""

    def __init__(self, kv_caches: Mapping[str, Any]) -> None:
        import torch

        names = layer_order(list(kv_caches))
        shapes = {tuple(kv_caches[n].shape) for n in names}
        dtypes = {kv_caches[n].dtype for n in names}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise EngineError("layout", f"KV cache layers differ in shape or dtype: {sorted(shapes)} {sorted(map(str, dtypes))}")
        shape = shapes.pop()
        dtype = dtypes.pop()
        if len(shape) != 4 or shape[3] % 2:
            raise EngineError("layout", f"KV cache layer shape {shape} is not [blocks, heads, block_size, 2*head_dim]")
        name = str(dtype).replace("torch.", "")
        if name not in _TORCH_TO_WIRE:
            raise EngineError("unsupported", f"KV cache dtype {name} has no production-v1 wire value (fp8 caches are not supported)")
        num_blocks, heads, block_size, two_d = shape
        self.geometry = PagedGeometry(len(names), num_blocks, heads, block_size, two_d // 2, _TORCH_TO_WIRE[name])
        self.names = names
        self.torch_dtype = dtype
        self.planes = []
        for n in names:
            t = kv_caches[n]
            if t.device.type != "cpu":
                raise EngineError("unsupported", f"KV cache layer {n} is on {t.device}, this connector handles CPU caches")
            if not t.is_contiguous():
                raise EngineError("layout", f"KV cache layer {n} is not contiguous")
            # per (block, head): the K half and the V half, block_size * head_dim elements each
            self.planes.append(t.view(num_blocks, heads, 2, block_size * (two_d // 2)))
        self._torch = torch

    # -- reading ------------------------------------------------------------------------------
    def _block_index(self, block_ids: Sequence[int], start: int, stop: int):
        g = self.geometry
        if not 0 <= start < stop:
            raise EngineError("layout", f"empty or negative row range [{start}, {stop})")
        b0, b1 = start // g.block_size, -(-stop // g.block_size)
        if b1 > len(block_ids):
            raise EngineError("layout", f"rows [{start}, {stop}) need {b1} blocks, the block table has {len(block_ids)}")
        ids = self._torch.as_tensor(list(block_ids[b0:b1]), dtype=self._torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= g.num_blocks:
            raise EngineError("layout", "block table names a block outside the KV cache")
        return ids, b0

    def gather(self, layer: int, block_ids: Sequence[int], start: int, stop: int):
        """Rows ``[start, stop)`` of layer ``layer`` as a contiguous ``[2, stop-start, heads*head_dim]``
        tensor (K plane, V plane), token-major: one gather and one transposing copy."""
        g = self.geometry
        ids, b0 = self._block_index(block_ids, start, stop)
        n, H, D, bs = len(ids), g.kv_heads, g.head_dim, g.block_size
        blocks = self.planes[layer].index_select(0, ids)  # [n, H, 2, bs*D]
        rows = self._torch.empty((2, n, bs, H, D), dtype=blocks.dtype)
        rows[0] = blocks[:, :, 0].view(n, H, D, bs).permute(0, 3, 1, 2)  # K^T -> token-major
        rows[1] = blocks[:, :, 1].view(n, H, bs, D).permute(0, 2, 1, 3)
        lo = start - b0 * bs
        return rows.view(2, n * bs, H * D)[:, lo : lo + (stop - start)].contiguous()

    # -- writing ------------------------------------------------------------------------------
    def scatter(self, layer: int, block_ids: Sequence[int], start: int, kv_rows) -> None:
        """Write ``kv_rows`` (``[2, n, heads*head_dim]``: K then V, token-major) to rows
        ``[start, start+n)`` of layer ``layer``. ``start`` must be block-aligned; a last
        partial block is written only up to the range's end."""
        g = self.geometry
        n = int(kv_rows.shape[1])
        if tuple(kv_rows.shape) != (2, n, g.row_elements) or kv_rows.dtype != self.torch_dtype:
            raise EngineError("layout", f"rows of shape {tuple(kv_rows.shape)} / {kv_rows.dtype} do not fit layer {layer}")
        if start % g.block_size:
            raise EngineError("layout", f"a scatter must start on a block boundary (row {start})")
        ids, _b0 = self._block_index(block_ids, start, start + n)
        H, D, bs = g.kv_heads, g.head_dim, g.block_size
        plane = self.planes[layer]
        full = n // bs
        src = kv_rows.view(2, n, H, D)
        if full:
            whole = src[:, : full * bs].reshape(2, full, bs, H, D)
            blocks = self._torch.empty((full, H, 2, bs * D), dtype=kv_rows.dtype)
            blocks[:, :, 0].view(full, H, D, bs).copy_(whole[0].permute(0, 2, 3, 1))  # K transposed
            blocks[:, :, 1].view(full, H, bs, D).copy_(whole[1].permute(0, 2, 1, 3))
            plane[ids[:full]] = blocks
        tail = n - full * bs
        if tail:
            part = src[:, full * bs :]  # [2, tail, H, D]; only the slots [0, tail) are written
            region = plane[int(ids[full])]  # [H, 2, bs*D], a view into the cache
            region[:, 0].view(H, D, bs)[:, :, :tail] = part[0].permute(1, 2, 0)
            region[:, 1].view(H, bs, D)[:, :tail] = part[1].permute(1, 0, 2)
