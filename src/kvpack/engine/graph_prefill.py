"""CUDA graphs for the lean prefill's full chunks (the adapter's ``prefill_forward="graphs"``).

The lean forward (kvpack.engine.lean_prefill) still launches ~40 kernels per layer, one by
one from Python, for every 256-token chunk. Everything between two attention calls has the
same shapes in every full chunk, so it can be captured once and replayed: a chunk becomes 33
*segments*, each one CUDA graph,

* segment 0: embeddings of the chunk's ids, rotary ``cos``/``sin`` of its positions, layer
  0 up to its cache update (input norm, q/k/v, rotary);
* segment ``l`` (1..L-1): layer ``l - 1`` after its attention (``o_proj``, residual, norm,
  MLP, residual) and layer ``l`` up to its cache update;
* segment ``L``: the last layer after its attention, the final norm and the last row's logits;

with the parts whose shapes or offsets move per chunk issued eagerly between replays: the
cache rows' copies (``PreallocatedLayer.update``: the offset moves) and the lower-right
attention over the prefix (the key count grows). ~L * 4 launches per chunk instead of ~L * 40.

Every segment calls the lean forward's own functions (``pre_attention``, ``post_attention``,
...), so eagerly (``capture=False``, what the CPU tests run) it is the lean forward split at
the attention calls, and on CUDA the graphs replay the kernels those calls launched while
being captured. The chunk's ids and positions are copied into static buffers first; the
attention writes its output into the static buffer the next segment reads. Partial chunks
(a prompt's tail, the first chunk after a decode) take the lean forward.

Bit-exactness is checked, not assumed: the same kernels run on the same values, but a GEMM
captured into a graph could in principle pick another cuBLAS kernel (the capture stream has
its own workspace), so tests/gpu/test_lean_prefill.py compares every plane with the model's
forward on the device.
"""

from __future__ import annotations

import threading
from typing import Any

from .lean_prefill import Plan, attend_chunks, check_rows, chunk_logits, embed_and_rotary, post_attention, pre_attention

#: The engine ABI's record of this path.
ABI_RECORD = "kvpack CUDA-graph segments of the lean Llama chunk forward (attention and cache copies eager)"

#: Rotary types whose forward has no data-dependent host logic (capturable).
STATIC_ROPE_TYPES = ("default", "linear", "llama3")


