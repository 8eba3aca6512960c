"""The exact identity of a vLLM engine's KV cache, as kvpack's :class:`EngineIdentity`.

A stored prefix may be loaded into a vLLM instance only if it was written by an instance
whose cache bytes mean exactly the same thing. The identity therefore binds (docs/vllm.md):

* the model: architecture, the model config (provenance keys removed), a SHA-256 over the
  checkpoint's weight files (names, sizes and contents), the stored tensor precisions, and
  the compute dtype and quantization vLLM runs them in;
* the tokenizer and chat template (digests of the fast tokenizer and its template);
* the cache: KV dtype, block size, the KV-cache layout, the attention backend and its in-block
  ISA, per-layer geometry (a ``CacheLayout``), vLLM/torch versions, the device;
* the context policy (``max_model_len``) and the shard map (tensor/pipeline parallel sizes).

Any difference changes at least one of the eight Id32, so the keyed prefix chain of every
stored cut moves: a miss, never a best-effort load (docs/engine.md, "Identity").

The OpenMP thread count is deliberately *not* bound: vLLM batches requests freely, so the
GEMM shapes that produce a row differ from step to step anyway; the identity binds what
decides the meaning of the cache bytes, and the tests compare tokens, not bits of rows.

Everything here runs once per process at connector start (hashing the weight files is the
slow part, ~1 s per GB). Nothing here mutates vLLM's config.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from ...engine.contract import LAYER_FULL, CacheLayout, EngineIdentity, LayerSpec
from ...engine.models import canonical_config, config_floats, tokenizer_digests
from ...errors import EngineError
from .paged import BLOCK_INTERIOR

CONNECTOR_NAME = "kvpack.integrations.vllm"
CONNECTOR_VERSION = 1

#: in-block layouts this connector was verified against (paged.py describes them)
VERIFIED_ISAS = frozenset({"vec", "vec16"})
_FAMILIES_ALL_FULL_ROPE = frozenset({"llama", "mistral", "qwen2"})
_TORCH_TO_WIRE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def weight_files_digest(model_dir: str) -> tuple[str, str]:
    """(hex SHA-256 over the checkpoint's ``*.safetensors`` files, their precision summary).

    The digest covers each file's name, size and SHA-256, sorted by name; the precision
    summary counts the stored tensor dtypes from the safetensors headers
    (``safetensors:F32x272``). Checkpoints in any other form are refused: the connector
    cannot say what weights vLLM runs.
    """
    if not os.path.isdir(model_dir):
        raise EngineError("unsupported", f"model {model_dir!r} is not a local directory; give vLLM a local checkpoint path")
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise EngineError("unsupported", f"{model_dir} holds no .safetensors weights")
    outer = hashlib.sha256(b"kvpack/vllm/v1/weight-files\0")
    dtypes: dict[str, int] = {}
    for name in names:
        path = os.path.join(model_dir, name)
        h = hashlib.sha256()
        size = 0
        with open(path, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            if not 0 < header_len <= 100 << 20:
                raise EngineError("model", f"{name}: not a safetensors file")
            header = fh.read(header_len)
            h.update(header_len.to_bytes(8, "little") + header)
            size = 8 + len(header)
            for entry_name, entry in json.loads(header).items():
                if entry_name != "__metadata__":
                    dtypes[entry["dtype"]] = dtypes.get(entry["dtype"], 0) + 1
            while True:
                block = fh.read(1 << 22)
                if not block:
                    break
                h.update(block)
                size += len(block)
        outer.update(json.dumps([name, size, h.hexdigest()]).encode() + b"\n")
    return outer.hexdigest(), "safetensors:" + ",".join(f"{k}x{dtypes[k]}" for k in sorted(dtypes))


def _tokenizer_digests(tokenizer_dir: str, vocab_size: int) -> tuple[str, str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tokenizer_digests(tok, vocab_size)


def resolved_kv_dtype(cache_dtype: str, model_dtype: Any) -> str:
    """The wire dtype of the KV cache (``auto`` means the model's compute dtype)."""
    if cache_dtype != "auto":
        raise EngineError("unsupported", f"kv_cache_dtype {cache_dtype!r}: quantized KV caches have no production-v1 wire type")
    name = str(model_dtype).replace("torch.", "")
    if name not in _TORCH_TO_WIRE:
        raise EngineError("unsupported", f"compute dtype {name} has no production-v1 wire type")
    return _TORCH_TO_WIRE[name]


def cache_layout(hf_config: Any, kv_heads: int, head_dim: int, dtype: str) -> CacheLayout:
    """All-full-attention RoPE layers (the families this connector covers)."""
    model_type = getattr(hf_config, "model_type", "")
    if model_type not in _FAMILIES_ALL_FULL_ROPE:
        raise EngineError("unsupported", f"model type {model_type!r} is not covered (full-attention RoPE families: {sorted(_FAMILIES_ALL_FULL_ROPE)})")
    if getattr(hf_config, "sliding_window", None) or any(t != "full_attention" for t in (getattr(hf_config, "layer_types", None) or [])):
        raise EngineError("unsupported", "sliding-window layers are not covered by the vLLM connector")
    n = int(hf_config.num_hidden_layers)
    specs = tuple(LayerSpec(i, LAYER_FULL, kv_heads, head_dim, dtype, "rope") for i in range(n))
    return CacheLayout(layers=specs, vocab_size=int(hf_config.vocab_size))


def attention_isa(model_dtype: Any, block_size: int, head_dim: int, cache_dtype: str) -> str:
    """The CPU attention backend's in-block ISA for this configuration (vLLM's own rule)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(model_dtype, block_size, head_dim, cache_dtype))


#: the only KV-cache layout the CPU attention backend supports (and paged.py reads)
CPU_KV_LAYOUT = "LBHNC"


def check_kv_cache_config(identity: EngineIdentity, kv_cache_config: Any) -> None:
    """The engine's resolved KV-cache configuration must be the one the identity describes."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise EngineError("unsupported", f"{len(groups)} KV cache groups (hybrid models are not covered)")
    spec = groups[0].kv_cache_spec
    layer = identity.layout.layers[0]
    got = (int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size))
    want = (int(identity.engine_abi["block_size"]), layer.kv_heads, layer.head_dim)
    if got != want:
        raise EngineError("identity", f"KV cache spec (block, heads, head_dim) {got} differs from the configuration's {want}")
    layout = getattr(kv_cache_config, "kv_cache_layout", None)
    if layout not in (None, CPU_KV_LAYOUT):
        raise EngineError("unsupported", f"KV cache layout {layout!r}: the connector reads {CPU_KV_LAYOUT} blocks only")


def vllm_identity(vllm_config: Any) -> EngineIdentity:
    """The identity of the KV cache this vLLM configuration computes (module docstring).

    Needs only the configuration (``EngineArgs(...).create_engine_config()`` is enough), so
    the identity file for enrollment can be written without starting an engine; the
    connector checks the engine's resolved KV-cache spec against it
    (:func:`check_kv_cache_config`)."""
    import torch
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise EngineError("unsupported", "the kvpack vLLM connector handles vLLM's CPU backend only (GPU cache layouts are not verified)")
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise EngineError("unsupported", "tensor or pipeline parallel vLLM instances are not covered (single-shard map only)")
    block_size, kv_heads, head_dim = int(cc.block_size), int(mc.get_num_kv_heads(pc)), int(mc.get_head_size())
    dtype = resolved_kv_dtype(str(cc.cache_dtype), mc.dtype)
    isa = attention_isa(mc.dtype, block_size, head_dim, str(cc.cache_dtype))
    if isa not in VERIFIED_ISAS:
        raise EngineError("unsupported", f"CPU attention ISA {isa!r}: only {sorted(VERIFIED_ISAS)} in-block layouts are verified")
    hf_config = mc.hf_config
    layout = cache_layout(hf_config, kv_heads, head_dim, dtype)
    weights, precision = weight_files_digest(mc.model)
    tok_digest, tpl_digest = _tokenizer_digests(mc.tokenizer or mc.model, int(hf_config.vocab_size))
    config = canonical_config(hf_config)
    scalars: dict[str, float] = {}
    config_floats("config", config, scalars)
    quant = getattr(mc, "quantization", None)
    engine_abi = {
        "engine": "vllm",
        "connector": CONNECTOR_NAME,
        "connector_version": CONNECTOR_VERSION,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "device": "cpu",
        "attention_backend": "CPU_ATTN",
        "attention_isa": isa,
        "kv_cache_layout": CPU_KV_LAYOUT,
        "block_interior": BLOCK_INTERIOR,
        "kv_cache_dtype": str(cc.cache_dtype),
        "block_size": block_size,
        "compute_dtype": str(mc.dtype).replace("torch.", ""),
        "quantization": None if quant is None else str(quant),
        "byte_order": sys.byteorder,
    }
    return EngineIdentity(
        model_name=",".join(getattr(hf_config, "architectures", None) or [str(hf_config.model_type)]),
        weights_digest=weights,
        config=config,
        tokenizer_digest=tok_digest,
        chat_template_digest=tpl_digest,
        context_policy={
            "max_context": int(mc.max_model_len),
            "prefix_cuts": "absolute multiples of 256 and the prompt minus its last token",
            "suffix": "computed by vLLM",
        },
        adapter={"name": "none"},
        weight_precision=f"{precision}->{engine_abi['compute_dtype']}",
        engine_abi=engine_abi,
        scalars=scalars,
        layout=layout,
        rope={"rope_layers": list(range(layout.num_layers)), "rope_parameters": _rope(hf_config)},
    )


def _rope(hf_config: Any) -> Mapping[str, Any]:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return json.loads(json.dumps(dict(params), sort_keys=True, default=str)) if isinstance(params, Mapping) else {"repr": str(params)}
