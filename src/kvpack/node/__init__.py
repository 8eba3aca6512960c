"""kvpack node daemons: the decode node (:mod:`.receiver`), the prefill node (:mod:`.producer`),
the reuse ladder (:mod:`.ladder`), the engine <-> Handoff V2 mapping (:mod:`.wire`) and
Prometheus metrics (:mod:`.metrics`).

The protocol logic lives in :mod:`kvpack.handoff` (sans-I/O) and the transport security in
:mod:`kvpack.security`; this package is the thin I/O driver that joins them to an engine
adapter: sockets, threads, clocks, files. See docs/protocol.md ("Node wiring") and
docs/operations.md.
"""
