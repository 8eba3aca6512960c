"""Check order where two refusals meet (INTEROP-A-ERRATA-2): every row of
``production_v1_check_order.tsv``, read at test time from the shared conformance directory.

No case, context or expected category lives in this repository; the rows are judged by the
same strict decode the ``kvpack verdict`` and ``kvpack transcode`` verbs use.
"""

from __future__ import annotations

import hashlib

import pytest

from kvpack.errors import FormatError
from kvpack.format.verdict import KINDS, DecodeContext, canonical_bytes, judge


def _check_order_rows(conformance_dir):
    rows = []
    for line in (conformance_dir / "production_v1_check_order.tsv").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        case, kind, category, context, hexdata = line.split("\t")
        rows.append((case, kind, category, context, bytes.fromhex(hexdata)))
    return rows


def test_every_check_order_case_refuses_with_its_category(conformance_dir):
    rows = _check_order_rows(conformance_dir)
    assert len(rows) == 8
    wrong = []
    for case, kind, category, context, data in rows:
        assert kind in KINDS, case
        verdict = judge(kind, data, DecodeContext.parse(context))
        if verdict.category != category:
            wrong.append((case, category, verdict.line()))
    assert not wrong, wrong


def test_check_order_cases_raise_typed_errors_from_the_decoders(conformance_dir):
    # the same rows through the raising API: nothing is re-emitted for a refused object
    for case, kind, category, context, data in _check_order_rows(conformance_dir):
        with pytest.raises(FormatError) as info:
            canonical_bytes(kind, data, DecodeContext.parse(context))
        assert info.value.category == category, case


def test_zero_token_span_is_semantics_on_the_deferred_path_too(conformance_dir):
    # E2-3 for the external-digest path (GPU restores): the refusal is held until finish(),
    # after the object digest, and it is the same category as the full decode's.
    from kvpack.format.chunk import ExternalDigests, decode_chunk_deferred, deferrable

    raw_chunk_rows = [r for r in _check_order_rows(conformance_dir) if r[1] == "chunk" and deferrable(r[4])]
    assert raw_chunk_rows  # C1 is the raw unencrypted fixture chunk
    for case, _kind, category, context, data in raw_chunk_rows:
        ctx = DecodeContext.parse(context)
        family, key, ref, span = ctx.chunk_binding()
        keys = ctx.keys()
        deferred = decode_chunk_deferred(data, ref=ref, span=span, tenant=keys.tenant, family=family, key=key, keys=keys)
        with pytest.raises(FormatError) as info:
            deferred.finish(ExternalDigests(hashlib.sha256(data).digest(), deferred.content_id))
        assert info.value.category == category, case
