"""``kvpack store init|save|ls|show|verify|repair|forget|gc`` and ``kvpack generate``.

A store is a directory or ``s3://bucket/prefix`` (with ``--endpoint URL``; credentials from
the AWS environment variables or ``--s3-credentials FILE``, a 0600 file). Exit codes follow
docs/cli.md: 0 ok, 1 refused or problems found, 2 usage, 10 no store, 11 locked, 12 wrong key.
Failures are raised and printed by the CLI's error contract as one line on stderr
(``kvpack: <category>: <message>``), a full disk (ENOSPC) or an I/O error (EIO) included.
"""

from __future__ import annotations

import argparse
import json
import sys

from ._args import engine_spec, existing_file, int_range, max_new_tokens, not_a_file, threads


def _location_args(q: argparse.ArgumentParser, *, key: bool = True) -> None:
    q.add_argument("--endpoint", help="S3 endpoint URL for s3:// stores (or KVPACK_S3_ENDPOINT)")
    q.add_argument("--s3-credentials", type=existing_file, help="0600 file with the S3 access key id and secret (default: the AWS environment variables)")
    if key:
        q.add_argument("--root-key-file", type=existing_file, help="the 32-byte root key file (default: STORE/root.key; required for s3:// stores)")


STORE_HELP = "a store directory or s3://bucket/prefix"
CUT_HELP = "manifest id of the cut (64 hex digits as kvpack store ls prints them, or a unique prefix of at least 8)"


def cut_id(text: str) -> str:
    import re

    if not re.fullmatch(r"[0-9a-f]{8,64}", text or ""):
        raise argparse.ArgumentTypeError(f"must be a manifest id (8..64 lowercase hex digits), got {text!r}")
    return text


cut_id.__name__ = "manifest id"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="the pack store (a directory or s3://bucket/prefix)")
    ss = p.add_subparsers(dest="store_command", metavar="ACTION")
    ss.required = True

    q = ss.add_parser("init", help="create a store (a directory or s3://bucket/prefix)")
    q.add_argument("dir", metavar="STORE", type=not_a_file, help=STORE_HELP + " (created)")
    q.add_argument("--tenant", default="default", help="tenant name (scopes every key and id)")
    q.add_argument("--encrypt", action="store_true", help="encrypt chunks and manifests at rest (ChaCha20-Poly1305)")
    q.add_argument("--root-key-file", help="keep the 32-byte root here (created 0600 if missing) instead of STORE/root.key")
    q.add_argument("--chunk-bytes", type=int_range(1, 4 * 1024 * 1024, what="a chunk size"), default=2 * 1024 * 1024, help="chunk plaintext size in bytes")
    _location_args(q, key=False)
    q.set_defaults(func=cmd_init)

    q = ss.add_parser("save", help="prefill a prompt with the bundled model and save its cut and checkpoints")
    q.add_argument("dir", metavar="STORE", type=not_a_file, help=STORE_HELP)
    _location_args(q)
    q.add_argument("--prompt", required=True, help="user prompt (through the chat template unless --raw)")
    q.add_argument("--raw", action="store_true", help="tokenize the prompt as is (no chat template)")
    q.add_argument("--engine", type=engine_spec, default="smollm2", help=_spec_help())
    q.add_argument("--threads", type=threads, help="torch threads (part of the engine identity; default: the engine's)")
    q.set_defaults(func=cmd_save)

    for name, func, helptext in (
        ("ls", cmd_ls, "list committed cuts (full manifest ids, as store show takes them)"),
        ("gc", cmd_gc, "remove unreferenced objects"),
        ("repair", cmd_repair, "quarantine every cut that fails verify --read-data (with receipts) and drop malformed index entries"),
    ):
        q = ss.add_parser(name, help=helptext)
        q.add_argument("dir", metavar="STORE", type=not_a_file, help=STORE_HELP)
        _location_args(q)
        if name != "ls":
            _deadline_arg(q)
        if name == "gc":
            q.add_argument(
                "--wait",
                type=wait_seconds,
                help="seconds a directory store's gc waits for the store lock before it refuses (exit 11; default: KVPACK_GC_WAIT_S or 600)",
            )
        q.set_defaults(func=func)

    q = ss.add_parser("show", help="describe one cut (its pack chain, states, chunks)")
    q.add_argument("dir", metavar="STORE", type=not_a_file, help=STORE_HELP)
    q.add_argument("manifest_id", metavar="CUT", type=cut_id, help=CUT_HELP)
    _location_args(q)
    q.set_defaults(func=cmd_show)

    q = ss.add_parser("forget", help="remove the index entries of one cut (its objects become garbage for gc)")
    q.add_argument("dir", metavar="STORE", type=not_a_file, help=STORE_HELP)
    q.add_argument("manifest_id", metavar="CUT", type=cut_id, help=CUT_HELP)
    _location_args(q)
    _deadline_arg(q)
    q.set_defaults(func=cmd_forget)

    q = ss.add_parser("verify", help="check every committed cut (packs, index bindings; with --read-data every chunk byte)")
    q.add_argument("dir", metavar="STORE", type=not_a_file, help=STORE_HELP)
    q.add_argument("--read-data", action="store_true", help="read and verify every chunk byte (slow), not only the structure")
    _location_args(q)
    _deadline_arg(q)
    q.set_defaults(func=cmd_verify)

    p = sub.add_parser("generate", help="generate with the bundled model, reusing the deepest stored prefix")
    p.add_argument("--store", required=True, type=not_a_file, help="store directory (created if missing) or s3://bucket/prefix")
    p.add_argument("--prompt", required=True, help="user prompt (through the chat template unless --raw)")
    p.add_argument("--max-new-tokens", type=max_new_tokens, default=32, help="tokens to decode after the prompt")
    p.add_argument("--raw", action="store_true", help="tokenize the prompt as is (no chat template)")
    p.add_argument("--engine", type=engine_spec, default="smollm2", help=_spec_help())
    p.add_argument("--threads", type=threads, help="torch threads (part of the engine identity; default: the engine's)")
    p.add_argument("--no-save", action="store_true", help="do not save the prompt's cut to the store")
    _location_args(p)
    p.set_defaults(func=cmd_generate)


