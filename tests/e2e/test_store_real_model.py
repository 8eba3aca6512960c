"""The store with real transformers models (issue 3 §5): SmolLM2 saved in one process and
restored in another with bit-identical decoding; prefix restore + suffix prefill; Cohere2
windowed layers; identity misses; a damaged object refused with nothing installed."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpack.engine.models import build_cohere2  # noqa: E402
from kvpack.engine.transformers_adapter import TransformersEngine  # noqa: E402
from kvpack.errors import StoreError  # noqa: E402
from kvpack.store import PackStore  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = (
    "Describe, step by step, how a lighthouse keeper of the nineteenth century maintained the lamp, "
    "the lens and the log book, and why each duty mattered to passing ships. "
) * 16

SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys, torch
    from kvpack.engine.models import load_smollm2
    from kvpack.engine.transformers_adapter import TransformersEngine
    from kvpack.generate import chat_tokens
    from kvpack.store import PackStore
    mode, store_dir, prompt, extra = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    eng = TransformersEngine(load_smollm2(), threads=2, prefill_chunk_tokens=256)
    store = PackStore.open(store_dir)
    tokens = chat_tokens(eng, prompt)
    tokens = tokens + [int(t) for t in torch.arange(extra) % 500 + 1000] if extra else tokens
    def logits_hashes(rows):
        return [hashlib.sha256(r.float().contiguous().numpy().tobytes()).hexdigest() for r in rows]
    out = {"prompt_tokens": len(tokens)}
    s = eng.new_session()
    if mode == "save":
        def on_chunk(ss):
            if ss.position % 256 == 0:
                store.save(ss)
        s.prefill(tokens, on_chunk=on_chunk)
        store.save(s)
        out["cache_digest"] = s.cache_digest().hex()
        toks, rows = s.decode_greedy(32)
    elif mode == "restore":
        hit = store.find_deepest(tokens, eng.layout, eng.identity.ids())
        store.restore(hit, s, tokens)
        out["hit"] = hit.cut
        out["cache_digest"] = s.cache_digest().hex()
        toks, rows = s.decode_greedy(32)
    elif mode == "prefix":
        hit = store.find_deepest(tokens, eng.layout, eng.identity.ids())
        store.restore(hit, s, tokens)
        out["hit"] = hit.cut
        s.prefill(tokens[hit.cut:])
        toks, rows = s.decode_greedy(8)
        ref = eng.new_session()
        ref.prefill(tokens)
        out["reference_cache_digest"] = ref.cache_digest().hex()
        rtoks, rrows = ref.decode_greedy(8)
        out["reference_tokens"] = rtoks
        out["reference_logits"] = logits_hashes(rrows)
        out["cache_digest_after"] = s.cache_digest().hex()
        out["reference_digest_after"] = ref.cache_digest().hex()
    out["tokens"] = toks
    out["logits"] = logits_hashes(rows)
    print(json.dumps(out))
    """
)


def _run(*args) -> dict:
    result = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_smollm2_save_in_one_process_restore_in_another(tmp_path):
    store = PackStore.init(str(tmp_path / "store"))
    saved = _run("save", store.path, PROMPT, "0")
    assert saved["prompt_tokens"] > 512
    restored = _run("restore", store.path, PROMPT, "0")
    assert restored["hit"] == saved["prompt_tokens"]  # exact final match: no prefill at all
    assert restored["cache_digest"] == saved["cache_digest"]  # every restored tensor hashes equal
    assert restored["tokens"] == saved["tokens"] and len(saved["tokens"]) == 32
    assert restored["logits"] == saved["logits"]  # every logits row bit-identical
    # a longer prompt sharing the prefix: deepest aligned prefix + suffix prefill, bit-exact
    prefix = _run("prefix", store.path, PROMPT, "300")
    assert prefix["hit"] % 256 == 0 and prefix["hit"] >= 512
    assert prefix["cache_digest_after"] == prefix["reference_digest_after"]
    assert prefix["tokens"] == prefix["reference_tokens"]
    assert prefix["logits"] == prefix["reference_logits"]
    assert PackStore.open(store.path).verify(read_data=True)["ok"]


