"""A prompt plus ``max_new_tokens`` past the engine's context is refused before any work
(``kvpack generate`` and the decode node's local API share :func:`kvpack.generate.check_context`):
it used to fail mid-decode, after the prefill, as an engine error."""

from __future__ import annotations

import pytest

from kvpack.errors import UsageError
from kvpack.generate import check_context, generate

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def engine():
    from kvpack.engine.models import build_llama
    from kvpack.engine.transformers_adapter import TransformersEngine

    return TransformersEngine(build_llama(seed=0, num_hidden_layers=2, max_position_embeddings=512), threads=1)


def test_the_bound_is_prompt_plus_new_tokens(engine):
    assert engine.max_context == 512
    check_context(engine, 500, 12)  # exactly the context: served
    with pytest.raises(UsageError) as exc:
        check_context(engine, 500, 13)
    assert exc.value.category == "usage" and "context of 512 tokens" in exc.value.message


def test_generate_refuses_before_prefilling(engine):
    session_class = type(engine.new_session())
    prefilled = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(session_class, "prefill", lambda self, ids: prefilled.append(len(ids)))
        with pytest.raises(UsageError):
            generate(engine, None, list(range(1, 501)), max_new_tokens=40)
    assert prefilled == []
    assert len(generate(engine, None, list(range(1, 201)), max_new_tokens=4).tokens) == 4
