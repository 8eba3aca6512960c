"""DetachedInstall refusals: abort, identity and layout mismatches leave the live session as it was."""

from __future__ import annotations

import pytest
import torch
from conftest import THREADS, random_tokens

from kvpack.engine.models import build_cohere2
from kvpack.engine.transformers_adapter import TransformersEngine, transfer_cut
from kvpack.errors import EngineError


def _snapshot(session):
    logits = None if session.last_logits is None else session.last_logits.clone()
    return list(session.tokens), session.cache_digest(), logits, session.cache


def _assert_unchanged(session, snap):
    tokens, digest, logits, cache = snap
    assert session.tokens == tokens
    assert session.cache is cache  # not even replaced by an equal object
    assert session.cache_digest() == digest
    assert torch.equal(session.last_logits, logits)


@pytest.fixture
def source(cohere2_engine):
    s = cohere2_engine.new_session()
    s.prefill(random_tokens(150, 512, seed=5))
    return s


@pytest.fixture
def live(cohere2_engine):
    """A live session with its own, different context: what an install must not disturb."""
    s = cohere2_engine.new_session()
    s.prefill(random_tokens(90, 512, seed=6))
    return s


def _fill(install, source, skip=None):
    for layer, role in source.layout.states():
        if (layer, role) == skip:
            continue
        lo, hi = install.required_range(layer)
        install.write_rows(layer, role, lo, source.export_rows(layer, role, lo, hi))


def test_abort_after_a_full_fill_leaves_the_live_session_unchanged(cohere2_engine, source, live):
    snap = _snapshot(live)
    install = live.begin_install(source.position, source.tokens, cohere2_engine.identity)
    _fill(install, source)
    install.write_logits(source.export_logits())
    install.abort()
    _assert_unchanged(live, snap)
    with pytest.raises(EngineError) as err:
        install.commit()
    assert err.value.category == "install"
    _assert_unchanged(live, snap)
    # The untouched session still decodes like a twin that never saw the install.
    twin = cohere2_engine.new_session()
    twin.prefill(random_tokens(90, 512, seed=6))
    assert live.decode_greedy(4)[0] == twin.decode_greedy(4)[0]


def test_identity_mismatch_refuses_before_anything_is_written(cohere2_engine, source, live):
    snap = _snapshot(live)
    other = TransformersEngine(build_cohere2(seed=1), threads=THREADS, prefill_chunk_tokens=64)
    with pytest.raises(EngineError) as err:
        live.begin_install(source.position, source.tokens, other.identity)
    assert err.value.category == "identity" and "weights_config" in err.value.message
    _assert_unchanged(live, snap)


@pytest.mark.parametrize(
    "change",
    [
        lambda ident: ident.replace(scalars={**ident.scalars, "live.logit_scale": 0.0625 * (1 + 2**-52)}),
        lambda ident: ident.replace(tokenizer_digest="ab" * 32),
        lambda ident: ident.replace(weight_precision="bfloat16"),
        lambda ident: ident.replace(engine_abi={**ident.engine_abi, "threads": 16}),
    ],
    ids=["one-scalar-ulp", "tokenizer", "precision", "thread-count"],
)
def test_any_identity_change_is_refused(cohere2_engine, source, live, change):
    snap = _snapshot(live)
    claimed = change(cohere2_engine.identity)
    assert claimed.semantic_model_id_bytes() != cohere2_engine.identity.semantic_model_id_bytes()
    with pytest.raises(EngineError) as err:
        live.begin_install(source.position, source.tokens, claimed)
    assert err.value.category == "identity"
    # Raw Id32 values (what a pack carries) are refused the same way.
    with pytest.raises(EngineError):
        live.begin_install(source.position, source.tokens, claimed.ids())
    _assert_unchanged(live, snap)


def test_llama_cache_cannot_be_installed_into_cohere2(cohere2_engine, llama_engine, live):
    src = llama_engine.new_session()
    src.prefill(random_tokens(40, 512))
    snap = _snapshot(live)
    with pytest.raises(EngineError) as err:
        transfer_cut(src, live)
    assert err.value.category == "identity"
    _assert_unchanged(live, snap)


