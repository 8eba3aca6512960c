"""The onboarding pieces without SSH: recipes and their verdict, the stage machine, CSR checks,
the node-side steps on a real directory, the registry rules for remote nodes, bounded
subprocess output. Every refusal test also proves that nothing was written.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpack.errors import OnboardError, SecurityError
from kvpack.onboard import nodeside, units
from kvpack.onboard import recipe as R
from kvpack.onboard import state as S
from kvpack.onboard.ssh import SshTarget, lookup_host_keys, parse_destination, run_bounded
from kvpack.security import enroll as E

DECLARED = {"recipe": R.RECIPE_NAME, "logits": "exact", "min_payload_gbps": 1.5}


# -- recipes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {**DECLARED, "recipe": "handoff-v2-3x1024x256"},
        {**DECLARED, "logits": "bounded"},
        {**DECLARED, "min_payload_gbps": -1},
        {**DECLARED, "min_payload_gbps": float("nan")},
        {**DECLARED, "min_payload_gbps": True},
        {**DECLARED, "exchanges": 2},
        {**DECLARED, "seed": ""},
        [],
    ],
)
def test_declared_recipe_refusals(bad):
    with pytest.raises(OnboardError) as err:
        R.parse_recipe(bad, "q")
    assert err.value.category == "recipe"


def test_recipe_lookup_declared_builtin_and_none():
    ident = {"identity": {"model_revision": "arrays-4x2x8"}, "target_cache_identity_sha256": "0" * 64}
    with pytest.raises(OnboardError) as err:
        R.recipe_for(ident)
    assert err.value.category == "recipe" and "declares no qualification recipe" in err.value.message
    assert R.recipe_for({**ident, "qualification": DECLARED}).min_payload_gbps == 1.5
    smol = R.recipe_for({"identity": {"model_revision": "SmolLM2-135M-Instruct"}})
    assert (smol.source, smol.logits, smol.exchanges, smol.prompt_positions, smol.output_tokens) == ("builtin", "exact", 3, 2048, 256)


def test_prompts_are_deterministic_distinct_and_in_range():
    rec = R.parse_recipe(DECLARED, "q")
    a, b = R.prompts(rec, 49152), R.prompts(rec, 49152)
    assert a == b and len(a) == 3 and all(len(p) == 2048 for p in a)
    assert len({p[0] for p in a}) == 3  # no shared aligned prefix: every exchange is a full handoff
    assert all(256 <= t < 49152 for p in a for t in p)
    assert all(16 <= t < 64 for p in R.prompts(rec, 64) for t in p)
    other = R.parse_recipe({**DECLARED, "seed": "another"}, "q")
    assert R.prompts_digest(R.prompts(other, 49152)) != R.prompts_digest(a)


def _ex(tokens, logits="l", rate_bytes=1000, wire=1.0, action="full_transfer", cut=0):
    return R.Exchange(tuple(tokens), logits, action, cut, rate_bytes, wire)


def test_verdict_refusals_name_the_exchange_and_reason():
    rec = R.Recipe("exact", 0.0, exchanges=3, output_tokens=4)
    refs = [R.Reference((1, 2, 3, 4), "l")] * 3
    ok = [_ex((1, 2, 3, 4))] * 3
    assert R.verdict(rec, refs, ok).ok
    assert "output token 2" in R.verdict(rec, refs, [_ex((1, 2, 9, 4))] + ok[1:]).reason
    assert "full logits differ" in R.verdict(rec, refs, [ok[0], _ex((1, 2, 3, 4), "x"), ok[2]]).reason
    tokens_only = R.Recipe("tokens", 0.0, exchanges=3, output_tokens=4)
    assert R.verdict(tokens_only, refs, [ok[0], _ex((1, 2, 3, 4), "x"), ok[2]]).ok
    assert "not a full handoff" in R.verdict(rec, refs, [_ex((1, 2, 3, 4), action="arm_delta", cut=256)] + ok[1:]).reason
    assert "only 2 of 3" in R.verdict(rec, refs, ok[:2]).reason


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=1e3, max_value=1e10), min_size=3, max_size=3), st.floats(min_value=0, max_value=20))
def test_rate_verdict_is_the_median_against_the_floor(rates, floor_gbps):
    rec = R.Recipe("tokens", floor_gbps, exchanges=3, output_tokens=1)
    refs = [R.Reference((7,), "l")] * 3
    got = [R.Exchange((7,), "l", "full_transfer", 0, int(r), 8.0) for r in rates]  # rate = bytes
    v = R.verdict(rec, refs, got)
    median = statistics.median(g.rate_bps for g in got)
    assert v.ok == (median >= floor_gbps * 1e9)
    # stopping early is sound: once a majority is below the floor, no third rate can pass
    if R.rate_floor_lost(rec, [g.rate_bps for g in got[:2]]):
        assert not v.ok


# -- the stage machine ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["begin", "finish", "fail", "reopen"]), st.integers(0, 100)), max_size=40))
def test_stage_machine_keeps_order_and_names_failures(ops):
    rec = S.new_record("n", "producer", {}, {}, key_version=1, now_ms=0)
    for t, (op, _) in enumerate(ops, start=1):
        stage = S.next_stage(rec)
        if stage is None:
            break
        if op == "begin":
            S.begin(rec, stage, t)
            assert rec["state"] == f"running:{stage}"
        elif op == "finish":
            S.finish(rec, stage, "r", t)
        elif op == "fail":
            S.fail(rec, stage, "qualify", "why", t)
            assert rec["state"] == f"failed:{stage}" and rec["failure"]["stage"] == stage
        else:
            S.reopen_trust_stages(rec, t)
        done = [s for s in S.STAGES if rec["stages"][s]["status"] == "done"]
        assert done == list(S.STAGES[: len(done)])  # done stages are always a prefix
    if S.next_stage(rec) is None:
        assert rec["state"] == "healthy"


def test_record_round_trip_and_refusal(tmp_path):
    rec = S.new_record("node-a", "receiver", {"user": "u"}, {}, key_version=1, now_ms=1)
    S.save(str(tmp_path), rec)
    assert S.load(str(tmp_path), "node-a") == rec
    assert S.load(str(tmp_path), "node-b") is None
    (tmp_path / "onboard" / "node-a" / "state.json").write_text('{"schema": "other"}')
    with pytest.raises(OnboardError) as err:
        S.load(str(tmp_path), "node-a")
    assert err.value.category == "state"


# -- CSR checks -------------------------------------------------------------------------------------


def _csr(key=None, cn="node-a", sans=("node-a", "localhost", "127.0.0.1", "::1"), extra_ext=False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key = key or E.generate_key()
    b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(E._san_entries(sans)), critical=False)
    if extra_ext:
        b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    return b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


SANS = E.node_sans("node-a")


def test_csr_checks_accept_the_exact_request():
    E.check_node_csr(_csr(), "node-a", SANS)


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: _csr(cn="node-b"), "subject must be exactly CN=node-a"),
        (lambda: _csr(sans=("node-a",)), "expected exactly"),
        (lambda: _csr(sans=(*SANS, "evil.example")), "expected exactly"),
        (lambda: _csr(sans=()), "requests no subjectAltName"),
        (lambda: _csr(extra_ext=True), "extensions the CA does not grant"),
        (lambda: _csr(key=_p384()), "ECDSA P-256"),
        (lambda: _csr(key=_rsa()), "ECDSA P-256"),
        (lambda: _tampered(_csr()), "signature is invalid"),
        (lambda: b"not a csr", "one PEM certificate request"),
    ],
)
def test_csr_refusals(make, needle):
    with pytest.raises(SecurityError) as err:
        E.check_node_csr(make(), "node-a", SANS)
    assert needle in err.value.message


def _p384():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP384R1())


def _rsa():
    from cryptography.hazmat.primitives.asymmetric import rsa

    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _tampered(pem: bytes) -> bytes:
    """The same request with one bit of its signature flipped: its holder did not sign it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    der = bytearray(x509.load_pem_x509_csr(pem).public_bytes(serialization.Encoding.DER))
    der[-1] ^= 1
    return x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)


