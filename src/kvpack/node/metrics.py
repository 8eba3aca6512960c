"""Prometheus metrics of a node daemon and its observability listener (DESIGN.md principle 7).

Each daemon owns one :class:`NodeMetrics` with its own registry (so two nodes in one test
process do not collide) and serves it, with the health endpoints and the status page, on one
small HTTP listener:

* ``/metrics``: Prometheus text;
* ``/healthz``: 200 while the process serves requests (liveness);
* ``/readyz``: 200 when every readiness check of the node passes, else 503, with a JSON body
  naming the checks (listener bound, ledger open and not degraded, ...);
* ``/status`` (HTML) and ``/status.json``: the node's status page (:mod:`.status`).

Exposure: the listener binds ``127.0.0.1`` on a free port by default. Metrics and the status
page name transfers and refusals, which is operational data, so a non-loopback address is
only served with mutual TLS (:meth:`NodeMetrics.serve` with ``tls=``): the node's enrolled
certificate, and clients must present a certificate issued by the cluster CA. Nothing served
here is a secret (no keys, no token ids, no prompt text).

Series (``role`` is ``receiver`` or ``producer``):

* ``kvpack_transfers_total{role,verdict}``: transfers by verdict (``committed`` or the
  refusal category);
* ``kvpack_refusals_total{role,reason}``: refusals by reason (protocol/security category,
  TLS refusals included);
* ``kvpack_transfer_bytes_total{role}``: payload bytes moved;
* ``kvpack_phase_seconds{role,phase}``: latency of each phase (control, prefill, wire,
  verify, reserve, commit, decode, ...);
* ``kvpack_ledger_reservations_total{role,result}`` and
  ``kvpack_ledger_reserve_seconds{role}``: durable reservations (receiver replay ledger,
  producer generation ledger) and their latency;
* ``kvpack_receipts_{written,failures,deferred,late,dropped}_total{role}``,
  ``kvpack_receipts_pending{role}`` and ``kvpack_receipts_writer_stuck_seconds{role}``: the
  receipt writer (``deferred``: replies that went out before their receipt was on disk);
* ``kvpack_prefilled_tokens_total{role}`` / ``kvpack_reused_tokens_total{role,tier}``:
  compute done and avoided;
* ``kvpack_build_info{role,version,python}`` and ``kvpack_model_info{role,model,engine,
  identity_sha256,threads,torch,transformers}``: constant 1, labelled with what runs.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import platform
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .. import __version__

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
log = logging.getLogger("kvpack.node.metrics")

#: the page may style itself inline and show inline SVG; it may load nothing, run nothing
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"


class _StoreCounters:
    """A collector of a PackStore handle's own counters (plain ints it keeps; see
    :class:`kvpack.store.packstore.PackStore`)."""

    SERIES = (
        (
            "kvpack_store_unreadable_entries",
            "unreadable_entries",
            "Index entries store lookups passed over because the storage failed to read them (a miss; never quarantined)",
        ),
        ("kvpack_store_withdrawn_restores", "withdrawn_restores", "Store restores that ended as a miss because their cut was forgotten while they ran"),
    )

    def __init__(self, role: str, store: Any) -> None:
        self.role = role
        self.store = store

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        for name, attribute, helptext in self.SERIES:
            family = CounterMetricFamily(name, helptext, labels=["role"])
            family.add_metric([self.role], float(getattr(self.store, attribute, 0) or 0))
            yield family


class _ReceiptCounters:
    """A collector of a :class:`~kvpack.node.receipts.ReceiptWriter`'s counters."""

    COUNTERS = (
        ("written", "Receipts published durably"),
        ("failures", "Receipt writes that failed (full disk, EIO) or were dropped"),
        ("deferred", "Replies that went out before their receipt was on disk (receipt pending: the receipts disk did not answer in time)"),
        ("late", "Receipts written after their reply went out (the receipts disk answered again)"),
        ("dropped", "Receipts dropped because too many were already waiting for the disk"),
    )

    def __init__(self, role: str, writer: Any) -> None:
        self.role = role
        self.writer = writer

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for attribute, helptext in self.COUNTERS:
            family = CounterMetricFamily(f"kvpack_receipts_{attribute}", helptext, labels=["role"])
            family.add_metric([self.role], float(getattr(self.writer, attribute, 0) or 0))
            yield family
        stats = self.writer.stats()
        pending = GaugeMetricFamily("kvpack_receipts_pending", "Receipts held in memory waiting for the receipts disk", labels=["role"])
        pending.add_metric([self.role], float(stats["pending"]))
        yield pending
        stuck = GaugeMetricFamily("kvpack_receipts_writer_stuck_seconds", "How long the receipt writer's current write has run (0: idle)", labels=["role"])
        stuck.add_metric([self.role], float(stats["writer_stuck_s"] or 0.0))
        yield stuck


