"""The status page of a running node, rendered by a real browser (Debian's chromium, headless).

Two real daemons (``kvpack producer`` and ``kvpack receiver``, arrays engine, subprocesses on
loopback) move one prompt; a stranger then knocks on the data port without TLS (counted, no
receipt), and a cluster peer sends nonsense after TLS (a refusal
with a receipt). Chromium loads ``/status`` from the receiver's observability listener and
dumps the DOM it rendered; the test checks the sections (sessions, the committed transfer
and the refusal with their receipt ids and reasons, the throughput sparkline as inline SVG,
ledger watermark and volume probe, store usage, the onboarding record of a node) and that
the page references no external asset. The screenshot stays in the test's tmp directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvpack.errors import KvpackError

from .conftest import ENGINE, LOOSE_GATE, check_contract, run_cli

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))


class Daemon:
    """A kvpack daemon subprocess; ``ready`` is the JSON line it prints once listening."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpack.cli", *argv], stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True, env=_env())
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise AssertionError(f"daemon exited {self.proc.returncode}: {log.read_text()[-3000:]}")
        self.ready = json.loads(line)

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=60)


def _get(url: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture(scope="module")
def running(world, tmp_path_factory):
    """A producer and a receiver that moved one prompt, and a refused stranger."""
    from kvpack.security.enroll import Cluster

    tmp = tmp_path_factory.mktemp("status")
    # enrollment wants a real control port; the daemons below bind the kernel's picks instead
    # (--control-listen/--listen :0), so no port reserved here and released can be taken first
    assert run_cli(["enroll", "node", world.cluster, "pre-s", "--role", "producer", "--control-listen", "127.0.0.1:29591"]).code == 0
    assert run_cli(["enroll", "node", world.cluster, "dec-s", "--role", "receiver", "--listen", "127.0.0.1:0"]).code == 0
    cluster = Cluster.open(world.cluster)
    # an onboarding record as the admin-side wizard writes it (schema kvpack-onboard-state-v1)
    record = Path(world.cluster) / "onboard" / "gpu-7" / "state.json"
    record.parent.mkdir(parents=True)
    now = int(time.time() * 1000)
    record.write_text(
        json.dumps(
            {
                "schema": "kvpack-onboard-state-v1",
                "name": "gpu-7",
                "role": "receiver",
                "state": "failed:qualify",
                "failure": {"stage": "qualify", "category": "qualify", "reason": "payload rate below the floor", "unix_ms": now},
                "updated_unix_ms": now,
            }
        )
    )
    producer = Daemon(
        ["producer", "--config", cluster.producer_config_path("pre-s"), "--engine", ENGINE, "--control-listen", "127.0.0.1:0"], tmp / "producer.log"
    )
    sock = str(tmp / "r.sock")
    control = f"127.0.0.1:{producer.ready['control_port']}"
    receiver_argv = [
        "receiver",
        "--config",
        cluster.receiver_config_path("dec-s", "pre-s"),
        "--engine",
        ENGINE,
        "--socket",
        sock,
        "--producer-control",
        control,
    ]
    receiver = Daemon(
        [*receiver_argv, "--cluster-dir", world.cluster, *LOOSE_GATE],
        tmp / "receiver.log",
    )
    try:
        tokens = tmp / "tokens.json"
        tokens.write_text(json.dumps([(i * 7) % 64 for i in range(300)]))
        r = run_cli(["request", "--socket", sock, "--tokens-file", str(tokens), "--max-new-tokens", "4", "--json"])
        check_contract(r, 0)
        reply = json.loads(r.out)
        # a stranger without TLS on the data port: refused during the handshake, counted and
        # logged in aggregate (no receipt: a flood of those must not fill the disk, issue 14)
        with socket.create_connection(("127.0.0.1", receiver.ready["data_port"]), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            s.settimeout(10)
            try:
                s.recv(100)
            except OSError:
                pass
        # a peer of the cluster that speaks nonsense after TLS: refused with a receipt
        from kvpack.security.config import load_producer_config
        from kvpack.security.tls import connect

        ep = load_producer_config(cluster.producer_config_path("pre-s")).data_endpoint("dec-s")
        ch = connect(ep, "127.0.0.1", receiver.ready["data_port"])
        try:
            ch.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"\0" * 32)
            ch.settimeout(10)
            try:
                ch.recv(100)
            except (OSError, KvpackError):
                pass
        finally:
            ch.close()
        deadline = time.monotonic() + 30
        base = receiver.ready["metrics_url"]
        while time.monotonic() < deadline:
            doc = json.loads(_get(base + "status.json")[2])
            if any(t["verdict"] == "refused" for t in doc["transfers"]):
                break
            time.sleep(0.1)
        receipts = Path(cluster.node_dir("dec-s")) / "receipts"
        yield {"producer": producer, "receiver": receiver, "reply": reply, "tmp": tmp, "base": base, "receipts": receipts}
    finally:
        rc_r, rc_p = receiver.stop(), producer.stop()
        assert (rc_r, rc_p) == (0, 0), (tmp / "receiver.log").read_text()[-2000:]


def test_health_ready_metrics_and_status_json(running):
    base = running["base"]
    assert base.startswith("http://127.0.0.1:")
    status, headers, body = _get(base + "healthz")
    assert status == 200 and body == b"ok\n"
    status, _, body = _get(base + "readyz")
    ready = json.loads(body)
    assert status == 200 and ready["ready"] is True
    assert {c["name"] for c in ready["checks"]} == {"data listener", "replay ledger", "engine"}
    status, _, body = _get(base + "metrics")
    text = body.decode()
    assert status == 200 and 'kvpack_build_info{python="' in text and 'role="receiver"' in text
    assert re.search(r'kvpack_model_info\{.*engine="ArrayEngine".*\} 1\.0', text)
    assert 'kvpack_transfers_total{role="receiver",verdict="committed"} 1.0' in text
    status, headers, body = _get(base + "status.json")
    doc = json.loads(body)
    committed = [t for t in doc["transfers"] if t["verdict"] == "committed"]
    assert len(committed) == 1 and committed[0]["payload_bytes"] == running["reply"]["result"]["transfer"]["payload_bytes"]
    assert (running["receipts"] / f"{committed[0]['receipt']}.json").is_file()  # the id names the receipt file
    assert doc["ledger"]["watermarks"] and doc["ledger"]["watermarks"][0]["generation"] >= 1
    assert doc["ledger"]["probe"]["samples"] == 20
    assert doc["nodes"] == [
        {
            "name": "gpu-7",
            "role": "receiver",
            "state": "failed:qualify",
            "failure": "qualify: payload rate below the floor",
            "updated_unix": pytest.approx(doc["nodes"][0]["updated_unix"]),
        }
    ]
    assert sum(doc["throughput"]["bytes"]) == committed[0]["payload_bytes"]
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    status, _, _ = _get(base + "nope")
    assert status == 404


def test_daemon_logs_one_json_line_per_transfer_with_its_receipt(running):
    """The receiver's stderr is JSON lines; each receipt it wrote has one 'transfer' line."""
    lines = [json.loads(line) for line in (running["tmp"] / "receiver.log").read_text().splitlines() if line.strip()]
    transfers = [e for e in lines if e["event"] == "transfer"]
    written = sorted(p.stem for p in running["receipts"].glob("*.json"))
    assert sorted(e["receipt"] for e in transfers) == written and len(written) == 2
    assert {e["verdict"] for e in transfers} == {"committed", "refused"}
    assert all(e["level"] in ("info", "warning") and e["ts"].endswith("Z") and e["logger"] == "kvpack.node.receipts" for e in transfers)
    assert any(e["event"] == "ready" and e["metrics_url"] == running["base"] for e in lines)
    # one line per request, naming the receipt of the transfer that served it
    requests = [e for e in lines if e["event"] == "request"]
    committed = next(e["receipt"] for e in transfers if e["verdict"] == "committed")
    assert len(requests) == 1 and requests[0]["ok"] is True and requests[0]["receipt"] == committed
    assert requests[0]["action"] == "full_transfer" and requests[0]["decoded_tokens"] == 4


def _chromium(*args: str) -> subprocess.CompletedProcess:
    """Headless chromium, started as a Popen from the main thread so the lifeline ties it to
    this run (tests/conftest.py leaves the blocking subprocess.run untied)."""
    with subprocess.Popen([CHROMIUM, *FLAGS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (scripts/install.sh installs it as root)")
def test_status_page_in_headless_chromium(running, tmp_path):
    url = running["base"] + "status"
    profile = tmp_path / "profile"
    dom = _chromium(f"--user-data-dir={profile}", "--virtual-time-budget=2000", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    (tmp_path / "status.dom.html").write_text(html)
    assert '<h1 id="title">kvpack receiver <span id="ready" class="ok">ready</span></h1>' in html
    # sessions: the live session holds the prompt plus the decoded tokens
    assert re.search(r'<table id="sessions">.*<td>live</td><td>idle</td><td class="num">\d+</td>', html, re.S)
    # transfers: the committed one and the refused stranger, each with its receipt id
    rows = re.findall(r"<tr>(.*?)</tr>", re.search(r'<table id="transfers">(.*?)</table>', html, re.S).group(1))
    verdicts = [re.search(r'<td class="(ok|bad)">(\w+)</td>', row).group(2) for row in rows[1:]]
    assert "committed" in verdicts and "refused" in verdicts
    refused = next(row for row in rows[1:] if ">refused<" in row)
    assert "framing" in refused and re.search(r"<code>\d+-receiver-refused-[0-9a-f]{6}</code>", refused)
    committed = next(row for row in rows[1:] if ">committed<" in row)
    assert running["reply"]["result"]["transfer"]["transfer_id"] in committed
    # sparkline: inline SVG, one polyline over 60 buckets
    svg = re.search(r'<svg id="throughput-sparkline".*?</svg>', html, re.S).group(0)
    assert len(re.search(r'points="([^"]+)"', svg).group(1).split()) == 60
    assert re.search(r'<table id="watermarks">.*<td class="num">1</td>', html, re.S)
    assert 'id="volume-probe"' in html and "over 20 reservations" in html
    assert re.search(r'<p id="store-summary">.*: \d+ cuts, ', html)
    assert re.search(r'<table id="nodes">.*<td>gpu-7</td><td>receiver</td><td class="bad">failed:qualify</td>', html, re.S)
    # nothing external: no script, no link, no src= to another origin
    assert "<script" not in html and "<link" not in html and not re.search(r'src="(?!data:)', html)
    shot = tmp_path / "status.png"
    pic = _chromium(f"--user-data-dir={profile}", "--window-size=1280,1600", f"--screenshot={shot}", url)
    assert pic.returncode == 0 and shot.stat().st_size > 10_000, pic.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
