"""`layer_matmul`: validation and dispatch to an implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.checks import check_pow2, fmt_shape
from pallas_kernels.layer_matmul.reference import layer_matmul_reference
from pallas_kernels.layer_matmul.triton import layer_matmul_triton
from pallas_kernels.platform import chosen_implementation

IMPLEMENTATIONS = ("reference", "triton")
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def layer_matmul(x: jax.Array, w: jax.Array, layer: int, *, implementation: str | None = None,
                 interpret: bool = False, tile_k: int = 256, tile_n: int = 128) -> jax.Array:
    """``x @ w[layer]`` without copying the layer out of the stacked weight (a decoder's few-row matmuls).

    Args:
      x: ``[M, K]`` (a few rows: a decode step's tokens); bf16, fp16 or fp32.
      w: ``[L, K, N]``, the layers' weights stacked; x's dtype.
      layer: a Python int in ``[0, L)`` (static: each layer compiles its own call).
      implementation: "reference" (slice + ``jnp.dot``) | "triton" | None (Triton on a GPU or when ``interpret``).
      tile_k, tile_n: the Triton tile (powers of two >= 16).

    Returns ``[M, N]`` in x's dtype (float32 accumulation).
    """
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"x: expected a 2-D array [M, K]; received shape {fmt_shape(getattr(x, 'shape', ()))}")
    m, k = x.shape
    if getattr(w, "ndim", None) != 3 or w.shape[1] != k:
        raise ValueError(f"w: expected [L, K={k}, N] (K from x [M, K]); received {fmt_shape(getattr(w, 'shape', ()))}")
    if jnp.dtype(x.dtype) not in map(jnp.dtype, DTYPES) or w.dtype != x.dtype:
        raise ValueError(f"x / w: expected one dtype of bfloat16, float16, float32; received {x.dtype} / {w.dtype}")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < w.shape[0]:
        raise ValueError(f"layer: expected a Python int in [0, L={w.shape[0]}); received {layer!r}")
    check_pow2("tile_k", tile_k, 16)
    check_pow2("tile_n", tile_n, 16)
    implementation = chosen_implementation(implementation, interpret, IMPLEMENTATIONS)
    if implementation == "reference":
        return layer_matmul_reference(x, w, layer=layer)
    return layer_matmul_triton(x, w, layer=layer, tile_k=tile_k, tile_n=tile_n, interpret=interpret)
