"""``kvpack node add``: the onboarding stage pipeline, resumable, with revocation on failure.

Stages (:data:`.state.STAGES`), each with a progress label, a receipt and a durable record:

1. ``preflight``  SSH with the pinned host key; the node's kvpack version and engine
   identity (``node-local preflight``); the identity's recipe (none: refused); the ledger
   volume (``kvpack probe-volume`` on the node's ``state/``).
2. ``keygen``     ``node-local keygen``: the key is born in ``staging/v<N>`` on the node.
3. ``sign``       the CSR is checked (key type, subject, SANs) and signed by the cluster CA.
4. ``install``    certificate and CA to the node (checked there against the staged key);
                  pair epochs recorded durably, then fresh HMAC keys to both ends over SSH.
5. ``configs``    node and peer configs, each validated by the machine that will load it.
6. ``start``      the node's daemon as a managed unit (and its producer peers restarted).
7. ``qualify``    the identity's recipe: three exchanges (:mod:`.qualify`).
8. ``healthy``    the node and its pairs enter the registry; ``state=healthy``.

Trust reaches peers only from ``install`` on, and the registry (what ``enroll`` and every
later config derive from) only at ``healthy``. A failure from ``install`` on *revokes*: the
pair keys and configs of the pending pairs are removed from the peers (admin-side peers
always; remote peers best effort, each outcome recorded), the node's daemons are stopped,
and those stages run again on resume (with fresh keys under new epochs). A wizard killed
anywhere leaves ``running:<stage>``; re-running it resumes at the first stage not done, and
every stage is idempotent, so a node ends with one key whatever happened.

Failure points for crash tests: ``KVPACK_FAILPOINTS="onboard.<stage>.begin=kill"`` and the
mid-stage points named in :data:`FAILPOINTS`.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import kvpack

from ..errors import KvpackError, OnboardError, SecurityError
from ..security.enroll import COUNTERPART, NAME_RE, Cluster, is_remote, key_id_for, node_sans, producer_config_json, receiver_config_json
from . import qualify as Q
from . import recipe as R
from . import state as S
from .hosts import LocalHost, NodeHost, SshHost, run_json
from .ssh import SshTarget, fingerprint, lookup_host_keys, parse_destination

FAILPOINTS = (
    "onboard.<stage>.begin",
    "onboard.keygen.remote",
    "onboard.install.node",
    "onboard.install.pair",
    "onboard.configs.node",
    "onboard.start.node",
    "onboard.qualify.exchange",
    "onboard.healthy.registry",
)
LONG_S = 1800.0  # model loads and daemon starts on a loaded 2-core node


def failpoint(name: str) -> None:
    """SIGKILL this process at ``name`` when ``KVPACK_FAILPOINTS`` says ``name=kill``."""
    for item in os.environ.get("KVPACK_FAILPOINTS", "").split(";"):
        key, _, action = item.partition("=")
        if key.strip() == name and action.strip() == "kill":
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class AddOptions:
    cluster: str
    name: str
    role: str
    destination: str  # USER@HOST
    ssh_port: int = 22
    known_hosts: str | None = None
    ssh_key: str | None = None
    node_dir: str | None = None  # on the node; default kvpack/<name> under the login's home
    engine: str = "smollm2"
    threads: int = 2
    listen: str | None = None  # receiver: Handoff V2 listen address on the node
    control_listen: str | None = None  # producer: control listen address on the node
    peer: str | None = None
    sans: list[str] = field(default_factory=list)
    days: int = 365
    min_payload_gbps: float | None = None
    probe_max_tail_ms: float = 100.0
    remote_kvpack: str = "kvpack"

    #: fields that define the node: a re-run must not contradict them
    FIXED = ("role", "destination", "ssh_port", "node_dir", "engine", "threads", "listen", "control_listen", "peer", "sans", "days")


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class Wizard:
    """One ``kvpack node add`` run for one node."""

    def __init__(self, opts: AddOptions, *, progress: Callable[[str], None] | None = None) -> None:
        if not NAME_RE.fullmatch(opts.name or ""):
            raise OnboardError("usage", f"node name {opts.name!r} must be 1..60 of [a-z0-9-], starting and ending alphanumeric")
        if opts.role not in COUNTERPART:
            raise OnboardError("usage", f"role must be producer or receiver, got {opts.role!r}")
        self.opts = opts
        self.cluster = Cluster.open(opts.cluster)
        self.root = self.cluster.root
        self.dir = S.onboard_dir(self.root, opts.name)
        self.progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
        self.rec: dict[str, Any] = {}
        self._node: SshHost | None = None

    # -- driver ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        with S.RunLock(self.root, self.opts.name):
            self.rec = self._load_or_create()
            if self.rec["state"] == "healthy":
                self.progress(f"{self.opts.name}: already healthy")
                return self.rec
            while (stage := S.next_stage(self.rec)) is not None:
                self._run_stage(stage)
            self.progress(f"{self.opts.name}: state=healthy")
            return self.rec

    def _load_or_create(self) -> dict[str, Any]:
        o = self.opts
        rec = S.load(self.root, o.name)
        asked = {k: getattr(o, k) for k in AddOptions.FIXED}
        if rec is not None and rec["state"] != "removed":
            differs = {k: (rec["options"].get(k), v) for k, v in asked.items() if rec["options"].get(k) != v}
            if differs:
                raise OnboardError(
                    "usage", f"node {o.name!r} is being onboarded with other settings {differs} (recorded, asked): 'kvpack node remove' it first"
                )
            return rec
        if o.name in self.cluster.registry["nodes"]:
            raise OnboardError("usage", f"node {o.name!r} is already enrolled: 'kvpack node remove' it first")
        user, host = parse_destination(o.destination)
        version = 1 if rec is None else int(rec.get("key_version", 0)) + 1
        target = {"user": user, "host": host, "port": o.ssh_port, "node_dir": o.node_dir or f"kvpack/{o.name}", "alias": f"kvpack-node-{o.name}"}
        fresh = S.new_record(o.name, o.role, target, asked, key_version=version, now_ms=_now_ms())
        if rec is not None:
            # a node that was removed comes back with a new key (staging/v<N+1>) and new pair
            # epochs (the registry retired the old ones)
            fresh["history"].append({"unix_ms": _now_ms(), "event": f"re-added after removal: key version {version}"})
        S.save(self.root, fresh)
        return fresh

    def _run_stage(self, stage: str) -> None:
        index = S.STAGES.index(stage) + 1
        self.progress(f"[{index}/{len(S.STAGES)}] {stage}: {S.LABELS[stage]} ...")
        S.begin(self.rec, stage, _now_ms())
        S.save(self.root, self.rec)
        failpoint(f"onboard.{stage}.begin")
        attempt = self.rec["stages"][stage]["attempts"]
        t0 = time.perf_counter()
        try:
            facts = getattr(self, f"_stage_{stage}")()
        except Exception as exc:  # noqa: BLE001 - every failure is recorded with its stage
            category, reason = _classify(exc)
            body = {
                "stage": stage,
                "label": S.LABELS[stage],
                "outcome": "failed",
                "category": category,
                "reason": reason,
                "seconds": round(time.perf_counter() - t0, 3),
            }
            receipt = S.write_receipt(self.root, self.opts.name, stage, attempt, body)
            S.fail(self.rec, stage, category, reason, _now_ms(), receipt)
            if stage in S.TRUST_STAGES:
                self.rec["revocation"] = self._revoke()
                S.reopen_trust_stages(self.rec, _now_ms())
            S.save(self.root, self.rec)
            self.progress(f"[{index}/{len(S.STAGES)}] {stage}: FAILED ({category}): {reason}")
            if isinstance(exc, OnboardError):
                raise
            raise OnboardError(category, reason) from exc
        body = {"stage": stage, "label": S.LABELS[stage], "outcome": "done", "seconds": round(time.perf_counter() - t0, 3), **facts}
        receipt = S.write_receipt(self.root, self.opts.name, stage, attempt, body)
        S.finish(self.rec, stage, receipt, _now_ms())
        S.save(self.root, self.rec)
        self.progress(f"[{index}/{len(S.STAGES)}] {stage}: done ({time.perf_counter() - t0:.1f} s)")

    # -- hosts ------------------------------------------------------------------------------------------
    def _target(self, rec: dict[str, Any], known_hosts_file: str, ssh_key: str | None) -> SshTarget:
        t = rec["target"]
        return SshTarget(t["alias"], t["user"], t["host"], int(t["port"]), tuple(t.get("host_keys") or ()), known_hosts_file, ssh_key)

    @property
    def node(self) -> SshHost:
        if self._node is None:
            t = self.rec["target"]
            target = self._target(self.rec, os.path.join(self.dir, "known_hosts"), self.opts.ssh_key)
            self._node = SshHost(self.opts.name, t.get("node_dir_abs") or t["node_dir"], target, tuple(shlex.split(self.opts.remote_kvpack)))
        return self._node

    def peer_host(self, name: str) -> NodeHost:
        """How to run commands on an enrolled peer: SSH for an onboarded node (its own pinned
        host key and recorded login), this machine for an offline node."""
        entry = self.cluster.registry["nodes"][name]
        if not is_remote(entry):
            return LocalHost(name, self.cluster.node_dir(name))
        prec = S.load(self.root, name)
        if prec is None:
            raise OnboardError("state", f"peer {name!r} is onboarded but its onboarding record is missing")
        target = self._target(prec, os.path.join(S.onboard_dir(self.root, name), "known_hosts"), prec["options"].get("ssh_key") or self.opts.ssh_key)
        remote_kvpack = tuple(shlex.split(prec["options"].get("remote_kvpack") or self.opts.remote_kvpack))
        return SshHost(name, entry["remote"]["node_dir"], target, remote_kvpack)

    def _counterparts(self) -> list[str]:
        role = COUNTERPART[self.opts.role]
        return sorted(n for n, e in self.cluster.registry["nodes"].items() if e["role"] == role)

    # -- stages -----------------------------------------------------------------------------------------
    def _stage_preflight(self) -> dict[str, Any]:
        o, rec = self.opts, self.rec
        identity = self.cluster.registry.get("default_identity")
        if not identity:
            raise OnboardError("identity", "the cluster has no model identity: 'kvpack enroll init DIR --identity FILE' first")
        recipe = R.recipe_for(identity)
        if o.min_payload_gbps is not None:
            recipe = recipe.with_floor(o.min_payload_gbps)
        peer = self._choose_peer()
        known = o.known_hosts or os.path.expanduser("~/.ssh/known_hosts")
        keys = lookup_host_keys(known, rec["target"]["host"], int(rec["target"]["port"]))
        rec["target"].update(host_keys=keys, host_key_sha256=[fingerprint(k) for k in keys], known_hosts_source=os.path.abspath(known))
        rec["options"]["ssh_key"] = o.ssh_key
        rec["options"]["remote_kvpack"] = o.remote_kvpack
        self._node = None
        self.node.target.write_known_hosts()
        report = run_json(self.node, ["node-local", "preflight", "--dir", rec["target"]["node_dir"]])
        if report.get("kvpack_version") != kvpack.__version__:
            raise OnboardError("version", f"the node runs kvpack {report.get('kvpack_version')!r}, this machine {kvpack.__version__!r}")
        # the node's own `kvpack identity` of the engine it will run (loads its model)
        theirs = run_json(self.node, ["identity", "--engine", o.engine, "--threads", str(o.threads), "--json"], timeout_s=LONG_S)
        report["identity"] = theirs
        report["vocab_size"] = (theirs.get("layout") or {}).get("vocab_size")
        if theirs.get("identity") != identity["identity"] or theirs.get("target_cache_identity_sha256") != identity["target_cache_identity_sha256"]:
            raise OnboardError("identity", f"the node's {o.engine} (threads {o.threads}) is not the cluster's identity ({_identity_diff(identity, theirs)})")
        state_dir = os.path.join(report["dir"], "state")
        probe = run_json(self.node, ["probe-volume", state_dir, "--json", "--max-tail-ms", repr(o.probe_max_tail_ms)], timeout_s=600, ok_codes=(0, 1))
        if not probe.get("ok"):
            raise OnboardError(
                "volume",
                f"the node's ledger volume {state_dir} failed the probe: worst of {probe.get('iterations')} reservations {probe.get('max_ms')} ms > {o.probe_max_tail_ms:g} ms (median {probe.get('median_ms')} ms)",
            )
        rec["target"]["node_dir_abs"] = report["dir"]
        self._node = None
        rec["pending"].update(identity=identity, recipe=recipe.to_json(), peer=peer, vocab_size=report.get("vocab_size"))
        return {"node": report, "probe": probe, "recipe": recipe.to_json(), "peer": peer, "host_key_sha256": rec["target"]["host_key_sha256"]}

    def _choose_peer(self) -> str:
        peers = self._counterparts()
        want = COUNTERPART[self.opts.role]
        if self.opts.peer is not None:
            if self.opts.peer not in peers:
                raise OnboardError("usage", f"--peer {self.opts.peer!r} is not an enrolled {want}")
            return self.opts.peer
        if not peers:
            raise OnboardError("usage", f"no enrolled {want} to qualify a {self.opts.role} against: enroll or add one first")
        if len(peers) > 1:
            raise OnboardError("usage", f"several {want}s are enrolled ({peers}): name the qualification peer with --peer")
        return peers[0]

    def _stage_keygen(self) -> dict[str, Any]:
        sans = node_sans(self.opts.name, self.opts.sans)
        version = int(self.rec["key_version"])
        args = ["node-local", "keygen", "--dir", self.node.node_dir, "--name", self.opts.name, "--version", str(version)]
        for san in sans:
            args += ["--san", san]
        out = run_json(self.node, args)
        failpoint("onboard.keygen.remote")
        csr = out.get("csr_pem")
        if not isinstance(csr, str) or len(csr) > 16384:
            raise OnboardError("csr", "the node returned no CSR")
        from ..durable import atomic_write

        atomic_write(os.path.join(self.dir, "node.csr"), csr.encode(), mode=0o644)
        self.rec["pending"].update(sans=sans, public_key_sha256=out.get("public_key_sha256"))
        return {
            "key_version": version,
            "key_created": out.get("created"),
            "public_key_sha256": out.get("public_key_sha256"),
            "staged_versions": out.get("staged_versions"),
        }

    def _stage_sign(self) -> dict[str, Any]:
        from ..durable import atomic_write
        from ..security.enroll import cert_pem, cert_sha256

        with open(os.path.join(self.dir, "node.csr"), "rb") as fh:
            csr_pem = fh.read(16385)
        pending = self.rec["pending"]
        try:
            cert, _ca = self.cluster.sign_node_csr(self.opts.name, csr_pem, pending["sans"], days=self.opts.days)
        except SecurityError as exc:
            raise OnboardError("csr", exc.message) from None
        from .nodeside import _public_sha256

        if _public_sha256(cert.public_key()) != pending.get("public_key_sha256"):
            raise OnboardError("csr", "the CSR's key is not the key the node reported at keygen")
        atomic_write(os.path.join(self.dir, "node.crt"), cert_pem(cert), mode=0o644)
        pending.update(leaf_sha256=cert_sha256(cert), not_after=cert.not_valid_after_utc.isoformat())
        return {"leaf_sha256": pending["leaf_sha256"], "not_after": pending["not_after"], "sans": pending["sans"]}

    def _stage_install(self) -> dict[str, Any]:
        with open(os.path.join(self.dir, "node.crt"), "rb") as fh:
            cert = fh.read(65536).decode()
        bundle = json.dumps({"certificate_pem": cert, "ca_pem": self.cluster.ca_certificate_pem().decode()}).encode()
        pins = run_json(self.node, ["node-local", "install", "--dir", self.node.node_dir, "--version", str(self.rec["key_version"])], stdin=bundle)
        if pins.get("leaf_sha256") != self.rec["pending"]["leaf_sha256"]:
            raise OnboardError("install", "the node installed another certificate than the one signed")
        failpoint("onboard.install.node")
        pairs = self._next_pairs()
        self.rec["pending"]["pairs"] = pairs
        S.save(self.root, self.rec)  # epochs durable before any key of theirs exists
        for pair in pairs:
            material = (secrets.token_bytes(32).hex() + "\n").encode()
            for n, host in enumerate((self.node, self.peer_host(self._other(pair)))):
                run_json(host, ["node-local", "put-secret", "--dir", host.node_dir, "--key-id", pair["key_id"]], stdin=material)
                if n == 0:
                    failpoint("onboard.install.pair")
            del material
        return {"pins": pins, "pairs": pairs}

    def _other(self, pair: dict[str, Any]) -> str:
        return pair["receiver"] if pair["producer"] == self.opts.name else pair["producer"]

    def _next_pairs(self) -> list[dict[str, Any]]:
        """One pair per enrolled counterpart, each at an epoch above every epoch it ever had."""
        before = {p["key_id"]: int(p["epoch"]) for p in self.rec["pending"].get("pairs") or []}
        pairs = []
        for other in self._counterparts():
            producer, receiver = (self.opts.name, other) if self.opts.role == "producer" else (other, self.opts.name)
            key_id = key_id_for(producer, receiver)
            epoch = max(self.cluster.next_pair_epoch(producer, receiver), before.get(key_id, 0) + 1)
            pairs.append({"producer": producer, "receiver": receiver, "key_id": key_id, "epoch": epoch})
        return pairs

    def entry(self) -> dict[str, Any]:
        """The registry entry this node gets when it is healthy (and the view configs use)."""
        o, rec, pending = self.opts, self.rec, self.rec["pending"]
        t = rec["target"]
        entry: dict[str, Any] = {
            "role": o.role,
            "pki_generation": int(rec["key_version"]),
            "days": o.days,
            "sans": pending["sans"],
            "leaf_sha256": pending["leaf_sha256"],
            "not_after": pending["not_after"],
            "engine": {"spec": o.engine, "threads": o.threads},
            "remote": {
                "user": t["user"],
                "host": t["host"],
                "port": int(t["port"]),
                "node_dir": t["node_dir_abs"],
                "host_keys": t["host_keys"],
                "host_key_sha256": t["host_key_sha256"],
            },
        }
        if o.role == "receiver":
            from ..security.enroll import DEFAULT_RECEIVER_LISTEN

            entry.update(listen=o.listen or DEFAULT_RECEIVER_LISTEN, identity=pending["identity"], serves=pending["peer"])
        else:
            from ..security.enroll import DEFAULT_CONTROL_LISTEN

            entry["control_listen"] = o.control_listen or DEFAULT_CONTROL_LISTEN
        return entry

    def _config_targets(self, nodes: dict[str, Any], pairs: list[dict[str, Any]], *, include_node: bool) -> list[tuple[str, str, dict[str, Any] | None]]:
        """(node, config file, body or None for 'remove') for the new node and its peers."""
        name, out = self.opts.name, []
        mine = [p for p in self.rec["pending"].get("pairs") or []]
        if self.opts.role == "producer":
            if include_node:
                out.append((name, "producer.json", producer_config_json(nodes, pairs, name)))
            for p in mine:
                body = receiver_config_json(nodes, p) if name in nodes and p in pairs else None
                out.append((p["receiver"], f"receiver.{name}.json", body))
        else:
            if include_node:
                out += [(name, f"receiver.{p['producer']}.json", receiver_config_json(nodes, p)) for p in mine]
            for p in mine:
                out.append((p["producer"], "producer.json", producer_config_json(nodes, pairs, p["producer"])))
        return out

    def _stage_configs(self) -> dict[str, Any]:
        from ..durable import atomic_write, ensure_dir

        nodes = copy.deepcopy(self.cluster.registry["nodes"])
        nodes[self.opts.name] = self.entry()
        pairs = [p for p in self.cluster.registry["pairs"]] + list(self.rec["pending"]["pairs"])
        written = []
        for node, filename, body in self._config_targets(nodes, pairs, include_node=True):
            host = self.node if node == self.opts.name else self.peer_host(node)
            data = json.dumps(body, indent=2, sort_keys=True).encode() + b"\n"
            out = run_json(host, ["node-local", "put-config", "--dir", host.node_dir, "--name", filename], stdin=data)
            ensure_dir(os.path.join(self.dir, "configs", node), mode=0o700)
            atomic_write(os.path.join(self.dir, "configs", node, filename), data, mode=0o644)  # public: secrets are paths
            written.append({"node": node, "where": host.where(), "file": filename, "sha256": out.get("sha256")})
            if node == self.opts.name:
                failpoint("onboard.configs.node")
        return {"configs": written}

    def unit_fields(self) -> tuple[str, dict[str, Any]]:
        o = self.opts
        if o.role == "producer":
            return "producer", {"role": "producer", "config": "producer.json", "engine": o.engine, "threads": o.threads}
        fields = {"role": "receiver", "config": f"receiver.{self.rec['pending']['peer']}.json", "engine": o.engine, "threads": o.threads}
        # the daemon's own ledger-volume gate at the limit the operator gave the preflight probe
        return "receiver", {**fields, "ledger_max_tail_ms": o.probe_max_tail_ms}

    def producer_fields(self, producer: str) -> dict[str, Any]:
        """How a producer peer's managed unit runs: its recorded engine (an onboarded node),
        else this run's (an offline node of the same identity runs the same engine)."""
        engine = self.cluster.registry["nodes"].get(producer, {}).get("engine") or {}
        return {
            "role": "producer",
            "config": "producer.json",
            "engine": engine.get("spec", self.opts.engine),
            "threads": engine.get("threads", self.opts.threads),
        }

    def start_unit(self, host: NodeHost, unit: str, fields: dict[str, Any], *, restart: bool = True, if_running: bool = False) -> dict[str, Any]:
        args = ["node-local", "daemon", "start", "--dir", host.node_dir, "--unit", unit, "--role", fields["role"], "--config", fields["config"]]
        args += ["--engine", fields["engine"], "--threads", str(fields["threads"])]
        if fields.get("no_store"):
            args.append("--no-store")
        if fields.get("listen"):
            args += ["--listen", fields["listen"]]
        if fields.get("receipts"):
            args += ["--receipts", fields["receipts"]]
        if fields.get("ledger_max_tail_ms") is not None:
            args += ["--ledger-max-tail-ms", repr(float(fields["ledger_max_tail_ms"]))]
        if restart:
            args.append("--restart")
        if if_running:
            args.append("--if-running")
        return run_json(host, args, timeout_s=LONG_S)

    def stop_unit(self, host: NodeHost, unit: str) -> dict[str, Any]:
        return run_json(host, ["node-local", "daemon", "stop", "--dir", host.node_dir, "--unit", unit], timeout_s=300)

    def _stage_start(self) -> dict[str, Any]:
        unit, fields = self.unit_fields()
        ready = self.start_unit(self.node, unit, fields)
        failpoint("onboard.start.node")
        peers = []
        if self.opts.role == "receiver":
            # producers load their receivers at start: restart them with the new config (the
            # qualification peer always; the others only if they are running now)
            for p in self.rec["pending"]["pairs"]:
                host = self.peer_host(p["producer"])
                out = self.start_unit(host, "producer", self.producer_fields(p["producer"]), if_running=p["producer"] != self.rec["pending"]["peer"])
                peers.append({"node": p["producer"], "where": host.where(), "running": out.get("running"), "ready": out.get("ready")})
        return {"unit": unit, "ready": ready.get("ready"), "pid": ready.get("pid"), "argv": ready.get("argv"), "peers": peers}

    def _pairing(self) -> Q.Pairing:
        o, pending = self.opts, self.rec["pending"]
        if o.role == "receiver":
            unit, fields = self.unit_fields()
            return Q.Pairing(self.node, unit, fields, transient=False)
        peer = pending["peer"]
        listen_host = self.cluster.registry["nodes"][peer]["listen"].rsplit(":", 1)[0]
        fields = {
            "role": "receiver",
            "config": f"receiver.{o.name}.json",
            "engine": o.engine,
            "threads": o.threads,
            "no_store": True,
            "listen": f"{listen_host}:0",
            "ledger_max_tail_ms": o.probe_max_tail_ms,
        }
        unit = f"qualify-{o.name}"
        fields["receipts"] = unit
        return Q.Pairing(self.peer_host(peer), unit, fields, transient=True)

    def _stage_qualify(self) -> dict[str, Any]:
        pending = self.rec["pending"]
        recipe = R.parse_recipe(
            {k: pending["recipe"][k] for k in ("recipe", "logits", "min_payload_gbps", "seed")}, "recorded recipe", source=pending["recipe"]["source"]
        )
        if self.opts.min_payload_gbps is not None and self.opts.min_payload_gbps != recipe.min_payload_gbps:
            recipe = recipe.with_floor(self.opts.min_payload_gbps)  # the operator re-ran with another floor
        vocab = pending.get("vocab_size")
        if not isinstance(vocab, int):
            raise OnboardError("state", "the node's vocabulary size was not recorded at preflight")
        prompts = R.prompts(recipe, vocab)
        attempt = self.rec["stages"]["qualify"]["attempts"]
        out_dir = os.path.join(self.dir, "qualify", f"attempt-{attempt}")
        cache = os.path.join(self.root, "onboard", "references")
        refs = Q.in_background(Q.reference_runs, cache, pending["identity"], recipe, self.opts.engine, self.opts.threads, prompts)
        summary = Q.run(
            self._pairing(),
            recipe,
            prompts,
            refs,
            out_dir,
            start_unit=lambda p: self.start_unit(p.receiver_host, p.unit, p.unit_fields),
            stop_unit=lambda p: self._best_effort(self.stop_unit, p.receiver_host, p.unit),
            after_exchange=lambda i: failpoint("onboard.qualify.exchange"),
        )
        summary["dir"] = os.path.relpath(out_dir, self.dir)
        self.rec["qualification"] = summary
        if not summary["ok"]:
            raise OnboardError("qualify", summary["reason"])
        return {"qualification": summary}

    def _stage_healthy(self) -> dict[str, Any]:
        entry = self.entry()
        try:
            self.cluster.commit_onboarded(self.opts.name, entry, list(self.rec["pending"]["pairs"]))
        except SecurityError as exc:
            raise OnboardError("state", exc.message) from None
        failpoint("onboard.healthy.registry")
        q = self.rec["qualification"] or {}
        return {"leaf_sha256": entry["leaf_sha256"], "pairs": self.rec["pending"]["pairs"], "median_bps": q.get("median_bps"), "rates_bps": q.get("rates_bps")}

    # -- revocation -------------------------------------------------------------------------------------
    def _best_effort(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return {"ok": True, "result": fn(*args, **kwargs)}
        except KvpackError as exc:
            return {"ok": False, "error": f"{exc.category}: {exc.message}"[:1000]}
        except Exception as exc:  # noqa: BLE001 - revocation reports, it never stops half way
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000]}

    def _revoke(self) -> dict[str, Any]:
        """Take back what the pending pairs put on peers; stop the node's daemons."""
        name, pending = self.opts.name, self.rec["pending"]
        self.cluster = Cluster.open(self.root)
        # Registry first: the node (if a crash left it committed) and its pairs leave it, the
        # pairs' epochs are retired, and offline (admin-side) peers' configs and key files are
        # rewritten or deleted by the registry code itself, synchronously.
        self.cluster.remove_node(name, also_retire=pending.get("pairs") or [])
        report: dict[str, Any] = {"unix_ms": _now_ms(), "admin_side": [], "remote": [], "node": []}
        nodes = self.cluster.registry["nodes"]

        def on(node: str, what: dict[str, Any], *args: str, stdin: bytes | None = None) -> None:
            host = self.peer_host(node)
            side = report["remote"] if isinstance(host, SshHost) else report["admin_side"]
            side.append({"node": node, **what, **self._best_effort(run_json, host, ["node-local", *args[:1], "--dir", host.node_dir, *args[1:]], stdin=stdin)})

        for node, filename, body in self._config_targets(nodes, self.cluster.registry["pairs"], include_node=False):
            if node in nodes:
                data = None if body is None else json.dumps(body, indent=2, sort_keys=True).encode() + b"\n"
                on(node, {"file": filename}, "remove-config" if data is None else "put-config", "--name", filename, stdin=data)
        for pair in pending.get("pairs") or []:
            other = self._other(pair)
            if other not in nodes:
                continue
            on(other, {"key_id": pair["key_id"]}, "remove-secret", "--key-id", pair["key_id"])
            if self.opts.role == "receiver":  # a running producer drops the revoked receiver now
                fields = self.producer_fields(other)
                side = report["remote"] if is_remote(nodes[other]) else report["admin_side"]
                side.append(
                    {"node": other, "restart": "producer", **self._best_effort(self.start_unit, self.peer_host(other), "producer", fields, if_running=True)}
                )
        if self.rec["target"].get("node_dir_abs"):
            report["node"].append({"unit": self.opts.role, **self._best_effort(self.stop_unit, self.node, self.opts.role)})
        if self.opts.role == "producer" and pending.get("peer") in nodes:
            unit = f"qualify-{name}"
            report["node"].append({"unit": unit, **self._best_effort(self.stop_unit, self.peer_host(pending["peer"]), unit)})
        report["admin_side_ok"] = all(item.get("ok") for item in report["admin_side"])
        return report


