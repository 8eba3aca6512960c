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

from .conftest import DTYPES, assert_same_session, random_tokens, requires_cuda

torch = pytest.importorskip("torch")

LENGTHS = [1, 255, 256, 257, 700, 1030]


def _pair(dtype: str = "f32", device: str = "cpu", forward: str = "lean", **kw):
    """A model-forward engine and a ``forward`` engine (lean or graphs) over one model."""
    loaded = build_llama(seed=0, num_hidden_layers=3, max_position_embeddings=2048, **kw)
    loaded.model = loaded.model.to(DTYPES[dtype])
    engines = {}
    for name in ("model", forward):
        engines[name] = TransformersEngine(loaded, threads=2, prefill_chunk_tokens=256, device=device, prefill_attention="lower_right", prefill_forward=name)
    return engines["model"], engines[forward]


@pytest.fixture(scope="module", params=[(dtype, forward) for forward in ("lean", "graphs") for dtype in ("f32", "bf16", "f16")], ids=str)
def pair(request):
    dtype, forward = request.param
    return _pair(dtype, forward=forward)


def test_lean_prefill_is_bit_identical_to_the_model_forward(pair):
    model, lean = pair
    assert model.prefill_forward == "model" and lean.prefill_forward in ("lean", "graphs")
    tokens = random_tokens(max(LENGTHS), model.layout.vocab_size, seed=3)
    for n in LENGTHS:
        a, b = model.new_session(), lean.new_session()
        a.prefill(tokens[:n])
        b.prefill(tokens[:n])
        assert_same_session(a, b)


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
    assert_same_session(whole, resumed)


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
    assert_same_session(a, b)
    # and a prefill after decode (not chunk-aligned any more) stays identical
    a.prefill(tokens[:300])
    b.prefill(tokens[:300])
    assert_same_session(a, b)


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
    norm = loaded.model.model.layers[0].input_layernorm
    norm.forward = lambda hidden: hidden  # what kernelize() does to a module, in kind
    assert "replaced forward" in (lean_prefill.unsupported_reason(loaded.model, "lower_right") or "")
    del norm.forward
    assert lean_prefill.unsupported_reason(loaded.model, "lower_right") is None
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
    assert_same_session(a, s)


@requires_cuda
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_cuda_lean_prefill_is_bit_identical(dtype):
    model, lean = _pair(dtype, device="cuda")
    tokens = random_tokens(max(LENGTHS), model.layout.vocab_size, seed=3)
    for n in LENGTHS:
        a, b = model.new_session(), lean.new_session()
        a.prefill(tokens[:n])
        b.prefill(tokens[:n])
        assert_same_session(a, b)
    whole = model.new_session()
    whole.prefill(tokens[:900])
    part = lean.new_session()
    part.prefill(tokens[:512])
    resumed = lean.new_session()
    transfer_cut(part, resumed)
    resumed.prefill(tokens[512:900])
    assert_same_session(whole, resumed)
    out_a, _ = whole.decode_greedy(8)
    out_b, _ = resumed.decode_greedy(8)
    assert out_a == out_b
    assert_same_session(whole, resumed)


@requires_cuda
def test_cuda_auto_selects_the_graph_forward_where_it_can(monkeypatch):
    monkeypatch.delenv(PREFILL_FORWARD_ENV, raising=False)
    loaded = build_llama(seed=0, num_hidden_layers=2)
    loaded.model = loaded.model.to(torch.float16)
    eng = TransformersEngine(loaded, threads=2, device="cuda")
    assert (eng.prefill_attention, eng.prefill_forward) == ("lower_right", "graphs")
    dynamic = build_llama(seed=0, num_hidden_layers=2)
    dynamic.model.model.rotary_emb.rope_type = "dynamic"  # frequencies updated on the host
    assert TransformersEngine(dynamic, threads=2, device="cuda").prefill_forward == "lean"


@requires_cuda
def test_concurrent_sessions_on_one_cuda_graphs_engine_stay_exact():
    """The captured runner's static buffers under sessions prefilling at once, each thread
    on its own stream (the ordering between chunks then rests on the runner's event)."""
    _prefill_at_once(*_pair("f16", device="cuda", forward="graphs"), tokens=1024, seed=20, own_streams=True)


@pytest.mark.parametrize("forward", ["lean", "graphs"])
def test_a_cache_out_of_step_with_the_position_is_refused(forward):
    """The chunk's attention bias is made for ``position + n`` key rows; a cache holding
    another count (here: a token recorded without its rows) is refused before anything is
    computed, not attended with a misaligned mask. The next chunk is a full one (position
    256), so ``graphs`` takes its segmented path."""
    _, engine = _pair(forward=forward)
    tokens = random_tokens(600, engine.layout.vocab_size, seed=4)
    s = engine.new_session()
    s.prefill(tokens[:255])
    s.tokens.append(tokens[255])  # position 256, 255 cached rows
    with pytest.raises(EngineError) as exc:
        s.prefill(tokens[256:512])
    assert exc.value.category == "layout"
    assert "expected 256" in str(exc.value)
    assert s.position == 256 and all(layer.get_seq_length() == 255 for layer in s.cache.layers)  # nothing appended


