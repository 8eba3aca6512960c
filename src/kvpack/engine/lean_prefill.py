"""A lean per-chunk prefill forward for the Llama family: the same torch ops as transformers'
``LlamaForCausalLM`` forward, without its per-call plumbing (the adapter's ``prefill_forward``).

On the H200 the adapter's 256-token chunked prefill was bound by the host: issuing one chunk
(Python plus kernel launches) took ~31 ms against ~11.5 ms of GPU work (docs/benchmarks.md).
Part of that is transformers' generic machinery, paid per chunk and per layer: the output
capturing and config-default decorators, the mask builder, ``nn.Module.__call__`` around every
norm, projection and activation (hook checks, kwargs), the gradient-checkpointing layer wrapper,
the attention-interface lookup, ``DynamicCache.update`` indirection and the output records.
:func:`forward_chunk` runs one chunk as straight-line code instead:

* embedding, positions ``arange(n) + past`` and the rotary ``cos``/``sin`` through the model's own
  modules' ``forward`` (so any RoPE variant the module implements is computed the same way);
* per layer: ``input_layernorm.forward``, the q/k/v projections as three separate
  ``F.linear`` calls (exactly ``nn.Linear.forward``), transformers' own
  ``apply_rotary_pos_emb``, the cache layer's ``update`` (kvpack.engine.fast_prefill's
  preallocated rows), the registered lower-right attention, ``o_proj``, the residual add,
  ``post_attention_layernorm.forward``, ``down(act(gate(x)) * up(x))``, the residual add;
* the final norm over every row (a norm over the last row alone could reduce differently on
  a device), then ``lm_head`` on the last row only, as ``logits_to_keep=1`` does.

Same ops, same operands, same order, same dtypes: the bits equal the model's own forward, which
the tests check plane by plane (tests/gpu/test_lean_prefill.py, on the CPU and on CUDA). What
cannot be mirrored is refused (:func:`unsupported_reason`), and the adapter then keeps the
model's forward. Decode (one token per forward) keeps the model's forward.
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: The engine ABI's record of this path (absent from the ABI when the model's forward runs).
ABI_RECORD = "kvpack lean Llama chunk forward: transformers modeling_llama ops, same order and dtypes"


def _llama_classes() -> dict[str, type]:
    from transformers.models.llama import modeling_llama as ml

    return {
        "causal_lm": ml.LlamaForCausalLM,
        "model": ml.LlamaModel,
        "layer": ml.LlamaDecoderLayer,
        "attention": ml.LlamaAttention,
        "mlp": ml.LlamaMLP,
        "norm": ml.LlamaRMSNorm,
        "rotary": ml.LlamaRotaryEmbedding,
    }


def _exactly(obj: Any, cls: type) -> bool:
    """``type(obj) is cls`` (a subclass may override any step), without narrowing ``obj``."""
    return type(obj) is cls


def _has_hooks(module: Any) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or getattr(module, "_forward_hooks_with_kwargs", None))


def unsupported_reason(model: Any, prefill_attention: str) -> str | None:
    """``None`` if :func:`forward_chunk` computes exactly what ``model`` computes, else why not.

    The classes must be exactly transformers' Llama classes (a subclass may override any
    step), the prefill must use kvpack's lower-right attention over preallocated rows, no
    forward hooks may be registered (the lean path would skip them), and the model must not
    be kernelized (hub kernels replace module forwards)."""
    import torch

    if prefill_attention != "lower_right":
        return f"prefill_attention {prefill_attention}: the lean forward runs kvpack's lower-right attention only"
    cls = _llama_classes()
    if not _exactly(model, cls["causal_lm"]):
        return f"model class {type(model).__name__}: only LlamaForCausalLM"
    base = model.model
    if not _exactly(base, cls["model"]) or not _exactly(base.norm, cls["norm"]) or not _exactly(base.rotary_emb, cls["rotary"]):
        return "the base model is not transformers' LlamaModel with its own norm and rotary embedding"
    if getattr(model, "_use_kernels", False) or getattr(model, "use_kernels", False):
        return "the model is kernelized (hub kernels replace module forwards)"
    if model.training:
        return "the model is in training mode"
    if len(base.layers) != int(model.config.num_hidden_layers):
        return "the layer list and num_hidden_layers disagree"
    for i, layer in enumerate(base.layers):
        parts = (
            (layer, "layer"),
            (layer.self_attn, "attention"),
            (layer.mlp, "mlp"),
            (layer.input_layernorm, "norm"),
            (layer.post_attention_layernorm, "norm"),
        )
        for module, kind in parts:
            if not _exactly(module, cls[kind]):
                return f"layer {i}: {type(module).__name__} is not transformers' {cls[kind].__name__}"
        for proj in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
        ):
            if not _exactly(proj, torch.nn.Linear):
                return f"layer {i}: projection {type(proj).__name__} is not torch.nn.Linear"
    if not _exactly(model.lm_head, torch.nn.Linear):
        return f"lm_head {type(model.lm_head).__name__} is not torch.nn.Linear"
    for name, module in model.named_modules():
        # kernelize() (hub kernels) and other patching replace a module's forward on the
        # instance; the lean forward computes the class's ops and would not match
        if "forward" in vars(module):
            return f"module {name or type(model).__name__} has a replaced forward"
    return hooks_reason(model)


def hooks_reason(model: Any) -> str | None:
    """Why the lean forward cannot run now because of hooks (checked before every prefill:
    hooks can be added after the engine is built), or ``None``."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return "global module forward hooks are registered"
    for name, module in model.named_modules():
        if _has_hooks(module):
            return f"module {name or type(model).__name__} has forward hooks"
    return None


