"""Prometheus metrics of a node daemon, served on a loopback port (DESIGN.md principle 7).

Each daemon owns one :class:`NodeMetrics` with its own registry (so two nodes in one test
process do not collide) and serves it with ``prometheus_client``'s HTTP exporter bound to
127.0.0.1 only: metrics name transfers and refusals, which is operational data, and the
daemon's only network-facing ports are the mTLS ones.

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
* ``kvpack_prefilled_tokens_total{role}`` / ``kvpack_reused_tokens_total{role,tier}``:
  compute done and avoided.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class NodeMetrics:
    def __init__(self, role: str) -> None:
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
        self._server: WSGIServer | None = None
        self.port: int | None = None

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

    # -- serving ---------------------------------------------------------------------------
    def serve(self, port: int = 0) -> int:
        """Serve on 127.0.0.1:``port`` (0 picks a free port); returns the bound port."""
        server, _thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        self._server = server
        self.port = server.server_address[1]
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def text(self) -> str:
        return generate_latest(self.registry).decode()