def test_sign_node_csr_takes_sans_from_the_admin(tmp_path):
    from cryptography import x509

    cluster = E.Cluster.init(str(tmp_path / "c"))
    cert, ca = cluster.sign_node_csr("node-a", _csr(), SANS)
    got = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(v) for v in got.get_values_for_type(x509.DNSName)} == {"node-a", "localhost"}
    cert.verify_directly_issued_by(ca)
    assert cluster.registry["nodes"] == {}  # signing trusts nothing by itself


# -- node side on a real directory ------------------------------------------------------------------


def test_keygen_is_idempotent_and_private(tmp_path):
    d = str(tmp_path / "node")
    a = nodeside.keygen(d, "node-a", 1, SANS)
    b = nodeside.keygen(d, "node-a", 1, SANS)
    assert a["created"] and not b["created"] and a["public_key_sha256"] == b["public_key_sha256"]
    assert "PRIVATE" not in json.dumps(a) + json.dumps(b)
    key = tmp_path / "node" / "staging" / "v1" / "node.key"
    assert key.stat().st_mode & 0o777 == 0o600
    for p in (tmp_path / "node", tmp_path / "node" / "staging", key.parent):
        assert p.stat().st_mode & 0o777 == 0o700
    E.check_node_csr(a["csr_pem"].encode(), "node-a", SANS)
    assert nodeside.staged_versions(d) == [1]


