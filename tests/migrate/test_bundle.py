"""Session bundle v1: exact round trip, seal/open, every refusal, identity binding, and the
bit-exact adoption proof with the real SmolLM2 (decode after adoption == decode on the source)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvpack.engine.arrays import ArrayEngine, array_layout
from kvpack.errors import MigrationError
from kvpack.migrate import bundle as B
from kvpack.migrate import machine as M
from kvpack.migrate.registry import greedy


@pytest.fixture(scope="module")
def engine():
    return ArrayEngine(array_layout(layers=3, kv_heads=2, head_dim=16, vocab=64, windowed={1: 5}))


def make(engine, n=70):
    s = engine.new_session()
    s.prefill([(i * 5) % 64 for i in range(n)])
    plain = B.export_bundle(
        s, session_id="sess-b", revision=3, sampler={"kind": "greedy"}, rng={"seed": 7}, messages=[{"role": "user", "content": "hi \u00e9"}]
    )
    return s, plain


def test_round_trip_and_adoption_is_bit_exact(engine):
    s, plain = make(engine)
    b = B.decode_bundle(plain)
    assert b.record["revision"] == 3 and b.record["cut"] == 70 and b.record["messages"][0]["content"] == "hi \u00e9"
    assert B.encode_bundle({k: v for k, v in b.record.items() if k != "files"}, b.files) == plain
    key = B.new_transport_key()
    sealed = B.seal(plain, key, segment=B.MIN_SEGMENT)
    assert len(sealed) == B.sealed_size(len(plain), B.MIN_SEGMENT)
    s2, rec = B.adopt_bundle(B.open_sealed(sealed, key), engine)
    assert s2.cache_digest() == s.cache_digest() and s2.tokens == s.tokens
    assert greedy(s, 6) == greedy(s2, 6)


def test_refusals(engine):
    s, plain = make(engine, 2000)  # > 1 segment at the minimum segment size
    key = B.new_transport_key()
    sealed = B.seal(plain, key, segment=B.MIN_SEGMENT)
    assert (len(sealed) - 32) > B.MIN_SEGMENT
    for pos in (0, 12, 30, 40, len(sealed) // 2, len(sealed) - 1):
        bad = bytearray(sealed)
        bad[pos] ^= 1
        with pytest.raises(MigrationError) as e:
            B.open_sealed(bytes(bad), key)
        assert e.value.category == "integrity"
    with pytest.raises(MigrationError, match="authentication"):
        B.open_sealed(sealed, B.new_transport_key())
    with pytest.raises(MigrationError):
        B.open_sealed(sealed[:-1], key)
    with pytest.raises(MigrationError):
        B.open_sealed(sealed + b"\0", key)
    for mutate in (lambda p: p[:-1], lambda p: p + b"\0", lambda p: p[:8] + b"\x02" + p[9:], lambda p: p[:20] + b" " + p[21:]):
        with pytest.raises(MigrationError) as e:
            B.decode_bundle(mutate(plain))
        assert e.value.category == "integrity"
    # a flipped byte inside a file: the record's SHA-256 no longer matches
    bad = bytearray(plain)
    bad[-10] ^= 0xFF
    with pytest.raises(MigrationError, match="SHA-256"):
        B.decode_bundle(bytes(bad))


def test_identity_mismatch_refused_before_install():
    a = ArrayEngine(array_layout(layers=2, kv_heads=2, head_dim=8), name="model-a")
    b = ArrayEngine(array_layout(layers=2, kv_heads=2, head_dim=8), name="model-b")
    s = a.new_session()
    s.prefill([1, 2, 3])
    plain = B.export_bundle(s, session_id="x", revision=0, sampler={}, rng={}, messages=[])
    with pytest.raises(MigrationError) as e:
        B.adopt_bundle(plain, b)
    assert e.value.category == "identity_mismatch" and "weights_config" in e.value.message


def test_machine_move_invariant_and_failure_recording():
    for st in M.OUTGOING_STATUSES:
        assert M.may_delete_source("move", st) == (st in M.DESTINATION_DURABLE)
        assert not M.may_delete_source("copy", st)
        assert M.failure_status(st) == (st if st in M.KEPT_ON_FAILURE else "ambiguous")
    # every status reachable before the destination commit plans no deletion, whatever the lookup says
    for st in (M.STARTING, M.PREPARED, M.TRANSFERRING, M.AMBIGUOUS):
        for dest in (None, M.PREPARED, M.UPLOADED):
            assert M.plan(st, "move", have_payload=True, destination=dest).action != "delete_source"
        assert M.plan(st, "move", have_payload=True, destination=M.COMMITTED).action == "record_committed" or st == M.STARTING
    assert M.plan(M.AMBIGUOUS, "move", have_payload=True, destination=M.PREPARED, received=7, size=10) == M.Step("upload", 7)
    assert M.plan(M.AMBIGUOUS, "move", have_payload=True, destination=M.UPLOADED).action == "commit"
    assert M.plan(M.DESTINATION_COMMITTED, "move", have_payload=False, destination=None).action == "delete_source"
    with pytest.raises(M.TransitionError):
        M.check_transition("outgoing", M.STARTING, M.COMPLETED)
    with pytest.raises(M.TransitionError):
        M.check_transition("outgoing", M.TRANSFERRING, M.COMPLETED)  # never complete without the commit on record


@pytest.mark.slow
def test_smollm2_adoption_is_bit_exact():
    """Real SmolLM2-135M: a session prefilled and decoded, exported, sealed, opened and adopted
    into a new session continues exactly as the source: tokens and every float32 logits row."""
    pytest.importorskip("torch")
    from kvpack.engine.models import load_smollm2
    from kvpack.engine.transformers_adapter import TransformersEngine

    engine = TransformersEngine(load_smollm2(), threads=2)
    src = engine.new_session()
    src.prefill(engine.encode("The quick brown fox jumps over the lazy dog. Then it"))
    greedy(src, 4)  # part of the state comes from decode steps
    plain = B.export_bundle(src, session_id="sess-lm", revision=1, sampler={"kind": "greedy"}, rng={}, messages=[])
    key = B.new_transport_key()
    dst, _rec = B.adopt_bundle(B.open_sealed(B.seal(plain, key), key), engine)
    assert dst.cache_digest() == src.cache_digest()
    t1, rows1 = greedy(src, 16)
    t2, rows2 = greedy(dst, 16)
    assert t1 == t2
    assert [hashlib.sha256(r).digest() for r in rows1] == [hashlib.sha256(r).digest() for r in rows2]
    assert all(np.array_equal(np.frombuffer(a, "<f4"), np.frombuffer(b, "<f4")) for a, b in zip(rows1, rows2))
    # control: the comparison can fail (one flipped bit in one logits row is seen)
    bad = bytearray(rows2[3])
    bad[0] ^= 1
    assert hashlib.sha256(bytes(bad)).digest() != hashlib.sha256(rows1[3]).digest()
