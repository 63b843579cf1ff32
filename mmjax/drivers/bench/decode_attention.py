"""Decode-attention variants `mmjax bench decode` compares with XLA's dense attention
(``models.attention.dense_attention``), all with the ``models.attention`` protocol.

* `reduce_attention`: the scores and the weighted sum as multiply-reduce expressions over the cache
  as it lies. XLA's batched matrix products want the batch axes (batch, key head) major, so dense
  attention over a ``[B, S, K, D]`` cache makes a transposed (and masked) copy of each layer's keys
  and values before reading them again (on a CPU: one ``transpose_copy`` fusion per layer and per
  k / v); here the masking and the non-finite rules are fused into the reductions. Whether a GPU
  then reads each layer's cache once, and whether XLA still updates the cache in place (on a CPU it
  does not: reading the cache inside the fusions makes it copy the whole cache before each layer's
  write), is what the benchmark measures.
* `split_k_attention`: the split-K Pallas kernel of ``pallas_kernels.tree_decode`` with the new
  token as a one-slot block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.checks import check_sm_scale
from pallas_kernels.tree_decode import tree_decode_attention


def reduce_attention(q, k, v, *, layer=None, q_positions, kv_valid, modality=None, sm_scale: float | None = None,
                     causal: bool = True) -> jax.Array:
    """Exact softmax attention of ``q`` over the cache ``k`` / ``v`` (``models.attention`` protocol).

    q: [B, T, N, D] (T small); k, v: [B, S, K, D], N % K == 0 (head n reads key head n // (N / K));
    q_positions: int32 [B, T] (causal: key j visible to query i iff j <= q_positions[i]); kv_valid:
    bool [B, S] or per query [B, T, S]. Returns [B, T, N, D] in q's dtype. Same results as
    ``models.attention.dense_attention`` (float32 softmax; its rules: a query that sees no key gives
    0, one that sees a non-finite score or value gives NaN, masked slots contribute nothing whatever
    they hold), with the probabilities kept in float32 for the weighted sum.
    """
    del layer, modality
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"q/k/v: expected q [B,T,N,D] and k == v [B,S,K,D], got {q.shape}, {k.shape}, {v.shape}")
    b, t, n, d = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d or n % kh:
        raise ValueError(f"k: expected [B={b}, S, K, D={d}] with N={n} divisible by K, got {k.shape}")
    if q_positions.shape != (b, t):
        raise ValueError(f"q_positions: expected shape {(b, t)}, got {q_positions.shape}")
    if kv_valid.shape not in ((b, s_len), (b, t, s_len)):
        raise ValueError(f"kv_valid: expected shape {(b, s_len)} or per query {(b, t, s_len)}, got {kv_valid.shape}")
    scale = check_sm_scale(sm_scale, d)
    g = n // kh
    mask = kv_valid if kv_valid.ndim == 3 else jnp.broadcast_to(kv_valid[:, None], (b, t, s_len))
    if causal:
        mask = mask & (q_positions[:, :, None] >= jnp.arange(s_len, dtype=q_positions.dtype)[None, None])
    m5 = mask[:, :, :, None, None]  # [B, T, S, 1, 1]
    qg = (q.astype(jnp.float32) * scale).reshape(b, t, 1, kh, g, d)
    # scores [B, T, S, K, G]: a multiply-reduce over D of the cache's rows as they lie
    s = jnp.sum(k.astype(jnp.float32)[:, None, :, :, None, :] * qg, axis=-1)
    poison = jnp.sum(jnp.where(m5, s * 0.0, 0.0), axis=2)  # NaN where a visible score is not finite
    s = jnp.where(m5, s, -jnp.inf)
    m = jnp.max(s, axis=2, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)  # 0 at masked slots
    # the weighted sum reads each value once; a masked slot's product is dropped whatever it holds, and
    # a visible non-finite value turns its product non-finite (+ v * 0), which poisons the row below
    vf = v.astype(jnp.float32)[:, None, :, :, None, :]  # [B, 1, S, K, 1, D]
    acc = jnp.sum(jnp.where(m5[..., None], p[..., None] * vf + vf * 0.0, 0.0), axis=2)  # [B, T, K, G, D]
    l = jnp.sum(p, axis=2) + poison  # [B, T, K, G]
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    out = jnp.where(jnp.isnan(jnp.sum(acc, axis=-1, keepdims=True)), jnp.nan, out)
    return out.reshape(b, t, n, d).astype(q.dtype)


def split_k_attention(q, k, v, *, layer=None, q_positions, kv_valid, modality=None):
    """Decode attention (every row's new token at the same slot) through the split-K Pallas kernel
    ``pallas_kernels.tree_decode_attention``: the prefix is every valid slot before the new token's,
    the block is the new token's slot. q [B, T=1, N, D]; k, v [B, S, K, D]; q_positions int32 [B, 1];
    kv_valid bool [B, S]. Returns [B, 1, N, D]."""
    del layer, modality
    b, t = q_positions.shape
    if t != 1 or kv_valid.ndim != 2:
        raise ValueError(f"q_positions / kv_valid: expected [B, 1] / [B, S] (one new token per row), got "
                         f"{q_positions.shape} / {kv_valid.shape}")
    slot = q_positions[0, 0]
    prefix = kv_valid & (jnp.arange(kv_valid.shape[1], dtype=jnp.int32)[None] < slot)
    return tree_decode_attention(q, k, v, prefix, slot, jnp.ones((b, 1, 1), bool))
