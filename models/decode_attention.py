"""Decode-shaped attention over a KV cache as it lies: `reduce_attention`.

XLA's batched matrix products want the batch axes (batch, key head) major, so the einsum form of
``models.attention.dense_attention`` over a ``[B, S, K, D]`` cache makes a transposed (and masked)
copy of each layer's keys and values before reading them. At one query per row and a batch of
several rows that copy is the cost of a decode step: Qwen2.5-VL-7B shape, 25.6k-slot cache, batch 4,
one H100, 2026-11-25 (``mmjax bench decode --variants default,reduce_attn``, before this became the
default): 49.0 ms per step with two cache-sized copies (5.6 GiB of temporaries) against 18.5 ms with
the multiply-reduce form below and none; batch 16 at 1k slots on an H200, 2026-11-23: 10.0 against
7.1 ms. At batch 1 the einsum form is faster (8.6 against 13.0 ms at 25.6k), and on a CPU the
reduce form makes XLA copy the cache before each layer's in-place write, so ``dense_attention``
uses this form only for one query per row, more than one row, on CUDA
(``jax.lax.platform_dependent``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.checks import check_sm_scale
from pallas_kernels.nonfinite import score_poison


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
    poison = jnp.sum(score_poison(s, m5), axis=2)  # NaN where a visible score is not finite
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
