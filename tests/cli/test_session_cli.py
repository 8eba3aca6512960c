"""``kvpack session list|create|show`` against a real decode node API (``kvpack
decode-node-api`` subprocess, HTTPS on loopback, arrays engine), and the API key contract:
a key the node rejects is exit 12 (wrong key), an unknown session exit 1 (not_found)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import check_contract, free_port, node_config, run_cli, write_secret

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def api(world):
    cfg = node_config(world, "api", port=free_port())
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(world.root / "api.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvpack.cli", "decode-node-api", "--config", cfg], stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    try:
        while True:
            r = run_cli(["session", "list", "--config", cfg])
            if r.code == 0:
                break
            assert proc.poll() is None, (world.root / "api.log").read_text()
            assert time.monotonic() < deadline, r.err
            time.sleep(0.2)
        yield cfg
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_session_create_list_show(world, api):
    tokens = world.root / "session-tokens.json"
    tokens.write_text(json.dumps([3, 1, 4, 1, 5, 9, 2, 6]))
    r = run_cli(["session", "create", "--config", api, "--tokens-file", str(tokens), "--session-id", "chat-1", "--json"])
    check_contract(r, 0)
    created = json.loads(r.out)
    assert created["id"] == "chat-1" and created["position"] == 8 and created["state"] == "live"
    r = run_cli(["--json", "session", "list", "--config", api])
    check_contract(r, 0)
    listed = json.loads(r.out)["sessions"]
    assert [s["id"] for s in listed] == ["chat-1"] and listed[0]["bytes"] > 0
    # the id printed by list is the id show takes; text output names it too
    r = run_cli(["session", "show", listed[0]["id"], "--config", api])
    check_contract(r, 0)
    assert r.out.startswith("chat-1 live position=8 revision=0 cache_sha256=")
    assert json.loads(run_cli(["session", "show", "chat-1", "--config", api, "--json"]).out)["cache_sha256"] == created["cache_sha256"]
    # creating it again is a conflict; an unknown one is not found
    check_contract(run_cli(["session", "create", "--config", api, "--tokens-file", str(tokens), "--session-id", "chat-1"]), 1, "conflict")
    check_contract(run_cli(["session", "show", "nope", "--config", api]), 1, "not_found")


def test_wrong_api_key_is_exit_12(world, api):
    cfg = json.loads(Path(api).read_text())
    cfg["api_key_file"] = write_secret(world.root / "wrong-api.key", b"not-the-key-0123456789abcdef\n")
    wrong = world.root / "node-api" / "wrong.json"
    wrong.write_text(json.dumps(cfg))
    check_contract(run_cli(["session", "list", "--config", str(wrong)]), 12, "unauthorized")
    check_contract(run_cli(["transfer", "status", "t1", "--config", str(wrong)]), 12, "unauthorized")


def test_transfer_status_unknown_is_not_found(world, api):
    check_contract(run_cli(["transfer", "status", "t-unknown", "--config", api]), 1, "not_found")
