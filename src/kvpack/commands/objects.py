"""``kvpack fixture``, ``kvpack inspect`` and ``kvpack verify``: the production-v1 object tools.

Refusals are raised (typed FormatError / SecurityError) and reported by the CLI's error
contract: ``kvpack: <category>: <message>`` on stderr, exit 1 for a refused object, 2 for a
missing/unsafe key or input file (docs/cli.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ._args import existing_file, not_a_file


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fixture", help="write every production-v1 reference vector object to OUTDIR/<suite>/<name>")
    p.add_argument("outdir", type=not_a_file, help="directory to write the vector objects into (created)")
    p.add_argument("--manifest", action="store_true", help="also print the vector lines (suite, name, bytes, sha256)")
    p.set_defaults(func=cmd_fixture)

    p = sub.add_parser(
        "inspect",
        help="describe a production-v1 object (pack, chunk, manifest, ...)",
        description="Describe a production-v1 object. Without --root-key-file every check that needs no key runs "
        "(structure, header digest, a plain pack's manifest id and manifest); damage they can see exits 1. "
        "What only the key can prove (a pack's footer HMAC, an encrypted manifest, a chunk's payload) is reported "
        "as 'structure ok, not verified' with exit 0: kvpack verify proves the object.",
    )
    p.add_argument("file", type=existing_file, help="the object file")
    p.add_argument("--root-key-file", type=existing_file, help="verify and show an encrypted pack's manifest (32-byte root, 0600)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="verify a pack or chunk object under a root key")
    p.add_argument("file", type=existing_file, help="the pack or chunk object file")
    p.add_argument("--root-key-file", required=True, type=existing_file, help="file with the 32-byte root (raw, or 64 lowercase hex; mode 0600)")
    p.add_argument("--pack", type=existing_file, help="for a chunk: the pack whose manifest references it (full ref binding)")
    p.set_defaults(func=cmd_verify)


def cmd_fixture(args) -> int:
    import hashlib

    from ..durable import atomic_write, ensure_dir
    from ..format.fixtures import vector_objects

    lines = []
    for suite, name, data in vector_objects():
        path = os.path.join(args.outdir, suite, name)
        ensure_dir(os.path.dirname(path), mode=0o755)
        atomic_write(path, data, mode=0o644, sync_dir=False)
        lines.append({"suite": suite, "name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    if args.json:
        print(json.dumps({"outdir": args.outdir, "objects": len(lines), **({"vectors": lines} if args.manifest else {})}, sort_keys=True))
        return 0
    if args.manifest:
        for v in lines:
            print(f"{v['suite']}\t{v['name']}\t{v['bytes']}\t{v['sha256']}")
    print(f"wrote {len(lines)} objects under {args.outdir}", file=sys.stderr)
    return 0


def _load_root(path: str) -> bytes:
    from ..rootkey import load_root_key

    return load_root_key(path)


def _read(path: str) -> bytes:
    from ._args import read_small_file

    return read_small_file(path, what="object file", max_bytes=1 << 30, binary=True)


def cmd_inspect(args) -> int:
    from ..format.describe import describe

    data = _read(args.file)
    root = _load_root(args.root_key_file) if args.root_key_file else None
    info = describe(data, root=root)
    if args.json:
        print(json.dumps(info, sort_keys=True))
        return 0
    if info.get("verified") is True:
        print("verified: every check passed under the root key")
    elif "unverified" in info:
        print(f"structure ok, not verified: {'; '.join(info['unverified'])}")
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
    from ..errors import FormatError, UsageError
    from ..format import KeyRing, decode_chunk, decode_pack, verify_chunk_standalone
    from ..format.describe import detect_kind

    data = _read(args.file)
    root = _load_root(args.root_key_file)
    kind = detect_kind(data)
    if kind == "pack":
        manifest, _ = decode_pack(data, KeyRing(root, data[56:88]))
        out = {"ok": True, "kind": "pack", "manifest_id": manifest.manifest_id().hex(), "tokens": manifest.cut.token_count}
        out["chunks"] = sum(1 for _ in manifest.chunk_refs())
        text = f"ok pack {out['manifest_id']} tokens={out['tokens']} chunks={out['chunks']}"
    elif kind == "chunk":
        ring = KeyRing(root, data[48:80])
        if args.pack:
            pack = _read(args.pack)
            manifest, _ = decode_pack(pack, KeyRing(root, pack[56:88]))
            content_id = data[112:144]
            for key, span, ref in manifest.chunk_refs():
                if ref.content_id == content_id:
                    decode_chunk(data, ref=ref, span=span, tenant=manifest.tenant, family=manifest.family, key=key, keys=ring)
                    out = {"ok": True, "kind": "chunk", "content_id": content_id.hex(), "state": str(key), "bound": True}
                    out.update(token_start=span.token_start, token_count=span.token_count)
                    text = f"ok chunk {content_id.hex()} state={key} tokens={span.token_start}+{span.token_count}"
                    break
            else:
                raise FormatError("authentication", f"chunk {content_id.hex()} is not referenced by {args.pack}")
        else:
            header, _ = verify_chunk_standalone(data, ring)
            out = {"ok": True, "kind": "chunk", "content_id": header.content_id.hex(), "bound": False}
            text = f"ok chunk {header.content_id.hex()} (standalone: pass --pack to bind it to a manifest ref)"
    else:
        raise UsageError("file", f"{args.file} is a {kind}; verify takes a pack or a chunk object")
    print(json.dumps(out, sort_keys=True) if args.json else text)
    return 0
