"""LLaVA-OneVision / LLaVA-Video model: SigLIP tower + projector + Qwen2 decoder; forward, prefill and decode.

Host-side preparation (token types, positions, the anyres layout of every image) happens in ``prepare_inputs``;
the visual features are computed by one jit-compiled function per layout (``visual_inputs``) and merged at the
placeholder tokens (``<image>`` / ``<video>``, in row-major order, as transformers' ``masked_scatter``).

Image features (transformers' ``pack_image_features``): a row with one image is tiled (anyres): the base tile's
features, then the tiles' features as one grid with the padding removed, shrunk bilinearly when above
``anyres_max_N`` tiles' worth, with ``image_newline`` after every grid row; an image of a multi-image row is its
base tile + one newline. Video features (``get_video_features``): per frame, the tile features pooled 2x2
(bilinear to ceil(g / 2) per side), all frames, then one newline per video.

The decoder side is the shared decoder with Qwen2's 1-D RoPE expressed as M-RoPE with three equal position rows
(``config.text.mrope_section = (head_dim / 2, 0, 0)``), so the decoder functions of ``models.qwen2_5_vl.model``
(``prefill_language_model``, ``prompt_embeddings``, ``prefill_chunk``, ``final_logits``, ``decode_step``,
``cached_forward``) run this model unchanged: they read only ``model.language_model`` and ``model.config.text``.
Positions are ``cumsum(attention_mask) - 1`` (transformers' ``generate`` rule; its plain forward uses
``arange(T)``: pass ``position_ids`` to get that for left-padded rows).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import resolve_attention
from models.kv_cache import KVCache
from models.llava_onevision import anyres
from models.llava_onevision import vision as vision_lib
from models.llava_onevision.config import LlavaOnevisionConfig
from models.qwen2_5_vl.model import (
    cached_forward,
    decode_step,
    final_logits,
    merged_embeddings,
    prefill_chunk,
    prefill_language_model,
    prompt_embeddings,
)
from models.qwen2_5_vl.rope_index import token_types
from models.rotary import mrope_cos_sin
from models.text_decoder import LayerInputs, TextDecoder, check_token_inputs, lm_logits, run_decoder

__all__ = [
    "LlavaOnevision",
    "PreparedInputs",
    "cached_forward",
    "decode_step",
    "final_logits",
    "forward",
    "image_features",
    "init_cache",
    "prefill_chunk",
    "prefill_language_model",
    "prepare_inputs",
    "prompt_embeddings",
    "video_features",
    "visual_inputs",
]


class LlavaOnevision(nnx.Module):
    """Parameters: ``vision`` (VisionTower: SigLIP, projector, image_newline) and ``language_model`` (TextDecoder)."""

    def __init__(self, config: LlavaOnevisionConfig, *, dtype=jnp.float32, key: jax.Array | None = None):
        key = jax.random.key(0) if key is None else key
        kv, kt = jax.random.split(key)
        self.config = config
        self.vision = vision_lib.VisionTower(config, dtype=dtype, key=kv)
        self.language_model = TextDecoder(config.text, dtype=dtype, key=kt)


@dataclasses.dataclass(frozen=True)
class PreparedInputs:
    """Validated inputs. Arrays: input_ids int32 [B, T], attention_mask bool [B, T], position_ids int32 [3, B, T]
    (three equal rows), token_types int32 [B, T] (0 text, 1 image, 2 video), rope_deltas int32 [B],
    pixel_values float [n_tiles, 3, S, S] or None (every image's tiles, concatenated), pixel_values_videos float
    [n_videos, F, 3, S, S] or None. Static: image_layouts (one `anyres.ImageLayout` per image)."""

    input_ids: Any
    attention_mask: Any
    position_ids: Any
    token_types: Any
    rope_deltas: Any
    pixel_values: Any
    pixel_values_videos: Any
    image_layouts: tuple


def _image_tiles(config: LlavaOnevisionConfig, pixel_values, image_sizes, batch_num_images):
    """(tiles [n_tiles, 3, S, S], layouts) from the processor's padded [n_images, max_tiles, 3, S, S] (or the
    tiles already concatenated, [n_tiles, 3, S, S])."""
    v = config.vision
    if pixel_values is None and image_sizes is None:
        return None, ()
    if pixel_values is None or image_sizes is None:
        raise ValueError("pixel_values / image_sizes: expected both or neither")
    sizes = np.asarray(image_sizes).reshape(-1, 2).astype(np.int64)
    n = len(sizes)
    counts = [1] * n if batch_num_images is None else [int(c) for c in np.asarray(batch_num_images).reshape(-1)]
    if sum(counts) != n:
        raise ValueError(f"batch_num_images: expected counts summing to the {n} images of image_sizes, got {counts}")
    tiled = [c == 1 for c in counts for _ in range(c)]
    layouts = tuple(anyres.image_layout(tuple(s), tile=v.image_size, grid=v.grid, pinpoints=config.image_grid_pinpoints,
                                        max_patches=config.max_patches, tiled=t, tile_tokens=config.tile_tokens)
                    for s, t in zip(sizes.tolist(), tiled))
    px = jnp.asarray(pixel_values)
    tile = (v.num_channels, v.image_size, v.image_size)
    want = sum(lay.tiles for lay in layouts)
    if px.ndim == 5 and px.shape[0] == n and px.shape[2:] == tile:
        if px.shape[1] < max(lay.tiles for lay in layouts):
            raise ValueError(f"pixel_values: expected at least {max(lay.tiles for lay in layouts)} tiles per image "
                             f"for image_sizes {sizes.tolist()}, got {px.shape[1]}")
        px = jnp.concatenate([px[i, :lay.tiles] for i, lay in enumerate(layouts)])
    elif not (px.ndim == 4 and px.shape == (want,) + tile):
        raise ValueError(f"pixel_values: expected [{n}, max_tiles, {', '.join(map(str, tile))}] or "
                         f"[{want}, {', '.join(map(str, tile))}] for image_sizes {sizes.tolist()}, got {px.shape}")
    return px, layouts


def prepare_inputs(config: LlavaOnevisionConfig, *, input_ids, attention_mask=None, pixel_values=None,
                   image_sizes=None, pixel_values_videos=None, batch_num_images=None, position_ids=None,
                   **unused) -> PreparedInputs:
    """Validate HF-processor style inputs (transformers' names) and compute token types and positions on the host
    (``mm_token_type_ids`` / ``image_sizes_videos`` are accepted and ignored: types come from ``input_ids``).
    ``position_ids`` [B, T] (or [3, B, T] with equal rows) overrides ``cumsum(attention_mask) - 1``."""
    extra = sorted(k for k, v in unused.items()
                   if v is not None and k not in ("image_sizes_videos", "mm_token_type_ids", "cache_position"))
    if extra:
        raise ValueError(f"prepare_inputs: unexpected arguments {extra}")
    ids, mask = check_token_inputs(input_ids, attention_mask, config.text.vocab_size)
    v = config.vision
    tiles, layouts = _image_tiles(config, pixel_values, image_sizes, batch_num_images)
    videos = None
    n_video_tokens = 0
    if pixel_values_videos is not None:
        videos = (pixel_values_videos if isinstance(pixel_values_videos, jax.Array)
                  else np.asarray(pixel_values_videos))  # host pixels stay on the host until the tower runs
        if videos.ndim != 5 or videos.shape[2:] != (v.num_channels, v.image_size, v.image_size):
            raise ValueError(f"pixel_values_videos: expected [n_videos, frames, {v.num_channels}, {v.image_size}, "
                             f"{v.image_size}], got {videos.shape}")
        n_video_tokens = videos.shape[0] * anyres.video_tokens(videos.shape[1], v.grid)
    types = token_types(ids, config.image_token_id, config.video_token_id)
    for kind, want, name in ((1, sum(lay.tokens for lay in layouts), "image"), (2, n_video_tokens, "video")):
        got = int(((types == kind) & mask).sum())
        if want != got:
            raise ValueError(f"input_ids: expected {want} {name} placeholder tokens for the given {name}s, got {got}")
    if position_ids is None:
        pos = np.where(mask, np.cumsum(mask, axis=-1) - 1, 0)
    else:
        pos = np.asarray(position_ids)
        if pos.ndim == 3 and pos.shape[0] == 3 and (pos == pos[:1]).all():
            pos = pos[0]
        if pos.shape != ids.shape or not np.issubdtype(pos.dtype, np.integer):
            raise ValueError(f"position_ids: expected an integer array of shape {ids.shape}, got {pos.dtype} "
                             f"{pos.shape}")
    deltas = pos.max(axis=-1, initial=-1) + 1 - mask.sum(-1)
    pos3 = np.broadcast_to(pos[None], (3,) + pos.shape)
    return PreparedInputs(jnp.asarray(ids, jnp.int32), jnp.asarray(mask), jnp.asarray(pos3, jnp.int32),
                          jnp.asarray(types, jnp.int32), jnp.asarray(deltas, jnp.int32), tiles, videos, layouts)


def _pack_image(feats: jax.Array, lay: anyres.ImageLayout, grid: int, newline: jax.Array) -> jax.Array:
    """One image's tile features [tiles, P, H] -> its packed features [lay.tokens, H]."""
    h = feats.shape[-1]
    base = feats[0]
    if lay.tiles == 1:
        return jnp.concatenate([base, newline[None]])
    x = feats[1:].reshape(lay.rows, lay.cols, grid, grid, h).transpose(0, 2, 1, 3, 4)
    x = x.reshape(lay.rows * grid, lay.cols * grid, h)
    top, bottom, left, right = lay.crop
    x = x[top:bottom, left:right]
    if lay.resized is not None:
        mh = jnp.asarray(anyres.bilinear_matrix(x.shape[0], lay.resized[0]))
        mw = jnp.asarray(anyres.bilinear_matrix(x.shape[1], lay.resized[1]))
        x = jnp.einsum("oi,ijh,pj->oph", mh, x.astype(jnp.float32), mw).astype(feats.dtype)
    x = jnp.concatenate([x, jnp.broadcast_to(newline, (x.shape[0], 1, h))], axis=1)
    return jnp.concatenate([base, x.reshape(-1, h)])


@functools.partial(jax.jit, static_argnames=("layouts", "chunk"))
def image_features(model: LlavaOnevision, tiles: jax.Array, layouts: tuple, chunk: int | None = None) -> jax.Array:
    """Packed image features [sum(layout.tokens), H] of the images' concatenated tiles [n_tiles, 3, S, S]."""
    c = model.config
    feats = vision_lib.encode_tiles(model.vision, tiles, chunk)
    newline = model.vision.image_newline[...].astype(feats.dtype)
    if c.select_strategy == "default" and any(lay.tiles > 1 for lay in layouts):
        raise ValueError("vision_feature_select_strategy 'default' leaves tiles that are not square grids; anyres "
                         "packing needs 'full'")
    out, start = [], 0
    for lay in layouts:
        out.append(_pack_image(feats[start:start + lay.tiles], lay, c.vision.grid, newline))
        start += lay.tiles
    return jnp.concatenate(out)


def pooled_frames(vision, frames: jax.Array, grid: int, chunk: int | None = None) -> jax.Array:
    """frames [N, 3, S, S] -> [N, ceil(grid/2)**2, H]: each frame's tile features (the vision tower ``vision``,
    ``grid`` patches a side) pooled 2x2 (bilinear). Frames are independent (the tower may run them on any
    device)."""
    feats = vision_lib.encode_tiles(vision, frames, chunk)
    hdim = feats.shape[-1]
    side = anyres.pooled_side(grid)
    m = jnp.asarray(anyres.bilinear_matrix(grid, side))
    x = feats.reshape(frames.shape[0], grid, grid, hdim).astype(jnp.float32)
    x = jnp.einsum("oi,bijh,pj->boph", m, x, m).astype(feats.dtype)
    return x.reshape(frames.shape[0], side * side, hdim)


def with_newlines(model: LlavaOnevision, x: jax.Array) -> jax.Array:
    """Pooled frame features of n videos x [n, F * side**2, H] -> [n * (F * side**2 + 1), H]: one newline
    feature after each video."""
    n, _, hdim = x.shape
    newline = jnp.broadcast_to(model.vision.image_newline[...].astype(x.dtype), (n, 1, hdim))
    return jnp.concatenate([x, newline], axis=1).reshape(-1, hdim)


@functools.partial(jax.jit, static_argnames=("chunk",))
def video_features(model: LlavaOnevision, videos: jax.Array, chunk: int | None = None) -> jax.Array:
    """videos [n, F, 3, S, S] -> features [n * (F * ceil(g/2)**2 + 1), H]: per-frame tile features pooled 2x2
    (bilinear), then one newline per video."""
    n, f = videos.shape[:2]
    x = pooled_frames(model.vision, videos.reshape((n * f,) + videos.shape[2:]), model.config.vision.grid, chunk)
    return with_newlines(model, x.reshape(n, -1, x.shape[-1]))


def frame_tokens(config: LlavaOnevisionConfig, p: PreparedInputs) -> int | None:
    """Tokens per video frame in the LLM's stream (``ceil(grid / 2)**2`` pooled features, the frames of a video
    contiguous, one newline after its last); None without videos."""
    return None if p.pixel_values_videos is None else anyres.pooled_side(config.vision.grid) ** 2


def visual_inputs(model: LlavaOnevision, p: PreparedInputs, frames_per_chunk: int | None = None):
    """(image features or None, video features or None), each [n_tokens, H]. ``frames_per_chunk``: tiles /
    frames through the tower at a time (None: all at once)."""
    img = image_features(model, p.pixel_values, p.image_layouts, frames_per_chunk) if p.image_layouts else None
    vid = video_features(model, p.pixel_values_videos, frames_per_chunk) if p.pixel_values_videos is not None else None
    return img, vid


@functools.partial(jax.jit, static_argnames=("attention", "mlp_chunk"))
def _lm_forward(model, input_ids, image_feats, video_feats, position_ids, mask, types, attention, mlp_chunk):
    b, t = mask.shape
    embeds = merged_embeddings(model, input_ids, types, image_feats, video_feats)
    c = model.config.text
    cos, sin = mrope_cos_sin(position_ids, c.head_dim, c.rope_theta, c.mrope_section)
    li = LayerInputs(cos, sin, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), mask, types,
                     jnp.asarray(0, jnp.int32))
    h, _, _ = run_decoder(model.language_model, embeds, li, attention, mlp_chunk=mlp_chunk)
    return lm_logits(model.language_model, h)


