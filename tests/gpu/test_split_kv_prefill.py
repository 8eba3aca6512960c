"""The split-KV chunk attention (``prefill_attention="split_kv"``, kvpack.engine.fast_prefill).

A chunk whose prefix is long enough has its prefix keys cut into equal pieces (one batched
kernel call), the rest, and its own causal square, merged by log-sum-exp. That is a
different rounding from the single lower-right call, so it is a different identity; what
must hold is the contract: a session restored at a cut and continued computes exactly what an
uninterrupted prefill computes. On the CPU the split runs through torch's CPU flash kernel
(tests shrink the piece size so that short prompts split); on CUDA through the flash kernel
with the real policy."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpack.engine import fast_prefill
from kvpack.engine.fast_prefill import SPLIT_KV, SplitKV, chunk_attention
from kvpack.engine.models import build_cohere2, build_llama
from kvpack.engine.transformers_adapter import TransformersEngine, transfer_cut
from kvpack.errors import EngineError
from kvpack.store import PackStore

from .conftest import DTYPES, random_tokens, requires_cuda

torch = pytest.importorskip("torch")


def _engine(dtype="f32", device="cpu", mode=SPLIT_KV, forward="auto", chunk=128) -> TransformersEngine:
    loaded = build_llama(seed=0, max_position_embeddings=16384)
    loaded.model = loaded.model.to(DTYPES[dtype])
    return TransformersEngine(loaded, threads=2, prefill_chunk_tokens=chunk, device=device, prefill_attention=mode, prefill_forward=forward)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 256 rows (the policy is read per chunk), so a 1,000-token prompt splits."""
    monkeypatch.setattr(fast_prefill, "SPLIT_PIECE_ROWS", 256)
    monkeypatch.setattr(fast_prefill, "SPLIT_MAX_PIECES", 3)


@pytest.fixture
def split_calls(monkeypatch):
    """Counts the chunks that really ran split (the control: the path under test ran)."""
    seen: list[tuple[int, int, int]] = []
    real = fast_prefill._split_attend

    def counting(query, key, value, scaling, plan):
        seen.append((plan.pieces, plan.piece, plan.remainder))
        return real(query, key, value, scaling, plan)

    monkeypatch.setattr(fast_prefill, "_split_attend", counting)
    return seen


def _through_the_store(eng, tokens, cut, tmp_path, chunk_bytes=4096):
    """(uninterrupted session, the cut saved, restored from the store and continued)."""
    whole = eng.new_session()
    whole.prefill(tokens)
    part = eng.new_session()
    part.prefill(tokens[:cut])
    store = PackStore.init(os.path.join(tmp_path, "s"), chunk_bytes=chunk_bytes)
    store.save(part)
    resumed = eng.new_session()
    store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), resumed, tokens)
    resumed.prefill(tokens[cut:])
    assert resumed.cache_digest() == whole.cache_digest()
    assert torch.equal(resumed.last_logits, whole.last_logits)
    return whole, part, resumed


