"""Errata L12 known-answer vectors, reproduced from inputs (only the published digests are
literals), plus C.6's key-order and normalization rules."""

import hashlib
import hmac

from kvpack.handoff.canonical_json import canonical_bytes
from kvpack.handoff.events import Begin
from kvpack.handoff.frames import decode_all, frame_bytes
from kvpack.handoff.manifest import SealAccumulator, seal_tag
from kvpack.handoff.schedule import muse_intents
from kvpack.handoff.sender import Sender, declare_segments

from ._support import KEY, manifest

# Published in INTEROP-C-ERRATA.md L12.
DEFERRED_BEGIN = "90e0af346bf5d658f10090acc0aaa7560dca228e909903cc674786d176581537"
DEFERRED_DESCRIPTORS = "ce51e9bd96f4a83ac4e189a621a31f084a39ea936beaa43bf008ad31980eaa09"
DEFERRED_PAYLOAD = "5fd0979fbbecbde4e4c00555c04c739c9769b18923009bc715c012201afeaa13"
DEFERRED_HMAC = "314772a04c78047e9fbf696705e4bc7185697bb04c1f7d3fe1c92aa7f0db38ea"
DECLARED_BEGIN = "2ba70d46b817888b44cfebfca1db44c6b0e8090f7be010d57710dc8732d0906d"
DECLARED_HMAC = "89d8033d9e7a1a951cbc1651349e25ed0d7ccafda819d041d359a51ea9e5876d"
DELTA_BEGIN = "9286719d5c5180b561e6acb9806657818023cad51df58efe43894b457de857ac"
DELTA_BEGIN_WRONG = "6b6359ef7a4bcf4b9073649a4d74a152421a87bb20323c3f103f288ec10a5bdc"


def _run_sender(deferred: bool):
    intents = muse_intents(1)
    payloads = [bytes(seg.byte_len) for seg in intents]
    segs = () if deferred else declare_segments(intents, payloads)
    m = manifest((5,), deferred=deferred, segments=segs)
    s = Sender(m, KEY)
    s.begin()
    for i, p in zip(intents, payloads):
        s.send_segment(p, i if deferred else None)
    s.seal()
    return m, s, intents, payloads


def test_vector_geometry():
    intents = muse_intents(1)
    assert len(intents) == 4
    assert [seg.byte_len for seg in intents] == [13312] * 4
    assert sum(seg.byte_len for seg in intents) == 53248


def test_deferred_vector():
    m, s, _, _ = _run_sender(deferred=True)
    core = s.seal_manifest.core
    assert m.begin_sha256() == DEFERRED_BEGIN
    assert core.begin_sha256 == DEFERRED_BEGIN
    assert core.descriptor_sha256 == DEFERRED_DESCRIPTORS
    assert core.payload_sha256 == DEFERRED_PAYLOAD
    assert s.seal_manifest.hmac_sha256 == DEFERRED_HMAC
    assert (core.segment_count, core.total_bytes) == (4, 53248)
    # Independent recomputation with hashlib/hmac only, no kvpack code in the loop.
    expected_tag = hmac.new(KEY, canonical_bytes(core.to_json()), hashlib.sha256).hexdigest()
    assert expected_tag == DEFERRED_HMAC
    assert hashlib.sha256(bytes(53248)).hexdigest() == DEFERRED_PAYLOAD


def test_declared_vector():
    m, s, _, _ = _run_sender(deferred=False)
    assert "deferred_segments" not in m.to_json()
    assert m.begin_sha256() == DECLARED_BEGIN
    assert s.seal_manifest.hmac_sha256 == DECLARED_HMAC
    # Same descriptors and payload as deferred mode.
    assert s.seal_manifest.core.descriptor_sha256 == DEFERRED_DESCRIPTORS


def test_delta_vector_excludes_prefix_cut():
    m = manifest(tuple(range(300)), deferred=True)
    assert m.begin_sha256() == DELTA_BEGIN
    raw = dict(m.to_json(), prefix_cut=256)
    assert hashlib.sha256(canonical_bytes(raw)).hexdigest() == DELTA_BEGIN_WRONG
    # Through the wire: the begin frame carries prefix_cut, the typed manifest drops it.
    wire = frame_bytes(Begin(m, 256))
    assert b'"prefix_cut":256' in wire
    (frame,) = decode_all(wire)
    assert frame.prefix_cut == 256
    assert frame.manifest.begin_sha256() == DELTA_BEGIN


def test_seal_core_canonical_key_order():
    _, s, _, _ = _run_sender(deferred=True)
    text = canonical_bytes(s.seal_manifest.core.to_json()).decode()
    keys = ["begin_sha256", "descriptor_sha256", "generation", "payload_sha256", "segment_count", "total_bytes", "transfer_id"]
    positions = [text.index(f'"{k}"') for k in keys]
    assert positions == sorted(positions)


def test_descriptor_digest_is_plain_concatenation():
    m, s, intents, payloads = _run_sender(deferred=True)
    acc = SealAccumulator()
    blob = b""
    for n, (i, p) in enumerate(zip(intents, payloads)):
        d = declare_segments([i], [p])[0]
        d = type(d)(**{**d.to_json(), "sequence": n})
        blob += canonical_bytes(d.to_json())
        acc.add_descriptor(d)
    assert hashlib.sha256(blob).hexdigest() == s.seal_manifest.core.descriptor_sha256
    # the accumulator both sides keep computes exactly that plain concatenation
    assert acc.descriptor_hash.hexdigest() == s.seal_manifest.core.descriptor_sha256
    # layer null is always present (errata M2): the NoPE tile has layer null.
    assert b'"layer":null' in blob


def test_seal_tag_changes_with_key():
    _, s, _, _ = _run_sender(deferred=True)
    assert seal_tag(bytes(32), s.seal_manifest.core) != DEFERRED_HMAC
