"""The node API against slow, idle, racing and malformed clients, on a real HTTPS daemon (issue 15).

* four concurrent uploads of one transfer: one writer wins (200), the others get 409 at once,
  never a 5xx, and nothing unhandled reaches the node's log;
* a client that never finishes its TLS handshake, one idle after TLS, one trickling its request
  head and one stalling its body are each closed within the configured deadline, while a
  legitimate client is served meanwhile; a client over its per-IP connection cap is cut off at
  accept while others are not;
* ids are matched whole (``%0A`` -> 400), and duplicate JSON keys are refused (400) on every
  JSON route.
"""

from __future__ import annotations

import base64
import socket
import ssl
import threading
import time

import httpx
import pytest

from .conftest import API_KEY
from .test_api import prepare_body

SID = "sess-hard"
LIMITS = {"tls_handshake_timeout_s": 2, "header_timeout_s": 2, "body_idle_timeout_s": 2, "json_body_timeout_s": 4, "max_connections_per_client": 6}
ATTACKER = "127.0.0.2"  # all of 127/8 is loopback: the attackers get their own per-IP budget
SLACK_S = 3.0  # generous: a loaded 2-core machine; the point is "closed", not "how fast"


@pytest.fixture(scope="module")
def node(tmp_path_factory, cluster):
    from .conftest import Node

    n = Node(tmp_path_factory.mktemp("hard"), cluster, "dec-c", extra={"api_limits": LIMITS}).start()
    n.create(SID, 16)
    yield n
    n.kill()


def tls_context(node) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=node.ca)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def raw_connect(node, source: str = ATTACKER) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", node.port), timeout=10, source_address=(source, 0))
    s.settimeout(LIMITS["header_timeout_s"] + LIMITS["tls_handshake_timeout_s"] + 10)
    return s


def tls_connect(node, source: str = ATTACKER) -> ssl.SSLSocket:
    return tls_context(node).wrap_socket(raw_connect(node, source), server_hostname="127.0.0.1")


def closed_after(sock: socket.socket, t0: float) -> float:
    """Block until the server closes ``sock``; the seconds since ``t0``."""
    try:
        while sock.recv(4096):
            pass
    except (ssl.SSLError, ConnectionError):
        pass
    return time.monotonic() - t0


def legit_get(node) -> int:
    with httpx.Client(base_url=node.url, verify=tls_context(node), headers={"authorization": f"Bearer {API_KEY}"}, timeout=10, trust_env=False) as c:
        return c.get(f"/v1/sessions/{SID}").status_code


