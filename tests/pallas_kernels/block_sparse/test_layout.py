"""BlockLayout constructors, dense masks, density."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BlockLayout
from tests.pallas_kernels.helpers import wholly_masked_entries


@pytest.mark.parametrize("t,s,bq,bk", [(64, 64, 16, 16), (50, 130, 32, 16), (1, 40, 16, 32)])
def test_dense_causal_mask_is_causal(t, s, bq, bk):
    layout = BlockLayout.dense_causal(t, s, block_q=bq, block_k=bk)
    mask = np.asarray(layout.to_dense_mask())[0, 0]
    expected = np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t)
    np.testing.assert_array_equal(mask, expected)
    # Tile-level FLOPs over causal pairs: >= 1, and only the diagonal tiles add to it.
    dens = float(layout.density()[0, 0])
    assert 1.0 <= dens <= 1.0 + (bq + bk) * t / expected.sum()


def test_from_block_mask_roundtrip():
    rng = np.random.default_rng(0)
    mask = rng.random((2, 3, 4, 7)) < 0.4
    layout = BlockLayout.from_block_mask(jnp.asarray(mask), q_len=64, kv_len=100, block_q=16, block_k=16)
    blocks, count = np.asarray(layout.kv_blocks), np.asarray(layout.kv_block_count)
    np.testing.assert_array_equal(count, mask.sum(-1))
    for idx in np.ndindex(2, 3, 4):
        np.testing.assert_array_equal(blocks[idx][: count[idx]], np.flatnonzero(mask[idx]))
    pairs = np.asarray(layout.computed_pairs_permuted())
    np.testing.assert_array_equal(pairs, np.repeat(np.repeat(mask, 16, 2), 16, 3)[:, :, :64, :100])
    # jit-able with a static max_blocks.
    f = jax.jit(lambda m: BlockLayout.from_block_mask(m, q_len=64, kv_len=100, block_q=16,
                                                       block_k=16, max_blocks=3).kv_block_count)
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(mask))), np.minimum(mask.sum(-1), 3))


def test_permuted_mask_is_causal_on_original_positions():
    rng = np.random.default_rng(1)
    t = s = 48
    qp = rng.permutation(t).astype(np.int32)[None, None]
    kp = rng.permutation(s).astype(np.int32)[None, None]
    full = np.ones((1, 1, 3, 3), bool)
    layout = BlockLayout.from_block_mask(jnp.asarray(full), q_len=t, kv_len=s, block_q=16, block_k=16,
                                         q_perm=jnp.asarray(qp), kv_perm=jnp.asarray(kp))
    np.testing.assert_array_equal(np.asarray(layout.to_dense_mask())[0, 0], np.tril(np.ones((t, s), bool)))
    # One permuted block maps to the original pairs it names.
    one = np.zeros((1, 1, 3, 3), bool)
    one[0, 0, 1, 2] = True
    lay1 = layout.replace(**{f: getattr(BlockLayout.from_block_mask(jnp.asarray(one), q_len=t, kv_len=s,
                                                                    block_q=16, block_k=16), f)
                             for f in ("kv_blocks", "kv_block_count")})
    mask = np.asarray(lay1.to_dense_mask(causal=False))[0, 0]
    expected = np.zeros((t, s), bool)
    expected[np.ix_(qp[0, 0, 16:32], kp[0, 0, 32:48])] = True
    np.testing.assert_array_equal(mask, expected)


def test_random_causal_keeps_fraction_and_is_causal():
    layout = BlockLayout.random_causal(jax.random.PRNGKey(0), 4096, 4096, keep=0.1, block_q=64,
                                       block_k=64, heads=3)
    mask = np.asarray(layout.to_dense_mask(causal=False))
    causal = np.tril(np.ones((4096, 4096), bool))
    assert not (mask & ~np.kron(np.tril(np.ones((64, 64), bool)), np.ones((64, 64), bool))).any()
    frac = (mask & causal).sum() / (3 * causal.sum())
    assert 0.07 < frac < 0.14
    counts = np.asarray(layout.kv_block_count)
    assert (counts >= 1).all()
    dens = np.asarray(layout.density())
    assert dens.shape == (1, 3) and np.all((dens > 0.07) & (dens < 0.15))
    blocks = np.asarray(layout.kv_blocks)
    assert not (blocks[0, 0] == blocks[0, 1]).all() and not (blocks[0, 1] == blocks[0, 2]).all()  # own draws
    last = blocks[0, :, np.arange(64), counts[0, 0] - 1]  # [nq, heads]: the diagonal block ends each list
    np.testing.assert_array_equal(last, np.broadcast_to(np.arange(64)[:, None], last.shape))


def test_density_of_columns_and_non_causal():
    layout = BlockLayout.from_block_mask(
        jnp.zeros((1, 1, 2, 2), bool), q_len=32, kv_len=32, block_q=16, block_k=16,
        kv_columns=jnp.asarray([[[[3, 5], [7, 0]]]], jnp.int32),
        kv_column_count=jnp.asarray([[[2, 1]]], jnp.int32),
    )
    assert float(layout.density(causal=False)[0, 0]) == pytest.approx((2 * 16 + 1 * 16) / (32 * 32))


def test_column_pairs_follow_the_lists():
    """`computed_pairs_permuted` for single columns: each query block's listed columns (repeats once), nothing for
    the slots past its count or for ids out of ``[0, S)``, the columns of one head not in another's rows."""
    t, s, bq = 40, 50, 16
    cols = np.array([[[[3, 49, -1, 7], [0, 0, 60, 11], [5, 6, 7, 8]],
                      [[1, 2, 3, 4], [9, 9, 9, 9], [48, 47, 0, 0]]]], np.int32)  # [1, 2, nq 3, 4]
    count = np.array([[[2, 4, 0], [4, 1, 2]]], np.int32)
    layout = BlockLayout.from_block_mask(jnp.zeros((1, 2, 3, 4), bool), q_len=t, kv_len=s, block_q=bq, block_k=16,
                                         kv_columns=jnp.asarray(cols), kv_column_count=jnp.asarray(count))
    want = np.zeros((1, 2, t, s), bool)
    for h in range(2):
        for i in range(3):
            for c in cols[0, h, i, : count[0, h, i]]:
                if 0 <= c < s:
                    want[0, h, i * bq:(i + 1) * bq, c] = True
    np.testing.assert_array_equal(np.asarray(layout.computed_pairs_permuted()), want)


