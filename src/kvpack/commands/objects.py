"""``kvpack fixture``, ``kvpack inspect`` and ``kvpack verify``: the production-v1 object tools.

Exit codes: 0 ok, 1 refused (``refused <category>: <message>``), 2 usage or key-file errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fixture", help="write every production-v1 reference vector object to OUTDIR/<suite>/<name>")
    p.add_argument("outdir")
    p.add_argument("--manifest", action="store_true", help="also print the vector lines (suite, name, bytes, sha256)")
    p.set_defaults(func=cmd_fixture)

    p = sub.add_parser("inspect", help="describe a production-v1 object (pack, chunk, manifest, ...)")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--root-key-file", help="verify and show an encrypted pack's manifest")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="verify a pack or chunk object under a root key")
    p.add_argument("file")
    p.add_argument("--root-key-file", required=True, help="file with the 32-byte root (raw, or 64 lowercase hex)")
    p.add_argument("--pack", help="for a chunk: the pack whose manifest references it (full ref binding)")
    p.set_defaults(func=cmd_verify)


def cmd_fixture(args) -> int:
    import hashlib

    from ..durable import atomic_write, ensure_dir
    from ..format.fixtures import vector_objects

    count = 0
    for suite, name, data in vector_objects():
        path = os.path.join(args.outdir, suite, name)
        ensure_dir(os.path.dirname(path), mode=0o755)
        atomic_write(path, data, mode=0o644, sync_dir=False)
        count += 1
        if args.manifest:
            print(f"{suite}\t{name}\t{len(data)}\t{hashlib.sha256(data).hexdigest()}")
    print(f"wrote {count} objects under {args.outdir}", file=sys.stderr)
    return 0


def _load_root(path: str) -> bytes | None:
    from ..errors import SecurityError
    from ..rootkey import load_root_key

    try:
        return load_root_key(path)
    except SecurityError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return None


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        print(f"error: cannot read {path}: {exc.strerror}", file=sys.stderr)
        return None


def cmd_inspect(args) -> int:
    from ..errors import FormatError
    from ..format.describe import describe

    data = _read(args.file)
    if data is None:
        return 2
    root = None
    if args.root_key_file:
        root = _load_root(args.root_key_file)
        if root is None:
            return 2
    try:
        info = describe(data, root=root)
    except FormatError as exc:
        print(f"refused {exc.category}: {exc.message}")
        return 1
    if args.json:
        print(json.dumps(info, sort_keys=True))
    else:
        _print_tree(info)
    return 0


def _print_tree(value, indent: int = 0) -> None:
    pad = "  " * indent
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                print(f"{pad}{key}:")
                _print_tree(item, indent + 1)
            else:
                print(f"{pad}{key}: {item}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                print(f"{pad}-")
                _print_tree(item, indent + 1)
            else:
                print(f"{pad}- {item}")


def cmd_verify(args) -> int:
    from ..errors import FormatError
    from ..format import KeyRing, decode_chunk, decode_pack, verify_chunk_standalone
    from ..format.describe import detect_kind

    data = _read(args.file)
    root = _load_root(args.root_key_file)
    if data is None or root is None:
        return 2
    try:
        kind = detect_kind(data)
        if kind == "pack":
            tenant = data[56:88]
            manifest, _ = decode_pack(data, KeyRing(root, tenant))
            print(f"ok pack {manifest.manifest_id().hex()} tokens={manifest.cut.token_count} chunks={sum(1 for _ in manifest.chunk_refs())}")
        elif kind == "chunk":
            tenant = data[48:80]
            ring = KeyRing(root, tenant)
            if args.pack:
                pack = _read(args.pack)
                if pack is None:
                    return 2
                manifest, _ = decode_pack(pack, KeyRing(root, pack[56:88]))
                content_id = data[112:144]
                for key, span, ref in manifest.chunk_refs():
                    if ref.content_id == content_id:
                        decode_chunk(data, ref=ref, span=span, tenant=manifest.tenant, family=manifest.family, key=key, keys=ring)
                        print(f"ok chunk {content_id.hex()} state={key} tokens={span.token_start}+{span.token_count}")
                        break
                else:
                    print(f"refused authentication: chunk {content_id.hex()} is not referenced by {args.pack}")
                    return 1
            else:
                header, _ = verify_chunk_standalone(data, ring)
                print(f"ok chunk {header.content_id.hex()} (standalone: pass --pack to bind it to a manifest ref)")
        else:
            print(f"error: {args.file} is a {kind}; verify takes a pack or a chunk object", file=sys.stderr)
            return 2
    except FormatError as exc:
        print(f"refused {exc.category}: {exc.message}")
        return 1
    return 0