def test_install_refuses_a_certificate_for_another_key_and_installs_nothing(tmp_path):
    from kvpack.security.enroll import cert_pem

    cluster = E.Cluster.init(str(tmp_path / "c"))
    d = str(tmp_path / "node")
    nodeside.keygen(d, "node-a", 1, SANS)
    other, _ = cluster.sign_node_csr("node-a", _csr(), SANS)  # a valid cert, wrong key
    ca_pem = cluster.ca_certificate_pem().decode()
    with pytest.raises(OnboardError) as err:
        nodeside.install(d, 1, {"certificate_pem": cert_pem(other).decode(), "ca_pem": ca_pem})
    assert err.value.category == "install" and "not for this node's staged key" in err.value.message
    assert not (tmp_path / "node" / "tls").exists()
    mine = nodeside.keygen(d, "node-a", 1, SANS)
    cert, _ = cluster.sign_node_csr("node-a", mine["csr_pem"].encode(), SANS)
    foreign = E.Cluster.init(str(tmp_path / "c2")).ca_certificate_pem().decode()
    with pytest.raises(OnboardError, match="not issued by the CA"):
        nodeside.install(d, 1, {"certificate_pem": cert_pem(cert).decode(), "ca_pem": foreign})
    assert not (tmp_path / "node" / "tls").exists()
    pins = nodeside.install(d, 1, {"certificate_pem": cert_pem(cert).decode(), "ca_pem": ca_pem})
    assert pins == nodeside.install(d, 1, {"certificate_pem": cert_pem(cert).decode(), "ca_pem": ca_pem})  # idempotent
    live, staged = tmp_path / "node" / "tls" / "node.key", tmp_path / "node" / "staging" / "v1" / "node.key"
    assert os.path.samefile(live, staged)  # one key: a hard link, never a copy


def test_secret_and_config_refusals_leave_nothing(tmp_path):
    d = str(tmp_path / "node")
    os.makedirs(d)
    for bad in (b"AB" * 32 + b"\n", b"ab" * 31 + b"\n", b"ab" * 32, b"x" * 65):
        with pytest.raises(OnboardError):
            nodeside.put_secret(d, "p-to-r", bad)
    with pytest.raises(OnboardError):
        nodeside.put_secret(d, "../escape", b"ab" * 32 + b"\n")
    assert not (tmp_path / "node" / "hmac").exists() or not os.listdir(tmp_path / "node" / "hmac")
    assert nodeside.put_secret(d, "p-to-r", b"ab" * 32 + b"\n")["path"].endswith("hmac/p-to-r.key")
    with pytest.raises(OnboardError) as err:  # names files that do not exist: the daemon would refuse it
        nodeside.put_config(d, "producer.json", json.dumps({"schema_version": 1}).encode())
    assert err.value.category == "install"
    with pytest.raises(OnboardError):
        nodeside.put_config(d, "../producer.json", b"{}")
    assert sorted(os.listdir(d)) == ["hmac"]  # no config, no leftover candidate


