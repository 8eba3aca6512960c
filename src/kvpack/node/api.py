"""The decode node's HTTPS API (ASGI, FastAPI): session migration routes of INTEROP.md PART D.

Routes (every one requires ``Authorization: Bearer <api key>``, compared in constant time;
``/openapi.json`` is public)::

    POST /v1/sessions/{id}/migrate                       D.2  -> 202 TransferView
    GET  /v1/session-transfers/{id}                      D.2  -> 200 TransferView
    POST /__kvpack/v1/session-transfers/prepare          D.3  -> 200 TransferView (TLS only)
    PUT  /__kvpack/v1/session-transfers/{id}/payload     D.3  -> 200 TransferView (TLS only)
    POST /__kvpack/v1/session-transfers/{id}/commit      D.3  -> 200 TransferView (TLS only)
  kvpack additions:
    GET  /__kvpack/v1/session-transfers/{id}/payload     durable upload offset (resume; TLS only)
    POST /v1/session-transfers/{id}/reconcile            look up + finish an outgoing transfer (synchronous)
    GET  /v1/session-transfers/{id}/progress             bytes sent (progress bars)
    POST /v1/sessions                                    create a session (prefill prompt ids)
    GET  /v1/sessions                                    ids, live|fenced, bundle bytes (kvpack session list)
    GET  /v1/sessions/{id}                               position, revision, cache digest, live|fenced
    POST /v1/sessions/{id}/decode                        greedy steps (tokens + logits digests)
    DELETE /v1/sessions/{id}                             drop a session held here

Rules (D.1): error body ``{"error":{"type","message"}}``; 401 ``authentication_required`` with
``www-authenticate: Bearer``; Content-Type compared exactly (``application/json``, or
``application/octet-stream`` for the payload), else 415 ``invalid_request_error``; bodies are
strict (unknown fields, wrong types, floats for integers, duplicate keys: 400
``invalid_request_error``); ids are 1..128 of ``[A-Za-z0-9_-]``, matched whole (a trailing
newline is refused); JSON bodies are capped at 64 MiB (413) and must arrive within
``json_body_timeout_s`` (408); internal routes answer 403 ``tls_required`` unless the
connection itself is TLS (``X-Forwarded-*`` headers are never trusted: uvicorn runs with
``proxy_headers=False``). Connection-level limits (TLS handshake, header and body-idle
deadlines, per-client and total connection caps) are enforced by :mod:`.api_front`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from typing import Any, Literal, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..vocab import strict_json_loads
from ..errors import KvpackError, MigrationError
from ..migrate.config import ApiLimits

log = logging.getLogger("kvpack.node.api")

MAX_JSON_BODY = 64 * 1024 * 1024
PAYLOAD_CONCURRENCY = 4
# pydantic compiles Field patterns with Rust's regex, where ``$`` is end of text (no newline
# exception); Python-side checks use ``fullmatch`` on the bare class.
ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
INTERNAL_PREFIX = "/__kvpack/"
PUBLIC_PATHS = frozenset({"/openapi.json"})
U64 = 2**64 - 1


# -- bodies (strict: unknown fields refused, no coercion) ----------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class MigrateBody(_Strict):
    destination: str
    mode: Literal["copy", "move"]
    tier: Literal["decode", "storage"] = "decode"
    transfer_id: Optional[str] = Field(default=None, pattern=ID_PATTERN)


class PrepareBody(_Strict):
    transfer_id: str = Field(pattern=ID_PATTERN)
    session_id: str = Field(pattern=ID_PATTERN)
    source: str = Field(max_length=256)
    mode: Literal["copy", "move"]
    tier: str = Field(max_length=32)
    bytes: int = Field(ge=0, le=U64)
    sha256: str = Field(max_length=64)
    transport_key: str = Field(max_length=64)
    model_sha256: str = Field(max_length=64)
    tokenizer_sha256: str = Field(max_length=64)
    template_sha256: str = Field(max_length=64)
    layout_abi: str = Field(max_length=64)
    engine_identity_sha256: str = Field(max_length=64)
    dflash_identity_sha256: Optional[str] = Field(max_length=64)
    vision_projector_sha256: Optional[str] = Field(max_length=64)
    vision_preprocessing_sha256: Optional[str] = Field(max_length=64)


class CreateSessionBody(_Strict):
    session_id: Optional[str] = Field(default=None, pattern=ID_PATTERN)
    prompt_token_ids: list[int] = Field(min_length=1, max_length=131072)
    messages: list[dict[str, str]] = Field(default_factory=list, max_length=1024)
    seed: int = Field(default=0, ge=0, le=U64)


class DecodeBody(_Strict):
    tokens: int = Field(ge=1, le=4096)


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


class TransferView(BaseModel):
    id: str
    session_id: str
    direction: Literal["outgoing", "incoming"]
    mode: Literal["copy", "move"]
    tier: Literal["decode", "storage"]
    destination: str
    status: str
    bytes: int
    sha256: str
    source_deleted: bool
    last_error: Optional[str] = None


# -- errors ----------------------------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.headers = headers


def error_response(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status, headers=headers)


def _map(exc: KvpackError, default_kind: str) -> ApiError:
    """MigrationError categories -> HTTP status and error type (route decides the 400 type)."""
    cat = getattr(exc, "category", "")
    msg = getattr(exc, "message", str(exc))
    status = getattr(exc, "http_status", None)
    if isinstance(exc, MigrationError):
        if cat == "not_found":
            return ApiError(404, "not_found", msg)
        if cat == "identity_mismatch":
            return ApiError(409, "identity_mismatch", msg)
        if cat == "conflict":
            return ApiError(status or 409, "conflict", msg)
        if cat == "state":
            if msg.startswith("migration_not_configured"):
                return ApiError(409, "migration_not_configured", msg)
            return ApiError(409, "conflict", msg) if default_kind != "transfer_commit_error" else ApiError(400, default_kind, msg)
        if cat == "tls_required":
            return ApiError(403, "tls_required", msg)
        if cat == "unauthorized":
            return ApiError(401, "authentication_required", msg, {"www-authenticate": "Bearer"})
        return ApiError(status or 400, default_kind, msg)
    return ApiError(400, default_kind, f"{cat}: {msg}")


def _id(value: str, what: str) -> str:
    if _ID.fullmatch(value) is None:
        raise ApiError(400, "invalid_request_error", f"{what} must be 1..128 of [A-Za-z0-9_-]")
    return value


async def _read_json_bytes(request: Request, timeout_s: float) -> bytes:
    """The whole body, bounded in size (413) and in time (408)."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_JSON_BODY):
        raise ApiError(413, "invalid_request_error", f"body exceeds {MAX_JSON_BODY} bytes")
    data = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for block in request.stream():
                data += block
                if len(data) > MAX_JSON_BODY:
                    raise ApiError(413, "invalid_request_error", f"body exceeds {MAX_JSON_BODY} bytes")
    except TimeoutError:
        raise ApiError(408, "invalid_request_error", f"body not received within {timeout_s:g}s") from None
    return bytes(data)