def _classify(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, OnboardError):
        return exc.category, exc.message
    if isinstance(exc, KvpackError):
        return ("install" if isinstance(exc, SecurityError) else "internal"), f"{type(exc).__name__} {exc.category}: {exc.message}"
    return "internal", f"{type(exc).__name__}: {exc}"


def _identity_diff(want: dict[str, Any], got: dict[str, Any]) -> str:
    if not got:
        return "the node reported none"
    diffs = [k for k in sorted(want["identity"]) if (got.get("identity") or {}).get(k) != want["identity"][k]]
    if want["target_cache_identity_sha256"] != got.get("target_cache_identity_sha256"):
        diffs.append("target_cache_identity_sha256")
    return "differs in " + ", ".join(diffs)


# -- list / show / remove ----------------------------------------------------------------------------


def node_summaries(cluster_root: str) -> list[dict[str, Any]]:
    """Every node the admin knows: registry entries and onboarding records, one row each
    (the status page reads the same files)."""
    cluster = Cluster.open(cluster_root)
    names = set(cluster.registry["nodes"])
    base = os.path.join(cluster.root, "onboard")
    if os.path.isdir(base):
        names |= {n for n in os.listdir(base) if NAME_RE.fullmatch(n) and os.path.exists(S.record_path(cluster.root, n))}
    rows = []
    for name in sorted(names):
        entry = cluster.registry["nodes"].get(name)
        rec = S.load(cluster.root, name)
        state = rec["state"] if rec else "enrolled-offline"
        if rec and state.startswith("running:") and not S.RunLock(cluster.root, name).held_elsewhere():
            state = "interrupted:" + state.split(":", 1)[1]
        q = (rec or {}).get("qualification") or {}
        rows.append(
            {
                "name": name,
                "role": (entry or {}).get("role") or (rec or {}).get("role"),
                "state": state,
                "where": _where(entry, rec),
                "leaf_sha256": (entry or {}).get("leaf_sha256"),
                "median_gbps": q.get("median_gbps"),
                "failure": (rec or {}).get("failure"),
            }
        )
    return rows


