"""The control plane from the node side: the decode node's control client, the kvpack
extension keys of a MUPCTL1 request, and the bounds a producer applies before it echoes or
writes anything a requester sent.

Why it exists: the control conversation (errata H2: request, ``accepted``, then a silent
open connection until the Handoff V2 ack, then at most one telemetry answer) was inline in
the receiver daemon, and a pre-``accepted`` refusal was signalled by patching an attribute
onto an exception. Here it is one small client with typed outcomes:

* :meth:`ControlClient.request` returns a :class:`ControlSession` once the producer answered
  ``accepted``; a ``failed`` answer before that raises :class:`RequestRefused`, whose
  ``extensions`` field names the kvpack extension keys the request carried -- a strict
  upstream producer refuses unknown keys, so the caller retries without them (one stream,
  full transfer) and nothing was sent or installed meanwhile;
* extensions (:data:`EXT_PREFIX_CUT`, :data:`EXT_STRIPES`) ride in the request object next to
  the C.14 fields; :func:`split_extensions` lifts them on the producer before the strict
  typed parse and refuses malformed values.

What it must never do: write cache bytes on the control channel, read more than one bounded
control message where one is expected, or echo an unchecked field.
"""

from __future__ import annotations

import re
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import KvpackError, ProtocolError
from ..handoff import canonical_json as cj
from ..handoff.control import MAX_PROMPT_TOKENS, ControlDecoder, ControlRequestV1, ControlResponse, encode_control
from .common import read_control, readable
from .local_api import Cancelled

#: kvpack's delta cut: the upstream request V1 has no such field (errata L1)
EXT_PREFIX_CUT = "kvpack_prefix_cut"
#: kvpack's striping: how many connections the receiver accepts for this transfer (2..16)
EXT_STRIPES = "kvpack_stripes"
EXTENSIONS = (EXT_PREFIX_CUT, EXT_STRIPES)
MAX_STRIPES = 16
#: the largest valid request: 131,072 token ids of up to 10 digits plus the other fields
MAX_REQUEST_BYTES = MAX_PROMPT_TOKENS * 11 + (16 << 10)
#: responses carry no token ids: a few KiB at most
MAX_RESPONSE_BYTES = 64 << 10
#: how often a wait for the producer's answer looks at the request's cancel token
CANCEL_POLL_S = 0.1
_ECHO_ID = re.compile(r"[A-Za-z0-9_.\-]{1,100}")


def echo_id(value: Any) -> str:
    """The request id a ``failed`` answer may echo: the requester's id only when it is a valid
    C.14 id (1..100 of ``[A-Za-z0-9-_.]``), else ``"unknown"`` -- never 64 MiB of anything."""
    return value if isinstance(value, str) and value.isascii() and _ECHO_ID.fullmatch(value) else "unknown"


def split_extensions(raw: Any, accepted: tuple[str, ...]) -> tuple[Any, dict[str, int]]:
    """Lift the kvpack extension keys this producer ``accepted`` out of a raw request object
    (unknown keys stay, for the strict typed parse to refuse); values are checked here."""
    if not isinstance(raw, dict):
        return raw, {}
    rest = dict(raw)
    ext: dict[str, int] = {}
    for key in accepted:
        if key in rest:
            ext[key] = cj.u64(rest.pop(key), key)
    if EXT_STRIPES in ext and not 1 <= ext[EXT_STRIPES] <= MAX_STRIPES:
        raise ProtocolError("json", f"{EXT_STRIPES} must be in 1..{MAX_STRIPES}")
    return rest, ext


def read_answer(channel, deadline: float, cancel: Optional[Callable[[], None]] = None) -> Any:
    """One control answer by ``deadline`` (monotonic). With ``cancel`` (a callable that raises
    once the request was cancelled), the wait looks at it at least every
    :data:`CANCEL_POLL_S`: a busy producer may take its whole ``slot_wait_s`` to answer, and
    a request whose client went away must free its decode slot at once, not then.

    Each read waits at most one poll interval, straight on the verified ``SSLSocket`` (as
    :func:`kvpack.node.transport.fill` does): the channel's wrapper reports a timeout before
    the peer spoke as a refused connection, and a TLS 1.3 session ticket arriving after the
    handshake makes the socket readable without any answer in it."""
    if cancel is None or not isinstance(getattr(channel, "sock", None), ssl.SSLSocket):
        return read_control(channel, deadline, ControlDecoder(MAX_RESPONSE_BYTES))
    decoder = ControlDecoder(MAX_RESPONSE_BYTES)
    pending = decoder.feed(b"")
    buf = bytearray(1 << 16)
    sock = channel.sock
    try:
        while not pending:
            cancel()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no control message before the deadline")
            if channel.has_pending():
                n = channel.recv_into(buf)
            else:
                sock.settimeout(max(0.001, min(left, CANCEL_POLL_S)))
                try:
                    n = sock.recv_into(buf)
                except (socket.timeout, TimeoutError):
                    continue
                except ssl.SSLError as exc:
                    raise channel.read_error(exc) from None
                if n == 0:
                    n = channel.recv_into(buf)  # the wrapper's verdict on this close
                else:
                    channel.peer_has_spoken = True
            if n == 0:
                raise ProtocolError("aborted", "control connection closed before a whole message")
            pending = decoder.feed(bytes(buf[:n]))
    finally:
        channel.settimeout(None)
    if len(pending) > 1:
        raise ProtocolError("state", "more than one control message where one was expected")
    return pending[0]


