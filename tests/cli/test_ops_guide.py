"""docs/operations.md works as written: its one-host section is a script this test extracts
and runs with bash, start to finish (real model, real daemons on loopback: two prefill nodes
and one decode node serving both; curl and jq), and its example migration config (node.json)
is accepted by the strict config loader."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import free_port

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "operations.md"


def loopback_script() -> str:
    text = GUIDE.read_text()
    block = re.search(r"<!-- loopback-script:begin -->\n```bash\n(.*?)```\n<!-- loopback-script:end -->", text, re.S)
    assert block, "docs/operations.md lost its loopback-script markers"
    return block.group(1)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("jq") is None, reason="the guide uses curl and jq (scripts/install.sh installs them as root)")
def test_one_host_section_runs_as_written(tmp_path):
    pytest.importorskip("transformers")
    shim = tmp_path / "bin"
    shim.mkdir()
    kvpack = shim / "kvpack"  # `kvpack` on PATH runs this checkout with this interpreter
    kvpack.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvpack.cli "$@"\n')
    kvpack.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(
        os.environ,
        PATH=f"{shim}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        WORK=str(work),
        CONTROL_PORT=str(free_port()),
        CONTROL_PORT_B=str(free_port()),
    )
    proc = subprocess.run(["bash", "-c", loopback_script()], capture_output=True, text=True, env=env, timeout=1200)
    (tmp_path / "script.out").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    logs = "".join(f"\n--- {p.name} ---\n{p.read_text()[-3000:]}" for p in work.glob("*.log"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    out = proc.stdout
    assert "700 srv/decode-a" in out and "600 srv/decode-a/tls/node.key" in out  # modes survived the copy
    assert '"ready":true' in out and "kvpack_model_info{" in out
    assert "full_transfer" in out
    # one decode node served both prefill nodes: a committed receipt names each
    assert re.search(r"^committed\tprefill-a\t", out, re.M) and re.search(r"^committed\tprefill-b\t", out, re.M), out[-3000:]
    assert 'id="ready" class="ok">ready' in out
    assert out.rstrip().endswith(f"loopback cluster OK in {work}")
    for log in ("producer.log", "producer-b.log", "receiver.log"):  # not a terminal: no third-party progress bars
        text = (work / log).read_text()
        assert "Loading weights" not in text and "\r" not in text, text[-2000:]
        assert all(json.loads(line)["event"] for line in text.splitlines() if line.strip())
    for name in ("reply.json", "reply-b.json"):
        reply = json.loads((work / name).read_text())
        assert reply["ok"] and reply["result"]["transfer"]["payload_bytes"] > 0, reply


def test_node_json_example_is_accepted(tmp_path):
    """The guide's minimal node.json, placed in an enrolled node directory, loads."""
    from kvpack.migrate.config import load_config

    text = GUIDE.read_text()
    example = re.search(r"A minimal one, next to the node directory `nodes/decode-a/`:\n\n```json\n(.*?)```", text, re.S)
    assert example, "docs/operations.md lost its node.json example"
    node_dir = tmp_path / "cluster" / "nodes" / "decode-a"
    (node_dir / "tls").mkdir(parents=True)
    path = node_dir / "node.json"
    path.write_text(example.group(1))
    cfg = load_config(str(path))
    assert cfg.node_name == "decode-a" and cfg.host == "127.0.0.1" and cfg.port == 8443
    assert cfg.cluster_dir == str(tmp_path / "cluster") and cfg.tls["private_key"] == str(node_dir / "tls" / "node.key")
    assert cfg.engine == {"kind": "smollm2", "threads": 2}
