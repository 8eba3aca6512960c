"""A node's status page: what it holds, what it moved, and whether it is ready.

Served read-only on the observability listener (:mod:`.metrics`: ``/status``,
``/status.json``, ``/readyz``), under the same exposure rule as the metrics (loopback, or
mutual TLS). A daemon does not build pages: it registers *snapshot providers* (functions
returning a dict of sections) and *readiness checks* on its :class:`StatusBoard`
(``node.metrics.status``); :func:`attach_receiver` / :func:`attach_producer` do that in one
call from the daemon's ``start()``. This module reads; it never changes node state.

The snapshot (``/status.json``) has these sections, each optional:

* ``node``: role, version, model labels, uptime;
* ``sessions``: what the node holds (live session position, resident prefixes, ...);
* ``transfers``: the latest receipts (id, verdict, reason, bytes, ids, seconds);
* ``throughput``: payload bytes per minute over the last hour (the sparkline);
* ``ledger``: replay-ledger watermarks (key id, epoch, highest generation), degraded
  latch, and the bind-time volume probe; for a producer its generation counter;
* ``store``: objects and bytes per kind in the pack store (cached for 30 s);
* ``nodes``: onboarding state records (``<cluster>/onboard/<name>/state.json``, schema
  ``kvpack-onboard-state-v1``) when the node was started with ``--cluster-dir``.

The HTML is one self-contained document: inline CSS and an inline SVG sparkline, no script,
no external asset (the listener's Content-Security-Policy forbids loading any). Every value
is HTML-escaped. Nothing secret is shown: ids, digests, counts, paths of non-secret
directories; never key material, token ids or prompt text.
"""

from __future__ import annotations

import html
import json
import logging
import os
import platform
import stat
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from .. import __version__
from ..logs import event

Snapshot = dict[str, Any]
Provider = Callable[[], Snapshot]
Check = Callable[[], tuple[bool, str]]

THROUGHPUT_BUCKET_S = 60
THROUGHPUT_BUCKETS = 60
STORE_CACHE_S = 30.0
MAX_ONBOARD_RECORD_BYTES = 1 << 20


