"""Small helpers shared by the kernels: ceil division, powers of two, padding to tiles,
and the base-2 softmax constants."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def cdiv(a: int, b: int) -> int:
    """Ceil division of Python ints."""
    return -(-a // b)


def round_up(x: int, m: int) -> int:
    """Smallest multiple of ``m`` >= x (Python ints)."""
    return cdiv(x, m) * m


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (x - 1).bit_length())


def inverse_permutation(perm: jax.Array) -> jax.Array:
    """int ``[..., L]`` permutations of 0..L-1 along the last axis -> their inverses (one
    scatter; no sort)."""
    idx = jnp.broadcast_to(jnp.arange(perm.shape[-1], dtype=perm.dtype), perm.shape)
    return jnp.put_along_axis(jnp.zeros_like(perm), perm, idx, axis=-1, inplace=False)


def pad_to(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad ``axis`` of ``x`` up to ``size`` (no-op when it already has that size)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)
