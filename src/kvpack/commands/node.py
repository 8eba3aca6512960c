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


def _store(path: str | None, default: str):
    from ..store import PackStore

    path = path or default
    if os.path.exists(os.path.join(path, "store.json")):
        return PackStore.open(path)
    return PackStore.init(path)


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
        return load_engine(args.engine, threads=args.threads)


def cmd_receiver(args: argparse.Namespace) -> int:
    from ..node.receiver import ReceiverNode
    from ..security.config import load_receiver_config

    cfg = load_receiver_config(args.config)
    base = os.path.dirname(cfg.path)
    engine = _engine(args)
    store = None if args.no_store else _store(args.store, os.path.join(base, "state", "store"))
    node = ReceiverNode(
        cfg,
        engine,
        receipts_dir=args.receipts or os.path.join(base, "receipts"),
        store=store,
        metrics_port=args.metrics_port,
        advertised_port=args.advertise_port,
        socket_path=args.socket or os.path.join(base, "state", "receiver.sock"),
    ).start()
    print(
        json.dumps(
            {
                "ready": True,
                "role": "receiver",
                "data_port": node.data_port,
                "metrics_port": node.metrics.port,
                "socket": node.socket_path,
                "ledger_probe_max_ms": None if node.probe is None else round(node.probe.max_ms, 3),
            }
        ),
        flush=True,
    )
    return _serve_until_signal(node.stop)


def cmd_producer(args: argparse.Namespace) -> int:
    from ..node.producer import ProducerNode
    from ..security.config import load_producer_config

    cfg = load_producer_config(args.config)
    base = os.path.dirname(cfg.path)
    engine = _engine(args)
    store = None if args.no_store else _store(args.store, os.path.join(base, "state", "store"))
    node = ProducerNode(
        cfg,
        engine,
        receipts_dir=args.receipts or os.path.join(base, "receipts"),
        store=store,
        metrics_port=args.metrics_port,
        pacing_bytes_per_s=args.pacing_bytes_per_s,
    ).start()
    print(json.dumps({"ready": True, "role": "producer", "control_port": node.control_port, "metrics_port": node.metrics.port}), flush=True)
    return _serve_until_signal(node.stop)


def cmd_request(args: argparse.Namespace) -> int:
    from ..node.receiver import request_local

    payload: dict = {"max_new_tokens": args.max_new_tokens, "save": args.save, "chat": not args.raw}
    if args.tokens_file:
        with open(args.tokens_file, encoding="utf-8") as fh:
            payload["tokens"] = json.load(fh)
    else:
        payload["prompt"] = args.prompt
    reply = request_local(args.socket, payload)
    if args.json:
        print(json.dumps(reply, sort_keys=True))
    elif reply.get("ok"):
        res = reply["result"]
        print(res.get("text", res["tokens"]))
        t = res.get("transfer") or {}
        print(
            f"[{res['plan']['action']} via {res['plan']['tier']}; ttft {res['ttft_s']:.3f} s; "
            f"payload {t.get('payload_bytes', 0)} B; prefix_cut {t.get('prefix_cut', 0)}]",
            file=sys.stderr,
        )
    else:
        print(f"refused {reply['error']['reason']}: {reply['error']['detail']}", file=sys.stderr)
    return 0 if reply.get("ok") else 1


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="node config written by kvpack enroll")
    p.add_argument("--engine", default="smollm2", help="smollm2 (default) or arrays:L:H:D (NumPy adapter, tests)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (part of the engine identity)")
    p.add_argument("--store", help="pack store directory (default: <config dir>/state/store, created)")
    p.add_argument("--no-store", action="store_true", help="no durable tier")
    p.add_argument("--receipts", help="receipt directory (default: <config dir>/receipts)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port on 127.0.0.1 (0: any free port)")


def register(sub) -> None:
    p = sub.add_parser("receiver", help="run the decode node (Handoff V2 receiver) daemon")
    _common(p)
    p.add_argument("--socket", help="local API Unix socket (default: <config dir>/state/receiver.sock)")
    p.add_argument("--advertise-port", type=int, help="data port to advertise in requests (NAT, proxies)")
    p.set_defaults(func=cmd_receiver)

    p = sub.add_parser("producer", help="run the prefill node (Handoff V2 producer) daemon")
    _common(p)
    p.add_argument("--pacing-bytes-per-s", type=float, help="pace data writes (upstream paces at 1e9 B/s)")
    p.set_defaults(func=cmd_producer)

    p = sub.add_parser("request", help="ask a running decode node to complete a prompt")
    p.add_argument("--socket", required=True, help="the receiver's local API socket")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user prompt (through the chat template)")
    src.add_argument("--tokens-file", help="JSON list of token ids (used verbatim)")
    p.add_argument("--raw", action="store_true", help="tokenize the prompt without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--save", action="store_true", help="also save the prompt's cut to the receiver's pack store")
    p.add_argument("--json", action="store_true", help="print the whole reply as JSON")
    p.set_defaults(func=cmd_request)