def _cohere2():
    return TransformersEngine(build_cohere2(seed=0, num_hidden_layers=8, sliding_window=24), threads=2, prefill_chunk_tokens=64)


def test_cohere2_windowed_layers_round_trip_through_the_store(tmp_path):
    eng = _cohere2()
    assert eng.layout.windowed_layers()
    store = PackStore.init(str(tmp_path / "store"), chunk_bytes=64 * 1024)
    tokens = [int(t) for t in torch.randint(0, eng.layout.vocab_size, (700,), generator=torch.Generator().manual_seed(3))]
    src = eng.new_session()
    src.prefill(tokens, on_chunk=lambda s: store.save(s) if s.position % 256 == 0 else None)
    store.save(src)
    digest = src.cache_digest()
    ref_tokens, ref_rows = src.decode_greedy(16)
    hit = store.find_deepest(tokens, eng.layout, eng.identity.ids())
    assert hit.cut == 700
    dst = eng.new_session()
    store.restore(hit, dst, tokens)
    assert dst.cache_digest() == digest
    for layer in eng.layout.windowed_layers():
        lo, hi = dst.retained_range(layer)
        assert (lo, hi) == (700 - eng.layout.layer(layer).window_tokens, 700)
    toks, rows = dst.decode_greedy(16)
    assert toks == ref_tokens and all(torch.equal(a, b) for a, b in zip(rows, ref_rows))
    # prefix restore at 512 then suffix prefill equals uninterrupted chunked prefill
    query = tokens[:600] + [5, 6, 7]
    hit = store.find_deepest(query, eng.layout, eng.identity.ids())
    assert hit.cut == 512
    a = eng.new_session()
    store.restore(hit, a, query)
    a.prefill(query[512:])
    b = eng.new_session()
    b.prefill(query)
    assert a.cache_digest() == b.cache_digest()
    assert torch.equal(a.last_logits, b.last_logits)


def test_identity_changes_are_misses_and_damage_installs_nothing(tmp_path):
    eng = _cohere2()
    store = PackStore.init(str(tmp_path / "store"), encrypted=True, chunk_bytes=64 * 1024)
    tokens = list(range(10, 310))
    s = eng.new_session()
    s.prefill(tokens)
    store.save(s)
    ids = eng.identity.ids()
    assert store.find_deepest(tokens, eng.layout, ids) is not None
    scalars = dict(eng.identity.scalars)
    name = next(n for n in sorted(scalars) if scalars[n])
    changed = [
        eng.identity.replace(scalars={**scalars, name: math.nextafter(float(scalars[name]), math.inf)}),
        eng.identity.replace(tokenizer_digest=hashlib.sha256(b"other tokenizer").hexdigest()),
        eng.identity.replace(weight_precision="bf16"),
    ]
    for identity in changed:
        assert identity.ids() != ids
        assert store.find_deepest(tokens, eng.layout, identity.ids()) is None
    # flip one byte in the middle of every object: restore refuses, live session unchanged
    hit = store.find_deepest(tokens, eng.layout, ids)
    live = eng.new_session()
    live.prefill([1, 2, 3])
    before = live.cache_digest()
    refused = 0
    for sub in ("packs", "logits", "chunks"):
        for name in sorted(os.listdir(os.path.join(store.path, sub)))[:6]:
            path = os.path.join(store.path, sub, name)
            data = bytearray(open(path, "rb").read())
            data[len(data) // 2] ^= 1
            open(path, "wb").write(bytes(data))
            try:
                store.restore(hit, live, tokens)
            except StoreError:
                refused += 1
            else:
                pytest.fail(f"damaged {sub}/{name} was installed")
            finally:
                data[len(data) // 2] ^= 1
                open(path, "wb").write(bytes(data))
            assert live.cache_digest() == before
    assert refused >= 8
    store.restore(hit, live, tokens)
    assert live.position == 300
