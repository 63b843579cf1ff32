"""`phase_masses` in the Pallas Triton lowering: one program per (stride, row) reads its row once, as rows of
``stride`` positions.

The strides are grouped by their padded width (a power of two >= the stride); one kernel per group, its programs run
the group's strides fastest, so the programs reading one row of ``vertical`` run together and share it through L2.
A program steps over its row ``rows_per_step`` strides at a time: it loads an ``[rows_per_step, W]`` tile (row r,
column p: position ``(i rows_per_step + r) stride + p``, masked where p >= stride or past S), adds it to a float32
accumulator, and at the end sums the accumulator's rows into the phase masses (-inf past the stride). One launch per
width group replaces XLA's reshape-and-sum per stride; the sums are the same up to float32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.phase_mass.reference import width
from pallas_kernels.tiling import next_pow2

TILE_ELEMENTS = 4096  # positions a program loads per step (rows_per_step = TILE_ELEMENTS / W)
MAX_STRIDE = 8192  # the widest tile a program keeps ([1, W] float32 accumulator)


def _kernel(strides_ref, v_ref, o_ref, *, rows_per_step: int, s: int):
    c = strides_ref[pl.program_id(0)]
    w = o_ref.shape[-1]
    col = lax.broadcasted_iota(jnp.int32, (rows_per_step, w), 1)
    row = lax.broadcasted_iota(jnp.int32, (rows_per_step, w), 0)
    span = c * rows_per_step

    def body(i, acc):
        at = (i * rows_per_step + row) * c + col
        return acc + pltriton.load(v_ref.at[at], mask=(col < c) & (at < s), other=0.0)

    acc = lax.fori_loop(0, (s + span - 1) // span, body, jnp.zeros((rows_per_step, w), jnp.float32))
    o_ref[...] = jnp.where(lax.broadcasted_iota(jnp.int32, (w,), 0) < c, jnp.sum(acc, axis=0), -jnp.inf)


def _group(v: jax.Array, strides: tuple[int, ...], w: int, interpret: bool, num_warps: int) -> jax.Array:
    """``[R, S]`` -> ``[R, len(strides), w]`` for strides of padded width w."""
    r, s = v.shape
    return pl.pallas_call(
        functools.partial(_kernel, rows_per_step=max(1, TILE_ELEMENTS // w), s=s),
        grid=(len(strides), r),
        in_specs=[pl.BlockSpec((len(strides),), lambda c, i: (0,)),
                  pl.BlockSpec((None, s), lambda c, i: (i, 0))],
        out_specs=pl.BlockSpec((None, None, w), lambda c, i: (i, c, 0)),
        out_shape=jax.ShapeDtypeStruct((r, len(strides), w), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=interpret,
        name="phase_masses",
    )(jnp.asarray(strides, jnp.int32), v)


@functools.partial(jax.jit, static_argnames=("strides", "interpret", "num_warps"))
def phase_masses_triton(vertical: jax.Array, strides: tuple[int, ...], *, interpret: bool = False,
                        num_warps: int = 4) -> jax.Array:
    """vertical float32 ``[B, N, S]`` -> ``[B, N, C, W]`` as `reference.phase_masses_reference` (inputs assumed
    validated by `pallas_kernels.phase_mass.api`)."""
    b, n, s = vertical.shape
    w_all = width(strides)
    v = vertical.reshape(b * n, s)
    groups: dict[int, list[int]] = {}
    for i, st in enumerate(strides):
        groups.setdefault(next_pow2(st), []).append(i)
    parts, order = [], []
    for w, idx in sorted(groups.items()):
        out = _group(v, tuple(strides[i] for i in idx), w, interpret, num_warps)
        parts.append(jnp.pad(out, ((0, 0), (0, 0), (0, w_all - w)), constant_values=-jnp.inf))
        order += idx
    out = jnp.concatenate(parts, axis=1)
    if order != sorted(order):  # back to the strides' order
        out = out[:, np.argsort(np.asarray(order))]
    return out.reshape(b, n, len(strides), w_all)