def forward(model: LlavaOnevision, *, input_ids, attention_mask=None, pixel_values=None, image_sizes=None,
            pixel_values_videos=None, batch_num_images=None, position_ids=None, attention: Any = "dense",
            mlp_chunk: int | None = None, frames_per_chunk: int | None = None, **unused) -> jax.Array:
    """Full-sequence logits float32 [B, T, V] from HF processor outputs (transformers' argument names:
    ``pixel_values`` [n_images, max_tiles, 3, S, S], ``image_sizes`` [n_images, 2] (height, width),
    ``batch_num_images`` [B], ``pixel_values_videos`` [n_videos, F, 3, S, S])."""
    p = prepare_inputs(model.config, input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                       image_sizes=image_sizes, pixel_values_videos=pixel_values_videos,
                       batch_num_images=batch_num_images, position_ids=position_ids, **unused)
    img, vid = visual_inputs(model, p, frames_per_chunk)
    return _lm_forward(model, p.input_ids, img, vid, p.position_ids, p.attention_mask, p.token_types,
                       resolve_attention(attention), mlp_chunk)


def init_cache(config: LlavaOnevisionConfig, batch: int, max_length: int, dtype, kv_dtype=None) -> KVCache:
    """An empty KV cache (see ``models.kv_cache.KVCache.empty``)."""
    return KVCache.empty(config.text, batch, max_length, dtype, kv_dtype)
