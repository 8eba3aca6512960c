"""The qualification driver: three real Handoff V2 exchanges through the node daemons' CLIs.

The receiver side of the pair is a managed unit (:mod:`.units`) started fresh for the run, so
nothing it holds from before can turn an exchange into a local reuse: for a new producer, a
transient ``qualify-<producer>`` receiver on its peer (its own port, no store, its own
receipts); for a new receiver, its own daemon, restarted. Each exchange is ``kvpack request
--tokens-file - --max-new-tokens 256 --ignore-eos --json`` on the receiver's machine; the
payload rate comes from the receiver's receipt of that transfer (fetched with ``kvpack
node-local receipt``): its payload bytes over its wire time, the receiver's clock.

The references are local uninterrupted runs of the same prompts on the admin machine with
the same engine, computed once per identity, recipe and prompt set and kept in
``<cluster>/onboard/references/`` (a later node of the same identity reuses them). Every
exchange's reply and receipt is kept in ``onboard/<name>/qualify/<attempt>/``.

This module never decides what the verdict means for trust; the wizard does.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..durable import atomic_write, ensure_dir
from ..errors import OnboardError
from . import recipe as R
from .hosts import NodeHost, refusal_of, run_json

REQUEST_TIMEOUT_S = 3600.0


@dataclass
class Pairing:
    """Who plays which part in the exchanges."""

    receiver_host: NodeHost
    unit: str  # the receiver unit the exchanges go through
    unit_fields: dict[str, Any]  # units.build_argv fields for it
    transient: bool  # stop it afterwards (a qualify-<producer> unit on the peer)


def reference_runs(cache_dir: str, identity: dict[str, Any], recipe: R.Recipe, engine: str, threads: int, prompts: list[list[int]]) -> list[R.Reference]:
    """The local uninterrupted runs of ``prompts``: prefill P-1 tokens, the boundary token on
    its own (as the receiver computes it), then ``output_tokens`` greedy tokens; cached."""
    key = hashlib.sha256(
        json.dumps(
            {
                "identity": identity["identity"],
                "target": identity["target_cache_identity_sha256"],
                "recipe": [recipe.prompt_positions, recipe.output_tokens, recipe.seed],
                "engine": engine,
                "threads": threads,
                "prompts": R.prompts_digest(prompts),
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    path = os.path.join(cache_dir, f"{key}.json")
    cached = _load_references(path, len(prompts), recipe.output_tokens)
    if cached is not None:
        return cached
    from ..engine.registry import load_engine
    from ..node.common import greedy, logits_bytes
    from ..node.wire import identity_file_json

    eng = load_engine(engine, threads=threads)
    mine = identity_file_json(eng)
    if mine["identity"] != identity["identity"] or mine["target_cache_identity_sha256"] != identity["target_cache_identity_sha256"]:
        raise OnboardError("identity", f"the admin machine's {engine} (threads {threads}) is not the cluster identity: it cannot compute the reference runs")
    refs = []
    for prompt in prompts:
        session = eng.new_session()
        session.prefill(prompt[:-1])
        session.prefill(prompt[-1:])
        tokens, rows = greedy(session, recipe.output_tokens)
        refs.append(R.Reference(tuple(int(t) for t in tokens), hashlib.sha256(logits_bytes(rows)).hexdigest()))
        del session
    ensure_dir(cache_dir, mode=0o700)
    body = {"key": key, "engine": engine, "threads": threads, "references": [{"tokens": list(r.tokens), "logits_sha256": r.logits_sha256} for r in refs]}
    atomic_write(path, json.dumps(body, sort_keys=True).encode() + b"\n", mode=0o644)
    return refs


def _load_references(path: str, count: int, output_tokens: int) -> list[R.Reference] | None:
    try:
        with open(path, "rb") as fh:
            body = json.loads(fh.read(1 << 22))
        refs = [R.Reference(tuple(int(t) for t in r["tokens"]), str(r["logits_sha256"])) for r in body["references"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: recompute (it is a cache, never a trust anchor)
    if len(refs) != count or any(len(r.tokens) != output_tokens for r in refs):
        return None
    return refs


def _exchange(host: NodeHost, socket: str, prompt: list[int], recipe: R.Recipe, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run one exchange; return (the request's reply, the receiver's receipt of its transfer)."""
    args = [
        "request",
        "--socket",
        socket,
        "--tokens-file",
        "-",
        "--max-new-tokens",
        str(recipe.output_tokens),
        "--ignore-eos",
        "--json",
        "--timeout",
        str(int(REQUEST_TIMEOUT_S)),
    ]
    done = host.kvpack(args, stdin=json.dumps(prompt).encode(), timeout_s=REQUEST_TIMEOUT_S)
    if done.returncode != 0:  # the receiver refused: its verdict is the CLI's error line
        why = refusal_of(host, args, done)
        raise OnboardError("qualify", f"exchange {index + 1} was refused by the receiver: {why.message}")
    reply = run_json(host, args, stdin=None, timeout_s=1, replay=done)
    if not isinstance(reply, dict) or not reply.get("ok"):
        err = reply.get("error", {}) if isinstance(reply, dict) else {}
        raise OnboardError("qualify", f"exchange {index + 1} was refused by the receiver: {err.get('reason')}: {str(err.get('detail'))[:500]}")
    transfer = reply["result"].get("transfer") or {}
    path = transfer.get("receipt_path")
    if not isinstance(path, str):
        raise OnboardError("qualify", f"exchange {index + 1}: no handoff happened (plan {reply['result'].get('plan')})")
    receipt = run_json(host, ["node-local", "receipt", "--dir", host.node_dir, "--path", path])
    if receipt.get("verdict") != "committed":
        raise OnboardError("qualify", f"exchange {index + 1}: the receiver's receipt says {receipt.get('verdict')}: {receipt.get('reason')}")
    return reply, receipt


