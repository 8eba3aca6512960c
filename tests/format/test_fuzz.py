"""Fuzzing every production-v1 decoder with random and mutated bytes.

The only acceptable outcomes are a typed FormatError or a successful decode whose canonical
re-encoding equals the input. ``test_mutation_fuzz`` feeds >= 100,000 inputs (CI runs it).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpack.errors import FormatError
from kvpack.format import (
    Family,
    Manifest,
    Schema,
    StateDeclaration,
    StatsSidecar,
    decode_chunk,
    decode_pack,
    verify_chunk_standalone,
)
from kvpack.format import constants as C
from kvpack.format.codec import decode_frame
from kvpack.format.fixtures import fixture_keys, reference_delta_chain, reference_fixture, suites

KEYS = fixture_keys()


def _decoders():
    """name -> (seed inputs, decode function returning canonical bytes or None)."""
    seeds: dict[str, list[bytes]] = {k: [] for k in ("state", "family", "schema", "manifest", "raw", "lossless", "chunk", "pack", "sidecar")}
    chunk_ctx = []
    for combo in suites():
        objs = dict(reference_fixture(*combo))
        seeds["state"].append(objs["state_declaration"])
        seeds["family"].append(objs["family"])
        seeds["schema"].append(objs["schema"])
        seeds["manifest"].append(objs["manifest"])
        seeds["raw"].append(objs["raw_frame"])
        seeds["lossless"].append(objs["lossless_frame"])
        seeds["chunk"].append(objs["chunk"])
        seeds["pack"].append(objs["pack"])
        chain = dict(reference_delta_chain(*combo))
        seeds["manifest"].append(chain["stage-3/manifest"])
        seeds["pack"].append(chain["stage-5/pack"])
        m, _ = decode_pack(objs["pack"], KEYS)
        chunk_ctx.append((m, next(m.chunk_refs())))
    side = StatsSidecar.from_f16(bytes(64), 4, 2)
    seeds["sidecar"].append(side.encode())
    m, (key, span, ref) = chunk_ctx[0]

    def chunk(data):
        decode_chunk(data, ref=ref, span=span, tenant=m.tenant, family=m.family, key=key, keys=KEYS)
        return None

    def chunk_standalone(data):
        verify_chunk_standalone(data, KEYS)
        return None

    def pack(data):
        decode_pack(data, KEYS)
        return None

    return seeds, {
        "state": lambda d: StateDeclaration.decode(d).encode(),
        "family": lambda d: Family.decode(d).encode(),
        "schema": lambda d: Schema.decode(d).encode(),
        "manifest": lambda d: Manifest.decode(d).encode(),
        "raw": lambda d: (decode_frame(C.CODEC_RAW, d, 16), None)[1],
        "lossless": lambda d: (decode_frame(C.CODEC_LOSSLESS, d, 16), None)[1],
        "chunk": chunk,
        "chunk-standalone": chunk_standalone,
        "pack": pack,
        "sidecar": lambda d: StatsSidecar.decode(d).encode(),
    }


SEEDS, DECODERS = _decoders()
SEEDS["chunk-standalone"] = SEEDS["chunk"]


def _feed(name: str, data: bytes) -> bool:
    """True if accepted. Accepted canonical objects must re-encode to the input."""
    try:
        canonical = DECODERS[name](data)
    except FormatError:
        return False
    if canonical is not None:
        assert canonical == data, name
    return True


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    op = rng.randrange(8)
    if op == 0 and b:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 1 and b:
        b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 2:
        del b[rng.randrange(len(b) + 1) :]
    elif op == 3:
        pos = rng.randrange(len(b) + 1)
        b[pos:pos] = rng.randbytes(rng.randint(1, 16))
    elif op == 4 and len(b) >= 2:
        pos = rng.randrange(len(b) - 1)
        b[pos : pos + 2] = rng.choice([b"\xff\xff", b"\0\0", b"\x01\0", b"\0\x01", b"\xff\x7f"])
    elif op == 5 and len(b) >= 8:
        pos = rng.randrange(len(b) - 7)
        b[pos : pos + 8] = rng.choice([b"\xff" * 8, bytes(8), (1 << 63).to_bytes(8, "little"), (2**32).to_bytes(8, "little")])
    elif op == 6 and b:
        pos = rng.randrange(len(b))
        del b[pos : pos + rng.randint(1, 32)]
    else:
        b = bytearray(rng.randbytes(rng.randint(0, 64))) if rng.random() < 0.5 else b + bytes(rng.randint(1, 4096))
    return bytes(b)


@pytest.mark.fuzz
def test_mutation_fuzz():
    rng = random.Random(0x6B7670616B)
    total = accepted = 0
    per_decoder = 11_000
    for name in DECODERS:
        for _ in range(per_decoder):
            data = _mutate(rng, rng.choice(SEEDS[name]))
            accepted += _feed(name, data)
            total += 1
    assert total >= 100_000
    assert accepted < total  # the corpus really exercises refusals


@pytest.mark.fuzz
def test_authenticated_objects_accept_only_their_exact_bytes():
    """For the verified chunk and pack decoders, any accepted input is an original object."""
    rng = random.Random(0x61757468)
    for name in ("chunk", "pack"):
        originals = set(SEEDS[name])
        for _ in range(4_000):
            data = _mutate(rng, rng.choice(SEEDS[name]))
            if _feed(name, data):
                assert data in originals, name


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(DECODERS)), data=st.binary(max_size=2048))
def test_arbitrary_bytes(name, data):
    _feed(name, data)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(DECODERS)), data=st.data())
def test_hypothesis_guided_mutations(name, data):
    seed = data.draw(st.sampled_from(SEEDS[name]))
    pos = data.draw(st.integers(0, max(0, len(seed) - 1)))
    value = data.draw(st.integers(0, 255))
    mutated = bytearray(seed)
    if mutated:
        mutated[pos] = value
    _feed(name, bytes(mutated))
