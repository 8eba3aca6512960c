"""``kvpack session list|create|show``: the sessions a decode node holds, over its local API.

The decode node's HTTPS API (``kvpack decode-node-api``; address, CA and API key from the
node's config file, docs/migration.md "node.json") owns the session registry; this command
lists what it holds, creates a session from a JSON list of prompt token ids (the node
prefills it) and shows one session's position, revision, cache digest and live|fenced
state. The ids it prints are the ids ``kvpack migrate`` and ``session show`` take.
"""

from __future__ import annotations

import argparse
import json

from ._args import existing_file, nonneg_int
from .migrate import ID_HELP, ident

CONFIG_HELP = "the decode node's config file (node.json)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("session", help="list, create and show the sessions a decode node holds (its local API)")
    ss = p.add_subparsers(dest="session_command", metavar="ACTION")
    ss.required = True

    q = ss.add_parser("list", help="every session on the node: id, live|fenced, bundle size")
    q.add_argument("--config", required=True, type=existing_file, help=CONFIG_HELP)
    q.set_defaults(func=cmd_list, extras=("node",))

    q = ss.add_parser("create", help="create a session: the node prefills the prompt token ids")
    q.add_argument("--config", required=True, type=existing_file, help=CONFIG_HELP)
    q.add_argument("--tokens-file", required=True, type=existing_file, help="JSON list of prompt token ids")
    q.add_argument("--session-id", type=ident, help=f"session id ({ID_HELP}; default: the node picks one)")
    q.add_argument("--seed", type=nonneg_int, default=0, help="sampler seed recorded with the session")
    q.set_defaults(func=cmd_create, extras=("node",))

    q = ss.add_parser("show", help="one session: position, revision, cache digest, live|fenced")
    q.add_argument("session", type=ident, help=f"session id ({ID_HELP})")
    q.add_argument("--config", required=True, type=existing_file, help=CONFIG_HELP)
    q.set_defaults(func=cmd_show, extras=("node",))


def _call(args, method: str, url: str, **kw) -> dict:
    from .migrate import NodeClient

    with NodeClient(args.config) as node:
        return node.request(method, url, **kw)


def cmd_list(args) -> int:
    sessions = _call(args, "GET", "/v1/sessions")["sessions"]
    if args.json:
        print(json.dumps({"sessions": sessions}, sort_keys=True))
        return 0
    print(f"{'SESSION':<40} {'STATE':<7} {'BYTES':>12}")
    for s in sessions:
        print(f"{s['id']:<40} {s['state']:<7} {s['bytes']:>12}")
    return 0


def cmd_create(args) -> int:
    from ._args import read_token_ids

    body: dict = {"prompt_token_ids": read_token_ids(args.tokens_file), "seed": args.seed}
    if args.session_id:
        body["session_id"] = args.session_id
    info = _call(args, "POST", "/v1/sessions", json=body)
    _print(info, args.json)
    return 0


def cmd_show(args) -> int:
    info = _call(args, "GET", f"/v1/sessions/{args.session}")
    _print(info, args.json)
    return 0


def _print(info: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(info, sort_keys=True))
    else:
        print(f"{info['id']} {info['state']} position={info['position']} revision={info['revision']} cache_sha256={info['cache_sha256']}")