class StatusBoard:
    """Snapshot providers and readiness checks of one node (thread-safe registration)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.started = time.time()
        self._providers: list[Provider] = []
        self._checks: list[tuple[str, Check]] = []
        self._lock = threading.Lock()

    def provide(self, provider: Provider) -> None:
        with self._lock:
            self._providers.append(provider)

    def ready_check(self, name: str, check: Check) -> None:
        with self._lock:
            self._checks.append((name, check))

    def snapshot(self) -> Snapshot:
        out: Snapshot = {
            "node": {
                "role": self.role,
                "version": __version__,
                "python": platform.python_version(),
                "started_unix": round(self.started, 3),
                "uptime_s": round(time.time() - self.started, 1),
            },
            "generated_unix": round(time.time(), 3),
        }
        with self._lock:
            providers = list(self._providers)
        for provider in providers:
            try:
                part = provider()
            except Exception as exc:  # noqa: BLE001 - a broken section must not hide the rest
                part = {"errors": [f"{type(exc).__name__}: {exc}"[:300]]}
            for key, value in part.items():
                if key == "node" and isinstance(value, dict):
                    out["node"].update(value)
                elif key == "errors":
                    out.setdefault("errors", []).extend(value)
                else:
                    out[key] = value
        out["ready"] = self.readiness()
        if "transfers" in out and "throughput" not in out:
            out["throughput"] = throughput(out["transfers"])
        return out

    def readiness(self) -> dict[str, Any]:
        with self._lock:
            checks = list(self._checks)
        results = []
        for name, check in checks:
            try:
                ok, detail = check()
            except Exception as exc:  # noqa: BLE001
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            results.append({"name": name, "ok": bool(ok), "detail": str(detail)[:300]})
        return {"ready": bool(results) and all(r["ok"] for r in results), "checks": results}


# -- receipts -----------------------------------------------------------------------------------


def summarize_receipt(receipt: dict[str, Any], receipt_id: str) -> dict[str, Any]:
    """The fields of one receipt the log line and the status page show (no secrets)."""
    producer_part = receipt.get("receipt")
    producer: dict[str, Any] = producer_part if isinstance(producer_part, dict) else {}
    nbytes = receipt.get("payload_bytes")
    if nbytes is None:
        nbytes = producer.get("payload_bytes", 0)
    durations_part = receipt.get("durations_s")
    durations: dict[str, Any] = durations_part if isinstance(durations_part, dict) else {}
    seconds = float(sum(float(v) for v in durations.values() if isinstance(v, (int, float))))
    return {
        "receipt": receipt_id,
        "time_unix": round(time.time(), 3),
        "role": receipt.get("role", "node"),
        "verdict": str(receipt.get("verdict", "unknown")),
        "reason": receipt.get("reason"),
        "detail": (str(receipt["detail"])[:200] if receipt.get("detail") else None),
        "phase": receipt.get("phase"),
        "request_id": receipt.get("request_id"),
        "transfer_id": receipt.get("transfer_id") or producer.get("transfer_id"),
        "payload_bytes": int(nbytes or 0),
        "prefix_cut": receipt.get("prefix_cut"),
        "seconds": round(seconds, 6) if seconds else None,
    }


def load_recent_receipts(directory: str, limit: int = 50) -> list[dict[str, Any]]:
    """Summaries of the newest ``limit`` receipt files (after a restart the page has history).
    Only regular files are read (opened non-blocking, never through a link): a FIFO or
    device named like a receipt would block the reader forever."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json") and not n.startswith("."))[-limit:]
    except OSError:
        return []
    out = []
    for name in names:
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            with open(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                receipt = json.loads(fh.read(1 << 20))
        except (OSError, ValueError):
            continue
        summary = summarize_receipt(receipt, name[: -len(".json")])
        try:
            summary["time_unix"] = int(name.split("-", 1)[0]) / 1e9
        except ValueError:
            pass
        out.append(summary)
    return out


def throughput(transfers: list[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """Committed payload bytes per bucket, oldest first (THROUGHPUT_BUCKETS of _BUCKET_S)."""
    now = time.time() if now is None else now
    buckets = [0] * THROUGHPUT_BUCKETS
    for t in transfers:
        if t.get("verdict") != "committed":
            continue
        age = now - float(t.get("time_unix") or 0)
        index = THROUGHPUT_BUCKETS - 1 - int(age // THROUGHPUT_BUCKET_S)
        if 0 <= index < THROUGHPUT_BUCKETS:
            buckets[index] += int(t.get("payload_bytes") or 0)
    return {"bucket_s": THROUGHPUT_BUCKET_S, "bytes": buckets}


def _recent(writer: Any) -> list[dict[str, Any]]:
    # memory only: the writer loaded the history when it opened (ReceiptWriter), so a page
    # request never reads the receipts disk (a hung one held each request's thread)
    recent = list(getattr(writer, "recent", []) or [])
    return list(reversed(recent[-50:]))  # newest first


_request_log = logging.getLogger("kvpack.node.requests")


def log_request(reply: dict[str, Any]) -> None:
    """One JSON log line per local-API request: outcome, plan, TTFT and the receipt id of the
    transfer that served it (none when the prompt was served from a held prefix)."""
    if reply.get("ok"):
        res = reply.get("result") or {}
        transfer = res.get("transfer") or {}
        path = transfer.get("receipt_path")
        event(
            _request_log,
            "request",
            ok=True,
            prompt_tokens=res.get("prompt_tokens"),
            action=(res.get("plan") or {}).get("action"),
            tier=(res.get("plan") or {}).get("tier"),
            ttft_s=res.get("ttft_s"),
            decoded_tokens=len(res.get("tokens") or []),
            request_id=transfer.get("request_id"),
            receipt=os.path.basename(path)[: -len(".json")] if isinstance(path, str) else None,
            receipt_state=transfer.get("receipt_state"),
        )
    else:
        err = reply.get("error") or {}
        event(_request_log, "request", level=logging.WARNING, ok=False, reason=err.get("reason"), detail=str(err.get("detail", ""))[:300])


# -- store and onboarding -----------------------------------------------------------------------


class _StoreUsage:
    """Objects and bytes per kind in a pack store, listed at most every STORE_CACHE_S."""

    KINDS = ("chunks", "packs", "logits", "index", "quarantine")

    def __init__(self, store: Any) -> None:
        self.store = store
        self._at = 0.0
        self._value: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def __call__(self) -> dict[str, Any]:
        with self._lock:
            if self._value is None or time.monotonic() - self._at > STORE_CACHE_S:
                self._value = self._measure()
                self._at = time.monotonic()
            return self._value

    def _measure(self) -> dict[str, Any]:
        env: Any = getattr(self.store, "env", None)
        out: dict[str, Any] = {"location": str(getattr(self.store, "path", getattr(env, "location", "?"))), "kinds": {}}
        out["encrypted"] = bool(getattr(self.store, "encrypted", False))
        total = 0
        for kind in self.KINDS:
            count = size = 0
            try:
                for info in env.list(kind + "/"):
                    count += 1
                    size += int(info.size)
            except Exception as exc:  # noqa: BLE001 - the page shows the problem instead
                out.setdefault("errors", []).append(f"{kind}: {type(exc).__name__}: {exc}"[:200])
            out["kinds"][kind] = {"objects": count, "bytes": size}
            total += size
        out["cuts"] = out["kinds"]["index"]["objects"]
        out["bytes"] = total
        out["measured_unix"] = round(time.time(), 3)
        return out


def onboarding_records(cluster_dir: str | None) -> list[dict[str, Any]]:
    """The admin-side onboarding records under ``cluster_dir/onboard/*/state.json`` (optional)."""
    if not cluster_dir:
        return []
    root = os.path.join(cluster_dir, "onboard")
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    out = []
    for name in names:
        path = os.path.join(root, name, "state.json")
        try:
            if os.path.getsize(path) > MAX_ONBOARD_RECORD_BYTES:
                continue
            with open(path, "rb") as fh:
                rec = json.loads(fh.read())
        except (OSError, ValueError):
            continue
        if not isinstance(rec, dict) or rec.get("schema") != "kvpack-onboard-state-v1":
            continue
        failure = rec.get("failure") if isinstance(rec.get("failure"), dict) else None
        out.append(
            {
                "name": str(rec.get("name", name)),
                "role": str(rec.get("role", "?")),
                "state": str(rec.get("state", "?")),
                "failure": None if failure is None else f"{failure.get('category')}: {str(failure.get('reason', ''))[:200]}",
                "updated_unix": (rec.get("updated_unix_ms") or 0) / 1000,
            }
        )
    return out


# -- providers for the two daemons ------------------------------------------------------------


def _probe_json(probe: Any) -> dict[str, Any] | None:
    if probe is None:
        return None
    return {"median_ms": round(probe.median_ms, 3), "p99_ms": round(probe.p99_ms, 3), "max_ms": round(probe.max_ms, 3), "samples": len(probe.samples_ms)}


def _replay_ledger(node: Any) -> dict[str, Any]:
    ledger = getattr(node, "ledger", None)
    out: dict[str, Any] = {"probe": _probe_json(getattr(node, "probe", None))}
    if ledger is None:
        out["open"] = False
        return out
    out.update(open=True, path=getattr(ledger, "path", None), degraded=getattr(ledger, "degraded", None))
    marks = []
    for key, generation in sorted((ledger.snapshot() if hasattr(ledger, "snapshot") else {}).items()):
        key_id, _, epoch = str(key).rpartition(":")  # security.ledger.ledger_key: "<key id>:<epoch>"
        marks.append({"key_id": key_id or str(key), "epoch": epoch, "generation": generation})
    out["watermarks"] = marks
    return out


def _resident(resident: Any) -> dict[str, Any] | None:
    if resident is None:
        return None
    nbytes = getattr(resident, "nbytes", 0)
    return {"entries": len(resident), "bytes": int(nbytes() if callable(nbytes) else nbytes), "max_bytes": getattr(resident, "max_bytes", None)}


def _fronts(node: Any) -> Optional[dict]:
    """The data listener's TLS fronts (configured, live, restarts, connections each)."""
    pool = getattr(node, "_fronts", None)
    return None if pool is None else pool.snapshot()


def attach_receiver(node: Any, *, cluster_dir: str | None = None) -> None:
    """Register the decode node's snapshot and readiness checks (called from its start())."""
    board: StatusBoard = node.metrics.status
    cluster_dir = cluster_dir or getattr(node.metrics, "cluster_dir", None)
    store_usage = _StoreUsage(node.store) if getattr(node, "store", None) is not None else None
    if getattr(node, "store", None) is not None:
        node.metrics.watch_store(node.store)  # lookup counters (unreadable entries, withdrawn restores)
    labels = node.metrics.describe_engine(node.engine)

    def snapshot() -> Snapshot:
        session = getattr(node, "session", None)
        busy = getattr(node, "_request_lock", None)
        sessions = [
            {
                "id": "live",
                "position": getattr(session, "position", None),
                "prefilled": getattr(node, "live_prefilled", None),
                "state": "busy" if busy is not None and busy.locked() else "idle",
            }
        ]
        resident = getattr(node, "resident", None)
        out: Snapshot = {
            "node": {"model": labels, "data_port": getattr(node, "data_port", None), "cluster_dir": cluster_dir, "tls_fronts": _fronts(node)},
            "sessions": sessions,
            "resident": _resident(resident),
            "transfers": _recent(node.receipts),
            "ledger": _replay_ledger(node),
            "store": store_usage() if store_usage else None,
        }
        if cluster_dir:
            out["nodes"] = onboarding_records(cluster_dir)
        return out

    board.provide(snapshot)
    board.ready_check("data listener", lambda: (node.data_port is not None, f"port {node.data_port}"))
    board.ready_check(
        "replay ledger",
        lambda: (
            node.ledger is not None and not node.ledger.degraded,
            "open" if node.ledger is not None and not node.ledger.degraded else f"degraded: {getattr(node.ledger, 'degraded', 'not open')}",
        ),
    )
    board.ready_check("engine", lambda: (node.engine is not None, labels["model"]))


def attach_producer(node: Any, *, cluster_dir: str | None = None) -> None:
    """Register the prefill node's snapshot and readiness checks (called from its start())."""
    board: StatusBoard = node.metrics.status
    cluster_dir = cluster_dir or getattr(node.metrics, "cluster_dir", None)
    store_usage = _StoreUsage(node.store) if getattr(node, "store", None) is not None else None
    if getattr(node, "store", None) is not None:
        node.metrics.watch_store(node.store)  # lookup counters (unreadable entries, withdrawn restores)
    labels = node.metrics.describe_engine(node.engine)

    def snapshot() -> Snapshot:
        ledger = getattr(node, "ledger", None)
        resident = getattr(node, "resident", None)
        out: Snapshot = {
            "node": {"model": labels, "control_port": getattr(node, "control_port", None), "cluster_dir": cluster_dir},
            "sessions": [],
            "resident": _resident(resident),
            "transfers": _recent(node.receipts),
            "ledger": {"open": ledger is not None, "path": getattr(ledger, "path", None), "next_generation": getattr(ledger, "next", None)},
            "store": store_usage() if store_usage else None,
        }
        if cluster_dir:
            out["nodes"] = onboarding_records(cluster_dir)
        return out

    board.provide(snapshot)
    board.ready_check("control listener", lambda: (node.control_port is not None, f"port {node.control_port}"))
    board.ready_check("generation ledger", lambda: (getattr(node, "ledger", None) is not None, "open"))


# -- HTML ---------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1d2330;background:#fafbfc}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em;border-bottom:1px solid #d8dde6}
table{border-collapse:collapse;width:100%;margin:.3em 0}th,td{text-align:left;padding:.25em .6em;border-bottom:1px solid #e6e9ef;vertical-align:top}
th{background:#eef1f6;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#11703a;font-weight:600}.bad{color:#b42318;font-weight:600}.muted{color:#6b7385}
code{font:12px ui-monospace,monospace}.spark{background:#fff;border:1px solid #d8dde6}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _bytes(n: Any) -> str:
    try:
        n = float(n)
    except (TypeError, ValueError):
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _when(unix: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(unix))) + "Z"
    except (TypeError, ValueError, OverflowError):
        return "-"


def _table(headers: list[str], rows: list[list[str]], *, table_id: str, empty: str) -> str:
    if not rows:
        return f'<p class="muted" id="{table_id}-empty">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(rows_cell for rows_cell in row) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _td(value: Any, *, num: bool = False, cls: str = "") -> str:
    classes = " ".join(c for c in ("num" if num else "", cls) if c)
    return f'<td class="{classes}">{_e(value)}</td>' if classes else f"<td>{_e(value)}</td>"


def sparkline_svg(values: list[int], *, width: int = 480, height: int = 60) -> str:
    """An inline SVG polyline of ``values`` (no script, no external reference)."""
    top = max(values) if values and max(values) > 0 else 1
    n = max(len(values) - 1, 1)
    points = " ".join(f"{i * width / n:.1f},{height - 2 - (v / top) * (height - 4):.1f}" for i, v in enumerate(values))
    return (
        f'<svg id="throughput-sparkline" class="spark" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="committed payload bytes per minute">'
        f'<polyline fill="none" stroke="#2b6cb0" stroke-width="2" points="{points}"/></svg>'
    )


def _section_sessions(snap: Snapshot) -> str:
    rows = [[_td(s.get("id")), _td(s.get("state")), _td(s.get("position"), num=True), _td(s.get("prefilled"), num=True)] for s in snap.get("sessions") or []]
    out = _table(["session", "state", "position", "prefilled"], rows, table_id="sessions", empty="no sessions")
    res = snap.get("resident")
    if res:
        out += f'<p id="resident">resident prefixes: {_e(res.get("entries"))} ({_e(_bytes(res.get("bytes")))} of {_e(_bytes(res.get("max_bytes")))})</p>'
    return out


def _section_transfers(snap: Snapshot) -> str:
    rows = []
    for t in snap.get("transfers") or []:
        cls = "ok" if t.get("verdict") == "committed" else "bad"
        reason = t.get("reason") or ""
        if t.get("detail"):
            reason = f"{reason}: {t['detail']}" if reason else t["detail"]
        rows.append(
            [
                _td(_when(t.get("time_unix"))),
                _td(t.get("verdict"), cls=cls),
                _td(reason),
                _td(_bytes(t.get("payload_bytes")), num=True),
                _td(t.get("transfer_id") or t.get("request_id") or "-"),
                f"<td><code>{_e(t.get('receipt'))}</code></td>",
            ]
        )
    return _table(["time (UTC)", "verdict", "reason", "payload", "transfer", "receipt"], rows, table_id="transfers", empty="no transfers yet")


def _section_ledger(snap: Snapshot) -> str:
    led = snap.get("ledger") or {}
    parts = []
    if "degraded" in led:
        state = '<span class="bad">degraded: ' + _e(led["degraded"]) + "</span>" if led.get("degraded") else '<span class="ok">healthy</span>'
        parts.append(f'<p id="ledger-state">replay ledger: {state}</p>')
    if led.get("next_generation") is not None:
        parts.append(f'<p id="ledger-state">generation ledger: next generation <b>{_e(led["next_generation"])}</b></p>')
    marks = led.get("watermarks")
    if marks is not None:
        rows = [[_td(m.get("key_id")), _td(m.get("epoch"), num=True), _td(m.get("generation"), num=True)] for m in marks]
        parts.append(_table(["key id", "epoch", "watermark (highest generation)"], rows, table_id="watermarks", empty="no generation reserved yet"))
    probe = led.get("probe")
    if probe:
        parts.append(
            f'<p id="volume-probe">volume probe at start: median {_e(probe["median_ms"])} ms, p99 {_e(probe["p99_ms"])} ms, '
            f"max {_e(probe['max_ms'])} ms over {_e(probe['samples'])} reservations</p>"
        )
    return "".join(parts) or '<p class="muted">no ledger</p>'


def _section_store(snap: Snapshot) -> str:
    st = snap.get("store")
    if not st:
        return '<p class="muted" id="store-none">no pack store</p>'
    rows = [[_td(kind), _td(v.get("objects"), num=True), _td(_bytes(v.get("bytes")), num=True)] for kind, v in (st.get("kinds") or {}).items()]
    head = f'<p id="store-summary">{_e(st.get("location"))}: {_e(st.get("cuts"))} cuts, {_e(_bytes(st.get("bytes")))} ({"encrypted" if st.get("encrypted") else "plain"})</p>'
    return head + _table(["kind", "objects", "bytes"], rows, table_id="store", empty="empty store")


def _section_nodes(snap: Snapshot) -> str:
    if "nodes" not in snap:
        return '<p class="muted">no onboarding records (start the node with --cluster-dir on the admin machine)</p>'
    rows = []
    for n in snap["nodes"]:
        cls = "ok" if n.get("state") == "healthy" else ("bad" if str(n.get("state", "")).startswith("failed") else "")
        rows.append([_td(n.get("name")), _td(n.get("role")), _td(n.get("state"), cls=cls), _td(n.get("failure") or ""), _td(_when(n.get("updated_unix")))])
    return _table(["node", "role", "onboarding state", "failure", "updated (UTC)"], rows, table_id="nodes", empty="no onboarding records")


def _line_fronts(node: dict) -> str:
    """The decode node's TLS front processes, when it runs any (docs/operations.md 3e)."""
    fronts = node.get("tls_fronts")
    if not isinstance(fronts, dict):
        return ""
    return (
        f'<p id="tls-fronts">TLS fronts: {_e(fronts.get("live"))} of {_e(fronts.get("configured"))} live, '
        f"{_e(fronts.get('restarts'))} restarts, {_e(fronts.get('relayed_total'))} connections relayed, "
        f"holding {_e(fronts.get('connections'))}</p>"
    )


def render_html(snap: Snapshot) -> str:
    """The status page as one self-contained HTML document."""
    node = snap.get("node") or {}
    ready = snap.get("ready") or {"ready": False, "checks": []}
    model = node.get("model") or {}
    checks = "".join(f'<li class="{"ok" if c["ok"] else "bad"}">{_e(c["name"])}: {_e(c["detail"])}</li>' for c in ready.get("checks", []))
    tp = snap.get("throughput") or {"bucket_s": THROUGHPUT_BUCKET_S, "bytes": [0] * THROUGHPUT_BUCKETS}
    total = sum(tp["bytes"])
    errors = "".join(f"<li>{_e(e)}</li>" for e in snap.get("errors") or [])
    title = f"kvpack {node.get('role', 'node')}"
    return (
        "<!doctype html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="10">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        f'<h1 id="title">{_e(title)} <span id="ready" class="{"ok" if ready["ready"] else "bad"}">{"ready" if ready["ready"] else "not ready"}</span></h1>'
        f'<p class="muted" id="build">kvpack {_e(node.get("version"))}, Python {_e(node.get("python"))}; model {_e(model.get("model"))} '
        f"({_e(model.get('engine'))}, {_e(model.get('threads'))} threads), identity <code>{_e(str(model.get('identity_sha256', ''))[:16])}</code>; "
        f"up {_e(node.get('uptime_s'))} s; generated {_e(_when(snap.get('generated_unix')))}</p>"
        + _line_fronts(node)
        + f'<ul id="checks">{checks}</ul>'
        + (f'<ul id="errors" class="bad">{errors}</ul>' if errors else "")
        + "<h2>Sessions</h2>"
        + _section_sessions(snap)
        + "<h2>Recent transfers</h2>"
        + _section_transfers(snap)
        + f'<h2>Throughput</h2><p id="throughput-total">{_e(_bytes(total))} committed in the last {_e(len(tp["bytes"]) * tp["bucket_s"] // 60)} minutes</p>'
        + sparkline_svg(tp["bytes"])
        + "<h2>Ledger</h2>"
        + _section_ledger(snap)
        + "<h2>Pack store</h2>"
        + _section_store(snap)
        + "<h2>Nodes</h2>"
        + _section_nodes(snap)
        + "</body></html>\n"
    )
