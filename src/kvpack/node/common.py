"""Shared node plumbing: receipts, clocks, greedy decoding on any adapter, engine loading
(through :mod:`kvpack.engine.registry`), and reading one MUPCTL1 control frame from a TLS
channel under a deadline."""

from __future__ import annotations

import os
import select
import time
from typing import Any, Optional, Sequence

from ..errors import KvpackError, ProtocolError
from ..handoff.control import ControlDecoder
from .receipts import RECEIPT_SCHEMA, RECENT_RECEIPTS, ReceiptWriter  # noqa: F401 - re-exported (callers import them from here)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def verdict_of(exc: BaseException) -> tuple[str, str]:
    """(reason, detail) of a refusal: the typed category when there is one."""
    if isinstance(exc, KvpackError):
        return exc.category, exc.message
    if isinstance(exc, (TimeoutError, OSError)):
        return "io", f"{type(exc).__name__}: {exc}"
    return "internal", f"{type(exc).__name__}: {exc}"


def greedy(session, n: int, stop_token_ids: Sequence[int] = (), cancel: Any = None):
    """Greedy decode ``n`` tokens on any adapter session; returns (tokens, logits rows).

    With a ``cancel`` token (``.check()`` raises once cancelled) the tokens are decoded one
    step at a time and the token is checked between steps, so a request whose client went
    away frees its slot within one decode step. One step at a time is the same computation
    (each step forwards the token chosen from the previous row)."""
    if cancel is None:
        return session.decode_greedy(n, stop_token_ids=stop_token_ids)
    stops = {int(t) for t in stop_token_ids}
    tokens: list[int] = []
    rows: list = []
    for _ in range(n):
        cancel.check()
        step_tokens, step_rows = session.decode_greedy(1, stop_token_ids=stop_token_ids)
        tokens += step_tokens
        rows += step_rows
        if step_tokens and step_tokens[-1] in stops:
            break
    return tokens, rows


def refusal_error(category: str, message: str) -> KvpackError:
    """A typed error for a refusal recorded elsewhere (another thread's receipt): the class
    that owns ``category``, so the user sees the receiver's true reason (``pin``,
    ``certificate``, ``layout`` ...), never a generic one."""
    from ..errors import EngineError, NetworkError, SecurityError, StoreError

    for cls in (ProtocolError, SecurityError, EngineError, StoreError, NetworkError):
        if category in cls.CATEGORIES:
            return cls(category, message)
    return ProtocolError("aborted", f"{category}: {message}")


def logits_bytes(rows) -> bytes:
    """The decode logits rows as one f32 LE byte string (for SHA-256 comparisons)."""
    out = bytearray()
    for r in rows:
        if hasattr(r, "detach"):
            out += r.detach().to("cpu").float().contiguous().numpy().tobytes()
        else:
            import numpy as np

            out += np.asarray(r, dtype="<f4").tobytes()
    return bytes(out)


def load_engine(spec: str = "smollm2", *, threads: Optional[int] = None):
    """The engine ``spec`` names, from the one engine registry (:mod:`kvpack.engine.registry`)."""
    from ..engine.registry import load_engine as registry_load

    return registry_load(spec, threads=threads)


def hash_workers() -> int:
    """Threads of a daemon's payload-hashing pool: two per transfer being hashed (one per
    digest), room for a few at once, more on larger machines."""
    return max(4, min(32, 2 * (os.cpu_count() or 2)))


def chunk_tokens(engine) -> int:
    return int(getattr(engine, "prefill_chunk_tokens", 256))


def read_control(channel, deadline: float, decoder: Optional[ControlDecoder] = None) -> Any:
    """One MUPCTL1 message from a blocking TLS channel, or ``TimeoutError`` at ``deadline``
    (monotonic). A close before a whole frame is ``ProtocolError('aborted')``."""
    dec = decoder or ControlDecoder()
    pending = dec.feed(b"")
    buf = bytearray(1 << 16)
    while not pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no control message before the deadline")
        buffered = getattr(channel.sock, "pending", None)  # an SSLSocket's decrypted record; a relay's socket has none
        if buffered is None or not buffered():
            r, _, _ = select.select([channel.sock], [], [], remaining)
            if not r:
                continue
        channel.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            n = channel.recv_into(buf)
        finally:
            channel.settimeout(None)
        if n == 0:
            raise ProtocolError("aborted", "control connection closed before a whole message")
        pending = dec.feed(bytes(buf[:n]))
    if len(pending) > 1:
        raise ProtocolError("state", "more than one control message where one was expected")
    return pending[0]


def readable(sock) -> bool:
    """True if ``sock`` has bytes (or a close) waiting: a peer that spoke or went away."""
    if hasattr(sock, "pending") and sock.pending():
        return True
    r, _, _ = select.select([sock], [], [], 0)
    return bool(r)


def close_listener(sock) -> None:
    """Close a listening socket another thread blocks in ``accept()`` on. ``shutdown`` wakes
    that thread (on Linux); a bare ``close`` would leave the kernel socket, and the port,
    bound until the blocked call returned."""
    if sock is None:
        return
    import socket as _socket

    try:
        sock.shutdown(_socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