class NodeMetrics:
    def __init__(self, role: str) -> None:
        from .status import StatusBoard

        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.transfers = Counter("kvpack_transfers", "Handoff transfers by verdict", ["role", "verdict"], registry=r)
        self.refusals = Counter("kvpack_refusals", "Refusals by reason", ["role", "reason"], registry=r)
        self.bytes = Counter("kvpack_transfer_bytes", "Handoff payload bytes", ["role"], registry=r)
        self.phase = Histogram("kvpack_phase_seconds", "Latency per phase", ["role", "phase"], buckets=_BUCKETS, registry=r)
        self.reservations = Counter("kvpack_ledger_reservations", "Durable ledger reservations", ["role", "result"], registry=r)
        self.reserve_s = Histogram("kvpack_ledger_reserve_seconds", "Ledger reservation latency", ["role"], buckets=_BUCKETS, registry=r)
        self.prefilled = Counter("kvpack_prefilled_tokens", "Tokens prefilled on this node", ["role"], registry=r)
        self.reused = Counter("kvpack_reused_tokens", "Tokens reused instead of recomputed", ["role", "tier"], registry=r)
        self.build_info = Gauge("kvpack_build_info", "kvpack build running this node (constant 1)", ["role", "version", "python"], registry=r)
        self.build_info.labels(role, __version__, platform.python_version()).set(1)
        self.model_info = Gauge(
            "kvpack_model_info",
            "Model and engine this node runs (constant 1)",
            ["role", "model", "engine", "identity_sha256", "threads", "torch", "transformers"],
            registry=r,
        )
        #: the status page and readiness checks (the daemon registers its snapshot provider)
        self.status = StatusBoard(role)
        self._server: _ObservabilityServer | None = None
        self.port: int | None = None
        self.host: str | None = None
        #: where serve() binds when the daemon calls it without arguments (set by the CLI)
        self.listen_host = "127.0.0.1"
        self.tls: ssl.SSLContext | None = None
        #: admin side: the cluster directory whose onboarding records the status page lists
        self.cluster_dir: str | None = None

    # -- recording -------------------------------------------------------------------------
    def transfer(self, verdict: str, nbytes: int = 0) -> None:
        self.transfers.labels(self.role, verdict).inc()
        if nbytes:
            self.bytes.labels(self.role).inc(nbytes)

    def refusal(self, reason: str) -> None:
        self.refusals.labels(self.role, reason).inc()

    def phases(self, timings: dict[str, float]) -> None:
        for name, seconds in timings.items():
            if seconds is not None and seconds >= 0:
                self.phase.labels(self.role, name).observe(seconds)

    def reservation(self, ok: bool, seconds: float) -> None:
        self.reservations.labels(self.role, "ok" if ok else "failed").inc()
        self.reserve_s.labels(self.role).observe(seconds)

    def watch_store(self, store: Any) -> None:
        """Export the node's pack-store handle's lookup counters, read at every scrape
        (``kvpack_store_unreadable_entries_total``, ``kvpack_store_withdrawn_restores_total``).
        Once per registry: a second call is ignored."""
        if getattr(self, "_store_watched", False):
            return
        self._store_watched = True
        self.registry.register(_StoreCounters(self.role, store))

    def watch_receipts(self, writer: Any) -> None:
        """Export a receipt writer's counters, read at every scrape
        (``kvpack_receipts_{written,failures,deferred,late,dropped}_total``,
        ``kvpack_receipts_pending``, ``kvpack_receipts_writer_stuck_seconds``). Once."""
        if getattr(self, "_receipts_watched", False):
            return
        self._receipts_watched = True
        self.registry.register(_ReceiptCounters(self.role, writer))

    def describe_engine(self, engine: Any) -> dict[str, str]:
        """Set ``kvpack_model_info`` from an engine (any adapter); returns the labels."""
        labels = engine_labels(engine)
        self.model_info.labels(self.role, *(labels[k] for k in ("model", "engine", "identity_sha256", "threads", "torch", "transformers"))).set(1)
        return labels

    # -- serving ---------------------------------------------------------------------------
    def configure_listener(self, host: str, tls: ssl.SSLContext | None = None) -> None:
        """Where :meth:`serve` binds (the CLI calls this before the daemon starts)."""
        check_exposure(host, tls)
        self.listen_host, self.tls = host, tls

    def serve(self, port: int = 0, *, host: str | None = None, tls: ssl.SSLContext | None = None) -> int:
        """Serve on ``host:port`` (default: the configured host, 127.0.0.1; port 0 picks a free
        port); returns the bound port. A non-loopback host needs ``tls`` (mutual TLS)."""
        host = host or self.listen_host
        tls = tls or self.tls
        check_exposure(host, tls)
        server = _ObservabilityServer(host, port, self, tls)
        self._server = server
        self.host = host
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, name=f"kvpack-{self.role}-metrics", daemon=True).start()
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def check_exposure(host: str, tls: ssl.SSLContext | None) -> None:
    """The exposure rule: loopback in the clear, anything else only with mutual TLS."""
    from ..errors import UsageError

    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise UsageError("usage", f"metrics listen host {host!r} must be an IP address") from None
    if not address.is_loopback and tls is None:
        raise UsageError("usage", f"metrics listen address {host} is not loopback: serve it with --metrics-tls (mutual TLS with the cluster CA)")


