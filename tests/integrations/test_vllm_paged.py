"""vLLM's paged CPU KV layout <-> kvpack's token-major planes, and the verified prefix store
behind the connector, on real tensors and a real pack store (no vLLM needed).

The tensors have exactly the shape and in-block layout vLLM's CPU attention backend hands a
connector (``[blocks, kv_heads, block_size, 2*head_dim]``; per (block, head): K transposed
``[head_dim, block_size]``, then V ``[block_size, head_dim]``), filled with random values;
with vLLM installed, the layout is also checked against vLLM's own cache-write kernel.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvpack.engine.contract import CacheLayout, EngineIdentity, LayerSpec  # noqa: E402
from kvpack.errors import EngineError, StoreError  # noqa: E402
from kvpack.integrations.vllm.paged import PagedKV, layer_order  # noqa: E402
from kvpack.integrations.vllm.prefix import LoadSpec, PrefixPlanner, SaveSpec, capture, load_prefix, publish, save_cuts  # noqa: E402
from kvpack.store import PackStore  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 3, 2, 8, 32


def paged_caches(num_blocks: int = 64, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn((LAYERS, num_blocks, HEADS, BLOCK, 2 * HEAD_DIM), generator=g)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYERS)}


def slow_rows(cache, block_ids, start, stop):
    """Token-major K and V rows read one element at a time from the documented layout (the
    independent reading the vectorised gather is checked against): per (block, head), K at
    element ``d * BLOCK + t`` of the first half, V at ``t * HEAD_DIM + d`` of the second."""
    flat = cache.reshape(cache.shape[0], HEADS, 2, BLOCK * HEAD_DIM)
    k = torch.empty((stop - start, HEADS * HEAD_DIM))
    v = torch.empty((stop - start, HEADS * HEAD_DIM))
    for t in range(start, stop):
        b, off = block_ids[t // BLOCK], t % BLOCK
        for h in range(HEADS):
            for d in range(HEAD_DIM):
                k[t - start, h * HEAD_DIM + d] = flat[b, h, 0, d * BLOCK + off]
                v[t - start, h * HEAD_DIM + d] = flat[b, h, 1, off * HEAD_DIM + d]
    return k, v


def test_layers_are_ordered_by_index_and_gaps_are_refused():
    assert layer_order(["m.layers.10.a", "m.layers.2.a", *[f"m.layers.{i}.a" for i in (0, 1, 3, 4, 5, 6, 7, 8, 9)]])[:3] == [
        "m.layers.0.a",
        "m.layers.1.a",
        "m.layers.2.a",
    ]
    with pytest.raises(EngineError):
        layer_order(["m.layers.0.a", "m.layers.2.a"])
    with pytest.raises(EngineError):
        layer_order(["lm_head"])


def test_gather_reads_k_then_v_rows_of_each_block_and_head():
    caches = paged_caches()
    paged = PagedKV(caches)
    block_ids = [7, 3, 50, 12]
    rows = paged.gather(1, block_ids, 5, 100)
    k, v = slow_rows(caches["model.layers.1.self_attn.attn"], block_ids, 5, 100)
    assert torch.equal(rows[0], k) and torch.equal(rows[1], v)


def _draw_block_range(data) -> tuple[list[int], int, int]:
    """1-5 distinct blocks of a 16-block cache, a block-aligned start inside them and a row
    count that fits: (block ids, first row, rows)."""
    nblocks = data.draw(st.integers(1, 5))
    block_ids = data.draw(st.lists(st.integers(0, 15), min_size=nblocks, max_size=nblocks, unique=True))
    start = BLOCK * data.draw(st.integers(0, nblocks - 1))
    return block_ids, start, data.draw(st.integers(1, nblocks * BLOCK - start))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_scatter_then_gather_round_trips_and_touches_nothing_else(data):
    caches = paged_caches(num_blocks=16, seed=1)
    paged = PagedKV(caches)
    before = {n: t.clone() for n, t in caches.items()}
    block_ids, start, n = _draw_block_range(data)
    layer = data.draw(st.integers(0, LAYERS - 1))
    rows = torch.randn((2, n, HEADS * HEAD_DIM))
    paged.scatter(layer, block_ids, start, rows)
    assert torch.equal(paged.gather(layer, block_ids, start, start + n), rows)
    # nothing outside the written rows changed: other layers, other blocks, the tail slots
    name = f"model.layers.{layer}.self_attn.attn"
    for other, t in caches.items():
        if other != name:
            assert torch.equal(t, before[other])
    written = {(block_ids[t // BLOCK], t % BLOCK) for t in range(start, start + n)}
    now = caches[name].reshape(16, HEADS, 2, BLOCK * HEAD_DIM)
    old = before[name].reshape(16, HEADS, 2, BLOCK * HEAD_DIM)
    k_now, k_old = now[:, :, 0].reshape(16, HEADS, HEAD_DIM, BLOCK), old[:, :, 0].reshape(16, HEADS, HEAD_DIM, BLOCK)
    v_now, v_old = now[:, :, 1].reshape(16, HEADS, BLOCK, HEAD_DIM), old[:, :, 1].reshape(16, HEADS, BLOCK, HEAD_DIM)
    for b in range(16):
        for slot in range(BLOCK):
            if (b, slot) not in written:
                assert torch.equal(k_now[b, :, :, slot], k_old[b, :, :, slot]) and torch.equal(v_now[b, :, slot], v_old[b, :, slot])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_staged_pieces_in_any_order_commit_exactly_the_scatter_of_the_whole(data):
    """A load stages each verified chunk's rows as it comes (any order, any split, pieces
    crossing block boundaries): committing them writes the same bytes as one scatter of all
    the rows, and nothing before the commit."""
    caches = paged_caches(num_blocks=16, seed=2)
    paged = PagedKV(caches)
    ref_caches = {n: t.clone() for n, t in caches.items()}
    reference = PagedKV(ref_caches)
    before = {n: t.clone() for n, t in caches.items()}
    block_ids, start, n = _draw_block_range(data)
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=4)) if n > 1 else set())
    pieces = list(zip([0, *cuts], [*cuts, n]))
    rows = {layer: torch.randn((2, n, HEADS * HEAD_DIM)) for layer in range(LAYERS)}
    staged = paged.staging(block_ids, start, start + n)
    order = data.draw(st.permutations([(layer, role, a, b) for layer in range(LAYERS) for role in (0, 1) for a, b in pieces]))
    for layer, role, a, b in order:
        staged.write(layer, role, start + a, rows[layer][role, a:b])
    assert all(torch.equal(caches[k], before[k]) for k in caches)  # nothing written yet
    for layer in range(LAYERS):
        staged.commit(layer)
        reference.scatter(layer, block_ids, start, rows[layer])
    for name in caches:
        assert torch.equal(caches[name], ref_caches[name])


def test_staging_refuses_rows_outside_its_range_or_of_another_shape():
    paged = PagedKV(paged_caches(num_blocks=8))
    staged = paged.staging([1, 2], 0, 40)
    with pytest.raises(EngineError):
        staged.write(0, 0, 30, torch.zeros((11, HEADS * HEAD_DIM)))  # rows [30, 41) past the end
    with pytest.raises(EngineError):
        staged.write(0, 2, 0, torch.zeros((4, HEADS * HEAD_DIM)))  # no third plane
    with pytest.raises(EngineError):
        staged.write(0, 0, 0, torch.zeros((4, HEADS * HEAD_DIM), dtype=torch.float16))
    with pytest.raises(EngineError):
        paged.staging([1, 2], 8, 40)  # not block-aligned
    with pytest.raises(EngineError):
        paged.staging([1], 0, 40)  # two blocks needed, one in the table


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_layout_is_the_one_vllms_cache_kernel_writes(dtype):
    pytest.importorskip("vllm")
    from kvpack.integrations.vllm.worker import check_block_layout

    # the kernels take head sizes of 32..512 (SmolLM2's is 64)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros((4, 3, BLOCK, 2 * 64), dtype=getattr(torch, dtype)) for i in range(2)}
    check_block_layout(PagedKV(caches), "vec", "auto")  # raises if the kernel stores blocks otherwise


def test_unusable_tensors_and_ranges_are_refused():
    with pytest.raises(EngineError):
        PagedKV({"model.layers.0.a": torch.zeros(4, 2, 32, 15)})  # odd last dim
    with pytest.raises(EngineError):
        PagedKV({"model.layers.0.a": torch.zeros(4, 2, 32, 16, dtype=torch.int8)})
    paged = PagedKV(paged_caches(num_blocks=8))
    with pytest.raises(EngineError):
        paged.gather(0, [0, 1], 0, 3 * BLOCK)  # more rows than the block table covers
    with pytest.raises(EngineError):
        paged.gather(0, [0, 99], 0, 2 * BLOCK)  # a block outside the cache
    with pytest.raises(EngineError):
        paged.scatter(0, [0, 1], 5, torch.zeros(2, 10, HEADS * HEAD_DIM))  # not block aligned


# -- the prefix store ------------------------------------------------------------------------


LAYOUT = CacheLayout(tuple(LayerSpec(i, "full", HEADS, HEAD_DIM, "f32", "rope") for i in range(LAYERS)), vocab_size=97)


def _identity(**abi) -> EngineIdentity:
    return EngineIdentity(
        model_name="paged-test",
        weights_digest="00" * 32,
        config={"model_type": "llama"},
        tokenizer_digest="11" * 32,
        chat_template_digest="22" * 32,
        context_policy={"max_context": 4096},
        adapter={"name": "none"},
        weight_precision="f32",
        engine_abi={"engine": "vllm-test", "block_size": BLOCK, **abi},
        scalars={},
        layout=LAYOUT,
    )


TOKENS = [(i * 13 + 5) % 97 for i in range(700)]


@pytest.fixture()
def store(tmp_path) -> PackStore:
    return PackStore.init(str(tmp_path / "store"), chunk_bytes=8192)


def _saved(store: PackStore, ids, caches=None, block_ids=tuple(range(22)), prompt_len: int = 512):
    """Save the cuts of the prompt ``TOKENS[:prompt_len]`` (256, 512 and, unless the prompt
    ends on or one past a 256 boundary, its tail cut ``prompt_len - 1``)."""
    paged = PagedKV(caches or paged_caches())
    cuts = save_cuts(prompt_len, 0)
    spec = SaveSpec("r1", tuple(TOKENS[: cuts[-1]]), cuts, block_ids)
    reports = publish(store, capture(paged, LAYOUT, ids, spec), spec.cuts)
    return paged, reports


def test_the_cuts_to_save_are_the_256_boundaries_and_the_prompt_minus_its_last_token():
    assert save_cuts(512, 0) == (256, 512)  # the 512 cut already covers a repeat of this prompt
    assert save_cuts(513, 0) == (256, 512)  # the tail would be the 512 cut itself
    assert save_cuts(700, 0) == (256, 512, 699)
    assert save_cuts(700, 256) == (512, 699) and save_cuts(700, 512) == (699,)
    assert save_cuts(700, 699) == () and save_cuts(200, 0) == (199,) and save_cuts(1, 0) == ()


def test_a_tail_cut_loads_all_but_the_last_token_into_a_partial_block(store):
    ids = _identity().ids()
    src, reports = _saved(store, ids, prompt_len=700)
    assert [r.kind for r in reports] == ["full", "delta", "delta"]  # the tail is a delta on 512
    planner = PrefixPlanner(store, LAYOUT, ids, BLOCK)
    plan = planner.lookup(TOKENS[:700], local=64)
    assert plan.hit is not None and (plan.stored, plan.lo, plan.hi) == (699, 64, 699)  # 699 = 21 blocks + 27 rows
    # another last token finds the same tail; a prompt sharing fewer tokens finds the 512 cut
    assert planner.lookup(TOKENS[:699] + [96], local=0).hi == 699
    assert planner.lookup(TOKENS[:650] + [1] * 50, local=0).stored == 512
    dst_caches = paged_caches(seed=9)
    before = PagedKV(paged_caches(seed=9))
    dst = PagedKV(dst_caches)
    blocks = tuple(range(40, 62))
    load_prefix(store, dst, LAYOUT, ids, _load_spec(plan, blocks))
    for layer in range(LAYERS):
        assert torch.equal(dst.gather(layer, blocks, 64, 699), src.gather(layer, tuple(range(22)), 64, 699))
        # the last block's slots from the prompt's last token on are vLLM's: not written
        assert torch.equal(dst.gather(layer, blocks, 699, 704), before.gather(layer, blocks, 699, 704))
        assert torch.equal(dst.gather(layer, blocks, 0, 64), before.gather(layer, blocks, 0, 64))


def test_saved_cuts_load_into_other_blocks_exactly(store):
    ids = _identity().ids()
    src, reports = _saved(store, ids)
    assert [r.kind for r in reports] == ["full", "delta"]
    planner = PrefixPlanner(store, LAYOUT, ids, BLOCK)
    plan = planner.lookup(TOKENS, local=64)  # vLLM holds two blocks locally
    assert plan.hit is not None and (plan.stored, plan.lo, plan.hi) == (512, 64, 512)
    dst_caches = paged_caches(seed=9)
    dst = PagedKV(dst_caches)
    blocks = tuple(range(40, 62))
    load_prefix(store, dst, LAYOUT, ids, LoadSpec("r2", tuple(TOKENS[:512]), plan.hit.manifest_id, plan.hit.node_id, 512, 64, 512, blocks))
    for layer in range(LAYERS):
        assert torch.equal(dst.gather(layer, blocks, 64, 512), src.gather(layer, tuple(range(22)), 64, 512))
        # the rows vLLM already held locally were not written
        assert torch.equal(dst.gather(layer, blocks, 0, 64), PagedKV(paged_caches(seed=9)).gather(layer, blocks, 0, 64))


def test_the_last_prompt_token_is_always_left_to_vllm(store):
    ids = _identity().ids()
    _saved(store, ids)
    plan = PrefixPlanner(store, LAYOUT, ids, BLOCK).lookup(TOKENS[:512], local=0)
    assert (plan.stored, plan.hi) == (512, 511)  # 512 stored, one token short of the prompt's end
    assert PrefixPlanner(store, LAYOUT, ids, BLOCK).lookup(TOKENS[:257], local=0).hi == 256


def test_another_identity_is_a_miss(store):
    _saved(store, _identity().ids())
    for other in (_identity(block_size=64), _identity(attention_isa="amx")):
        plan = PrefixPlanner(store, LAYOUT, other.ids(), BLOCK).lookup(TOKENS, local=0)
        assert plan.hit is None and plan.stored == 0 and not plan.refusals


def _load_spec(plan, blocks):
    return LoadSpec("r2", tuple(TOKENS[: plan.hit.cut]), plan.hit.manifest_id, plan.hit.node_id, plan.hit.cut, plan.lo, plan.hi, blocks)


def test_a_flipped_chunk_byte_is_refused_writes_nothing_and_is_quarantined(store):
    ids = _identity().ids()
    _saved(store, ids)
    plan = PrefixPlanner(store, LAYOUT, ids, BLOCK).lookup(TOKENS, local=0)
    chain = store.load_chain(plan.hit.manifest_id)
    victim = store.chunk_path(next(iter(chain[0].chunk_refs()))[2].content_id)
    with open(victim, "r+b") as fh:
        fh.seek(os.path.getsize(victim) - 40)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x80]))
    dst_caches = paged_caches(seed=9)
    untouched = {n: t.clone() for n, t in dst_caches.items()}
    with pytest.raises(StoreError):
        load_prefix(store, PagedKV(dst_caches), LAYOUT, ids, _load_spec(plan, tuple(range(40, 62))))
    assert all(torch.equal(dst_caches[n], untouched[n]) for n in dst_caches)
    assert os.listdir(os.path.join(store.path, "quarantine"))
    # the quarantined cut is gone from the index: the next lookup plans the intact 256 cut
    assert PrefixPlanner(store, LAYOUT, ids, BLOCK).lookup(TOKENS, local=0).stored == 256


def test_a_truncated_chunk_is_refused_at_planning_and_the_shallower_cut_is_offered(store):
    ids = _identity().ids()
    _saved(store, ids)
    first = PrefixPlanner(store, LAYOUT, ids, BLOCK).lookup(TOKENS, local=0)
    top = store.load_chain(first.hit.manifest_id)[0]
    victim = store.chunk_path(next(iter(top.chunk_refs()))[2].content_id)
    with open(victim, "r+b") as fh:
        fh.truncate(os.path.getsize(victim) - 1)
    plan = PrefixPlanner(store, LAYOUT, ids, BLOCK).lookup(TOKENS, local=0)
    assert plan.refusals == ["corrupt"] and plan.hit is not None and (plan.stored, plan.hi) == (256, 256)


def test_a_load_of_a_foreign_identity_installs_nothing(store):
    ids = _identity().ids()
    _saved(store, ids)
    plan = PrefixPlanner(store, LAYOUT, ids, BLOCK).lookup(TOKENS, local=0)
    dst_caches = paged_caches(seed=9)
    untouched = {n: t.clone() for n, t in dst_caches.items()}
    with pytest.raises(StoreError):
        load_prefix(store, PagedKV(dst_caches), LAYOUT, _identity(block_size=64).ids(), _load_spec(plan, tuple(range(40, 62))))
    assert all(torch.equal(dst_caches[n], untouched[n]) for n in dst_caches)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs and affinity calls")
def test_a_load_may_use_every_cpu_and_the_compute_thread_gets_its_binding_back():
    import threading

    from kvpack.integrations.vllm.worker import widened_affinity

    cpus = sorted(os.sched_getaffinity(0))
    seen: dict[str, set] = {}

    def compute_thread() -> None:  # bound like vLLM's compute thread, then a load runs on it
        os.sched_setaffinity(0, {cpus[0]})
        with widened_affinity():
            seen["during"] = os.sched_getaffinity(0)
            worker = threading.Thread(target=lambda: seen.update(verifier=os.sched_getaffinity(0)))
            worker.start()
            worker.join()
        seen["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=compute_thread)
    t.start()
    t.join()
    assert seen["during"] == seen["verifier"] == set(cpus)  # a thread made during the load inherits it
    assert seen["after"] == {cpus[0]}
