"""``kvpack migrate``, ``kvpack transfer status|reconcile``, ``kvpack decode-node-api`` and
``kvpack storage-node pin``: session migration from the command line (docs/migration.md).

The CLI talks to the local decode node's HTTPS API (address, CA and API key from the node's
config file): the node holds the sessions and runs the transfers, the CLI starts them, shows
progress (rich progress bar on a terminal) and reports the final TransferView.

Exit codes: 0 completed (or source_restored for a copy restore), 1 any other final status or
a refusal (the final status is the error line's category), 2 usage, 12 the node rejected the
API key (docs/cli.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ._args import duration, existing_file, not_a_file

ID_HELP = "1..128 of [A-Za-z0-9_-]"


def ident(text: str) -> str:
    import re

    if not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", text or ""):
        raise argparse.ArgumentTypeError(f"must be {ID_HELP}, got {text!r}")
    return text


ident.__name__ = "id"

FINAL = {"completed", "ambiguous", "conflict", "destination_committed_source_retained", "source_restored", "source_restored_remote_retained"}
SUCCESS = {"completed", "source_restored"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("migrate", help="copy or move a session to a decode node or a storage node")
    p.add_argument("session", type=ident, help=f"session id ({ID_HELP})")
    p.add_argument("--to", required=True, help="https://HOST:PORT (decode tier), storage:NODE (storage tier) or local (restore from storage)")
    p.add_argument("--mode", required=True, choices=("copy", "move"), help="copy keeps the source; move deletes it after the destination's durable commit")
    p.add_argument("--transfer-id", type=ident, help=f"transfer id ({ID_HELP}; default: the node picks one)")
    p.add_argument("--config", required=True, type=existing_file, help="the local decode node's config file (node.json)")
    p.add_argument("--no-wait", action="store_true", help="return after the node accepted the transfer")
    p.add_argument("--timeout", type=duration, default=None, help="seconds to wait for a final status (default: 3600; not with --no-wait)")
    p.set_defaults(func=cmd_migrate, extras=("node",))

    t = sub.add_parser("transfer", help="session transfer status and reconciliation")
    ts = t.add_subparsers(dest="transfer_command", metavar="ACTION")
    ts.required = True
    q = ts.add_parser("status", help="the TransferView of a transfer")
    q.add_argument("transfer_id", type=ident, help=f"transfer id ({ID_HELP})")
    q.add_argument("--config", required=True, type=existing_file, help="the local decode node's config file (node.json)")
    q.set_defaults(func=cmd_status, extras=("node",))
    q = ts.add_parser("reconcile", help="look the transfer up at its destination and finish it")
    q.add_argument("transfer_id", type=ident, help=f"transfer id ({ID_HELP})")
    q.add_argument("--config", required=True, type=existing_file, help="the local decode node's config file (node.json)")
    q.add_argument("--timeout", type=duration, default=3600.0, help="seconds to wait for the node's answer")
    q.set_defaults(func=cmd_reconcile, extras=("node",))

    s = sub.add_parser("decode-node-api", help="serve the decode node's migration API (HTTPS, loopback)")
    s.add_argument("--config", required=True, type=existing_file, help="the decode node's config file (node.json, docs/migration.md)")
    s.set_defaults(func=cmd_serve, log_default="info", extras=("node",))

    n = sub.add_parser("storage-node", help="storage-tier enrollment")
    ns = n.add_subparsers(dest="storage_command", metavar="ACTION")
    ns.required = True
    q = ns.add_parser("pin", help="record a storage node's SSH address, user, pinned host key and lane dir")
    q.add_argument("cluster_dir", type=not_a_file, help="cluster directory made by kvpack enroll init")
    q.add_argument("name", help="the storage node's enrolled name")
    q.add_argument("--address", required=True, help="IP:PORT of its sshd")
    q.add_argument("--user", required=True, help="SSH user on the storage node")
    q.add_argument("--host-key-file", required=True, type=existing_file, help="the sshd's public host key (e.g. ssh_host_ed25519_key.pub)")
    q.add_argument("--lane-dir", required=True, help="absolute directory on the storage node")
    q.set_defaults(func=cmd_pin)


#: HTTP status of the node API -> MigrationError category (exit codes follow docs/cli.md)
HTTP_CATEGORY = {401: "unauthorized", 403: "tls_required", 404: "not_found", 409: "conflict"}


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

    def close(self) -> None:
        # an idle keep-alive connection left open holds up the node's graceful shutdown
        self.client.close()

    def __enter__(self) -> "NodeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, url: str, **kw):
        from ..errors import MigrationError

        resp = self.client.request(method, url, **kw)
        if resp.status_code >= 300:
            try:
                err = resp.json()["error"]
                detail = f"{resp.status_code} {err['type']}: {err['message']}"
            except (ValueError, KeyError, TypeError):
                detail = f"HTTP {resp.status_code}"
            raise MigrationError(HTTP_CATEGORY.get(resp.status_code, "usage" if resp.status_code < 500 else "transport"), detail)
        try:
            return resp.json()
        except ValueError:
            raise MigrationError("transport", f"HTTP {resp.status_code} with a body that is not JSON") from None

    def wait(self, tid: str, timeout: float, *, show: bool) -> dict:
        deadline = time.monotonic() + timeout
        bar = None
        try:
            if show and sys.stderr.isatty():
                from rich.console import Console
                from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

                columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
                bar = Progress(*columns, console=Console(stderr=True), transient=True)
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
    from ._args import refuse_ignored

    if args.no_wait:
        refuse_ignored([("--timeout", args.timeout is not None)], because="--no-wait (nothing is waited for)")
    timeout = 3600.0 if args.timeout is None else args.timeout
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
    with NodeClient(args.config) as node:
        view = node.request("POST", f"/v1/sessions/{args.session}/migrate", json=body)
        if not args.no_wait:
            view = node.wait(view["id"], timeout, show=not args.json)
    _print(view, args.json)
    if not args.no_wait:
        _final(view, SUCCESS)
    return 0


def _final(view: dict, success: set) -> None:
    """A final status other than success is this command's failure (after the view printed)."""
    from ..cli_errors import CommandFailed

    if view["status"] not in success:
        why = f": {view['last_error']}" if view.get("last_error") else ""
        raise CommandFailed(str(view["status"]), f"transfer {view['id']} ended {view['status']} (source_deleted={str(view['source_deleted']).lower()}){why}")


