"""Shared test helpers: random inputs, masked dense attention, random layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import BlockLayout


def random_qkv(seed: int, b: int, t: int, s: int, n: int, kh: int, d: int, dtype=jnp.float32):
    """Fresh normal inputs (never zeros): q [B,T,N,D], k/v [B,S,K,D]."""
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (b, t, n, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, kh, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, kh, d), jnp.float32).astype(dtype)
    return q, k, v


def masked_dense_attention(q, k, v, mask, sm_scale=None):
    """Float64-free dense reference on an explicit bool mask [B|1,N|1,T,S] (original order).

    Returns out [B,T,N,D] float32 and lse [B,N,T] (rows with no key: 0 and -inf)."""
    b, t, n, d = q.shape
    groups = n // k.shape[2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    kk = jnp.repeat(k.astype(jnp.float32), groups, axis=2)
    vv = jnp.repeat(v.astype(jnp.float32), groups, axis=2)
    s = jnp.einsum("btnd,bsnd->bnts", q.astype(jnp.float32), kk,
                   precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(mask, s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)
    l = p.sum(-1, keepdims=True)
    out = jnp.einsum("bnts,bsnd->btnd", p / jnp.where(l > 0, l, 1.0), vv,
                     precision=jax.lax.Precision.HIGHEST)
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)), -jnp.inf)
    return out, lse


def random_layout(rng: np.random.Generator, b, n, t, s, bq, bk, *, density=0.4, empty_rows=True,
                  perm=False, columns=0, lead_b=None, lead_n=None) -> BlockLayout:
    """Random layout with optional empty query blocks, permutations and single columns."""
    lb = b if lead_b is None else lead_b
    ln = n if lead_n is None else lead_n
    nq, nk = -(-t // bq), -(-s // bk)
    mask = rng.random((lb, ln, nq, nk)) < density
    if empty_rows and nq > 1:
        mask[..., rng.integers(0, nq), :] = False
    cols = ccount = None
    if columns:
        cols = np.zeros((lb, ln, nq, columns), np.int32)
        ccount = np.zeros((lb, ln, nq), np.int32)
        for idx in np.ndindex(lb, ln, nq):
            free = np.flatnonzero(~np.repeat(mask[idx], bk)[:s])
            m = int(rng.integers(0, min(columns, free.size) + 1))
            cols[idx][:m] = rng.choice(free, size=m, replace=False)
            ccount[idx] = m
        cols, ccount = jnp.asarray(cols), jnp.asarray(ccount)
    q_perm = kv_perm = None
    if perm:
        q_perm = jnp.asarray(np.stack([[rng.permutation(t) for _ in range(ln)] for _ in range(lb)]).astype(np.int32))
        kv_perm = jnp.asarray(np.stack([[rng.permutation(s) for _ in range(ln)] for _ in range(lb)]).astype(np.int32))
    return BlockLayout.from_block_mask(
        jnp.asarray(mask), q_len=t, kv_len=s, block_q=bq, block_k=bk,
        kv_columns=cols, kv_column_count=ccount, q_perm=q_perm, kv_perm=kv_perm,
    )


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
