"""`union_of_pairs` (the lists of the Mosaic GPU kernel's ``union_lists`` mode) against a plain-Python reading of
the layout, and the mode's argument checks and lowering on a CPU machine (its runs are in test_mosaic_gpu_gpu.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BlockLayout
from pallas_kernels.block_sparse.mosaic_gpu import block_sparse_attention_mosaic_gpu
from pallas_kernels.block_sparse.pair_union import union_of_pairs
from tests.pallas_kernels.block_sparse.test_mosaic_gpu import _lower
from tests.pallas_kernels.block_sparse.test_windows import random_window_layout
from tests.pallas_kernels.helpers import random_layout


def _random_lists(rng, lead, nq, m, nk):
    """Distinct ids per query block in random order, some out of range, random counts (some 0, some past the
    ids in range)."""
    blocks = np.stack([rng.permutation(np.arange(-2, nk + 3))[:m] for _ in range(int(np.prod(lead)) * nq)])
    count = rng.integers(0, m + 1, size=lead + (nq,))
    return blocks.reshape(lead + (nq, m)).astype(np.int32), count.astype(np.int32)


@pytest.mark.parametrize("lead,nq,m,nk", [((1, 1), 6, 5, 9), ((2, 3), 7, 4, 6), ((1, 2), 1, 8, 20)])
def test_union_of_pairs_lists_each_pairs_blocks_once_and_each_query_blocks_own(lead, nq, m, nk):
    rng = np.random.default_rng(nq * m + nk)
    blocks, count = _random_lists(rng, lead, nq, m, nk)
    u = union_of_pairs(jnp.asarray(blocks), jnp.asarray(count), nk)
    nc = -(-nq // 2)
    assert u.ids.shape == lead + (nc, 2 * m) and u.own.shape == lead + (nc, 2, m)
    assert u.count.shape == lead + (nc,) and u.own_count.shape == lead + (nc, 2)
    ids, cnt, own, own_cnt = (np.asarray(x) for x in u)
    for idx in np.ndindex(*lead):
        for c in range(nc):
            lists = []
            for w in range(2):
                qb = 2 * c + w
                lists.append({int(x) for x in blocks[idx][qb, :count[idx][qb]] if 0 <= x < nk} if qb < nq else set())
            union = sorted(lists[0] | lists[1])
            assert list(ids[idx][c, :cnt[idx][c]]) == union
            assert not ids[idx][c, cnt[idx][c]:].any()
            for w in range(2):
                steps = own[idx][c, w, :own_cnt[idx][c, w]]
                assert list(steps) == sorted(steps) and len(set(steps)) == len(steps)
                assert {union[j] for j in steps} == lists[w]


def test_union_of_pairs_broadcasts_leads_and_query_blocks():
    """A list shared by every head and query block (``[1, 1, 1, M]``) against counts per head: the union of a
    list with itself is the list, and both consumers own all of it."""
    blocks = jnp.asarray([[[[5, 1, 3]]]], jnp.int32)
    count = jnp.asarray(np.array([[[3, 3, 2, 3, 1]] * 2]), jnp.int32)  # [1, 2, 5]
    u = union_of_pairs(blocks, count, 8)
    assert u.ids.shape == (1, 2, 3, 6)
    np.testing.assert_array_equal(u.count[0, 0], [3, 3, 1])
    np.testing.assert_array_equal(u.ids[0, 0, 1, :3], [1, 3, 5])
    np.testing.assert_array_equal(u.own_count[0, 0], [[3, 3], [2, 3], [1, 0]])
    np.testing.assert_array_equal(u.own[0, 0, 1, 0, :2], [0, 2])  # blocks 5 and 1 of the union [1, 3, 5]


def test_union_of_pairs_rejects_bad_operands():
    with pytest.raises(ValueError, match="blocks, count"):
        union_of_pairs(jnp.zeros((2, 3, 4), jnp.int32), jnp.zeros((2, 3), jnp.int32), 4)
    with pytest.raises(ValueError, match="blocks, count"):
        union_of_pairs(jnp.zeros((1, 1, 2, 4), jnp.float32), jnp.zeros((1, 1, 2), jnp.int32), 4)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        union_of_pairs(jnp.zeros((1, 1, 2, 4), jnp.int32), jnp.zeros((1, 1, 2), jnp.int32), 0)


@pytest.mark.parametrize("perm,stages,bk,d", [(False, None, 64, 128), (True, 3, 64, 128), (True, None, 128, 64)])
def test_union_lists_lower_for_cuda(perm, stages, bk, d):
    """With permutations and single columns in the Mosaic column pass (64-row mode: its own stage count)."""
    rng = np.random.default_rng(3 + perm)
    layout = random_layout(rng, 1, 4, 1000, 1300, 64, bk, density=0.3, perm=perm, columns=24 if perm else 0)
    _lower((1, 1000, 4, d), (1, 1300, 2, d), jnp.bfloat16, layout, block_sparse_attention_mosaic_gpu,
           sm_scale=0.1, union_lists=True, num_stages=stages, column_pass="mosaic")


def test_union_lists_refuses_layouts_it_does_not_run():
    rng = np.random.default_rng(5)
    q = jnp.ones((1, 300, 4, 128), jnp.bfloat16)
    k = jnp.ones((1, 300, 2, 128), jnp.bfloat16)
    run = lambda lay, **kw: block_sparse_attention_mosaic_gpu(q, k, k, lay, sm_scale=0.1,  # noqa: E731
                                                              union_lists=True, **kw)
    with pytest.raises(ValueError, match="union_lists: .*block_q=128"):
        run(BlockLayout.dense_causal(300, 300, block_q=128, block_k=64))
    with pytest.raises(ValueError, match="union_lists: .*kv_windows=True"):
        run(random_window_layout(rng, 1, 4, 300, 300, 64, 64, columns=0, perm=False, max_windows=3))
    with pytest.raises(ValueError, match="union_lists: .*key_pairs=True"):
        run(BlockLayout.dense_causal(300, 300, block_q=64, block_k=64), key_pairs=True)
    with pytest.raises(ValueError, match="union_lists: .*block_k=32"):
        run(BlockLayout.dense_causal(300, 300, block_q=64, block_k=32))
    with pytest.raises(ValueError, match="num_stages: .*union_lists"):
        run(BlockLayout.dense_causal(300, 300, block_q=64, block_k=64), num_stages=9)
