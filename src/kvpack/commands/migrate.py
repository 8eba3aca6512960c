"""``kvpack migrate``, ``kvpack transfer status|reconcile``, ``kvpack decode-node-api`` and
``kvpack storage-node pin``: session migration from the command line (docs/migration.md).

The CLI talks to the local decode node's HTTPS API (address, CA and API key from the node's
config file): the node holds the sessions and runs the transfers, the CLI starts them, shows
progress (rich progress bar on a terminal) and reports the final TransferView.

Exit codes: 0 completed (or source_restored for a copy restore), 1 any other final status or
a refusal, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

FINAL = {"completed", "ambiguous", "conflict", "destination_committed_source_retained", "source_restored", "source_restored_remote_retained"}
SUCCESS = {"completed", "source_restored"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("migrate", help="copy or move a session to a decode node or a storage node")
    p.add_argument("session")
    p.add_argument("--to", required=True, help="https://HOST:PORT (decode tier), storage:NODE (storage tier) or local (restore from storage)")
    p.add_argument("--mode", required=True, choices=("copy", "move"))
    p.add_argument("--transfer-id")
    p.add_argument("--config", required=True, help="the local decode node's config file")
    p.add_argument("--no-wait", action="store_true", help="return after the node accepted the transfer")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_migrate)

    t = sub.add_parser("transfer", help="session transfer status and reconciliation")
    ts = t.add_subparsers(dest="transfer_command", metavar="ACTION")
    ts.required = True
    q = ts.add_parser("status", help="the TransferView of a transfer")
    q.add_argument("transfer_id")
    q.add_argument("--config", required=True)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_status)
    q = ts.add_parser("reconcile", help="look the transfer up at its destination and finish it")
    q.add_argument("transfer_id")
    q.add_argument("--config", required=True)
    q.add_argument("--timeout", type=float, default=3600.0)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_reconcile)

    s = sub.add_parser("decode-node-api", help="serve the decode node's migration API (HTTPS, loopback)")
    s.add_argument("--config", required=True)
    s.set_defaults(func=cmd_serve)

    n = sub.add_parser("storage-node", help="storage-tier enrollment")
    ns = n.add_subparsers(dest="storage_command", metavar="ACTION")
    ns.required = True
    q = ns.add_parser("pin", help="record a storage node's SSH address, user, pinned host key and lane dir")
    q.add_argument("cluster_dir")
    q.add_argument("name")
    q.add_argument("--address", required=True, help="IP:PORT of its sshd")
    q.add_argument("--user", required=True)
    q.add_argument("--host-key-file", required=True, help="the sshd's public host key (e.g. ssh_host_ed25519_key.pub)")
    q.add_argument("--lane-dir", required=True, help="absolute directory on the storage node")
    q.set_defaults(func=cmd_pin)


class NodeClient:
    """A small HTTPS client for the local node's public routes."""

    def __init__(self, config_path: str) -> None:
        import httpx

        from ..migrate.config import load_config, read_api_key
        from ..migrate.decode_tier import client_ssl_context

        cfg = load_config(config_path)
        key = read_api_key(cfg.api_key_file).decode("ascii")
        verify = client_ssl_context(cfg.tls["ca"]) if cfg.tls else False
        self.client = httpx.Client(base_url=cfg.base_url, verify=verify, headers={"authorization": f"Bearer {key}"}, timeout=60.0, trust_env=False)

    def request(self, method: str, url: str, **kw):
        from ..errors import MigrationError

        resp = self.client.request(method, url, **kw)
        if resp.status_code >= 300:
            try:
                err = resp.json()["error"]
                raise MigrationError("usage" if resp.status_code < 500 else "transport", f"{resp.status_code} {err['type']}: {err['message']}")
            except (ValueError, KeyError):
                raise MigrationError("transport", f"HTTP {resp.status_code}") from None
        return resp.json()

    def wait(self, tid: str, timeout: float, *, show: bool) -> dict:
        deadline = time.monotonic() + timeout
        bar = None
        try:
            if show and sys.stderr.isatty():
                from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

                bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True)
                bar.start()
                task = bar.add_task(tid, total=None)
            while True:
                prog = self.request("GET", f"/v1/session-transfers/{tid}/progress")
                if bar is not None:
                    bar.update(task, total=prog["bytes"] or None, completed=prog["sent"], description=f"{tid} {prog['status']}")
                # a restore starts from the export's final status: wait for the run itself to end
                if prog["status"] in FINAL and not prog["running"] and prog["phase"] != "restore-pending":
                    view = self.request("GET", f"/v1/session-transfers/{tid}")
                    if view["status"] in FINAL:
                        return view
                if time.monotonic() > deadline:
                    return self.request("GET", f"/v1/session-transfers/{tid}")
                time.sleep(0.1)
        finally:
            if bar is not None:
                bar.stop()


def _print(view: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(view, indent=2))
    else:
        extra = f" last_error={view['last_error']}" if view.get("last_error") else ""
        print(
            f"{view['id']} {view['status']} session={view['session_id']} {view['mode']} {view['tier']} -> {view['destination']} "
            f"bytes={view['bytes']} source_deleted={str(view['source_deleted']).lower()}{extra}"
        )


def cmd_migrate(args) -> int:
    to = args.to
    if to.startswith("storage:"):
        tier, destination = "storage", to[len("storage:") :]
    elif to == "local":
        tier, destination = "storage", "local"
    else:
        tier, destination = "decode", to
    body = {"destination": destination, "mode": args.mode, "tier": tier}
    if args.transfer_id:
        body["transfer_id"] = args.transfer_id
    node = NodeClient(args.config)
    view = node.request("POST", f"/v1/sessions/{args.session}/migrate", json=body)
    if not args.no_wait:
        view = node.wait(view["id"], args.timeout, show=not args.json)
    _print(view, args.json)
    return 0 if args.no_wait or view["status"] in SUCCESS else 1


def cmd_status(args) -> int:
    view = NodeClient(args.config).request("GET", f"/v1/session-transfers/{args.transfer_id}")
    _print(view, args.json)
    return 0


def cmd_reconcile(args) -> int:
    node = NodeClient(args.config)
    # synchronous on the node: the reply is the status the lookup-driven run ended in
    view = node.request("POST", f"/v1/session-transfers/{args.transfer_id}/reconcile", timeout=args.timeout)
    _print(view, args.json)
    return 0 if view["status"] in SUCCESS | {"committed"} else 1


def cmd_serve(args) -> int:
    from ..node.api import serve

    serve(args.config)
    return 0


def cmd_pin(args) -> int:
    from ..security.enroll import Cluster

    with open(args.host_key_file, encoding="ascii") as fh:
        line = fh.read().strip()
    entry = Cluster.open(args.cluster_dir).set_storage_ssh(args.name, address=args.address, user=args.user, host_key=line, lane_dir=args.lane_dir)
    print(
        f"storage node {args.name}: ssh {entry['ssh']['user']}@{entry['ssh']['address']} host key {entry['ssh']['host_key_sha256']} lane {entry['ssh']['lane_dir']}"
    )
    return 0
