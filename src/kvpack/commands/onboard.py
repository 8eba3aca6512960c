"""``kvpack node`` (admin machine) and ``kvpack node-local`` (the node, run over SSH).

    kvpack node add USER@HOST --cluster DIR --role producer|receiver [--name N] [--ssh-port P]
                    [--known-hosts FILE] [--ssh-key FILE] [--node-dir DIR] [--engine SPEC]
                    [--threads N] [--listen IP:PORT | --control-listen IP:PORT] [--peer NAME]
                    [--san NAME ...] [--min-payload-gbps X] [--probe-max-tail-ms MS]
                    [--remote-kvpack CMD] [--json]
    kvpack node list --cluster DIR [--json]
    kvpack node show NAME --cluster DIR [--json]
    kvpack node remove NAME --cluster DIR [--ssh-key FILE]

``node`` is its own command group next to the daemon commands (``kvpack producer``,
``kvpack receiver``, ``kvpack request``), which keep their names. ``node-local`` is what the
wizard runs on the node; an operator can run it by hand too (``status``, ``daemon stop``).
The work lives in :mod:`kvpack.onboard`; this module only parses and prints.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_node(subparsers)
    _register_node_local(subparsers)


def _register_node(subparsers: argparse._SubParsersAction) -> None:
    from ._args import days, engine_spec, existing_dir, existing_file, nonneg_float, port, positive_float, socket_address, threads

    parser = subparsers.add_parser("node", help="onboard nodes over SSH: add, list, show, remove")
    sub = parser.add_subparsers(dest="node_command", metavar="ACTION")
    sub.required = True

    add = sub.add_parser("add", help="onboard USER@HOST: keys born on the node, CSR signed, configs, daemon, qualification, healthy")
    add.add_argument("destination", help="USER@HOST of the node (SSH login)")
    add.add_argument("--cluster", required=True, type=existing_dir, help="cluster directory (kvpack enroll init)")
    add.add_argument("--role", required=True, choices=("producer", "receiver"), help="what the node will run")
    add.add_argument("--name", help="node name (default: the host name's first label)")
    add.add_argument("--ssh-port", type=port, default=22, help="the node's SSH port")
    add.add_argument(
        "--known-hosts", type=existing_file, help="known-hosts file holding the node's host key (default ~/.ssh/known_hosts); no trust on first use"
    )
    add.add_argument("--ssh-key", type=existing_file, help="SSH private key for the login (default: ssh's own identities)")
    add.add_argument("--node-dir", help="node directory on the node (default kvpack/<name> under the login's home)")
    add.add_argument(
        "--engine",
        type=engine_spec,
        default="smollm2",
        help="engine spec the node runs (its identity must be the cluster's): smollm2, muse-tiny, arrays:L:H:D[:DTYPE]",
    )
    add.add_argument("--threads", type=threads, help="torch threads, part of the identity (default: the engine's default)")
    add.add_argument("--listen", type=socket_address(), help="receiver: Handoff V2 listen address on the node (ip:port)")
    add.add_argument("--control-listen", type=socket_address(allow_port_zero=False), help="producer: control listen address on the node (ip:port)")
    add.add_argument("--peer", help="the enrolled node to qualify against (default: the only one of the other role)")
    add.add_argument("--san", action="append", default=[], help="extra subjectAltName for the node's certificate")
    add.add_argument("--days", type=days, default=365, help="leaf validity in days")
    add.add_argument(
        "--min-payload-gbps", type=nonneg_float, help="override the recipe's payload-rate floor (median of three, receiver clock; default: the recipe's)"
    )
    add.add_argument("--probe-max-tail-ms", type=positive_float, default=100.0, help="ledger-volume probe limit on the node")
    add.add_argument("--remote-kvpack", default="kvpack", help="how to run kvpack on the node (e.g. 'python3 -m kvpack.cli')")
    add.add_argument("--json", action="store_true", help="print the final state record as JSON")
    add.set_defaults(func=_add)

    lst = sub.add_parser("list", help="nodes and their onboarding state")
    lst.add_argument("--cluster", required=True, type=existing_dir, help="cluster directory")
    lst.add_argument("--json", action="store_true", help="one JSON list (the fields the status page shows)")
    lst.set_defaults(func=_list)

    show = sub.add_parser("show", help="one node's onboarding record (stages, receipts, qualification)")
    show.add_argument("name", help="node name")
    show.add_argument("--cluster", required=True, type=existing_dir, help="cluster directory")
    show.add_argument("--json", action="store_true", help="the registry entry and the whole state record as JSON")
    show.set_defaults(func=_show)

    rm = sub.add_parser("remove", help="revoke a node: registry, peers' configs and keys, its daemons")
    rm.add_argument("name", help="node name")
    rm.add_argument("--cluster", required=True, type=existing_dir, help="cluster directory")
    rm.add_argument("--ssh-key", type=existing_file, help="SSH private key (default: the one recorded when the node was added)")
    rm.set_defaults(func=_remove)


def _register_node_local(subparsers: argparse._SubParsersAction) -> None:
    from ._args import engine_spec, existing_file, int_range, not_a_file, positive_float, socket_address, threads

    key_version = int_range(1, 1000, what="a key version")
    parser = subparsers.add_parser("node-local", help="node-side onboarding steps (run by 'kvpack node add' over SSH)")
    sub = parser.add_subparsers(dest="node_local_command", metavar="STEP")
    sub.required = True

    def step(name: str, help_text: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--dir", required=True, type=not_a_file, help="the node directory")
        p.set_defaults(func=func)
        return p

    step("preflight", "create the node directory and its state/ volume; report the kvpack version", _nl_preflight)
    p = step("keygen", "generate (or reuse) the TLS key in staging/v<N>; print only its CSR", _nl_keygen)
    p.add_argument("--name", required=True, help="node name (the CSR's CN)")
    p.add_argument("--version", type=key_version, required=True, help="key version N: staging/v<N>")
    p.add_argument("--san", action="append", default=[], help="subjectAltName to request (repeat)")
    p = step("install", "install certificate and CA (JSON on stdin) for the staged key", _nl_install)
    p.add_argument("--version", type=key_version, required=True, help="key version N the certificate was issued for")
    p = step("put-secret", "write an HMAC key (stdin) as hmac/<key_id>.key, 0600", _nl_put_secret)
    p.add_argument("--key-id", required=True, help="<producer>-to-<receiver>")
    p = step("remove-secret", "delete hmac/<key_id>.key", _nl_remove_secret)
    p.add_argument("--key-id", required=True, help="<producer>-to-<receiver>")
    p = step("put-config", "validate a config (stdin) as its daemon will, then publish it", _nl_put_config)
    p.add_argument("--name", required=True, help="producer.json or receiver.<producer>.json")
    p = step("remove-config", "delete a config", _nl_remove_config)
    p.add_argument("--name", required=True, help="producer.json or receiver.<producer>.json")
    p = step("receipt", "print one daemon receipt from inside the node directory", _nl_receipt)
    p.add_argument("--path", required=True, type=existing_file, help="the receipt file (as the daemon reported it)")
    step("status", "what is installed and running on this node", _nl_status)
    p = step("daemon", "start, stop or inspect a managed daemon unit", _nl_daemon)
    p.add_argument("action", choices=("start", "stop", "status"), help="what to do with the unit")
    p.add_argument("--unit", required=True, help="unit name (producer, receiver, qualify-<producer>)")
    p.add_argument("--role", choices=("producer", "receiver"), help="start: which daemon")
    p.add_argument("--config", help="start: config file name in the node directory")
    p.add_argument("--engine", type=engine_spec, default="smollm2", help="start: engine spec (smollm2, muse-tiny, arrays:L:H:D[:DTYPE])")
    p.add_argument("--threads", type=threads, default=2, help="start: torch threads")
    p.add_argument("--no-store", action="store_true", help="start: no durable pack store")
    p.add_argument("--listen", type=socket_address(), help="start (receiver): listen address override, e.g. 127.0.0.1:0")
    p.add_argument("--receipts", help="start: keep receipts in run/<NAME>/receipts")
    p.add_argument("--restart", action="store_true", help="start: restart a running unit")
    p.add_argument("--if-running", action="store_true", help="start: only (re)start a unit that is running now")
    p.add_argument("--ledger-max-tail-ms", type=positive_float, help="start (receiver): the daemon's ledger-volume gate (default: the daemon's, 100)")
    p.add_argument("--timeout", type=positive_float, default=1800.0, help="start: seconds to wait for the ready line")


# -- node ------------------------------------------------------------------------------------------


def _add(args: argparse.Namespace) -> int:
    from ..onboard.ssh import parse_destination
    from ..onboard.wizard import AddOptions, Wizard

    from ..engine.registry import default_threads, parse_spec

    _user, host = parse_destination(args.destination)
    name = args.name or host.split(".")[0].lower()
    engine = parse_spec(args.engine).text
    threads = default_threads(engine) if args.threads is None else args.threads
    opts = AddOptions(
        cluster=args.cluster,
        name=name,
        role=args.role,
        destination=args.destination,
        ssh_port=args.ssh_port,
        known_hosts=args.known_hosts,
        ssh_key=args.ssh_key,
        node_dir=args.node_dir,
        engine=engine,
        threads=threads,
        listen=args.listen,
        control_listen=args.control_listen,
        peer=args.peer,
        sans=args.san,
        days=args.days,
        min_payload_gbps=args.min_payload_gbps,
        probe_max_tail_ms=args.probe_max_tail_ms,
        remote_kvpack=args.remote_kvpack,
    )
    rec = Wizard(opts).run()
    if args.json:
        print(json.dumps(rec, sort_keys=True))
    else:
        q = rec.get("qualification") or {}
        print(f"{name}: {rec['state']} (leaf sha256 {rec['pending'].get('leaf_sha256')}, median payload rate {q.get('median_gbps')} Gbps)")
    return 0


def _list(args: argparse.Namespace) -> int:
    from ..onboard.wizard import node_summaries

    rows = node_summaries(args.cluster)
    if args.json:
        print(json.dumps(rows, sort_keys=True))
        return 0
    print(f"{'NODE':<20} {'ROLE':<9} {'STATE':<22} {'WHERE':<28} {'GBPS':<9} LEAF")
    for r in rows:
        gbps = "" if r["median_gbps"] is None else f"{r['median_gbps']:.4f}"
        print(f"{r['name']:<20} {r['role'] or '':<9} {r['state']:<22} {r['where']:<28} {gbps:<9} {(r['leaf_sha256'] or '')[:16]}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from ..errors import OnboardError
    from ..onboard import state as S
    from ..security.enroll import Cluster

    cluster = Cluster.open(args.cluster)
    rec = S.load(cluster.root, args.name)
    entry = cluster.registry["nodes"].get(args.name)
    if rec is None and entry is None:
        raise OnboardError("usage", f"no node named {args.name!r}")
    doc = {"name": args.name, "registry": entry, "onboarding": rec}
    if args.json:
        print(json.dumps(doc, sort_keys=True))
        return 0
    if rec is None:
        print(f"{args.name}: offline-enrolled {entry['role']} (no onboarding record)")
        return 0
    print(f"{args.name}: {rec['role']} {rec['state']} at {rec['target']['user']}@{rec['target']['host']}:{rec['target']['port']}")
    for stage in S.STAGES:
        st = rec["stages"][stage]
        print(f"  {stage:<10} {st['status']:<8} {st.get('receipt') or ''}")
    if rec.get("failure"):
        print(f"  failure: {rec['failure']['category']}: {rec['failure']['reason']}")
    q = rec.get("qualification")
    if q:
        print(f"  qualification: ok={q['ok']} median {q['median_gbps']} Gbps, rates {q['rates_bps']} bps")
    return 0


def _remove(args: argparse.Namespace) -> int:
    from ..onboard.wizard import remove

    remove(args.cluster, args.name, ssh_key=args.ssh_key)
    return 0


# -- node-local ------------------------------------------------------------------------------------


def _emit(obj) -> int:
    print(json.dumps(obj, sort_keys=True))
    return 0


def _stdin(limit: int = 1 << 20) -> bytes:
    from ..errors import OnboardError

    data = sys.stdin.buffer.read(limit + 1)
    if len(data) > limit:
        raise OnboardError("install", f"input larger than {limit} bytes")
    return data


def _nl_preflight(args):
    from ..onboard import nodeside

    return _emit(nodeside.preflight(args.dir))


def _nl_keygen(args):
    from ..onboard import nodeside

    return _emit(nodeside.keygen(args.dir, args.name, args.version, args.san))


def _nl_install(args):
    from ..errors import OnboardError
    from ..onboard import nodeside

    try:
        bundle = json.loads(_stdin())
    except ValueError as exc:
        raise OnboardError("install", f"install bundle is not JSON: {exc}") from None
    return _emit(nodeside.install(args.dir, args.version, bundle))


def _nl_put_secret(args):
    from ..onboard import nodeside

    return _emit(nodeside.put_secret(args.dir, args.key_id, _stdin(4096)))


def _nl_remove_secret(args):
    from ..onboard import nodeside

    return _emit(nodeside.remove_secret(args.dir, args.key_id))


def _nl_put_config(args):
    from ..onboard import nodeside

    return _emit(nodeside.put_config(args.dir, args.name, _stdin()))


def _nl_remove_config(args):
    from ..onboard import nodeside

    return _emit(nodeside.remove_config(args.dir, args.name))


def _nl_receipt(args):
    from ..onboard import nodeside

    return _emit(nodeside.read_receipt(args.dir, args.path))


def _nl_status(args):
    from ..onboard import nodeside

    return _emit(nodeside.status(args.dir))


def _nl_daemon(args):
    from ..errors import OnboardError
    from ..onboard import units

    if args.action == "status":
        return _emit(units.status(args.dir, args.unit))
    if args.action == "stop":
        return _emit(units.stop(args.dir, args.unit))
    if not args.role or not args.config:
        raise OnboardError("usage", "daemon start needs --role and --config")
    fields = {
        "role": args.role,
        "config": args.config,
        "engine": args.engine,
        "threads": args.threads,
        "no_store": args.no_store,
        "listen": args.listen,
        "receipts": args.receipts,
        "ledger_max_tail_ms": args.ledger_max_tail_ms,
    }
    return _emit(units.start(args.dir, args.unit, fields, restart=args.restart, if_running=args.if_running, timeout_s=args.timeout))