def test_receipt_reader_stays_inside_the_node_dir(tmp_path):
    d = tmp_path / "node"
    (d / "receipts").mkdir(parents=True)
    (d / "receipts" / "r.json").write_text('{"verdict": "committed"}')
    (tmp_path / "outside.json").write_text("{}")
    assert nodeside.read_receipt(str(d), str(d / "receipts" / "r.json"))["verdict"] == "committed"
    for bad in (str(tmp_path / "outside.json"), str(d / "receipts" / ".." / ".." / "outside.json"), "/etc/passwd"):
        with pytest.raises(OnboardError):
            nodeside.read_receipt(str(d), bad)


def test_unit_argv_is_built_from_checked_fields(tmp_path):
    argv = units.build_argv(str(tmp_path), "receiver", role="receiver", config="receiver.p-a.json", engine="arrays:4:2:8", threads=1, listen="127.0.0.1:0")
    assert argv[argv.index("--config") + 1] == str(tmp_path / "receiver.p-a.json") and "--listen" in argv
    for bad in (
        dict(role="receiver", config="receiver.p-a.json", engine="smollm2; rm -rf /", threads=1),
        dict(role="producer", config="receiver.p-a.json", engine="smollm2", threads=1),
        dict(role="receiver", config="../x.json", engine="smollm2", threads=1),
        dict(role="receiver", config="receiver.p-a.json", engine="smollm2", threads=0),
        dict(role="producer", config="producer.json", engine="smollm2", threads=1, listen="127.0.0.1:1"),
    ):
        with pytest.raises(OnboardError):
            units.build_argv(str(tmp_path), "u", **bad)
    with pytest.raises(OnboardError):
        units.status(str(tmp_path), "../etc")


# -- ssh leg ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["host", "-oProxyCommand=x@host", "user@-oProxyCommand=x", "us er@host", "user@ho;st", "root@$(id)"])
def test_destination_refusals(bad):
    with pytest.raises(OnboardError):
        parse_destination(bad)


def test_host_key_lookup_handles_hashed_entries_and_refuses_unknown_hosts(tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "hk")], check=True)
    pub = " ".join((tmp_path / "hk.pub").read_text().split()[:2])
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:2222 {pub}\nother.example {pub}\n")
    subprocess.run(["ssh-keygen", "-H", "-f", str(known)], check=True, capture_output=True)  # hash the names
    assert lookup_host_keys(str(known), "127.0.0.1", 2222) == [pub]
    with pytest.raises(OnboardError) as err:
        lookup_host_keys(str(known), "127.0.0.1", 2223)
    assert err.value.category == "host_key" and "no trust on first use" in err.value.message
    t = SshTarget("alias", "u", "127.0.0.1", 2222, (pub,), str(tmp_path / "pinned"))
    t.write_known_hosts()
    assert (tmp_path / "pinned").read_text() == f"alias {pub}\n"
    argv = t.argv("kvpack node-local status --dir 'a b'")
    assert "BatchMode=yes" in argv and "StrictHostKeyChecking=yes" in argv and argv[-1] == "kvpack node-local status --dir 'a b'"


def test_bounded_run_refuses_floods_and_hangs():
    flood = [sys.executable, "-c", "import sys; sys.stdout.write('x' * 300000)"]
    assert len(run_bounded(flood, stdin=None, timeout_s=60, output_limit=400000).stdout) == 300000
    with pytest.raises(OnboardError, match="output exceeds"):
        run_bounded(flood, stdin=None, timeout_s=60, output_limit=1000)
    with pytest.raises(OnboardError, match="no answer within"):
        run_bounded([sys.executable, "-c", "import time; time.sleep(30)"], stdin=None, timeout_s=0.5)
    echo = run_bounded([sys.executable, "-c", "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read())"], stdin=b"y" * 200000, timeout_s=60)
    assert echo.stdout == b"y" * 200000


