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
    def staging(self, block_ids: Sequence[int], start: int, stop: int) -> "BlockStaging":
        """An empty :class:`BlockStaging` for rows ``[start, stop)`` of every layer."""
        return BlockStaging(self, block_ids, start, stop)

    def scatter(self, layer: int, block_ids: Sequence[int], start: int, kv_rows) -> None:
        """Write ``kv_rows`` (``[2, n, heads*head_dim]``: K then V, token-major) to rows
        ``[start, start+n)`` of layer ``layer``. ``start`` must be block-aligned; a last
        partial block is written only up to the range's end. (The same code as a staged
        load: one :class:`BlockStaging` of this layer, committed at once.)"""
        g = self.geometry
        n = int(kv_rows.shape[1])
        if tuple(kv_rows.shape) != (2, n, g.row_elements) or kv_rows.dtype != self.torch_dtype:
            raise EngineError("layout", f"rows of shape {tuple(kv_rows.shape)} / {kv_rows.dtype} do not fit layer {layer}")
        staged = BlockStaging(self, block_ids, start, start + n, layers=(layer,))
        staged.write(layer, 0, start, kv_rows[0])
        staged.write(layer, 1, start, kv_rows[1])
        staged.commit(layer)


class BlockStaging:
    """Rows ``[start, stop)`` of some layers, held in vLLM's own block interior (K
    transposed, V token-major) outside the cache until :meth:`commit` copies whole blocks in.

    A verified load writes each chunk's rows here as it is verified (the transposing copy
    happens then, beside the hashing threads), and the commit -- after the whole load
    verified -- is one block copy per layer plus the slots ``[0, stop mod block_size)`` of a
    last partial block: the cache is touched only by the commit, only in the blocks of the
    caller's table, never beyond ``stop``. ``start`` must be block-aligned."""

    def __init__(self, paged: PagedKV, block_ids: Sequence[int], start: int, stop: int, layers: Sequence[int] | None = None) -> None:
        g = paged.geometry
        if start % g.block_size:
            raise EngineError("layout", f"a scatter must start on a block boundary (row {start})")
        self.paged, self.start, self.stop = paged, start, stop
        self.ids, _b0 = paged._block_index(block_ids, start, stop)  # checks the range and the table
        torch = paged._torch
        nblk, H, D, bs = len(self.ids), g.kv_heads, g.head_dim, g.block_size
        self.layers = tuple(range(g.num_layers)) if layers is None else tuple(layers)
        self._blocks = {layer: torch.empty((nblk, H, 2, bs * D), dtype=paged.torch_dtype) for layer in self.layers}
        # per layer: the K halves as [nblk, H, D, bs] and the V halves as [nblk, H, bs, D] (views)
        self._views = {layer: (t.view(nblk, H, 2, D, bs)[:, :, 0], t.view(nblk, H, 2, bs, D)[:, :, 1]) for layer, t in self._blocks.items()}

    def write(self, layer: int, role: int, row: int, rows: Any) -> None:
        """Stage ``rows`` (``[n, heads*head_dim]``, token-major, the cache's dtype) of plane
        ``role`` (0: K, 1: V) at rows ``[row, row+n)``, which must lie inside ``[start, stop)``."""
        g = self.paged.geometry
        H, D, bs = g.kv_heads, g.head_dim, g.block_size
        n = int(rows.shape[0])
        if tuple(rows.shape) != (n, g.row_elements) or rows.dtype != self.paged.torch_dtype or role not in (0, 1) or n == 0:
            raise EngineError("layout", f"rows of shape {tuple(rows.shape)} / {rows.dtype} do not fit layer {layer}")
        if layer not in self._views or not self.start <= row < row + n <= self.stop:
            raise EngineError("layout", f"rows [{row}, {row + n}) of layer {layer} fall outside the staged [{self.start}, {self.stop})")
        blocks = self._views[layer][role]
        src = rows.view(n, H, D)
        r0 = row - self.start
        for j in range(r0 // bs, (r0 + n - 1) // bs + 1):
            t0, t1 = max(r0, j * bs), min(r0 + n, (j + 1) * bs)
            part = src[t0 - r0 : t1 - r0]  # [m, H, D]
            s0, s1 = t0 - j * bs, t1 - j * bs
            if role == 0:
                blocks[j, :, :, s0:s1] = part.permute(1, 2, 0)  # K transposed: [H, D, m]
            else:
                blocks[j, :, s0:s1] = part.permute(1, 0, 2)  # V: [H, m, D]

    def commit(self, layer: int) -> None:
        """Copy layer ``layer``'s staged rows into the cache (whole blocks, then the slots
        ``[0, tail)`` of a last partial block)."""
        g = self.paged.geometry
        H, D, bs = g.kv_heads, g.head_dim, g.block_size
        staged = self._blocks.pop(layer)
        self._views.pop(layer, None)
        plane = self.paged.planes[layer]
        n = self.stop - self.start
        full = n // bs
        if full:
            plane.index_copy_(0, self.ids[:full], staged[:full])
        tail = n - full * bs
        if tail:
            region = plane[int(self.ids[full])]  # [H, 2, bs*D], a view into the cache
            region[:, 0].view(H, D, bs)[:, :, :tail] = staged[full, :, 0].view(H, D, bs)[:, :, :tail]
            region[:, 1].view(H, bs, D)[:, :tail] = staged[full, :, 1].view(H, bs, D)[:, :tail]

    def discard(self) -> None:
        self._blocks.clear()
        self._views.clear()
