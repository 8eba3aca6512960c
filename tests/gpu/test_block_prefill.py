"""Block prefill (TransformersEngine ``prefill_block_chunks``): several grid chunks per call.

The contract is the grid's: a prefill in blocks leaves every K/V plane and logits row bit for
bit as the 256-token grid does, ``on_chunk`` sees each chunk's cut (position, logits, rows)
as the grid leaves it, a failure or a callback's exception leaves a consistent cut, and an
engine whose blocks do not reproduce the grid on its device falls back to one chunk at a
time after its probe. On the CPU the lean and graphs (eager) forwards run; the CUDA test
runs the same comparison on the device, where blocks are the default."""

from __future__ import annotations

import pytest

from kvpack.engine import lean_prefill
from kvpack.engine.models import build_llama
from kvpack.engine.transformers_adapter import PREFILL_BLOCK_ENV, EngineSession, TransformersEngine, transfer_cut
from kvpack.errors import EngineError

from .conftest import DTYPES, assert_same_session, random_tokens, requires_cuda

torch = pytest.importorskip("torch")

LENGTHS = [300, 1024, 1030, 1300, 2304, 2600]


def _engines(dtype: str = "f32", device: str = "cpu", forward: str = "lean", blocks: int = 4):
    """A grid engine (one chunk per call) and a block engine over one model."""
    loaded = build_llama(seed=0, num_hidden_layers=3, max_position_embeddings=4096)
    loaded.model = loaded.model.to(DTYPES[dtype])
    kw = dict(threads=2, prefill_chunk_tokens=256, device=device, prefill_attention="lower_right", prefill_forward=forward)
    return TransformersEngine(loaded, prefill_block_chunks=1, **kw), TransformersEngine(loaded, prefill_block_chunks=blocks, **kw)


