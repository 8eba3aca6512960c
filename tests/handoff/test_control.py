"""C.14 MUPCTL1 codec: framing, canonical-only reader, request/response/receipt rules."""

import struct

import pytest
from hypothesis import given, strategies as st

from kvpack.errors import ProtocolError
from kvpack.handoff.control import (
    MAGIC,
    RECEIPT_FIELDS,
    ControlDecoder,
    ControlReceipt,
    ControlRequestV1,
    ControlResponse,
    decode_control,
    encode_control,
)

NOW = 1_700_000_000_000
REQ = ControlRequestV1("muser-1700000000000-0", NOW + 60_000, (1, 2, 3), "10.0.0.2", 29591)
RECEIPT = ControlReceipt(*[10 + i for i in range(6)], 2, 53248, 1000)


def test_request_roundtrip_and_frame():
    data = REQ.encode()
    assert data[:8] == b"MUPCTL1\0"
    assert struct.unpack("<I", data[8:12])[0] == len(data) - 12
    back = ControlRequestV1.from_json(decode_control(data))
    assert back == REQ
    back.validate(NOW)


@pytest.mark.parametrize(
    "change,category",
    [
        ({"request_id": ""}, "manifest"),
        ({"request_id": "x" * 101}, "manifest"),
        ({"request_id": "a b"}, "manifest"),
        ({"deadline_unix_ms": NOW}, "expired"),
        ({"prompt_token_ids": (1,)}, "manifest"),
        ({"prompt_token_ids": (1, 2**31)}, "manifest"),
        ({"receiver_host": ""}, "manifest"),
        ({"receiver_host": "a/b"}, "manifest"),
        ({"receiver_port": 0}, "manifest"),
    ],
)
def test_request_validation(change, category):
    import dataclasses

    with pytest.raises(ProtocolError) as e:
        dataclasses.replace(REQ, **change).validate(NOW)
    assert e.value.category == category


def test_request_strict_parse():
    for mutate in (
        lambda r: r.update(extra=1),
        lambda r: r.update(schema_version=2),
        lambda r: r.update(receiver_port=65536),
        lambda r: r.update(receiver_port=True),
        lambda r: r.pop("receiver_host"),
    ):
        r = REQ.to_json()
        mutate(r)
        with pytest.raises(ProtocolError):
            ControlRequestV1.from_json(r)


def test_response_shapes():
    for resp in (
        ControlResponse(REQ.request_id, "accepted"),
        ControlResponse(REQ.request_id, "failed", error="boom"),
        ControlResponse(REQ.request_id, "committed", receipt=RECEIPT),
    ):
        back = ControlResponse.from_json(decode_control(resp.encode()))
        assert back == resp
        back.validate_for(REQ.request_id)
    for bad in (
        {"status": "failed"},
        {"status": "accepted", "error": "x"},
        {"status": "committed"},
        {"status": "accepted", "receipt": RECEIPT.to_json()},
        {"status": "failed", "error": "x" * 1025},
        {"status": "done"},
    ):
        obj = {"schema_version": 1, "request_id": "r", **bad}
        with pytest.raises(ProtocolError):
            ControlResponse.from_json(obj)
    with pytest.raises(ProtocolError) as e:
        ControlResponse("unknown", "failed", error="x").validate_for(REQ.request_id)
    assert e.value.category == "identity"


def test_receipt_rules():
    import dataclasses

    for field in RECEIPT_FIELDS:
        with pytest.raises(ProtocolError, match="zero"):
            dataclasses.replace(RECEIPT, **{field: 0}).validate()
    with pytest.raises(ProtocolError, match="after"):
        dataclasses.replace(RECEIPT, prefill_start_unix_ns=99).validate()
    with pytest.raises(ProtocolError, match="after"):
        dataclasses.replace(RECEIPT, first_segment_sent_unix_ns=9).validate()
    # Streaming: the transfer starts before prefill ends; allowed.
    dataclasses.replace(RECEIPT, transfer_start_unix_ns=10, first_segment_sent_unix_ns=11).validate()


def test_reader_requires_canonical_bytes():
    body = b'{"status":"accepted", "request_id":"r","schema_version":1}'
    with pytest.raises(ProtocolError, match="canonical"):
        decode_control(struct.pack("<8sI", MAGIC, len(body)) + body)


@pytest.mark.parametrize(
    "data,match",
    [
        (b"MUPCTL2\0" + struct.pack("<I", 2) + b"{}", "magic"),
        (MAGIC + struct.pack("<I", 0), "length"),
        (MAGIC + struct.pack("<I", 64 * 1024 * 1024 + 1), "length"),
        (MAGIC + struct.pack("<I", 5) + b"{}", "truncated"),
    ],
)
def test_framing_refusals(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode_control(data)


@given(st.lists(st.integers(0, 200), max_size=10))
def test_split_feeding(cuts):
    stream = REQ.encode() + ControlResponse("r", "accepted").encode()
    dec = ControlDecoder()
    out = []
    prev = 0
    for c in sorted(cuts) + [len(stream)]:
        out += dec.feed(stream[prev:c])
        prev = max(prev, c)
    dec.eof()
    assert out == [REQ.to_json(), {"schema_version": 1, "request_id": "r", "status": "accepted"}]


def test_encode_refuses_floats():
    with pytest.raises(ProtocolError):
        encode_control({"a": 1.5})
