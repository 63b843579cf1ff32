"""`swiglu_quantize` in the Pallas Triton lowering: one pass over the gate / up GEMM result.

XLA runs ``silu(g) * u`` followed by a per-row fp8 quantization as a reduction fusion that writes the bf16 product
and its row maxima, then a second fusion that reads the product again and converts it (the 7B decoder's MLP at
16,384 rows, H200: 1.86 GB moved in about 1.0 ms, then 0.93 GB in 0.4 ms). Here one program holds ``rows`` whole
rows in registers: it reads its rows of y once, forms h, takes the row maxima and writes the float8 values and the
scales, so y is read once and only the float8 result is written (the same shape: 0.48 ms against XLA's 1.41 ms,
3.2 TB/s, `tools/swiglu_quantize_bench.py`). Block shapes in Triton are powers of two and a row of
``F`` columns generally is not (18,944 in the 7B decoder, 3,424 in its vision tower), so the row is cut into the
powers of two of F's binary form (18,944 = 16,384 + 2,048 + 512), each loaded unmasked; the pieces' maxima are
combined before any piece is scaled. F must be a multiple of 16 (the fp8 GEMM's sizes are too), so every piece
is at least 16 wide and loads stay vectorized.

A per-column bias (the vision tower's MLP has one) is optional: read once per program in y's dtype and broadcast
over its rows. Per-column vectors cost time (H200, the tower's shape, `tools/swiglu_quantize_bench.py`): 0.09 ms
without, 0.12 ms with a bfloat16 bias, 0.13-0.18 ms with a per-channel scale as well (XLA: 0.22 ms), 0.17-0.27 ms
with float32 vectors; so the scales are per row only and the weights are quantized to suit (`models.fp8_linear`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.swiglu_quantize.reference import FP8, FP8_MAX


def pieces(f: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) of the powers of two that sum to ``f``, widest first: 18944 -> (0, 16384), (16384, 2048),
    (18432, 512)."""
    out, off = [], 0
    for bit in reversed(range(f.bit_length())):
        if f >> bit & 1:
            out.append((off, 1 << bit))
            off += 1 << bit
    return tuple(out)


def _sigmoid(g: jax.Array, approx: bool) -> jax.Array:
    """``1 / (1 + exp(-g))`` as ``0.5 + 0.5 tanh(g / 2)``: with ``approx`` one ``tanh.approx.f32`` instruction
    (relative error about 2^-11, far below float8's 2^-4) instead of an exponential and an IEEE division."""
    t = pltriton.approx_tanh(0.5 * g) if approx else jnp.tanh(0.5 * g)
    return 0.5 + 0.5 * t


def _kernel(y_ref, gs_ref, us_ref, *refs, f: int, rows: int, approx: bool, col_bias: bool):
    cb_ref = refs[0] if col_bias else None
    q_ref, s_ref = refs[-2:]
    r = pl.ds(pl.program_id(0) * rows, rows)
    gs, us = gs_ref[r, :], us_ref[r, :]  # [rows, 1]

    def half(start: int, width: int, row_scale):
        z = y_ref[r, pl.ds(start, width)].astype(jnp.float32) * row_scale
        if cb_ref is not None:  # [1, width] stored in y's dtype, shared by the program's rows
            z = z + cb_ref[:, pl.ds(start, width)].astype(jnp.float32)
        return z

    parts = pieces(f)
    hs, amax = [], None
    for off, width in parts:
        g, u = half(off, width, gs), half(f + off, width, us)
        h = g * _sigmoid(g, approx) * u
        hs.append(h)
        m = jnp.max(jnp.abs(h), axis=1, keepdims=True)
        amax = m if amax is None else jnp.maximum(amax, m)
    ok = amax > 0
    inv = jnp.where(ok, FP8_MAX / amax, 1.0)
    for (off, width), h in zip(parts, hs):
        q_ref[r, pl.ds(off, width)] = (h * inv).astype(q_ref.dtype)
    s_ref[r, :] = jnp.where(ok, amax / FP8_MAX, 1.0) + amax * 0.0  # amax * 0 is NaN for an inf or NaN amax, else 0


@functools.partial(jax.jit, static_argnames=("rows", "num_warps", "approx", "interpret"))
def swiglu_quantize_triton(y: jax.Array, gate_scale: jax.Array, up_scale: jax.Array, col_bias: jax.Array | None, *,
                           rows: int, num_warps: int, approx: bool = True,
                           interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Shapes and meaning as in `pallas_kernels.swiglu_quantize.api.swiglu_quantize`; inputs assumed validated
    (M a multiple of ``rows``, F a multiple of 16). ``approx``: the sigmoid through ``tanh.approx`` (`_sigmoid`;
    the interpreter has no inline PTX, so ``interpret`` uses the exact tanh)."""
    m, f = y.shape[0], y.shape[1] // 2
    cols = [] if col_bias is None else [col_bias.astype(y.dtype).reshape(1, 2 * f)]
    return pl.pallas_call(
        functools.partial(_kernel, f=f, rows=rows, approx=approx and not interpret, col_bias=col_bias is not None),
        grid=(m // rows,),
        in_specs=[pl.no_block_spec] * (3 + len(cols)),
        out_specs=[pl.no_block_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((m, f), FP8), jax.ShapeDtypeStruct((m, 1), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="swiglu_quantize",
    )(y, gate_scale.astype(jnp.float32), up_scale.astype(jnp.float32), *cols)