def metrics_tls_context(certificate_chain: str, private_key: str, ca: str) -> ssl.SSLContext:
    """HTTPS for the observability listener: the node's leaf; clients need a cluster-CA leaf."""
    from ..security.tls import load_identity

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=ca)
    load_identity(ctx, certificate_chain, private_key)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def engine_labels(engine: Any) -> dict[str, str]:
    """Model/engine labels of any adapter (missing fields are ``unknown``)."""
    ident = getattr(engine, "identity", None)
    abi = dict(getattr(ident, "engine_abi", {}) or {})
    digest = "unknown"
    try:
        digest = ident.ids().digest().hex() if ident is not None else "unknown"
    except Exception:  # noqa: BLE001 - labels are best effort; the node runs regardless
        pass
    return {
        "model": str(getattr(ident, "model_name", None) or getattr(engine, "name", None) or type(engine).__name__),
        "engine": type(engine).__name__,
        "identity_sha256": digest,
        "threads": str(abi.get("threads", getattr(engine, "threads", "unknown"))),
        "torch": str(abi.get("torch", "none")),
        "transformers": str(abi.get("transformers", "none")),
    }


class _ObservabilityServer(ThreadingHTTPServer):
    """One thread per connection, within two bounds (docs/operations.md, "Limits and
    deadlines"): at most :attr:`max_connections` at once (more are closed at once and
    counted in :attr:`refused`), and each connection -- TLS handshake, request head and
    answer -- whole within :attr:`connection_s`. The handler's ``timeout`` bounds each
    read only: a peer trickling a byte every few seconds used to hold a thread (and a file
    descriptor the data listener needs) for as long as it liked, and any number of them.
    ``serve_forever`` calls :meth:`service_actions` every 0.5 s; it shuts down the sockets of
    connections past their deadline, which ends their threads' blocked reads."""

    daemon_threads = True
    request_queue_size = 64
    max_connections = 64
    connection_s = 10.0

    def __init__(self, host: str, port: int, metrics: NodeMetrics, tls: ssl.SSLContext | None) -> None:
        self.metrics = metrics
        self.tls = tls
        self._active: dict[int, tuple[socket.socket, float]] = {}
        self._active_lock = threading.Lock()
        self.refused = 0
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            super().__init__((host, port), _Handler)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, f"metrics listen {host}:{port}") from None

    def get_request(self):
        sock, addr = super().get_request()
        if self.tls is not None:
            # the handshake runs in the request thread (first read), under the handler timeout
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def process_request(self, request, client_address) -> None:
        with self._active_lock:
            over = len(self._active) >= self.max_connections
            if over:
                self.refused += 1
            else:
                self._active[id(request)] = (request, time.monotonic() + self.connection_s)
        if over:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._active_lock:
            self._active.pop(id(request), None)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._active_lock:
            late = [sock for sock, end in self._active.values() if end <= now]
        for sock in late:
            try:  # the plain socket's shutdown (an SSLSocket's would drop its TLS object)
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def active(self) -> int:
        with self._active_lock:
            return len(self._active)

    def handle_error(self, request, client_address) -> None:
        log.debug("observability request failed", exc_info=True)


