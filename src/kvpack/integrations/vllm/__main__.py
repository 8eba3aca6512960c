"""``python -m kvpack.integrations.vllm identity``: the enrollment identity of a vLLM engine.

Disaggregated prefill admits a transfer only under the exact identity the consumer was
enrolled with (``kvpack enroll init --identity FILE``). This writes that file from the same
engine arguments ``vllm serve`` / ``LLM(...)`` will get, without starting an engine (vLLM
resolves its configuration; the weights are hashed, not loaded)::

    python -m kvpack.integrations.vllm identity --model DIR --dtype float32 \\
        --max-model-len 4096 [--block-size 128] -o identity.json

Both instances must run with these arguments; the consumer refuses to start otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpack.integrations.vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    ident = sub.add_parser("identity", help="write the enrollment identity file of a vLLM engine configuration")
    ident.add_argument("--model", required=True, help="local checkpoint directory (safetensors)")
    ident.add_argument("--dtype", default="auto")
    ident.add_argument("--max-model-len", type=int, default=None)
    ident.add_argument("--block-size", type=int, default=None)
    ident.add_argument("--kv-cache-dtype", default="auto")
    ident.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    args = parser.parse_args(argv)

    from vllm.engine.arg_utils import EngineArgs

    from ...node.wire import identity_file_json
    from .identity import vllm_identity

    kw = {"block_size": args.block_size} if args.block_size else {}
    engine_args = EngineArgs(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype, enforce_eager=True, **kw)
    identity = vllm_identity(engine_args.create_engine_config())

    # identity_file_json reads only the engine's identity
    body = json.dumps(identity_file_json(SimpleNamespace(identity=identity)), indent=2, sort_keys=True) + "\n"
    if args.output == "-":
        sys.stdout.write(body)
    else:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
