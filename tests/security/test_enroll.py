"""Enrollment through the real CLI: configs load, enrolled nodes shake hands, rotation cuts the
old certificate off and moves to a fresh epoch without touching the ledger."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading

import pytest

from kvpack.cli import main
from kvpack.errors import SecurityError
from kvpack.security.config import load_producer_config, load_receiver_config
from kvpack.security.ledger import ReplayLedger
from kvpack.security.secret_files import load_hmac_key
from kvpack.security.tls import TlsEndpoint, accept, connect, listen

IDENTITY = {
    "identity": {
        "adapter_sha256": "1" * 64,
        "chat_template_sha256": "2" * 64,
        "context_policy_sha256": "3" * 64,
        "model_sha256": "4" * 64,
        "tokenizer_sha256": "5" * 64,
        "model_revision": "m",
        "tokenizer_revision": "t",
    },
    "target_cache_identity_sha256": "6" * 64,
}


def cli(*args: str) -> int:
    return main(["enroll", *args])


@pytest.fixture
def cluster(tmp_path):
    ident = tmp_path / "identity.json"
    ident.write_text(json.dumps(IDENTITY))
    root = str(tmp_path / "cluster")
    assert cli("init", root, "--identity", str(ident)) == 0
    assert cli("node", root, "dec-a", "--role", "receiver", "--listen", "127.0.0.1:29590") == 0
    assert cli("node", root, "pre-a", "--role", "producer") == 0
    assert cli("node", root, "store-a", "--role", "storage") == 0
    return root


def node(root: str, name: str, *parts: str) -> str:
    return os.path.join(root, "nodes", name, *parts)


def handshake(server_ep: TlsEndpoint, client_ep: TlsEndpoint) -> tuple[object, object]:
    """One loopback connection; returns (server outcome, client outcome)."""
    listener = listen("127.0.0.1", 0)
    outcome: dict[str, object] = {}

    def serve() -> None:
        try:
            with accept(listener, server_ep, timeout=5) as ch:
                ch.settimeout(5)
                data = ch.recv_exact(5)
                ch.sendall(b"ack:" + data)
                outcome["server"] = ch.peer.leaf_sha256
        except BaseException as exc:
            outcome["server"] = exc

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with connect(client_ep, "127.0.0.1", listener.getsockname()[1]) as ch:
            ch.sendall(b"hello")
            client = ch.recv_exact(9)
    except BaseException as exc:
        client = exc
    finally:
        thread.join(10)
        listener.close()
    return outcome.get("server"), client


def test_fresh_cluster_configs_load_and_handshake(cluster):
    show = main(["enroll", "show", cluster, "--json"])
    assert show == 0
    rcfg = load_receiver_config(node(cluster, "dec-a", "receiver.pre-a.json"))
    pcfg = load_producer_config(node(cluster, "pre-a", "producer.json"))
    registry = json.load(open(os.path.join(cluster, "cluster.json")))
    pins = {n: e["leaf_sha256"] for n, e in registry["nodes"].items()}

    # Cross-pinned, same pair key id and epoch, the same key on both ends.
    assert rcfg.peer_leaf_sha256 == {pins["pre-a"]}
    assert pcfg.receiver("dec-a").leaf_sha256 == {pins["dec-a"]}
    assert rcfg.hmac_key_id == pcfg.receiver("dec-a").hmac_key_id == "pre-a-to-dec-a"
    assert rcfg.minimum_hmac_epoch == pcfg.receiver("dec-a").hmac_epoch == 1
    assert rcfg.load_hmac_key() == load_hmac_key(pcfg.receiver("dec-a").hmac_key_file)
    assert rcfg.identity == IDENTITY["identity"]
    assert rcfg.producer_control.server_name == "pre-a"

    # Secrets by relative path, never inline; private files 0600; keys live only in their node.
    raw = json.load(open(rcfg.path))
    for field in ("certificate_chain", "private_key", "peer_ca", "hmac_key_file", "replay_ledger"):
        assert not os.path.isabs(raw[field])
    text = open(rcfg.path).read() + open(pcfg.path).read()
    assert rcfg.load_hmac_key().hex() not in text and "PRIVATE KEY" not in text
    for path in (rcfg.private_key, rcfg.hmac_key_file, pcfg.private_key, os.path.join(cluster, "ca", "ca.key")):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for name in ("dec-a", "pre-a", "store-a"):
        key = open(node(cluster, name, "tls", "node.key"), "rb").read()
        others = [p for p in _all_files(cluster) if not p.startswith(node(cluster, name))]
        assert all(open(p, "rb").read() != key for p in others)

    # Data plane: the producer connects to the receiver.
    server, client = handshake(rcfg.data_endpoint(), pcfg.data_endpoint("dec-a"))
    assert server == pins["pre-a"] and client == b"ack:hello"
    # Control plane: the receiver connects to the producer's control listener.
    server, client = handshake(pcfg.control_endpoint(), rcfg.control_endpoint())
    assert server == pins["dec-a"] and client == b"ack:hello"


def _all_files(root):
    for base, _, files in os.walk(root):
        for f in files:
            yield os.path.join(base, f)


def test_rotation_refuses_old_certificate_and_bumps_epoch(cluster, tmp_path):
    old_tls = tmp_path / "old-pre-a-tls"
    shutil.copytree(node(cluster, "pre-a", "tls"), old_tls)
    old_producer = load_producer_config(node(cluster, "pre-a", "producer.json"))
    rcfg = load_receiver_config(node(cluster, "dec-a", "receiver.pre-a.json"))
    with ReplayLedger.open(rcfg.replay_ledger, minimum_epoch=rcfg.minimum_hmac_epoch) as led:
        led.reserve(rcfg.hmac_key_id, 1, 41)
    ledger_before = open(rcfg.replay_ledger, "rb").read()
    old_key = rcfg.load_hmac_key()

    assert cli("node", cluster, "pre-a", "--rotate") == 0

    new_r = load_receiver_config(node(cluster, "dec-a", "receiver.pre-a.json"))
    new_p = load_producer_config(node(cluster, "pre-a", "producer.json"))
    assert new_r.minimum_hmac_epoch == new_p.receiver("dec-a").hmac_epoch == 2
    assert new_r.hmac_key_id == rcfg.hmac_key_id and new_r.load_hmac_key() != old_key
    assert new_r.replay_ledger == rcfg.replay_ledger
    assert open(rcfg.replay_ledger, "rb").read() == ledger_before  # never reset

    # The old producer certificate (still chaining to the same CA) is refused by pin.
    old_ep = TlsEndpoint(
        str(old_tls / "node.crt"), str(old_tls / "node.key"), str(old_tls / "ca.crt"), old_producer.receiver("dec-a").leaf_sha256, "muser-kvpack-v2", "dec-a"
    )
    server, client = handshake(new_r.data_endpoint(), old_ep)
    assert isinstance(server, SecurityError) and server.category == "pin"
    assert isinstance(client, SecurityError)
    # The new one works.
    server, client = handshake(new_r.data_endpoint(), new_p.data_endpoint("dec-a"))
    assert client == b"ack:hello"

    # The ledger continues: the old epoch is below the floor, the new epoch starts at 1.
    with ReplayLedger.open(new_r.replay_ledger, minimum_epoch=new_r.minimum_hmac_epoch) as led:
        with pytest.raises(SecurityError) as info:
            led.admit(new_r.hmac_key_id, 1, 42)
        assert info.value.category == "epoch"
        led.reserve(new_r.hmac_key_id, 2, 1)
        assert led.snapshot() == {"pre-a-to-dec-a:1": 41, "pre-a-to-dec-a:2": 1}


def test_ca_rotation_reissues_everything(cluster):
    before = load_producer_config(node(cluster, "pre-a", "producer.json"))
    old = TlsEndpoint(before.certificate_chain, before.private_key, before.peer_ca, before.receiver("dec-a").leaf_sha256, "muser-kvpack-v2", "dec-a")
    # Keep the old material readable after rotation by copying it aside.
    saved = {}
    for attr in ("certificate_chain", "private_key", "peer_ca"):
        saved[attr] = open(getattr(old, attr), "rb").read()
    assert cli("init", cluster, "--rotate") == 0
    r = load_receiver_config(node(cluster, "dec-a", "receiver.pre-a.json"))
    p = load_producer_config(node(cluster, "pre-a", "producer.json"))
    assert r.minimum_hmac_epoch == 2
    server, client = handshake(r.data_endpoint(), p.data_endpoint("dec-a"))
    assert client == b"ack:hello"
    d = os.path.dirname(r.path) + "-old"
    os.makedirs(d, mode=0o700)
    paths = {}
    for attr, data in saved.items():
        paths[attr] = os.path.join(d, attr)
        with open(paths[attr], "wb") as fh:
            fh.write(data)
        os.chmod(paths[attr], 0o600)
    old_ep = TlsEndpoint(paths["certificate_chain"], paths["private_key"], paths["peer_ca"], old.peer_pins, "muser-kvpack-v2", "dec-a")
    server, client = handshake(r.data_endpoint(), old_ep)
    assert isinstance(server, SecurityError) and server.category == "certificate"


def test_enrollment_refusals_leave_registry_unchanged(cluster, tmp_path, capsys):
    registry = os.path.join(cluster, "cluster.json")
    before = open(registry, "rb").read()
    assert cli("node", cluster, "pre-a", "--role", "producer") == 1  # already enrolled
    assert cli("node", cluster, "Bad_Name", "--role", "producer") == 1  # not a DNS label
    assert cli("node", cluster, "ghost", "--rotate") == 1  # nothing to rotate
    assert cli("node", cluster, "dec-a", "--rotate", "--role", "producer") == 1  # role change
    assert cli("init", cluster) == 1  # already initialised
    bare = str(tmp_path / "bare")
    assert cli("init", bare) == 0
    assert cli("node", bare, "dec-b", "--role", "receiver") == 1  # no identity known
    err = capsys.readouterr().err
    assert err.count("kvpack: enrollment: ") == 6
    assert open(registry, "rb").read() == before


def test_receiver_config_refusals(cluster):
    path = node(cluster, "dec-a", "receiver.pre-a.json")
    good = json.load(open(path))

    def refused(mutate, category="config"):
        cfg = json.loads(json.dumps(good))
        mutate(cfg)
        with open(path, "w") as fh:
            json.dump(cfg, fh)
        with pytest.raises(SecurityError) as info:
            load_receiver_config(path)
        assert info.value.category == category, info.value
        return info.value.message

    assert "unknown field" in refused(lambda c: c.update(extra=1))
    assert "unknown field" in refused(lambda c: c["identity"].update(extra=1))
    assert "lowercase" in refused(lambda c: c.update(peer_leaf_sha256=[c["peer_leaf_sha256"][0].upper()]))
    assert "empty" in refused(lambda c: c.update(peer_leaf_sha256=[]))
    assert "integer" in refused(lambda c: c.update(minimum_hmac_epoch=True))
    assert "1..18446744073709551615" in refused(lambda c: c.update(minimum_hmac_epoch=0))
    assert "1..900000" in refused(lambda c: c.update(timeout_ms=900_001))
    assert "wait_for_producer_ms" in refused(lambda c: c.update(wait_for_producer_ms=c["timeout_ms"] + 1))
    assert "advertised_receiver_host" in refused(lambda c: c.pop("advertised_receiver_host"))
    assert "together" in refused(lambda c: c.update(dflash_identity_sha256="7" * 64))
    assert "IP address" in refused(lambda c: c.update(listen="localhost:1"))
    assert "not an existing file" in refused(lambda c: c.update(peer_ca="tls/none.crt"))
    assert "128 bytes" in refused(lambda c: c.update(hmac_key_id="x" * 129))
    with open(path, "w") as fh:
        fh.write('{"schema_version": 1, "schema_version": 1}')
    with pytest.raises(SecurityError) as info:
        load_receiver_config(path)
    assert "duplicate" in info.value.message
    with open(path, "w") as fh:
        json.dump(good, fh)
    os.chmod(node(cluster, "dec-a", "tls", "node.key"), 0o640)
    with pytest.raises(SecurityError) as info:
        load_receiver_config(path)
    assert info.value.category == "secret_file"