class _Norm(NamedTuple):
    weight: Any
    eps: float


class _Layer(NamedTuple):
    """One decoder layer's tensors and constants, read once per prefill (``nn.Module``
    attribute lookups cost more than the ops around them at this size)."""

    input_norm: _Norm
    q: tuple[Any, Any]
    k: tuple[Any, Any]
    v: tuple[Any, Any]
    o: tuple[Any, Any]
    post_norm: _Norm
    gate: tuple[Any, Any]
    up: tuple[Any, Any]
    down: tuple[Any, Any]
    act: Any
    head_dim: int
    scaling: float


class Plan(NamedTuple):
    """What :func:`forward_chunk` reads from the model, gathered by :func:`plan`."""

    model: Any
    embed: Any
    rotary: Any
    layers: tuple[_Layer, ...]
    norm: _Norm
    lm_head: tuple[Any, Any]


def _linear(module: Any) -> tuple[Any, Any]:
    return module.weight, module.bias


def _norm(module: Any) -> _Norm:
    return _Norm(module.weight, module.variance_epsilon)


def plan(model: Any) -> Plan:
    """The model's tensors and constants for :func:`forward_chunk` (gathered per prefill, so
    a model whose parameters are replaced between prefills is read afresh)."""
    base = model.model
    layers = []
    for decoder in base.layers:
        attn, mlp = decoder.self_attn, decoder.mlp
        layers.append(
            _Layer(
                input_norm=_norm(decoder.input_layernorm),
                q=_linear(attn.q_proj),
                k=_linear(attn.k_proj),
                v=_linear(attn.v_proj),
                o=_linear(attn.o_proj),
                post_norm=_norm(decoder.post_attention_layernorm),
                gate=_linear(mlp.gate_proj),
                up=_linear(mlp.up_proj),
                down=_linear(mlp.down_proj),
                act=mlp.act_fn.forward,
                head_dim=int(attn.head_dim),
                scaling=attn.scaling,
            )
        )
    return Plan(model, base.embed_tokens.forward, base.rotary_emb.forward, tuple(layers), _norm(base.norm), _linear(model.lm_head))


