"""Connection limits for the node's HTTPS API: the small front between sockets and uvicorn.

Why it exists: uvicorn's h11 server has no deadline for a request's headers, none for a body
that stops arriving, and only asyncio's 60 s default for a TLS handshake; a peer that connects
and sends nothing (or one header byte a second) holds a connection forever, and 256 of them lock
every client out. This module subclasses uvicorn's :class:`H11Protocol` and adds, per
connection:

* a **per-client cap** (``max_connections_per_client``, by peer IP) and a **global cap**
  (``max_connections``), checked when the TCP connection arrives, before any TLS work: a
  connection over either cap is aborted at once;
* the **TLS handshake** under ``tls_handshake_timeout_s`` (the front runs ``start_tls`` itself,
  so uvicorn serves plain TCP and never sees an unfinished handshake);
* a **header deadline**: a complete request head must arrive within ``header_timeout_s`` of the
  connection being ready or of the previous response ending (an absolute deadline, so trickling
  bytes does not extend it); this also closes idle keep-alive and idle-after-TLS connections;
* a **body idle timeout**: while the server is reading a body, a gap of
  ``body_idle_timeout_s`` without a byte closes the connection (the payload route then records
  its durable offset). A gap caused by the server itself (reading paused because the app is not
  consuming yet, e.g. queued for a payload slot) does not count.

What it must never do: parse HTTP itself (h11 does), or close a connection whose request is
being answered. The JSON routes' whole-body deadline lives in :mod:`.api` (``json_body_timeout_s``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any, ClassVar, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..migrate.config import ApiLimits

log = logging.getLogger("kvpack.node.api")
__all__ = ["ApiLimits", "hardened_protocol"]


class _Counts:
    """Open connections, in total and per peer host (one instance per server)."""

    def __init__(self) -> None:
        self.total = 0
        self.per_host: dict[str, int] = {}

    def admit(self, host: str, limits: ApiLimits) -> bool:
        if self.total >= limits.max_connections or self.per_host.get(host, 0) >= limits.max_connections_per_client:
            return False
        self.total += 1
        self.per_host[host] = self.per_host.get(host, 0) + 1
        return True

    def release(self, host: str) -> None:
        self.total -= 1
        left = self.per_host.get(host, 1) - 1
        if left:
            self.per_host[host] = left
        else:
            self.per_host.pop(host, None)


class HardenedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits above; :func:`hardened_protocol` binds them."""

    limits: ClassVar[ApiLimits] = ApiLimits()
    tls: ClassVar[Optional[ssl.SSLContext]] = None
    counts: ClassVar[_Counts]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._host: Optional[str] = None  # set once admitted (and counted)
        self._http_started = False
        self._early: list[bytes] = []
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._body_timer: Optional[asyncio.TimerHandle] = None
        self._tls_task: Optional[asyncio.Task[None]] = None

    # -- connection set-up: caps, then TLS under its own deadline ------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's own
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self.counts.admit(host, self.limits):
            log.warning("refused a connection from %s: connection limit reached", host)
            transport.abort()
            return
        self._host = host
        if self.tls is None:
            self._start_http(transport)
        else:
            self._tls_task = self.loop.create_task(self._handshake(transport))  # keep a reference

    async def _handshake(self, raw: asyncio.Transport) -> None:
        try:
            assert self.tls is not None
            wrapped = await self.loop.start_tls(
                raw,
                self,
                self.tls,
                server_side=True,
                ssl_handshake_timeout=self.limits.tls_handshake_timeout_s,
            )
        except (OSError, ssl.SSLError, ConnectionError, asyncio.TimeoutError) as exc:
            log.info("TLS handshake from %s failed: %s", self._host, exc)
            raw.abort()
            self._release()
            return
        if wrapped is None or wrapped.is_closing():
            self._release()
            return
        self._start_http(wrapped)

    def _start_http(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._http_started = True
        self._arm_header_deadline()
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)

    def _release(self) -> None:
        if self._host is not None:
            self.counts.release(self._host)
            self._host = None

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._release()
        self._cancel_timers()
        if self._http_started:
            super().connection_lost(exc)

    # -- deadlines ------------------------------------------------------------------------------------
    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None

    def _arm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._on_header_deadline)

    def _on_header_deadline(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info("closed a connection from %s: no complete request head within %gs", self._host, self.limits.header_timeout_s)
            self.transport.close()

    def _arm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_timer = self.loop.call_later(self.limits.body_idle_timeout_s, self._on_body_idle)

    def _on_body_idle(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if self.flow.read_paused:  # we stopped reading, not the client: not its gap
            self._arm_body_timer()
            return
        log.info("closed a connection from %s: no body bytes for %gs", self._host, self.limits.body_idle_timeout_s)
        self.transport.close()

    # -- h11 events -----------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if not self._http_started:
            self._early.append(data)  # TLS finished before start_tls returned: keep it in order
            return
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle and self._header_timer is not None:
            self._header_timer.cancel()  # a complete request head arrived
            self._header_timer = None
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self._arm_body_timer()
        elif self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        # The next request's head is due within the header deadline (unless a pipelined
        # request already started a new cycle inside the call above).
        if self.cycle is cycle and not self.transport.is_closing():
            self._arm_header_deadline()


def hardened_protocol(limits: ApiLimits, tls: Optional[ssl.SSLContext]) -> type[HardenedH11Protocol]:
    """The protocol class to give uvicorn as ``http`` (with uvicorn's own ``ssl`` unset): it
    enforces ``limits``; ``tls`` is the server context (None: plain HTTP). Each call makes one
    server's class, with its own connection counts."""
    attrs = {"limits": limits, "tls": tls, "counts": _Counts()}
    return type("HardenedH11Protocol", (HardenedH11Protocol,), attrs)
