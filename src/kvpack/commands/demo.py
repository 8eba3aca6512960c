"""``kvpack demo``: disaggregated prefill with SmolLM2 on a throwaway loopback cluster.

One command, offline, no flags. It enrolls a cluster (CA, a decode node, a prefill node,
pins, pair HMAC key) in a temporary directory, starts the producer and the receiver on
127.0.0.1 (in-process threads, real sockets, mutual TLS 1.3), and then:

1. computes the local, uninterrupted reference: prefill of the prompt minus its boundary
   token, the boundary token, greedy decode -- the same computation order the handoff
   path performs (docs/engine.md, "Determinism");
2. asks the receiver for the same prompt: the producer prefills, streams sealed tiles,
   the receiver verifies, reserves, commits, decodes. Proof: tokens and every logits row
   identical to (1);
3. a follow-up prompt sharing a prefix: the receiver's resident tier arms a delta, the
   producer installs the prefix it computed before and prefills only the suffix. Proof:
   identical to its own local reference; fewer bytes and fewer prefilled tokens;
4. the follow-up's cut is saved to the receiver's pack store and restored in a new
   process, which decodes the same tokens.

``--json`` prints one object (``bit_exact``, ``full_bytes``, ``delta_bytes``,
``prefilled_tokens_full``, ``prefilled_tokens_delta``, ``payload_gbps`` (Gbit/s on the
wire while sending payload), ``ttft_s`` and the rest).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

DOCUMENT = (
    "kvpack moves the key-value cache of a language model between machines exactly and provably. "
    "A prefill node computes the cache for a prompt and streams it to a decode node in tiles. "
    "Every tile is hashed, and the whole stream is sealed with an HMAC over the canonical begin "
    "manifest, the segment descriptors and every payload byte. Mutual TLS 1.3 with pinned leaf "
    "certificates proves who is on the other end of the socket; the seal proves what was sent; "
    "and a durable replay ledger proves when it was sent, because a captured transfer that is "
    "replayed carries a generation the ledger has already reserved. The decode node writes each "
    "verified tile into a detached generation of its cache while the rest is still on the wire. "
    "Only after the seal verifies and the generation is reserved on disk does it swap the new "
    "cache in, atomically, and acknowledge. If anything fails before that point, nothing is "
    "installed and the live session is exactly as it was. When the decode node already holds a "
    "prefix of the prompt, aligned on a 256-token boundary, it asks for a delta: the producer "
    "computes and ships only the suffix, and the decode node proves at admission that the prefix "
    "it holds is token for token the one the producer built on. The ledger must live on the "
    "internal disk, because its reservation sits between the verified seal and the "
    "acknowledgement, so the tail latency of a slow volume is paid by random transfers. "
    "Receipts record every phase of every transfer, and metrics count transfers, bytes, "
    "refusals and ledger reservations, so an operator can see the system working."
)
QUESTION_1 = "In two sentences: what does the replay ledger prove, and why must it be durable?"
QUESTION_2 = "In one sentence: where must the ledger live, and why?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_reference(engine, tokens: list[int], n: int, stops) -> dict:
    from ..node.common import greedy, logits_bytes

    s = engine.new_session()
    t0 = time.perf_counter()
    s.prefill(tokens[:-1])
    s.prefill(tokens[-1:])
    ttft = time.perf_counter() - t0
    out, rows = greedy(s, n, stops)
    return {"tokens": out, "logits_sha256": hashlib.sha256(logits_bytes(rows)).hexdigest(), "ttft_s": ttft}


def _restore_child(store_dir: str, tokens_file: str, n: int) -> int:
    """Runs in a fresh process: restore the saved cut from the pack store and decode."""
    from ..node.common import greedy, load_engine, logits_bytes
    from ..store import PackStore

    engine = load_engine("smollm2")
    with open(tokens_file, encoding="utf-8") as fh:
        tokens = json.load(fh)
    store = PackStore.open(store_dir)
    hit = store.find_deepest(tokens, engine.layout, engine.identity.ids())
    if hit is None or hit.cut != len(tokens):
        print(json.dumps({"ok": False, "error": "no saved cut for the prompt"}))
        return 1
    s = engine.new_session()
    rep = store.restore(hit, s, tokens)
    eos = engine.tokenizer.eos_token_id
    out, rows = greedy(s, n, [eos] if eos is not None else ())
    print(
        json.dumps(
            {
                "ok": True,
                "cut": hit.cut,
                "restore_s": rep.seconds,
                "bytes_verified": rep.bytes_verified,
                "tokens": out,
                "logits_sha256": hashlib.sha256(logits_bytes(rows)).hexdigest(),
            }
        )
    )
    return 0


def _start_cluster(engine, tmp: str):
    """Enroll a throwaway cluster in ``tmp`` and start both nodes on loopback (real sockets, mTLS)."""
    from ..node.producer import ProducerNode
    from ..node.receiver import ReceiverNode
    from ..node.wire import identity_file_json
    from ..progress import status
    from ..security.config import load_producer_config, load_receiver_config
    from ..security.enroll import Cluster
    from ..store import PackStore

    with status("enrolling a throwaway cluster (CA, decode node, prefill node, pins, pair key) ..."):
        cluster = Cluster.init(os.path.join(tmp, "cluster"), identity=identity_file_json(engine))
        cluster.enroll_node("decode-a", "receiver", listen=f"127.0.0.1:{_free_port()}")
        cluster.enroll_node("prefill-a", "producer", control_listen=f"127.0.0.1:{_free_port()}")
        rcfg = load_receiver_config(cluster.receiver_config_path("decode-a", "prefill-a"))
        pcfg = load_producer_config(cluster.producer_config_path("prefill-a"))
        rstore = PackStore.init(os.path.join(tmp, "decode-store"))
        pstore = PackStore.init(os.path.join(tmp, "prefill-store"))
    producer = ProducerNode(pcfg, engine, receipts_dir=os.path.join(tmp, "prefill-receipts"), store=pstore).start()
    try:
        receiver = ReceiverNode(rcfg, engine, receipts_dir=os.path.join(tmp, "decode-receipts"), store=rstore, socket_path=None).start()
    except BaseException:
        producer.stop()
        raise
    return producer, receiver, rstore


def _full_handoff(engine, receiver, prompt: list[int], max_new_tokens: int, stops, say) -> dict:
    """Step 2: the receiver asks the producer for the whole prompt; proof against a local run."""
    from ..progress import status

    with status(f"local reference: prefill {len(prompt)} tokens and decode on one node ..."):
        ref = _local_reference(engine, prompt, max_new_tokens, stops)
    with status("disaggregated: control -> prefill -> sealed tiles over mTLS -> verify -> reserve -> commit -> decode ..."):
        got = receiver.generate(prompt, max_new_tokens, stop_token_ids=stops)
    transfer = got["transfer"]
    receipt = transfer["producer_receipt"] or {}
    exact = got["tokens"] == ref["tokens"] and got["logits_sha256"] == ref["logits_sha256"]
    wire_s = receipt.get("payload_wire_ns", 0) / 1e9
    gbps = transfer["payload_bytes"] * 8 / wire_s / 1e9 if wire_s else 0.0
    split = {
        "control_s": round(transfer["control_s"], 4),
        "prefill_s": round((receipt.get("prefill_end_unix_ns", 0) - receipt.get("prefill_start_unix_ns", 0)) / 1e9, 4),
        "wire_s": round(wire_s, 4),
        "verify_s": transfer["durations_s"].get("verify"),
        "reserve_s": transfer["durations_s"].get("reserve"),
        "commit_s": transfer["durations_s"].get("commit"),
        "boundary_s": got["boundary_s"],
    }
    answer = engine.decode(got["tokens"]).strip()
    say(f"\nQ1 ({len(prompt)} prompt tokens): {QUESTION_1}\nA1: {answer}")
    say(f"  bit-exact vs local decoding (tokens and {len(got['tokens'])} logits rows): {exact}")
    say(
        f"  full handoff: {transfer['payload_bytes']:,} B in {transfer['segments']} sealed tiles, {gbps:.2f} Gbit/s while sending; "
        f"producer prefilled {receipt.get('prefill_tokens')} tokens"
    )
    say(
        f"  TTFT {got['ttft_s']:.3f} s = "
        + ", ".join(f"{k[:-2]} {v:.4f}" for k, v in split.items() if v is not None)
        + " (prefill and wire overlap: tiles stream per chunk)"
    )
    return {
        "exact": exact,
        "answer": answer,
        "bytes": transfer["payload_bytes"],
        "prefilled": receipt.get("prefill_tokens"),
        "gbps": gbps,
        "split": split,
        "ttft_s": got["ttft_s"],
        "local_ttft_s": ref["ttft_s"],
    }


def _delta_handoff(engine, receiver, prompt: list[int], max_new_tokens: int, stops, say) -> dict:
    """Step 3: a follow-up sharing a prefix arms a delta and is saved to the decode node's store."""
    from ..progress import status

    with status(f"local reference for the follow-up ({len(prompt)} tokens) ..."):
        ref = _local_reference(engine, prompt, max_new_tokens, stops)
    with status("follow-up: resident prefix arms a delta; producer prefills only the suffix ..."):
        got = receiver.generate(prompt, max_new_tokens, save=True, stop_token_ids=stops)
    transfer = got["transfer"]
    receipt = transfer["producer_receipt"] or {}
    exact = got["tokens"] == ref["tokens"] and got["logits_sha256"] == ref["logits_sha256"]
    full_equiv = receiver.geometry.tile_bytes(len(prompt) - 1)
    prefilled = receipt.get("prefill_tokens", 0)
    say(f"\nQ2: {QUESTION_2}\nA2: {engine.decode(got['tokens']).strip()}")
    say(
        f"  delta handoff (prefix_cut {transfer['prefix_cut']}, {got['plan']['tier']} tier): {transfer['payload_bytes']:,} B "
        f"instead of {full_equiv:,} B ({100 * (1 - transfer['payload_bytes'] / full_equiv):.1f} % saved); producer "
        f"prefilled {prefilled} of {len(prompt) - 1} tokens ({len(prompt) - 1 - prefilled} not recomputed)"
    )
    say(f"  bit-exact vs local decoding: {exact}")
    return {
        "exact": exact,
        "tokens": got["tokens"],
        "logits_sha256": got["logits_sha256"],
        "bytes": transfer["payload_bytes"],
        "full_equivalent_bytes": full_equiv,
        "prefix_cut": transfer["prefix_cut"],
        "prefilled": prefilled,
        "saved": got["saved"],
        "ttft_s": got["ttft_s"],
    }


