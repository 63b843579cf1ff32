"""Synthetic q / k / v with planted structure, for pattern benchmarks, tests and experiments.

* `video_qkv`: video-like inputs (frames of h x w tokens, M-RoPE, smooth content, frame anchors).
* `GridVideo`, `grid_video_qkv`, `VIDEO_FAMILIES`: video-like inputs with the structure of
  MMInference's grid heads (per-frame sink tokens at a fixed phase, broadcast rows, the same
  spatial position attended across nearby frames); `mixed_video_text_qkv` interleaves them
  with text; `needle_qkv`: a few key blocks every query matches.
* `interleaved_kinds`, `planted_qkv`: mixed video + text inputs (MM-NIAH-like) whose heads follow a
  planted boundary type.

## Grid-structured video (`grid_video_qkv`)

A `GridVideo` is ``frames`` frames of ``h x w`` tokens in raster order after ``prefix`` text
tokens (frame stride ``h * w``). Queries and keys are sums of independent parts, each in its
own block of the head dim, so their logits add up:

* spatial identity: every spatial position (row, col) has a random unit vector (plus a
  smooth low-frequency part, so neighbouring positions are alike); the key and the query of
  a token carry their position's vector, rotated by ``omega * frame`` with frequencies
  ``omega`` spread over ``[0, pi / reach]``. The logit of two tokens at the same position
  is then ``gain * mean(cos(omega * dframes))``, a kernel that decays over about ``reach``
  frames: slashes at multiples of the frame stride, strongest for nearby frames, with a
  2-D neighbourhood around each (and in the own frame, the local band);
* sinks: the token at ``sink_phase`` of every frame carries a salient key direction that
  every query reads with a per-head strength (vertical lines every frame stride);
* broadcast rows: the queries at ``broadcast_phase`` of every frame drop their own
  content and read a weak copy of the sink direction, so their attention spreads over
  all keys (horizontal lines);
* noise on every query and key (the diffuse floor no sparse pattern keeps).

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

import dataclasses

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


# ---------------------------------------------------------------- grid-structured video
@dataclasses.dataclass(frozen=True)
class GridVideo:
    """A video-like input family (see the module docstring). Sizes in tokens."""

    frames: int
    frame_hw: tuple[int, int]
    sink_phase: int = 0
    broadcast_phase: int | None = None  # None: the sink phase
    prefix: int = 0
    reach: float = 3.0
    gain: float = 12.0
    sink_gain: float = 9.0
    noise: float = 0.5
    smooth: float = 0.5

    def __post_init__(self) -> None:
        h, w = self.frame_hw
        for name, val in (("frames", self.frames), ("frame_hw", min(h, w))):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}: expected ints >= 1; received {getattr(self, name)!r}")
        for name in ("sink_phase", "broadcast_phase"):
            val = getattr(self, name)
            if val is not None and not 0 <= val < h * w:
                raise ValueError(f"{name}: expected a phase in [0, {h * w}) (tokens per frame); received {val!r}")
        if self.prefix < 0:
            raise ValueError(f"prefix: expected an int >= 0; received {self.prefix!r}")
        if self.reach <= 0:
            raise ValueError(f"reach: expected > 0 frames; received {self.reach!r}")

    @property
    def frame_tokens(self) -> int:
        return self.frame_hw[0] * self.frame_hw[1]

    @property
    def seq_len(self) -> int:
        return self.prefix + self.frames * self.frame_tokens

    @property
    def name(self) -> str:
        h, w = self.frame_hw
        return f"video-{self.frames}x{h}x{w}-p{self.sink_phase}"


# Several families: 12-28 frames, 8k-64k tokens (and the 4.6k shape the issue describes),
# different frame sizes, sink / broadcast phases and a text prefix.
VIDEO_FAMILIES: tuple[GridVideo, ...] = (
    GridVideo(24, (12, 16), sink_phase=0),                          # S = 4,608
    GridVideo(16, (24, 24), sink_phase=37, broadcast_phase=300),    # S = 9,216
    GridVideo(28, (16, 20), sink_phase=150, prefix=64),             # S = 9,024
    GridVideo(12, (32, 32), sink_phase=511, reach=2.0),             # S = 12,288
    GridVideo(20, (28, 28), sink_phase=5, broadcast_phase=400),     # S = 15,680
    GridVideo(20, (30, 40), sink_phase=17),                         # S = 24,000 (frame > 1024 tokens)
    GridVideo(21, (48, 64), sink_phase=1000, prefix=128),           # S = 64,640
)


def _rotate_pairs(x: jax.Array, angle: jax.Array) -> jax.Array:
    """x ``[S, 2P]`` (pairs are (x[:P], x[P:])), angle ``[S, P]`` -> rotated x."""
    half = x.shape[-1] // 2
    c, s_ = jnp.cos(angle), jnp.sin(angle)
    a, b = x[:, :half], x[:, half:]
    return jnp.concatenate([a * c - b * s_, a * s_ + b * c], -1)


def grid_video_qkv(key: jax.Array, spec: GridVideo, *, heads: int = 4, kv_heads: int = 2, head_dim: int = 128,
                   dtype=jnp.float32):
    """q ``[1, S, N, D]``, k / v ``[1, S, K, D]`` (S = ``spec.seq_len``) with the structure of
    the module docstring. Heads differ in how strongly they read the sinks (head 0 least).
    Uses the first 3/4 of the head dim for spatial identity and 1/16 for the sink direction."""
    if head_dim < 32 or head_dim % 16:
        raise ValueError(f"head_dim: expected a multiple of 16 >= 32; received {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads: expected a divisor of heads={heads}; received {kv_heads}")
    s, f = spec.seq_len, spec.frame_tokens
    h, w = spec.frame_hw
    d_sp = 3 * head_dim // 4
    k_r, k_sm, k_sink, k_q, k_k, k_v, k_head = jax.random.split(key, 7)
    idx = np.arange(s)
    vid = idx >= spec.prefix
    rel = np.maximum(idx - spec.prefix, 0)
    frame, phase = rel // f, rel % f
    # Spatial identity: a random unit vector per position plus a smooth part over (row, col).
    r = jax.random.normal(k_r, (f, d_sp))
    rows_, cols_ = np.arange(f) // w, np.arange(f) % w
    freqs = jax.random.normal(k_sm, (d_sp, 2)) * jnp.asarray([1.0 / h, 1.0 / w]) * 2.0
    sm = jnp.cos(jnp.stack([rows_, cols_], -1).astype(jnp.float32) @ freqs.T)  # [f, d_sp]
    emb = r / jnp.linalg.norm(r, axis=-1, keepdims=True) + spec.smooth * sm / jnp.sqrt(d_sp)
    emb = emb / jnp.linalg.norm(emb, axis=-1, keepdims=True)
    omega = jnp.linspace(0.0, np.pi / spec.reach, d_sp // 2)
    tok = _rotate_pairs(emb[phase], jnp.asarray(frame, jnp.float32)[:, None] * omega[None])  # [S, d_sp]
    tok = jnp.where(jnp.asarray(vid)[:, None], tok, 0.0)
    amp = np.sqrt(spec.gain * np.sqrt(head_dim))
    u = jax.random.normal(k_sink, (head_dim // 16,))
    u = u / jnp.linalg.norm(u)
    is_sink = jnp.asarray(vid & (phase == spec.sink_phase))
    bphase = spec.sink_phase if spec.broadcast_phase is None else spec.broadcast_phase
    is_bcast = jnp.asarray(vid & (phase == bphase))
    rest = head_dim - d_sp - head_dim // 16
    sink_amp = np.sqrt(spec.sink_gain * np.sqrt(head_dim))
    head_sink = sink_amp * jnp.linspace(0.6, 1.2, heads)  # per query head
    k_base = jnp.concatenate([amp * tok, jnp.where(is_sink[:, None], sink_amp * u, 0.0),
                              jnp.zeros((s, rest))], -1)  # [S, D]
    q_tok = jnp.concatenate([amp * tok, jnp.zeros((s, head_dim - d_sp))], -1)  # [S, D]
    sink_dir = jnp.concatenate([jnp.zeros((d_sp,)), u, jnp.zeros((rest,))])
    q = q_tok[:, None, :] + head_sink[None, :, None] * sink_dir[None, None, :]  # [S, N, D]
    # Broadcast rows: no content, a weak read of the sinks -> attention over all keys.
    q = jnp.where(is_bcast[:, None, None], 0.15 * head_sink[None, :, None] * sink_dir, q)
    q = q + spec.noise * jax.random.normal(k_q, (s, heads, head_dim))
    k = k_base[:, None, :] + spec.noise * jax.random.normal(k_k, (s, kv_heads, head_dim))
    v = jax.random.normal(k_v, (s, kv_heads, head_dim))
    return q[None].astype(dtype), k[None].astype(dtype), v[None].astype(dtype)


def mixed_video_text_qkv(key: jax.Array, spec: GridVideo, *, text_tokens: int = 256, segments: int = 4,
                         heads: int = 4, kv_heads: int = 2, head_dim: int = 128, dtype=jnp.float32):
    """Mixed video + text: ``segments`` text segments of ``text_tokens`` tokens, the first
    before the video and the others cut into it at frame boundaries (frames spread evenly).
    Text tokens carry noise only in q / k (diffuse attention; the video's structure is
    unchanged). Returns (q, k, v, kinds int32 ``[S]``: 0 text, 2 video)."""
    if segments < 1 or text_tokens < 1:
        raise ValueError(f"segments / text_tokens: expected ints >= 1; received {segments}, {text_tokens}")
    video = dataclasses.replace(spec, prefix=0)
    qv, kv_, vv = grid_video_qkv(key, video, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=jnp.float32)
    f = spec.frame_tokens
    cuts = [round(i * spec.frames / segments) * f for i in range(segments)]
    k_t = jax.random.split(jax.random.fold_in(key, 7), 3)
    qs, ks, vs, kinds = [], [], [], []
    for i, start in enumerate(cuts):
        end = cuts[i + 1] if i + 1 < segments else video.seq_len
        qs += [spec.noise * jax.random.normal(jax.random.fold_in(k_t[0], i), (1, text_tokens, heads, head_dim)),
               qv[:, start:end]]
        ks += [spec.noise * jax.random.normal(jax.random.fold_in(k_t[1], i), (1, text_tokens, kv_heads, head_dim)),
               kv_[:, start:end]]
        vs += [jax.random.normal(jax.random.fold_in(k_t[2], i), (1, text_tokens, kv_heads, head_dim)), vv[:, start:end]]
        kinds += [np.full(text_tokens, TEXT), np.full(end - start, VIDEO)]
    cat = lambda xs: jnp.concatenate(xs, axis=1).astype(dtype)
    return cat(qs), cat(ks), cat(vs), np.concatenate(kinds).astype(np.int32)


def needle_qkv(key: jax.Array, seq_len: int, *, needles: int = 8, block: int = 64, heads: int = 4,
               kv_heads: int = 2, head_dim: int = 128, strength: float = 0.7, dtype=jnp.float32):
    """Noise plus ``needles`` key blocks of ``block`` tokens (random, in the first 90% of the
    sequence) and the first block, all of which every query matches (MOMO's needle input)."""
    ku, kn, kq, kk, kv = jax.random.split(key, 5)
    u = jax.random.normal(ku, (head_dim,))
    nk = max(seq_len // block, 2)
    blocks = jax.random.choice(kn, jnp.arange(1, max(2, int(nk * 0.9))), (needles,), replace=False)
    is_needle = jnp.zeros((nk + 1,), bool).at[blocks].set(True).at[0].set(True)
    hit = is_needle[jnp.minimum(jnp.arange(seq_len) // block, nk)]
    q = jax.random.normal(kq, (1, seq_len, heads, head_dim)) + strength * u
    k = jax.random.normal(kk, (1, seq_len, kv_heads, head_dim)) + jnp.where(hit[None, :, None, None], strength * u, 0.0)
    v = jax.random.normal(kv, (1, seq_len, kv_heads, head_dim))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)
