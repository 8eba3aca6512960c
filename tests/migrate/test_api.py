"""The decode-node HTTPS API against a real uvicorn daemon: D.1-D.3 rules, auth on every
route, TLS-only internal routes, strict bodies, idempotent prepare/commit, payload limits, and
a bounded schemathesis run over the published OpenAPI schema (no 5xx, no unhandled error)."""

from __future__ import annotations

import base64
import hashlib
import re
import ssl

import httpx
import pytest

from .conftest import API_KEY

SID = "sess-api"


@pytest.fixture
def node(nodes):
    n = nodes("dec-b").start()
    n.create(SID, 40)
    return n


def identity(node) -> dict:
    """The node's own identity fields, read from its engine config (same engine, same ids)."""
    from kvpack.migrate.config import build_engine
    from kvpack.migrate.service import MigrationService

    from .conftest import ENGINE

    return MigrationService.identity_fields(type("S", (), {"engine": build_engine(ENGINE)})())


def prepare_body(node, tid="xfer-api", payload=b"p" * 100, **over) -> dict:
    body = {
        "transfer_id": tid,
        "session_id": "sess-incoming",
        "source": "kvpack-decode-source",
        "mode": "copy",
        "tier": "decode",
        "bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "transport_key": base64.b64encode(b"k" * 32).decode(),
        **identity(node),
    }
    body.update(over)
    return body


def routes(schema: dict) -> list[tuple[str, str]]:
    out = []
    for path, ops in schema["paths"].items():
        for method in ops:
            out.append((method.upper(), re.sub(r"\{[^}]+\}", "x-1", path)))
    return out


def test_every_route_refuses_missing_or_wrong_keys(node):
    schema = node.client.get("/openapi.json").json()
    found = routes(schema)
    assert len(found) >= 11
    for key in (None, "Bearer wrong-key-0123456789abcdef", f"Bearer {API_KEY}x", API_KEY, f"bearer {API_KEY}"):
        headers = {} if key is None else {"authorization": key}
        with httpx.Client(base_url=node.url, verify=ssl.create_default_context(cafile=node.ca), trust_env=False) as c:
            for method, path in found:
                r = c.request(method, path, headers={**headers, "content-type": "application/json"}, content=b"{}")
                assert r.status_code == 401, (method, path, key, r.status_code)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json() == {"error": {"type": "authentication_required", "message": "a valid bearer API key is required"}}