@given(q_len=st.integers(1, 1024), prefix=st.integers(0, 300_000))
def test_the_split_plan_covers_the_prefix_exactly(q_len, prefix):
    kv = prefix + q_len
    plan = chunk_attention(SPLIT_KV, q_len, kv)
    if not SplitKV.applies(q_len, kv):
        assert type(plan) is not SplitKV
        assert q_len == 1 or prefix < 2 * fast_prefill.SPLIT_PIECE_ROWS
        return
    assert type(plan) is SplitKV
    assert plan.pieces * plan.piece + plan.remainder == prefix
    assert 2 <= plan.pieces <= fast_prefill.SPLIT_MAX_PIECES
    assert plan.piece % 256 == 0 and plan.piece >= fast_prefill.SPLIT_PIECE_ROWS - 255
    assert 0 <= plan.remainder < plan.piece + 256 * plan.pieces
    # lower_right keeps its one call whatever the prefix
    assert type(chunk_attention("lower_right", q_len, kv)) is not SplitKV


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("kv", [256 * 8 + 128, 256 * 12, 256 * 13 + 128])
def test_split_attention_is_the_same_function_as_one_call(small_pieces, dtype, kv):
    gen = torch.Generator().manual_seed(kv)
    dt = DTYPES[dtype]
    cap = kv + 256
    keys = torch.randn(1, 2, cap, 16, generator=gen).to(dt)[:, :, :kv]  # a view of a larger buffer, as the cache's
    values = torch.randn(1, 2, cap, 16, generator=gen).to(dt)[:, :, :kv]
    query = torch.randn(1, 128, 8, 16, generator=gen).to(dt).transpose(1, 2)
    plan = chunk_attention(SPLIT_KV, 128, kv)
    assert type(plan) is SplitKV and plan.pieces == 3
    one = fast_prefill.attend(query, keys, values, 0.25, fast_prefill.lower_right_bias(128, kv))
    split = fast_prefill.attend(query, keys, values, 0.25, plan)
    assert split.shape == one.shape and split.dtype == one.dtype and split.is_contiguous()
    tol = 1e-5 if dtype == "f32" else 2e-2
    assert torch.allclose(split.float(), one.float(), atol=tol, rtol=tol)
    # a control: a key row of the first piece changed changes the output
    keys[:, :, 3] += 5
    assert not torch.allclose(fast_prefill.attend(query, keys, values, 0.25, plan).float(), split.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("forward", ["lean", "graphs"])
def test_restored_then_continued_equals_uninterrupted(small_pieces, split_calls, forward, tmp_path):
    eng = _engine(forward=forward)
    assert eng.prefill_attention == SPLIT_KV and eng.prefill_forward == forward
    tokens = random_tokens(1300, eng.layout.vocab_size, seed=3)
    whole, part, resumed = _through_the_store(eng, tokens, 768, tmp_path)
    assert split_calls, "no chunk ran split"
    assert any(r for _, _, r in split_calls) and len({p for p, _, _ in split_calls}) > 1
    # a cut handed over in memory agrees too (the prompt's partial last chunk runs the lean
    # forward, with its own split)
    other = eng.new_session()
    transfer_cut(part, other)
    other.prefill(tokens[768:])
    assert other.cache_digest() == whole.cache_digest()
    assert resumed.decode_greedy(6)[0] == whole.decode_greedy(6)[0]


def test_split_kv_is_its_own_identity():
    split, plain = _engine(), _engine(mode="lower_right")
    assert split.identity.engine_abi["prefill"] == fast_prefill.SPLIT_ABI
    assert split.ids() != plain.ids()
    with pytest.raises(EngineError):
        plain.check_identity(split.identity)


def test_split_kv_is_refused_where_it_cannot_run():
    with pytest.raises(EngineError) as exc:
        _engine(forward="model")  # the model's forward would run the attention unsplit
    assert exc.value.category == "unsupported" and "split_kv" in str(exc.value)
    cohere = build_cohere2(seed=0, num_hidden_layers=4, sliding_window=24)
    with pytest.raises(EngineError) as exc:
        TransformersEngine(cohere, threads=2, prefill_chunk_tokens=64, prefill_attention=SPLIT_KV)
    assert exc.value.category == "unsupported"
    assert fast_prefill.split_unsupported_reason("cuda", torch.float32) is not None
    assert fast_prefill.split_unsupported_reason("cuda", torch.float16) is None


@requires_cuda
def test_cuda_f32_is_refused():
    with pytest.raises(EngineError) as exc:
        _engine("f32", device="cuda")
    assert exc.value.category == "unsupported"


@requires_cuda
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_cuda_split_restores_and_continues_bit_exactly(split_calls, dtype, tmp_path):
    """The real policy: a 9,000-token prompt's later chunks split on the device."""
    eng = _engine(dtype, device="cuda", chunk=256)
    assert eng.prefill_forward == "graphs"
    tokens = random_tokens(9000, eng.layout.vocab_size, seed=5)
    whole, _part, resumed = _through_the_store(eng, tokens, 8704, tmp_path, chunk_bytes=1 << 16)
    assert split_calls
    assert resumed.decode_greedy(8)[0] == whole.decode_greedy(8)[0]
    lower = _engine(dtype, device="cuda", mode="lower_right", chunk=256).new_session()
    lower.prefill(tokens)
    assert torch.allclose(lower.last_logits, whole.last_logits, atol=5e-2, rtol=5e-2)


def test_the_environment_picks_auto_s_attention(monkeypatch):
    monkeypatch.setenv("KVPACK_PREFILL_ATTENTION", "split_kv")
    assert _engine(mode="auto").prefill_attention == SPLIT_KV
    assert _engine(mode="lower_right").prefill_attention == "lower_right"  # an explicit choice wins
    monkeypatch.setenv("KVPACK_PREFILL_ATTENTION", "fastest")
    with pytest.raises(EngineError) as exc:
        _engine(mode="auto")
    assert exc.value.category == "unsupported" and "KVPACK_PREFILL_ATTENTION" in str(exc.value)
