"""``kvpack receiver``, ``kvpack producer`` and ``kvpack request``: run the node daemons and
ask a running decode node for a completion (docs/operations.md).

Each daemon prints one JSON line on stdout once it is listening (``{"ready": true, ...}``
with its ports), then serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from ._args import check_unix_socket_path, existing_file, max_new_tokens, not_a_file, port, port_or_zero, positive_float, socket_address, threads
from ._args import duration, duration_at_most, engine_spec, int_range, nonneg_int, positive_int, refuse_ignored, unix_socket_path

METRICS_LISTEN_DEFAULT = "127.0.0.1:0"
#: kvpack.node.transport.Limits.handshake_s allows (0, 600]
MAX_HANDSHAKE_S = 600.0


def _store_location_args(p: argparse.ArgumentParser) -> None:
    """``--endpoint``, ``--s3-credentials`` and ``--root-key-file``, as every store verb."""
    from .store import _location_args

    _location_args(p)


def _store(args: argparse.Namespace, default: str):
    """The daemon's durable tier: ``--store`` (a directory or s3://bucket/prefix with
    ``--endpoint``), opened or created like ``kvpack generate``'s."""
    from ..store.location import open_or_init, store_kwargs

    return open_or_init(args.store or default, **store_kwargs(args))


def _serve_until_signal(stop) -> int:
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    try:
        while not done.wait(0.5):
            pass
    finally:
        stop()
    return 0


def _engine(args):
    from ..node.common import load_engine
    from ..progress import status

    with status(f"loading engine {args.engine} ..."):
        engine = load_engine(args.engine, threads=args.threads)
    if callable(getattr(engine, "prepare", None)):
        with status("checking the engine on this device (block prefill probe) ..."):
            engine.prepare()
    return engine


def _refuse_ignored_daemon_flags(args: argparse.Namespace) -> None:
    if args.no_store:
        stores = [("--store", args.store is not None)] + [
            (f"--{n.replace('_', '-')}", getattr(args, n, None) is not None) for n in ("endpoint", "s3_credentials", "root_key_file")
        ]
        refuse_ignored(stores, because="--no-store")
    if args.no_metrics:
        metrics = [
            ("--metrics-listen", args.metrics_listen != METRICS_LISTEN_DEFAULT),
            ("--metrics-port", args.metrics_port is not None),
            ("--metrics-tls", args.metrics_tls),
            ("--cluster-dir", args.cluster_dir is not None),  # shown on the status page only
        ]
        refuse_ignored(metrics, because="--no-metrics")


