"""Pure-JAX candidate mass: the definition of correct. One query block at a time (``lax.map``), the listed
key blocks gathered, so memory is O(B * N * C * block * D) per query block, never T x S."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("query_block", "block", "stride", "gamma", "sm_scale"))
def candidate_mass_reference(q: jax.Array, k: jax.Array, candidates: jax.Array, ref_lse: jax.Array, *,
                             query_block: int, block: int, stride: int, gamma: int, sm_scale: float) -> jax.Array:
    """Shapes and meaning as in `pallas_kernels.candidate_mass.api.candidate_mass`; inputs assumed validated."""
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    nq = candidates.shape[2]
    nk = -(-s // block)
    t_pad = nq * query_block
    qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
    kf = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, nk * block - s), (0, 0), (0, 0)))
    kf = kf.reshape(b, nk, block, kh, d)  # [B, nk, block, K, D]; query head h reads key head h // groups
    rows = jnp.arange(t_pad, dtype=jnp.int32)
    ref = jnp.pad(ref_lse.astype(jnp.float32), ((0, 0), (0, 0), (0, nq * query_block // gamma + 1)),
                  constant_values=-jnp.inf)[..., rows // gamma]  # [B, N, Tp]: each row's sampled row
    used = (rows < t) & (rows % stride == 0)
    pos = rows + (s - t)

    def one(i):
        qb = jax.lax.dynamic_slice_in_dim(qf, i * query_block, query_block, axis=1)  # [B, qb, N, D]
        rb = jax.lax.dynamic_slice_in_dim(ref, i * query_block, query_block, axis=2)  # [B, N, qb]
        ub = jax.lax.dynamic_slice_in_dim(used, i * query_block, query_block)
        pb = jax.lax.dynamic_slice_in_dim(pos, i * query_block, query_block)
        ids = candidates[:, :, i]  # [B, N, C]
        ok = (ids >= 0) & (ids < nk)
        safe = jnp.where(ok, ids, 0)
        kk = kf[jnp.arange(b)[:, None, None], safe, :, (jnp.arange(n) // groups)[None, :, None]]  # [B,N,C,block,D]
        sc = jnp.einsum("bqnd,bncjd->bncqj", qb, kk, precision=jax.lax.Precision.HIGHEST) * sm_scale
        kpos = safe[..., None] * block + jnp.arange(block)  # [B, N, C, block]
        vis = (kpos[:, :, :, None, :] <= pb[None, None, None, :, None]) & (kpos < s)[:, :, :, None, :]
        lse = jax.nn.logsumexp(jnp.where(vis, sc, -jnp.inf), axis=-1)  # [B, N, C, qb]
        fin = jnp.isfinite(lse) & jnp.isfinite(rb)[:, :, None, :] & ub[None, None, None, :]
        mass = jnp.where(fin, jnp.exp(jnp.where(fin, lse - rb[:, :, None, :], 0.0)), 0.0).sum(-1)
        return jnp.where(ok, mass, 0.0)

    return jnp.moveaxis(jax.lax.map(one, jnp.arange(nq)), 0, 2)  # [B, N, nq, C]