@pytest.mark.parametrize("kwargs,match", [
    (dict(q_len=0, kv_len=10), "q_len"),
    (dict(q_len=20, kv_len=10), "q_len"),
    (dict(q_len=10, kv_len=10, block_q=24), "block_q"),
    (dict(q_len=10, kv_len=10, block_k=8), "block_k"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockLayout.dense_causal(**kwargs)


def test_from_block_mask_errors():
    with pytest.raises(ValueError, match=r"mask: expected a boolean array of shape \[B, N, 2, 2\]"):
        BlockLayout.from_block_mask(jnp.zeros((1, 1, 3, 2), bool), q_len=32, kv_len=32, block_q=16, block_k=16)
    with pytest.raises(ValueError, match="mask: expected dtype bool"):
        BlockLayout.from_block_mask(jnp.zeros((1, 1, 2, 2)), q_len=32, kv_len=32, block_q=16, block_k=16)
    with pytest.raises(ValueError, match="keep"):
        BlockLayout.random_causal(jax.random.PRNGKey(0), 32, 32, keep=0.0)


def test_wholly_masked_entries_names_the_tiles_no_row_of_their_block_sees():
    """The test helper: a block past the diagonal, a block inside the gap, a block before the window and a key
    window past the rows are flagged; tiles with one visible pair, unlisted entries and dense causal are not."""
    def lay(lists, **kw):
        count = jnp.asarray([[[len(x) for x in lists]]], jnp.int32)
        blocks = jnp.asarray([[[x + [0] * (4 - len(x)) for x in lists]]], jnp.int32)
        return BlockLayout(kv_blocks=blocks, kv_block_count=count, block_q=16, block_k=16, q_len=64, kv_len=64, **kw)

    # query block 1 holds rows 16..31: block 1 has the pair (31, 16..31); block 2 (keys 32..47) none
    got = wholly_masked_entries(lay([[0], [0, 1, 2], [0, 1, 2], [3]]))
    np.testing.assert_array_equal(got[0, 0], [[0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    # gap 16: rows 16..31 see keys <= 15 only, rows 48..63 keys <= 47; window 17: rows 48..63 see keys > 31 only
    got = wholly_masked_entries(lay([[0], [0, 1], [0, 1], [1, 2, 3]], gap=16))
    np.testing.assert_array_equal(got[0, 0, :, :3], [[1, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 1]])
    got = wholly_masked_entries(lay([[0], [0, 1], [0, 1, 2], [1, 2, 3]], window=17))
    np.testing.assert_array_equal(got[0, 0, :, :3], [[0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0]])
    # key windows (starts): rows 0..15 see keys <= 15: the window from 14 holds 14 and 15, the one from 16 nothing
    got = wholly_masked_entries(lay([[14, 30], [0], [0], [0]], kv_windows=True))
    np.testing.assert_array_equal(got[0, 0, 0, :2], [0, 1])
    assert not wholly_masked_entries(BlockLayout.dense_causal(50, 130, block_q=32, block_k=16)).any()