def test_concurrent_uploads_of_one_transfer_one_writer_others_409(node):
    payload = bytes(range(256)) * (8 * 1024)  # 2 MiB
    tid = "xfer-racing"
    r = node.client.post("/__kvpack/v1/session-transfers/prepare", json=prepare_body(node, tid=tid, payload=payload, session_id="sess-racing"))
    assert r.status_code == 200, r.text
    start = threading.Barrier(4)
    results: list[tuple[int, str]] = []

    def slow_body():
        for i in range(0, len(payload), 64 * 1024):
            yield payload[i : i + 64 * 1024]
            time.sleep(0.02)  # ~0.7 s per upload: all four overlap

    def upload() -> None:
        with httpx.Client(base_url=node.url, verify=tls_context(node), headers={"authorization": f"Bearer {API_KEY}"}, timeout=60, trust_env=False) as c:
            start.wait()
            resp = c.put(f"/__kvpack/v1/session-transfers/{tid}/payload", content=slow_body(), headers={"content-type": "application/octet-stream"})
            results.append((resp.status_code, resp.text))

    threads = [threading.Thread(target=upload) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = sorted(code for code, _ in results)
    assert codes == [200, 409, 409, 409], results
    for code, text in results:
        if code == 409:
            assert "already in progress" in text or "payload already received" in text, text
    assert node.view(tid)["status"] == "uploaded"
    offset = node.client.get(f"/__kvpack/v1/session-transfers/{tid}/payload").json()
    assert offset["received"] == len(payload)
    assert (node.home / "session-transfers" / f"{tid}.payload").read_bytes() == payload
    log = node.log.read_text()
    assert "Traceback" not in log and "internal_error" not in log and "FileNotFoundError" not in log


def test_slow_and_idle_clients_are_closed_within_the_deadlines(node):
    t0 = time.monotonic()
    no_handshake = raw_connect(node)  # TCP only: never sends a ClientHello
    idle_tls = tls_connect(node)  # TLS done, then silence
    t_idle = time.monotonic()
    trickle = tls_connect(node)
    t_trickle = time.monotonic()
    trickle.sendall(b"GET /v1/sessions/" + SID.encode() + b" HTTP/1.1\r\nHost: x\r\n")
    stalled_body = tls_connect(node)
    stalled_body.sendall(
        f"POST /v1/sessions/{SID}/decode HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode()
    )
    t_body = time.monotonic()
    # the trickling client sends one header byte every 0.25 s: an absolute deadline still closes it
    stop = threading.Event()

    def drip() -> None:
        try:
            while not stop.is_set():
                trickle.sendall(b"X")
                time.sleep(0.25)
        except OSError:
            pass

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    # a legitimate client is served while all four are held
    assert legit_get(node) == 200
    waits = {
        "no_handshake": (closed_after(no_handshake, t0), LIMITS["tls_handshake_timeout_s"]),
        "idle_tls": (closed_after(idle_tls, t_idle), LIMITS["header_timeout_s"]),
        "trickling_head": (closed_after(trickle, t_trickle), LIMITS["header_timeout_s"]),
        "stalled_body": (closed_after(stalled_body, t_body), LIMITS["body_idle_timeout_s"]),
    }
    stop.set()
    for what, (took, limit) in waits.items():
        assert took < limit + SLACK_S, (what, took, limit)
    assert legit_get(node) == 200
    for s in (no_handshake, idle_tls, trickle, stalled_body):
        s.close()


def test_per_client_connection_cap(node):
    held = [tls_connect(node) for _ in range(LIMITS["max_connections_per_client"])]
    try:
        t0 = time.monotonic()
        with pytest.raises((ssl.SSLError, ConnectionError)):
            tls_connect(node)  # aborted at accept, before any TLS work: the handshake fails
        assert time.monotonic() - t0 < LIMITS["header_timeout_s"]  # at once, not by a deadline
        assert legit_get(node) == 200  # another client's budget is untouched
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    s = tls_connect(node)  # capacity is back once they are gone
    s.close()


def test_ids_with_a_trailing_newline_are_refused(node):
    c = node.client
    for path in (f"/v1/sessions/{SID}%0A", "/v1/session-transfers/xfer-ok%0A", "/v1/session-transfers/xfer-ok%0A/progress"):
        r = c.get(path)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, r.status_code, r.text)
    assert c.post(f"/v1/sessions/{SID}%0A/decode", json={"tokens": 1}).status_code == 400
    assert c.post("/__kvpack/v1/session-transfers/xfer-ok%0A/commit").status_code == 400
    r = c.post("/__kvpack/v1/session-transfers/prepare", json=prepare_body(node, tid="xfer-nl\n"))
    assert r.status_code == 400
    r = c.post(f"/v1/sessions/{SID}/migrate", json={"destination": "https://127.0.0.1:1", "mode": "copy", "transfer_id": "xfer-nl\n"})
    assert r.status_code == 400
    assert not list((node.home / "session-transfers").glob("*nl*"))


def test_duplicate_json_keys_are_refused_on_every_json_route(node):
    c = node.client
    key = base64.b64encode(b"k" * 32).decode()
    prepare = prepare_body(node, tid="xfer-dup-keys", session_id="sess-dup-keys", transport_key=key)
    body = httpx.Request("POST", "http://x", json=prepare).content
    dup_prepare = body[:-1] + b',"mode":"move"}'  # the last "mode" would win in a plain parser
    cases = [
        ("/__kvpack/v1/session-transfers/prepare", dup_prepare),
        (f"/v1/sessions/{SID}/migrate", b'{"destination":"https://127.0.0.1:1","mode":"copy","mode":"move"}'),
        ("/v1/sessions", b'{"session_id":"sess-dup","prompt_token_ids":[1,2],"prompt_token_ids":[3]}'),
        (f"/v1/sessions/{SID}/decode", b'{"tokens":1,"tokens":2}'),
        (f"/v1/sessions/{SID}/decode", b'{"tokens":NaN}'),
    ]
    before = c.get(f"/v1/sessions/{SID}").json()
    for path, raw in cases:
        r = c.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, r.status_code, r.text)
    assert "duplicate key" in c.post(f"/v1/sessions/{SID}/decode", content=b'{"tokens":1,"tokens":2}', headers={"content-type": "application/json"}).text
    assert c.get("/v1/session-transfers/xfer-dup-keys").status_code == 404  # nothing prepared
    assert c.get("/v1/sessions/sess-dup").status_code == 404  # nothing created
    assert c.get(f"/v1/sessions/{SID}").json() == before  # nothing decoded