async def _json_body(request: Request, model: type[BaseModel], *, timeout_s: float, optional: bool = False) -> Any:
    ctype = request.headers.get("content-type")
    if ctype != "application/json":
        if optional and ctype is None and request.headers.get("content-length") in (None, "0"):
            return model()
        raise ApiError(415, "invalid_request_error", "Content-Type must be exactly application/json")
    data = await _read_json_bytes(request, timeout_s)
    try:
        strict_json_loads(data)  # duplicate keys and NaN/Infinity refused before pydantic's last-wins parse
    except ValueError as exc:
        raise ApiError(400, "invalid_request_error", f"body is not strict JSON: {exc}") from None
    try:
        return model.model_validate_json(data, strict=True)
    except ValidationError as exc:
        errors = exc.errors()
        where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
        raise ApiError(400, "invalid_request_error", f"{where or 'body'}: {errors[0]['msg'] if errors else 'invalid body'}") from None


def _openapi_body(model: type[BaseModel], content_type: str = "application/json") -> dict:
    return {"requestBody": {"required": True, "content": {content_type: {"schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


_ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": ErrorBody} for status in (400, 401, 403, 404, 408, 409, 413, 415)}


# -- the app -------------------------------------------------------------------------------------------------


class AuthTlsMiddleware:
    """Runs before routing: TLS for internal routes (403), then the bearer key (401)."""

    def __init__(self, app, api_key: bytes) -> None:
        self.app = app
        self.expected = b"Bearer " + api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        if scope["path"].startswith(INTERNAL_PREFIX) and scope.get("scheme") != "https":
            resp = error_response(403, "tls_required", "internal routes are served over TLS only")
            return await resp(scope, receive, send)
        supplied = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                supplied = value
                break
        # constant-time comparison of the whole header value
        if not hmac.compare_digest(supplied, self.expected):
            resp = error_response(401, "authentication_required", "a valid bearer API key is required", {"www-authenticate": "Bearer"})
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(svc: Any, limits: ApiLimits | None = None) -> tuple[AuthTlsMiddleware, FastAPI]:
    app = FastAPI(
        title="kvpack decode node",
        version="1",
        docs_url=None,
        redoc_url=None,
        description="Session migration (INTEROP.md PART D) and the node's session registry.",
    )
    body_s = (limits or ApiLimits()).json_body_timeout_s
    _error_handlers(app)
    _public_routes(app, svc, body_s)
    _internal_routes(app, svc, body_s)
    _session_routes(app, svc, body_s)
    return AuthTlsMiddleware(app, svc.api_key), app


async def _call(fn: Any, *args: Any, kind: str) -> Any:
    """Run ``fn`` on the thread pool; a KvpackError becomes the route's ApiError."""
    try:
        return await run_in_threadpool(fn, *args)
    except KvpackError as exc:
        raise _map(exc, kind) from None


def _error_handlers(app: FastAPI) -> None:
    """Every error leaves as the D.1 body; anything unhandled is logged and answered 500."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return error_response(exc.status, exc.kind, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError):
        return error_response(400, "invalid_request_error", "request does not match the route")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return error_response(exc.status_code, kind, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unhandled(_request: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal_error", "internal error")


def _public_routes(app: FastAPI, svc: Any, body_s: float) -> None:
    """D.2 public routes and kvpack's reconcile/progress."""

    # -- D.2 public ---------------------------------------------------------------------------------
    @app.post(
        "/v1/sessions/{session_id}/migrate",
        status_code=202,
        response_model=TransferView,
        response_model_exclude_none=True,
        openapi_extra=_openapi_body(MigrateBody),
        responses=_ERRORS,
    )
    async def migrate(session_id: str, request: Request):
        _id(session_id, "session id")
        body = await _json_body(request, MigrateBody, timeout_s=body_s)
        v = await _call(svc.start_migration, session_id, body.destination, body.mode, body.tier, body.transfer_id, kind="invalid_request_error")
        return JSONResponse(v, status_code=202)

    @app.get("/v1/session-transfers/{transfer_id}", response_model=TransferView, response_model_exclude_none=True, responses=_ERRORS)
    async def transfer_status(transfer_id: str):
        _id(transfer_id, "transfer id")
        return JSONResponse(await _call(svc.status, transfer_id, kind="transfer_error"))

    @app.post("/v1/session-transfers/{transfer_id}/reconcile", response_model=TransferView, response_model_exclude_none=True, responses=_ERRORS)
    async def transfer_reconcile(transfer_id: str):
        _id(transfer_id, "transfer id")
        return JSONResponse(await _call(svc.reconcile, transfer_id, kind="transfer_error"))

    @app.get("/v1/session-transfers/{transfer_id}/progress", responses=_ERRORS)
    async def transfer_progress(transfer_id: str):
        _id(transfer_id, "transfer id")
        return JSONResponse(await _call(svc.progress_view, transfer_id, kind="transfer_error"))


def _internal_routes(app: FastAPI, svc: Any, body_s: float) -> None:
    """D.3 internal routes (TLS only, enforced by the middleware)."""
    payload_slots = asyncio.Semaphore(PAYLOAD_CONCURRENCY)

    # -- D.3 internal -------------------------------------------------------------------------------
    @app.post(
        "/__kvpack/v1/session-transfers/prepare",
        response_model=TransferView,
        response_model_exclude_none=True,
        openapi_extra=_openapi_body(PrepareBody),
        responses=_ERRORS,
    )
    async def prepare(request: Request):
        body = await _json_body(request, PrepareBody, timeout_s=body_s)
        return JSONResponse(await _call(svc.prepare, body.model_dump(), kind="transfer_prepare_error"))

    @app.put(
        "/__kvpack/v1/session-transfers/{transfer_id}/payload",
        response_model=TransferView,
        response_model_exclude_none=True,
        openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
        responses=_ERRORS,
    )
    async def payload(transfer_id: str, request: Request):
        from ..migrate.resume import receive_payload

        _id(transfer_id, "transfer id")
        if request.headers.get("content-type") != "application/octet-stream":
            raise ApiError(415, "invalid_request_error", "Content-Type must be exactly application/octet-stream")
        async with payload_slots:
            try:
                v = await receive_payload(svc, transfer_id, request.headers, request.stream())
            except KvpackError as exc:
                raise _map(exc, "transfer_payload_error") from None
        return JSONResponse(v)

    @app.get("/__kvpack/v1/session-transfers/{transfer_id}/payload", responses=_ERRORS)
    async def payload_offset(transfer_id: str):
        _id(transfer_id, "transfer id")
        return JSONResponse(await _call(svc.upload_offset, transfer_id, kind="transfer_error"))

    @app.post("/__kvpack/v1/session-transfers/{transfer_id}/commit", response_model=TransferView, response_model_exclude_none=True, responses=_ERRORS)
    async def commit(transfer_id: str):
        _id(transfer_id, "transfer id")
        return JSONResponse(await _call(svc.commit, transfer_id, kind="transfer_commit_error"))


def _session_routes(app: FastAPI, svc: Any, body_s: float) -> None:
    """kvpack's session registry routes."""

    # -- session registry (kvpack) --------------------------------------------------------------------
    @app.post("/v1/sessions", status_code=201, openapi_extra=_openapi_body(CreateSessionBody), responses=_ERRORS)
    async def create_session(request: Request):
        from ..migrate.service import new_session_id

        body = await _json_body(request, CreateSessionBody, timeout_s=body_s)
        sid = body.session_id or new_session_id()
        info = await _call(lambda: svc.registry.create(sid, body.prompt_token_ids, messages=body.messages, seed=body.seed), kind="invalid_request_error")
        return JSONResponse(info, status_code=201)

    @app.get("/v1/sessions", responses=_ERRORS)
    async def session_list():
        return JSONResponse({"sessions": await _call(svc.registry.list, kind="invalid_request_error")})

    @app.get("/v1/sessions/{session_id}", responses=_ERRORS)
    async def session_info(session_id: str):
        _id(session_id, "session id")
        return JSONResponse(await _call(svc.registry.info, session_id, kind="invalid_request_error"))

    @app.post("/v1/sessions/{session_id}/decode", openapi_extra=_openapi_body(DecodeBody), responses=_ERRORS)
    async def session_decode(session_id: str, request: Request):
        _id(session_id, "session id")
        body = await _json_body(request, DecodeBody, timeout_s=body_s)
        return JSONResponse(await _call(svc.registry.decode, session_id, body.tokens, kind="invalid_request_error"))

    @app.delete("/v1/sessions/{session_id}", responses=_ERRORS)
    async def session_delete(session_id: str):
        _id(session_id, "session id")

        def drop():
            fenced = svc.registry.fence(session_id)
            if fenced:
                raise MigrationError("state", f"session {session_id} is being moved by transfer {fenced}")
            if not svc.registry.exists(session_id):
                raise MigrationError("not_found", f"session {session_id} does not exist")
            svc.registry.delete(session_id)
            return {"id": session_id, "deleted": True}

        return JSONResponse(await _call(drop, kind="invalid_request_error"))


def server_ssl_context(tls: dict[str, str]):
    """TLS 1.3-only server context from the enrolled node certificate; the key is read under the
    secret-file contract and handed to OpenSSL as the exact checked bytes (security.tls)."""
    import ssl
    from ..security.tls import load_identity

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols(["http/1.1"])
    load_identity(ctx, tls["certificate_chain"], tls["private_key"])
    return ctx


def serve(config_path: str) -> None:
    """Run the node API over HTTPS (or plain HTTP when the config has no tls) on loopback."""
    import uvicorn

    from ..migrate.config import load_config
    from ..migrate.service import MigrationService

    from .api_front import hardened_protocol

    cfg = load_config(config_path)
    svc = MigrationService(cfg)
    limits = cfg.api_limits
    asgi, _app = create_app(svc, limits)
    # TLS is done by the front (its own handshake deadline); uvicorn serves what it hands over.
    protocol = hardened_protocol(limits, server_ssl_context(cfg.tls) if cfg.tls else None)
    config = uvicorn.Config(
        asgi,
        host=cfg.host,
        port=cfg.port,
        http=protocol,
        # explicit: with uvloop installed (vLLM needs it) uvicorn's "auto" would switch loops
        loop="asyncio",
        proxy_headers=False,
        server_header=False,
        log_level="warning",
        log_config=None,  # keep kvpack's JSON-lines handler (kvpack.logs) on uvicorn's loggers
        lifespan="off",
        timeout_keep_alive=limits.header_timeout_s,  # type: ignore[arg-type]
        limit_concurrency=limits.max_connections,
    )
    print(f"kvpack decode node {cfg.node_name} serving {cfg.base_url}", flush=True)
    uvicorn.Server(config).run()
