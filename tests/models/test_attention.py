"""Dense attention (direct and blocked paths), masking rules and attention-spec resolution."""

import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import LayerAttention, cudnn_attention, dense_attention, resolve_attention


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
