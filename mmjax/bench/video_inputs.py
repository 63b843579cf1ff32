"""Video-like synthetic q/k/v with spatio-temporal structure, for pattern benchmarks.

Tokens are frames of ``h x w`` patches in raster order. Each token carries a smooth latent
(a few low-frequency Fourier modes over (t, h, w)) projected per head, plus noise; queries
and keys then get three-axis rotary embeddings on (t, h, w) positions (the head dim split
into temporal / height / width sections, as in Qwen2.5-VL's M-RoPE). Attention then depends
on content similarity and on relative (dt, dh, dw): same-position tokens in other frames
line up at multiples of ``h * w`` (periodic slashes), neighbours form a local band, and a
salient anchor token per frame (stronger in later heads) gives vertical lines every ``h * w``
keys, the grid heads of MMInference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _rope(x: jax.Array, pos: jax.Array, sections: tuple[int, int, int], theta: float = 10000.0) -> jax.Array:
    """x ``[B,S,H,D]`` f32, pos int ``[S, 3]`` -> rotated x; ``sections`` are rotary pairs per
    (t, h, w) axis."""
    d = x.shape[-1]
    half = d // 2
    inv = 1.0 / (theta ** (np.arange(half) / half))
    # Which position axis each rotary pair uses: height and width on the high frequencies,
    # time on the lowest, so same-position tokens of other frames stay alike (grid heads).
    axis = np.repeat(np.array([1, 2, 0]), [sections[1], sections[2], sections[0]])[:half]
    ang = pos[:, axis].astype(jnp.float32) * jnp.asarray(inv, jnp.float32)  # [S, half]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def video_qkv(key: jax.Array, seq_len: int, *, heads: int = 28, kv_heads: int = 4, head_dim: int = 128,
              frame_hw: tuple[int, int] = (16, 16), latent: int = 32, modes: int = 12,
              noise: float = 0.5, scale: float = 1.6, qk_align: float = 0.9, anchor_phase: int = 0,
              anchor_strength: float = 10.0, dtype=jnp.bfloat16):
    """q ``[1,S,N,D]``, k/v ``[1,S,K,D]`` for a video of ``S / (h*w)`` frames (last one partial).

    ``scale`` sharpens attention (logit temperature); ``noise`` adds token-level detail;
    ``qk_align`` is how much of each key projection it shares with its queries;
    ``anchor_strength`` (0 disables) plants salient frame-anchor tokens at ``anchor_phase``.
    """
    h, w = frame_hw
    idx = np.arange(seq_len)
    pos = np.stack([idx // (h * w), (idx % (h * w)) // w, idx % w], -1)  # [S, 3] (t, h, w)
    k_freq, k_phase, k_amp, k_q, k_k, k_v, k_nq, k_nk, k_u = jax.random.split(key, 9)
    # Smooth latent: low-frequency modes over (t, h, w).
    freqs = jax.random.normal(k_freq, (modes, 3)) * jnp.asarray([0.05, 0.4, 0.4])
    phase = jax.random.uniform(k_phase, (modes,), maxval=2 * np.pi)
    amp = jax.random.normal(k_amp, (modes, latent)) / np.sqrt(modes)
    posf = jnp.asarray(pos, jnp.float32)
    z = jnp.cos(posf @ freqs.T + phase) @ amp  # [S, latent]
    sections = (head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16)

    groups = heads // kv_heads
    w_q = jax.random.normal(k_q, (latent, heads, head_dim)) / np.sqrt(latent)
    # Keys share most of their projection with the queries of their group (as trained
    # q/k projections do), so a token attends to tokens with similar content, and M-RoPE
    # turns that into peaks at equal (h, w) across frames and at small offsets.
    w_k = qk_align * w_q[:, ::groups] + np.sqrt(1 - qk_align ** 2) * jax.random.normal(
        k_k, (latent, kv_heads, head_dim)) / np.sqrt(latent)

    def project(wmat, kn):
        x = jnp.einsum("sl,lnd->snd", z, wmat)[None]
        return np.sqrt(scale) * (x + noise * jax.random.normal(kn, x.shape))

    q = _rope(project(w_q, k_nq), pos, sections)
    k = _rope(project(w_k, k_nk), pos, sections)
    if anchor_strength:
        # Frame anchors: the token at spatial phase `anchor_phase` of every frame is salient
        # (vertical lines every h*w keys), with a per-head strength; anchor queries look at
        # everything (horizontal lines).
        u = jax.random.normal(k_u, (head_dim,))
        u = u / jnp.linalg.norm(u)
        head_amp = anchor_strength * jnp.linspace(0.0, 1.0, heads)
        is_anchor = jnp.asarray(idx % (h * w) == anchor_phase)[None, :, None, None]
        k = k + jnp.where(is_anchor, 1.0, 0.0) * anchor_strength * u
        q = q + head_amp[None, None, :, None] * u
        q = jnp.where(is_anchor, 0.2 * q, q)
    v = jax.random.normal(k_v, (1, seq_len, kv_heads, head_dim))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)