def forward_chunk(plan: Plan, cache_layers: list[Any], input_ids: Any, past: int) -> Any:
    """One prefill chunk: ``input_ids`` ``(1, n)`` at absolute positions ``[past, past + n)``;
    ``cache_layers`` are the cache's layers (``update`` appends K/V rows and returns the rows
    so far). Returns the logits of the last row, shape ``(1, 1, vocab)``, as
    ``model(..., logits_to_keep=1).logits``.

    Every line mirrors transformers 5.x ``modeling_llama`` (named in the comments) with the
    registered lower-right attention (kvpack.engine.fast_prefill) for the attention call; the
    tests hold it to the model's forward bit for bit."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lower_right_attention silences the bias's kernel warnings
        return _forward_chunk(plan, cache_layers, input_ids, past)


def rms_norm(hidden: Any, norm: _Norm) -> Any:
    """LlamaRMSNorm.forward."""
    import torch

    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.eps)
    return norm.weight * hidden.to(input_dtype)


def embed_and_rotary(plan: Plan, input_ids: Any, position_ids: Any) -> tuple[Any, Any, Any]:
    """LlamaModel.forward's start: the embeddings and the rotary ``cos``/``sin`` for
    ``position_ids`` (``arange(n) + past_seen_tokens``), unsqueezed as
    ``apply_rotary_pos_emb(unsqueeze_dim=1)`` does (the same views serve every layer)."""
    hidden = plan.embed(input_ids)
    cos, sin = plan.rotary(hidden, position_ids)
    return hidden, cos.unsqueeze(1), sin.unsqueeze(1)


def pre_attention(layer: _Layer, hidden: Any, cos: Any, sin: Any) -> tuple[Any, Any, Any]:
    """LlamaDecoderLayer.forward up to the cache update: input norm, q/k/v projections as
    three ``F.linear`` calls, ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``).
    Returns ``(query, key, value)``, each ``(1, heads, n, head_dim)``."""
    import torch
    import torch.nn.functional as F

    hidden = rms_norm(hidden, layer.input_norm)
    hidden_shape = (*hidden.shape[:-1], -1, layer.head_dim)
    query = F.linear(hidden, *layer.q).view(hidden_shape).transpose(1, 2)
    key = F.linear(hidden, *layer.k).view(hidden_shape).transpose(1, 2)
    value = F.linear(hidden, *layer.v).view(hidden_shape).transpose(1, 2)
    half = layer.head_dim // 2
    query = (query * cos) + (torch.cat((-query[..., half:], query[..., :half]), dim=-1) * sin)
    key = (key * cos) + (torch.cat((-key[..., half:], key[..., :half]), dim=-1) * sin)
    return query, key, value


def post_attention(layer: _Layer, attn_out: Any, residual: Any) -> Any:
    """LlamaDecoderLayer.forward after the attention: ``o_proj`` of the attention output
    ``(1, n, heads * head_dim)``, the residual add, the post-attention norm, the MLP
    ``down(act(gate(x)) * up(x))`` and the second residual add."""
    import torch.nn.functional as F

    hidden = F.linear(attn_out, *layer.o)
    hidden = residual + hidden
    residual = hidden
    hidden = rms_norm(hidden, layer.post_norm)
    hidden = F.linear(layer.act(F.linear(hidden, *layer.gate)) * F.linear(hidden, *layer.up), *layer.down)
    return residual + hidden


def final_logits(plan: Plan, hidden: Any) -> Any:
    """The final norm over every row, then ``lm_head`` on the last row only
    (``LlamaForCausalLM.forward`` with ``logits_to_keep=1``: ``slice(-1, None)``)."""
    import torch.nn.functional as F

    hidden = rms_norm(hidden, plan.norm)
    return F.linear(hidden[:, slice(-1, None), :], *plan.lm_head)


def check_rows(cache_layers: list[Any], past: int) -> None:
    """Every cache layer holds ``past`` rows before a chunk at ``past`` (the chunk's attention
    bias is made for ``past + n`` keys); refused before anything is computed otherwise."""
    from ..errors import EngineError

    for index, cache_layer in enumerate(cache_layers):
        rows = cache_layer.get_seq_length()
        if rows != past:
            raise EngineError("layout", f"layer {index} holds {rows} cached rows at position {past}; expected {past}")


def _forward_chunk(plan: Plan, cache_layers: list[Any], input_ids: Any, past: int) -> Any:
    return _forward_rows(plan, cache_layers, input_ids, past, input_ids.shape[1])[-1]


def forward_block(plan: Plan, cache_layers: list[Any], input_ids: Any, past: int, chunk_tokens: int) -> list[Any]:
    """Several consecutive grid chunks at once: ``input_ids`` ``(1, k * chunk_tokens)`` at
    ``[past, past + k * chunk_tokens)``, ``past`` a multiple of ``chunk_tokens``. The
    row-wise work (norms, projections, rotary, MLP) runs over all ``k * chunk_tokens`` rows in
    one call each; every chunk's attention is the very call :func:`forward_chunk` makes for
    that chunk (its ``chunk_tokens`` queries over the keys up to its own end). Returns the
    last row's logits of every chunk, in order, each ``(1, 1, vocab)``.

    Whether that equals the grid bit for bit rests on the row-wise kernels computing a row the
    same way whatever the row count; the adapter checks it on the device before it uses this
    (``TransformersEngine.block_chunks``), and falls back to one chunk at a time if not."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _forward_rows(plan, cache_layers, input_ids, past, chunk_tokens)


