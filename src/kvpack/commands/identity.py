"""``kvpack identity --engine SPEC [--threads N] [--out FILE] [--json]``: the identity file.

A decode node admits exactly one model identity (C.4 ``identity`` plus
``target_cache_identity_sha256``), and ``kvpack enroll init --identity FILE`` and every
receiver config take it from this file. It is computed from the engine that will really
run -- loaded through the engine registry with the same spec and thread count the daemons
use -- so the only way to get it right is to run the same build, never to type digests.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..engine.registry import SPEC_HELP
    from ._args import engine_spec, threads

    p = subparsers.add_parser("identity", help="write the identity file a decode node admits (for enroll and receiver configs)")
    p.add_argument("--engine", type=engine_spec, default="smollm2", help=SPEC_HELP)
    p.add_argument("--threads", type=threads, help="torch threads (part of the identity: run the daemons with the same; default: the engine's default)")
    p.add_argument("--out", help="write the identity file here (default: print it); with --json: engine, layout summary and file too")
    p.set_defaults(func=_run)


def layout_summary(engine) -> dict:
    """Classes of the engine's cache layout, for humans and receipts (not hashed)."""
    layout = engine.layout
    full = [s.index for s in layout.layers if s.kind == "full"]
    windowed = [s.index for s in layout.layers if s.kind != "full"]
    first = layout.layers[0]
    return {
        "layers": layout.num_layers,
        "full_layers": full,
        "windowed_layers": windowed,
        "window_tokens": sorted({s.window_tokens for s in layout.layers if s.kind != "full"}),
        "kv_heads": first.kv_heads,
        "head_dim": first.head_dim,
        "dtypes": sorted({s.dtype for s in layout.layers}),
        "vocab_size": layout.vocab_size,
    }


def _run(args: argparse.Namespace) -> int:
    from ..engine.registry import default_threads, load_engine
    from ..node.wire import identity_file_json, write_identity_file
    from ..progress import status

    threads = default_threads(args.engine) if args.threads is None else args.threads
    with status(f"loading engine {args.engine} ..."):
        engine = load_engine(args.engine, threads=threads)
    doc = identity_file_json(engine)
    if args.out:
        write_identity_file(engine, args.out)
    if args.json:
        out = {"engine": args.engine, "threads": threads, **doc, "layout": layout_summary(engine), "file": args.out}
        print(json.dumps(out, sort_keys=True))
    elif args.out:
        print(f"wrote {args.out}: engine {args.engine}, {threads} thread(s), target cache identity {doc['target_cache_identity_sha256']}", file=sys.stderr)
    else:
        print(json.dumps(doc, indent=2, sort_keys=True))
    return 0
