"""The lean per-chunk prefill forward (kvpack.engine.lean_prefill, ``prefill_forward``).

The contract: after a prefill through the lean forward every K/V plane and the last-logits
row are bit-identical to a prefill through the model's own forward, at lengths on and across
the 256-token chunk boundaries; a session restored at a cut and continued equals an
uninterrupted one; decode after a lean prefill equals decode after a model prefill. On the
CPU the lower-right path is forced; the CUDA tests run the same checks on the device."""

from __future__ import annotations

import pytest

from kvpack.engine import lean_prefill
from kvpack.engine.models import build_cohere2, build_llama
from kvpack.engine.transformers_adapter import PREFILL_FORWARD_ENV, TransformersEngine, transfer_cut
from kvpack.errors import EngineError

from .conftest import DTYPES, random_tokens, requires_cuda

torch = pytest.importorskip("torch")

LENGTHS = [1, 255, 256, 257, 700, 1030]


def _pair(dtype: str = "f32", device: str = "cpu", **kw):
    """A model-forward and a lean-forward engine over one model (the same weights)."""
    loaded = build_llama(seed=0, num_hidden_layers=3, max_position_embeddings=2048, **kw)
    loaded.model = loaded.model.to(DTYPES[dtype])
    engines = {}
    for forward in ("model", "lean"):
        engines[forward] = TransformersEngine(
            loaded, threads=2, prefill_chunk_tokens=256, device=device, prefill_attention="lower_right", prefill_forward=forward
        )
    return engines["model"], engines["lean"]


def _assert_same_cache(a, b) -> None:
    assert a.position == b.position
    for layer, (la, lb) in enumerate(zip(a.cache.layers, b.cache.layers)):
        assert torch.equal(la.keys, lb.keys), f"layer {layer} k"
        assert torch.equal(la.values, lb.values), f"layer {layer} v"
    assert a.last_logits.dtype == b.last_logits.dtype == torch.float32
    assert torch.equal(a.last_logits, b.last_logits)
    assert a.cache_digest() == b.cache_digest()


@pytest.fixture(scope="module", params=["f32", "bf16", "f16"])
def pair(request):
    return _pair(request.param)


def test_lean_prefill_is_bit_identical_to_the_model_forward(pair):
    model, lean = pair
    assert (model.prefill_forward, lean.prefill_forward) == ("model", "lean")
    tokens = random_tokens(max(LENGTHS), model.layout.vocab_size, seed=3)
    for n in LENGTHS:
        a, b = model.new_session(), lean.new_session()
        a.prefill(tokens[:n])
        b.prefill(tokens[:n])
        _assert_same_cache(a, b)


def test_lean_prefill_really_differs_from_a_perturbed_model():
    """The comparison can fail: one weight of layer 1 nudged in the lean engine's model shows
    from layer 2 on, and not before."""
    model, _ = _pair()
    loaded = build_llama(seed=0, num_hidden_layers=3, max_position_embeddings=2048)
    with torch.no_grad():
        loaded.model.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-3
    other = TransformersEngine(loaded, threads=2, prefill_chunk_tokens=256, prefill_attention="lower_right", prefill_forward="lean")
    tokens = random_tokens(300, model.layout.vocab_size, seed=3)
    a, b = model.new_session(), other.new_session()
    a.prefill(tokens)
    b.prefill(tokens)
    assert torch.equal(a.cache.layers[1].keys, b.cache.layers[1].keys)  # before the change
    assert not torch.equal(a.cache.layers[2].keys, b.cache.layers[2].keys)
    assert not torch.equal(a.last_logits, b.last_logits)


def test_restored_then_continued_equals_uninterrupted(pair):
    model, lean = pair
    tokens = random_tokens(900, model.layout.vocab_size, seed=5)
    whole = model.new_session()
    whole.prefill(tokens)
    part = lean.new_session()
    part.prefill(tokens[:512])
    resumed = lean.new_session()
    transfer_cut(part, resumed)
    resumed.prefill(tokens[512:])
    _assert_same_cache(whole, resumed)


def test_decode_after_a_lean_prefill_equals_decode_after_a_model_prefill(pair):
    model, lean = pair
    tokens = random_tokens(600, model.layout.vocab_size, seed=7)
    a, b = model.new_session(), lean.new_session()
    a.prefill(tokens)
    b.prefill(tokens)
    out_a, logits_a = a.decode_greedy(12)
    out_b, logits_b = b.decode_greedy(12)
    assert out_a == out_b
    assert all(torch.equal(x, y) for x, y in zip(logits_a, logits_b))
    _assert_same_cache(a, b)
    # and a prefill after decode (not chunk-aligned any more) stays identical
    a.prefill(tokens[:300])
    b.prefill(tokens[:300])
    _assert_same_cache(a, b)


def test_on_chunk_sees_every_chunk_boundary():
    model, lean = _pair()
    tokens = random_tokens(700, model.layout.vocab_size, seed=8)
    seen: dict[str, list] = {"model": [], "lean": []}
    for name, eng in (("model", model), ("lean", lean)):
        s = eng.new_session()
        s.prefill(tokens, on_chunk=lambda sess, name=name: seen[name].append((sess.position, sess.cache_digest())))
    assert [p for p, _ in seen["lean"]] == [256, 512, 700]
    assert seen["lean"] == seen["model"]


