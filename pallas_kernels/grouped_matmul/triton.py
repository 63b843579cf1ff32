"""Grouped matmul in the Pallas Triton lowering: one program per (row tile of one group, column tile).

The rows of group g are the ``sizes[g]`` rows after the earlier groups'. The wrapper cuts every group into
tiles of ``tile_m`` rows that start at the group's first row (so a tile never holds two groups; the last
tile of a group is partial) and lists them: tile t has its group, first row and row count (`tile_table`).
At most ``ceil(M / tile_m) + G`` tiles exist, a static bound; the grid has that many row slots and slots
past the last real tile do nothing. A program loads its rows in ``tile_k`` chunks (masked past the group's
end), multiplies them with the group's ``[tile_k, tile_n]`` slice of rhs, accumulates in float32 and
stores its rows (masked), so tiles of neighbouring groups write disjoint rows. The grid is (row slot,
column tile) with the column tile fastest: the programs running together share one lhs tile and one
group's matrix. lhs is padded by ``tile_m`` rows so a partial last tile never reads past the array; K and N
that are not multiples of the tiles are zero-padded (a copy of rhs: real expert shapes are multiples).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tiling import cdiv
from pallas_kernels.tiling import pad_to as _pad_to


def tile_table(group_sizes: jax.Array, m: int, tile_m: int) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """(group, first row, rows) int32 ``[slots]`` of every row tile and the static slot count
    ``ceil(m / tile_m) + G``; slots past the last tile have 0 rows. Sizes are clipped so the groups
    fit in m rows (the API checks concrete sizes)."""
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = jnp.maximum(ends - starts, 0)
    tiles = (sizes + tile_m - 1) // tile_m
    tile_ends = jnp.cumsum(tiles)
    slots = cdiv(m, tile_m) + g
    t = jnp.arange(slots, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right").astype(jnp.int32), g - 1)
    local = t - (tile_ends[group] - tiles[group])
    first = starts[group] + local * tile_m
    rows = jnp.where(t < tile_ends[-1], jnp.clip(ends[group] - first, 0, tile_m), 0)
    return group, first, rows.astype(jnp.int32), slots


def _kernel(group_ref, first_ref, rows_ref, lhs_ref, rhs_ref, out_ref, *, tile_m: int, tile_n: int, tile_k: int,
            k_tiles: int):
    slot, col = pl.program_id(0), pl.program_id(1)
    rows = rows_ref[slot]

    @pl.when(rows > 0)
    def _():
        g = group_ref[slot]
        first = first_ref[slot]
        row_ok = lax.broadcasted_iota(jnp.int32, (tile_m,), 0) < rows
        n0 = col * tile_n

        def body(i, acc):
            k0 = i * tile_k
            a = pltriton.load(lhs_ref.at[pl.ds(first, tile_m), pl.ds(k0, tile_k)], mask=row_ok[:, None], other=0.0)
            b = rhs_ref[g, pl.ds(k0, tile_k), pl.ds(n0, tile_n)]
            return acc + pltriton.dot(a, b)

        acc = lax.fori_loop(0, k_tiles, body, jnp.zeros((tile_m, tile_n), jnp.float32))
        pltriton.store(out_ref.at[pl.ds(first, tile_m), pl.ds(n0, tile_n)], acc.astype(out_ref.dtype),
                       mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("tile_m", "tile_n", "tile_k", "num_warps", "num_stages", "interpret"))
def grouped_matmul_triton(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, tile_m: int = 128,
                          tile_n: int = 128, tile_k: int = 64, num_warps: int = 8, num_stages: int = 3,
                          interpret: bool = False) -> jax.Array:
    """See `api.grouped_matmul`; inputs are assumed validated. lhs ``[M, K]``, rhs ``[G, K, N]``,
    group_sizes int32 ``[G]`` -> ``[M, N]`` in lhs's dtype; rows past the groups are 0."""
    m, k_dim = lhs.shape
    n = rhs.shape[2]
    group, first, rows, slots = tile_table(group_sizes, m, tile_m)
    k_pad = cdiv(k_dim, tile_k) * tile_k
    n_pad = cdiv(n, tile_n) * tile_n
    lhs_in = _pad_to(_pad_to(lhs, 0, m + tile_m), 1, k_pad)  # a partial last tile never reads past the rows
    rhs_in = _pad_to(_pad_to(rhs, 1, k_pad), 2, n_pad)
    kernel = functools.partial(_kernel, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, k_tiles=k_pad // tile_k)
    out = pl.pallas_call(
        kernel,
        grid=(slots, n_pad // tile_n),
        in_specs=[pl.no_block_spec] * 5,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((m + tile_m, n_pad), lhs.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(group, first, rows, lhs_in, rhs_in)
    total = jnp.minimum(jnp.sum(group_sizes.astype(jnp.int32)), m)
    return jnp.where((jnp.arange(m) < total)[:, None], out[:m, :n], 0).astype(lhs.dtype)
