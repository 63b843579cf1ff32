"""Layer matmul in the Pallas Triton lowering.

XLA runs ``x @ w[i]`` for a few rows as a split-K GEMM whose operand is the layer's slice reshaped to
``[splits, K / splits, N]``; a slice of the stacked weight cannot be viewed that way in place, so XLA copies
the layer first (a decode step of the 7B model on an H100: one 24.5 MiB copy of ``wo[i]`` per layer,
about 0.5 ms a step at batch 1). Here the stacked weight is the kernel's operand and the layer a block
index, so nothing is copied: one program per (``tile_n`` output columns, ``tile_k`` slice of K) multiplies
the rows (padded to 16) by its ``[tile_k, tile_n]`` tile of ``w[layer]`` and writes a float32 partial;
the partials over K are summed by XLA (``K / tile_k`` x M x N floats, a few percent of the weight's bytes).
K and N need not be tile multiples: the edge tiles load the weight under a mask (0 past K or N) and store the
partial's columns under a mask (the Triton lowering does not clip blocks at an array's edge; before 2026-11-28
this kernel stored whole tiles, so for N < tile_n it wrote past its rows, nondeterministically, found through the
speculative-decoding GPU test on a tiny model).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tiling import cdiv, pad_to, round_up

ROWS = 16  # the smallest M a Triton dot takes


def _kernel(x_ref, w_ref, o_ref, *, k: int, n: int, tile_k: int, tile_n: int):
    # The Triton lowering does not clip a block at the array's edge: a tile of w reaching past K or N reads other
    # memory, and an unmasked store of the last column tile writes into the next row of the partial (and past the
    # buffer), racing with that row's own program. So the edge tiles load and store under masks.
    if k % tile_k or n % tile_n:
        rows = pl.program_id(1) * tile_k + lax.broadcasted_iota(jnp.int32, (tile_k, tile_n), 0)
        cols = pl.program_id(0) * tile_n + lax.broadcasted_iota(jnp.int32, (tile_k, tile_n), 1)
        w = pltriton.load(w_ref, mask=(rows < k) & (cols < n), other=0)
    else:
        w = w_ref[...]
    acc = pltriton.dot(x_ref[...], w).astype(jnp.float32)
    if n % tile_n:
        cols = pl.program_id(0) * tile_n + lax.broadcasted_iota(jnp.int32, acc.shape, 1)
        pltriton.store(o_ref, acc, mask=cols < n)
    else:
        o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("layer", "tile_k", "tile_n", "num_warps", "num_stages", "interpret"))
def layer_matmul_triton(x: jax.Array, w: jax.Array, *, layer: int, tile_k: int = 256, tile_n: int = 128,
                        num_warps: int = 4, num_stages: int = 1, interpret: bool = False) -> jax.Array:
    """Shapes and meaning as in `pallas_kernels.layer_matmul.api.layer_matmul`; inputs assumed validated."""
    m, k = x.shape
    n = w.shape[2]
    rows = max(ROWS, round_up(m, ROWS))
    splits, cols = cdiv(k, tile_k), cdiv(n, tile_n)
    x_in = pad_to(pad_to(x, 0, rows), 1, splits * tile_k)  # zero rows / columns past K add nothing
    partial = pl.pallas_call(
        functools.partial(_kernel, k=k, n=n, tile_k=tile_k, tile_n=tile_n),
        grid=(cols, splits),
        in_specs=[
            pl.BlockSpec((rows, tile_k), lambda j, s: (0, s)),
            pl.BlockSpec((None, tile_k, tile_n), lambda j, s: (layer, s, j)),
        ],
        out_specs=pl.BlockSpec((None, rows, tile_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, rows, n), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="layer_matmul",
    )(x_in, w)
    return partial.sum(axis=0)[:m].astype(x.dtype)