def _where(entry: dict[str, Any] | None, rec: dict[str, Any] | None) -> str:
    if rec is not None:
        t = rec["target"]
        return f"{t['user']}@{t['host']}:{t['port']}"
    return "offline" if entry is not None else "?"


def remove(cluster_root: str, name: str, *, progress: Callable[[str], None] | None = None, ssh_key: str | None = None) -> dict[str, Any]:
    """Revoke a node: out of the registry (its pairs' epochs retired), off its peers' configs
    and key files, its daemons stopped; the record says ``removed`` (and is kept)."""
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    cluster = Cluster.open(cluster_root)
    rec = S.load(cluster.root, name)
    if rec is None and name not in cluster.registry["nodes"]:
        raise OnboardError("usage", f"no node named {name!r}")
    if rec is None:
        removed = cluster.remove_node(name)
        say(f"{name}: offline node removed from the registry ({len(removed)} pairs retired); its directory was left in place")
        return {"name": name, "state": "removed", "pairs": removed}
    with S.RunLock(cluster.root, name):
        opts = AddOptions(cluster_root, name, rec["role"], f"{rec['target']['user']}@{rec['target']['host']}", ssh_key=ssh_key or rec["options"].get("ssh_key"))
        for k in AddOptions.FIXED:
            if k in rec["options"]:
                setattr(opts, k, rec["options"][k])
        opts.remote_kvpack = rec["options"].get("remote_kvpack") or "kvpack"
        wiz = Wizard(opts, progress=say)
        wiz.rec = rec
        registry_pairs = [p for p in cluster.registry["pairs"] if name in (p["producer"], p["receiver"])]
        rec["pending"]["pairs"] = list({p["key_id"]: p for p in [*(rec["pending"].get("pairs") or []), *registry_pairs]}.values())
        report = wiz._revoke()
        rec["state"] = "removed"
        rec["revocation"] = report
        S._touch(rec, _now_ms(), "removed")
        S.save(cluster.root, rec)
        say(f"{name}: removed (admin side ok: {report['admin_side_ok']})")
        return rec
