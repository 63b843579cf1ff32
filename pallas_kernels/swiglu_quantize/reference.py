"""Pure-JAX definition of `swiglu_quantize` (the kernels are tested against it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def swiglu_quantize_reference(y: jax.Array, gate_scale: jax.Array, up_scale: jax.Array,
                              col_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """y [M, 2F], gate_scale / up_scale [M, 1] float32, col_bias [2F] or None -> (float8_e4m3fn [M, F], float32
    [M, 1]).

    With ``z = y * [gate_scale | up_scale] + col_bias`` (float32; the bias rounded to y's dtype first, none: 0),
    ``g = z[:, :F]``, ``u = z[:, F:]`` and ``h = silu(g) * u``:
    ``q = h * 448 / max|h_row|`` rounded to float8 and ``scale = max|h_row| / 448``, so ``h ~ q * scale``. An
    all-zero row gets scale 1; a row whose maximum is not finite (an inf or NaN in h) gets scale NaN, so whatever
    consumes ``q * scale`` sees NaN for it, never a finite value."""
    f = y.shape[1] // 2
    rows = jnp.concatenate([jnp.broadcast_to(gate_scale, (y.shape[0], f)), jnp.broadcast_to(up_scale, (y.shape[0], f))],
                           axis=1)
    z = y.astype(jnp.float32) * rows.astype(jnp.float32)
    if col_bias is not None:
        z = z + col_bias.astype(y.dtype).astype(jnp.float32)
    g, u = z[:, :f], z[:, f:]
    h = g * (0.5 + 0.5 * jnp.tanh(0.5 * g)) * u  # sigmoid as the kernel writes it
    amax = jnp.max(jnp.abs(h), axis=1, keepdims=True)
    ok = amax > 0
    q = (h * jnp.where(ok, FP8_MAX / amax, 1.0)).astype(FP8)
    scale = jnp.where(ok, amax / FP8_MAX, 1.0) + jnp.where(jnp.isfinite(amax), 0.0, jnp.nan)
    return q, scale
