"""``kvpack enroll``: cluster CA, node enrollment and rotation, and a registry listing.

    kvpack enroll init DIR [--identity FILE] [--rotate]
    kvpack enroll node DIR NAME --role receiver|producer|storage [--listen IP:PORT]
                       [--control-listen IP:PORT] [--identity FILE] [--san NAME ...] [--days N]
    kvpack enroll node DIR NAME --rotate
    kvpack enroll show DIR [--json]

The work lives in :mod:`kvpack.security.enroll`; this module only parses and prints.
"""

from __future__ import annotations

import argparse
import json

from ._args import days, existing_dir, existing_file, not_a_file, socket_address


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("enroll", help="enroll a cluster: CA, node certificates, pins, HMAC keys")
    sub = parser.add_subparsers(dest="enroll_command", metavar="ACTION")
    sub.required = True

    init = sub.add_parser("init", help="create the cluster CA (or rotate it with --rotate)")
    init.add_argument("dir", type=not_a_file, help="cluster directory (created; keep its ca/ offline)")
    init.add_argument("--identity", type=existing_file, help="default model identity JSON for receivers (kvpack identity writes one)")
    init.add_argument("--rotate", action="store_true", help="replace the CA, re-key every node, bump every HMAC epoch")
    init.set_defaults(func=_init)

    node = sub.add_parser("node", help="enroll a node (or re-key it with --rotate)")
    node.add_argument("dir", type=existing_dir, help="cluster directory made by kvpack enroll init")
    node.add_argument("name", help="node name (its directory under DIR/nodes/ and its certificate subject)")
    node.add_argument("--role", choices=("receiver", "producer", "storage"), help="what the node runs (required for a new node)")
    node.add_argument("--rotate", action="store_true", help="new key and certificate; bump the HMAC epoch of its pairs")
    node.add_argument("--listen", type=socket_address(), help="receiver Handoff V2 listen address (ip:port; default: 127.0.0.1:29590)")
    node.add_argument(
        "--control-listen", type=socket_address(allow_port_zero=False), help="producer control listen address (ip:port; default: 127.0.0.1:29591)"
    )
    node.add_argument("--identity", type=existing_file, help="model identity JSON this receiver admits (default: the one given to enroll init)")
    node.add_argument("--san", action="append", default=[], help="extra subjectAltName (e.g. muser-prefilld for the genuine producer)")
    node.add_argument("--days", type=days, default=365, help="leaf validity in days (>= 1)")
    node.set_defaults(func=_node)

    show = sub.add_parser("show", help="list nodes, roles, pins, key ids, epochs, expiry")
    show.add_argument("dir", type=existing_dir, help="cluster directory")
    show.set_defaults(func=_show)


def _init(args: argparse.Namespace) -> int:
    from ..security.enroll import Cluster, load_identity_file

    identity = load_identity_file(args.identity) if args.identity else None
    cluster = Cluster.init(args.dir, identity=identity, rotate=args.rotate)
    ca = cluster.registry["ca"]
    verb = "rotated" if args.rotate else "created"
    if args.json:
        print(json.dumps({"action": verb, "ca": ca}, sort_keys=True))
        return 0
    print(f"{verb} cluster CA {ca['subject']} (sha256 {ca['sha256']}, expires {ca['not_after']})")
    return 0


def _node(args: argparse.Namespace) -> int:
    from ..security.enroll import Cluster, load_identity_file

    if not args.rotate and args.role is None:
        from ..errors import UsageError

        raise UsageError("usage", "--role is required when enrolling a new node")
    identity = load_identity_file(args.identity) if args.identity else None
    cluster = Cluster.open(args.dir)
    entry = cluster.enroll_node(
        args.name, args.role, rotate=args.rotate, listen=args.listen, control_listen=args.control_listen, identity=identity, extra_sans=args.san, days=args.days
    )
    verb = "rotated" if args.rotate else "enrolled"
    pairs = [p for p in cluster.registry["pairs"] if args.name in (p["producer"], p["receiver"])]
    if args.json:
        print(json.dumps({"action": verb, "name": args.name, "node": entry, "pairs": pairs}, sort_keys=True))
        return 0
    print(f"{verb} {entry['role']} {args.name}: leaf sha256 {entry['leaf_sha256']}, expires {entry['not_after']}")
    for pair in pairs:
        print(f"  pair {pair['key_id']}: epoch {pair['epoch']}")
    from ..security.enroll import COUNTERPART, is_remote

    unpaired = sorted(
        n
        for n, e in cluster.registry["nodes"].items()
        if e["role"] == COUNTERPART.get(entry["role"]) and is_remote(e) and not any(n in (p["producer"], p["receiver"]) for p in pairs)
    )
    if unpaired:
        print(f"  not paired with SSH-onboarded {unpaired}: offline enrollment cannot reach them (docs/operations.md §1b)")
    return 0


def _show(args: argparse.Namespace) -> int:
    from ..security.enroll import Cluster

    report = Cluster.open(args.dir).show()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    ca = report["ca"]
    print(f"cluster {report['cluster']}")
    print(f"CA {ca['subject']} sha256 {ca['sha256']} expires {ca['not_after']} (generation {ca['generation']})")
    print(f"{'NODE':<20} {'ROLE':<9} {'LEAF SHA-256':<64} EXPIRES")
    for node in report["nodes"]:
        print(f"{node['name']:<20} {node['role']:<9} {node['leaf_sha256']:<64} {node['not_after']}")
    if report["pairs"]:
        print(f"{'KEY ID':<40} EPOCH")
        for pair in report["pairs"]:
            print(f"{pair['key_id']:<40} {pair['epoch']}")
    return 0
