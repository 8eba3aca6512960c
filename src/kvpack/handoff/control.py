"""The MUPCTL1 control plane to the producer (INTEROP C.14, errata H2/M6/L9), pure codec.

Frame: ``b"MUPCTL1\\0" | u32 LE length (1..=64 MiB) | canonical JSON``. Unlike KVPKV2
headers, the reader requires the JSON to be canonical bytes (re-encode and compare), so a
control message has exactly one wire form.

Messages: :class:`ControlRequestV1` (receiver -> producer: prefill these tokens and hand the
cache back to me), :class:`ControlResponse` (producer -> receiver: accepted, then committed
with a :class:`ControlReceipt`, or failed). Request V2 (multimodal) is not implemented here.

Sequence (errata H2): the receiver writes one request, reads "accepted", then keeps the
connection open and silent until its Handoff V2 ack; afterwards it may read one final
response under a short deadline, as telemetry only.

It must never accept a control message that is not canonical bytes.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import ProtocolError
from . import canonical_json as cj

MAGIC = b"MUPCTL1\0"
PREFIX = struct.Struct("<8sI")
PREFIX_BYTES = PREFIX.size  # 12
MAX_CONTROL_BYTES = 64 * 1024 * 1024
MAX_PROMPT_TOKENS = 131072
MAX_TOKEN_ID = 0x7FFFFFFF  # errata M6: the producer's bound (no vocabulary check)
MAX_ERROR_CHARS = 1024

_REQUEST_ID = re.compile(r"[A-Za-z0-9_.\-]{1,100}\Z")  # errata M6: ASCII, 1..=100
_HOST = re.compile(r"[A-Za-z0-9.:\-_]{1,253}\Z")


def encode_control(message: dict[str, Any]) -> bytes:
    body = cj.canonical_bytes(message)
    if not 0 < len(body) <= MAX_CONTROL_BYTES:
        raise ProtocolError("framing", f"control message of {len(body)} bytes outside 1..=64 MiB", remote=False)
    return PREFIX.pack(MAGIC, len(body)) + body


class ControlDecoder:
    """Incremental MUPCTL1 reader: the length is checked before the body is buffered."""

    def __init__(self, max_len: int = MAX_CONTROL_BYTES) -> None:
        self.max_len = max_len
        self._buf = bytearray()
        self._need: Optional[int] = None
        self._error: Optional[ProtocolError] = None

    def feed(self, data: bytes) -> list[Any]:
        if self._error is not None:
            raise self._error
        self._buf += data
        out = []
        try:
            while True:
                if self._need is None:
                    if len(self._buf) < PREFIX_BYTES:
                        break
                    magic, n = PREFIX.unpack_from(self._buf)
                    if magic != MAGIC:
                        raise ProtocolError("framing", "bad control magic")
                    if n == 0 or n > self.max_len:
                        raise ProtocolError("framing", f"control length {n} outside 1..={self.max_len}")
                    self._need = n
                    del self._buf[:PREFIX_BYTES]
                if len(self._buf) < self._need:
                    break
                body = bytes(self._buf[: self._need])
                del self._buf[: self._need]
                self._need = None
                out.append(cj.decode_canonical(body, self.max_len))
        except ProtocolError as exc:
            self._error = exc
            raise
        return out

    def eof(self) -> None:
        if self._buf or self._need is not None:
            raise ProtocolError("framing", "truncated control frame")


def decode_control(data: bytes) -> Any:
    """Exactly one complete control frame."""
    dec = ControlDecoder()
    msgs = dec.feed(data)
    dec.eof()
    if len(msgs) != 1:
        raise ProtocolError("framing", f"expected one control frame, got {len(msgs)}")
    return msgs[0]


@dataclass(frozen=True)
class ControlRequestV1:
    request_id: str
    deadline_unix_ms: int
    prompt_token_ids: tuple[int, ...]
    receiver_host: str
    receiver_port: int
    schema_version: int = 1

    KEYS = ("schema_version", "request_id", "deadline_unix_ms", "prompt_token_ids", "receiver_host", "receiver_port")

    @classmethod
    def from_json(cls, obj: Any) -> "ControlRequestV1":
        cj.check_keys(obj, "request", cls.KEYS)
        version = cj.u32(obj["schema_version"], "request.schema_version")
        if version != 1:
            raise ProtocolError("json", f"request schema_version {version} is not 1")
        return cls(
            request_id=cj.string(obj["request_id"], "request.request_id"),
            deadline_unix_ms=cj.u64(obj["deadline_unix_ms"], "request.deadline_unix_ms"),
            prompt_token_ids=cj.u32_array(obj["prompt_token_ids"], "request.prompt_token_ids"),
            receiver_host=cj.string(obj["receiver_host"], "request.receiver_host"),
            receiver_port=cj.uint(obj["receiver_port"], "request.receiver_port", 65535),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "request_id": self.request_id,
            "deadline_unix_ms": self.deadline_unix_ms,
            "prompt_token_ids": list(self.prompt_token_ids),
            "receiver_host": self.receiver_host,
            "receiver_port": self.receiver_port,
        }

    def validate(self, now_unix_ms: int, max_context: int = MAX_PROMPT_TOKENS) -> None:
        if not (self.request_id.isascii() and _REQUEST_ID.match(self.request_id)):
            raise ProtocolError("manifest", "request_id is not 1..100 of [A-Za-z0-9-_.]")
        if self.deadline_unix_ms <= now_unix_ms:
            raise ProtocolError("expired", "request deadline already passed")
        n = len(self.prompt_token_ids)
        if not 2 <= n <= min(max_context, MAX_PROMPT_TOKENS):
            raise ProtocolError("manifest", f"prompt of {n} tokens outside 2..={min(max_context, MAX_PROMPT_TOKENS)}")
        if max(self.prompt_token_ids) > MAX_TOKEN_ID:
            raise ProtocolError("manifest", "token id above 2^31-1")
        if not (self.receiver_host.isascii() and _HOST.match(self.receiver_host)):
            raise ProtocolError("manifest", "receiver_host is not 1..253 of [A-Za-z0-9.:-_]")
        if self.receiver_port == 0:
            raise ProtocolError("manifest", "receiver_port 0")

    def encode(self) -> bytes:
        return encode_control(self.to_json())


RECEIPT_FIELDS = (
    "prefill_start_unix_ns",
    "prefill_end_unix_ns",
    "state_saved_unix_ns",
    "transfer_start_unix_ns",
    "first_segment_sent_unix_ns",
    "transfer_acked_unix_ns",
    "prefill_tokens",
    "payload_bytes",
    "payload_wire_ns",
)

# Ordering constraints we enforce (decision, docs/protocol.md): the spec only says
# "ordering and non-zero constraints apply". A streaming producer starts the transfer
# before prefill ends, so only orderings that hold in both streaming and offline modes are
# required: prefill_start <= prefill_end <= state_saved, transfer_start <=
# first_segment_sent <= transfer_acked, and each phase starts before the ack.
_ORDER = (
    ("prefill_start_unix_ns", "prefill_end_unix_ns"),
    ("prefill_end_unix_ns", "state_saved_unix_ns"),
    ("transfer_start_unix_ns", "first_segment_sent_unix_ns"),
    ("first_segment_sent_unix_ns", "transfer_acked_unix_ns"),
    ("prefill_start_unix_ns", "transfer_acked_unix_ns"),
    ("state_saved_unix_ns", "transfer_acked_unix_ns"),
)


@dataclass(frozen=True)
class ControlReceipt:
    prefill_start_unix_ns: int
    prefill_end_unix_ns: int
    state_saved_unix_ns: int
    transfer_start_unix_ns: int
    first_segment_sent_unix_ns: int
    transfer_acked_unix_ns: int
    prefill_tokens: int
    payload_bytes: int
    payload_wire_ns: int

    @classmethod
    def from_json(cls, obj: Any) -> "ControlReceipt":
        cj.check_keys(obj, "receipt", RECEIPT_FIELDS)
        r = cls(**{k: cj.u64(obj[k], f"receipt.{k}") for k in RECEIPT_FIELDS})
        r.validate()
        return r

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RECEIPT_FIELDS}

    def validate(self) -> None:
        for k in RECEIPT_FIELDS:
            if getattr(self, k) == 0:
                raise ProtocolError("manifest", f"receipt.{k} is zero")
        for a, b in _ORDER:
            if getattr(self, a) > getattr(self, b):
                raise ProtocolError("manifest", f"receipt.{a} is after receipt.{b}")


STATUSES = frozenset({"accepted", "committed", "failed"})


@dataclass(frozen=True)
class ControlResponse:
    request_id: str
    status: str
    error: Optional[str] = None
    receipt: Optional[ControlReceipt] = None
    schema_version: int = 1

    @classmethod
    def from_json(cls, obj: Any) -> "ControlResponse":
        cj.check_keys(obj, "response", ("schema_version", "request_id", "status"), ("error", "receipt"))
        if cj.u32(obj["schema_version"], "response.schema_version") != 1:
            raise ProtocolError("json", "response schema_version is not 1")
        status = cj.string(obj["status"], "response.status")
        if status not in STATUSES:
            raise ProtocolError("json", f"response status {status!r} unknown")
        error = obj.get("error")
        receipt = obj.get("receipt")
        if error is not None:
            error = cj.string(error, "response.error")
        if receipt is not None:
            receipt = ControlReceipt.from_json(receipt)
        out = cls(cj.string(obj["request_id"], "response.request_id"), status, error, receipt)
        out.check_shape()
        return out

    def check_shape(self) -> None:
        if (self.error is not None) != (self.status == "failed"):
            raise ProtocolError("manifest", "error is present exactly when status is failed")
        if self.error is not None and not 1 <= len(self.error) <= MAX_ERROR_CHARS:
            raise ProtocolError("manifest", "error is not 1..1024 characters")
        if (self.receipt is not None) != (self.status == "committed"):
            raise ProtocolError("manifest", "receipt is present exactly when status is committed")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema_version": 1, "request_id": self.request_id, "status": self.status}
        if self.error is not None:
            out["error"] = self.error
        if self.receipt is not None:
            out["receipt"] = self.receipt.to_json()
        return out

    def encode(self) -> bytes:
        self.check_shape()
        return encode_control(self.to_json())

    def validate_for(self, request_id: str) -> None:
        """Errata L9: a response for another request (or "unknown") is a control failure."""
        if self.request_id != request_id:
            raise ProtocolError("identity", f"response for request {self.request_id!r}, expected {request_id!r}")