def _deadline_arg(q: argparse.ArgumentParser) -> None:
    q.add_argument(
        "--deadline",
        type=wait_seconds,
        help="seconds the whole command may take; past them it stops with one io line and exit 1, "
        "keeping what it had completed (default: KVPACK_MAINTENANCE_DEADLINE_S or 3600)",
    )


def _open_maintained(args, op: str):
    """The store of verify/repair/forget/gc, opened under the command's whole deadline
    (``--deadline``, else KVPACK_MAINTENANCE_DEADLINE_S or 3600 s), and that deadline."""
    from ..store.location import store_kwargs
    from ..store.maintenance import open_bounded

    return open_bounded(args.dir, op, deadline_s=args.deadline, **store_kwargs(args))


def _open(args):
    from ..store import PackStore
    from ..store.location import store_kwargs

    return PackStore.open(args.dir, **store_kwargs(args))


def cmd_init(args) -> int:
    from ..store import PackStore
    from ..store.location import store_kwargs

    kw = store_kwargs(args)
    store = PackStore.init(args.dir, tenant=args.tenant, encrypted=args.encrypt, chunk_bytes=args.chunk_bytes, **kw)
    if args.json:
        print(
            json.dumps({"store": store.path, "tenant": store.tenant_name, "epoch": store.epoch, "encrypted": store.encrypted, "chunk_bytes": store.chunk_bytes})
        )
        return 0
    print(f"initialised store {store.path} (tenant {store.tenant_name!r}, epoch {store.epoch}, {'encrypted' if store.encrypted else 'plain'})")
    return 0


def _spec_help() -> str:
    from ..engine.registry import SPEC_HELP

    return SPEC_HELP


def _engine(args):
    from ..engine.registry import load_engine
    from ..progress import status

    with status(f"loading engine {args.engine} ..."):
        return load_engine(args.engine, threads=args.threads)


def _open_or_init(args):
    from ..store.location import open_or_init, store_kwargs

    return open_or_init(args.store, **store_kwargs(args))


def _text_engine(args) -> None:
    """Refuse, before any store is opened or created, an engine that cannot tokenize the
    prompt these verbs take as text."""
    from ..engine.registry import parse_spec
    from ..errors import UsageError

    if not parse_spec(args.engine).tokenizes:
        raise UsageError(
            "usage", f"--engine {args.engine} has no tokenizer: this verb takes a text prompt (use --engine smollm2; token ids go through the node daemons)"
        )


def cmd_generate(args) -> int:
    from ..generate import chat_tokens, generate

    _text_engine(args)
    store = _open_or_init(args)
    engine = _engine(args)
    tokens = chat_tokens(engine, args.prompt, chat=not args.raw)
    result = generate(engine, store, tokens, max_new_tokens=args.max_new_tokens, save=not args.no_save)
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    print(result.text)
    for receipt in result.quarantined:
        print(f"-- quarantined a stored cut that failed verification ({receipt['problems'][0][:160]}); recomputed it", file=sys.stderr)
    if result.unreadable:
        print(
            f"-- {len(result.unreadable)} stored index entr{'y' if len(result.unreadable) == 1 else 'ies'} could not be read "
            f"({result.unreadable[0][:160]}); passed over as a miss and recomputed, nothing quarantined",
            file=sys.stderr,
        )
    print(
        f"-- reused {result.reused_tokens} tokens ({result.reused_bytes / 1e6:.1f} MB verified in {result.restore_s:.3f} s), "
        f"prefilled {result.prefilled_tokens} tokens in {result.prefill_s:.3f} s; TTFT {result.ttft_s:.3f} s; "
        f"{len(result.tokens)} tokens decoded in {result.decode_s:.2f} s; saved cuts {result.saved_cuts}",
        file=sys.stderr,
    )
    return 0


