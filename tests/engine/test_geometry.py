"""Restore proofs on the random geometry models: Cohere2 (Muse layout, windowed) and Llama.

Every proof compares against an uninterrupted run with the same computation order
(absolute-aligned prefill chunks, one token per decode forward, same thread count), and
compares with ``torch.equal``: bit-identical, not close.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from conftest import COHERE2_WINDOW, random_tokens

from kvpack.engine.contract import LAYER_FULL, LAYER_WINDOWED
from kvpack.engine.transformers_adapter import transfer_cut
from kvpack.errors import EngineError


@pytest.fixture(params=["cohere2", "llama"])
def engine(request, cohere2_engine, llama_engine):
    return {"cohere2": cohere2_engine, "llama": llama_engine}[request.param]


def _exported(session):
    """{(layer, role): (lo, hi, sha256)} of everything the session retains."""
    out = {}
    for layer, role in session.layout.states():
        lo, hi = session.retained_range(layer)
        out[(layer, role)] = (lo, hi, hashlib.sha256(session.export_rows(layer, role, lo, hi)).digest())
    return out


def test_cohere2_layout_is_the_muse_partition(cohere2_engine):
    layout = cohere2_engine.layout
    assert layout.num_layers == 8
    for spec in layout.layers:
        if spec.index % 4 == 3:
            assert (spec.kind, spec.position, spec.window_tokens) == (LAYER_FULL, "nope", 0)
        else:
            # HF sliding layers keep window - 1 rows.
            assert (spec.kind, spec.position) == (LAYER_WINDOWED, "rope")
            assert (spec.attention_window, spec.window_tokens) == (COHERE2_WINDOW, COHERE2_WINDOW - 1)
        assert (spec.kv_heads, spec.head_dim, spec.dtype, spec.dtype_wire) == (2, 16, "f32", 8)


def test_llama_layout_is_one_class(llama_engine):
    assert {(s.kind, s.position) for s in llama_engine.layout.layers} == {(LAYER_FULL, "rope")}


@pytest.mark.parametrize("n", [5, 23, 24, 100, 300])
def test_live_cache_holds_exactly_the_retained_rows(cohere2_engine, n):
    s = cohere2_engine.new_session()
    s.prefill(random_tokens(n, 512))
    for spec in s.layout.layers:
        lo, hi = s.retained_range(spec.index)
        assert hi == n
        assert lo == (max(0, n - (COHERE2_WINDOW - 1)) if spec.kind == LAYER_WINDOWED else 0)
        keys = s.cache.layers[spec.index].keys
        assert keys.shape == (1, 2, hi - lo, 16)
        # Token-major export is the transposed cache, row for row.
        rows = torch.frombuffer(bytearray(s.export_rows(spec.index, "k", lo, hi)), dtype=torch.float32)
        assert torch.equal(rows.view(hi - lo, 2, 16), keys[0].transpose(0, 1))


@pytest.mark.parametrize("n", [7, 300, 513])
def test_export_install_decode_is_bit_identical(engine, n):
    """Cut at the end of the prompt, install into a fresh session, greedy-decode 32 tokens."""
    prompt = random_tokens(n, 512, seed=n)
    ref = engine.new_session()
    ref.prefill(prompt)
    exported = _exported(ref)
    restored = engine.new_session()
    transfer_cut(ref, restored)
    assert restored.tokens == ref.tokens
    # The restored cache hashes equal to what was exported, state by state.
    assert _exported(restored) == exported
    assert torch.equal(restored.last_logits, ref.last_logits)
    ref_tokens, ref_logits = ref.decode_greedy(32)
    got_tokens, got_logits = restored.decode_greedy(32)
    assert got_tokens == ref_tokens
    assert len(got_logits) == len(ref_logits) == 32
    assert all(torch.equal(a, b) for a, b in zip(got_logits, ref_logits))
    assert torch.equal(restored.last_logits, ref.last_logits)
    assert restored.cache_digest() == ref.cache_digest()


@pytest.mark.parametrize("k", [1, 2])
def test_prefix_restore_plus_suffix_prefill_equals_chunked_prefill(engine, k):
    """Rows [0, k*256) restored, then the suffix prefilled: the same bits as no restore."""
    cut = 256 * k
    prompt = random_tokens(cut + 200, 512, seed=k)
    uninterrupted = engine.new_session()
    holder = {}

    def save_at_cut(session):
        # A windowed layer only holds the window ending at the cut while the session is
        # there, so the cut is exported from the chunk callback (what the store does).
        if session.position == cut:
            holder["prefix"] = engine.new_session()
            transfer_cut(session, holder["prefix"], with_logits=False)

    uninterrupted.prefill(prompt, on_chunk=save_at_cut)
    resumed = holder["prefix"]
    assert resumed.position == cut and resumed.last_logits is None
    with pytest.raises(EngineError):
        resumed.decode_greedy(1)  # no logits at a prefix-only install
    resumed.prefill(prompt[cut:])
    assert resumed.tokens == uninterrupted.tokens
    assert resumed.cache_digest() == uninterrupted.cache_digest()
    assert torch.equal(resumed.last_logits, uninterrupted.last_logits)
    a_tokens, a_logits = uninterrupted.decode_greedy(16)
    b_tokens, b_logits = resumed.decode_greedy(16)
    assert a_tokens == b_tokens and all(torch.equal(x, y) for x, y in zip(a_logits, b_logits))


def test_full_span_prefix_can_be_cut_from_a_deeper_session(llama_engine):
    """Without windowed layers, rows [0, cut) stay available after the session moved on."""
    prompt = random_tokens(700, 512, seed=7)
    deep = llama_engine.new_session()
    deep.prefill(prompt)
    resumed = llama_engine.new_session()
    transfer_cut(deep, resumed, 512, with_logits=False)
    resumed.prefill(prompt[512:])
    assert resumed.cache_digest() == deep.cache_digest()


def test_windowed_layers_refuse_evicted_rows(cohere2_engine):
    s = cohere2_engine.new_session()
    s.prefill(random_tokens(300, 512))
    with pytest.raises(EngineError) as err:
        s.export_rows(0, "k", 0, 300)
    assert err.value.category == "layout"
    # The full (NoPE) layer still has them all.
    assert len(s.export_rows(3, "k", 0, 300)) == 300 * 2 * 16 * 4
    # And a deeper session cannot supply a shallower cut for windowed layers.
    target = cohere2_engine.new_session()
    with pytest.raises(EngineError):
        transfer_cut(s, target, 256, with_logits=False)
    assert target.position == 0


def test_a_wrong_window_row_is_detected_by_the_decode_comparison(cohere2_engine):
    """Control: the bit-exact comparison can fail. Perturb one retained row of a windowed
    layer in transit (the oldest row still inside the window) and decoding diverges."""
    prompt = random_tokens(300, 512, seed=3)
    ref = cohere2_engine.new_session()
    ref.prefill(prompt)
    bad = cohere2_engine.new_session()
    install = bad.begin_install(300, ref.tokens, cohere2_engine.identity)
    for layer, role in ref.layout.states():
        lo, hi = install.required_range(layer)
        data = bytearray(ref.export_rows(layer, role, lo, hi))
        if (layer, role) == (0, "k"):
            data[3] ^= 0x80  # sign bit of the first element of row lo (f32 little-endian)
        install.write_rows(layer, role, lo, data)
    install.write_logits(ref.export_logits())
    install.commit()
    _, ref_logits = ref.decode_greedy(4)
    _, bad_logits = bad.decode_greedy(4)
    assert torch.equal(ref_logits[0], bad_logits[0])  # the first row came from the plane
    assert not all(torch.equal(a, b) for a, b in zip(ref_logits[1:], bad_logits[1:]))


def test_decode_stops_after_a_stop_token(llama_engine):
    s = llama_engine.new_session()
    s.prefill(random_tokens(40, 512))
    first = int(torch.argmax(s.last_logits))
    tokens, logits = s.decode_greedy(10, stop_token_ids=[first])
    assert tokens == [first] and len(logits) == 1 and s.position == 41


def test_chunk_size_other_than_the_identity_is_refused(llama_engine):
    s = llama_engine.new_session()
    with pytest.raises(EngineError) as err:
        s.prefill([1, 2, 3], chunk_size=64)
    assert err.value.category == "identity" and s.position == 0


def test_prefill_chunks_are_absolute_aligned(llama_engine):
    """Prefill calls that end on chunk boundaries give the bits of one call: inside a call,
    chunks end at absolute multiples of the chunk size, not relative to the call's start."""
    chunk = llama_engine.prefill_chunk_tokens
    prompt = random_tokens(400, 512, seed=11)
    one = llama_engine.new_session()
    seen = []
    one.prefill(prompt, on_chunk=lambda s: seen.append(s.position))
    assert seen == [128, 256, 384, 400]
    pieces = llama_engine.new_session()
    for a, b in [(0, chunk), (chunk, 3 * chunk), (3 * chunk, 400)]:
        pieces.prefill(prompt[a:b])
    assert pieces.cache_digest() == one.cache_digest()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_restore_is_bit_identical():
    from kvpack.engine.models import build_cohere2
    from kvpack.engine.transformers_adapter import TransformersEngine

    eng = TransformersEngine(build_cohere2(seed=0), device="cuda", prefill_chunk_tokens=64)
    ref = eng.new_session()
    ref.prefill(random_tokens(300, 512))
    restored = eng.new_session()
    transfer_cut(ref, restored)
    assert restored.cache_digest() == ref.cache_digest()
    a, la = ref.decode_greedy(16)
    b, lb = restored.decode_greedy(16)
    assert la[0].device.type == "cuda"
    assert a == b and all(torch.equal(x, y) for x, y in zip(la, lb))
    # Prefix at 256 (exported from the chunk callback) + suffix prefill, on the GPU.
    prompt = random_tokens(400, 512, seed=2)
    full = eng.new_session()
    holder = {}

    def save(session):
        if session.position == 256:
            holder["p"] = eng.new_session()
            transfer_cut(session, holder["p"], with_logits=False)

    full.prefill(prompt, on_chunk=save)
    holder["p"].prefill(prompt[256:])
    assert holder["p"].cache_digest() == full.cache_digest()
