"""The Mosaic GPU kernel on a CPU machine: its argument checks, and its lowering to a Mosaic
GPU module for CUDA (catches Pallas / Mosaic lowering errors in CI). Running it needs an sm90
GPU: Mosaic GPU's interpret mode cannot run it (tests in test_mosaic_gpu_gpu.py)."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BlockLayout, block_sparse_attention
from pallas_kernels.block_sparse.mosaic_gpu import block_sparse_attention_mosaic_gpu
from pallas_kernels.block_sparse.mosaic_lists import item_order, stable_descending_order
from pallas_kernels.block_sparse.mosaic_options import (
    auto_persistent,
    default_stages,
    max_stages,
    preferred,
    smem_bytes,
)
from tests.pallas_kernels.helpers import lower_for_cuda, random_qkv


def _zeros_layout(b, t, s, n, bk, **kw):
    nq = -(-t // 128)
    z = lambda *shape: jnp.zeros(shape, jnp.int32)
    return BlockLayout(kv_blocks=z(b, n, nq, 5), kv_block_count=z(b, n, nq), block_q=128, block_k=bk,
                       q_len=t, kv_len=s, **kw)


@pytest.mark.parametrize("dtype,d,bq,bk,causal", [(jnp.bfloat16, 128, 128, 64, True), (jnp.float16, 80, 128, 128, False),
                                                  (jnp.bfloat16, 128, 64, 64, True)])
def test_block_layout_lowers_for_cuda(dtype, d, bq, bk, causal):
    layout = BlockLayout.dense_causal(1000, 1500, block_q=bq, block_k=bk)
    lower_for_cuda((1, 1000, 28, d), (1, 1500, 4, d), dtype, layout, causal=causal)


@pytest.mark.parametrize("column_pass", [None, "mosaic"])
def test_shared_columns_lower_for_cuda(column_pass):
    """Columns shared by every query block and head: gathered once per key / value head, read as windows (by
    default, ``"fused"``, appended to the keys of the block pass; ``"mosaic"``: a launch of their own)."""
    layout = BlockLayout.dense_causal(1000, 1500, block_q=128, block_k=64)
    layout = layout.replace(kv_block_count=jnp.minimum(layout.kv_block_count, 2),
                            kv_columns=jnp.arange(1000, 1300, dtype=jnp.int32)[None, None, None],
                            kv_column_count=jnp.full((1, 1, 8), 300, jnp.int32))
    text = lower_for_cuda((1, 1000, 8, 128), (1, 1500, 2, 128), jnp.bfloat16, layout, block_sparse_attention_mosaic_gpu,
                  sm_scale=0.125, column_pass=column_pass)
    launches = 2 if column_pass == "mosaic" else 1
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == launches
    text = lower_for_cuda((1, 1000, 8, 128), (1, 1500, 2, 128), jnp.bfloat16, layout, block_sparse_attention_mosaic_gpu,
                  sm_scale=0.125, column_pass=column_pass, poison=None)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2 * launches  # both branches of the poison cond


def test_q_block_range_lowers_for_cuda():
    """A layout with work in a few query blocks runs them alone, lists in chunks (`mosaic_gpu._rows_pass`)."""
    layout = BlockLayout.dense_causal(1000, 20000, block_q=128, block_k=64)
    layout = layout.replace(kv_block_count=jnp.where(jnp.arange(8) >= 6, layout.kv_block_count, 0),
                            q_block_range=(6, 8))
    text = lower_for_cuda((1, 1000, 8, 128), (1, 20000, 2, 128), jnp.bfloat16, layout)
    assert text.count("mosaic_gpu") >= 1


@pytest.mark.parametrize("columns,perm_heads,kv_heads,want", [
    (False, 8, 2, True),  # block lists, permuted per head: the kernel copies k / v per head, still preferred
    (True, 0, 2, True),  # single columns, no permutation
    (True, 1, 2, True),  # single columns, one key permutation for every head
    (True, 8, 8, True),  # per-head permutation without grouped heads: no copy
    (True, 8, 2, False),  # per-head permutation over grouped heads: a k / v copy per query head, Triton gathers
])
def test_preferred_sends_column_layouts_to_mosaic_unless_keys_are_permuted_per_grouped_head(
        columns, perm_heads, kv_heads, want):
    b, t, s, n = 1, 300, 700, 8
    nq = -(-t // 128)
    z = lambda *shape: jnp.zeros(shape, jnp.int32)
    kw = dict(kv_columns=z(b, n, nq, 3), kv_column_count=z(b, n, nq)) if columns else {}
    if perm_heads:
        kw["kv_perm"] = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (1, perm_heads, s))
    q = jnp.ones((b, t, n, 128), jnp.bfloat16)
    assert preferred(q, _zeros_layout(b, t, s, n, 64, **kw), kv_heads) is want
    assert not preferred(q.astype(jnp.float32), _zeros_layout(b, t, s, n, 64, **kw), kv_heads)  # Triton's dtype


def test_permuted_layout_with_columns_and_window_lowers_for_cuda():
    b, t, s, n = 2, 300, 700, 8
    nq = -(-t // 128)
    z = lambda *shape: jnp.zeros(shape, jnp.int32)
    layout = _zeros_layout(b, t, s, n, 64, kv_columns=z(b, 1, nq, 70), kv_column_count=z(b, 1, nq),
                           q_perm=z(b, n, t), kv_perm=z(1, n, s), window=192)
    # The Mosaic column pass (the default Triton one needs a GPU to lower its Triton kernel).
    lower_for_cuda((b, t, n, 64), (b, s, 2, 64), jnp.bfloat16, layout, block_sparse_attention_mosaic_gpu,
                   sm_scale=0.125, num_stages=2, column_pass="mosaic")


@pytest.mark.parametrize("change,kw,match", [
    ("f32", {}, r"q: expected dtype bfloat16 or float16"),
    ("bq32", {}, r"layout.block_q: expected one of \(64, 128\)"),
    ("bk16", {}, r"layout.block_k: expected one of \(32, 64, 128\)"),
    ("bk32", {"num_stages": 5}, r"num_stages: expected an int in \[2, 4\].*key_pairs"),  # 32 keys: pairs
    ("d192", {}, r"head dim D <= 128"),
    ("bq64bk128", {}, r"block_q=64 with block_k=128 and D=128 needs"),
    (None, {"num_warps": 4}, r"num_warps: expected None"),
    (None, {"interpret": True}, r"interpret: expected False"),
    (None, {"num_stages": 1}, r"num_stages: expected an int in \[2, "),
    (None, {"num_stages": 9}, r"num_stages: expected an int in \[2, "),
])
def test_mosaic_rejects_unsupported_input_before_launch(change, kw, match):
    d = {"d192": 192, "bq64bk128": 128}.get(change, 64)
    dtype = jnp.float32 if change == "f32" else jnp.bfloat16
    q, k, v = random_qkv(0, 1, 200, 200, 2, 1, d, dtype)
    bq = {"bq32": 32, "bq64bk128": 64}.get(change, 128)
    bk = {"bk16": 16, "bk32": 32, "bq64bk128": 128}.get(change, 64)
    layout = BlockLayout.dense_causal(200, 200, block_q=bq, block_k=bk)
    with pytest.raises(ValueError, match=match):
        block_sparse_attention(q, k, v, layout, implementation="mosaic_gpu", **kw)


def test_default_stages_fit_shared_memory():
    assert default_stages(64, 128) == 4 and default_stages(128, 128) == 2 and default_stages(64, 128, 64) == 2
    for bq, bk, d in ((128, 64, 64), (128, 64, 128), (128, 128, 64), (128, 128, 128), (64, 64, 64), (64, 64, 128),
                      (64, 128, 64)):
        st = default_stages(bk, d, bq)
        assert 2 <= st <= max_stages(bk, d, bq) <= 4 and smem_bytes(bk, d, st, bq) <= 227 * 1024, (bq, bk, d)


@pytest.mark.parametrize("bq,perm", [(64, False), (64, True), (128, True)])
def test_most_stages_that_fit_lower_for_cuda(bq, perm):
    """The largest stage count `check_supported` accepts compiles within the 227 KiB of shared memory (Mosaic GPU
    counts the bytes while lowering), with and without original positions, and one more is rejected up front."""
    bk = 128 if bq == 128 else 64
    layout = BlockLayout.dense_causal(1000, 1000, block_q=bq, block_k=bk)
    if perm:
        p = jnp.asarray(np.random.default_rng(0).permutation(1000), jnp.int32)[None, None]
        layout = dataclasses.replace(layout, q_perm=p, kv_perm=p)
    st = max_stages(bk, 128, bq)
    assert st == 3
    lower_for_cuda((1, 1000, 8, 128), (1, 1000, 8, 128), jnp.bfloat16, layout, num_stages=st)
    with pytest.raises(ValueError, match="num_stages"):
        lower_for_cuda((1, 1000, 8, 128), (1, 1000, 8, 128), jnp.bfloat16, layout, num_stages=st + 1)


def _dense_variant(t, bq, bk, perm, windows, **window_kw):
    """The dense causal layout of ``t`` tokens, with one random permutation of rows and keys (``perm``) and read as
    key windows (``windows``, extra fields ``window_kw``)."""
    layout = BlockLayout.dense_causal(t, t, block_q=bq, block_k=bk)
    if perm:
        p = jnp.asarray(np.random.default_rng(0).permutation(t), jnp.int32)[None, None]
        layout = dataclasses.replace(layout, q_perm=p, kv_perm=p)
    if windows:
        layout = dataclasses.replace(layout, kv_windows=True, **window_kw)
    return layout


@pytest.mark.parametrize("bq,perm,windows,bk", [(64, False, False, 64), (64, True, False, 64), (128, True, False, 64),
                                                (64, False, True, 64), (64, True, True, 32), (128, False, False, 32)])
def test_key_pairs_lower_for_cuda(bq, perm, windows, bk):
    """``key_pairs=True`` (two 64-key entries per 128-key stage, or two 32-key ones per 64-key stage) lowers with
    its default stages in the 227 KiB, with and without positions and key windows; one more K stage is over the
    shared memory Mosaic GPU counts (as `smem_bytes` says) and is refused before tracing. 32-key entries one per
    step do not lower (wgmma's K of 64 with the 128-byte swizzle) and are refused."""
    t = 1000
    layout = _dense_variant(t, bq, bk, perm, windows)
    run = functools.partial(lower_for_cuda, (1, t, 8, 128), (1, t, 8, 128), jnp.bfloat16, layout,
                            block_sparse_attention_mosaic_gpu, sm_scale=0.1, key_pairs=True)
    run()
    st = max_stages(bk, 128, bq, pair=True)
    assert st == {(64, 64): 2, (128, 64): 3, (64, 32): 3, (128, 32): 4}[bq, bk]
    if st < 4:
        assert smem_bytes(bk, 128, st + 1, bq, pair=True) > 227 * 1024
        with pytest.raises(ValueError, match=rf"num_stages: expected an int in \[2, {st}\]"):
            run(num_stages=st + 1)
    if bk == 32:
        run(num_stages=st)
        with pytest.raises(ValueError, match="key_pairs: expected True or None for layout.block_k=32"):
            run(key_pairs=False)


@pytest.mark.parametrize("bq,bk,pairs,perm,windows", [(64, 64, False, False, False), (128, 64, True, False, False),
                                                   (64, 32, True, False, True), (128, 64, False, True, False)])
def test_overlap_lowers_for_cuda(bq, bk, pairs, perm, windows):
    """``overlap=True`` (step j + 1's S, then step j's P V; step j + 1's softmax while P V runs) lowers, with and
    without the schedule barrier (``pingpong``; also the default steps without it), with 64- and 128-row query
    blocks, one or two entries per step, key windows and original positions; with positions and one V stage per ring
    (64-row query blocks, 128-key steps) it is refused before tracing."""
    t = 1000
    layout = _dense_variant(t, bq, bk, perm, windows, window_align=8)
    run = functools.partial(lower_for_cuda, (1, t, 8, 128), (1, t, 8, 128), jnp.bfloat16, layout,
                            block_sparse_attention_mosaic_gpu, sm_scale=0.1, key_pairs=pairs, overlap=True)
    run()
    run(pingpong=False)
    run(overlap=False, pingpong=False)
    if perm:
        one_v = _dense_variant(t, 64, 64, perm=True, windows=False)
        with pytest.raises(ValueError, match="overlap: needs two V stages"):
            lower_for_cuda((1, t, 8, 128), (1, t, 8, 128), jnp.bfloat16, one_v, block_sparse_attention_mosaic_gpu,
                   sm_scale=0.1, key_pairs=True, overlap=True)


def test_key_pairs_shared_memory_count():
    """Two K stages and one V stage of 128 keys per consumer (64-row blocks): 231,576 bytes with positions."""
    assert smem_bytes(64, 128, 2, 64, pair=True) == 231_576
    assert smem_bytes(64, 128, 2, 128, pair=True) == smem_bytes(128, 128, 2, 128)
    with pytest.raises(ValueError, match="key_pairs"):
        block_sparse_attention_mosaic_gpu(*random_qkv(0, 1, 200, 200, 2, 1, 64, jnp.bfloat16),
                                          BlockLayout.dense_causal(200, 200, block_q=128, block_k=128),
                                          sm_scale=0.1, key_pairs=True)


@pytest.mark.parametrize("bq,bk,perm,windows,extra", [(128, 64, False, False, {}), (64, 64, False, False, {}),
                                                      (128, 64, True, False, {}), (64, 32, False, True, {}),
                                                      (64, 64, False, False, {"overlap": True}),
                                                      (128, 128, True, False, {"column_pass": "mosaic"})])
def test_persistent_grid_lowers_for_cuda(bq, bk, perm, windows, extra):
    """``persistent=True``: one CTA per multiprocessor looping over the work items in `item_order` (more items than
    the abstract H100's 132 multiprocessors here), with its own O tiles: with original positions, key windows,
    ``overlap`` and the Mosaic column pass; its stages fit the 227 KiB with the O tiles."""
    t = 3000
    layout = _dense_variant(t, bq, bk, perm, windows, window_align=8)
    if extra.get("column_pass"):
        nq = layout.num_q_blocks
        layout = layout.replace(kv_columns=jnp.zeros((1, 1, nq, 20), jnp.int32),
                                kv_column_count=jnp.full((1, 1, nq), 20, jnp.int32))
    lower_for_cuda((1, t, 16, 128), (1, t, 4, 128), jnp.bfloat16, layout, block_sparse_attention_mosaic_gpu,
           sm_scale=0.1, persistent=True, **extra)
    pair = bk == 32 or (bq == 128 and bk == 64)
    st = max_stages(bk, 128, bq, pair=pair, persistent=True)
    assert 2 <= st and smem_bytes(bk, 128, st, bq, pair=pair, persistent=True) <= 227 * 1024
    assert smem_bytes(bk, 128, st, bq, pair=pair, persistent=True) == smem_bytes(bk, 128, st, bq, pair=pair) + 32768


def test_persistent_grid_refuses_what_does_not_fit_with_its_o_tiles():
    """64-row query blocks with 128-key steps fit 227 KiB only without the persistent grid's O tiles."""
    q, k, v = random_qkv(0, 1, 300, 300, 2, 2, 128, jnp.bfloat16)
    layout = BlockLayout.dense_causal(300, 300, block_q=64, block_k=64)
    with pytest.raises(ValueError, match="on the persistent grid"):
        block_sparse_attention_mosaic_gpu(q, k, v, layout, sm_scale=0.1, key_pairs=True, persistent=True)
    lower_for_cuda((1, 300, 2, 128), (1, 300, 2, 128), jnp.bfloat16, layout, block_sparse_attention_mosaic_gpu,
           sm_scale=0.1, key_pairs=True)


def test_auto_persistent_takes_short_work_that_fits():
    """`auto_persistent`: at most 7,168 work items with lists of at most 128 steps, or lists of 2 to 6 steps, where
    the O tiles fit."""
    q = lambda t, n, b=1: jax.ShapeDtypeStruct((b, t, n, 128), jnp.bfloat16)  # noqa: E731
    sparse = lambda t, bq=128, bk=128: BlockLayout.random_causal(  # noqa: E731
        jax.random.PRNGKey(0), t, t, keep=0.03, block_q=bq, block_k=bk)
    assert auto_persistent(q(32768, 28), sparse(32768), pair=False)  # 7,168 items, 9 steps
    assert auto_persistent(q(32768, 28), sparse(32768, bk=64), pair=True)
    assert not auto_persistent(q(32768, 28, b=2), sparse(32768), pair=False)  # 14,336 items
    assert not auto_persistent(q(131072, 28), sparse(131072), pair=False)
    dense = BlockLayout.dense_causal(32768, 32768, block_q=128, block_k=128)
    assert not auto_persistent(q(32768, 28), dense, pair=False)  # 256 steps
    short = BlockLayout.dense_causal(16384, 16384, block_q=128, block_k=128)
    assert auto_persistent(q(16384, 8), short, pair=False)  # 128 steps
    assert not auto_persistent(q(16384, 8), short, pair=False, max_entries=129)  # (fused: with column tiles)
    assert not auto_persistent(q(131072, 8), sparse(131072, bq=64, bk=64), pair=False)  # 8,192 items
    assert not auto_persistent(q(16384, 8), sparse(16384, bq=64, bk=64), pair=True)  # 128-key steps: no room
    assert auto_persistent(q(16384, 8), sparse(16384, bq=64, bk=64), pair=False)
    # and any number of items with lists of 2 to 6 steps (Grid's band: 5 64-key entries, 3 steps)
    nq = 131072 // 128
    fixed = lambda n, bk=64: BlockLayout(  # noqa: E731
        kv_blocks=jnp.zeros((1, 1, nq, n), jnp.int32), kv_block_count=jnp.full((1, 1, nq), n, jnp.int32),
        block_q=128, block_k=bk, q_len=131072, kv_len=131072)
    assert auto_persistent(q(131072, 28), fixed(5), pair=True)
    assert auto_persistent(q(131072, 28), fixed(12), pair=True) and auto_persistent(q(131072, 28), fixed(6, 128),
                                                                                     pair=False)
    assert not auto_persistent(q(131072, 28), fixed(2), pair=True)  # one step
    assert not auto_persistent(q(131072, 28), fixed(13), pair=True)  # 7 steps
    assert not auto_persistent(q(131072, 28), fixed(7, 128), pair=False)
    # 128-key stages: 3 fit one CTA per item, 2 with the O tiles; a third stage asked for keeps the item grid
    assert max_stages(128, 128, 128) == 3 and max_stages(128, 128, 128, persistent=True) == 2
    assert auto_persistent(q(4096, 8), sparse(4096), pair=False, stages=2)
    assert not auto_persistent(q(4096, 8), sparse(4096), pair=False, stages=3)


def test_item_order_puts_the_longest_items_first_and_keeps_ties_in_item_order():
    """`item_order`: items by steps, descending; item w is (batch w // (N * ctas), head w // ctas % N, 128-row
    block ctas - 1 - w % ctas); 64-row blocks count the longer list of their pair, pairs of entries count halves."""
    rng = np.random.default_rng(0)
    b, n, ctas = 2, 3, 5
    for bq, nq, pair in ((128, ctas, False), (128, ctas, True), (64, 2 * ctas - 1, False)):
        count = jnp.asarray(rng.integers(0, 9, (b, n, nq)), jnp.int32)
        order = np.asarray(item_order(count, block_q=bq, ctas=ctas, batch=b, heads=n, pair=pair))
        assert sorted(order.tolist()) == list(range(b * n * ctas))
        c = np.asarray(count)
        if pair:
            c = (c + 1) // 2
        if bq == 64:
            c = np.pad(c, ((0, 0), (0, 0), (0, 1))).reshape(b, n, ctas, 2).max(-1)
        steps = [c[w // (n * ctas), w // ctas % n, ctas - 1 - w % ctas] for w in order]
        assert all(x >= y for x, y in zip(steps, steps[1:])), steps
        ties = [[w for w, st in zip(order, steps) if st == v] for v in set(steps)]
        assert all(t == sorted(t) for t in ties)
    one_head = item_order(jnp.array([[[3, 1, 2]]], jnp.int32), block_q=128, ctas=3, batch=2, heads=2, pair=False)
    # counts broadcast over batch and heads: block 0 (3 entries) is item 2 of each (batch, head), block 2 item 0
    assert np.asarray(one_head).tolist() == [2, 5, 8, 11, 0, 3, 6, 9, 1, 4, 7, 10]


def test_item_order_heads_first_decodes_items_with_the_heads_fastest():
    """`item_order(heads_first=True)`: item w is (batch w // (N * ctas), head w % N, 128-row block ctas - 1 - w // N %
    ctas); the same items by steps, descending, ties in item order (so the heads of a query block stay together)."""
    rng = np.random.default_rng(1)
    b, n, ctas = 2, 3, 5
    count = jnp.asarray(rng.integers(0, 4, (b, n, ctas)), jnp.int32)
    order = np.asarray(item_order(count, block_q=128, ctas=ctas, batch=b, heads=n, pair=False, heads_first=True))
    assert sorted(order.tolist()) == list(range(b * n * ctas))
    c = np.asarray(count)
    steps = [c[w // (n * ctas), w % n, ctas - 1 - w // n % ctas] for w in order]
    assert all(x >= y for x, y in zip(steps, steps[1:])), steps
    assert all(t == sorted(t) for t in [[w for w, st in zip(order, steps) if st == v] for v in set(steps)])
    same = item_order(jnp.ones((1, 1, 3), jnp.int32), block_q=128, ctas=3, batch=1, heads=2, pair=False,
                      heads_first=True)
    assert np.asarray(same).tolist() == list(range(6))


def test_item_order_groups_runs_each_key_value_head_longest_first_before_the_next():
    """`item_order(groups=g)`: the items of batch 0's first g query heads (key / value head 0) come first, then key /
    value head 1's, ..., batch by batch; within a group most steps first, ties in item order; the same order by
    counting and by XLA's sort, with heads fastest too; a group size that does not divide the heads is named."""
    rng = np.random.default_rng(3)
    b, n, g, ctas = 2, 6, 3, 5
    count = jnp.asarray(rng.integers(0, 7, (b, n, ctas)), jnp.int32)
    c = np.asarray(count)
    for heads_first in (False, True):
        kw = dict(block_q=128, ctas=ctas, batch=b, heads=n, pair=False, heads_first=heads_first, groups=g)
        order = np.asarray(item_order(count, **kw))
        assert sorted(order.tolist()) == list(range(b * n * ctas))
        head = order % n if heads_first else order // ctas % n
        block = ctas - 1 - (order // n % ctas if heads_first else order % ctas)
        batch = order // (n * ctas)
        group = batch * (n // g) + head // g
        assert np.all(np.diff(group) >= 0), group
        for x in range(b * n // g):
            mine = order[group == x]
            steps = c[batch[group == x], head[group == x], block[group == x]]
            assert np.all(np.diff(steps) <= 0), steps
            assert all(t == sorted(t) for t in [[w for w, st in zip(mine, steps) if st == v] for v in set(steps)])
        np.testing.assert_array_equal(order, np.asarray(item_order(count, method="sort", **kw)))
    with pytest.raises(ValueError, match="groups: expected a divisor of heads=6"):
        item_order(count, block_q=128, ctas=ctas, batch=b, heads=n, pair=False, groups=4)


def test_item_order_by_counting_is_the_sorts_order():
    """`item_order(method="rank")` (`stable_descending_order`, the default up to `RANK_ORDER_ITEMS` items) gives
    XLA's stable sort's order on random counts with many ties, few ties and one value, for every item layout; an
    unknown method is named."""
    rng = np.random.default_rng(2)
    b, n, ctas = 2, 3, 7
    for hi in (1, 3, 1000):
        for bq, nq, pair, heads_first in ((128, ctas, False, False), (128, ctas, True, True),
                                          (64, 2 * ctas - 1, False, False)):
            count = jnp.asarray(rng.integers(0, hi, (b, n, nq)), jnp.int32)
            kw = dict(block_q=bq, ctas=ctas, batch=b, heads=n, pair=pair, heads_first=heads_first)
            rank = np.asarray(item_order(count, method="rank", **kw))
            np.testing.assert_array_equal(rank, np.asarray(item_order(count, method="sort", **kw)))
            np.testing.assert_array_equal(rank, np.asarray(item_order(count, **kw)))
    cost = jnp.asarray(rng.integers(0, 50, 300), jnp.int32)
    np.testing.assert_array_equal(np.asarray(stable_descending_order(cost)),
                                  np.argsort(-np.asarray(cost), kind="stable"))
    assert stable_descending_order(jnp.zeros(0, jnp.int32)).shape == (0,)
    huge = jnp.array([5, 2**30, 7, 2**31 - 1, 2**30], jnp.int32)  # past the key's cap: tied, in index order
    assert np.asarray(stable_descending_order(huge)).tolist() == [1, 3, 4, 2, 0]
    with pytest.raises(ValueError, match="method: expected 'auto', 'rank' or 'sort'; received 'heap'"):
        item_order(count, block_q=128, ctas=ctas, batch=b, heads=n, pair=False, method="heap")


@pytest.mark.parametrize("bq,persistent,perm", [(128, False, False), (64, True, False), (128, True, True)])
def test_heads_first_lowers_for_cuda(bq, persistent, perm):
    """``heads_first=True`` on the item grid and the persistent grid, with and without original positions."""
    t = 3000
    layout = _dense_variant(t, bq, 64, perm, False)
    lower_for_cuda((1, t, 16, 128), (1, t, 4, 128), jnp.bfloat16, layout, block_sparse_attention_mosaic_gpu,
           sm_scale=0.1, persistent=persistent, heads_first=True)
    q, k, v = random_qkv(0, 1, 300, 300, 4, 2, 128, jnp.bfloat16)
    with pytest.raises(ValueError, match="^heads_first: expected True or False; received 1"):
        block_sparse_attention_mosaic_gpu(q, k, v, BlockLayout.dense_causal(300, 300), sm_scale=0.1, heads_first=1)


@pytest.mark.parametrize("profile,match", [((0, "/tmp"), r"profile\[0\]"), ((8, ""), "profile: expected"),
                                           ("/tmp", "profile: expected")])
def test_mosaic_rejects_a_bad_profile_request(profile, match):
    q = jnp.ones((1, 256, 2, 128), jnp.bfloat16)
    layout = BlockLayout.dense_causal(256, 256, block_q=128, block_k=64)
    with pytest.raises(ValueError, match=match):
        block_sparse_attention_mosaic_gpu(q, q, q, layout, sm_scale=0.1, profile=profile)


@pytest.mark.parametrize("bq,persistent,pair", [(128, False, True), (128, True, True), (64, False, False)])
def test_strided_rows_lower_for_cuda(bq, persistent, pair):
    """`BlockLayout.q_row_stride` (Grid's phase-major rows): q and out as ``[B, T / stride, stride, N, D]`` views with
    each query block one strided box (TMA), on one CTA per item and on the persistent grid, 128- and 64-row blocks."""
    t, st = 4096, 16
    q_perm = np.concatenate([np.arange(p, t, st) for p in range(st)]).astype(np.int32)[None, None]
    layout = BlockLayout.random_causal(jax.random.PRNGKey(1), t, t, keep=0.1, block_q=bq, block_k=64).replace(
        q_perm=jnp.asarray(q_perm), q_row_stride=st)
    run = functools.partial(lower_for_cuda, (1, t, 8, 128), (1, t, 2, 128), jnp.bfloat16,
                            attention=block_sparse_attention_mosaic_gpu, sm_scale=0.1, persistent=persistent,
                            key_pairs=pair)
    gathers = [run(lay).count("stablehlo.gather") for lay in (layout, layout.replace(q_row_stride=0))]
    assert gathers[0] == gathers[1] - 2  # no gather of q into the blocks' row order, none of out back
