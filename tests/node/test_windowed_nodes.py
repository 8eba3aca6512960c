"""Producer -> receiver (in process, real loopback mutual TLS) for a two-class cache layout on
a real transformers model: a small seeded Cohere2 (NoPE layers 3 and 7, six sliding-window
RoPE layers of 300 rows). Decoding after every full and delta handoff -- at positions below,
at and above the window -- is bit-identical (tokens and every logits row) to uninterrupted
local decoding with the same computation order, and the bytes on the wire are exactly the
span-schedule arithmetic. (muse-tiny, the seed's full geometry, runs through the real
daemons in test_muse_nodes.py.)
"""

from __future__ import annotations

import hashlib
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpack.engine.models import build_cohere2  # noqa: E402
from kvpack.engine.transformers_adapter import TransformersEngine  # noqa: E402
from kvpack.node.common import greedy, logits_bytes  # noqa: E402
from kvpack.node.producer import ProducerNode  # noqa: E402
from kvpack.node.receiver import ReceiverNode  # noqa: E402

from .helpers import Enrolled  # noqa: E402

WINDOW = 300  # rows a sliding layer retains (HF sliding_window = 301)


@pytest.fixture(scope="module")
def engine():
    loaded = build_cohere2(seed=3, num_hidden_layers=8, sliding_window=WINDOW + 1, max_position_embeddings=4096)
    return TransformersEngine(loaded, threads=1, prefill_chunk_tokens=256)


@pytest.fixture(scope="module")
def nodes(engine, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("windowed")
    enrolled = Enrolled(str(tmp / "cluster"), engine)
    producer = ProducerNode(enrolled.producer_config(), engine, receipts_dir=str(tmp / "p"), metrics_port=None).start()
    enrolled.producer_listening("prefill-a", producer.control_port)
    receiver = ReceiverNode(enrolled.receiver_config(), engine, receipts_dir=str(tmp / "r"), metrics_port=None, check_volume=False).start()
    yield receiver
    receiver.stop()
    producer.stop()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def reference(engine, tokens, n=8):
    s = engine.new_session()
    s.prefill(tokens[:-1])
    s.prefill(tokens[-1:])
    out, rows = greedy(s, n)
    return out, hashlib.sha256(logits_bytes(rows)).hexdigest()


@pytest.mark.parametrize("length", [WINDOW - 99, WINDOW + 1, 2 * WINDOW + 101], ids=["below", "at", "above"])
def test_full_handoff_bit_exact_below_at_and_above_the_window(engine, nodes, length):
    tokens = prompt(length, seed=length)
    r = nodes.generate(tokens, 8)
    assert r["plan"]["action"] == "full_transfer"
    assert (r["tokens"], r["logits_sha256"]) == reference(engine, tokens)
    position = length - 1
    assert r["transfer"]["payload_bytes"] == nodes.geometry.payload_bytes(position)
    assert r["transfer"]["producer_receipt"]["payload_bytes"] == r["transfer"]["payload_bytes"]


@pytest.mark.parametrize("suffix", [60, WINDOW, WINDOW + 188], ids=["suffix-inside-window", "suffix-one-window", "suffix-beyond-window"])
def test_delta_handoff_bit_exact_and_window_resent_when_outrun(engine, nodes, suffix):
    base = prompt(513, seed=1000 + suffix)  # position 512: a resident entry ending at the cut
    first = nodes.generate(base, 4)
    assert first["plan"]["action"] == "full_transfer"
    tokens = base[:512] + prompt(suffix + 1, seed=2000 + suffix)
    r = nodes.generate(tokens, 8)
    t = r["transfer"]
    assert r["plan"]["action"] == "arm_delta" and t["prefix_cut"] == 512
    assert (r["tokens"], r["logits_sha256"]) == reference(engine, tokens)
    position = len(tokens) - 1
    assert t["payload_bytes"] == nodes.geometry.payload_bytes(position, 512) < nodes.geometry.payload_bytes(position)
    # the held prefix supplied [0, 512) of the NoPE layers and the part of the window before the cut
    row = engine.layout.layers[0].row_bytes
    held_window = max(0, 512 - max(0, position - WINDOW))
    assert t["prefix_bytes_copied"] == (512 * 2 * 2 + held_window * 6 * 2) * row
    assert t["producer_receipt"]["prefill_tokens"] == position - 512  # the producer reused its prefix
    receipts = sorted(os.listdir(os.path.dirname(t["receipt_path"])))
    assert receipts