def _restore_in_new_process(store_dir: str, tmp: str, prompt: list[int], max_new_tokens: int, delta: dict, say) -> bool:
    """Step 4: a fresh process restores the saved cut and must decode exactly what the node did."""
    from ..progress import status

    tokens_file = os.path.join(tmp, "prompt2.json")
    with open(tokens_file, "w", encoding="utf-8") as fh:
        json.dump(prompt, fh)
    with status("restoring the saved cut in a new process and decoding ..."):
        child = subprocess.run(
            [sys.executable, "-m", "kvpack.commands.demo", "--restore-child", store_dir, tokens_file, str(max_new_tokens)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    try:
        restored = json.loads(child.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        restored = {"ok": False, "error": child.stderr[-2000:]}
    exact = bool(restored.get("ok")) and restored["tokens"] == delta["tokens"] and restored["logits_sha256"] == delta["logits_sha256"]
    say(
        f"  saved to the durable store ({delta['saved']['kind']} pack, cut {delta['saved']['cut']}); new process restored "
        f"{restored.get('bytes_verified', 0):,} verified bytes and decoded identically: {exact}"
    )
    return exact


def run_demo(max_new_tokens: int = 24, *, quiet: bool = False) -> dict:
    from ..generate import chat_tokens
    from ..node.common import load_engine
    from ..progress import status

    def say(msg: str) -> None:
        if not quiet:
            print(msg, flush=True)

    t_all = time.perf_counter()
    with status("loading SmolLM2-135M-Instruct (bundled GGUF, offline) ..."):
        engine = load_engine("smollm2")
    eos = engine.tokenizer.eos_token_id
    stops = [eos] if eos is not None else []
    tmp = tempfile.mkdtemp(prefix="kvpack-demo-")
    producer, receiver, rstore = _start_cluster(engine, tmp)
    say(
        f"cluster in {tmp}: producer control 127.0.0.1:{producer.control_port}, receiver data "
        f"127.0.0.1:{receiver.data_port}, metrics 127.0.0.1:{receiver.metrics.port} / :{producer.metrics.port}"
    )
    try:
        p1 = chat_tokens(engine, DOCUMENT + "\n\n" + QUESTION_1)
        p2 = chat_tokens(engine, DOCUMENT + "\n\n" + QUESTION_2)
        full = _full_handoff(engine, receiver, p1, max_new_tokens, stops, say)
        delta = _delta_handoff(engine, receiver, p2, max_new_tokens, stops, say)
        exact_restore = _restore_in_new_process(rstore.path, tmp, p2, max_new_tokens, delta, say)
        out = {
            "bit_exact": bool(full["exact"] and delta["exact"] and exact_restore),
            "bit_exact_full": full["exact"],
            "bit_exact_delta": delta["exact"],
            "bit_exact_restore_new_process": exact_restore,
            "answer": full["answer"],
            "prompt_tokens": len(p1),
            "followup_prompt_tokens": len(p2),
            "full_bytes": full["bytes"],
            "delta_bytes": delta["bytes"],
            "delta_full_equivalent_bytes": delta["full_equivalent_bytes"],
            "bytes_saved": delta["full_equivalent_bytes"] - delta["bytes"],
            "prefix_cut": delta["prefix_cut"],
            "prefilled_tokens_full": full["prefilled"],
            "prefilled_tokens_delta": delta["prefilled"],
            "tokens_not_recomputed": len(p2) - 1 - delta["prefilled"],
            "payload_gbps": round(full["gbps"], 3),
            "ttft_s": full["ttft_s"],
            "ttft_split_s": full["split"],
            "ttft_delta_s": delta["ttft_s"],
            "local_ttft_s": round(full["local_ttft_s"], 4),
            "receipts": {"receiver": len(receiver.receipts.all()), "producer": len(producer.receipts.all())},
            "cluster_dir": tmp,
            "seconds": round(time.perf_counter() - t_all, 2),
        }
        say(f"\nall proofs hold: {out['bit_exact']}  ({out['seconds']} s; receipts under {tmp})")
        return out
    finally:
        receiver.stop()
        producer.stop()


def cmd_demo(args: argparse.Namespace) -> int:
    out = run_demo(args.max_new_tokens, quiet=args.json)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    if not out["bit_exact"]:
        from ..cli_errors import CommandFailed

        failed = [k for k in ("bit_exact_full", "bit_exact_delta", "bit_exact_restore_new_process") if not out[k]]
        raise CommandFailed("not_exact", f"proof failed: {', '.join(failed)} (receipts under {out['cluster_dir']})")
    return 0


def register(sub) -> None:
    from ._args import int_range

    p = sub.add_parser("demo", help="disaggregated prefill with SmolLM2 on a throwaway loopback cluster, with proofs")
    p.add_argument("--max-new-tokens", type=int_range(1, 512, what="a token count"), default=24, help="tokens to decode per question")
    p.set_defaults(func=cmd_demo, extras=("engine", "node"))


if __name__ == "__main__":  # the restore child: python -m kvpack.commands.demo --restore-child STORE TOKENS N
    if len(sys.argv) == 5 and sys.argv[1] == "--restore-child":
        sys.exit(_restore_child(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    sys.exit(2)