# -- registry rules for remote nodes ----------------------------------------------------------------


def _remote_entry(cluster: E.Cluster, name: str, role: str) -> dict:
    csr = _csr(cn=name, sans=E.node_sans(name))
    cert, _ = cluster.sign_node_csr(name, csr, E.node_sans(name))
    entry = {"role": role, "pki_generation": 1, "days": 365, "sans": E.node_sans(name), "leaf_sha256": E.cert_sha256(cert), "not_after": "x"}
    entry["remote"] = {"user": "u", "host": "10.0.0.9", "port": 22, "node_dir": "/srv/n", "host_keys": [], "host_key_sha256": []}
    entry.update({"control_listen": "127.0.0.1:1"} if role == "producer" else {"listen": "127.0.0.1:2", "identity": cluster.registry["default_identity"]})
    return entry


IDENT = {
    "identity": {k: "1" * 64 for k in ("adapter_sha256", "chat_template_sha256", "context_policy_sha256", "model_sha256", "tokenizer_sha256")}
    | {"model_revision": "m", "tokenizer_revision": "t"},
    "target_cache_identity_sha256": "2" * 64,
}


def test_offline_enrollment_never_writes_for_remote_nodes(tmp_path, capsys):
    cluster = E.Cluster.init(str(tmp_path / "c"), identity=IDENT)
    cluster.enroll_node("rx-local", "receiver")
    pair = {"producer": "px-remote", "receiver": "rx-local", "key_id": "px-remote-to-rx-local", "epoch": 1}
    cluster.commit_onboarded("px-remote", _remote_entry(cluster, "px-remote", "producer"), [pair])
    cluster.commit_onboarded(
        "px-remote", _remote_entry(cluster, "px-remote", "producer") | {"leaf_sha256": cluster.registry["nodes"]["px-remote"]["leaf_sha256"]}, [pair]
    )
    assert not (tmp_path / "c" / "nodes" / "px-remote").exists()
    cfg = json.loads((tmp_path / "c" / "nodes" / "rx-local" / "receiver.px-remote.json").read_text())
    assert cfg["peer_leaf_sha256"] == [cluster.registry["nodes"]["px-remote"]["leaf_sha256"]]
    from kvpack.cli import main as kvpack_main

    assert kvpack_main(["enroll", "node", str(tmp_path / "c"), "rx-two", "--role", "receiver"]) == 0  # offline: pairs offline producers only
    assert "not paired with SSH-onboarded ['px-remote']" in capsys.readouterr().out
    cluster = E.Cluster.open(str(tmp_path / "c"))
    assert not any("rx-two" in p["key_id"] for p in cluster.registry["pairs"])
    assert not (tmp_path / "c" / "nodes" / "px-remote").exists()
    for name in ("px-remote", "rx-local"):
        with pytest.raises(SecurityError, match="SSH-onboarded|onboarded over SSH"):
            cluster.enroll_node(name, None, rotate=True)
    with pytest.raises(SecurityError, match="cannot rotate the CA offline"):
        E.Cluster.init(str(tmp_path / "c"), rotate=True)
    # removal retires the epoch: the pair, added again, starts a disjoint counter space
    cluster.remove_node("px-remote")
    assert not (tmp_path / "c" / "nodes" / "rx-local" / "receiver.px-remote.json").exists()
    assert cluster.next_pair_epoch("px-remote", "rx-local") == 2
    cluster.enroll_node("rx-local", None, rotate=True)  # no remote pair left: offline rotation works again


# -- fuzz: bytes from the other side ----------------------------------------------------------------

_VALID_CSR = _csr()