def _limits(args):
    from ..node.transport import Limits

    return Limits(max_connections=args.max_connections, max_handshakes=max(1, args.max_connections // 2), handshake_s=args.handshake_timeout)


def cmd_receiver(args: argparse.Namespace) -> int:
    """Fail fast (issue 14): configs, store, ledgers + volume probes, ports and the API socket
    are checked and bound *before* the model loads; then the engine, then serving."""
    from ..node.local_api import ApiLimits
    from ..node.receiver import ReceiverNode
    from ..security.config import load_receiver_config

    _refuse_ignored_daemon_flags(args)
    cfgs = [load_receiver_config(path) for path in args.config]
    if args.listen:
        # e.g. a qualification receiver on port 0 next to the node's serving daemon
        import dataclasses

        from ..security.config import parse_socket_address

        listen_host, listen_port = parse_socket_address(args.listen, "--listen")
        cfgs = [dataclasses.replace(c, listen_host=listen_host, listen_port=listen_port) for c in cfgs]
    if args.producer_control:
        cfgs = [_with_producer_control(cfgs, args.producer_control)]
    cfg = cfgs[0]
    base = os.path.dirname(cfg.path)
    socket_path = args.socket or os.path.join(base, "state", "receiver.sock")
    check_unix_socket_path(socket_path)
    metrics_host, metrics_tls = _metrics_listener(args, cfg.data_endpoint())
    store = None if args.no_store else _store(args, os.path.join(base, "state", "store"))
    node = ReceiverNode(
        cfgs,
        None,
        receipts_dir=args.receipts or os.path.join(base, "receipts"),
        store=store,
        metrics_port=_metrics_port(args),
        advertised_port=args.advertise_port,
        socket_path=socket_path,
        resident_bytes=args.resident_mib << 20,
        decode_slots=args.decode_slots,
        stripes=args.stripes,
        limits=_limits(args),
        api_limits=ApiLimits(max_request_bytes=args.max_request_bytes, max_new_tokens=args.max_new_tokens_limit),
        slot_wait_s=args.slot_wait,
        ledger_max_tail_ms=args.ledger_max_tail_ms,
        tls_fronts=args.tls_fronts,
        receipt_wait_s=args.receipt_wait,
        ledger_deadline_s=args.ledger_deadline,
    )
    _prepare_metrics(node, metrics_host, metrics_tls, args)
    _bind(node)
    _start(node, _engine(args))
    ready = {
        "ready": True,
        "role": "receiver",
        "data_port": node.data_port,
        "metrics_port": node.metrics.port,
        "metrics_url": _metrics_url(node),
        "socket": node.socket_path,
        "producers": [link.name for link in node.links],
        "decode_slots": node.decode_slot_count,
        # TLS front processes of the data listener (0: handshakes and records in-process)
        "tls_fronts": node.tls_fronts,
        "ledger_probe_max_ms": None if node.probe is None else round(node.probe.max_ms, 3),
    }
    _announce(ready)
    return _serve_until_signal(node.stop)


def _with_producer_control(cfgs, address: str):
    """The one config with its producer's control address replaced (a producer that listens
    on port 0 reports the port it got in its ready line; this is where it goes)."""
    import dataclasses

    from ..errors import UsageError
    from ..security.config import ProducerControl, parse_host_port

    if len(cfgs) != 1 or cfgs[0].producer_control is None:
        raise UsageError("usage", "--producer-control takes exactly one --config, with producer_control")
    host, port = parse_host_port(address, "--producer-control")
    old = cfgs[0].producer_control
    return dataclasses.replace(cfgs[0], producer_control=ProducerControl(address, host, port, old.server_name))


def cmd_receive(args: argparse.Namespace) -> int:
    """``kvpack receive --once``: bind, admit one unsolicited transfer (C.15 without
    producer_control), print its receipt; exit 0 when it committed, else its refusal."""
    import queue

    from ..cli_errors import CommandFailed
    from ..errors import NetworkError, SecurityError
    from ..node.receiver import ReceiverNode
    from ..security.config import load_receiver_config

    if args.no_store:
        refuse_ignored([("--store", args.store is not None)], because="--no-store")
    cfg = load_receiver_config(args.config)
    if cfg.producer_control is not None:
        raise SecurityError("config", f"{cfg.path}: kvpack receive takes a receiver config without producer_control (unsolicited mode)")
    base = os.path.dirname(cfg.path)
    store = None if args.no_store else _store(args, os.path.join(base, "state", "store"))
    node = ReceiverNode(
        cfg,
        None,
        receipts_dir=args.receipts or os.path.join(base, "receipts"),
        store=store,
        metrics_port=None,
        socket_path=None,
        ledger_max_tail_ms=args.ledger_max_tail_ms,
    )
    _bind(node)  # fail fast: ledger lock, volume probe and data port before the model loads
    _start(node, _engine(args))
    try:
        print(json.dumps({"ready": True, "role": "receive", "data_port": node.data_port}), file=sys.stderr, flush=True)
        try:
            outcome = node.landed.get(timeout=args.timeout)
        except queue.Empty:
            raise NetworkError("timeout", f"no transfer was admitted within {args.timeout:g} s (refused connections are in the receipts)") from None
    finally:
        node.stop()
    info = outcome.info
    if args.json:
        print(json.dumps(info, sort_keys=True, default=str))
    elif outcome.error is None:
        print(
            f"committed {info['transfer_id']} (generation {info['generation']}): {info['position']} tokens, "
            f"{info['payload_bytes']} B in {info['segments']} segments; session {info.get('session')}; receipt {info.get('receipt_path')}"
        )
    if outcome.error is not None:
        raise CommandFailed(str(info.get("reason", "refused")), str(info.get("detail", "")))
    return 0


def cmd_producer(args: argparse.Namespace) -> int:
    from ..node.producer import ProducerNode
    from ..security.config import load_producer_config

    _refuse_ignored_daemon_flags(args)
    cfg = load_producer_config(args.config)
    if args.control_listen:
        import dataclasses

        from ..security.config import parse_socket_address

        host, port_number = parse_socket_address(args.control_listen, "--control-listen")
        cfg = dataclasses.replace(cfg, control_listen_host=host, control_listen_port=port_number)
    base = os.path.dirname(cfg.path)
    metrics_host, metrics_tls = _metrics_listener(args, cfg.control_endpoint())
    store = None if args.no_store else _store(args, os.path.join(base, "state", "store"))
    node = ProducerNode(
        cfg,
        None,
        receipts_dir=args.receipts or os.path.join(base, "receipts"),
        store=store,
        metrics_port=_metrics_port(args),
        pacing_bytes_per_s=args.pacing_bytes_per_s,
        resident_bytes=args.resident_mib << 20,
        limits=_limits(args),
        prefill_slots=args.prefill_slots,
        max_stripes=args.max_stripes,
        receipt_wait_s=args.receipt_wait,
        ledger_deadline_s=args.ledger_deadline,
    )
    _prepare_metrics(node, metrics_host, metrics_tls, args)
    _bind(node)
    _start(node, _engine(args))
    _announce({"ready": True, "role": "producer", "control_port": node.control_port, "metrics_port": node.metrics.port, "metrics_url": _metrics_url(node)})
    return _serve_until_signal(node.stop)


def _bind(node) -> None:
    """Everything that can fail without a model (locks, ports, sockets, volume probes)."""
    try:
        node.bind()
    except BaseException:
        try:
            node.stop()
        except Exception:  # noqa: BLE001 - the bind failure is what the operator must see
            pass
        raise


def _start(node, engine=None) -> None:
    """Start a daemon; if anything fails, release what it bound."""
    try:
        node.start(engine)
    except BaseException:
        try:
            node.stop()
        except Exception:  # noqa: BLE001 - the start failure is what the operator must see
            pass
        raise


def _metrics_port(args) -> int | None:
    if args.no_metrics:
        return None
    _host, _sep, port_text = args.metrics_listen.rpartition(":")
    return args.metrics_port if args.metrics_port is not None else int(port_text)


def _metrics_listener(args, endpoint):
    """(host, TLS context or None) of the observability listener, checked before any work."""
    from ..node.metrics import check_exposure, metrics_tls_context
    from ..security.config import parse_socket_address

    host, _port = parse_socket_address(args.metrics_listen, "--metrics-listen")
    tls = metrics_tls_context(endpoint.certificate_chain, endpoint.private_key, endpoint.peer_ca) if args.metrics_tls else None
    check_exposure(host, tls)
    return host, tls


def _prepare_metrics(node, host: str, tls, args) -> None:
    node.metrics.configure_listener(host, tls)
    node.metrics.cluster_dir = args.cluster_dir


def _metrics_url(node) -> str | None:
    if node.metrics.port is None:
        return None
    host = node.metrics.host or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if node.metrics.tls else 'http'}://{host}:{node.metrics.port}/"


def _announce(ready: dict) -> None:
    from ..logs import event

    print(json.dumps(ready), flush=True)
    import logging

    event(logging.getLogger("kvpack.node"), "ready", **ready)


def cmd_request(args: argparse.Namespace) -> int:
    from ..cli_errors import CommandFailed
    from ..errors import NetworkError
    from ..node.local_api import request_local
    from ._args import read_token_ids

    if args.tokens_file:
        refuse_ignored([("--raw", args.raw)], because="--tokens-file (token ids are used verbatim)")
    payload: dict = {"max_new_tokens": args.max_new_tokens, "save": args.save, "chat": not args.raw}
    if args.stripes is not None:
        payload["stripes"] = args.stripes
    if args.producer is not None:
        payload["producer"] = args.producer
    if args.ignore_eos:
        payload["stop_at_eos"] = False
    if args.session:
        payload["session"] = args.session
    if args.tokens_file:
        payload["tokens"] = read_token_ids(args.tokens_file, stdin_text=sys.stdin.read() if args.tokens_file == "-" else None)
    else:
        payload["prompt"] = args.prompt
    from ..progress import status

    try:
        with status("waiting for the decode node: plan, prefill and transfer (or local reuse), decode ..."):
            reply = request_local(args.socket, payload, timeout=args.timeout)
    except FileNotFoundError:
        raise NetworkError("unreachable", f"no local API socket at {args.socket} (is kvpack receiver running with this --socket?)") from None
    except ConnectionRefusedError:
        raise NetworkError("unreachable", f"nothing accepts connections on {args.socket} (a stale socket of a stopped receiver?)") from None
    except TimeoutError:
        raise NetworkError("timeout", f"the decode node did not answer within {args.timeout:g} s") from None
    except ValueError:
        raise NetworkError("unreachable", f"the decode node at {args.socket} closed the connection without a reply") from None
    if not reply.get("ok"):
        error = reply.get("error") or {}
        raise CommandFailed(str(error.get("reason", "refused")), str(error.get("detail", "")))
    if args.json:
        print(json.dumps(reply, sort_keys=True))
        return 0
    res = reply["result"]
    print(res.get("text", res["tokens"]))
    t = res.get("transfer") or {}
    print(
        f"[{res['plan']['action']} via {res['plan']['tier']}; ttft {res['ttft_s']:.3f} s; "
        f"payload {t.get('payload_bytes', 0)} B; prefix_cut {t.get('prefix_cut', 0)}]",
        file=sys.stderr,
    )
    saved = res.get("saved")
    if isinstance(saved, dict) and saved.get("error"):  # served; only the --save failed (a full store disk)
        print(f"[not saved: {saved['error']}]", file=sys.stderr)
    return 0


def _spec_help() -> str:
    from ..engine.registry import SPEC_HELP

    return SPEC_HELP


def _common(p: argparse.ArgumentParser, *, many_configs: bool = False) -> None:
    if many_configs:
        p.add_argument(
            "--config",
            required=True,
            type=existing_file,
            action="append",
            help="receiver config written by kvpack enroll (repeat it, one per enrolled producer, to serve several producers from one node and port)",
        )
    else:
        p.add_argument("--config", required=True, type=existing_file, help="node config written by kvpack enroll")
    p.add_argument("--engine", type=engine_spec, default="smollm2", help=_spec_help())
    p.add_argument("--threads", type=threads, help="torch threads (part of the engine identity: every node the same; default: the engine's default)")
    p.add_argument("--store", type=not_a_file, help="pack store: a directory or s3://bucket/prefix (default: <config dir>/state/store, created)")
    p.add_argument("--no-store", action="store_true", help="no durable tier")
    _store_location_args(p)
    p.add_argument("--receipts", type=not_a_file, help="receipt directory (default: <config dir>/receipts)")
    p.add_argument(
        "--metrics-listen",
        type=socket_address(),
        default=METRICS_LISTEN_DEFAULT,
        help="observability listener (/metrics, /healthz, /readyz, /status) ip:port; port 0 picks a free one; non-loopback needs --metrics-tls",
    )
    p.add_argument("--metrics-port", type=port_or_zero, help="shorthand: the port of --metrics-listen (default: that address's port)")
    p.add_argument(
        "--metrics-tls", action="store_true", help="serve the observability listener over mutual TLS (node certificate; clients need a cluster-CA certificate)"
    )
    p.add_argument("--no-metrics", action="store_true", help="no observability listener")
    p.add_argument("--cluster-dir", type=not_a_file, help="admin machine: list this cluster's onboarding records on the status page")
    p.set_defaults(log_default="info")


def _limit_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resident-mib", type=nonneg_int, default=1024, help="memory for prefixes kept resident for reuse (MiB; 0: none)")
    p.add_argument(
        "--max-connections", type=positive_int, default=512, help="connections held on the listener in any state (half of them may be in their TLS handshake)"
    )
    p.add_argument(
        "--handshake-timeout", type=duration_at_most(MAX_HANDSHAKE_S), default=5.0, help="seconds a peer has to finish its whole TLS handshake (at most 600)"
    )
    p.add_argument(
        "--receipt-wait",
        type=duration,
        default=1.0,
        help="seconds a reply waits for its receipt to be on disk; then it goes out and the receipt is written when the disk answers (pending)",
    )
    p.add_argument(
        "--ledger-deadline",
        type=duration,
        default=5.0,
        help="seconds a transfer waits for the replay/generation ledger (its lock, a durable write) before it is refused ledger_unavailable",
    )


def register(sub) -> None:
    p = sub.add_parser("receiver", help="run the decode node (Handoff V2 receiver) daemon")
    _common(p, many_configs=True)
    _limit_flags(p)
    p.add_argument("--decode-slots", type=int_range(1, 256), default=4, help="requests served at once (one engine session each)")
    p.add_argument(
        "--stripes",
        type=int_range(1, 16),
        default=1,
        help="connections a handoff may be striped over (a producer that does not speak kvpack's extension sends one)",
    )
    p.add_argument("--max-new-tokens-limit", type=int_range(1, 1 << 16), default=4096, help="the largest max_new_tokens a request may ask for")
    p.add_argument("--max-request-bytes", type=int_range(1 << 10, 1 << 30), default=8 << 20, help="the largest local API request line")
    p.add_argument("--slot-wait", type=duration, default=60.0, help="seconds a request waits for a free decode slot before it is refused")
    p.add_argument("--socket", type=unix_socket_path, help="local API Unix socket (default: <config dir>/state/receiver.sock)")
    p.add_argument(
        "--tls-fronts",
        type=_tls_fronts,
        default="auto",
        help="TLS front processes of the data listener: they run handshakes and decrypt, so striped handoffs decrypt in parallel "
        "(0: in this process; default auto: min(8, cpus/2) on 8 cores or more, else 0)",
    )
    p.add_argument("--advertise-port", type=port, help="data port to advertise in requests (NAT, proxies; default: the bound data port)")
    p.add_argument(
        "--ledger-max-tail-ms",
        type=positive_float,
        help="refuse to start when the worst of 20 ledger reservations on the ledger's volume exceeds this (default: 100)",
    )
    p.add_argument(
        "--listen",
        type=socket_address(),
        help="override the config's listen address (ip:port; port 0 picks a free one and advertises it; default: the config's)",
    )
    p.add_argument(
        "--producer-control",
        help="override the producer's control address (host:port, one --config only; e.g. the control_port a producer on port 0 reported)",
    )
    p.set_defaults(func=cmd_receiver, extras=("node",))

    p = sub.add_parser("producer", help="run the prefill node (Handoff V2 producer) daemon")
    _common(p)
    _limit_flags(p)
    p.add_argument("--prefill-slots", type=int_range(1, 256), default=4, help="requests prefilled at once (more are answered failed: busy)")
    p.add_argument("--max-stripes", type=int_range(1, 16), default=8, help="most connections one handoff is striped over when a receiver asks")
    p.add_argument("--pacing-bytes-per-s", type=positive_float, help="pace data writes (upstream paces at 1e9 B/s; default: unpaced)")
    p.add_argument(
        "--control-listen",
        type=socket_address(),
        help="override the config's control listen address (ip:port; port 0 picks a free one, reported as control_port in the ready line)",
    )
    p.set_defaults(func=cmd_producer, extras=("node",))

    p = sub.add_parser("request", help="ask a running decode node to complete a prompt")
    p.add_argument("--socket", required=True, type=unix_socket_path, help="the receiver's local API socket")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user prompt (through the chat template)")
    src.add_argument("--tokens-file", type=_tokens_file, help="JSON list of token ids (used verbatim; - reads stdin)")
    p.add_argument("--raw", action="store_true", help="tokenize the prompt without the chat template")
    p.add_argument("--max-new-tokens", type=max_new_tokens, default=32, help="tokens to decode after the prompt")
    p.add_argument("--ignore-eos", action="store_true", help="decode exactly --max-new-tokens tokens (do not stop at end-of-sequence)")
    p.add_argument("--save", action="store_true", help="also save the prompt's cut to the receiver's pack store")
    p.add_argument(
        "--session",
        help="decode from this received session (unsolicited mode; its name is the transfer id): the prompt is the whole prompt, starting with the session's tokens",
    )
    p.add_argument("--timeout", type=duration, default=900.0, help="seconds to wait for the reply")
    p.add_argument("--stripes", type=int_range(1, 16), help="stripe the handoff over this many connections (default: the node's --stripes)")
    p.add_argument("--producer", help="ask this enrolled producer (default: the node picks one)")
    p.set_defaults(func=cmd_request, extras=("node",))

    p = sub.add_parser("receive", help="one-shot decode node: wait for one unsolicited transfer, print its receipt, exit")
    p.add_argument("--config", required=True, type=existing_file, help="receiver config without producer_control (unsolicited mode)")
    p.add_argument("--engine", type=engine_spec, default="smollm2", help=_spec_help())
    p.add_argument("--threads", type=threads, help="torch threads (part of the engine identity; default: the engine's default)")
    p.add_argument(
        "--store",
        type=not_a_file,
        help="pack store for the received prefix cut: a directory or s3://bucket/prefix (default: <config dir>/state/store, created)",
    )
    p.add_argument("--no-store", action="store_true", help="no durable tier")
    _store_location_args(p)
    p.add_argument("--receipts", type=not_a_file, help="receipt directory (default: <config dir>/receipts)")
    p.add_argument(
        "--ledger-max-tail-ms",
        type=positive_float,
        help="refuse to start when the worst of 20 ledger reservations on the ledger's volume exceeds this (default: 100)",
    )
    p.add_argument(
        "--once", action="store_true", help="accepted for older scripts: receive always takes one transfer and exits (the long-running form is kvpack receiver)"
    )
    p.add_argument("--timeout", type=duration, default=900.0, help="seconds to wait for an admitted transfer")
    p.set_defaults(func=cmd_receive, extras=("node",))


def _tls_fronts(text: str) -> str:
    from ..errors import KvpackError
    from ..node.tls_front import resolve_fronts

    try:
        resolve_fronts(text)
    except KvpackError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


_tls_fronts.__name__ = "tls fronts"  # argparse names the type in its error: "invalid tls fronts value"


def _tokens_file(text: str) -> str:
    return text if text == "-" else existing_file(text)