def unsupported_reason(model: Any) -> str | None:
    """Why full chunks cannot replay graphs (beyond the lean forward's own conditions)."""
    rope_type = str(getattr(model.model.rotary_emb, "rope_type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type}: its frequencies are updated on the host per forward"
    return None


def same_plan(a: Plan, b: Plan) -> bool:
    """Whether two plans read the very same tensors (graphs captured for ``a`` are valid
    for ``b``: they bind the tensors' memory, not their values)."""
    if a.model is not b.model or len(a.layers) != len(b.layers) or a.norm.weight is not b.norm.weight or a.lm_head[0] is not b.lm_head[0]:
        return False
    for x, y in zip(a.layers, b.layers):
        for field in ("q", "k", "v", "o", "gate", "up", "down"):
            if getattr(x, field)[0] is not getattr(y, field)[0] or getattr(x, field)[1] is not getattr(y, field)[1]:
                return False
        if x.input_norm.weight is not y.input_norm.weight or x.post_norm.weight is not y.post_norm.weight:
            return False
    return a.embed.__self__.weight is b.embed.__self__.weight


class SegmentedChunk:
    """A full chunk of ``chunk_tokens`` through the segments above, for one plan.

    ``capture=True`` (CUDA) captures every segment into a graph on first use; ``False`` runs
    the segments eagerly over the same static buffers (the CPU tests).

    One chunk at a time: the ids, positions and attention outputs are static buffers every
    session of the engine shares (a daemon prefills several sessions at once), so
    :meth:`forward` holds a lock from the first copy into them to the copy of the logits out,
    and on CUDA the next chunk's stream waits for the last one's work on those buffers (the
    calling threads may use different streams)."""

    def __init__(self, plan: Plan, chunk_tokens: int, device: Any, *, capture: bool, grid_tokens: int | None = None) -> None:
        import torch

        self.plan = plan
        self.n = chunk_tokens
        # the grid chunk: a runner of several grid chunks at once (the adapter's block
        # prefill) attends chunk by chunk and returns every chunk's last-row logits
        self.grid = grid_tokens or chunk_tokens
        self.capture = capture
        first = plan.layers[0]
        heads = first.q[0].shape[0] // first.head_dim
        dtype = first.q[0].dtype
        self.ids = torch.zeros((1, chunk_tokens), dtype=torch.long, device=device)
        self.positions = torch.zeros((1, chunk_tokens), dtype=torch.long, device=device)
        # the attention output of layer l, read by segment l + 1 (o_proj's input)
        self.attn_out = [torch.zeros((1, chunk_tokens, heads * layer.head_dim), dtype=dtype, device=device) for layer in plan.layers]
        self.outputs: list[Any] = [None] * (len(plan.layers) + 1)
        self.graphs: list[Any] | None = None
        self._lock = threading.Lock()
        self._released: Any = None  # CUDA event after the last chunk's reads of the buffers

    # -- the segments (each reads static buffers or earlier segments' outputs) -------------

    def _segment(self, index: int) -> Any:
        plan = self.plan
        last = len(plan.layers)
        if index == 0:
            hidden, cos, sin = embed_and_rotary(plan, self.ids, self.positions)
            return (hidden, cos, sin, *pre_attention(plan.layers[0], hidden, cos, sin))
        prev = self.outputs[index - 1]
        cos, sin = self.outputs[0][1], self.outputs[0][2]
        hidden = post_attention(plan.layers[index - 1], self.attn_out[index - 1], prev[0])
        if index == last:
            return tuple(chunk_logits(plan, hidden, self.grid))
        return (hidden, *pre_attention(plan.layers[index], hidden, cos, sin))

    def _run(self, index: int) -> tuple:
        if self.graphs is not None:
            self.graphs[index].replay()
        else:
            self.outputs[index] = self._segment(index)
        return self.outputs[index]

    def _capture_graphs(self) -> None:
        import torch

        # Warm up on a side stream (cuBLAS handles, lazy initialisation), as torch's graph
        # docs require, then capture in order into one pool: segment i + 1 reads segment
        # i's outputs, which stay alive, and the graphs replay in the order captured.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for index in range(len(self.outputs)):
                self.outputs[index] = self._segment(index)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        for index in range(len(self.outputs)):
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads of the process (a store's restore workers) may
            # make CUDA calls that the default "global" mode would turn into capture errors
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[index] = self._segment(index)
            graphs.append(graph)
        self.graphs = graphs

    # -- one chunk -------------------------------------------------------------------------

    def forward(self, cache_layers: list[Any], input_ids: Any, past: int) -> Any:
        """The lean forward of one full chunk (``input_ids`` ``(1, chunk_tokens)`` at
        positions ``[past, past + n)``); returns the last row's logits ``(1, 1, vocab)``
        (a fresh tensor: the graph's output buffer is overwritten by the next chunk)."""
        return self.forward_block(cache_layers, input_ids, past)[-1]

    def forward_block(self, cache_layers: list[Any], input_ids: Any, past: int) -> list[Any]:
        """:meth:`forward` returning the last row's logits of every grid chunk in the
        runner's ``chunk_tokens`` (one for a runner of one grid chunk), fresh tensors."""
        import warnings

        with self._lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # lower_right_attention silences the bias's kernel warnings
            if self._released is not None:
                import torch

                torch.cuda.current_stream().wait_event(self._released)
            logits = self._forward(cache_layers, input_ids, past)
            if self.capture:
                import torch

                self._released = torch.cuda.Event()
                self._released.record()
            return logits

    def _forward(self, cache_layers: list[Any], input_ids: Any, past: int) -> Any:
        import torch

        from ..errors import EngineError
        from .fast_prefill import attend_into, lower_right_bias

        n = self.n
        if input_ids.shape != (1, n):
            raise EngineError("layout", f"a graph chunk takes (1, {n}) ids, got {tuple(input_ids.shape)}")
        check_rows(cache_layers, past)
        if self.capture and self.graphs is None:
            self._capture_graphs()
        self.ids.copy_(input_ids)
        self.positions.copy_((torch.arange(n, device=input_ids.device) + past).unsqueeze(0))
        kv_len = past + n
        bias = lower_right_bias(n, kv_len)
        outputs = self._run(0)
        for index, (layer, cache_layer) in enumerate(zip(self.plan.layers, cache_layers)):
            query, key, value = outputs[-3:]
            key, value = cache_layer.update(key, value)
            out = self.attn_out[index].view(1, n, query.shape[1], layer.head_dim)
            if self.grid >= n:
                attend_into(out, query, key, value, layer.scaling, bias)
            else:
                attend_chunks(out, query, key, value, layer.scaling, past, self.grid)
            outputs = self._run(index + 1)
        return [logits.clone() for logits in outputs]


__all__ = ["ABI_RECORD", "STATIC_ROPE_TYPES", "SegmentedChunk", "same_plan", "unsupported_reason"]