def _count_blocks(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = EngineSession._forward_block

    def spy(self, ids, *args, **kw):
        calls.append(len(ids))
        return real(self, ids, *args, **kw)

    monkeypatch.setattr(EngineSession, "_forward_block", spy)
    return calls


@pytest.fixture(scope="module", params=[(d, f) for f in ("lean", "graphs") for d in ("f32", "bf16")], ids=str)
def engines(request):
    dtype, forward = request.param
    return _engines(dtype, forward=forward)


def test_blocks_equal_the_grid(engines, monkeypatch):
    grid, blocks = engines
    assert blocks.block_tokens() == 1024 and blocks.block_reason is None  # the probe passed
    assert grid.block_tokens() == 256
    calls = _count_blocks(monkeypatch)
    tokens = random_tokens(max(LENGTHS), grid.layout.vocab_size, seed=5)
    for n in LENGTHS:
        a, b = grid.new_session(), blocks.new_session()
        a.prefill(tokens[:n])
        b.prefill(tokens[:n])
        assert_same_session(a, b)
    assert calls and set(calls) == {1024}  # blocks really ran (and only for whole blocks)
    # after an unaligned start (a decode), a block starts at the next grid boundary
    a, b = grid.new_session(), blocks.new_session()
    for s in (a, b):
        s.prefill(tokens[:100])
        s.decode_greedy(3)
        s.prefill(tokens[103:1500])
    assert_same_session(a, b)
    assert a.decode_greedy(5)[0] == b.decode_greedy(5)[0]


def test_on_chunk_sees_every_cut_as_the_grid_leaves_it(engines):
    grid, blocks = engines
    tokens = random_tokens(2600, grid.layout.vocab_size, seed=6)
    seen: dict[str, list] = {"grid": [], "blocks": []}
    for name, engine in (("grid", grid), ("blocks", blocks)):

        def record(s, out=seen[name]) -> None:
            rows = {layer.get_seq_length() for layer in s.cache.layers}
            out.append((s.position, rows, s.last_logits.clone(), s.cache_digest()))

        engine.new_session().prefill(tokens, on_chunk=record)
    assert [p for p, *_ in seen["grid"]] == [256 * i for i in range(1, 11)] + [2600]
    assert len(seen["grid"]) == len(seen["blocks"])
    for (pa, ra, la, da), (pb, rb, lb, db) in zip(seen["grid"], seen["blocks"]):
        assert pa == pb and ra == rb == {pa}
        assert torch.equal(la, lb) and da == db


def test_a_cut_shown_inside_a_block_restores_and_continues_exactly(engines):
    grid, blocks = engines
    tokens = random_tokens(2304, grid.layout.vocab_size, seed=7)
    donor = blocks.new_session()
    kept: dict[int, EngineSession] = {}

    def keep(s) -> None:
        if s.position == 768:  # the third chunk of the first block
            cut = blocks.new_session()
            transfer_cut(s, cut)
            kept[768] = cut

    donor.prefill(tokens, on_chunk=keep)
    resumed = kept[768]
    resumed.prefill(tokens[768:])
    whole = grid.new_session()
    whole.prefill(tokens)
    assert_same_session(whole, resumed)
    assert_same_session(whole, donor)


def test_a_callback_that_raises_leaves_that_cut(engines):
    grid, blocks = engines
    tokens = random_tokens(2048, grid.layout.vocab_size, seed=8)

    def stop_at_512(s) -> None:
        if s.position == 512:
            raise KeyboardInterrupt

    s = blocks.new_session()
    with pytest.raises(KeyboardInterrupt):
        s.prefill(tokens, on_chunk=stop_at_512)
    assert s.position == 512 and all(layer.get_seq_length() == 512 for layer in s.cache.layers)
    s.prefill(tokens[512:])  # the rows written past the cut are overwritten, not reused
    whole = grid.new_session()
    whole.prefill(tokens)
    assert_same_session(whole, s)


def test_a_failing_block_leaves_the_session_where_it_was(monkeypatch):
    grid, blocks = _engines(forward="lean")
    tokens = random_tokens(1536, grid.layout.vocab_size, seed=9)
    s = blocks.new_session()
    s.prefill(tokens[:256])
    calls = {"n": 0}
    real = lean_prefill.attend_chunks

    def fail_in_layer_2(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fault")
        return real(*args, **kw)

    assert blocks.block_tokens() == 1024
    monkeypatch.setattr(lean_prefill, "attend_chunks", fail_in_layer_2)
    with pytest.raises(RuntimeError):
        s.prefill(tokens[256:1280])
    assert s.position == 256 and all(layer.get_seq_length() == 256 for layer in s.cache.layers)
    monkeypatch.undo()
    s.prefill(tokens[256:])
    whole = grid.new_session()
    whole.prefill(tokens)
    assert_same_session(whole, s)


def test_blocks_that_differ_from_the_grid_are_turned_off(monkeypatch):
    """The probe can fail: a block forward nudged by one ulp in its last logits row is caught
    before any prefill uses it, and the engine keeps one chunk per call."""
    real = lean_prefill.forward_block

    def nudged(*args, **kw):
        rows = real(*args, **kw)
        rows[-1] = torch.nextafter(rows[-1], rows[-1] + 1)
        return rows

    monkeypatch.setattr(lean_prefill, "forward_block", nudged)
    grid, blocks = _engines(forward="lean")
    calls = _count_blocks(monkeypatch)
    with pytest.warns(RuntimeWarning, match="did not reproduce the grid"):
        assert blocks.block_tokens() == 256
    assert blocks.block_chunks == 1 and "did not reproduce" in (blocks.block_reason or "")
    calls.clear()
    tokens = random_tokens(2048, grid.layout.vocab_size, seed=10)
    a, b = grid.new_session(), blocks.new_session()
    a.prefill(tokens)
    b.prefill(tokens)
    assert_same_session(a, b)
    assert calls == []


def test_block_settings_are_checked(monkeypatch):
    loaded = build_llama(seed=0, num_hidden_layers=2, max_position_embeddings=2048)
    kw = dict(threads=2, prefill_attention="lower_right", prefill_forward="lean")
    for bad in (0, 65, -1, True, 2.0, "4"):
        with pytest.raises(EngineError) as exc:
            TransformersEngine(loaded, prefill_block_chunks=bad, **kw)
        assert exc.value.category == "unsupported"
    monkeypatch.setenv(PREFILL_BLOCK_ENV, "four")
    with pytest.raises(EngineError) as exc:
        TransformersEngine(loaded, **kw)
    assert exc.value.category == "unsupported" and PREFILL_BLOCK_ENV in str(exc.value)
    monkeypatch.setenv(PREFILL_BLOCK_ENV, "8")
    assert TransformersEngine(loaded, **kw).block_chunks == 8
    monkeypatch.delenv(PREFILL_BLOCK_ENV)
    assert TransformersEngine(loaded, **kw).block_chunks == 1  # the CPU default
    model = TransformersEngine(loaded, threads=2, prefill_attention="lower_right", prefill_forward="model", prefill_block_chunks=4)
    assert model.block_chunks == 1 and model.block_tokens() == 256  # the model's forward: one chunk per call
    short = TransformersEngine(build_llama(seed=0, num_hidden_layers=2, max_position_embeddings=512), prefill_block_chunks=4, **kw)
    assert short.block_tokens() == 256 and "max_context" in (short.block_reason or "")


@requires_cuda
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_cuda_blocks_equal_the_grid(dtype, monkeypatch):
    grid, blocks = _engines(dtype, device="cuda", forward="graphs")
    assert blocks.block_tokens() == 1024, blocks.block_reason
    calls = _count_blocks(monkeypatch)
    tokens = random_tokens(2600, grid.layout.vocab_size, seed=11)
    for n in (1024, 1300, 2600):
        a, b = grid.new_session(), blocks.new_session()
        a.prefill(tokens[:n])
        b.prefill(tokens[:n])
        assert_same_session(a, b)
    assert calls and blocks._segmented_block.graphs is not None  # captured on the device
    assert a.decode_greedy(8)[0] == b.decode_greedy(8)[0]


def test_a_daemon_runs_the_probe_at_start_not_in_its_first_request(monkeypatch):
    """``kvpack producer`` / ``receiver`` load the engine through ``commands.node._engine``,
    which runs the block probe there (``prepare``); the first prefill then runs no probe."""
    import argparse

    from kvpack.commands import node as node_commands
    from kvpack.node import common

    _grid, blocks = _engines(forward="lean", blocks=2)
    probes: list[int] = []
    real_probe = TransformersEngine._probe_blocks

    def counted(self):
        probes.append(self.block_chunks)
        return real_probe(self)

    monkeypatch.setattr(TransformersEngine, "_probe_blocks", counted)
    monkeypatch.setattr(common, "load_engine", lambda spec, threads=None: blocks)
    loaded = node_commands._engine(argparse.Namespace(engine="test-llama", threads=2))
    assert loaded is blocks and probes == [2] and blocks.block_reason is None
    session = blocks.new_session()
    session.prefill(random_tokens(1100, blocks.layout.vocab_size, seed=11))
    assert probes == [2] and session.position == 1100
