"""``muse-tiny``: a small seeded model whose KV cache has exactly the seed's Muse layout.

The seeds describe "Muse": 52 layers; every layer with ``layer % 4 == 3`` is full attention
without positions (NoPE, 13 layers), the other 39 are sliding-window RoPE layers whose ring
holds 2,048 rows; 2 KV heads x 128 head dim; an f16 cache. Hugging Face
``Cohere2ForCausalLM`` has exactly that two-class pattern (rotary embeddings only in the
sliding layers), so muse-tiny is a randomly initialised Cohere2 with the Muse cache
geometry and everything else small (hidden size 64, MLP 128, vocabulary 512), which makes
4,096 tokens of prefill a matter of seconds on two CPU cores. Its wire schedule is the
upstream Muse schedule byte for byte (:func:`kvpack.node.wire.span_layout`).

Window convention: a Hugging Face sliding layer with ``sliding_window = W`` lets a query
at ``p`` see ``[p - W + 1, p]`` and keeps the last ``W - 1`` rows. Muse's ring keeps 2,048
rows and the schedule ships the last 2,048 rows of every SWA layer, so muse-tiny sets
``sliding_window = 2049``: the layout's ``window_tokens`` is then 2,048, the retained
ring equals what the wire carries, and no shipped row is wasted or missing.

Weights: every tensor is a pure function of the seed and the tensor's name (SHAKE-256 in
counter mode -> 24-bit uniforms -> f16), independent of torch's or NumPy's random number
generators, so the weights file is the same bytes on every machine and version. It is
written once to the model cache directory and its SHA-256 -- the model digest, as the
seed's identity rules define ``model_sha256`` -- is pinned here
(:data:`MUSE_TINY_WEIGHTS_SHA256`) and verified on every load: a file that differs is
discarded and regenerated, and a generator whose output differs is refused (``model``).

Compute runs in f16 on the CPU as well (the cache dtype follows the projection dtype, and
every op Cohere2 uses has a CPU f16 kernel in torch 2.13: layer norm upcasts to f32
internally, rotary tables are cast to f16, SDPA takes its CPU flash path). Decoding is
deterministic and bit-identical after a restore (tests/engine/test_muse.py).

This module never downloads anything and never writes outside its cache directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any, Optional

import numpy as np

from ..durable import atomic_write, ensure_dir
from ..errors import EngineError
from .models import LoadedModel, default_cache_dir, tokenizer_digests

MUSE_TINY_NAME = "muse-tiny"
MUSE_TINY_SEED = 0x4D555345  # b"MUSE"
MUSE_LAYERS = 52
MUSE_NOPE_LAYERS = tuple(range(3, MUSE_LAYERS, 4))
MUSE_RING_ROWS = 2048  # rows a Muse SWA ring retains (C.12 SWA_WINDOW)
MUSE_KV_HEADS = 2
MUSE_HEAD_DIM = 128
MUSE_MAX_CONTEXT = 131072  # C.14: request positions 2..=131,072
MUSE_TINY_HIDDEN = 64
MUSE_TINY_INTERMEDIATE = 128
MUSE_TINY_VOCAB = 512
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_DOMAIN = b"kvpack/muse-tiny/weights/v1\0"

#: SHA-256 of the generated weights file (seed MUSE_TINY_SEED, the config below).
MUSE_TINY_WEIGHTS_SHA256 = "52d678de57c4acffa21bf48fb7b1463d430cfbffd44731e1550e313f853031c7"


def muse_tiny_config() -> Any:
    """The ``Cohere2Config`` of muse-tiny (Muse cache geometry, small elsewhere)."""
    from transformers import Cohere2Config

    layer_types = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(MUSE_LAYERS)]
    fields: dict[str, Any] = dict(
        vocab_size=MUSE_TINY_VOCAB,
        hidden_size=MUSE_TINY_HIDDEN,
        intermediate_size=MUSE_TINY_INTERMEDIATE,
        num_hidden_layers=MUSE_LAYERS,
        num_attention_heads=MUSE_KV_HEADS,
        num_key_value_heads=MUSE_KV_HEADS,
        head_dim=MUSE_HEAD_DIM,
        max_position_embeddings=MUSE_MAX_CONTEXT,
        sliding_window=MUSE_RING_ROWS + 1,  # HF keeps W - 1 rows: a 2,048-row ring
        layer_types=layer_types,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        # an untied output head: tied to a large random embedding, the argmax would be the
        # input token itself and greedy decoding would repeat one token forever
        tie_word_embeddings=False,
        dtype="float16",
    )
    return Cohere2Config(**fields)


def _uniform(name: str, shape: tuple[int, ...], bound: float, seed: int) -> np.ndarray:
    """f16 values uniform in ``[-bound, bound)``, a pure function of (seed, name, shape)."""
    n = int(np.prod(shape))
    stream = hashlib.shake_256(WEIGHTS_DOMAIN + seed.to_bytes(8, "little") + name.encode("ascii")).digest(4 * n)
    # 24-bit uniforms: exact in f32, so only the final scaling and the f16 cast round
    # (both IEEE round-to-nearest-even, the same everywhere).
    u = (np.frombuffer(stream, dtype="<u4") >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
    return ((u * np.float32(2.0) - np.float32(1.0)) * np.float32(bound)).astype(np.float16).reshape(shape)


def generate_weights(seed: int = MUSE_TINY_SEED) -> dict[str, np.ndarray]:
    """Every parameter of muse-tiny: norms are ones, the embedding uniform in +-1, the
    projections and the output head uniform in +-3/sqrt(fan_in): three times nn.Linear's
    scale, which keeps a random model's greedy decoding from settling on one token."""
    from transformers import Cohere2ForCausalLM

    import torch

    with torch.device("meta"):
        skeleton = Cohere2ForCausalLM(muse_tiny_config())
    out: dict[str, np.ndarray] = {}
    for name, param in sorted(skeleton.named_parameters()):
        shape = tuple(int(d) for d in param.shape)
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, dtype=np.float16)
        elif name == "model.embed_tokens.weight":
            out[name] = _uniform(name, shape, 1.0, seed)
        else:
            out[name] = _uniform(name, shape, 3.0 * float(shape[-1]) ** -0.5, seed)
    return out


