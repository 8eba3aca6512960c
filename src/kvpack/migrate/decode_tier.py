"""Decode tier, source side: the HTTPS client that drives a destination decode node.

:class:`DecodeDestination` speaks the internal routes of INTEROP.md D.3 (under
``/__kvpack/v1``) with the source's API key as a bearer token, over TLS 1.3 to a server whose
certificate must chain to the enrolled cluster CA (never the system store). It implements the
destination interface the transfer orchestrator (:mod:`.transfer`) drives:

* ``lookup(id)``: ``GET /v1/session-transfers/{id}`` (the reconciliation lookup) plus, while
  the destination is ``prepared``, its durable upload offset
  (``GET /__kvpack/v1/session-transfers/{id}/payload``); 404 means "no record of it";
* ``prepare(rec)``, ``upload(rec, path, offset)``, ``commit(rec)``.

Uploads resume: ``PUT .../payload`` with ``Content-Range: bytes START-END/TOTAL`` continues at
the destination's durable offset; the destination still checks the final size and SHA-256 of
the whole file (:mod:`.resume`).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterator
from typing import Any, Optional
from urllib.parse import urlsplit

from ..errors import MigrationError
from . import failpoints
from . import machine as M
from .incoming import LAYOUT_ABI
from .transfer import DestinationConflict

INTERNAL = "/__kvpack/v1/session-transfers"
SOURCE_LABEL = "kvpack-decode-source"
__all__ = ["LAYOUT_ABI", "DecodeDestination", "client_ssl_context", "validate_decode_destination"]


def validate_decode_destination(value: str) -> str:
    """An absolute ``https://host[:port]`` origin without path, query or fragment (D.2)."""
    if not isinstance(value, str):
        raise MigrationError("usage", "destination must be a string")
    v = value[:-1] if value.endswith("/") else value
    try:
        parts = urlsplit(v)
        port = parts.port
    except ValueError:
        raise MigrationError("usage", "destination is not a URL") from None
    if parts.scheme != "https" or not parts.hostname or parts.path or parts.query or parts.fragment or "#" in v or "?" in v:
        raise MigrationError("usage", "destination must be an absolute https origin with no path, query or fragment")
    if parts.username or parts.password:
        raise MigrationError("usage", "destination must not carry credentials")
    if port is not None and not 0 < port < 65536:
        raise MigrationError("usage", "destination port out of range")
    return v


def client_ssl_context(ca: str | None) -> ssl.SSLContext:
    if not ca:
        raise MigrationError("usage", "no CA configured to verify decode destinations (peer_ca)")
    ctx = ssl.create_default_context(cafile=ca)  # only this CA: never the system store
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def _error_type(resp: Any) -> Optional[str]:
    try:
        kind = resp.json().get("error", {}).get("type")
    except Exception:  # noqa: BLE001 - a body that is not the D.1 error object
        return None
    return kind if isinstance(kind, str) else None


def _error_text(resp: Any) -> str:
    try:
        body = resp.json()
        err = body.get("error", {})
        return f"{resp.status_code} {err.get('type')}: {err.get('message')}"
    except Exception:
        return f"{resp.status_code}"