def cmd_save(args) -> int:
    from ..generate import chat_tokens, generate

    _text_engine(args)
    store = _open(args)
    engine = _engine(args)
    tokens = chat_tokens(engine, args.prompt, chat=not args.raw)
    result = generate(engine, store, tokens, max_new_tokens=0)
    out = {"saved_cuts": result.saved_cuts, "manifest_id": result.manifest_id, "prompt_tokens": result.prompt_tokens, "reused_tokens": result.reused_tokens}
    print(json.dumps(out) if args.json else f"saved cuts {result.saved_cuts} (top {result.manifest_id})")
    return 0


def cmd_ls(args) -> int:
    rows = _open(args).ls()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'manifest id':<64} {'tokens':>7} {'kind':<6} {'depth':>5} {'packs':>5} {'complete MB':>11}")
    for r in sorted(rows, key=lambda r: r.get("tokens", 0)):
        if "error" in r:
            print(f"{r['manifest_id']}  error: {r['error']}")
            continue
        print(f"{r['manifest_id']} {r['tokens']:>7} {r['kind']:<6} {r['depth']:>5} {r['packs']:>5} {r['complete_bytes'] / 1e6:>11.1f}")
    return 0


def _resolve_cut(store, text: str) -> bytes:
    """A full manifest id, or a prefix naming exactly one committed cut."""
    from ..store.maintenance import _unique_cut

    if len(text) == 64:
        return bytes.fromhex(text)
    return _unique_cut(store.index_entries(), text)  # the cuts ls lists, without loading their chains


def cmd_show(args) -> int:
    from ..format.describe import manifest_json

    from ..errors import StoreError
    from ..store.packstore import pack_name

    store = _open(args)
    mid = _resolve_cut(store, args.manifest_id)
    if not store.env.exists(pack_name(mid)):  # an unknown id is a miss, not a damaged cut
        raise StoreError("miss", f"no stored cut has manifest id {mid.hex()}")
    chain = store.load_chain(mid)
    print(json.dumps({"chain": [manifest_json(m) for m in chain]}, indent=None if args.json else 1))
    return 0


def cmd_verify(args) -> int:
    from ..errors import StoreError

    from ..store.maintenance import verify

    store, deadline = _open_maintained(args, "verify")
    report = verify(store, read_data=args.read_data, deadline=deadline)
    if args.json:
        print(json.dumps(report))
    else:
        for problem in report["problems"]:
            print(f"problem: {problem}")
        print(
            f"{'ok' if report['ok'] else 'FAILED'}: {report['cuts']} cuts, {report['chunks_checked']} chunks {'read and verified' if args.read_data else 'checked'}"
        )
    if not report["ok"]:
        raise StoreError("corrupt", f"{len(report['problems'])} problem(s) found; kvpack store repair quarantines the damaged cuts")
    return 0


def cmd_repair(args) -> int:
    from ..store.maintenance import repair

    store, deadline = _open_maintained(args, "repair")
    report = repair(store, deadline=deadline)
    if args.json:
        print(json.dumps(report))
        return 0
    for receipt in report["receipts"]:
        print(f"quarantined {receipt['manifest_id'] or receipt['node_id']}: {'; '.join(receipt['problems'])[:300]} (receipt {receipt['receipt']})")
    print(f"checked {report['cuts_checked']} cuts, quarantined {report['quarantined']}")
    return 0


def cmd_forget(args) -> int:
    from ..store.maintenance import forget

    # a prefix is resolved inside forget, under its deadline (one listing of the index)
    text = args.manifest_id
    store, deadline = _open_maintained(args, "forget")
    out = forget(store, bytes.fromhex(text) if len(text) == 64 else text, deadline=deadline)
    print(json.dumps(out) if args.json else f"forgot cut {out['manifest_id']} ({out['index_entries_removed']} index entries removed)")
    return 0


def wait_seconds(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


wait_seconds.__name__ = "seconds"


def cmd_gc(args) -> int:
    from ..store.maintenance import gc

    store, deadline = _open_maintained(args, "gc")
    env = store.env
    if hasattr(env, "gc_wait_s"):  # a directory store: gc takes the store lock exclusively
        env.on_wait = lambda line: print(f"kvpack: {line}", file=sys.stderr, flush=True)
        if args.wait is not None:
            env.gc_wait_s = args.wait
    removed = gc(store, deadline=deadline)
    print(json.dumps(removed) if args.json else "removed " + ", ".join(f"{v} {k}" for k, v in removed.items()))
    return 0
