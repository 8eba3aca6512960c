"""The disaggregated-prefill pieces between kvpack's node classes and vLLM's blocks, on real
tensors in vLLM's CPU layout (no vLLM process): the consumer's install target writes a
request's blocks only on commit and only for the transfer it waits for; the producer's outbox
hands one finished prefill's rows to one consumer and frees its blocks.

The end-to-end path (two vLLM processes, mTLS, a tampered transfer) is
tests/integrations/test_vllm_disagg.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvpack.errors import EngineError, ProtocolError  # noqa: E402
from kvpack.integrations.vllm.disagg import _BlockTarget, _Outbox, _VllmEngine  # noqa: E402
from kvpack.integrations.vllm.meta import RecvSpec, SendSpec  # noqa: E402
from kvpack.integrations.vllm.paged import PagedKV  # noqa: E402
from kvpack.integrations.vllm.settings import Settings  # noqa: E402

from .test_vllm_paged import LAYOUT, TOKENS, _identity, paged_caches  # noqa: E402

BLOCKS = (9, 3, 14, 0, 7, 21, 2, 30)  # a shuffled block table: 8 blocks of 32 rows


def _engine(role: str = "kv_consumer", caches=None) -> _VllmEngine:
    settings = Settings.from_extra(role, {"kvpack.node_config": "/unused/config.json", "kvpack.transfer_wait_s": 0.2})
    sent: list[int] = []
    eng = _VllmEngine(_identity(), PagedKV(caches or paged_caches()), 4096, settings, _Outbox(), sent.append)
    eng.sent = sent  # type: ignore[attr-defined]
    return eng


def _rows(engine: _VllmEngine, n: int, seed: int = 5) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((2, n, s.row_elements), generator=g) for s in engine.layout.layers]


def _fill(install, rows) -> None:
    for layer, plane in enumerate(rows):
        for i, role in enumerate(("k", "v")):
            install.write_rows(layer, role, 0, memoryview(plane[i].contiguous().view(torch.uint8).numpy()))


def _snapshot(engine: _VllmEngine) -> list:
    return [p.clone() for p in engine.paged.planes]


def _unchanged(engine: _VllmEngine, before: list) -> bool:
    return all(torch.equal(a, b) for a, b in zip(engine.paged.planes, before))


def test_a_commit_writes_only_the_rows_vllm_lacks_into_the_requests_blocks():
    eng = _engine()
    prompt = tuple(TOKENS[:200])
    spec = RecvSpec("r1", prompt, len(prompt) - 1, BLOCKS, {"request_id": "r1"}, local=64)
    before = _snapshot(eng)
    rows = _rows(eng, spec.position)
    with _BlockTarget(eng, spec).begin_install(spec.position, prompt[: spec.position], eng.identity) as install:
        _fill(install, rows)
        assert _unchanged(eng, before)  # staged only: nothing reaches vLLM's blocks before commit
        install.commit(require_logits=False)
    for layer, plane in enumerate(rows):
        got = eng.paged.gather(layer, BLOCKS, 0, spec.position)
        assert torch.equal(got[:, 64:], plane[:, 64:])
        old = PagedKV(paged_caches()).gather(layer, BLOCKS, 0, 64)
        assert torch.equal(got[:, :64], old)  # rows vLLM already held are left alone
    untouched = [b for b in range(64) if b not in BLOCKS[:7]]
    for layer, plane in enumerate(eng.paged.planes):
        assert torch.equal(plane[untouched], before[layer][untouched])


@pytest.mark.parametrize("case", ["abort", "incomplete", "other_position", "other_prompt", "other_identity", "no_receive"])
def test_refused_or_unfinished_installs_write_nothing(case):
    eng = _engine()
    prompt = tuple(TOKENS[:200])
    spec = RecvSpec("r1", prompt, len(prompt) - 1, BLOCKS, {"request_id": "r1"})
    before = _snapshot(eng)
    target = _BlockTarget(eng, None if case == "no_receive" else spec)
    if case in ("other_position", "other_prompt", "other_identity", "no_receive"):
        position = spec.position - 1 if case == "other_position" else spec.position
        tokens = list(prompt[:position])
        if case == "other_prompt":
            tokens[3] += 1
        identity = _identity(block_size=64) if case == "other_identity" else eng.identity
        with pytest.raises(EngineError):
            target.begin_install(position, tokens, identity)
    else:
        rows = _rows(eng, spec.position)
        install = target.begin_install(spec.position, prompt[: spec.position], eng.identity)
        if case == "abort":
            _fill(install, rows)
            install.abort()
            with pytest.raises(EngineError):
                install.commit(require_logits=False)
        else:
            install.write_rows(0, "k", 0, memoryview(rows[0][0].contiguous().view(torch.uint8).numpy()))
            with pytest.raises(EngineError):
                install.commit(require_logits=False)
    assert _unchanged(eng, before)


def test_the_outbox_hands_one_prefill_to_one_consumer_and_frees_its_blocks():
    eng = _engine("kv_producer")
    prompt = tuple(TOKENS[:200])
    eng.outbox.add(SendSpec("p1", prompt, BLOCKS, deadline_unix=1e18))
    with pytest.raises(ProtocolError):  # another prompt is never served from these blocks
        eng.outbox.take_rows(tuple(TOKENS[1:100]), 0, eng.paged, 0.05)
    session = eng.new_session()
    session.prefill(prompt[:-1])
    for layer in range(len(LAYOUT.layers)):
        want = eng.paged.gather(layer, BLOCKS, 0, len(prompt) - 1)
        for i, role in enumerate(("k", "v")):
            assert bytes(session.export_rows(layer, role, 0, len(prompt) - 1)) == bytes(want[i].contiguous().view(torch.uint8).numpy())
    assert eng.outbox.done == {"p1"} and not eng.outbox.entries  # released: vLLM may free the blocks
    assert eng.sent and eng.sent[0] > 0
    with pytest.raises(ProtocolError):  # claimed once: a second consumer waits and is refused
        eng.new_session().prefill(prompt[:-1])


def test_an_unfetched_prefill_is_freed_at_its_deadline():
    eng = _engine("kv_producer")
    eng.outbox.add(SendSpec("p1", tuple(TOKENS[:50]), BLOCKS[:2], deadline_unix=0.0))
    eng.outbox.expire()
    assert eng.outbox.done == {"p1"} and not eng.outbox.entries