class DecodeDestination:
    def __init__(self, origin: str, api_key: bytes, ca: str | None, *, chunk_bytes: int = 1024 * 1024, timeout: float = 60.0) -> None:
        import httpx

        self.origin = origin
        self.chunk_bytes = chunk_bytes
        self._httpx = httpx
        self.client = httpx.Client(
            base_url=origin,
            verify=client_ssl_context(ca),
            headers={"authorization": "Bearer " + api_key.decode("ascii")},
            timeout=httpx.Timeout(timeout, connect=10.0),
            trust_env=False,  # no proxy from the environment: loopback peers only
        )

    def close(self) -> None:
        self.client.close()

    def _call(self, method: str, url: str, **kw):
        try:
            return self.client.request(method, url, **kw)
        except self._httpx.HTTPError as exc:
            raise MigrationError("transport", f"{method} {url}: {type(exc).__name__}: {exc}") from None

    @staticmethod
    def _view(resp: Any, what: str, *, final_conflict: bool = False) -> dict[str, Any]:
        """The 200 body; a 409 ``conflict`` is final (:class:`DestinationConflict`) where the
        route's conflicts are (prepare, commit), a retryable transport error elsewhere."""
        if resp.status_code == 409:
            kind = _error_type(resp)
            if kind == "identity_mismatch":
                raise MigrationError("identity_mismatch", f"{what}: {_error_text(resp)}")
            if final_conflict and kind == "conflict":
                raise DestinationConflict(f"{what}: {_error_text(resp)}")
            raise MigrationError("transport" if not final_conflict else "conflict", f"{what}: {_error_text(resp)}")
        if resp.status_code != 200:
            raise MigrationError("transport", f"{what}: {_error_text(resp)}")
        body: dict[str, Any] = resp.json()
        return body

    # -- the destination interface -------------------------------------------------------------------
    def lookup(self, rec: M.TransferRecord) -> tuple[Optional[M.Status], int]:
        tid = rec.id
        resp = self._call("GET", f"/v1/session-transfers/{tid}")
        if resp.status_code == 404:
            return None, 0
        view = self._view(resp, "status lookup")
        if view.get("direction") != "incoming":
            raise MigrationError("conflict", f"destination holds transfer {tid} as {view.get('direction')}")
        try:
            status = M.Status(view["status"])
        except ValueError:
            raise MigrationError("transport", f"destination reports unknown status {view['status']!r}") from None
        received = 0
        if status == M.PREPARED:
            r = self._call("GET", f"{INTERNAL}/{tid}/payload")
            received = int(self._view(r, "upload offset")["received"])
        return status, received

    def prepare(self, rec: M.TransferRecord, identity: dict[str, Optional[str]]) -> M.Status:
        body = {
            "transfer_id": rec.id,
            "session_id": rec.session_id,
            "source": SOURCE_LABEL,
            "mode": rec.mode,
            "tier": "decode",
            "bytes": rec.bytes,
            "sha256": rec.sha256,
            "transport_key": rec.transport_key,
            **identity,
        }
        resp = self._call("POST", f"{INTERNAL}/prepare", json=body)
        return M.Status(self._view(resp, "prepare", final_conflict=True)["status"])

    def upload(self, rec: M.TransferRecord, path: str, offset: int, progress: Optional[Callable[[int], None]] = None) -> None:
        total = rec.bytes
        kill_at = failpoints.byte_threshold("source.upload")

        def body() -> Iterator[bytes]:
            sent = offset
            with open(path, "rb") as fh:
                fh.seek(offset)
                while True:
                    block = fh.read(self.chunk_bytes)
                    if not block:
                        return
                    yield block
                    sent += len(block)
                    if progress:
                        progress(sent)
                    if kill_at is not None and sent >= kill_at:
                        failpoints.die()  # the source dies mid-upload (matrix row)

        headers = {"content-type": "application/octet-stream", "content-length": str(total - offset)}
        if offset:
            headers["content-range"] = f"bytes {offset}-{total - 1}/{total}"
        resp = self._call("PUT", f"{INTERNAL}/{rec.id}/payload", content=body(), headers=headers)
        view = self._view(resp, "upload")
        if view["status"] != M.UPLOADED.value:
            raise MigrationError("transport", f"upload ended with destination status {view['status']}")

    def commit(self, rec: M.TransferRecord) -> M.Status:
        resp = self._call("POST", f"{INTERNAL}/{rec.id}/commit")
        if failpoints.action("source.commit_reply") == "lost":
            # the destination acted; the reply never reaches the source (matrix row)
            raise MigrationError("transport", "commit reply lost (injected)")
        return M.Status(self._view(resp, "commit", final_conflict=True)["status"])

    def delete(self, rec: M.TransferRecord) -> None:
        raise MigrationError("usage", "a decode destination's sessions are deleted through its own API")

    def fetch(self, rec: M.TransferRecord) -> bytes:
        raise MigrationError("usage", "sessions are restored from storage nodes, not from decode nodes")