class RequestRefused(ProtocolError):
    """The producer answered ``failed`` before ``accepted``: nothing was sent or installed.

    ``extensions``: the kvpack extension keys the refused request carried (empty: the
    producer refused the request itself, retrying cannot help)."""

    def __init__(self, message: str, *, extensions: tuple[str, ...] = ()) -> None:
        super().__init__("aborted", message)
        self.extensions = extensions


@dataclass
class ControlSession:
    """An accepted request: the control connection stays open and silent (errata H2)."""

    channel: Any
    request_id: str
    frames: list = field(default_factory=list)
    control_s: float = 0.0
    early: Optional[ControlResponse] = None

    def poll(self) -> Optional[ControlResponse]:
        """A response that arrived while the transfer runs (``failed``, or ``committed``
        racing the node's own event), without blocking; None if the producer is silent."""
        if self.early is None and readable(self.channel.sock):
            raw = read_control(self.channel, time.monotonic() + 5.0, ControlDecoder(MAX_RESPONSE_BYTES))
            resp = ControlResponse.from_json(raw)
            resp.validate_for(self.request_id)
            self.frames.append({"dir": "received", "type": resp.status, "bytes": len(encode_control(raw))})
            self.early = resp
        return self.early

    def final(self, wait_s: float, cancel: Optional[Callable[[], None]] = None) -> Optional[ControlResponse]:
        """The producer's last answer (telemetry only): a short wait, then give up; a
        cancelled request stops waiting (``cancel()`` raises)."""
        if self.early is not None:
            return self.early
        try:
            raw = read_answer(self.channel, time.monotonic() + wait_s, cancel)
            resp = ControlResponse.from_json(raw)
            resp.validate_for(self.request_id)
        except Cancelled:
            raise
        except (KvpackError, TimeoutError, OSError):
            return None
        self.frames.append({"dir": "received", "type": resp.status, "bytes": len(encode_control(raw))})
        return resp

    def close(self) -> None:
        self.channel.close()


class ControlClient:
    """The decode node's client of one producer's control plane."""

    def __init__(self, endpoint, context, host: str, port: int, *, accept_timeout_s: float = 30.0) -> None:
        self.endpoint, self.context, self.host, self.port = endpoint, context, host, port
        self.accept_timeout_s = accept_timeout_s

    def request(self, req: ControlRequestV1, extensions: dict[str, int], connect=None, cancel: Optional[Callable[[], None]] = None) -> ControlSession:
        """Send ``req`` (plus ``extensions``) and read the producer's first answer. A busy
        producer may take its ``slot_wait_s`` to answer: ``cancel()`` (raises once the
        request was cancelled) is polled meanwhile, and closing the connection tells the
        producer to stop waiting too."""
        from ..security.tls import connect as tls_connect

        t0 = time.perf_counter()
        chan = (connect or tls_connect)(self.endpoint, self.host, self.port, context=self.context)
        session = ControlSession(chan, req.request_id)
        try:
            body = req.to_json()
            body.update(extensions)
            frame = encode_control(body)
            chan.sendall(frame)
            session.frames.append({"dir": "sent", "type": "request", "bytes": len(frame)})
            raw = read_answer(chan, time.monotonic() + self.accept_timeout_s, cancel)
            resp = ControlResponse.from_json(raw)
            if resp.status == "failed" and resp.request_id != req.request_id:
                # a producer that could not parse the request cannot echo its id; on this
                # connection (one request) the answer is still the refusal of our request
                raise RequestRefused(f"producer answered failed: {resp.error}", extensions=tuple(extensions))
            resp.validate_for(req.request_id)
            session.frames.append({"dir": "received", "type": resp.status, "bytes": len(encode_control(raw))})
            if resp.status != "accepted":
                raise RequestRefused(f"producer answered {resp.status}: {resp.error}", extensions=tuple(extensions))
        except BaseException:
            chan.close()
            raise
        session.control_s = time.perf_counter() - t0
        return session