Route = Callable[["NodeMetrics"], tuple[int, str, bytes]]


def _route_metrics(m: NodeMetrics) -> tuple[int, str, bytes]:
    return 200, CONTENT_TYPE_LATEST, generate_latest(m.registry)


def _route_healthz(m: NodeMetrics) -> tuple[int, str, bytes]:
    return 200, "text/plain; charset=utf-8", b"ok\n"


def _route_readyz(m: NodeMetrics) -> tuple[int, str, bytes]:
    ready = m.status.readiness()
    return (200 if ready["ready"] else 503), "application/json", json.dumps(ready, sort_keys=True).encode() + b"\n"


def _route_status_json(m: NodeMetrics) -> tuple[int, str, bytes]:
    return 200, "application/json", json.dumps(m.status.snapshot(), sort_keys=True, default=str).encode() + b"\n"


def _route_status(m: NodeMetrics) -> tuple[int, str, bytes]:
    from .status import render_html

    return 200, "text/html; charset=utf-8", render_html(m.status.snapshot()).encode()


ROUTES: dict[str, Route] = {
    "/metrics": _route_metrics,
    "/healthz": _route_healthz,
    "/readyz": _route_readyz,
    "/status": _route_status,
    "/status.json": _route_status_json,
    "/": _route_status,
}


class _Handler(BaseHTTPRequestHandler):
    server: _ObservabilityServer
    timeout = 10  # per read; the server's connection_s bounds the whole connection
    server_version = "kvpack"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(head=True)

    def _answer(self, *, head: bool) -> None:
        route = ROUTES.get(self.path.split("?", 1)[0])
        if route is None:
            status, ctype, body = 404, "text/plain; charset=utf-8", b"not found\n"
        else:
            try:
                status, ctype, body = route(self.server.metrics)
            except Exception:  # noqa: BLE001 - one failed page never takes the listener down
                log.exception("observability route %s failed", self.path)
                status, ctype, body = 500, "text/plain; charset=utf-8", b"internal error\n"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Content-Security-Policy", CSP)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _refuse_method(self) -> None:
        self.send_error(405, "only GET and HEAD")

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse_method  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("observability %s", format % args)
