"""`swiglu_quantize`: validation, tiling and dispatch to an implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.checks import check_int, check_pow2, fmt_shape
from pallas_kernels.platform import chosen_implementation
from pallas_kernels.swiglu_quantize.reference import swiglu_quantize_reference
from pallas_kernels.swiglu_quantize.triton import swiglu_quantize_triton

IMPLEMENTATIONS = ("reference", "triton")
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def default_tiling(m: int, f: int) -> tuple[int, int]:
    """(rows, num_warps) of one program: one row, about one warp per 1,024 columns (a power of two, 4 to 16). On an
    H200 (`tools/swiglu_quantize_bench.py`, 2026-11-26) that was the fastest tiling at both of the 7B model's
    widths: F = 18,944 with 16 warps 0.48 ms per 16,384 rows (3.2 TB/s), F = 3,424 with 4 warps 0.093 ms (3.0 TB/s);
    two or more rows per program were 0-20% slower, with a column bias too (F = 3,424, bf16 bias: one row 0.115 ms,
    two 0.149, four 0.170)."""
    del m
    return 1, max(4, min(16, 1 << max(0, (f // 1024).bit_length() - 1)))


def swiglu_quantize(y: jax.Array, gate_scale: jax.Array, up_scale: jax.Array, col_bias: jax.Array | None = None, *,
                    implementation: str | None = None,
                    interpret: bool = False, rows: int | None = None, num_warps: int | None = None,
                    approx: bool = True) -> tuple[jax.Array, jax.Array]:
    """``silu(g) * u`` of a gate | up product, quantized per row to float8_e4m3fn for the next fp8 GEMM.

    The scales are per row: per-column vectors cost time (`pallas_kernels.swiglu_quantize.triton`), so
    `models.fp8_linear` quantizes gate weights with one scale per tensor; the decoder folds the up weight's
    per-channel scales into the down weight, the vision tower (whose MLP has biases) quantizes up per tensor too
    and passes its biases as ``col_bias``.

    Args:
      y: ``[M, 2F]`` bf16 / fp16 / fp32, the gate columns then the up columns (an fp8 GEMM's unscaled result).
      gate_scale, up_scale: ``[M, 1]`` float32, the scale of each row of the gate and of the up half.
      col_bias: ``[2F]`` float or None, rounded to y's dtype: ``z = y * row scale + col_bias`` (float32).
      implementation: "reference" | "triton" | None (Triton on a GPU or when ``interpret``).
      rows, num_warps: the Triton tiling (rows of y per program, a power of two dividing M); default
        `default_tiling`. approx: the kernel's sigmoid through the GPU's ``tanh.approx`` (relative error about
        2^-11, below float8's rounding) rather than an exponential and a division.

    Returns ``(q, scale)``: q float8_e4m3fn ``[M, F]``, scale float32 ``[M, 1]`` with ``silu(g) * u ~ q * scale``
    where ``g | u = z`` (`swiglu_quantize_reference`: all-zero rows get scale 1, rows with an inf or NaN scale NaN).
    """
    if getattr(y, "ndim", None) != 2 or y.shape[1] % 2 or y.shape[0] < 1 or y.shape[1] < 2:
        raise ValueError(f"y: expected a 2-D array [M, 2F] (gate then up columns); received shape "
                         f"{fmt_shape(getattr(y, 'shape', ()))}")
    m, f = y.shape[0], y.shape[1] // 2
    if jnp.dtype(y.dtype) not in map(jnp.dtype, DTYPES):
        raise ValueError(f"y: expected dtype bfloat16, float16 or float32; received {y.dtype}")
    for name, scale in (("gate_scale", gate_scale), ("up_scale", up_scale)):
        if getattr(scale, "shape", None) != (m, 1) or not jnp.issubdtype(getattr(scale, "dtype", None), jnp.floating):
            raise ValueError(f"{name}: expected float [{m}, 1] (M from y [M, 2F]); received "
                             f"{fmt_shape(getattr(scale, 'shape', ()))} {getattr(scale, 'dtype', None)}")
    if col_bias is not None and (getattr(col_bias, "shape", None) != (2 * f,)
                                 or not jnp.issubdtype(getattr(col_bias, "dtype", None), jnp.floating)):
        raise ValueError(f"col_bias: expected None or float [{2 * f}] (2F from y [M, 2F]); received "
                         f"{fmt_shape(getattr(col_bias, 'shape', ()))} {getattr(col_bias, 'dtype', None)}")
    implementation = chosen_implementation(implementation, interpret, IMPLEMENTATIONS)
    if implementation == "reference":
        return swiglu_quantize_reference(y, gate_scale, up_scale, col_bias)
    if f % 16:
        raise ValueError(f"y: implementation='triton' takes F (half of y's {2 * f} columns) a multiple of 16; "
                         f"received F={f}")
    default_rows, default_warps = default_tiling(m, f)
    rows = default_rows if rows is None else rows
    num_warps = default_warps if num_warps is None else num_warps
    check_int("rows", rows, 1)
    if rows & (rows - 1) or m % rows:
        raise ValueError(f"rows: expected a power of two dividing M={m}; received {rows}")
    check_pow2("num_warps", num_warps, 1, 32)
    return swiglu_quantize_triton(y, gate_scale, up_scale, col_bias, rows=rows, num_warps=num_warps,
                                  approx=bool(approx), interpret=interpret)
