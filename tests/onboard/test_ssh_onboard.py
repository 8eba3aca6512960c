"""``kvpack node add`` end to end against a real sshd logging in a separate Unix user.

The cluster identity here is the NumPy array engine with its own declared recipe (three
exchanges, 2,048 positions, 256 output tokens, exact logits): every stage, every daemon and
every exchange is real, only the model is cheap, so the crash loop can afford to kill the
wizard at every stage. tests/onboard/test_smollm2_onboard.py runs the same recipe on SmolLM2.

Topology: ``admin-rx`` is an offline receiver on the admin machine (``kvpack enroll node``);
``prefill-a`` (producer) is added over SSH and qualified against it; ``decode-b`` (receiver)
is added over SSH and qualified against ``prefill-a``.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import pytest

from kvpack.engine.registry import load_engine
from kvpack.node.wire import identity_file_json
from kvpack.onboard.recipe import RECIPE_NAME
from kvpack.onboard.state import STAGES

from .conftest import free_port, kvpack, node_add, record, recording_ssh, stop_local_units

pytestmark = pytest.mark.slow

ENGINE = "arrays:4:2:8"
# The probe limit is the production gate's 100 ms times 20: these tests share two cores with
# other suites, and a loaded CI box can stall one fsync for a few hundred ms (the probe's own
# refusal is tested with a limit nothing can meet).
FAST = ("--engine", ENGINE, "--threads", "1", "--probe-max-tail-ms", "2000")


def identity(with_recipe: bool = True) -> dict:
    ident = identity_file_json(load_engine(ENGINE, threads=1))
    if with_recipe:
        ident["qualification"] = {"recipe": RECIPE_NAME, "logits": "exact", "min_payload_gbps": 0.0}
    return ident


def make_cluster(root: Path, ident: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "identity.json").write_text(json.dumps(ident))
    cluster = root / "cluster"
    assert kvpack("enroll", "init", str(cluster), "--identity", str(root / "identity.json")).rc == 0
    assert kvpack("enroll", "node", str(cluster), "admin-rx", "--role", "receiver", "--listen", f"127.0.0.1:{free_port()}").rc == 0
    return cluster


class Fleet:
    def __init__(self, remote, root: Path) -> None:
        self.remote = remote
        self.root = root
        self.cluster = make_cluster(root, identity())
        self.capture = root / "ssh-capture"
        self.wrapper = recording_ssh(self.capture)
        self.producer_port = free_port()
        self.receiver_port = free_port()
        self.ports: dict[str, int] = {}

    def add_producer(self, name: str, *extra: str, **kw):
        port = self.ports.setdefault(name, free_port())  # a re-run must ask for the same node
        return node_add(self.remote, self.cluster, name, "producer", *FAST, "--control-listen", f"127.0.0.1:{port}", *extra, **kw)

    def registry(self) -> dict:
        return json.loads((self.cluster / "cluster.json").read_text())


@pytest.fixture(scope="module")
def fleet(remote, tmp_path_factory):
    f = Fleet(remote, tmp_path_factory.mktemp("fleet"))
    a = node_add(remote, f.cluster, "prefill-a", "producer", *FAST, "--control-listen", f"127.0.0.1:{f.producer_port}", ssh_wrapper=f.wrapper)
    assert a.rc == 0, a.err
    b = node_add(remote, f.cluster, "decode-b", "receiver", *FAST, "--listen", f"127.0.0.1:{f.receiver_port}", "--peer", "prefill-a", ssh_wrapper=f.wrapper)
    assert b.rc == 0, b.err
    f.runs = {"prefill-a": a, "decode-b": b}
    yield f
    stop_local_units(f.cluster)


def node_path(fleet, name: str, *parts: str) -> Path:
    return Path(fleet.remote.node_dir(name), *parts)


def assert_one_key(fleet, name: str, cert_pin: str) -> None:
    """One key per node: one staged version, the live key is that inode, the certificate is for it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    staging = node_path(fleet, name, "staging")
    versions = sorted(p.name for p in staging.iterdir() if (p / "node.key").exists())
    assert versions == [f"v{record(fleet.cluster, name)['key_version']}"]
    staged = staging / versions[0] / "node.key"
    assert os.path.samefile(staged, node_path(fleet, name, "tls", "node.key"))
    assert staged.stat().st_mode & 0o777 == 0o600 and staging.stat().st_mode & 0o777 == 0o700
    assert staged.stat().st_uid == fleet.remote.pw.pw_uid  # created by the node's own user
    key = serialization.load_pem_private_key(staged.read_bytes(), None)
    cert = x509.load_pem_x509_certificate(node_path(fleet, name, "tls", "node.crt").read_bytes())
    assert cert.public_key().public_numbers() == key.public_key().public_numbers()
    import hashlib

    assert hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest() == cert_pin


