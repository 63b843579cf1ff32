"""Small numerical building blocks shared by the model ports."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as in HF Qwen2: normalise in float32, cast back to ``x.dtype``, then scale.

    x: [..., H], weight: [H] -> [..., H] (dtype of ``x * weight``).
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def chunked_over_axis(fn: Callable[[jax.Array], jax.Array], x: jax.Array, axis: int, chunk: int | None) -> jax.Array:
    """Apply a position-wise ``fn`` to ``x`` in chunks of ``chunk`` along ``axis`` (bounds peak memory).

    ``fn`` must act independently on every index of ``axis`` (e.g. an MLP over tokens). The axis is
    padded to a multiple of ``chunk``, mapped with ``lax.map`` and sliced back. ``chunk=None`` or a
    chunk at least as long as the axis calls ``fn`` once.
    """
    n = x.shape[axis]
    if chunk is None or n <= chunk:
        return fn(x)
    pieces = -(-n // chunk)
    pad = pieces * chunk - n
    xm = jnp.moveaxis(x, axis, 0)
    if pad:
        xm = jnp.pad(xm, [(0, pad)] + [(0, 0)] * (xm.ndim - 1))
    xm = xm.reshape((pieces, chunk) + xm.shape[1:])
    ym = jax.lax.map(lambda c: jnp.moveaxis(fn(jnp.moveaxis(c, 0, axis)), axis, 0), xm)
    ym = ym.reshape((pieces * chunk,) + ym.shape[2:])[:n]
    return jnp.moveaxis(ym, 0, axis)
