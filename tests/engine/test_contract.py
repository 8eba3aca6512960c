"""The adapter contract without an engine: canonical encoding, retention, identity bytes."""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvpack.engine.contract import (
    LAYER_FULL,
    LAYER_WINDOWED,
    CacheLayout,
    EngineIdentity,
    IdentityIds,
    LayerSpec,
    canonical_json,
    f64_bits,
    id32,
)
from kvpack.errors import EngineError


def _layout(window_tokens: int = 23) -> CacheLayout:
    layers = tuple(
        LayerSpec(i, LAYER_FULL, 2, 16, "f32", "nope")
        if i % 4 == 3
        else LayerSpec(i, LAYER_WINDOWED, 2, 16, "f32", "rope", window_tokens=window_tokens, attention_window=window_tokens + 1)
        for i in range(8)
    )
    return CacheLayout(layers=layers, vocab_size=512)


def _identity(**changes) -> EngineIdentity:
    base = EngineIdentity(
        model_name="m",
        weights_digest="00" * 32,
        config={"hidden_size": 64, "rms_norm_eps": 1e-5},
        tokenizer_digest="11" * 32,
        chat_template_digest="22" * 32,
        context_policy={"max_context": 4096, "prefill_chunk_tokens": 256},
        adapter={"name": "none"},
        weight_precision="float32",
        engine_abi={"torch": "2.13.0", "threads": 2},
        scalars={"rope_theta": 10000.0, "rms_eps": 1e-5, "logit_scale": 0.0625},
        layout=_layout(),
    )
    return base.replace(**changes) if changes else base


def test_canonical_json_is_sorted_compact_and_floats_are_bit_patterns():
    assert canonical_json({"b": 1, "a": [True, None, "x"]}) == b'{"a":[true,null,"x"],"b":1}'
    assert canonical_json({"x": 1.0}) == b'{"x":"f64:3ff0000000000000"}'
    # Two floats that print alike at low precision stay distinct: their bits differ.
    assert f64_bits(1e-5) != f64_bits(9.999999747378752e-06)
    assert f64_bits(-0.0) == "f64:" + struct.pack(">d", -0.0).hex() != f64_bits(0.0)
    # An int and a float of the same value are different constants.
    assert canonical_json([1]) != canonical_json([1.0])


@pytest.mark.parametrize("bad", [{1: "int key"}, {"x": b"bytes"}, {"x": {1, 2}}])
def test_canonical_json_refuses_what_it_cannot_encode_exactly(bad):
    with pytest.raises(EngineError) as err:
        canonical_json(bad)
    assert err.value.category == "identity"


def test_id32_is_domain_separated_sha256():
    obj = {"a": 1}
    assert id32("topology", obj) == hashlib.sha256(b"kvpack/engine/v1/topology\0" + b'{"a":1}').digest()
    assert id32("topology", obj) != id32("shard-map", obj)


def test_retained_ranges_full_and_windowed():
    layout = _layout(window_tokens=23)
    assert layout.retained_range(3, 1000) == (0, 1000)
    assert layout.retained_range(0, 1000) == (977, 1000)
    assert layout.retained_range(0, 10) == (0, 10)  # shorter than the window: everything
    assert layout.retained_range(0, 23) == (0, 23)
    assert layout.retained_range(0, 24) == (1, 24)
    assert layout.windowed_layers() == [0, 1, 2, 4, 5, 6]
    assert layout.layer(0).row_bytes == 2 * 16 * 4
    assert layout.layer(0).dtype_wire == 8
    assert layout.logits_layer == 8 and layout.logits_bytes == 2048
    assert layout.states()[:3] == [(0, "k"), (0, "v"), (1, "k")]
    with pytest.raises(EngineError):
        layout.layer(8)
    with pytest.raises(EngineError):
        layout.check_role("q")


def test_layer_spec_refuses_inconsistent_geometry():
    with pytest.raises(EngineError):
        LayerSpec(0, LAYER_WINDOWED, 2, 16, "f32", "rope", window_tokens=0)
    with pytest.raises(EngineError):
        LayerSpec(0, LAYER_FULL, 2, 16, "f32", "rope", window_tokens=5)
    with pytest.raises(EngineError) as err:
        LayerSpec(0, LAYER_FULL, 2, 16, "f64", "rope")
    assert err.value.category == "unsupported"
    with pytest.raises(EngineError):
        CacheLayout(layers=(LayerSpec(1, LAYER_FULL, 2, 16, "f32", "rope"),), vocab_size=8)


def test_semantic_model_id_has_five_id32_in_spec_order():
    ids = _identity().ids()
    smid = ids.semantic_model_id()
    assert len(smid) == 5 and all(len(x) == 32 for x in smid)
    assert ids.semantic_model_id_bytes() == b"".join([ids.weights_config, ids.adapters, ids.tokenizer_template, ids.position_semantics, ids.qualified_math])
    assert len(ids.family_ids()) == 3 and len(ids.encode()) == 256
    # Stable: the same identity built twice gives the same bytes.
    assert _identity().ids() == ids


@pytest.mark.parametrize(
    "change, changed",
    [
        ({"scalars": {"rope_theta": 10000.0, "rms_eps": 1e-5, "logit_scale": 0.0625000000000001}}, {"qualified_math"}),
        ({"tokenizer_digest": "12" * 32}, {"tokenizer_template"}),
        ({"chat_template_digest": "23" * 32}, {"tokenizer_template"}),
        ({"weight_precision": "bfloat16"}, {"weights_config", "qualified_math"}),
        ({"weights_digest": "01" + "00" * 31}, {"weights_config"}),
        ({"adapter": {"name": "lora", "sha256": "ab" * 32}}, {"adapters"}),
        ({"context_policy": {"max_context": 4096, "prefill_chunk_tokens": 128}}, {"position_semantics"}),
        ({"engine_abi": {"torch": "2.13.1", "threads": 2}}, {"qualified_math", "engine_cache_abi"}),
        ({"layout": _layout(window_tokens=31)}, {"position_semantics", "topology"}),
    ],
)
def test_each_identity_change_changes_exactly_the_expected_ids(change, changed):
    a, b = _identity().ids(), _identity(**change).ids()
    differing = {n for n in IdentityIds.__dataclass_fields__ if getattr(a, n) != getattr(b, n)}
    assert differing == changed
    if changed & {"weights_config", "adapters", "tokenizer_template", "position_semantics", "qualified_math"}:
        assert a.semantic_model_id_bytes() != b.semantic_model_id_bytes()
    assert a.digest() != b.digest()


def test_identity_refuses_non_numeric_or_nan_scalars():
    with pytest.raises(EngineError):
        _identity(scalars={"eps": "1e-5"})
    with pytest.raises(EngineError):
        _identity(scalars={"eps": float("nan")})


def test_identity_ids_must_be_32_bytes():
    with pytest.raises(EngineError):
        IdentityIds(*([b"\0" * 32] * 7 + [b"\0" * 31]))