def test_graph_segments_run_the_full_chunks():
    """``graphs`` takes the segmented runner for every full chunk (on the CPU eagerly) and the
    lean forward for partial ones; it is its own identity."""
    from kvpack.engine import graph_prefill

    model, graphs = _pair(forward="graphs")
    assert graphs.identity.engine_abi["prefill_forward"] == graph_prefill.ABI_RECORD
    assert len({model.ids(), graphs.ids(), _pair()[1].ids()}) == 3
    s = graphs.new_session()
    s.prefill(random_tokens(600, graphs.layout.vocab_size, seed=1))
    runner = graphs._segmented
    assert runner.graphs is None and runner.n == 256  # CPU: eager segments, nothing captured
    first = runner
    s.prefill(random_tokens(256, graphs.layout.vocab_size, seed=2))
    assert graphs._segmented is first  # same tensors: the runner is kept
    with torch.no_grad():
        graphs.model.lm_head.weight = torch.nn.Parameter(graphs.model.lm_head.weight.clone())
    graphs.new_session().prefill(random_tokens(256, graphs.layout.vocab_size, seed=2))
    assert graphs._segmented is not first  # new tensors: rebuilt (graphs bind memory)
    graphs.prefill_chunk_tokens = 128  # another grid on the same engine (diag_prefill_chunks does this)
    try:
        graphs.new_session().prefill(random_tokens(256, graphs.layout.vocab_size, seed=2))
        assert graphs._segmented.n == 128
    finally:
        graphs.prefill_chunk_tokens = 256


def test_graph_chunks_refuse_other_shapes_and_rope_updates():
    from kvpack.engine import graph_prefill
    from kvpack.engine.lean_prefill import plan

    _, graphs = _pair(forward="graphs")
    runner = graph_prefill.SegmentedChunk(plan(graphs.model), 256, torch.device("cpu"), capture=False)
    with pytest.raises(EngineError) as exc:
        runner.forward(graphs.new_session().cache.layers, torch.zeros((1, 100), dtype=torch.long), 0)
    assert exc.value.category == "layout"
    loaded = build_llama(seed=0, num_hidden_layers=2)
    loaded.model.model.rotary_emb.rope_type = "dynamic"
    assert "rope type dynamic" in (graph_prefill.unsupported_reason(loaded.model) or "")
    with pytest.raises(EngineError) as exc:
        TransformersEngine(loaded, threads=2, prefill_attention="lower_right", prefill_forward="graphs")
    assert exc.value.category == "unsupported"


@requires_cuda
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_cuda_graph_prefill_is_bit_identical(dtype):
    model, graphs = _pair(dtype, device="cuda", forward="graphs")
    tokens = random_tokens(1030, model.layout.vocab_size, seed=3)
    for n in (256, 700, 1030):
        a, b = model.new_session(), graphs.new_session()
        a.prefill(tokens[:n])
        b.prefill(tokens[:n])
        assert_same_session(a, b)
    assert graphs._segmented.graphs is not None  # captured on the device
    part = graphs.new_session()
    part.prefill(tokens[:512])
    resumed = graphs.new_session()
    transfer_cut(part, resumed)
    resumed.prefill(tokens[512:1030])
    whole = model.new_session()
    whole.prefill(tokens)
    assert_same_session(whole, resumed)
    assert whole.decode_greedy(8)[0] == resumed.decode_greedy(8)[0]
    assert_same_session(whole, resumed)


def _prefill_at_once(model, graphs, tokens: int, seed: int, own_streams: bool) -> None:
    """Four sessions prefill different prompts at once on ``graphs`` (each thread on its own
    CUDA stream with ``own_streams``); each must match its prompt's digest on ``model``."""
    import contextlib
    import threading

    prompts = [random_tokens(tokens, graphs.layout.vocab_size, seed=seed + i) for i in range(4)]
    want = []
    for p in prompts:
        s = model.new_session()
        s.prefill(p)
        want.append(s.cache_digest())
    got: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        with torch.cuda.stream(torch.cuda.Stream()) if own_streams else contextlib.nullcontext():
            s = graphs.new_session()
            start.wait()
            s.prefill(prompts[i])
            if own_streams:
                torch.cuda.current_stream().synchronize()
            got[i] = s.cache_digest()

    graphs.new_session().prefill(prompts[0][:256])  # build (capture) the runner before the race
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == want


def test_concurrent_sessions_on_one_graphs_engine_stay_exact():
    """The segmented runner's ids, positions and attention outputs are static buffers shared
    by every session of the engine (a daemon prefills several sessions on one engine at
    once): concurrent full chunks must not read each other's rows."""
    _prefill_at_once(*_pair(forward="graphs"), tokens=768, seed=10, own_streams=False)
