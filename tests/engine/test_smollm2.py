"""Restore proofs with the real bundled model, SmolLM2-135M-Instruct (GGUF Q4_1 -> float32)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvpack.engine.contract import LAYER_FULL
from kvpack.engine.transformers_adapter import transfer_cut
from kvpack.errors import EngineError

pytestmark = pytest.mark.slow

_PARAGRAPH = (
    "Section {i}. A KV cache holds the keys and values that attention computed for every "
    "token of the context. Persisting it lets a server skip prefill when the same prefix "
    "comes back, but only if the restored bytes are exactly the ones that were saved, under "
    "exactly the same model, tokenizer, template and arithmetic. "
)


def _prompt(engine, min_tokens: int) -> list[int]:
    """A real chat-formatted prompt of at least ``min_tokens`` tokens."""
    text = ""
    i = 0
    while True:
        text += _PARAGRAPH.format(i=i)
        i += 1
        messages = [{"role": "user", "content": text + "Summarise the sections in one sentence."}]
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if len(ids) >= min_tokens:
            return ids


def test_smollm2_layout_and_precision(smollm2_engine):
    layout = smollm2_engine.layout
    assert layout.num_layers == 30 and layout.vocab_size == 49152
    assert {(s.kind, s.kv_heads, s.head_dim, s.dtype, s.position) for s in layout.layers} == {(LAYER_FULL, 3, 64, "f32", "rope")}
    ident = smollm2_engine.identity
    assert ident.weight_precision.startswith("gguf:MOSTLY_Q4_1(") and ident.weight_precision.endswith("->float32")
    assert ident.scalars["config.rms_norm_eps"] == pytest.approx(1e-5)
    assert ident.scalars["config.rope_parameters.rope_theta"] == 100000.0
    assert ident.engine_abi["threads"] == smollm2_engine.threads
    # The count is process-wide: another engine loaded in this process (the suite loads several)
    # may have changed it. A session computes under the count its identity records.
    others = 1 if smollm2_engine.threads != 1 else 2
    torch.set_num_threads(others)
    session = smollm2_engine.new_session()
    session.prefill([1, 2, 3])
    assert torch.get_num_threads() == smollm2_engine.threads


def test_smollm2_export_install_decode_32_is_bit_identical(smollm2_engine):
    prompt = _prompt(smollm2_engine, 300)
    ref = smollm2_engine.new_session()
    ref.prefill(prompt)
    exported = {(layer, role): hashlib.sha256(ref.export_rows(layer, role, 0, ref.position)).digest() for layer, role in ref.layout.states()}
    restored = smollm2_engine.new_session()
    transfer_cut(ref, restored)
    restored_hashes = {
        (layer, role): hashlib.sha256(restored.export_rows(layer, role, 0, restored.position)).digest() for layer, role in restored.layout.states()
    }
    assert restored_hashes == exported
    ref_tokens, ref_logits = ref.decode_greedy(32)
    got_tokens, got_logits = restored.decode_greedy(32)
    assert got_tokens == ref_tokens
    assert len(got_logits) == 32 and all(torch.equal(a, b) for a, b in zip(got_logits, ref_logits))
    assert smollm2_engine.decode(got_tokens).strip()  # real text came out


def test_smollm2_prefix_restore_plus_suffix_prefill_is_bit_identical(smollm2_engine):
    prompt = _prompt(smollm2_engine, 600)
    uninterrupted = smollm2_engine.new_session()
    uninterrupted.prefill(prompt)
    for cut in (256, 512):
        resumed = smollm2_engine.new_session()
        # Full-span layers only: the prefix rows can be cut from the deeper session.
        transfer_cut(uninterrupted, resumed, cut, with_logits=False)
        resumed.prefill(prompt[cut:])
        assert resumed.cache_digest() == uninterrupted.cache_digest()
        assert torch.equal(resumed.last_logits, uninterrupted.last_logits)
    a_tokens, a_logits = uninterrupted.decode_greedy(8)
    b_tokens, b_logits = resumed.decode_greedy(8)
    assert a_tokens == b_tokens and all(torch.equal(x, y) for x, y in zip(a_logits, b_logits))


def test_smollm2_identity_changes_are_misses(smollm2_engine):
    ident = smollm2_engine.identity
    base = ident.semantic_model_id_bytes()
    eps = ident.scalars["config.rms_norm_eps"]
    variants = {
        "rms-eps-one-ulp": ident.replace(scalars={**ident.scalars, "config.rms_norm_eps": float.__add__(eps, eps * 2**-52)}),
        "tokenizer": ident.replace(tokenizer_digest=hashlib.sha256(b"other tokenizer").hexdigest()),
        "precision": ident.replace(weight_precision="gguf:MOSTLY_Q8_0->float32"),
    }
    session = smollm2_engine.new_session()
    session.prefill(_prompt(smollm2_engine, 10)[:10])
    for name, variant in variants.items():
        assert variant.semantic_model_id_bytes() != base, name
        with pytest.raises(EngineError) as err:
            session.begin_install(session.position, session.tokens, variant)
        assert err.value.category == "identity", name