def test_producer_and_receiver_complete_every_stage(fleet):
    reg = fleet.registry()
    for name, role in (("prefill-a", "producer"), ("decode-b", "receiver")):
        rec = record(fleet.cluster, name)
        assert rec["state"] == "healthy" and fleet.runs[name].record["state"] == "healthy"
        assert [rec["stages"][s]["status"] for s in STAGES] == ["done"] * len(STAGES)
        for s in STAGES:  # every stage left its receipt
            receipt = json.loads((fleet.cluster / "onboard" / name / rec["stages"][s]["receipt"]).read_text())
            assert receipt["stage"] == s and receipt["outcome"] == "done"
        assert all(f"[{i + 1}/8] {s}: done" in fleet.runs[name].err for i, s in enumerate(STAGES))  # progress labels
        q = rec["qualification"]
        assert q["ok"] and len(q["exchanges"]) == 3 and q["median_bps"] > 0 and len(q["rates_bps"]) == 3
        for ex in q["exchanges"]:  # receipts kept: the reply and the receiver's own receipt
            kept = json.loads((fleet.cluster / "onboard" / name / q["dir"] / ex).read_text())
            assert kept["receiver_receipt"]["verdict"] == "committed" and kept["receiver_receipt"]["prefix_cut"] == 0
            assert len(kept["reply"]["result"]["tokens"]) == 256 and kept["reply"]["result"]["prompt_tokens"] == 2048
        entry = reg["nodes"][name]
        assert entry["role"] == role and entry["remote"]["port"] == fleet.remote.port
        assert entry["leaf_sha256"] == rec["pending"]["leaf_sha256"]
        assert_one_key(fleet, name, entry["leaf_sha256"])
        assert not (fleet.cluster / "nodes" / name).exists()  # nothing of the node lives on the admin side
    # configs on both sides, secrets by path, pins of the exact leaves
    admin_cfg = json.loads((fleet.cluster / "nodes" / "admin-rx" / "receiver.prefill-a.json").read_text())
    assert admin_cfg["peer_leaf_sha256"] == [reg["nodes"]["prefill-a"]["leaf_sha256"]]
    pcfg = json.loads(node_path(fleet, "prefill-a", "producer.json").read_text())
    assert {r["name"]: r["leaf_sha256"] for r in pcfg["receivers"]} == {
        "admin-rx": [reg["nodes"]["admin-rx"]["leaf_sha256"]],
        "decode-b": [reg["nodes"]["decode-b"]["leaf_sha256"]],
    }
    assert all(r["hmac_key_file"].startswith("hmac/") for r in pcfg["receivers"])
    for key in node_path(fleet, "prefill-a", "hmac").iterdir():
        assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_bytes()) == 65
    assert (
        node_path(fleet, "decode-b", "hmac", "prefill-a-to-decode-b.key").read_bytes()
        == node_path(fleet, "prefill-a", "hmac", "prefill-a-to-decode-b.key").read_bytes()
    )
    rows = {r["name"]: r for r in json.loads(kvpack("node", "list", "--cluster", str(fleet.cluster), "--json").out)}
    assert rows["prefill-a"]["state"] == rows["decode-b"]["state"] == "healthy" and rows["admin-rx"]["state"] == "enrolled-offline"
    assert rows["decode-b"]["median_gbps"] > 0
    # the node daemons keep running as managed units after the wizard left
    status = json.loads(kvpack("node-local", "status", "--dir", fleet.remote.node_dir("decode-b")).out)
    assert status["units"] == {"receiver": True} and status["pins"]["leaf_sha256"] == reg["nodes"]["decode-b"]["leaf_sha256"]


