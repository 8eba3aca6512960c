"""The local API's hang-up watcher and the control plane's id echo.

Registering and unregistering a client never waits behind the watcher's select (issue 14: a
request waited seconds for the watcher's lock); a hang-up cancels only the token of a socket
that is still watched; a ``failed`` answer echoes only a whole valid C.14 id."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvpack.node.local_api import CancelToken, _Watcher


def test_watch_and_unwatch_do_not_wait_behind_a_long_select():
    w = _Watcher()
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        idle = CancelToken()
        w.watch(pairs[0][0], idle)  # an idle client: every select waits its whole poll
        time.sleep(0.2)
        w.POLL_S = 30.0  # the next select waits 30 s (the old watcher held its lock meanwhile)
        done = threading.Event()

        def churn() -> None:
            for a, _b in pairs[1:]:
                w.watch(a, CancelToken())
                w.unwatch(a)
            done.set()

        t = threading.Thread(target=churn, daemon=True)
        threading.Timer(0.2, t.start).start()  # the watcher is inside its 30 s select by then
        assert done.wait(10.0), "watch/unwatch waited for the watcher's select"
        assert not idle.cancelled
    finally:
        w._stop.set()
        pairs[0][1].close()  # wakes the select: the idle client hung up
        w._thread.join(5)
        for a, b in pairs:
            a.close()
            b.close()


def test_a_hang_up_cancels_only_a_watched_socket():
    w = _Watcher()
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    try:
        watched, dropped = CancelToken(), CancelToken()
        w.watch(a, watched)
        w.watch(c, dropped)
        w.unwatch(c)
        d.close()  # hangs up after unwatch: nobody may read c for it any more
        b.close()
        assert watched.wait(5.0)
        assert not dropped.wait(0.3)
    finally:
        w.close()
        a.close()
        c.close()


def test_echo_id_takes_only_a_whole_valid_c14_id():
    from kvpack.node.control import echo_id

    assert echo_id("muser-1-2_a.b") == "muser-1-2_a.b"
    for bad in ("abc\n", "a b", "x" * 101, "", "é", 7, None, "ok\x00"):
        assert echo_id(bad) == "unknown"


def _refusing_server(path: str, reply: bytes | None) -> threading.Thread:
    """A UNIX socket server that reads 1 KiB of one request, writes ``reply`` (if any) and
    closes, as the node does with a request line over its byte limit."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def serve() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                conn.recv(1024)
                if reply is not None:
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_client_still_sending_gets_the_refusal_not_a_broken_pipe(tmp_path):
    """Full CI once failed test_request_caps_are_refused_clearly with BrokenPipeError: the
    node refused a 20,000-token line and closed while the client was still sending it. The
    refusal was already in the client's receive queue; the client now reads it."""
    from kvpack.node.local_api import request_local

    path = str(tmp_path / "s")
    refusal = b'{"ok": false, "error": {"reason": "usage", "detail": "request line longer than 1024 bytes"}}\n'
    thread = _refusing_server(path, refusal)
    reply = request_local(path, {"tokens": list(range(1, 400_000))}, timeout=10)  # ~3 MiB: far past the socket buffers
    thread.join(5)
    assert reply["ok"] is False and reply["error"]["reason"] == "usage"


def test_a_peer_that_closes_without_a_reply_is_still_an_error(tmp_path):
    import pytest

    from kvpack.node.local_api import request_local

    path = str(tmp_path / "s")
    thread = _refusing_server(path, None)
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        request_local(path, {"tokens": list(range(1, 400_000))}, timeout=10)
    thread.join(5)


def _api_node(tmp_path, limits):
    from kvpack.node.local_api import ApiSocket, LocalApi

    api_socket = ApiSocket(str(tmp_path / "api.sock"))
    api = LocalApi(api_socket, lambda req, token: {"echo": len(req.get("tokens", []))}, limits, max_prompt_tokens=1 << 20)
    return api.start()


def _send_then_read(path: str, data: bytes, timeout: float = 10.0) -> bytes:
    """A plain client (``nc`` style): send everything, half-close, then read the reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = bytearray()
        while chunk := s.recv(1 << 16):
            out += chunk
        return bytes(out)


def test_a_plain_client_sending_an_oversized_line_reads_its_refusal(tmp_path):
    """The node drains what a refused client still sends: before, it closed with those bytes
    unread and a send-then-read client got a reset instead of the reason."""
    import json

    from kvpack.node.local_api import ApiLimits

    api = _api_node(tmp_path, ApiLimits(max_request_bytes=1024))
    try:
        for size in (4 << 20, 16 << 20):  # far past the socket buffers
            reply = json.loads(_send_then_read(str(tmp_path / "api.sock"), b"x" * size + b"\n"))
            assert reply["ok"] is False and reply["error"]["reason"] == "usage"
            assert "longer than 1024 bytes" in reply["error"]["detail"]
        ok = json.loads(_send_then_read(str(tmp_path / "api.sock"), b'{"tokens": [1, 2, 3]}\n'))
        assert ok == {"ok": True, "result": {"echo": 3}}  # the slot came back
    finally:
        api.stop()


def test_the_drain_is_bounded_in_bytes(tmp_path, monkeypatch):
    """A client that keeps sending after its refusal is cut off once the drain's byte bound
    is read: it costs the node a bounded slot, not an endless read."""
    from kvpack.node import local_api
    from kvpack.node.local_api import ApiLimits

    monkeypatch.setattr(local_api, "DRAIN_BYTES", 1 << 20)
    api = _api_node(tmp_path, ApiLimits(max_request_bytes=1024))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(tmp_path / "api.sock"))
            sent = 0
            with pytest.raises((BrokenPipeError, ConnectionResetError)):
                while sent < (256 << 20):
                    sent += s.send(b"x" * (1 << 20))
            assert sent < (64 << 20)  # cut off near the bound, not after everything
    finally:
        api.stop()
