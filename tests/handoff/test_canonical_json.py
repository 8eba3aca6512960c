"""C.7 canonical encoder and the errata M1 strict reader."""

import json

import pytest
from hypothesis import given, strategies as st

from kvpack.errors import ProtocolError
from kvpack.handoff import canonical_json as cj


def test_matches_python_reference_form():
    v = {"b": [1, 2, {"z": None, "a": True}], "a": "é\u2028\n\x7f", "\u00e9": 0}
    ref = json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert cj.canonical_bytes(v) == ref
    assert b"\xc3\xa9" in cj.canonical_bytes(v)  # raw UTF-8, not \u00e9


@pytest.mark.parametrize("bad", [1.0, float("nan"), {"a": [0.5]}, "\ud800"])
def test_encoder_refuses_non_canonical_values(bad):
    with pytest.raises(ProtocolError) as e:
        cj.canonical_bytes(bad)
    assert e.value.category == "json"


@pytest.mark.parametrize(
    "text",
    [
        b'{"a":1.0}',
        b'{"a":1e3}',
        b'{"a":NaN}',
        b'{"a":Infinity}',
        b'{"a":1,"a":2}',
        b'{"a":"\\ud800"}',
        b'{"a":"\xff"}',
        b"",
        b"{",
        b'{"a":' + b"9" * 5000 + b"}",
    ],
)
def test_strict_parser_refusals(text):
    with pytest.raises(ProtocolError) as e:
        cj.parse_json(text, 1 << 20)
    assert e.value.category == "json"


def test_parser_size_bound():
    with pytest.raises(ProtocolError):
        cj.parse_json(b"[1,2,3]", 6)
    assert cj.parse_json(b"[1,2,3]", 7) == [1, 2, 3]


def test_decode_canonical_requires_exact_bytes():
    assert cj.decode_canonical(b'{"a":1,"b":[]}', 100) == {"a": 1, "b": []}
    for text in (b'{"b":[],"a":1}', b'{"a": 1,"b":[]}', b'{"a":1,"b":[]} ', b'{"a":"\\u00e9"}'):
        with pytest.raises(ProtocolError):
            cj.decode_canonical(text, 100)


@pytest.mark.parametrize("value", [True, False, -1, 2**32, 1.0, "1", None])
def test_u32_refuses(value):
    with pytest.raises(ProtocolError):
        cj.u32(value, "f")


def test_u64_bounds_and_bool():
    assert cj.u64(2**64 - 1, "f") == 2**64 - 1
    for bad in (2**64, -1, True):
        with pytest.raises(ProtocolError):
            cj.u64(bad, "f")
    assert cj.boolean(True, "f") is True
    with pytest.raises(ProtocolError):
        cj.boolean(1, "f")


def test_check_keys_allow_list():
    cj.check_keys({"a": 1}, "o", ("a",), ("b",))
    with pytest.raises(ProtocolError, match="unknown field 'c'"):
        cj.check_keys({"a": 1, "c": 2}, "o", ("a",), ("b",))
    with pytest.raises(ProtocolError, match="missing field 'a'"):
        cj.check_keys({"b": 1}, "o", ("a",), ("b",))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(json_values)
def test_roundtrip_any_json_value(value):
    try:
        data = cj.canonical_bytes(value)
    except ProtocolError:
        # Only lone surrogates are unencodable among these values.
        return
    assert cj.decode_canonical(data, len(data)) == value