def _key_material(path: Path) -> dict[str, bytes]:
    """Every encoding of a private key that could leak: PEM, PKCS#8 and SEC1 DER (and their
    base64), the raw 32-byte scalar and its hex."""
    from cryptography.hazmat.primitives import serialization

    pem = path.read_bytes()
    key = serialization.load_pem_private_key(pem, None)
    pkcs8 = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    sec1 = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())
    scalar = key.private_numbers().private_value.to_bytes(32, "big")
    body = b"".join(line for line in pem.splitlines() if not line.startswith(b"-----"))
    return {
        "pem": pem,
        "pem-body": body[16:80],
        "pkcs8": pkcs8,
        "sec1": sec1,
        "pkcs8-b64": base64.b64encode(pkcs8)[8:72],
        "scalar": scalar,
        "scalar-hex": scalar.hex().encode(),
        "scalar-HEX": scalar.hex().upper().encode(),
    }


def test_no_private_key_bytes_of_a_node_exist_on_the_admin_side(fleet):
    secrets_ = {f"{name}:{kind}": v for name in ("prefill-a", "decode-b") for kind, v in _key_material(node_path(fleet, name, "tls", "node.key")).items()}
    captured = list(fleet.capture.glob("*.in")) + list(fleet.capture.glob("*.out"))
    assert len(captured) > 20  # every SSH session of both runs was recorded, both directions
    assert any("keygen" in p.with_suffix(".argv").read_text() for p in fleet.capture.glob("*.in"))
    scanned = 0
    for base in (fleet.cluster, fleet.capture, fleet.root):
        for p in base.rglob("*"):
            if p.is_file() and not p.is_symlink():
                data = p.read_bytes()
                scanned += 1
                leaks = [k for k, v in secrets_.items() if v in data]
                assert not leaks, f"{p} holds {leaks}"
    assert scanned > 50
    # the wizard's process never held the key either: it never asked for it (every remote argv)
    argvs = "\n".join(p.read_text() for p in fleet.capture.glob("*.argv"))
    assert "node.key" not in argvs and "cat" not in argvs.split()


def test_wrong_host_key_is_refused_before_anything_reaches_the_node(fleet, tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    other = " ".join((tmp_path / "other.pub").read_text().split()[:2])
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"[127.0.0.1]:{fleet.remote.port} {other}\n")
    r = fleet.add_producer("wrong-hk", "--peer", "admin-rx", "--known-hosts", str(wrong))
    assert r.rc == 1 and "host_key" in r.err
    rec = record(fleet.cluster, "wrong-hk")
    assert rec["state"] == "failed:preflight" and rec["failure"]["category"] == "host_key" and "not the pinned one" in rec["failure"]["reason"]
    assert not Path(fleet.remote.node_dir("wrong-hk")).exists()
    assert "wrong-hk" not in fleet.registry()["nodes"]
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    r = fleet.add_producer("wrong-hk", "--peer", "admin-rx", "--known-hosts", str(empty))
    assert r.rc == 1 and record(fleet.cluster, "wrong-hk")["failure"]["category"] == "host_key"
    assert "no trust on first use" in record(fleet.cluster, "wrong-hk")["failure"]["reason"]


def test_ledger_volume_failing_the_probe_is_refused(fleet):
    r = fleet.add_producer("slow-vol", "--peer", "admin-rx", "--probe-max-tail-ms", "0.000001")
    assert r.rc == 1
    rec = record(fleet.cluster, "slow-vol")
    assert rec["state"] == "failed:preflight" and rec["failure"]["category"] == "volume"
    assert "failed the probe" in rec["failure"]["reason"] and "reservations" in rec["failure"]["reason"]
    assert not (Path(fleet.remote.node_dir("slow-vol")) / "staging").exists()  # no key was generated
    assert "slow-vol" not in fleet.registry()["nodes"]


