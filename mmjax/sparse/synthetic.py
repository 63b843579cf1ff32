"""Synthetic q / k / v with planted structure, for pattern benchmarks, tests and experiments.

* `video_qkv`: video-like inputs (frames of h x w tokens, M-RoPE, smooth content, frame anchors).
* `interleaved_kinds`, `planted_qkv`: mixed video + text inputs (MM-NIAH-like) whose heads follow a
  planted boundary type.

## Video-like inputs

Tokens are frames of ``h x w`` patches in raster order. Each token carries a smooth latent
(a few low-frequency Fourier modes over (t, h, w)) projected per head, plus noise; queries
and keys then get three-axis rotary embeddings on (t, h, w) positions (the head dim split
into temporal / height / width sections, as in Qwen2.5-VL's M-RoPE). Attention then depends
on content similarity and on relative (dt, dh, dw): same-position tokens in other frames
line up at multiples of ``h * w`` (periodic slashes), neighbours form a local band, and a
salient anchor token per frame (stronger in later heads) gives vertical lines every ``h * w``
keys, the grid heads of MMInference.

## Mixed-modality inputs

Token layout (`interleaved_kinds`): ``text, frame, text, frame, ...`` with text segments of
``text_tokens`` and frames of ``frame_tokens`` video tokens (25% text for 64 / 192), so the
grid period in positions is ``frame_tokens + text_tokens``.

Planted heads (`planted_qkv`): keys carry three salient directions, shared by every head:
``u_line`` on the video token at spatial phase ``line_phase`` of every frame (Grid lines),
``u_text`` on the first ``text_keys`` text tokens (default: all), ``u_sink`` on the first
text segment. Each query head adds
one direction per row kind, with logit gain ``gain``:

* ``"none"``: every row looks at the lines (one Grid pattern for all rows);
* ``"k"``: every row looks at the marked text keys (a vertical band over the text modality);
* ``"q"``: video rows look at the lines, text rows at the first text segment;
* ``"2d"``: video rows look at the lines, text rows at the marked text keys.

Plus unit-variance noise on q / k (diffuse attention) and random values.
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

TEXT, VIDEO = 0, 2
PLANTS = ("none", "k", "q", "2d")


def interleaved_kinds(seq_len: int, frame_tokens: int = 192, text_tokens: int = 64, video_id: int = VIDEO
                      ) -> np.ndarray:
    """int32 ``[S]`` kinds: text segments (0) before every frame of video tokens (``video_id``)."""
    period = frame_tokens + text_tokens
    return np.where(np.arange(seq_len) % period < text_tokens, TEXT, video_id).astype(np.int32)


def planted_qkv(key: jax.Array, kinds: np.ndarray, plants: tuple[str, ...], *, kv_heads: int | None = None,
                head_dim: int = 64, frame_tokens: int = 192, text_tokens: int = 64, line_phase: int = 5,
                text_keys: int | None = None, gain: float = 10.0, noise: float = 1.0, dtype=jnp.float32):
    """q ``[1, S, N, D]``, k / v ``[1, S, K, D]`` with N = len(plants) heads planted as in the
    module docstring (K = kv_heads, default N; keys are shared by all heads). kinds: int
    ``[S]`` from `interleaved_kinds` (0 text, anything else video)."""
    bad = [p for p in plants if p not in PLANTS]
    if bad or not plants:
        raise ValueError(f"plants: expected a non-empty sequence of {PLANTS}; received {plants!r}")
    n = len(plants)
    kh = n if kv_heads is None else kv_heads
    if n % kh:
        raise ValueError(f"kv_heads: expected a divisor of N={n}; received {kh}")
    s = kinds.shape[0]
    pos = np.arange(s)
    period = frame_tokens + text_tokens
    is_text = kinds == TEXT
    marked = is_text & (np.cumsum(is_text) <= (s if text_keys is None else text_keys))
    is_line = (kinds != TEXT) & ((pos % period) - text_tokens == line_phase)
    is_sink = pos < text_tokens
    k_q, k_k, k_v, k_u = jax.random.split(key, 4)
    basis = jnp.linalg.qr(jax.random.normal(k_u, (head_dim, 3)))[0].T  # 3 orthonormal directions
    u_line, u_text, u_sink = basis
    feats = (jnp.asarray(is_line, jnp.float32)[:, None] * u_line + jnp.asarray(marked, jnp.float32)[:, None] * u_text
             + jnp.asarray(is_sink, jnp.float32)[:, None] * u_sink)  # [S, D]
    k = noise * jax.random.normal(k_k, (1, s, kh, head_dim)) + np.sqrt(head_dim) * feats[None, :, None]
    choose = {"none": (u_line, u_line), "k": (u_text, u_text), "q": (u_line, u_sink), "2d": (u_line, u_text)}
    text_rows = jnp.asarray(is_text)[:, None]
    dirs = jnp.stack([jnp.where(text_rows, choose[p][1][None], choose[p][0][None]) for p in plants], 1)  # [S, N, D]
    q = noise * jax.random.normal(k_q, (1, s, n, head_dim)) + gain * dirs[None]
    v = jax.random.normal(k_v, (1, s, kh, head_dim))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)
