"""Decode-shaped attention over a KV cache as it lies: `reduce_attention` and `split_k_decode_attention`.

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

At long context both XLA forms fall well short of reading the cache at the memory's speed; the split-K
Pallas kernel of ``pallas_kernels.tree_decode`` (key slices in parallel, merged) does better. Same shape, one
H100, 2026-11-25 (``mmjax bench decode --contexts 25600 --variants default,split_k``): batch 1 8.76 -> 8.10 ms
per step, batch 4 18.65 -> 12.22 ms. Short caches too (one H200, 2026-11-26, ``--contexts 1024,4096
--variants default,split_k``, `bench/results/decode-splitk-short_NVIDIA-H200_2026-11-26.json`; the default then was
the einsum form at batch 1 and the reduce form above it): 1k slots, batch 1 / 4 / 16: 5.07 / 5.48 / 9.16 ->
4.84 / 4.56 / 5.32 ms; 4k slots: 5.14 / 9.28 / 22.89 -> 5.08 / 5.22 / 7.36 ms (the reduce form wrote a float32
transposed copy of the cache, 4 MiB per row and 1k slots, before reading it). So on CUDA a step over at least
`SPLIT_K_MIN_SLOTS` = 1024 cache slots uses `split_k_decode_attention` at every batch size (shorter caches were not
measured with it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.checks import check_sm_scale
from pallas_kernels.nonfinite import score_poison
from pallas_kernels.tree_decode import tree_decode_attention

# Cache slots from which a one-query-per-row step on CUDA runs the split-K kernel (see the module docstring).
SPLIT_K_MIN_SLOTS = 1024


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


def split_k_decode_attention(q, k, v, *, layer=None, q_positions, kv_valid, modality=None,
                             sm_scale: float | None = None, causal: bool = True, implementation: str | None = None,
                             interpret: bool | None = None, stacked: bool = False) -> jax.Array:
    """One query per row over the cache through the split-K kernel ``pallas_kernels.tree_decode_attention``
    (``models.attention`` protocol; same results as ``dense_attention``).

    q: [B, 1, N, D]; k, v: [B, S, K, D]; q_positions: int32 [B, 1]; kv_valid: bool [B, S] (rows may sit at
    different slots). The kernel takes a prefix mask and a block of slots: the prefix is every slot the row
    sees but the last one, the block is the last slot with the row's own visibility, so any visible set is
    exact. implementation / interpret: as in ``tree_decode_attention`` (None: Triton on a GPU). ``stacked``:
    k, v are a stacked cache [L, B, S, K, D] and ``layer`` (a Python int) the layer to attend to.
    Returns [B, 1, N, D] in q's dtype.
    """
    del modality
    if stacked and not isinstance(layer, int):
        raise ValueError(f"layer: expected a Python int with a stacked cache (stacked=True); received {layer!r}")
    stacked_layer = layer if stacked else None
    b, t, n, d = q.shape
    s_len = k.shape[-3]
    if t != 1 or q_positions.shape != (b, 1) or kv_valid.shape != (b, s_len):
        raise ValueError(f"q_positions / kv_valid: expected [B, 1] / [B, S] with q [B, 1, N, D] (one query per row), "
                         f"got {q_positions.shape} / {kv_valid.shape} with q {q.shape}")
    visible = kv_valid
    if causal:
        visible = visible & (jnp.arange(s_len, dtype=q_positions.dtype)[None] <= q_positions)
    prefix = visible.at[:, s_len - 1].set(False)
    block = visible[:, s_len - 1][:, None, None]  # [B, 1, 1]
    return tree_decode_attention(q, k, v, prefix, s_len - 1, block, sm_scale=sm_scale,
                                 implementation=implementation, interpret=interpret, layer=stacked_layer)
