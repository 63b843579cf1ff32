"""Rotary position embeddings: 1D and multimodal (M-RoPE) tables for the decoder, 2D for the vision tower
(the 1-D frequencies of the text LMs, scaled or not, come from ``models.rope_scaling``)."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def inv_freq(dim: int, theta: float) -> jax.Array:
    """Inverse frequencies ``theta ** (-2i / dim)`` for i < dim / 2 -> float32 [dim // 2]."""
    return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def rope_cos_sin(position_ids: jax.Array, inv_freq: jax.Array, scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """1-D rotary tables. position_ids: int [B, T]; inv_freq: float32 [D / 2]; ``scaling`` multiplies both
    tables (YaRN's attention factor) -> cos, sin float32 [B, T, D]."""
    if position_ids.ndim != 2:
        raise ValueError(f"position_ids: expected shape [B, T], got {position_ids.shape}")
    f = position_ids.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb) * jnp.float32(scaling), jnp.sin(emb) * jnp.float32(scaling)


def mrope_cos_sin(position_ids: jax.Array, head_dim: int, theta: float,
                  mrope_section: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """Multimodal RoPE tables with the chunked ``mrope_section`` layout of Qwen2/2.5-VL.

    position_ids: int [3, B, T] (temporal, height, width ids; equal rows for text).
    The first ``mrope_section[0]`` frequencies take the temporal ids, the next ``mrope_section[1]``
    the height ids, the last ``mrope_section[2]`` the width ids; the table is then repeated for the
    two rotated halves. Returns cos, sin: float32 [B, T, head_dim].
    """
    if position_ids.ndim != 3 or position_ids.shape[0] != 3:
        raise ValueError(f"position_ids: expected shape [3, B, T], got {position_ids.shape}")
    if sum(mrope_section) != head_dim // 2:
        raise ValueError(f"mrope_section: expected sections summing to head_dim/2={head_dim // 2}, "
                         f"got {tuple(mrope_section)}")
    freqs = position_ids.astype(jnp.float32)[..., None] * inv_freq(head_dim, theta)  # [3, B, T, D/2]
    parts, start = [], 0
    for axis_id, size in enumerate(mrope_section):
        parts.append(freqs[axis_id, :, :, start:start + size])
        start += size
    f = jnp.concatenate(parts, axis=-1)  # [B, T, D/2]
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x: jax.Array) -> jax.Array:
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, N, D] (or [T, N, D]), cos/sin: [B, T, D] (or [T, D]) -> rotated x in x.dtype."""
    c = cos[..., None, :]
    s = sin[..., None, :]
    return (x * c + rotate_half(x) * s).astype(x.dtype)


def vision_cos_sin(hpos: jax.Array, wpos: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """2D (axial) rotary tables of the Qwen2.5-VL vision tower.

    hpos, wpos: int [P] row/column of each patch. Height and width each take a quarter of the
    head dim with the same frequencies; the halves are repeated for rotate_half.
    Returns cos, sin: float32 [P, head_dim].
    """
    spatial = head_dim // 2
    f = inv_freq(spatial, theta)  # [head_dim // 4]
    fh = hpos.astype(jnp.float32)[:, None] * f
    fw = wpos.astype(jnp.float32)[:, None] * f
    hw = jnp.concatenate([fh, fw], axis=-1)
    emb = jnp.concatenate([hw, hw], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)
