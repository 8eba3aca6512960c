"""The qualification driver: three real Handoff V2 exchanges through the node daemons' CLIs.

The receiver side of the pair is a managed unit (:mod:`.units`) started fresh for the run, so
nothing it holds from before can turn an exchange into a local reuse: for a new producer, a
transient ``qualify-<producer>`` receiver on its peer (its own port, no store, its own
receipts); for a new receiver, its own daemon, restarted. Each exchange is ``kvpack request
--tokens-file - --max-new-tokens 256 --ignore-eos --json`` on the receiver's machine; the
payload rate comes from the receiver's receipt of that transfer (fetched with ``kvpack
node-local receipt``): its payload bytes over its wire time, the receiver's clock.

The references are local uninterrupted runs of the same prompts on the admin machine with
the same engine, computed next to the exchanges (a worker thread; torch releases the GIL),
once per identity, recipe and prompt set, and kept in
``<cluster>/onboard/references/`` (a later node of the same identity reuses them). Every
exchange's reply and receipt is kept in ``onboard/<name>/qualify/<attempt>/``.

This module never decides what the verdict means for trust; the wizard does.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

from ..durable import atomic_write, ensure_dir
from ..errors import OnboardError
from . import recipe as R
from .hosts import NodeHost, refusal_of, run_json

REQUEST_TIMEOUT_S = 3600.0
REFERENCE_TIMEOUT_S = 3600.0


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


def in_background(fn: Callable[..., Any], *args: Any) -> Future:
    """Run ``fn(*args)`` on a daemon thread; its result or exception lands in the future. A
    daemon thread, so a failed qualification exits at once instead of waiting for the
    reference runs (their cache file is written atomically, so an abandoned one leaves none)."""
    import threading

    future: Future = Future()
    future.set_running_or_notify_cancel()

    def work() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
            future.set_exception(exc)

    threading.Thread(target=work, name="kvpack-reference-runs", daemon=True).start()
    return future


def _cannot_pass(recipe: R.Recipe, refs: list[R.Reference] | None, got: list[R.Exchange]) -> bool:
    """True once the verdict is settled as a failure: an exchange is inexact (known only once
    the references are there) or the rate median is lost."""
    if refs is not None and any(R.check_exchange(recipe, i, refs[i], g) is not None for i, g in enumerate(got)):
        return True
    return R.rate_floor_lost(recipe, [g.rate_bps for g in got])


def run(
    pairing: Pairing,
    recipe: R.Recipe,
    prompts: list[list[int]],
    refs: Future,
    out_dir: str,
    *,
    start_unit: Callable[[Pairing], dict[str, Any]],
    stop_unit: Callable[[Pairing], Any],
    after_exchange: Callable[[int], None] = lambda i: None,
) -> dict[str, Any]:
    """Run the exchanges in order while ``refs`` (a future of :func:`reference_runs`) is
    computed next to them, stopping as soon as the verdict cannot be a pass; return the
    summary (the caller raises ``OnboardError('qualify')`` when it is a failure).

    The references run concurrently because on a small host each exchange keeps one core busy
    at a time (the producer's prefill, then the receiver's decode); they are only needed for
    the verdict."""
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
            body = json.dumps({"reply": reply, "receiver_receipt": receipt}, indent=2, sort_keys=True).encode() + b"\n"
            atomic_write(os.path.join(out_dir, name), body, mode=0o644)
            files.append(name)
            after_exchange(i)
            if refs.done() and refs.exception() is not None:
                break  # the references failed: nothing can be verified, stop here
            if _cannot_pass(recipe, refs.result() if refs.done() else None, got):
                break
    finally:
        if pairing.transient:
            stop_unit(pairing)
    try:
        references = refs.result(timeout=REFERENCE_TIMEOUT_S)
    except FutureTimeout:
        raise OnboardError("qualify", f"the local reference runs did not finish within {REFERENCE_TIMEOUT_S:g} s") from None
    v = R.verdict(recipe, references, got)
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
