"""Hypothesis strategies for valid production-v1 families, manifests, chunks and packs."""

from __future__ import annotations

from hypothesis import strategies as st

from kvpack.format import constants as C
from kvpack.format.build import build_schema
from kvpack.format.objects import Family, FamilyState, StateKey

ids = st.binary(min_size=32, max_size=32).filter(lambda b: b != bytes(32))
names = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), min_size=1, max_size=12).filter(
    lambda s: 1 <= len(s.encode()) <= 255
)


@st.composite
def family_states(draw):
    n = draw(st.integers(1, 4))
    keys = draw(st.lists(st.tuples(st.integers(0, 5), names), min_size=n, max_size=n, unique=True))
    keys = sorted((StateKey(layer, name) for layer, name in keys), key=lambda k: k.sort_key())
    # drop keys that collide after sorting (unique by layer/name bytes is guaranteed above)
    states = []
    for key in keys:
        rank = draw(st.integers(1, 3))
        axis = draw(st.integers(0, rank - 1))
        dims = tuple(0 if i == axis else draw(st.integers(1, 6)) for i in range(rank))
        elements = 1
        for d in dims:
            if d:
                elements *= d
        states.append(
            FamilyState(
                key=key,
                dtype=draw(st.sampled_from(sorted(C.DTYPE_WIDTHS))),
                codec=draw(st.sampled_from(C.CODECS)),
                dims=dims,
                token_axis=axis,
                elements_per_token=elements,
            )
        )
    return tuple(states)


@st.composite
def families(draw):
    return Family(
        engine_cache_abi=draw(ids),
        topology=draw(ids),
        shard_map=draw(ids),
        states=draw(family_states()),
        mode=draw(st.sampled_from((C.MODE_NATIVE, C.MODE_PORTABLE))),
        page_size_tokens=draw(st.integers(1, 4096)),
    )


@st.composite
def schemas_for(draw, family: Family, cut: int):
    chunk_bytes = draw(st.sampled_from((1, 7, 64, 4096, C.MAX_CHUNK_PLAINTEXT)))
    return build_schema(family, cut, max_chunk_bytes=chunk_bytes)