def weights_file_bytes(seed: int = MUSE_TINY_SEED) -> bytes:
    """The safetensors bytes of the generated weights (deterministic serialisation)."""
    import safetensors.numpy

    return bytes(safetensors.numpy.save(generate_weights(seed), metadata={"format": "pt"}))


def _model_from_bytes(data: bytes) -> Any:
    import safetensors.torch
    import torch
    from transformers import Cohere2ForCausalLM

    tensors = safetensors.torch.load(data)
    with torch.device("meta"):
        model: Any = Cohere2ForCausalLM(muse_tiny_config())
    model = model.to_empty(device="cpu").to(torch.float16)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if unexpected or missing:  # the rotary buffers are computed, not stored
        raise EngineError("model", f"muse-tiny weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    base = model.model
    rotary = type(base.rotary_emb)(config=model.config)  # to_empty left its buffers uninitialised
    base.rotary_emb = rotary
    model.eval()
    return model


def load_muse_tiny(*, cache_dir: Optional[str] = None) -> LoadedModel:
    """muse-tiny from ``<cache>/muse-tiny-<digest prefix>/model.safetensors``, generated on
    first use; the file's SHA-256 must equal :data:`MUSE_TINY_WEIGHTS_SHA256`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    directory = os.path.join(cache_dir or default_cache_dir(), f"{MUSE_TINY_NAME}-{MUSE_TINY_WEIGHTS_SHA256[:16]}")
    path = os.path.join(directory, WEIGHTS_FILE)
    data = _read_verified(path)
    if data is None:
        data = weights_file_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != MUSE_TINY_WEIGHTS_SHA256:
            raise EngineError("model", f"generated muse-tiny weights hash to {digest}, not the pinned {MUSE_TINY_WEIGHTS_SHA256}")
        ensure_dir(directory, mode=0o700)
        atomic_write(path, data, mode=0o644)
    model = _model_from_bytes(data)
    tok_digest, tpl_digest = tokenizer_digests(None, MUSE_TINY_VOCAB)
    return LoadedModel(
        name=MUSE_TINY_NAME,
        model=model,
        tokenizer=None,
        weights_digest=MUSE_TINY_WEIGHTS_SHA256,
        tokenizer_digest=tok_digest,
        chat_template_digest=tpl_digest,
        weight_precision="f16:shake256-uniform-init",
        source={"weights_file": path, "weights_sha256": MUSE_TINY_WEIGHTS_SHA256, "seed": MUSE_TINY_SEED},
    )


def _read_verified(path: str) -> Optional[bytes]:
    """The file's bytes if they hash to the pinned digest; a damaged file is removed."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return None
    if hashlib.sha256(data).hexdigest() == MUSE_TINY_WEIGHTS_SHA256:
        return data
    # Wrong bytes: never load them. Remove the file (and a stray directory) and regenerate.
    try:
        os.unlink(path)
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass
    return None


__all__ = [
    "MUSE_MAX_CONTEXT",
    "MUSE_TINY_NAME",
    "MUSE_TINY_WEIGHTS_SHA256",
    "generate_weights",
    "load_muse_tiny",
    "muse_tiny_config",
    "weights_file_bytes",
]