def exchange_of(reply: dict[str, Any], receipt: dict[str, Any]) -> R.Exchange:
    result = reply["result"]
    wire = (receipt.get("durations_s") or {}).get("wire")
    return R.Exchange(
        tokens=tuple(int(t) for t in result["tokens"]),
        logits_sha256=str(result["logits_sha256"]),
        action=str(result["plan"]["action"]),
        prefix_cut=int(receipt.get("prefix_cut") or 0),
        payload_bytes=int(receipt.get("payload_bytes") or 0),
        wire_s=float(wire) if isinstance(wire, (int, float)) else 0.0,
    )


def run(
    pairing: Pairing,
    recipe: R.Recipe,
    prompts: list[list[int]],
    refs: list[R.Reference],
    out_dir: str,
    *,
    start_unit: Callable[[Pairing], dict[str, Any]],
    stop_unit: Callable[[Pairing], Any],
    after_exchange: Callable[[int], None] = lambda i: None,
) -> dict[str, Any]:
    """Run the exchanges in order, stopping at the first that cannot pass; return the summary
    (raises ``OnboardError('qualify')`` with it recorded when the verdict is a failure)."""
    ensure_dir(out_dir, mode=0o700)
    ready = start_unit(pairing)
    socket = (ready.get("ready") or {}).get("socket")
    if not isinstance(socket, str):
        raise OnboardError("daemon", f"receiver unit {pairing.unit} reported no local API socket")
    got: list[R.Exchange] = []
    files = []
    t0 = time.perf_counter()
    try:
        for i, prompt in enumerate(prompts):
            reply, receipt = _exchange(pairing.receiver_host, socket, prompt, recipe, i)
            got.append(exchange_of(reply, receipt))
            name = f"exchange-{i + 1}.json"
            atomic_write(
                os.path.join(out_dir, name), json.dumps({"reply": reply, "receiver_receipt": receipt}, indent=2, sort_keys=True).encode() + b"\n", mode=0o644
            )
            files.append(name)
            after_exchange(i)
            v = R.verdict(recipe, refs, got)
            if not v.ok and (R.check_exchange(recipe, i, refs[i], got[-1]) is not None or R.rate_floor_lost(recipe, list(v.rates_bps))):
                break
    finally:
        if pairing.transient:
            stop_unit(pairing)
    v = R.verdict(recipe, refs, got)
    summary = {
        "recipe": recipe.to_json(),
        "prompts_sha256": R.prompts_digest(prompts),
        "receiver": pairing.receiver_host.name,
        "receiver_unit": pairing.unit,
        "exchanges": files,
        "payload_bytes": [g.payload_bytes for g in got],
        "wire_s": [round(g.wire_s, 6) for g in got],
        "seconds": round(time.perf_counter() - t0, 3),
        **v.to_json(),
    }
    atomic_write(os.path.join(out_dir, "summary.json"), json.dumps(summary, indent=2, sort_keys=True).encode() + b"\n", mode=0o644)
    return summary
