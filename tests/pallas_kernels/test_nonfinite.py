"""The NaN / inf contract (`pallas_kernels.nonfinite`) in every kernel implementation: a row
that sees a non-finite score or value is NaN out, NaN lse; masked keys contribute nothing
whatever they hold; everything else equals attention on the finite inputs; the reference and
the Triton kernel (interpret mode) agree. Plus ``sm_scale`` and ``check_finite``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

from pallas_kernels import (
    BlockLayout,
    NonFiniteError,
    block_sparse_attention,
    merge_attention,
    qsa_topk,
    tree_decode_attention,
)
from tests.pallas_kernels.helpers import expect_nonfinite_contract as expect
from tests.pallas_kernels.helpers import plant_nonfinite as plant
from tests.pallas_kernels.helpers import random_layout, random_qkv

SETTINGS = dict(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# Shapes are fixed per case kind (compiles are cached): one permuted layout with columns, one
# plain GQA layout; what varies is where the NaN / inf land and the layout's content.
@st.composite
def block_cases(draw):
    shape = draw(st.sampled_from([(1, 40, 56, 2, 1, 16), (2, 24, 24, 4, 2, 24)]))
    return dict(zip(("b", "t", "s", "n", "kh", "d"), shape), perm=shape[0] == 1,
                columns=5 if shape[0] == 1 else 0, bad=draw(st.integers(1, 4)), seed=draw(st.integers(0, 2**30)))


@settings(**{**SETTINGS, "max_examples": 8})
@given(block_cases())
def test_block_sparse_nan_inf_reach_exactly_the_rows_that_see_them(c):
    rng = np.random.default_rng(c["seed"])
    q, k, v = random_qkv(c["seed"], c["b"], c["t"], c["s"], c["n"], c["kh"], c["d"])
    q, k, v = plant(rng, q, k, v, c["bad"])
    layout = random_layout(rng, c["b"], c["n"], c["t"], c["s"], 16, 16, density=0.5, perm=c["perm"],
                           columns=c["columns"])
    mask = layout.to_dense_mask()
    outs = [block_sparse_attention(q, k, v, layout, implementation="reference"),
            block_sparse_attention(q, k, v, layout, interpret=True)]
    for out, lse in outs:
        expect(out, lse, q, k, v, mask, 1e-4)
    np.testing.assert_array_equal(np.isnan(np.asarray(outs[0][0])), np.isnan(np.asarray(outs[1][0])))


def test_masked_value_inf_never_meets_a_zero_weight():
    """The audit case: inf in V at a key leaked into earlier rows (0 * inf in p @ v)."""
    q, k, v = random_qkv(3, 1, 64, 64, 2, 1, 16)
    v = v.at[0, 40, 0, 5].set(jnp.inf)
    k = k.at[0, 20, 0, 3].set(jnp.nan)
    layout = BlockLayout.dense_causal(64, 64, block_q=16, block_k=16)
    for impl in ("reference", "triton"):
        out, lse = block_sparse_attention(q, k, v, layout, implementation=impl, interpret=True)
        out, lse = np.asarray(out), np.asarray(lse)
        assert np.isfinite(out[0, :20]).all() and np.isfinite(lse[0, :, :20]).all(), impl
        assert np.isnan(out[0, 20:]).all() and np.isnan(lse[0, :, 20:]).all(), impl


def test_merge_propagates_nan_and_ignores_empty_parts():
    b, t, n, d = 1, 4, 1, 8
    out_a = jnp.ones((b, t, n, d))
    out_b = jnp.full((b, t, n, d), 2.0)
    lse_a = jnp.array([[[0.0, jnp.nan, -jnp.inf, 0.0]]])
    lse_b = jnp.array([[[0.0, 0.0, -jnp.inf, -jnp.inf]]])
    out_b = out_b.at[0, 3].set(jnp.nan)  # garbage in an empty part (lse -inf): contributes nothing
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    out, lse = np.asarray(out)[0, :, 0], np.asarray(lse)[0, 0]
    np.testing.assert_allclose(out[0], 1.5)
    assert np.isnan(out[1]).all() and np.isnan(lse[1])
    assert (out[2] == 0).all() and lse[2] == -np.inf
    np.testing.assert_allclose(out[3], 1.0)
    np.testing.assert_allclose(lse[[0, 3]], [np.log(2.0), 0.0])


@st.composite
def tree_cases(draw):
    b, t, s, n, kh = 2, 3, 56, 4, 2
    return dict(b=b, t=t, s=s, kh=kh, n=n, start=draw(st.integers(0, s - t)), bad=draw(st.integers(1, 4)),
                seed=draw(st.integers(0, 2**30)))


@settings(**SETTINGS)
@given(tree_cases())
def test_tree_decode_nan_inf_in_valid_and_invalid_slots(c):
    rng = np.random.default_rng(c["seed"])
    b, t, s, n, kh, start = c["b"], c["t"], c["s"], c["n"], c["kh"], c["start"]
    q, k, v = random_qkv(c["seed"], b, t, s, n, kh, 16)
    q, k, v = plant(rng, q, k, v, c["bad"])
    slot = np.arange(s)
    prefix = (rng.random((b, s)) < 0.6) & ((slot < start) | (slot >= start + t))[None]
    block = np.tril(np.ones((t, t), bool)) & (rng.random((b, t, t)) < 0.8)
    mask = np.broadcast_to(prefix[:, None, :], (b, t, s)).copy()
    mask[:, :, start:start + t] |= block
    mask = np.broadcast_to(mask[:, None], (b, n, t, s))
    args = (q, k, v, jnp.asarray(prefix), start, jnp.asarray(block))
    ref = tree_decode_attention(*args, implementation="reference")
    ker = tree_decode_attention(*args, implementation="triton", interpret=True, block_k=16, num_splits=2)
    for out in (ref, ker):
        expect(out, None, q, k, v, mask, 1e-4)


@st.composite
def qsa_cases(draw):
    return dict(topk=draw(st.sampled_from(["exact", "tournament", "estimated"])),
                bad=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**30)))


@settings(**{**SETTINGS, "max_examples": 10})
@given(qsa_cases())
def test_qsa_topk_nan_inf_rows_and_nan_blocks_first(c):
    rng = np.random.default_rng(c["seed"])
    b, t, s, n, kh, gamma, bkv, top_k = 1, 48, 64, 2, 1, 8, 16, 2
    q, k, v = random_qkv(c["seed"], b, t, s, n, kh, 16)
    q, k, v = plant(rng, q, k, v, c["bad"])
    kw = dict(gamma=gamma, block_kv=bkv, top_k=top_k, k_exact=1, topk=c["topk"], local=8)
    ref = qsa_topk(q, k, v, implementation="reference", **kw)
    ker = qsa_topk(q, k, v, implementation="triton", interpret=True, rows=16, **kw)
    pos = np.arange(0, t, gamma) + s - t
    mask = np.broadcast_to((np.arange(s)[None] <= pos[:, None])[None, None], (b, n, len(pos), s))
    for res in (ref, ker):
        expect(res.out_gamma, res.lse_gamma, q[:, ::gamma], k, v, mask, 1e-4)
    np.testing.assert_array_equal(np.asarray(ref.block_idx), np.asarray(ker.block_idx))
    np.testing.assert_allclose(np.asarray(ref.block_score), np.asarray(ker.block_score), rtol=1e-4, atol=1e-4)
    # A candidate block holding a visible non-finite q.k score has score NaN and is taken first.
    qk_bad = ~np.isfinite(np.einsum("bgnd,bskd->bngs", np.asarray(q[:, ::gamma]), np.asarray(k)))
    ids, scores = np.asarray(ref.block_idx), np.asarray(ref.block_score)
    for h in range(n):
        for g, p in enumerate(pos):
            lo = max(p - 8, 0) // bkv  # candidates: blocks [0, lo)
            nan_blocks = [j for j in range(lo) if (qk_bad[0, h, g, j * bkv:(j + 1) * bkv]
                                                   & (np.arange(j * bkv, (j + 1) * bkv) <= p)).any()]
            got = ids[0, h, g][np.isnan(scores[0, h, g])]
            assert set(got.tolist()) <= set(nan_blocks)  # NaN scores belong to blocks holding one
            # exact / tournament take the first top_k of them; the estimated hybrid its first
            # k_exact (append-only slots may be full by the time a later one comes).
            want = nan_blocks[:top_k if c["topk"] != "estimated" else 1]
            np.testing.assert_array_equal(got[:len(want)], want)


def test_check_finite_names_the_argument_eagerly_and_under_checkify():
    q, k, v = random_qkv(0, 1, 32, 32, 1, 1, 16)
    v = v.at[0, 7, 0, 2].set(jnp.inf)
    layout = BlockLayout.dense_causal(32, 32, block_q=16, block_k=16)
    with pytest.raises(NonFiniteError, match=r"v: expected finite values .* at index \[0, 7, 0, 2\]"):
        block_sparse_attention(q, k, v, layout, check_finite=True)
    with pytest.raises(NonFiniteError, match="v: expected finite values"):
        tree_decode_attention(q[:, :2], k, v, jnp.ones((1, 32), bool).at[:, 30:].set(False), 30,
                              jnp.ones((1, 2, 2), bool), check_finite=True)
    with pytest.raises(NonFiniteError, match="v: expected finite values"):
        qsa_topk(q, k, v, gamma=4, block_kv=16, top_k=1, check_finite=True)
    f = jax.jit(lambda q, k, v: block_sparse_attention(q, k, v, layout, check_finite=True))
    err, _ = checkify.checkify(f, errors=checkify.user_checks)(q, k, v)
    assert "v: expected finite values" in str(err.get())
    err, out = checkify.checkify(f, errors=checkify.user_checks)(q, k, v.at[0, 7, 0, 2].set(0.0))
    assert err.get() is None and np.isfinite(np.asarray(out[0])).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0, "abc", True, jnp.array([1.0])])
def test_sm_scale_must_be_a_finite_positive_float(bad):
    q, k, v = random_qkv(0, 1, 16, 16, 1, 1, 16)
    layout = BlockLayout.dense_causal(16, 16, block_q=16, block_k=16)
    for call in (lambda: block_sparse_attention(q, k, v, layout, sm_scale=bad),
                 lambda: tree_decode_attention(q[:, :1], k, v, jnp.ones((1, 16), bool).at[:, 15:].set(False), 15,
                                               jnp.ones((1, 1, 1), bool), sm_scale=bad),
                 lambda: qsa_topk(q, k, v, gamma=4, block_kv=16, top_k=1, sm_scale=bad)):
        with pytest.raises(ValueError, match="sm_scale: expected a finite positive float"):
            call()
    out, _ = block_sparse_attention(q, k, v, layout, sm_scale=np.float32(0.5))  # numpy scalars are fine
    assert np.isfinite(np.asarray(out)).all()
