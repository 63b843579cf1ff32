"""MOMO metrics: block mass, captured vs oracle mass, sparsity, mean-pooled baseline."""

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.sparse.metrics import block_mass, captured_mass, mean_pooled_layout, momo_sparsity
from mmjax.sparse.patterns.momo import forced_blocks
from pallas_kernels import BlockLayout
from tests.pallas_kernels.helpers import masked_dense_attention, random_qkv


def _dense_probs(q, k):
    b, t, n, d = q.shape
    s = k.shape[1]
    kk = jnp.repeat(k, n // k.shape[2], axis=2)
    sc = jnp.einsum("btnd,bsnd->bnts", q, kk, precision=jax.lax.Precision.HIGHEST) * d ** -0.5
    causal = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + s - t
    return jax.nn.softmax(jnp.where(causal, sc, -jnp.inf), axis=-1)


def test_block_mass_sums_dense_probabilities_per_block():
    q, k, _ = random_qkv(0, 2, 90, 150, 4, 2, 16)
    rows = jnp.asarray([0, 5, 33, 89])
    mass = block_mass(q, k, rows, block=16, chunk=3)
    p = np.asarray(_dense_probs(q, k))[:, :, np.asarray(rows)]
    p = np.pad(p, ((0, 0), (0, 0), (0, 0), (0, 160 - 150)))
    expect = p.reshape(p.shape[:3] + (10, 16)).sum(-1)
    np.testing.assert_allclose(np.asarray(mass), expect, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mass).sum(-1), 1.0, atol=1e-5)


def test_captured_mass_against_brute_force():
    rng = np.random.default_rng(1)
    q, k, _ = random_qkv(1, 1, 128, 128, 2, 1, 16)
    mask = rng.random((1, 2, 4, 8)) < 0.4
    lay = BlockLayout.from_block_mask(jnp.asarray(mask), q_len=128, kv_len=128, block_q=32, block_k=16)
    rows = jnp.arange(0, 128, 3)
    mass = np.asarray(block_mass(q, k, rows, block=16))
    got = captured_mass(jnp.asarray(mass), lay, rows)
    cap, orc = np.zeros((1, 2)), np.zeros((1, 2))
    for n in range(2):
        for i, r in enumerate(np.asarray(rows)):
            chosen = [j for j in range(8) if mask[0, n, r // 32, j] and j * 16 <= r]
            cap[0, n] += mass[0, n, i, chosen].sum()
            orc[0, n] += np.sort(mass[0, n, i])[::-1][: len(chosen)].sum()
    np.testing.assert_allclose(np.asarray(got["captured"]), cap / len(rows), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got["oracle"]), orc / len(rows), atol=1e-5)
    assert (np.asarray(got["ratio"]) <= 1.0 + 1e-6).all()
    # Shared-list oracle: rows of one query block rank blocks by their summed mass.
    blk = np.zeros((1, 2))
    rr = np.asarray(rows)
    for n in range(2):
        for i, r in enumerate(rr):
            same = rr // 32 == r // 32
            ranking = np.argsort(-mass[0, n, same].sum(0), kind="stable")
            chosen = [j for j in range(8) if mask[0, n, r // 32, j] and j * 16 <= r]
            blk[0, n] += mass[0, n, i, ranking[: len(chosen)]].sum()
    np.testing.assert_allclose(np.asarray(got["oracle_block"]), blk / len(rows), atol=1e-5)
    assert (np.asarray(got["captured"]) <= np.asarray(got["oracle_block"]) + 1e-6).all()
    assert (np.asarray(got["oracle_block"]) <= np.asarray(got["oracle"]) + 1e-6).all()
    dense = captured_mass(jnp.asarray(mass), BlockLayout.dense_causal(128, 128, block_q=32, block_k=16), rows)
    np.testing.assert_allclose(np.asarray(dense["captured"]), 1.0, atol=1e-5)


def test_sparsity_counts_both_passes():
    lay = BlockLayout.dense_causal(256, 256, block_q=32, block_k=16)
    sp = float(np.asarray(momo_sparsity(lay, 16)).ravel()[0])
    qsa = sum(p + 1 for p in range(0, 256, 16))
    total = 256 * 257 / 2
    dens = float(np.asarray(lay.density()).ravel()[0])
    assert abs(sp - (1 - (dens * total + qsa) / total)) < 1e-6
    assert sp < 0  # dense key pass plus QSA costs more than dense attention


def test_mean_pooled_layout_picks_the_planted_block():
    q, k, v = random_qkv(2, 1, 256, 256, 2, 1, 16)
    # plant a key block that every query matches strongly
    direction = jnp.ones((16,)) * 2.0
    k = k.at[:, 48:64].add(direction)
    q = q + direction
    lay = mean_pooled_layout(q, k, query_block=32, block=16, k_trim=1, sink_blocks=0, local=0)
    f_ids, f_count = forced_blocks(256, 256, query_block=32, block=16, sink_blocks=0, local=0)
    blocks, count = np.asarray(lay.kv_blocks), np.asarray(lay.kv_block_count)
    for c in range(2, 8):  # query blocks that see block 3 as a candidate
        listed = set(blocks[0, 0, c, : count[0, 0, c]])
        assert 3 in listed
        assert len(listed) == f_count[c] + 1
    # a layout is a layout: it computes what masked attention on its mask computes
    assert masked_dense_attention(q, k, v, lay.to_dense_mask())[0].shape == q.shape