def test_internal_routes_require_tls(nodes):
    plain = nodes("dec-c", tls=False).start()
    for method, path in (
        ("POST", "/__kvpack/v1/session-transfers/prepare"),
        ("PUT", "/__kvpack/v1/session-transfers/x/payload"),
        ("POST", "/__kvpack/v1/session-transfers/x/commit"),
        ("GET", "/__kvpack/v1/session-transfers/x/payload"),
    ):
        # with a valid key, and with forwarded headers claiming https: still refused
        r = plain.client.request(method, path, headers={"x-forwarded-proto": "https", "forwarded": "proto=https"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "tls_required", (method, path)
    assert plain.client.get("/v1/sessions/nope").status_code == 404  # public routes work over plain HTTP


def test_public_route_rules(node, nodes):
    c = node.client
    r = c.post(
        f"/v1/sessions/{SID}/migrate",
        content=b'{"destination":"https://127.0.0.1:1","mode":"copy"}',
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
    r = c.post(f"/v1/sessions/{SID}/migrate", json={"destination": "https://127.0.0.1:1", "mode": "copy", "extra": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert c.post(f"/v1/sessions/{SID}/migrate", json={"destination": "https://127.0.0.1:1", "mode": "teleport"}).status_code == 400
    for bad in ("http://127.0.0.1:1", "https://127.0.0.1:1/path", "https://127.0.0.1:1?q=1", "https://127.0.0.1:1#f", "127.0.0.1:1", "https://u:p@h:1"):
        r = c.post(f"/v1/sessions/{SID}/migrate", json={"destination": bad, "mode": "copy"})
        assert r.status_code == 400, bad
    assert c.post("/v1/sessions/bad.id/migrate", json={"destination": "https://127.0.0.1:1", "mode": "copy"}).status_code == 400
    assert c.post(f"/v1/sessions/{'a' * 129}/migrate", json={"destination": "https://127.0.0.1:1", "mode": "copy"}).status_code == 400
    r = c.post(f"/v1/sessions/{SID}/migrate", json={"destination": "https://127.0.0.1:1", "mode": "copy", "transfer_id": "bad id"})
    assert r.status_code == 400
    r = c.post("/v1/sessions/sess-none/migrate", json={"destination": "https://127.0.0.1:1/", "mode": "copy"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
    r = c.get("/v1/session-transfers/xfer-none")
    assert r.status_code == 404 and r.json() == {"error": {"type": "not_found", "message": "session transfer does not exist"}}
    # a node without a peer API key cannot start decode migrations
    lone = nodes("dec-a", peer_key=False).start()
    lone.create(SID, 8)
    r = lone.client.post(f"/v1/sessions/{SID}/migrate", json={"destination": "https://127.0.0.1:1", "mode": "copy"})
    assert r.status_code == 409 and r.json()["error"]["type"] == "migration_not_configured"
    # a migration that starts: 202 with the initial view; default id is xfer- + 32 hex
    r = c.post(f"/v1/sessions/{SID}/migrate", json={"destination": "https://127.0.0.1:9", "mode": "copy"})
    assert r.status_code == 202
    v = r.json()
    assert re.fullmatch(r"xfer-[0-9a-f]{32}", v["id"]) and v["status"] == "starting" and v["bytes"] == 0 and v["sha256"] == ""
    # nothing listens on port 9: the transfer ends ambiguous (a lookup failed, nothing guessed)
    assert node.wait_final(v["id"])["status"] == "ambiguous"


def test_prepare_payload_commit_rules(node):
    c = node.client
    url = "/__kvpack/v1/session-transfers"
    payload = b"p" * 100
    assert c.post(f"{url}/prepare", content=b"{}", headers={"content-type": "text/json"}).status_code == 415
    r = c.post(f"{url}/prepare", json={**prepare_body(node), "surprise": True})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = c.post(f"{url}/prepare", json=prepare_body(node, model_sha256="0" * 64))
    assert r.status_code == 409 and r.json()["error"]["type"] == "identity_mismatch"
    for over in (
        {"tier": "storage"},
        {"bytes": 0},
        {"bytes": 32 * 1024**3 + 1},
        {"sha256": "A" * 64},
        {"layout_abi": "muse-kv-layout-v1"},
        {"vision_projector_sha256": "1" * 64},
        {"transport_key": "short"},
    ):
        r = c.post(f"{url}/prepare", json=prepare_body(node, **over))
        assert r.status_code == 400 and r.json()["error"]["type"] == "transfer_prepare_error", over
    assert c.post(f"{url}/prepare", json=prepare_body(node, bytes=1.0)).status_code == 400  # no float for an integer
    r = c.post(f"{url}/prepare", json=prepare_body(node))
    assert r.status_code == 200
    v = r.json()
    assert (v["direction"], v["status"], v["destination"], v["bytes"]) == ("incoming", "prepared", "kvpack-decode-source", 100)
    assert c.post(f"{url}/prepare", json=prepare_body(node)).json() == v  # idempotent
    r = c.post(f"{url}/prepare", json=prepare_body(node, sha256="1" * 64))
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict"
    r = c.post(f"{url}/prepare", json=prepare_body(node, tid="xfer-dup", session_id=SID))
    assert r.status_code == 409  # the session already lives here
    # payload: exact content type, exact size, exact digest
    put = f"{url}/xfer-api/payload"
    assert c.put(put, content=payload, headers={"content-type": "application/octet-stream; x=1"}).status_code == 415
    r = c.put(put, content=payload + b"!", headers={"content-type": "application/octet-stream"})
    assert r.status_code == 413
    r = c.put(put, content=payload[:60], headers={"content-type": "application/octet-stream"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "transfer_payload_error"
    assert c.get(f"{put}").json()["received"] == 60  # durable prefix, resumable
    r = c.put(put, content=payload[:50], headers={"content-type": "application/octet-stream", "content-range": "bytes 50-99/100"})
    assert r.status_code == 409  # resume offset must be the durable offset
    r = c.put(put, content=b"q" * 40, headers={"content-type": "application/octet-stream", "content-range": "bytes 60-99/100"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "transfer_payload_error"  # whole-file SHA-256 still checked
    assert c.get(put).json()["received"] == 0
    assert c.post(f"{url}/xfer-api/commit").status_code == 400  # not uploaded yet
    r = c.put(put, content=payload[:60], headers={"content-type": "application/octet-stream"})
    r = c.put(put, content=payload[60:], headers={"content-type": "application/octet-stream", "content-range": "bytes 60-99/100"})
    assert r.status_code == 200 and r.json()["status"] == "uploaded"
    assert c.put(put, content=payload, headers={"content-type": "application/octet-stream"}).status_code == 409
    # the bytes are not a sealed bundle under this key: commit refuses, nothing is installed
    r = c.post(f"{url}/xfer-api/commit")
    assert r.status_code == 400 and r.json()["error"]["type"] == "transfer_commit_error"
    assert node.view("xfer-api")["status"] == "uploaded"
    assert c.post(f"{url}/xfer-nothing/commit").status_code == 404


def test_openapi_schemathesis_no_server_errors(node):
    """Bounded property-based run over every operation of the published schema, against the
    live HTTPS daemon: no 5xx, no unhandled exception in the node's log."""
    import ssl

    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, settings

    schema = schemathesis.openapi.from_dict(node.client.get("/openapi.json").json())
    ctx = ssl.create_default_context(cafile=node.ca)
    count = 0
    errors = []
    for op in schema.get_all_operations():
        operation = op.ok()
        strategy = operation.as_strategy()

        from hypothesis import given

        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def run(case):
            nonlocal count
            kwargs = case.as_transport_kwargs(base_url=node.url)
            headers = dict(kwargs.get("headers") or {})
            headers["authorization"] = f"Bearer {API_KEY}"
            with httpx.Client(verify=ctx, trust_env=False, timeout=30) as c:
                r = c.request(
                    kwargs["method"],
                    kwargs["url"],
                    headers=headers,
                    params=kwargs.get("params"),
                    content=kwargs.get("data") if not isinstance(kwargs.get("data"), dict) else None,
                    json=kwargs.get("json"),
                )
            count += 1
            if r.status_code >= 500:
                errors.append((kwargs["method"], kwargs["url"], r.status_code, r.text[:200]))

        run()
    assert count >= 100
    assert not errors, errors[:5]
    assert "Traceback" not in node.log.read_text() and "unhandled" not in node.log.read_text()


def test_a_body_nested_past_the_recursion_limit_is_a_400_not_a_500(node):
    """``[[[...`` of a few KiB (under the body cap) made json.loads raise RecursionError,
    which the JSON routes did not map: 500 and a logged traceback instead of a refusal."""
    c = node.client
    for body in (b"[" * 50_000 + b"]" * 50_000, b'{"prompt_token_ids": ' + b'{"a":' * 20_000 + b"1" + b"}" * 20_001):
        r = c.post("/v1/sessions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (r.status_code, r.text[:300])
        assert "nested too deeply" in r.json()["error"]["message"]
    assert c.get(f"/v1/sessions/{SID}").status_code == 200  # and the node serves on
