"""Rotary position embeddings: 1D (default or Llama-3.1 scaled) and multimodal (M-RoPE) for the decoder,
2D for the vision tower."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def inv_freq(dim: int, theta: float) -> jax.Array:
    """Inverse frequencies ``theta ** (-2i / dim)`` for i < dim / 2 -> float32 [dim // 2]."""
    return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """1-D rotary embedding of a text decoder, as transformers' ``rope_parameters``.

    ``rope_type`` "default": frequencies ``theta ** (-2i / D)``; "llama3": Llama 3.1's scaling of
    them (wavelengths above ``original_max_position_embeddings / low_freq_factor`` divided by
    ``factor``, below ``... / high_freq_factor`` kept, smooth interpolation between).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_type: expected 'default' or 'llama3', got {self.rope_type!r}")
        if not self.theta > 0:
            raise ValueError(f"rope theta: expected > 0, got {self.theta}")
        if self.rope_type == "llama3" and not (self.factor > 0 and self.high_freq_factor > self.low_freq_factor > 0
                                               and self.original_max_position_embeddings > 0):
            raise ValueError(f"llama3 rope: expected factor > 0, high_freq_factor > low_freq_factor > 0 and "
                             f"original_max_position_embeddings > 0; got {self}")

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies float32 [head_dim // 2], computed in float32 as transformers does."""
        exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        inv = (np.float32(1.0) / np.power(np.float32(self.theta), exponent)).astype(np.float32)
        if self.rope_type == "default":
            return inv
        factor, low, high = np.float32(self.factor), np.float32(self.low_freq_factor), np.float32(self.high_freq_factor)
        old = np.float32(self.original_max_position_embeddings)
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(position_ids: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """1-D rotary tables. position_ids: int [B, T]; inv_freq: float32 [D / 2] -> cos, sin float32 [B, T, D]."""
    if position_ids.ndim != 2:
        raise ValueError(f"position_ids: expected shape [B, T], got {position_ids.shape}")
    f = position_ids.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


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
