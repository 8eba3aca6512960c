"""``kvpack schedule``: print the Handoff V2 span schedule (INTEROP C.12) for a preset.

So anyone can check the seed's byte arithmetic: e.g. ``kvpack schedule --preset muse
--position 65535 --cut 32768 --json`` gives the 517,983,232-byte delta of a 65,536-token
prompt whose first 32,768 tokens are held (``position`` = prompt minus the held-back
boundary token).

It only prints; it must never compute the schedule itself (that is
:mod:`kvpack.handoff.schedule`).
"""

from __future__ import annotations

import argparse
import json

from ._args import int_range, nonneg_int

#: the MUPCTL1 prompt bound (C.14, handoff.control.MAX_PROMPT_TOKENS) minus the boundary token
MAX_POSITION = 131072 - 1


def register(sub) -> None:
    p = sub.add_parser("schedule", help="print the Handoff V2 span schedule for a layout preset")
    p.add_argument("--preset", default="muse", choices=["muse"], help="layout preset")
    p.add_argument(
        "--position",
        type=int_range(1, MAX_POSITION, what="a token position"),
        required=True,
        help="rows shipped: prompt length minus the boundary token",
    )
    p.add_argument("--cut", type=nonneg_int, default=0, help="delta prefix cut (256-aligned, < position); 0 = full")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # Imported here so that `kvpack --help` does not import the protocol package.
    from ..handoff.schedule import PRESETS, class_bytes, first_tile_complete_after_tokens, payload_bytes, schedule_span

    layout = PRESETS[args.preset]
    segs = schedule_span(layout, args.position, args.cut)
    full = payload_bytes(schedule_span(layout, args.position, 0))
    per_class = class_bytes(segs)
    total = payload_bytes(segs)
    summary = {
        "preset": layout.name,
        "position": args.position,
        "cut": args.cut,
        "segment_count": len(segs),
        "payload_bytes": total,
        "nope_bytes": per_class.get("nope", 0),
        "swa_bytes": per_class.get("swa", 0),
        "full_payload_bytes": full,
        "share_of_full": total / full,
        "first_tile_complete_after_tokens": first_tile_complete_after_tokens(layout, args.position, args.cut),
    }
    if args.json:
        print(json.dumps({**summary, "segments": [s.to_json() for s in segs]}, sort_keys=True))
        return 0
    print(f"{'seq':>5} {'role':<10} {'layer':>5} {'start':>8} {'count':>6} {'ept':>6} {'bytes':>10}")
    for s in segs:
        layer = "-" if s.layer is None else str(s.layer)
        print(f"{s.sequence:>5} {s.role:<10} {layer:>5} {s.logical_start:>8} {s.logical_count:>6} {s.elements_per_token:>6} {s.byte_len:>10}")
    print(
        f"segments {len(segs)}  payload {total:,} B  nope {summary['nope_bytes']:,} B  "
        f"swa {summary['swa_bytes']:,} B  share of full {100 * summary['share_of_full']:.4f} %"
    )
    return 0