@pytest.mark.parametrize(
    "bad_write, category",
    [
        # rows of another width (3 rows of head_dim 8): not a whole number of 128-byte rows
        (lambda inst, src: inst.write_rows(3, "k", 0, bytes(3 * 2 * 8 * 4)), "layout"),
        # rows beyond the cut
        (lambda inst, src: inst.write_rows(3, "k", 100, bytes(51 * 2 * 16 * 4)), "layout"),
        # evicted rows of a windowed layer (only [127, 150) are needed at cut 150)
        (lambda inst, src: inst.write_rows(0, "k", 0, bytes(23 * 2 * 16 * 4)), "layout"),
        (lambda inst, src: inst.write_rows(9, "k", 0, b""), "layout"),
        (lambda inst, src: inst.write_rows(0, "q", 127, b""), "layout"),
        (lambda inst, src: inst.write_logits(bytes(511 * 4)), "layout"),
        # the same rows twice
        (lambda inst, src: inst.write_rows(3, "v", 0, src.export_rows(3, "v", 0, 10)), "install"),
    ],
)
def test_layout_mismatch_refuses_and_installs_nothing(cohere2_engine, source, live, bad_write, category):
    snap = _snapshot(live)
    install = live.begin_install(source.position, source.tokens, cohere2_engine.identity)
    install.write_rows(3, "v", 0, source.export_rows(3, "v", 0, 150))
    with pytest.raises(EngineError) as err:
        bad_write(install, source)
    assert err.value.category == category
    install.abort()
    _assert_unchanged(live, snap)


def test_incomplete_install_cannot_commit(cohere2_engine, source, live):
    snap = _snapshot(live)
    install = live.begin_install(source.position, source.tokens, cohere2_engine.identity)
    _fill(install, source, skip=(6, "v"))
    install.write_logits(source.export_logits())
    assert install.missing() == [(6, "v", 23)]
    with pytest.raises(EngineError) as err:
        install.commit()
    assert err.value.category == "install"
    _assert_unchanged(live, snap)
    # Completing it makes the commit go through, and only then does the session change.
    lo, hi = install.required_range(6)
    install.write_rows(6, "v", lo, source.export_rows(6, "v", lo, hi))
    install.commit()
    assert live.tokens == source.tokens and live.cache_digest() == source.cache_digest()
    with pytest.raises(EngineError):
        install.write_rows(6, "v", lo, b"")


def test_a_cut_without_final_logits_cannot_commit_for_generation(cohere2_engine, source, live):
    snap = _snapshot(live)
    install = live.begin_install(source.position, source.tokens, cohere2_engine.identity)
    _fill(install, source)
    with pytest.raises(EngineError) as err:
        install.commit()
    assert err.value.category == "install"
    _assert_unchanged(live, snap)


def test_rows_may_arrive_in_pieces_and_any_order(cohere2_engine, source, live):
    install = live.begin_install(source.position, source.tokens, cohere2_engine.identity)
    for layer, role in reversed(source.layout.states()):
        lo, hi = install.required_range(layer)
        mid = (lo + hi) // 2
        install.write_rows(layer, role, mid, source.export_rows(layer, role, mid, hi))
        install.write_rows(layer, role, lo, bytes(source.export_rows(layer, role, lo, mid)))
    install.write_logits(bytearray(source.export_logits()))
    install.commit()
    assert live.cache_digest() == source.cache_digest()


@pytest.mark.parametrize("cut, tokens", [(0, []), (3, [1, 2]), (2, [1, 600])])
def test_bad_cut_or_tokens_are_refused(cohere2_engine, live, cut, tokens):
    with pytest.raises(EngineError) as err:
        live.begin_install(cut, tokens, cohere2_engine.identity)
    assert err.value.category == "install"


def test_identity_bytes_are_stable_across_processes(cohere2_engine):
    """A pack written by one process must be reachable from another: the identity (and so
    the SemanticModelId and family bytes) is recomputed there from scratch, equal."""
    import subprocess
    import sys

    code = (
        "from kvpack.engine.models import build_cohere2\n"
        "from kvpack.engine.transformers_adapter import TransformersEngine\n"
        f"e = TransformersEngine(build_cohere2(seed=0, num_hidden_layers=8, sliding_window=24), threads={THREADS}, "
        "prefill_chunk_tokens=64)\n"
        "print(e.ids().encode().hex())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert bytes.fromhex(out.stdout.strip().splitlines()[-1]) == cohere2_engine.ids().encode()
