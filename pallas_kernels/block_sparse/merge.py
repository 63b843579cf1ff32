"""Exact combination of two partial attention results over disjoint key sets."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_attention(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Merge softmax-normalised partial outputs by their log-sum-exps.

    out_a/out_b ``[B,T,N,D]``, lse_a/lse_b float32 ``[B,N,T]`` (``-inf`` for rows with no
    keys) -> (out ``[B,T,N,D]`` in out_a's dtype, lse ``[B,N,T]`` float32). A row empty in
    both inputs stays out = 0, lse = -inf; an empty part (lse -inf) contributes nothing
    whatever its out holds; a NaN lse in either part gives NaN out and NaN lse
    (`pallas_kernels.nonfinite`).
    """
    for name, x, rank in (("out_a", out_a, 4), ("lse_a", lse_a, 3), ("out_b", out_b, 4), ("lse_b", lse_b, 3)):
        if getattr(x, "ndim", None) != rank:
            raise ValueError(f"{name}: expected rank {rank}; received shape {getattr(x, 'shape', None)}")
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_b: expected shape {out_a.shape} (of out_a); received {out_b.shape}")
    b, t, n, _ = out_a.shape
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.shape != (b, n, t):
            raise ValueError(f"{name}: expected shape {(b, n, t)} ([B, N, T] from out_a); received {x.shape}")
    lse_a = lse_a.astype(jnp.float32)
    lse_b = lse_b.astype(jnp.float32)
    m = jnp.maximum(lse_a, lse_b)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    w_a = jnp.exp(lse_a - m_safe)
    w_b = jnp.exp(lse_b - m_safe)
    total = w_a + w_b
    empty = total == 0.0  # NaN weights are not empty: they propagate
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))
    inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))
    wa = jnp.einsum("bnt->btn", w_a * inv)[..., None]
    wb = jnp.einsum("bnt->btn", w_b * inv)[..., None]
    out = (jnp.where(wa == 0.0, 0.0, wa * out_a.astype(jnp.float32))
           + jnp.where(wb == 0.0, 0.0, wb * out_b.astype(jnp.float32)))
    return out.astype(out_a.dtype), lse