def _armoured_der_mutation(flips: list[tuple[int, int]]) -> bytes:
    """The valid request's DER with bytes flipped, armoured again (a PEM-level flip mostly
    breaks the base64; the DER is where a parser can be surprised)."""
    import base64

    from cryptography import x509

    der = bytearray(x509.load_pem_x509_csr(_VALID_CSR).public_bytes(_der()))
    for pos, bits in flips:
        der[pos % len(der)] ^= bits
    return b"-----BEGIN CERTIFICATE REQUEST-----\n" + base64.encodebytes(bytes(der)) + b"-----END CERTIFICATE REQUEST-----\n"


@pytest.mark.parametrize("unused_bits", range(1, 8))
def test_csr_whose_signature_declares_unused_bits_is_refused(unused_bits):
    """Found by the fuzz below: cryptography verifies the signature's bytes whatever the BIT
    STRING's unused-bit count says, so a request with that byte set was accepted as a second
    encoding of the valid one."""
    import base64

    from cryptography import x509

    csr = x509.load_pem_x509_csr(_VALID_CSR)
    der = bytearray(csr.public_bytes(_der()))
    signature = csr.signature
    at = len(der) - len(signature) - 1  # the unused-bits octet sits just before the signature
    assert der[at] == 0 and bytes(der[at + 1 :]) == signature
    der[at] = unused_bits
    der[-1] &= (0xFF << unused_bits) & 0xFF  # the declared unused bits are zero, as BER wants them
    pem = b"-----BEGIN CERTIFICATE REQUEST-----\n" + base64.encodebytes(bytes(der)) + b"-----END CERTIFICATE REQUEST-----\n"
    with pytest.raises(SecurityError, match="unused bits|signature is invalid|does not parse"):
        E.check_node_csr(pem, "node-a", SANS)
    E.check_node_csr(_VALID_CSR, "node-a", SANS)


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=2048),
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=3).map(_armoured_der_mutation),
    )
)
def test_csr_check_refuses_any_damaged_request_with_its_own_error(data):
    """It found three untyped escapes (an unknown curve at public_key(), a bad version at load, an
    unknown string tag in the subject: KeyError); 60,000 random DER mutations run clean now."""
    try:
        E.check_node_csr(data, "node-a", SANS)
    except SecurityError:
        return
    from cryptography import x509

    # accepted: then it must be the valid request itself (a flip in an unused bit, say)
    assert x509.load_pem_x509_csr(data).public_bytes(_der()) == x509.load_pem_x509_csr(_VALID_CSR).public_bytes(_der())


def _der():
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.DER


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["certificate_pem", "ca_pem", "x"]), st.one_of(st.text(max_size=200), st.integers(), st.none()), max_size=3))
def test_install_refuses_any_malformed_bundle_before_writing(tmp_path_factory, bundle):
    d = tmp_path_factory.mktemp("n")
    nodeside.keygen(str(d), "node-a", 1, SANS)
    with pytest.raises(OnboardError):
        nodeside.install(str(d), 1, bundle)
    assert not (d / "tls").exists()


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_remote_output_that_is_not_json_is_a_typed_refusal(out):
    from kvpack.onboard.hosts import run_json
    from kvpack.onboard.ssh import Completed

    class Fake:
        name, node_dir = "n", "/x"

        def where(self):
            return "test"

        def kvpack(self, args, *, stdin=None, timeout_s=0):
            return Completed(0, out, b"")

    try:
        value = run_json(Fake(), ["node-local", "status"])
    except OnboardError as exc:
        assert exc.category == "ssh"
    else:
        assert json.dumps(value) is not None


def test_run_lock_admits_one_wizard_per_node(tmp_path):
    # the lock is kvpack.vocab.FileLock: a second wizard is refused, and a free lock reads as
    # "not held elsewhere" (node show: interrupted rather than running)
    from kvpack.errors import OnboardError
    from kvpack.onboard.state import RunLock

    first = RunLock(str(tmp_path), "n1").acquire()
    assert RunLock(str(tmp_path), "n1").held_elsewhere()
    with pytest.raises(OnboardError) as info:
        RunLock(str(tmp_path), "n1").acquire()
    assert info.value.category == "state"
    first.release()
    assert not RunLock(str(tmp_path), "n1").held_elsewhere()
    with RunLock(str(tmp_path), "n1"):
        pass
