"""Video-like synthetic q/k/v with spatio-temporal structure, for pattern benchmarks.

Tokens are frames of ``h x w`` patches in raster order. Each token carries a smooth latent
(a few low-frequency Fourier modes over (t, h, w)) projected per head, plus noise; queries
and keys then get three-axis rotary embeddings on (t, h, w) positions (the head dim split
into temporal / height / width sections, as in Qwen2.5-VL's M-RoPE). Attention then depends
on content similarity and on relative (dt, dh, dw): same-position tokens in other frames
line up at multiples of ``h * w`` (grid / periodic structure), neighbours form a local band.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _rope(x: jax.Array, pos: jax.Array, sections: tuple[int, int, int], theta: float = 10000.0) -> jax.Array:
    """x ``[B,S,H,D]`` f32, pos int ``[S, 3]`` -> rotated x; ``sections`` are rotary pairs per axis."""
    d = x.shape[-1]
    half = d // 2
    inv = 1.0 / (theta ** (np.arange(half) / half))
    axis = np.repeat(np.arange(3), sections)[:half]  # which position axis each pair uses
    ang = pos[:, axis].astype(jnp.float32) * jnp.asarray(inv, jnp.float32)  # [S, half]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def video_qkv(key: jax.Array, seq_len: int, *, heads: int = 28, kv_heads: int = 4, head_dim: int = 128,
              frame_hw: tuple[int, int] = (16, 16), latent: int = 32, modes: int = 12,
              noise: float = 0.5, scale: float = 1.6, dtype=jnp.bfloat16):
    """q ``[1,S,N,D]``, k/v ``[1,S,K,D]`` for a video of ``S / (h*w)`` frames (last one partial).

    ``scale`` sharpens attention (logit temperature); ``noise`` adds token-level detail.
    """
    h, w = frame_hw
    idx = np.arange(seq_len)
    pos = np.stack([idx // (h * w), (idx % (h * w)) // w, idx % w], -1)  # [S, 3] (t, h, w)
    k_freq, k_phase, k_amp, k_q, k_k, k_v, k_nq, k_nk = jax.random.split(key, 8)
    # Smooth latent: low-frequency modes over (t, h, w).
    freqs = jax.random.normal(k_freq, (modes, 3)) * jnp.asarray([0.05, 0.4, 0.4])
    phase = jax.random.uniform(k_phase, (modes,), maxval=2 * np.pi)
    amp = jax.random.normal(k_amp, (modes, latent)) / np.sqrt(modes)
    posf = jnp.asarray(pos, jnp.float32)
    z = jnp.cos(posf @ freqs.T + phase) @ amp  # [S, latent]
    sections = (head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16)

    def project(kk, kn, n):
        wmat = jax.random.normal(kk, (latent, n, head_dim)) * (scale / np.sqrt(latent))
        x = jnp.einsum("sl,lnd->snd", z, wmat)[None]
        x = x + noise * jax.random.normal(kn, x.shape)
        return x

    q = _rope(project(k_q, k_nq, heads), pos, sections)
    k = _rope(project(k_k, k_nk, kv_heads), pos, sections)
    v = jax.random.normal(k_v, (1, seq_len, kv_heads, head_dim))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)