def test_the_forward_is_part_of_the_identity():
    model, lean = _pair()
    assert lean.identity.engine_abi["prefill_forward"] == lean_prefill.ABI_RECORD
    assert "prefill_forward" not in model.identity.engine_abi
    assert model.ids() != lean.ids()
    with pytest.raises(EngineError) as exc:
        model.check_identity(lean.identity)
    assert exc.value.category == "identity"


def test_auto_follows_the_environment_and_support(monkeypatch):
    loaded = build_llama(seed=0, num_hidden_layers=2)
    monkeypatch.delenv(PREFILL_FORWARD_ENV, raising=False)
    assert TransformersEngine(loaded, threads=2, prefill_attention="lower_right").prefill_forward == "lean"
    # transformers' own attention path: the lean forward does not mirror it
    assert TransformersEngine(build_llama(seed=0, num_hidden_layers=2), threads=2, prefill_attention="sdpa").prefill_forward == "model"
    monkeypatch.setenv(PREFILL_FORWARD_ENV, "model")
    assert TransformersEngine(loaded, threads=2, prefill_attention="lower_right").prefill_forward == "model"
    # an explicit option wins over the environment
    assert TransformersEngine(loaded, threads=2, prefill_attention="lower_right", prefill_forward="lean").prefill_forward == "lean"
    monkeypatch.setenv(PREFILL_FORWARD_ENV, "fast")
    with pytest.raises(EngineError) as exc:
        TransformersEngine(loaded, threads=2, prefill_attention="lower_right")
    assert exc.value.category == "unsupported"


def test_unsupported_models_are_refused_or_keep_the_model_forward():
    with pytest.raises(EngineError) as exc:
        TransformersEngine(build_llama(seed=0, num_hidden_layers=2), threads=2, prefill_attention="sdpa", prefill_forward="lean")
    assert exc.value.category == "unsupported"
    cohere = build_cohere2(seed=0, num_hidden_layers=4, sliding_window=24)
    assert lean_prefill.unsupported_reason(cohere.model, "sdpa") is not None
    assert TransformersEngine(cohere, threads=2, prefill_chunk_tokens=64).prefill_forward == "model"

    from transformers import LlamaForCausalLM

    class Tweaked(LlamaForCausalLM):
        pass

    loaded = build_llama(seed=0, num_hidden_layers=2)
    assert lean_prefill.unsupported_reason(loaded.model, "lower_right") is None
    tweaked = Tweaked(loaded.model.config)
    assert "LlamaForCausalLM" in (lean_prefill.unsupported_reason(tweaked, "lower_right") or "")
    loaded.model.model.layers[1].mlp.up_proj = torch.nn.Identity()
    assert "projection" in (lean_prefill.unsupported_reason(loaded.model, "lower_right") or "")


def test_hooks_added_after_the_build_refuse_the_lean_prefill():
    model, lean = _pair()
    tokens = random_tokens(300, lean.layout.vocab_size, seed=2)
    handle = lean.model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    try:
        s = lean.new_session()
        with pytest.raises(EngineError) as exc:
            s.prefill(tokens)
        assert exc.value.category == "unsupported"
        assert "hooks" in str(exc.value)
        assert s.position == 0 and s.last_logits is None  # nothing computed
    finally:
        handle.remove()
    s = lean.new_session()
    s.prefill(tokens)
    a = model.new_session()
    a.prefill(tokens)
    _assert_same_cache(a, s)


@requires_cuda
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_cuda_lean_prefill_is_bit_identical(dtype):
    model, lean = _pair(dtype, device="cuda")
    tokens = random_tokens(max(LENGTHS), model.layout.vocab_size, seed=3)
    for n in LENGTHS:
        a, b = model.new_session(), lean.new_session()
        a.prefill(tokens[:n])
        b.prefill(tokens[:n])
        _assert_same_cache(a, b)
    whole = model.new_session()
    whole.prefill(tokens[:900])
    part = lean.new_session()
    part.prefill(tokens[:512])
    resumed = lean.new_session()
    transfer_cut(part, resumed)
    resumed.prefill(tokens[512:900])
    _assert_same_cache(whole, resumed)
    out_a, _ = whole.decode_greedy(8)
    out_b, _ = resumed.decode_greedy(8)
    assert out_a == out_b
    _assert_same_cache(whole, resumed)


@requires_cuda
def test_cuda_auto_selects_the_lean_forward(monkeypatch):
    monkeypatch.delenv(PREFILL_FORWARD_ENV, raising=False)
    loaded = build_llama(seed=0, num_hidden_layers=2)
    loaded.model = loaded.model.to(torch.float16)
    eng = TransformersEngine(loaded, threads=2, device="cuda")
    assert (eng.prefill_attention, eng.prefill_forward) == ("lower_right", "lean")


def test_a_cache_out_of_step_with_the_position_is_refused():
    """The chunk's attention bias is made for ``position + n`` key rows; a cache holding
    another count (here: a token recorded without its rows) is refused, not attended with a
    misaligned mask."""
    _, lean = _pair()
    tokens = random_tokens(300, lean.layout.vocab_size, seed=4)
    s = lean.new_session()
    s.prefill(tokens[:256])
    s.tokens.append(tokens[256])  # position 257, 256 cached rows
    with pytest.raises(EngineError) as exc:
        s.prefill(tokens[257:])
    assert exc.value.category == "layout"
    assert "expected" in str(exc.value)
