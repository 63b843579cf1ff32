"""`phase_masses` in XLA: one padded reshape and sum per stride (the definition)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.tiling import next_pow2


def width(strides: tuple[int, ...]) -> int:
    """W: the phases axis of the output, the largest stride rounded up to a power of two."""
    return next_pow2(max(strides))


def phase_mass(vertical: jax.Array, stride: int) -> jax.Array:
    """vertical ``[B, N, S]`` -> mass per phase ``[B, N, stride]`` (the positions j with j % stride = p)."""
    s = vertical.shape[-1]
    pad = (-s) % stride
    v = jnp.pad(vertical, ((0, 0), (0, 0), (0, pad)))
    return v.reshape(v.shape[:2] + (-1, stride)).sum(-2)


def phase_masses_reference(vertical: jax.Array, strides: tuple[int, ...]) -> jax.Array:
    """vertical float32 ``[B, N, S]`` -> ``[B, N, C, W]``: row c holds `phase_mass` at ``strides[c]`` in its first
    ``strides[c]`` entries and -inf after them (so one top_k over the last axis takes every stride's best phases)."""
    w = width(strides)
    rows = [jnp.pad(phase_mass(vertical, st), ((0, 0), (0, 0), (0, w - st)), constant_values=-jnp.inf)
            for st in strides]
    return jnp.stack(rows, axis=-2)