def test_identity_without_a_recipe_is_refused(remote, tmp_path):
    cluster = make_cluster(tmp_path, identity(with_recipe=False))
    r = node_add(remote, cluster, "no-recipe", "producer", *FAST, "--control-listen", f"127.0.0.1:{free_port()}")
    assert r.rc == 1
    rec = record(cluster, "no-recipe")
    assert rec["state"] == "failed:preflight" and rec["failure"]["category"] == "recipe"
    assert "declares no qualification recipe" in rec["failure"]["reason"]
    assert not Path(remote.node_dir("no-recipe")).exists()  # refused before SSH


def _pair_files(fleet, name: str) -> dict[str, bool]:
    return {
        "admin-config": (fleet.cluster / "nodes" / "admin-rx" / f"receiver.{name}.json").exists(),
        "admin-key": (fleet.cluster / "nodes" / "admin-rx" / "hmac" / f"{name}-to-admin-rx.key").exists(),
        "remote-config": node_path(fleet, "decode-b", f"receiver.{name}.json").exists(),
        "remote-key": node_path(fleet, "decode-b", "hmac", f"{name}-to-decode-b.key").exists(),
    }


def test_floor_above_the_measured_rate_fails_qualify_and_revokes(fleet):
    r = fleet.add_producer("prefill-f", "--peer", "admin-rx", "--min-payload-gbps", "1000000")
    assert r.rc == 1
    rec = record(fleet.cluster, "prefill-f")
    assert rec["state"] == "failed:qualify" and rec["failure"]["category"] == "qualify"
    assert "below the floor of 1e+06 Gbps" in rec["failure"]["reason"]
    q = rec["qualification"]
    assert not q["ok"] and q["median_bps"] > 0 and len(q["exchanges"]) == 2  # the median was lost after two
    # no half-trusted pins: not in the registry, nothing left on the peers, its daemon stopped
    assert "prefill-f" not in fleet.registry()["nodes"]
    assert _pair_files(fleet, "prefill-f") == dict.fromkeys(("admin-config", "admin-key", "remote-config", "remote-key"), False)
    assert rec["revocation"]["admin_side_ok"] and all(x["ok"] for x in rec["revocation"]["remote"])
    assert json.loads(kvpack("node-local", "status", "--dir", fleet.remote.node_dir("prefill-f")).out)["units"] == {}
    assert [rec["stages"][s]["status"] for s in STAGES][:3] == ["done"] * 3
    # resume with an honest floor: trust is rebuilt under fresh epochs, the same key is kept
    r = fleet.add_producer("prefill-f", "--peer", "admin-rx", "--min-payload-gbps", "0")
    assert r.rc == 0, r.err
    rec = record(fleet.cluster, "prefill-f")
    assert rec["state"] == "healthy" and all(p["epoch"] == 2 for p in rec["pending"]["pairs"])
    assert _pair_files(fleet, "prefill-f") == dict.fromkeys(("admin-config", "admin-key", "remote-config", "remote-key"), True)
    assert_one_key(fleet, "prefill-f", fleet.registry()["nodes"]["prefill-f"]["leaf_sha256"])


KILL_POINTS = [
    "onboard.preflight.begin",
    "onboard.keygen.begin",
    "onboard.keygen.remote",
    "onboard.sign.begin",
    "onboard.install.begin",
    "onboard.install.node",
    "onboard.install.pair",
    "onboard.configs.begin",
    "onboard.configs.node",
    "onboard.start.begin",
    "onboard.start.node",
    "onboard.qualify.begin",
    "onboard.qualify.exchange",
    "onboard.healthy.begin",
    "onboard.healthy.registry",
]


# The producer is killed at every point; the receiver (whose stages differ only in which
# daemons restart and where the exchanges run) at the points where its path differs.
RECEIVER_KILL_POINTS = [
    "onboard.keygen.remote",
    "onboard.install.pair",
    "onboard.configs.node",
    "onboard.start.node",
    "onboard.qualify.exchange",
    "onboard.healthy.registry",
]


