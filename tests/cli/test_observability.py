"""The observability listener's exposure rule (loopback, or mutual TLS with the cluster CA),
the status page's escaping, JSON-lines logs, and progress that shows on a terminal only."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import ssl
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvpack.errors import UsageError
from kvpack.node.metrics import NodeMetrics, check_exposure, metrics_tls_context
from kvpack.node.status import render_html, summarize_receipt, throughput

from .conftest import run_cli

REPO = Path(__file__).resolve().parents[2]


def test_exposure_rule():
    check_exposure("127.0.0.1", None)
    check_exposure("::1", None)
    for host in ("0.0.0.0", "192.0.2.10", "::"):
        with pytest.raises(UsageError, match="--metrics-tls"):
            check_exposure(host, None)
    with pytest.raises(UsageError, match="IP address"):
        check_exposure("localhost", None)


def _tls(world, name: str):
    from kvpack.security.enroll import Cluster

    tls = Path(Cluster.open(world.cluster).node_dir(name)) / "tls"
    return str(tls / "node.crt"), str(tls / "node.key"), str(tls / "ca.crt")


def test_metrics_over_mutual_tls(world, tmp_path):
    """With --metrics-tls the listener speaks HTTPS with the node's leaf and requires a client
    certificate from the cluster CA; a client without one, or with another CA's, is refused."""
    cert, key, ca = _tls(world, "dec-a")
    metrics = NodeMetrics("receiver")
    metrics.configure_listener("127.0.0.1", metrics_tls_context(cert, key, ca))
    port = metrics.serve(0)
    try:
        url = f"https://127.0.0.1:{port}/healthz"
        client = ssl.create_default_context(cafile=ca)
        client.check_hostname = False  # the node's leaf names the node, not 127.0.0.1
        pcert, pkey, _ = _tls(world, "pre-a")
        client.load_cert_chain(pcert, pkey)
        with urllib.request.urlopen(url, context=client, timeout=10) as resp:
            assert resp.status == 200 and resp.read() == b"ok\n"
        anonymous = ssl.create_default_context(cafile=ca)
        anonymous.check_hostname = False
        with pytest.raises((ssl.SSLError, ConnectionResetError, urllib.error.URLError)):
            urllib.request.urlopen(url, context=anonymous, timeout=10).read()
        # plain HTTP on the TLS port gets nothing useful
        with pytest.raises((ConnectionResetError, urllib.error.URLError, http_client_errors())):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    finally:
        metrics.close()


def http_client_errors():
    import http.client

    return http.client.HTTPException


def test_status_page_escapes_everything():
    evil = "<script>alert(1)</script>&\"'"
    snap = {
        "node": {"role": "receiver", "version": "x", "python": "3", "model": {"model": evil}},
        "sessions": [{"id": evil, "state": "idle", "position": 1, "prefilled": 0}],
        "transfers": [summarize_receipt({"role": "receiver", "verdict": "refused", "reason": "tls", "detail": evil}, "1-receiver-refused-abcdef")],
        "ledger": {"degraded": evil, "watermarks": [{"key_id": evil, "epoch": "1", "generation": 3}]},
        "store": {"location": evil, "kinds": {}, "cuts": 0, "bytes": 0},
        "nodes": [{"name": evil, "role": "receiver", "state": "healthy", "failure": None, "updated_unix": 0}],
        "ready": {"ready": False, "checks": [{"name": evil, "ok": False, "detail": evil}]},
    }
    html = render_html(snap)
    assert "<script" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&quot;" in html and "&#x27;" in html
    assert 'id="tls-fronts"' not in html  # a node without fronts shows no fronts line
    snap["node"]["tls_fronts"] = {"configured": 2, "live": 1, "restarts": evil, "relayed_total": 7, "connections": [3, None]}
    html = render_html(snap)
    assert "TLS fronts: 1 of 2 live" in html and "7 connections relayed" in html and "<script" not in html


def test_throughput_buckets():
    now = 10_000.0
    tp = throughput(
        [
            {"verdict": "committed", "time_unix": now - 1, "payload_bytes": 5},
            {"verdict": "committed", "time_unix": now - 61, "payload_bytes": 7},
            {"verdict": "refused", "time_unix": now - 1, "payload_bytes": 100},
            {"verdict": "committed", "time_unix": now - 3601, "payload_bytes": 100},  # older than the window
        ],
        now=now,
    )
    assert tp["bytes"][-1] == 5 and tp["bytes"][-2] == 7 and sum(tp["bytes"]) == 12


def test_log_file_is_json_lines_and_0600(world, tmp_path):
    log = tmp_path / "kvpack.log"
    r = run_cli(["--log-file", str(log), "--log-level", "debug", "store", "ls", world.missing])
    assert r.code == 10 and r.err.startswith("kvpack: no_store: ")
    r = run_cli(["enroll", "show", world.cluster, "--log-file", str(log), "--log-level", "info"])
    assert r.code == 0
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600
    for line in log.read_text().splitlines():
        record = json.loads(line)
        assert {"ts", "level", "logger", "event"} <= set(record)
    # logging is restored after an in-process run: kvpack's logger propagates again
    import logging

    assert logging.getLogger("kvpack").propagate is True


def _on_a_terminal(code: str, *args: str) -> str:
    """Run Python ``code`` with stderr on a pseudo-terminal; return what the terminal showed."""
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), TERM="xterm", COLUMNS="100")
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stderr=slave, stdout=subprocess.PIPE, env=env)
    os.close(slave)
    seen = b""
    while True:
        r, _, _ = select.select([master], [], [], 30)
        if not r:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    proc.wait(timeout=60)
    os.close(master)
    return seen.decode("utf-8", "replace")


PROGRESS_SNIPPET = """
import sys, time
from kvpack import progress
progress.set_quiet(sys.argv[1] == "quiet")
with progress.status("warming the cache"):
    time.sleep(0.5)
with progress.bar("prefill", 300) as advance:
    for _ in range(3):
        advance(100)
        time.sleep(0.3)
"""


def test_progress_shows_on_a_terminal_only():
    shown = _on_a_terminal(PROGRESS_SNIPPET, "loud")
    assert "warming the cache" in shown and "prefill" in shown
    assert re.search(r"warming the cache.*0:00:0\d", shown)  # a status shows the time elapsed
    assert _on_a_terminal(PROGRESS_SNIPPET, "quiet") == ""  # --json
    piped = subprocess.run([sys.executable, "-c", PROGRESS_SNIPPET, "loud"], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    assert piped.stderr == ""  # not a terminal


def test_third_party_bars_quiet_off_a_terminal(monkeypatch):
    from kvpack import progress

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr(sys, "stderr", open(os.devnull, "w"))
    progress.set_quiet(False)
    progress.quiet_third_party()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    tf_logging = sys.modules.get("transformers.utils.logging")
    if tf_logging is not None:
        assert not tf_logging.is_progress_bar_enabled()
