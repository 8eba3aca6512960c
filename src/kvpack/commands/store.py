"""``kvpack store init|save|ls|show|verify|gc`` and ``kvpack generate``.

Exit codes: 0 ok, 1 refused or problems found, 2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="the filesystem pack store")
    ss = p.add_subparsers(dest="store_command", metavar="ACTION")
    ss.required = True

    q = ss.add_parser("init", help="create a store directory")
    q.add_argument("dir")
    q.add_argument("--tenant", default="default")
    q.add_argument("--encrypt", action="store_true", help="encrypt chunks and manifests at rest (ChaCha20-Poly1305)")
    q.add_argument("--root-key-file", help="keep the 32-byte root here (created 0600 if missing) instead of DIR/root.key")
    q.add_argument("--chunk-bytes", type=int, default=4 * 1024 * 1024)
    q.set_defaults(func=cmd_init)

    q = ss.add_parser("save", help="prefill a prompt with the bundled model and save its cut and checkpoints")
    q.add_argument("dir")
    q.add_argument("--prompt", required=True)
    q.add_argument("--raw", action="store_true", help="tokenize the prompt as is (no chat template)")
    q.add_argument("--threads", type=int)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_save)

    for name, func, helptext in (("ls", cmd_ls, "list committed cuts"), ("gc", cmd_gc, "remove unreferenced objects")):
        q = ss.add_parser(name, help=helptext)
        q.add_argument("dir")
        q.add_argument("--json", action="store_true")
        q.add_argument("--root-key-file")
        q.set_defaults(func=func)

    q = ss.add_parser("show", help="describe one cut (its pack chain, states, chunks)")
    q.add_argument("dir")
    q.add_argument("manifest_id")
    q.add_argument("--root-key-file")
    q.set_defaults(func=cmd_show)

    q = ss.add_parser("verify", help="check every committed cut (packs; with --read-data every chunk byte)")
    q.add_argument("dir")
    q.add_argument("--read-data", action="store_true")
    q.add_argument("--json", action="store_true")
    q.add_argument("--root-key-file")
    q.set_defaults(func=cmd_verify)

    p = sub.add_parser("generate", help="generate with the bundled model, reusing the deepest stored prefix")
    p.add_argument("--store", required=True, help="store directory (created if missing)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--raw", action="store_true", help="tokenize the prompt as is (no chat template)")
    p.add_argument("--threads", type=int, help="torch threads (part of the engine identity)")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_generate)


def _open(args):
    from ..store import PackStore

    return PackStore.open(args.dir, root_key_file=getattr(args, "root_key_file", None))


def cmd_init(args) -> int:
    from ..store import PackStore

    store = PackStore.init(args.dir, tenant=args.tenant, encrypted=args.encrypt, root_key_file=args.root_key_file, chunk_bytes=args.chunk_bytes)
    print(f"initialised store {store.path} (tenant {store.tenant_name!r}, epoch {store.epoch}, {'encrypted' if store.encrypted else 'plain'})")
    return 0


def _engine(threads):
    from ..engine.models import load_smollm2
    from ..engine.transformers_adapter import TransformersEngine
    from ..progress import status

    with status("loading SmolLM2-135M-Instruct (bundled GGUF)"):
        return TransformersEngine(load_smollm2(), threads=threads)


def _open_or_init(path: str):
    import os

    from ..store import PackStore

    if not os.path.exists(os.path.join(path, "store.json")):
        return PackStore.init(path)
    return PackStore.open(path)


def cmd_generate(args) -> int:
    from ..generate import chat_tokens, generate

    store = _open_or_init(args.store)
    engine = _engine(args.threads)
    tokens = chat_tokens(engine, args.prompt, chat=not args.raw)
    result = generate(engine, store, tokens, max_new_tokens=args.max_new_tokens, save=not args.no_save)
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    print(result.text)
    print(
        f"-- reused {result.reused_tokens} tokens ({result.reused_bytes / 1e6:.1f} MB verified in {result.restore_s:.3f} s), "
        f"prefilled {result.prefilled_tokens} tokens in {result.prefill_s:.3f} s; TTFT {result.ttft_s:.3f} s; "
        f"{len(result.tokens)} tokens decoded in {result.decode_s:.2f} s; saved cuts {result.saved_cuts}",
        file=sys.stderr,
    )
    return 0


def cmd_save(args) -> int:
    from ..generate import chat_tokens, generate

    store = _open(args)
    engine = _engine(args.threads)
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
    print(f"{'manifest id':<18} {'tokens':>7} {'kind':<6} {'depth':>5} {'packs':>5} {'complete MB':>11}")
    for r in sorted(rows, key=lambda r: r.get("tokens", 0)):
        if "error" in r:
            print(f"{r['manifest_id'][:16]}…  error: {r['error']}")
            continue
        print(f"{r['manifest_id'][:16]}… {r['tokens']:>7} {r['kind']:<6} {r['depth']:>5} {r['packs']:>5} {r['complete_bytes'] / 1e6:>11.1f}")
    return 0


def cmd_show(args) -> int:
    from ..format.describe import _manifest

    store = _open(args)
    try:
        mid = bytes.fromhex(args.manifest_id)
    except ValueError:
        print("error: manifest id must be 64 hex digits", file=sys.stderr)
        return 2
    chain = store.load_chain(mid)
    print(json.dumps({"chain": [_manifest(m) for m in chain]}, indent=1))
    return 0


def cmd_verify(args) -> int:
    report = _open(args).verify(read_data=args.read_data)
    if args.json:
        print(json.dumps(report))
    else:
        for problem in report["problems"]:
            print(f"problem: {problem}")
        print(
            f"{'ok' if report['ok'] else 'FAILED'}: {report['cuts']} cuts, {report['chunks_checked']} chunks {'read and verified' if args.read_data else 'checked'}"
        )
    return 0 if report["ok"] else 1


def cmd_gc(args) -> int:
    removed = _open(args).gc()
    print(json.dumps(removed) if args.json else "removed " + ", ".join(f"{v} {k}" for k, v in removed.items()))
    return 0
