"""Block-sparse attention on CPU: Triton kernel (interpret mode) == reference == masked dense."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import BlockLayout, block_sparse_attention, merge_attention
from tests.pallas_kernels.helpers import masked_dense_attention, random_layout, random_qkv, rel_err

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}


def _check(out, lse, ref_out, ref_lse, dtype):
    out32 = np.asarray(out, np.float32)
    assert not np.isnan(out32).any(), "NaN in output"
    assert rel_err(out32, ref_out) < TOL[dtype], rel_err(out32, ref_out)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    np.testing.assert_array_equal(lse[~fin], -np.inf)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=2e-2 if dtype != jnp.float32 else 1e-4)
    # Rows with no visible key are exactly zero.
    empty = ~fin  # [B, N, T]
    np.testing.assert_array_equal(np.einsum("btnd->bntd", out32)[empty], 0.0)


@st.composite
def cases(draw):
    kh = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2, 3]))
    bq = draw(st.sampled_from([16, 32]))
    bk = draw(st.sampled_from([16, 32]))
    s = draw(st.integers(20, 120))
    t = draw(st.integers(1, s))
    return dict(
        b=draw(st.sampled_from([1, 2])), t=t, s=s, n=kh * groups, kh=kh,
        d=draw(st.sampled_from([16, 32, 40])), bq=bq, bk=bk,
        density=draw(st.sampled_from([0.2, 0.5, 1.0])),
        perm=draw(st.booleans()), columns=draw(st.sampled_from([0, 0, 5, 17])),
        dtype=draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        lead_b=draw(st.sampled_from([None, 1])), lead_n=draw(st.sampled_from([None, 1])),
        seed=draw(st.integers(0, 2**30)),
    )


# ~7 s an example on 2 cores; hypothesis draws new examples on every run
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_kernel_matches_reference_and_dense(c):
    rng = np.random.default_rng(c["seed"])
    q, k, v = random_qkv(c["seed"], c["b"], c["t"], c["s"], c["n"], c["kh"], c["d"], c["dtype"])
    layout = random_layout(rng, c["b"], c["n"], c["t"], c["s"], c["bq"], c["bk"], density=c["density"],
                           perm=c["perm"], columns=c["columns"], lead_b=c["lead_b"], lead_n=c["lead_n"])
    ref_out, ref_lse = masked_dense_attention(q, k, v, layout.to_dense_mask())
    out_r, lse_r = block_sparse_attention(q, k, v, layout, implementation="reference")
    _check(out_r, lse_r, ref_out, ref_lse, c["dtype"])
    out_k, lse_k = block_sparse_attention(q, k, v, layout, interpret=True)
    _check(out_k, lse_k, ref_out, ref_lse, c["dtype"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t,s,n,kh,d", [(64, 64, 4, 2, 64), (50, 130, 6, 3, 32), (33, 33, 28, 4, 128)])
def test_dense_causal_equals_xla(dtype, t, s, n, kh, d):
    q, k, v = random_qkv(t * s + d, 2, t, s, n, kh, d, dtype)
    layout = BlockLayout.dense_causal(t, s, block_q=32, block_k=32)
    offset = s - t
    mask = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + offset)[None, None]
    ref = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                       v.astype(jnp.float32), mask=mask, implementation="xla")
    for impl, kw in (("reference", {}), ("triton", {"interpret": True})):
        out, lse = block_sparse_attention(q, k, v, layout, implementation=impl, **kw)
        assert out.dtype == dtype and out.shape == q.shape and lse.shape == (2, n, t)
        assert lse.dtype == jnp.float32
        assert rel_err(out, ref) < TOL[dtype], (impl, rel_err(out, ref))


@pytest.mark.parametrize("perm", [False, True])
def test_fully_masked_rows_give_zero_and_neg_inf(perm):
    b, t, s, n, kh, d = 1, 70, 70, 2, 1, 32
    q, k, v = random_qkv(5, b, t, s, n, kh, d)
    rng = np.random.default_rng(0)
    layout = random_layout(rng, b, n, t, s, 32, 16, density=0.5, perm=perm)
    counts = np.array(layout.kv_block_count)
    counts[:, :, 1] = 0  # query block 1 computes nothing
    layout = layout.replace(kv_block_count=jnp.asarray(counts))
    # Key blocks entirely in the future of the query block: every pair is masked.
    blocks = np.array(layout.kv_blocks)
    blocks[:, :, 0, :] = layout.num_kv_blocks - 1
    counts[:, :, 0] = 1
    layout = layout.replace(kv_blocks=jnp.asarray(blocks), kv_block_count=jnp.asarray(counts))
    ref_out, ref_lse = masked_dense_attention(q, k, v, layout.to_dense_mask())
    assert np.isneginf(np.asarray(ref_lse)).any()
    for kw in ({"implementation": "reference"}, {"interpret": True}):
        out, lse = block_sparse_attention(q, k, v, layout, **kw)
        _check(out, lse, ref_out, ref_lse, jnp.float32)


def test_all_empty_layout():
    q, k, v = random_qkv(1, 1, 40, 40, 2, 2, 16)
    layout = BlockLayout.dense_causal(40, 40, block_q=16, block_k=16)
    layout = layout.replace(kv_block_count=jnp.zeros_like(layout.kv_block_count))
    for kw in ({"implementation": "reference"}, {"interpret": True}):
        out, lse = block_sparse_attention(q, k, v, layout, **kw)
        np.testing.assert_array_equal(np.asarray(out), 0.0)
        assert np.isneginf(np.asarray(lse)).all()


@pytest.mark.parametrize("perm", [False, True])
def test_merge_of_split_layout_equals_unsplit(perm):
    b, t, s, n, kh, d = 2, 90, 120, 4, 2, 32
    q, k, v = random_qkv(11, b, t, s, n, kh, d)
    rng = np.random.default_rng(3)
    full = random_layout(rng, b, n, t, s, 32, 16, density=0.6, perm=perm, columns=6)
    nk = full.num_kv_blocks
    bm = np.zeros((b, n, full.num_q_blocks, nk), bool)
    blocks, count = np.asarray(full.kv_blocks), np.asarray(full.kv_block_count)
    for idx in np.ndindex(b, n, full.num_q_blocks):
        bm[idx][blocks[idx][: count[idx]]] = True
    even = bm & (np.arange(nk) % 2 == 0)
    common = dict(q_len=t, kv_len=s, block_q=32, block_k=16, q_perm=full.q_perm, kv_perm=full.kv_perm)
    part_a = BlockLayout.from_block_mask(jnp.asarray(even), kv_columns=full.kv_columns,
                                         kv_column_count=full.kv_column_count, **common)
    part_b = BlockLayout.from_block_mask(jnp.asarray(bm & ~even), **common)
    out_full, lse_full = block_sparse_attention(q, k, v, full, interpret=True)
    out_a, lse_a = block_sparse_attention(q, k, v, part_a, interpret=True)
    out_b, lse_b = block_sparse_attention(q, k, v, part_b, interpret=True)
    out_m, lse_m = merge_attention(out_a, lse_a, out_b, lse_b)
    assert rel_err(out_m, out_full) < 1e-5
    fin = np.isfinite(np.asarray(lse_full))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse_m)), fin)
    np.testing.assert_allclose(np.asarray(lse_m)[fin], np.asarray(lse_full)[fin], atol=1e-5)


def test_merge_with_empty_partial_is_identity_and_validates():
    q, k, v = random_qkv(2, 1, 32, 32, 2, 1, 16)
    layout = BlockLayout.dense_causal(32, 32, block_q=16, block_k=16)
    out, lse = block_sparse_attention(q, k, v, layout, implementation="reference")
    empty_out, empty_lse = jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf)
    out_m, lse_m = merge_attention(out, lse, empty_out, empty_lse)
    np.testing.assert_allclose(np.asarray(out_m), np.asarray(out), rtol=1e-6, atol=1e-6)
    out_e, lse_e = merge_attention(empty_out, empty_lse, empty_out, empty_lse)
    assert not np.isnan(np.asarray(out_e)).any() and np.isneginf(np.asarray(lse_e)).all()
    with pytest.raises(ValueError, match="lse_b"):
        merge_attention(out, lse, out, lse[:, :, :-1])


def test_reference_runs_32k_tokens_on_cpu_without_s_by_s():
    s = 32768
    q, k, v = random_qkv(7, 1, s, s, 2, 1, 32, jnp.bfloat16)
    layout = BlockLayout.random_causal(jax.random.PRNGKey(0), s, s, keep=0.02, block_q=128,
                                       block_k=128, heads=2)
    out, lse = block_sparse_attention(q, k, v, layout, implementation="reference")
    assert out.shape == q.shape and np.isfinite(np.asarray(lse)).all()
    # Spot-check a few rows against exact attention over the keys the layout keeps.
    blocks, count = np.asarray(layout.kv_blocks[0, 1]), np.asarray(layout.kv_block_count[0, 1])
    for row in (0, 5000, s - 1):
        qb = row // 128
        keys = np.concatenate([np.arange(bb * 128, bb * 128 + 128) for bb in blocks[qb, : count[qb]]])
        keys = keys[keys <= row]
        qq = np.asarray(q[0, row, 1], np.float32)
        kk, vv = np.asarray(k[0, keys, 0], np.float32), np.asarray(v[0, keys, 0], np.float32)
        sc = kk @ qq * 32 ** -0.5
        p = np.exp(sc - sc.max())
        ref = p @ vv / p.sum()
        np.testing.assert_allclose(np.asarray(out[0, row, 1], np.float32), ref, atol=2e-2)


def test_traced_out_of_range_layout_is_clamped_not_read_out_of_bounds():
    q, k, v = random_qkv(9, 1, 48, 48, 2, 1, 16)
    layout = BlockLayout.dense_causal(48, 48, block_q=16, block_k=16)

    @jax.jit
    def run(blocks, count):
        lay = layout.replace(kv_blocks=blocks, kv_block_count=count)
        return block_sparse_attention(q, k, v, lay, interpret=True)

    out, lse = run(layout.kv_blocks + 100, layout.kv_block_count + 5)
    assert np.isfinite(np.asarray(out)).all()


def test_broadcast_lists_and_columns_with_their_own_lead_dims():
    """Blocks shared by all heads and query blocks (dense-causal style list, per-row counts),
    columns per (batch, head): each array broadcasts on its own dims."""
    b, t, s, n, kh, d, bq, bk = 2, 64, 96, 4, 2, 16, 16, 16
    q, k, v = random_qkv(21, b, t, s, n, kh, d)
    rng = np.random.default_rng(21)
    nq = t // bq
    counts = np.array([1, 2, 3, 2], np.int32)  # per query block, lists shared
    cols = np.zeros((b, n, nq, 6), np.int32)
    ccount = rng.integers(0, 7, size=(b, n, nq)).astype(np.int32)
    for idx in np.ndindex(b, n, nq):
        cols[idx] = rng.choice(np.arange(counts[idx[2]] * bk, s), size=6, replace=False)
    layout = BlockLayout(
        kv_blocks=jnp.arange(s // bk, dtype=jnp.int32)[None, None, None],
        kv_block_count=jnp.asarray(counts)[None, None],
        kv_columns=jnp.asarray(cols), kv_column_count=jnp.asarray(ccount),
        block_q=bq, block_k=bk, q_len=t, kv_len=s,
    )
    ref_out, ref_lse = masked_dense_attention(q, k, v, layout.to_dense_mask())
    for kw in ({"implementation": "reference"}, {"interpret": True}):
        out, lse = block_sparse_attention(q, k, v, layout, **kw)
        _check(out, lse, ref_out, ref_lse, jnp.float32)


@pytest.mark.parametrize("perm,gap", [(False, 1), (True, 7), (False, 40)])
def test_causal_gap_and_window_split_keys_exactly(perm, gap):
    """A layout with a causal gap g computes keys <= position - g; merged with a window of
    the g nearest keys (gap 0) it equals the union layout."""
    b, t, s, n, kh, d = 1, 70, 100, 4, 2, 32
    q, k, v = random_qkv(gap, b, t, s, n, kh, d)
    rng = np.random.default_rng(gap)
    far = random_layout(rng, b, n, t, s, 32, 16, density=0.7, perm=perm).replace(gap=gap)
    mask = far.to_dense_mask()
    pos_q = np.arange(t)[:, None] + s - t
    assert not np.asarray(mask)[..., (pos_q - np.arange(s)[None, :]) < gap].any()
    ref_out, ref_lse = masked_dense_attention(q, k, v, mask)
    for kw in ({"implementation": "reference"}, {"interpret": True}):
        out, lse = block_sparse_attention(q, k, v, far, **kw)
        _check(out, lse, ref_out, ref_lse, jnp.float32)
    # A window of the g nearest keys (any superset of blocks) completes it exactly.
    near = random_layout(rng, b, n, t, s, 32, 16, density=0.8, perm=not perm).replace(window=gap)
    near_mask = np.asarray(near.to_dense_mask())
    assert not near_mask[..., (pos_q - np.arange(s)[None, :]) >= gap].any()
    assert not (np.asarray(mask) & near_mask).any()
    for kw in ({"implementation": "reference"}, {"interpret": True}):
        out_n, lse_n = block_sparse_attention(q, k, v, near, **kw)
        ref_n, ref_ln = masked_dense_attention(q, k, v, jnp.asarray(near_mask))
        _check(out_n, lse_n, ref_n, ref_ln, jnp.float32)
    out_m, lse_m = merge_attention(*block_sparse_attention(q, k, v, far, interpret=True),
                                   *block_sparse_attention(q, k, v, near, interpret=True))
    ref_u, _ = masked_dense_attention(q, k, v, mask | jnp.asarray(near_mask))
    assert rel_err(out_m, ref_u) < 1e-5
    with pytest.raises(ValueError, match="^causal:"):
        block_sparse_attention(q, k, v, far, causal=False)
