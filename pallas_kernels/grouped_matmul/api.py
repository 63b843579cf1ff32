"""`grouped_matmul`: validation and dispatch to an implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.checks import check_pow2, fmt_shape
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference
from pallas_kernels.grouped_matmul.triton import grouped_matmul_triton
from pallas_kernels.platform import chosen_implementation

IMPLEMENTATIONS = ("reference", "triton")
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, implementation: str | None = None,
                   interpret: bool = False, tile_m: int = 128, tile_n: int = 128, tile_k: int = 64,
                   num_warps: int = 8, num_stages: int = 3) -> jax.Array:
    """Each group of rows times its own matrix (``jax.lax.ragged_dot``'s contract; the experts of a MoE layer).

    Args:
      lhs: ``[M, K]``, rows grouped: group g holds the ``group_sizes[g]`` rows after the earlier groups'.
      rhs: ``[G, K, N]``, one matrix per group; lhs's dtype (bf16, fp16 or fp32).
      group_sizes: int32 ``[G]``, >= 0, summing to at most M (checked when concrete; traced sizes are
        clipped so the groups fit in M rows).
      implementation: "reference" (``ragged_dot``) | "triton" | None (Triton on a GPU or when ``interpret``).
      tile_m, tile_n, tile_k, num_warps, num_stages: the Triton tile (powers of two >= 16) and launch.

    Returns:
      ``[M, N]`` in lhs's dtype, float32 accumulation; rows past ``sum(group_sizes)`` are 0.
    """
    if getattr(lhs, "ndim", None) != 2:
        raise ValueError(f"lhs: expected a 2-D array [M, K]; received shape {fmt_shape(getattr(lhs, 'shape', ()))}")
    m, k = lhs.shape
    if getattr(rhs, "ndim", None) != 3 or rhs.shape[1] != k:
        raise ValueError(f"rhs: expected [G, K={k}, N] (K from lhs [M, K]); received "
                         f"{fmt_shape(getattr(rhs, 'shape', ()))}")
    g = rhs.shape[0]
    if jnp.dtype(lhs.dtype) not in map(jnp.dtype, DTYPES) or rhs.dtype != lhs.dtype:
        raise ValueError(f"lhs / rhs: expected one dtype of bfloat16, float16, float32; received {lhs.dtype} / "
                         f"{rhs.dtype}")
    if getattr(group_sizes, "shape", None) != (g,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes: expected an integer array [G={g}] (G from rhs [G, K, N]); received "
                         f"{getattr(group_sizes, 'dtype', type(group_sizes).__name__)} "
                         f"{fmt_shape(getattr(group_sizes, 'shape', ()))}")
    if not isinstance(group_sizes, jax.core.Tracer):
        sizes = np.asarray(group_sizes)
        if sizes.min(initial=0) < 0 or sizes.sum() > m:
            raise ValueError(f"group_sizes: expected sizes >= 0 summing to at most M={m}; received sum "
                             f"{int(sizes.sum())}, min {int(sizes.min(initial=0))}")
    for name, value in (("tile_m", tile_m), ("tile_n", tile_n), ("tile_k", tile_k)):
        check_pow2(name, value)
    implementation = chosen_implementation(implementation, interpret, IMPLEMENTATIONS)
    group_sizes = group_sizes.astype(jnp.int32)
    if implementation == "reference":
        return grouped_matmul_reference(lhs, rhs, group_sizes)
    return grouped_matmul_triton(lhs, rhs, group_sizes, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
                                 num_warps=num_warps, num_stages=num_stages, interpret=interpret)
