"""Dense attention (direct and blocked paths), masking rules and attention-spec resolution."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.attention import LayerAttention, cudnn_attention, dense_attention, resolve_attention
from pallas_kernels import NonFiniteError, tree_decode_attention
from tests.pallas_kernels.helpers import expect_nonfinite_contract, plant_nonfinite, random_qkv


def _naive(q, k, v, q_pos, valid, causal=True):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, d = q.shape
    g = n // k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        for h in range(n):
            s = q[bi, :, h] @ k[bi, :, h // g].T / np.sqrt(d)
            m = valid[bi][None, :] & ((np.asarray(q_pos[bi])[:, None] >= np.arange(k.shape[1])[None, :]) | (not causal))
            s = np.where(m, s, -np.inf)
            mx = s.max(-1, keepdims=True)
            p = np.where(m, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0)
            l = p.sum(-1, keepdims=True)
            out[bi, :, h] = (p / np.where(l > 0, l, 1)) @ v[bi, :, h // g]
    return out


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_dense_matches_naive_with_gqa_offsets_and_holes(direct, causal):
    rng = np.random.default_rng(0)
    b, t, s, n, kh, d = 2, 37, 53, 6, 2, 8
    q, k, v = (rng.standard_normal(x).astype(np.float32) for x in ((b, t, n, d), (b, s, kh, d), (b, s, kh, d)))
    q_pos = np.stack([np.arange(t) + 16, np.arange(t) + 5]).astype(np.int32)
    valid = rng.random((b, s)) > 0.2
    valid[1, :6] = False  # query 0 of row 1 (position 5) sees nothing -> zeros
    out = dense_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_pos),
                          kv_valid=jnp.asarray(valid), block_q=8, block_k=16, causal=causal,
                          direct_max_scores=(1 << 30) if direct else 0)
    ref = _naive(q, k, v, q_pos, valid, causal)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)
    if causal:
        assert np.all(np.asarray(out)[1, 0] == 0)
    assert np.isfinite(np.asarray(out)).all()


def test_dense_rejects_bad_shapes():
    q = jnp.zeros((1, 4, 6, 8))
    with pytest.raises(ValueError, match="k"):
        dense_attention(q, jnp.zeros((1, 4, 4, 8)), jnp.zeros((1, 4, 4, 8)), q_positions=jnp.zeros((1, 4), jnp.int32),
                        kv_valid=jnp.ones((1, 4), bool))
    with pytest.raises(ValueError, match="q_positions"):
        dense_attention(q, jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)), q_positions=jnp.zeros((4,), jnp.int32),
                        kv_valid=jnp.ones((1, 4), bool))
    with pytest.raises(ValueError, match="cudnn"):
        cudnn_attention(q, jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)), q_positions=jnp.zeros((1, 4), jnp.int32),
                        kv_valid=jnp.ones((1, 4), bool))


def test_resolve_attention():
    assert resolve_attention("dense").uniform is dense_attention
    assert resolve_attention(None).scannable
    assert resolve_attention("cudnn").uniform is cudnn_attention

    class Hook:
        def layer_attention(self, i):
            return dense_attention if i % 2 else cudnn_attention

    la = resolve_attention(Hook())
    assert not la.scannable and la.for_layer(1) is dense_attention and la.for_layer(2) is cudnn_attention
    seq = resolve_attention([cudnn_attention, dense_attention])
    assert seq.for_layer(1) is dense_attention
    hash(seq)  # static jit argument
    assert resolve_attention(dense_attention) == resolve_attention(dense_attention)  # no recompiles
    with pytest.raises(ValueError, match="attention"):
        resolve_attention("flash")
    with pytest.raises(ValueError, match="attention"):
        resolve_attention(3)
    with pytest.raises(ValueError):
        LayerAttention()


def _per_query_case(t=5, s_len=40, start=30, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((2, t, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, s_len, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, s_len, 2, 8)), jnp.float32)
    prefix = rng.random((2, s_len)) < 0.7
    prefix[:, start:] = False
    prefix[1, :] = False  # row 1 sees only its block
    block = rng.random((2, t, t)) < 0.5
    block[:, 2, :] = False  # a query that sees nothing in the block
    block[1, 2, :] = False
    full = np.zeros((2, t, s_len), bool)
    full[:, :, :start] = prefix[:, None, :start]
    full[:, :, start:start + t] = block
    return q, k, v, prefix, block, full, start


def test_per_query_mask_direct_and_blocked_agree_with_numpy():
    q, k, v, _, _, full, start = _per_query_case()
    qpos = jnp.broadcast_to(start + jnp.arange(5), (2, 5))
    direct = dense_attention(q, k, v, q_positions=qpos, kv_valid=jnp.asarray(full), causal=False)
    blocked = dense_attention(q, k, v, q_positions=qpos, kv_valid=jnp.asarray(full), causal=False,
                              direct_max_scores=0, block_q=2, block_k=8)
    kk = np.repeat(np.asarray(k), 2, axis=2)
    vv = np.repeat(np.asarray(v), 2, axis=2)
    sc = np.einsum("btnd,bsnd->bnts", np.asarray(q), kk) / np.sqrt(8)
    sc = np.where(full[:, None], sc, -np.inf)
    m = np.max(sc, -1, keepdims=True)
    p = np.where(full[:, None], np.exp(sc - np.where(np.isfinite(m), m, 0)), 0)
    want = np.einsum("bnts,bsnd->btnd", p / np.maximum(p.sum(-1, keepdims=True), 1e-30), vv)
    np.testing.assert_allclose(np.asarray(direct), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(blocked), want, atol=1e-5)
    assert np.all(np.asarray(direct)[1, 2] == 0)  # sees nothing -> 0


def test_tree_attention_equals_per_query_mask():
    """The tree-verification attention the speculative step injects (prefix mask + tree block mask,
    one softmax) equals dense attention with the per-query mask it stands for."""
    q, k, v, prefix, block, full, start = _per_query_case(seed=1)
    qpos = jnp.broadcast_to(start + jnp.arange(5), (2, 5))
    want = dense_attention(q, k, v, q_positions=qpos, kv_valid=jnp.asarray(full), causal=False)
    got = tree_decode_attention(q, k, v, jnp.asarray(prefix), jnp.asarray(start, jnp.int32), jnp.asarray(block),
                                implementation="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    with pytest.raises(ValueError, match="prefix_valid"):
        tree_decode_attention(q, k, v, jnp.asarray(prefix[:, :3]), jnp.asarray(start), jnp.asarray(block))


# --------------------------------------------------------------------- NaN / inf contract
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**30), st.integers(1, 4), st.booleans(), st.booleans())
def test_dense_nan_inf_reach_exactly_the_rows_that_see_them(seed, count, direct, per_query):
    """Direct and blocked paths: a NaN / inf in q, k or v (valid slot or not) makes exactly the
    rows that see it NaN; an unwritten cache slot holding NaN contaminates nobody."""
    rng = np.random.default_rng(seed)
    b, t, s, n, kh, d = 2, 12, 40, 4, 2, 8
    q, k, v = random_qkv(seed, b, t, s, n, kh, d)
    q, k, v = plant_nonfinite(rng, q, k, v, count)
    q_pos = np.stack([np.arange(t) + 20, np.arange(t) + 3]).astype(np.int32)
    valid = rng.random((b, t, s) if per_query else (b, s)) > 0.3
    mask = (valid if per_query else valid[:, None, :]) & (np.arange(s)[None, None, :] <= q_pos[:, :, None])
    out = dense_attention(q, k, v, q_positions=jnp.asarray(q_pos), kv_valid=jnp.asarray(valid), block_q=8,
                          block_k=16, direct_max_scores=(1 << 30) if direct else 0)
    expect_nonfinite_contract(out, None, q, k, v, np.broadcast_to(mask[:, None], (b, n, t, s)), 1e-4)


def test_dense_sm_scale_and_check_finite():
    q, k, v = random_qkv(0, 1, 4, 8, 2, 1, 8)
    kw = dict(q_positions=jnp.arange(4)[None] + 4, kv_valid=jnp.ones((1, 8), bool))
    with pytest.raises(ValueError, match="sm_scale: expected a finite positive float; received 'abc'"):
        dense_attention(q, k, v, sm_scale="abc", **kw)
    with pytest.raises(ValueError, match="sm_scale: expected a finite positive float; received nan"):
        dense_attention(q, k, v, sm_scale=float("nan"), **kw)
    with pytest.raises(NonFiniteError, match=r"k: expected finite values .* index \[0, 3, 0, 1\]"):
        dense_attention(q, k.at[0, 3, 0, 1].set(jnp.nan), v, check_finite=True, **kw)