@pytest.mark.parametrize("role,points", [("producer", KILL_POINTS), ("receiver", RECEIVER_KILL_POINTS)])
def test_wizard_killed_at_every_stage_resumes_to_healthy_with_one_key(fleet, role, points):
    name = f"crash-{role[0]}"
    if role == "producer":
        extra = (*FAST, "--peer", "admin-rx", "--control-listen", f"127.0.0.1:{free_port()}")
    else:
        extra = (*FAST, "--peer", "prefill-a", "--listen", f"127.0.0.1:{free_port()}")
    seen = []
    for point in points:
        r = node_add(fleet.remote, fleet.cluster, name, role, *extra, failpoint=point)
        assert r.rc == -9, (point, r.err[-2000:])  # SIGKILLed exactly there
        rec = record(fleet.cluster, name)
        stage = point.split(".")[1]
        assert rec["state"] == f"running:{stage}", (point, rec["state"])
        seen.append(stage)
        listed = {x["name"]: x for x in json.loads(kvpack("node", "list", "--cluster", str(fleet.cluster), "--json").out)}
        assert listed[name]["state"] == f"interrupted:{stage}"
    r = node_add(fleet.remote, fleet.cluster, name, role, *extra)
    assert r.rc == 0, r.err[-3000:]
    rec = record(fleet.cluster, name)
    assert rec["state"] == "healthy" and set(seen) == ({p.split(".")[1] for p in points})
    entry = fleet.registry()["nodes"][name]
    assert_one_key(fleet, name, entry["leaf_sha256"])
    if role == "producer":
        assert set(seen) == set(STAGES)
        assert rec["stages"]["keygen"]["attempts"] == 3 and rec["stages"]["install"]["attempts"] == 4
    # every kill during install re-provisioned under a new epoch: never a reused one
    pairs = {p["key_id"]: p["epoch"] for p in fleet.registry()["pairs"] if name in (p["producer"], p["receiver"])}
    assert pairs and all(e >= 2 for e in pairs.values())
    # the peer's config pins exactly the committed leaf
    if role == "producer":
        cfg = json.loads((fleet.cluster / "nodes" / "admin-rx" / f"receiver.{name}.json").read_text())
        assert cfg["peer_leaf_sha256"] == [entry["leaf_sha256"]] and cfg["minimum_hmac_epoch"] == pairs[f"{name}-to-admin-rx"]
    else:
        pcfg = json.loads(node_path(fleet, "prefill-a", "producer.json").read_text())
        assert [r["leaf_sha256"] for r in pcfg["receivers"] if r["name"] == name] == [[entry["leaf_sha256"]]]


def test_remove_revokes_and_a_re_add_gets_a_new_key_and_epoch(fleet):
    r = kvpack("node", "remove", "decode-b", "--cluster", str(fleet.cluster), "--ssh-key", str(fleet.remote.client_key))
    assert r.rc == 0, r.err
    reg = fleet.registry()
    assert "decode-b" not in reg["nodes"] and not any("decode-b" in p["key_id"] for p in reg["pairs"])
    assert reg["retired_epochs"]["prefill-a-to-decode-b"] == 1
    pcfg = json.loads(node_path(fleet, "prefill-a", "producer.json").read_text())
    assert "decode-b" not in [x["name"] for x in pcfg["receivers"]]
    assert not node_path(fleet, "prefill-a", "hmac", "prefill-a-to-decode-b.key").exists()
    assert json.loads(kvpack("node-local", "status", "--dir", fleet.remote.node_dir("decode-b")).out)["units"] == {}
    assert record(fleet.cluster, "decode-b")["state"] == "removed"
    r = node_add(fleet.remote, fleet.cluster, "decode-b", "receiver", *FAST, "--listen", f"127.0.0.1:{fleet.receiver_port}", "--peer", "prefill-a")
    assert r.rc == 0, r.err[-3000:]
    rec = record(fleet.cluster, "decode-b")
    assert rec["state"] == "healthy" and rec["key_version"] == 2
    assert {p["key_id"]: p["epoch"] for p in rec["pending"]["pairs"]}["prefill-a-to-decode-b"] == 2
    assert sorted(p.name for p in node_path(fleet, "decode-b", "staging").iterdir()) == ["v1", "v2"]
    assert os.path.samefile(node_path(fleet, "decode-b", "staging", "v2", "node.key"), node_path(fleet, "decode-b", "tls", "node.key"))