def cmd_status(args) -> int:
    with NodeClient(args.config) as node:
        view = node.request("GET", f"/v1/session-transfers/{args.transfer_id}")
    _print(view, args.json)
    return 0


def cmd_reconcile(args) -> int:
    with NodeClient(args.config) as node:
        # synchronous on the node: the reply is the status the lookup-driven run ended in
        view = node.request("POST", f"/v1/session-transfers/{args.transfer_id}/reconcile", timeout=args.timeout)
    _print(view, args.json)
    _final(view, SUCCESS | {"committed"})
    return 0


def cmd_serve(args) -> int:
    from ..cli_errors import CommandFailed
    from ..migrate.config import load_config
    from ..node.api import serve

    cfg = load_config(args.config)
    _check_bindable(cfg.host, cfg.port)
    try:
        serve(args.config)
    except SystemExit as exc:  # uvicorn exits on a startup failure after logging why
        if exc.code not in (0, None):
            raise CommandFailed("startup", f"the decode node API did not start (uvicorn exit {exc.code}; its log line above says why)") from None
    return 0


def _check_bindable(host: str, port: int) -> None:
    """Bind the API address once before uvicorn does, so a port in use or an address this
    host does not have is reported as such (uvicorn would only exit with a status)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, f"listen {host}:{port}") from None


def cmd_pin(args) -> int:
    from ..security.enroll import Cluster
    from ._args import read_small_file

    line = read_small_file(args.host_key_file, what="host key file", max_bytes=16384).strip()
    if not line.isascii():
        from ..errors import UsageError

        raise UsageError("file", f"host key file {args.host_key_file!r} is not an OpenSSH public key line (non-ASCII content)")
    entry = Cluster.open(args.cluster_dir).set_storage_ssh(args.name, address=args.address, user=args.user, host_key=line, lane_dir=args.lane_dir)
    if args.json:
        print(json.dumps({"name": args.name, **entry}, sort_keys=True))
        return 0
    print(
        f"storage node {args.name}: ssh {entry['ssh']['user']}@{entry['ssh']['address']} host key {entry['ssh']['host_key_sha256']} lane {entry['ssh']['lane_dir']}"
    )
    return 0
