"""Candidate mass in the Pallas Triton lowering.

One program per (query block, query head, batch). The wrapper takes every ``stride``-th row once (so a
program's tile is ``query_block / stride`` rows) and gives each row the log-sum-exp of its gamma group's
sampled row. The program walks its candidate list ``per_step`` blocks at a time: it gathers their keys into
one ``[per_step * block, D]`` tile, computes one ``[rows, per_step * block]`` score tile and sums
``exp2(s - ref)`` over the rows and each block's keys (base 2, float32; ``sum_r exp(lse_r(j) - ref_r)`` is
the same sum taken key by key, so no per-block maximum or log is needed), and stores the ``per_step`` masses
with one vector store. Keys after a row's position, padding rows and rows whose reference is -inf count
nothing; ids outside ``[0, nk)`` give 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tiling import LOG2E, next_pow2, pad_to


def _kernel(q_ref, k_ref, cand_ref, ref_ref, pos_ref, o_ref, *, scale: float, block: int, per_step: int,
            steps: int, kv_len: int, num_kv_blocks: int):
    q = q_ref[...]  # [rows, Dp]
    ref = ref_ref[...] * LOG2E  # [rows] base-2 reference lse
    ref = jnp.where(ref == -jnp.inf, jnp.inf, ref)  # -inf: the row counts nothing (exp2(s - inf) = 0)
    q_pos = pos_ref[...]  # [rows] positions (-1: padding)
    width = per_step * block
    key = lax.broadcasted_iota(jnp.int32, (width,), 0)  # key slot in the step's tile

    def body(step, carry):
        base = step * per_step
        ids = cand_ref[pl.ds(base, per_step)]  # [per_step]
        ok = (ids >= 0) & (ids < num_kv_blocks)
        start = jnp.where(ok, ids, 0) * block  # [per_step]
        k_pos = jnp.reshape(jnp.broadcast_to(start[:, None], (per_step, block)), (width,)) + key % block
        k = k_ref[k_pos, :]  # [width, Dp] gathered rows
        s = pltriton.dot(q, k, trans_b=True) * (scale * LOG2E)  # [rows, width] base 2
        vis = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_len)
        e = jnp.where(vis, jnp.exp2(s - ref[:, None]), 0.0)
        col = jnp.sum(e, axis=0)  # [width]
        mass = jnp.sum(jnp.reshape(col, (per_step, block)), axis=1)  # [per_step]
        o_ref[pl.ds(base, per_step)] = jnp.where(ok, mass, 0.0)
        return carry

    lax.fori_loop(0, steps, body, 0)


@functools.partial(jax.jit, static_argnames=("query_block", "block", "stride", "gamma", "sm_scale", "interpret",
                                             "num_warps", "per_step", "num_stages"))
def candidate_mass_triton(q: jax.Array, k: jax.Array, candidates: jax.Array, ref_lse: jax.Array, *,
                          query_block: int, block: int, stride: int, gamma: int, sm_scale: float,
                          interpret: bool = False, num_warps: int = 4, per_step: int | None = None,
                          num_stages: int = 3) -> jax.Array:
    """Shapes and meaning as in `pallas_kernels.candidate_mass.api.candidate_mass`; inputs assumed validated.

    ``per_step``: candidate blocks per loop step (a power of two; default: score tiles of 4096 elements, at
    least one block, at most the padded candidate count); ``num_warps`` (default 4), ``num_stages`` (default 3).

    Tile sweep on an H100 (2026-11-25, `tools/candidate_mass_tune.py`: 128k tokens, 28 / 4 heads, D 128, bf16,
    256 candidates of 64 keys per 128-row query block; `bench/results/candidate-mass-tune_*`): every row
    (128-row tiles) 51.1 ms with one block per step (52.6 before this form, 81-117 with four); every 4th row
    (32-row tiles) 18.5 ms with two blocks per step (26.5 before). 8 warps were slower in every case."""
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    nq, c = candidates.shape[2], candidates.shape[3]
    nk = -(-s // block)
    rows = query_block // stride
    t_pad = nq * query_block
    d_pad = max(16, next_pow2(d))
    if per_step is None:
        per_step = max(1, 4096 // (rows * block))
    per_step = min(per_step, next_pow2(c))
    steps = -(-c // per_step)
    c_pad = max(2, steps * per_step)
    idx = jnp.arange(0, t_pad, stride, dtype=jnp.int32)  # the rows taken, [nq * rows]
    q_sub = pad_to(pad_to(q, 1, t_pad)[:, idx], 3, d_pad)  # [B, nq * rows, N, Dp]
    k_in = pad_to(pad_to(k, 3, d_pad), 1, nk * block)
    ref = jnp.pad(ref_lse.astype(jnp.float32), ((0, 0), (0, 0), (0, t_pad // gamma + 1)),
                  constant_values=-jnp.inf)[..., idx // gamma]  # [B, N, nq * rows]
    pos = jnp.where(idx < t, idx + (s - t), -1)
    cand = jnp.pad(candidates.astype(jnp.int32), ((0, 0), (0, 0), (0, 0), (0, c_pad - c)), constant_values=-1)
    kernel = functools.partial(_kernel, scale=sm_scale, block=block, per_step=per_step, steps=steps, kv_len=s,
                               num_kv_blocks=nk)
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
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="candidate_mass",
    )(q_sub, k_in, cand, ref, pos)
    return out[..., :c]
