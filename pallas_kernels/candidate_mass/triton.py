"""Candidate mass in the Pallas Triton lowering.

One program per (query block, query head, batch). The wrapper takes every ``stride``-th row once (so a
program's tile is ``query_block / stride`` rows) and gives each row the log-sum-exp of its gamma group's
sampled row. The program walks its candidate list: per listed key block one ``[rows, block]`` score tile,
each row's log-sum-exp over the block (base 2, float32), ``exp(lse - ref)`` summed over the rows, one
scalar stored per candidate. Keys after a row's position and padding rows count nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tiling import LOG2E, next_pow2, pad_to


def _kernel(q_ref, k_ref, cand_ref, ref_ref, pos_ref, o_ref, *, scale: float, block: int, num_cand: int,
            kv_len: int, num_kv_blocks: int):
    q = q_ref[...]  # [rows, Dp]
    ref = ref_ref[...] * LOG2E  # [rows] base-2 reference lse (-inf: the row counts nothing)
    q_pos = pos_ref[...]  # [rows] positions (-1: padding)
    iota = lax.broadcasted_iota(jnp.int32, (block,), 0)

    def body(c, carry):
        j = cand_ref[c]
        ok = (j >= 0) & (j < num_kv_blocks)
        start = jnp.where(ok, j, 0) * block
        k = k_ref[pl.ds(start, block), :]
        s = pltriton.dot(q, k, trans_b=True) * (scale * LOG2E)  # [rows, block] base 2
        k_pos = start + iota
        vis = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_len)
        s = jnp.where(vis, s, -jnp.inf)
        m = jnp.max(s, axis=1)
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)
        l = jnp.sum(jnp.exp2(s - m_safe[:, None]), axis=1)
        fin = (m > -jnp.inf) & (ref > -jnp.inf)
        row = jnp.where(fin, jnp.exp2(jnp.where(fin, m_safe + jnp.log2(jnp.where(fin, l, 1.0)) - ref, 0.0)), 0.0)
        o_ref[c] = jnp.where(ok, jnp.sum(row), 0.0)
        return carry

    lax.fori_loop(0, num_cand, body, 0)


@functools.partial(jax.jit, static_argnames=("query_block", "block", "stride", "gamma", "sm_scale", "interpret",
                                             "num_warps"))
def candidate_mass_triton(q: jax.Array, k: jax.Array, candidates: jax.Array, ref_lse: jax.Array, *,
                          query_block: int, block: int, stride: int, gamma: int, sm_scale: float,
                          interpret: bool = False, num_warps: int = 4) -> jax.Array:
    """Shapes and meaning as in `pallas_kernels.candidate_mass.api.candidate_mass`; inputs assumed validated."""
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    nq, c = candidates.shape[2], candidates.shape[3]
    nk = -(-s // block)
    rows = query_block // stride
    t_pad = nq * query_block
    d_pad = max(16, next_pow2(d))
    c_pad = max(2, next_pow2(c))
    idx = jnp.arange(0, t_pad, stride, dtype=jnp.int32)  # the rows taken, [nq * rows]
    q_sub = pad_to(pad_to(q, 1, t_pad)[:, idx], 3, d_pad)  # [B, nq * rows, N, Dp]
    k_in = pad_to(pad_to(k, 3, d_pad), 1, nk * block)
    ref = jnp.pad(ref_lse.astype(jnp.float32), ((0, 0), (0, 0), (0, t_pad // gamma + 1)),
                  constant_values=-jnp.inf)[..., idx // gamma]  # [B, N, nq * rows]
    pos = jnp.where(idx < t, idx + (s - t), -1)
    cand = jnp.pad(candidates.astype(jnp.int32), ((0, 0), (0, 0), (0, 0), (0, c_pad - c)), constant_values=-1)
    kernel = functools.partial(_kernel, scale=sm_scale, block=block, num_cand=c, kv_len=s, num_kv_blocks=nk)
    out = pl.pallas_call(
        kernel,
        grid=(nq, n, b),
        in_specs=[
            pl.BlockSpec((None, rows, None, d_pad), lambda i, h, z: (z, i, h, 0)),
            pl.BlockSpec((None, nk * block, None, d_pad), lambda i, h, z: (z, 0, h // groups, 0)),
            pl.BlockSpec((None, None, None, c_pad), lambda i, h, z: (z, h, i, 0)),
            pl.BlockSpec((None, None, rows), lambda i, h, z: (z, h, i)),
            pl.BlockSpec((rows,), lambda i, h, z: (i,)),
        ],
        out_specs=pl.BlockSpec((None, None, None, c_pad), lambda i, h, z: (z, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, n, nq, c_pad), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="candidate_mass",
    )(q_sub, k_in, cand, ref, pos)
    return out[..., :c]