def attend_chunks(out: Any, query: Any, key: Any, value: Any, scaling: float | None, past: int, chunk_tokens: int) -> None:
    """The attention of a block of chunks, one lower-right call per chunk exactly as the grid
    makes it: chunk ``b``'s queries (rows ``[b * n, (b + 1) * n)`` of ``query``
    ``(1, heads, rows, d)``) over the keys ``[0, past + (b + 1) * n)``, written into rows
    ``[b * n, (b + 1) * n)`` of ``out`` ``(1, rows, heads, d)``."""
    from .fast_prefill import attend_into, lower_right_bias

    rows = query.shape[2]
    n = min(chunk_tokens, rows)
    for lo in range(0, rows, n):
        hi = min(lo + n, rows)
        end = past + hi
        # the chunk's queries copied out contiguous, as the grid's own chunk has them (a
        # strided view could steer the attention dispatch elsewhere)
        attend_into(out[:, lo:hi], query[:, :, lo:hi].contiguous(), key[:, :, :end], value[:, :, :end], scaling, lower_right_bias(hi - lo, end))


def _forward_rows(plan: Plan, cache_layers: list[Any], input_ids: Any, past: int, chunk_tokens: int) -> list[Any]:
    import torch

    from .fast_prefill import attend, lower_right_bias

    check_rows(cache_layers, past)
    position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device) + past).unsqueeze(0)
    hidden, cos, sin = embed_and_rotary(plan, input_ids, position_ids)
    q_len = hidden.shape[1]
    bias = lower_right_bias(q_len, past + q_len)  # lower_right_attention's bias: the same for every layer
    for layer, cache_layer in zip(plan.layers, cache_layers):
        query, key, value = pre_attention(layer, hidden, cos, sin)
        key, value = cache_layer.update(key, value)
        if q_len <= chunk_tokens:
            out = attend(query, key, value, layer.scaling, bias).reshape(1, q_len, -1).contiguous()
        else:
            out = torch.empty((1, q_len, query.shape[1], layer.head_dim), dtype=query.dtype, device=query.device)
            attend_chunks(out, query, key, value, layer.scaling, past, chunk_tokens)
            out = out.view(1, q_len, -1)
        hidden = post_attention(layer, out, hidden)
    return chunk_logits(plan, hidden, chunk_tokens)


def chunk_logits(plan: Plan, hidden: Any, chunk_tokens: int) -> list[Any]:
    """The final norm over every row, then ``lm_head`` on the last row of each chunk of
    ``chunk_tokens`` rows, one call per row (as :func:`final_logits` makes it per chunk)."""
    import torch.nn.functional as F

    hidden = rms_norm(hidden, plan.norm)
    rows = hidden.shape[1]
    ends = list(range(min(chunk_tokens, rows), rows + 1, chunk_tokens)) if rows > chunk_tokens else [rows]
    return [F.linear(hidden[:, end - 1 : end, :], *plan.lm_head) for end in ends]


__all__ = [
    "ABI_RECORD",
    "Plan",
    "attend_chunks",
    "chunk_logits",
    "forward_block",
    "check_rows",
    "embed_and_rotary",
    "final_logits",
    "forward_chunk",
    "hooks_reason",
    "plan",
    "post_attention",
    "pre_attention",
    "rms_norm",
    "unsupported_reason",
]
