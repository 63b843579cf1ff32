"""Mixed-modality synthetic inputs (MM-NIAH-like): video frames with text segments between
them, and q / k / v whose heads follow a planted boundary type.

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
