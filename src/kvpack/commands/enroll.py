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


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("enroll", help="enroll a cluster: CA, node certificates, pins, HMAC keys")
    sub = parser.add_subparsers(dest="enroll_command", metavar="ACTION")
    sub.required = True

    init = sub.add_parser("init", help="create the cluster CA (or rotate it with --rotate)")
    init.add_argument("dir")
    init.add_argument("--identity", help="default model identity JSON for receivers")
    init.add_argument("--rotate", action="store_true", help="replace the CA, re-key every node, bump every HMAC epoch")
    init.set_defaults(func=_init)

    node = sub.add_parser("node", help="enroll a node (or re-key it with --rotate)")
    node.add_argument("dir")
    node.add_argument("name")
    node.add_argument("--role", choices=("receiver", "producer", "storage"))
    node.add_argument("--rotate", action="store_true", help="new key and certificate; bump the HMAC epoch of its pairs")
    node.add_argument("--listen", help="receiver Handoff V2 listen address (ip:port)")
    node.add_argument("--control-listen", help="producer control listen address (ip:port)")
    node.add_argument("--identity", help="model identity JSON this receiver admits")
    node.add_argument("--san", action="append", default=[], help="extra subjectAltName (e.g. muser-prefilld for the genuine producer)")
    node.add_argument("--days", type=int, default=365, help="leaf validity in days")
    node.set_defaults(func=_node)

    show = sub.add_parser("show", help="list nodes, roles, pins, key ids, epochs, expiry")
    show.add_argument("dir")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=_show)


def _init(args: argparse.Namespace) -> int:
    from ..security.enroll import Cluster, load_identity_file

    identity = load_identity_file(args.identity) if args.identity else None
    cluster = Cluster.init(args.dir, identity=identity, rotate=args.rotate)
    ca = cluster.registry["ca"]
    verb = "rotated" if args.rotate else "created"
    print(f"{verb} cluster CA {ca['subject']} (sha256 {ca['sha256']}, expires {ca['not_after']})")
    return 0


def _node(args: argparse.Namespace) -> int:
    from ..security.config import parse_socket_address
    from ..security.enroll import Cluster, load_identity_file

    if args.listen:
        parse_socket_address(args.listen, "--listen")
    if args.control_listen:
        parse_socket_address(args.control_listen, "--control-listen", allow_port_zero=False)
    if not args.rotate and args.role is None:
        from ..errors import SecurityError

        raise SecurityError("enrollment", "--role is required when enrolling a new node")
    identity = load_identity_file(args.identity) if args.identity else None
    cluster = Cluster.open(args.dir)
    entry = cluster.enroll_node(
        args.name, args.role, rotate=args.rotate, listen=args.listen, control_listen=args.control_listen, identity=identity, extra_sans=args.san, days=args.days
    )
    verb = "rotated" if args.rotate else "enrolled"
    print(f"{verb} {entry['role']} {args.name}: leaf sha256 {entry['leaf_sha256']}, expires {entry['not_after']}")
    for pair in cluster.registry["pairs"]:
        if args.name in (pair["producer"], pair["receiver"]):
            print(f"  pair {pair['key_id']}: epoch {pair['epoch']}")
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
