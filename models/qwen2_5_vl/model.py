"""Qwen2.5-VL model: vision tower + Qwen2 decoder; forward, prefill and decode step as pure functions.

Host-side preparation (token types, M-RoPE ids, static grids) happens in ``prepare_inputs``; the
array work runs in jit-compiled functions that take the NNX model as a pytree argument.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import LayerAttention, resolve_attention
from models.common import PREFILL_XLA_OPTIONS
from models.kv_cache import KVCache
from models.qwen2_5_vl import vision as vision_lib
from models.qwen2_5_vl.config import Qwen2_5_VLConfig
from models.qwen2_5_vl.rope_index import get_rope_index, token_types
from models.rotary import mrope_cos_sin
from models.text_decoder import (LayerInputs, TextDecoder, check_token_inputs, decode_token, embed_tokens,
                                 last_token_logits, lm_logits, run_decoder)


class Qwen2_5_VL(nnx.Module):
    """Parameters of Qwen2.5-VL: ``visual`` (VisionTower) and ``language_model`` (TextDecoder)."""

    def __init__(self, config: Qwen2_5_VLConfig, *, dtype=jnp.float32, key: jax.Array | None = None):
        key = jax.random.key(0) if key is None else key
        kv, kt = jax.random.split(key)
        self.config = config
        self.visual = vision_lib.VisionTower(config.vision, dtype=dtype, key=kv)
        self.language_model = TextDecoder(config.text, dtype=dtype, key=kt)


@dataclasses.dataclass(frozen=True)
class PreparedInputs:
    """Validated inputs. Arrays: input_ids int32 [B, T], attention_mask bool [B, T], position_ids
    int32 [3, B, T], token_types int32 [B, T], rope_deltas int32 [B], pixel_values [Pi, patch_dim] or
    None, pixel_values_videos [Pv, patch_dim] or None (left where they were given: host NumPy pixels are not
    copied to a device before the vision tower runs). Static: image_grids / video_grids tuples of (t, h, w)."""

    input_ids: Any
    attention_mask: Any
    position_ids: Any
    token_types: Any
    rope_deltas: Any
    pixel_values: Any
    pixel_values_videos: Any
    image_grids: tuple
    video_grids: tuple


def _grids(name, grid_thw, pixels, patch_dim):
    if pixels is None and grid_thw is None:
        return (), None
    if pixels is None or grid_thw is None:
        raise ValueError(f"{name}: pixels and grid_thw must be given together")
    g = np.asarray(grid_thw).reshape(-1, 3).astype(np.int64)
    pixels = pixels if isinstance(pixels, jax.Array) else np.asarray(pixels)  # host pixels stay on the host
    n = int(np.prod(g, axis=1).sum())
    if pixels.shape != (n, patch_dim):
        raise ValueError(f"{name}: expected pixels of shape {(n, patch_dim)} for grid_thw {g.tolist()}, "
                         f"got {pixels.shape}")
    return tuple(tuple(int(v) for v in row) for row in g), pixels


def prepare_inputs(config: Qwen2_5_VLConfig, *, input_ids, attention_mask=None, pixel_values=None,
                   image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None, second_per_grid_ts=None,
                   position_ids=None) -> PreparedInputs:
    """Validate HF-processor style inputs and compute token types and M-RoPE ids on the host."""
    ids, mask = check_token_inputs(input_ids, attention_mask, config.text.vocab_size)
    vc = config.vision
    image_grids, pixel_values = _grids("pixel_values", image_grid_thw, pixel_values, vc.patch_dim)
    video_grids, pixel_values_videos = _grids("pixel_values_videos", video_grid_thw, pixel_values_videos, vc.patch_dim)
    types = token_types(ids, config.image_token_id, config.video_token_id)
    for kind, grids, name in ((1, image_grids, "image"), (2, video_grids, "video")):
        want = sum(t * h * w // vc.merge_unit for t, h, w in grids)
        got = int(((types == kind) & mask).sum())
        if want != got:
            raise ValueError(f"input_ids: expected {want} {name} pad tokens for the given {name} grids, got {got}")
    if second_per_grid_ts is not None and len(np.asarray(second_per_grid_ts).reshape(-1)) != len(video_grids):
        raise ValueError(f"second_per_grid_ts: expected {len(video_grids)} values, got "
                         f"{len(np.asarray(second_per_grid_ts).reshape(-1))}")
    pos, deltas = get_rope_index(ids, image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                                 spatial_merge_size=vc.spatial_merge_size, tokens_per_second=vc.tokens_per_second,
                                 image_grid_thw=np.asarray(image_grids).reshape(-1, 3) if image_grids else None,
                                 video_grid_thw=np.asarray(video_grids).reshape(-1, 3) if video_grids else None,
                                 second_per_grid_ts=second_per_grid_ts, attention_mask=mask,
                                 legacy_text_offset=config.rope_index_legacy)
    if position_ids is not None:
        pos = np.asarray(position_ids)
        if pos.shape != (3,) + ids.shape:
            raise ValueError(f"position_ids: expected shape {(3,) + ids.shape}, got {pos.shape}")
        deltas = (pos.max(axis=(0, 2)) + 1 - mask.sum(-1)).astype(np.int64)
    return PreparedInputs(jnp.asarray(ids, jnp.int32), jnp.asarray(mask), jnp.asarray(pos, jnp.int32),
                          jnp.asarray(types), jnp.asarray(deltas, jnp.int32), pixel_values, pixel_values_videos,
                          image_grids, video_grids)


def frame_tokens(config: Qwen2_5_VLConfig, p: PreparedInputs) -> int | None:
    """Tokens per video frame (temporal patch) in the LLM's stream: ``h * w / spatial_merge_size**2`` of the videos'
    (t, h, w) patch grids when every video has the same; None without videos or when their sizes differ (the
    stride of Grid heads with ``stride="frame"``, and the one `Grid.frame_first` tries)."""
    m2 = config.vision.spatial_merge_size ** 2
    sizes = {h * w // m2 for _, h, w in p.video_grids}
    return sizes.pop() if len(sizes) == 1 else None


@functools.partial(jax.jit, static_argnames=("grids", "frames_per_chunk"), compiler_options=vision_lib.XLA_OPTIONS)
def vision_features(model: Qwen2_5_VL, pixels: jax.Array, grids: tuple, frames_per_chunk: int | None = None):
    """Merged visual features of packed images or videos: [sum(t*h*w)/m**2, H] in the model dtype."""
    outs, start = [], 0
    for g in grids:
        n = g[0] * g[1] * g[2]
        outs.append(vision_lib.encode_grid(model.visual, pixels[start:start + n], g,
                                           frames_per_chunk=frames_per_chunk))
        start += n
    return jnp.concatenate(outs, axis=0)


def merge_visual(embeds: jax.Array, types: jax.Array, kind: int, feats: jax.Array) -> jax.Array:
    """Scatter feats [M, H] into embeds [B, T, H] at tokens with ``types == kind``, in row-major order."""
    hit = (types == kind).reshape(-1)
    idx = jnp.clip(jnp.cumsum(hit) - 1, 0, feats.shape[0] - 1)
    flat = jnp.where(hit[:, None], feats[idx].astype(embeds.dtype), embeds.reshape(-1, embeds.shape[-1]))
    return flat.reshape(embeds.shape)


def visual_inputs(model: Qwen2_5_VL, p: PreparedInputs, frames_per_chunk: int | None = None):
    """(image features or None, video features or None), each [n_tokens, H] (one jit per grid set)."""
    img = vision_features(model, p.pixel_values, p.image_grids, frames_per_chunk) if p.image_grids else None
    vid = vision_features(model, p.pixel_values_videos, p.video_grids, frames_per_chunk) if p.video_grids else None
    return img, vid


def merged_embeddings(model: Qwen2_5_VL, input_ids, types, image_feats=None, video_feats=None) -> jax.Array:
    """Token embeddings [B, T, H] with image / video features merged at their pad tokens."""
    x = embed_tokens(model.language_model, input_ids)
    if image_feats is not None:
        x = merge_visual(x, types, 1, image_feats)
    if video_feats is not None:
        x = merge_visual(x, types, 2, video_feats)
    return x


def _layer_inputs(config, position_ids, q_positions, kv_valid, modality, write_index):
    cos, sin = mrope_cos_sin(position_ids, config.text.head_dim, config.text.rope_theta, config.text.mrope_section)
    return LayerInputs(cos, sin, q_positions, kv_valid, modality, jnp.asarray(write_index, jnp.int32))


@functools.partial(jax.jit, static_argnames=("attention", "mlp_chunk", "hidden_layers"))
def _lm_forward(model, input_ids, image_feats, video_feats, position_ids, mask, types, attention, mlp_chunk,
                hidden_layers=()):
    b, t = mask.shape
    embeds = merged_embeddings(model, input_ids, types, image_feats, video_feats)
    li = _layer_inputs(model.config, position_ids, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), mask,
                       types, 0)
    h, _, hidden = run_decoder(model.language_model, embeds, li, attention, hidden_layers=hidden_layers,
                               mlp_chunk=mlp_chunk)
    return lm_logits(model.language_model, h), hidden


def forward(model: Qwen2_5_VL, *, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None,
            pixel_values_videos=None, video_grid_thw=None, second_per_grid_ts=None, position_ids=None,
            attention: Any = "dense", mlp_chunk: int | None = None, frames_per_chunk: int | None = None,
            **unused) -> jax.Array:
    """Full-sequence logits float32 [B, T, V] from HF processor outputs (same argument names).

    Extra processor outputs (e.g. ``mm_token_type_ids``) are accepted and ignored: token types are
    derived from ``input_ids``. ``position_ids`` [3, B, T] overrides the computed M-RoPE ids.
    """
    extra = set(unused) - {"mm_token_type_ids", "cache_position"}
    if extra:
        raise ValueError(f"forward: unexpected arguments {sorted(extra)}")
    p = prepare_inputs(model.config, input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                       image_grid_thw=image_grid_thw, pixel_values_videos=pixel_values_videos,
                       video_grid_thw=video_grid_thw, second_per_grid_ts=second_per_grid_ts, position_ids=position_ids)
    img, vid = visual_inputs(model, p, frames_per_chunk)
    logits, _ = _lm_forward(model, p.input_ids, img, vid, p.position_ids, p.attention_mask, p.token_types, resolve_attention(attention),
                            mlp_chunk)
    return logits


def init_cache(config: Qwen2_5_VLConfig, batch: int, max_length: int, dtype, kv_dtype=None) -> KVCache:
    """An empty KV cache (see ``models.kv_cache.KVCache.empty``)."""
    return KVCache.empty(config.text, batch, max_length, dtype, kv_dtype)


@functools.partial(jax.jit, static_argnames=("attention", "max_length", "hidden_layers", "mlp_chunk", "kv_dtype"),
                   compiler_options=PREFILL_XLA_OPTIONS)
def prefill_language_model(model: Qwen2_5_VL, input_ids, image_feats, video_feats, position_ids, mask, types,
                           rope_deltas, *, attention: LayerAttention, max_length: int, hidden_layers: tuple = (),
                           mlp_chunk: int | None = None, kv_dtype=None):
    """Merge visual features into the token embeddings, run the decoder and fill a fresh cache of
    ``max_length`` slots. input_ids/mask/types: [B, T]; image_feats/video_feats: [n, H] or None;
    position_ids: [3, B, T]; rope_deltas: [B]. ``kv_dtype``: the
    cache's storage dtype (default: the model's; ``jnp.float8_e4m3fn`` halves it).

    Returns (logits of each row's last valid token float32 [B, V], KVCache, hidden [n, B, T, H]).
    """
    b, t = mask.shape
    if max_length < t:
        raise ValueError(f"max_length: expected at least the prompt length {t}, got {max_length}")
    embeds = merged_embeddings(model, input_ids, types, image_feats, video_feats)
    cache = init_cache(model.config, b, max_length, embeds.dtype, kv_dtype)
    li = _layer_inputs(model.config, position_ids, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), mask,
                       types, 0)
    h, cache, hidden = run_decoder(model.language_model, embeds, li, attention, cache=cache,
                                   hidden_layers=hidden_layers, mlp_chunk=mlp_chunk)
    n_valid = jnp.sum(mask, axis=-1).astype(jnp.int32)
    valid = jnp.zeros((b, max_length), bool).at[:, :t].set(mask)
    cache = dataclasses.replace(cache, valid=valid, length=jnp.asarray(t, jnp.int32),
                                next_position=n_valid + rope_deltas)
    return last_token_logits(model.language_model, h, mask), cache, hidden


@jax.jit
def prompt_embeddings(model: Qwen2_5_VL, input_ids, types, image_feats=None, video_feats=None) -> jax.Array:
    """`merged_embeddings` as one jitted call: [B, T, H]."""
    return merged_embeddings(model, input_ids, types, image_feats, video_feats)


@jax.jit
def final_logits(model: Qwen2_5_VL, h: jax.Array) -> jax.Array:
    """h: final-normed states [B, H] -> logits float32 [B, V]."""
    return lm_logits(model.language_model, h[:, None])[:, 0]


@functools.partial(jax.jit, static_argnames=("attention", "start", "hidden_layers", "mlp_chunk"),
                   donate_argnames=("cache",), compiler_options=PREFILL_XLA_OPTIONS)
def prefill_chunk(model: Qwen2_5_VL, cache: KVCache, embeds, position_ids, mask, types, *, attention: LayerAttention,
                  start: int, hidden_layers: tuple = (), mlp_chunk: int | None = None):
    """Chunked prefill: run the decoder over the prompt tokens ``start .. start + C - 1`` (embeds
    [B, C, H], position_ids [3, B, C]) against the cache, which holds the tokens before ``start``;
    the chunk's keys / values are written at slots ``start ..`` and it attends causally to the first
    ``start + C`` slots. mask / types: [B, start + C] (validity and token types of every slot
    attended). The cache is donated; its ``valid`` / ``length`` are not changed (the caller commits
    them after the last chunk).

    Returns (final normed hidden [B, C, H], KVCache, hidden [n, B, C, H]).
    """
    b, c = embeds.shape[:2]
    end = start + c
    if mask.shape != (b, end) or types.shape != (b, end):
        raise ValueError(f"mask / types: expected [{b}, {end}] (the slots up to the chunk's end), got "
                         f"{mask.shape} / {types.shape}")
    q_slots = jnp.broadcast_to(start + jnp.arange(c, dtype=jnp.int32), (b, c))
    li = _layer_inputs(model.config, position_ids, q_slots, mask, types, start)
    h, cache, hidden = run_decoder(model.language_model, embeds, li, attention, cache=cache, kv_len=end,
                                   hidden_layers=hidden_layers, mlp_chunk=mlp_chunk)
    return h, cache, hidden


@functools.partial(jax.jit, static_argnames=("attention",), donate_argnames=("cache",))
def decode_step(model: Qwen2_5_VL, cache: KVCache, tokens: jax.Array, attention: LayerAttention | None = None):
    """One decoding step. tokens: int [B] -> (logits float32 [B, V], updated cache; the input cache is donated).

    The token is written at slot ``cache.length`` with M-RoPE position ``cache.next_position`` on all
    three axes. Past the cache's end the logits are NaN, the length stops growing and the last slot
    is overwritten.
    """
    attention = resolve_attention("dense") if attention is None else attention
    pos = jnp.broadcast_to(cache.next_position[None, :, None], (3,) + cache.next_position.shape + (1,))
    return decode_token(model.language_model, cache, tokens, attention,
                        lambda slots, valid, slot: _layer_inputs(model.config, pos, slots, valid, None, slot))


@functools.partial(jax.jit, static_argnames=("hidden_layers", "tree_attn"), donate_argnames=("cache",))
def cached_forward(model: Qwen2_5_VL, cache: KVCache, tokens: jax.Array, positions: jax.Array, write_slot: jax.Array,
                   prefix_valid: jax.Array, block_start: jax.Array, block_mask: jax.Array, *, tree_attn,
                   hidden_layers: tuple = ()):
    """Run text tokens against the cache with tree-shaped visibility (token trees, chunks).

    tokens: int [B, n] written at slots ``write_slot .. write_slot + n - 1``; positions: int32 [B, n] (or
    [B, 1], broadcast) M-RoPE position of each token (the same on the three axes, as for generated text). Each token
    sees the cache slots in ``prefix_valid`` bool [B, S] (which must exclude the block) and, of the
    W slots from ``block_start``, those in ``block_mask`` bool [B, n, W] (e.g. its ancestors in the
    tree and itself). ``tree_attn(q, k, v, prefix_valid, block_start, block_mask) -> out`` is the
    injected attention (one softmax over both key sets; e.g. ``pallas_kernels.tree_decode_attention``,
    whose pure-JAX reference runs on a CPU). The cache's ``valid`` / ``length`` /
    ``next_position`` are not changed (commit with ``compact_cache``); the input cache is donated.

    Returns (logits float32 [B, n, V], hidden [len(hidden_layers), B, n, H] in HF numbering, cache).
    """
    b, s = cache.valid.shape
    if tokens.ndim != 2 or tokens.shape[0] != b:
        raise ValueError(f"tokens: expected shape [B={b}, n], got {tokens.shape}")
    n = tokens.shape[1]
    if positions.ndim != 2 or positions.shape[0] != b or positions.shape[1] not in (1, n):
        raise ValueError(f"positions: expected shape {(b, n)} (or [{b}, 1], broadcast), got {positions.shape}")
    positions = jnp.broadcast_to(positions, (b, n))
    if prefix_valid.shape != (b, s) or block_mask.ndim != 3 or block_mask.shape[:2] != (b, n):
        raise ValueError(f"prefix_valid / block_mask: expected [{b}, {s}] / [{b}, {n}, W], got {prefix_valid.shape} / "
                         f"{block_mask.shape}")
    x = embed_tokens(model.language_model, tokens.astype(jnp.int32))
    pos = jnp.broadcast_to(positions.astype(jnp.int32)[None], (3, b, n))
    slots = jnp.broadcast_to(write_slot + jnp.arange(n, dtype=jnp.int32), (b, n))
    li = _layer_inputs(model.config, pos, slots, prefix_valid, None, write_slot)

    def attn(q, k, v, **_):
        return tree_attn(q, k, v, prefix_valid, block_start, block_mask)

    h, cache, hidden = run_decoder(model.language_model, x, li, LayerAttention(uniform=attn), cache=cache, kv_len=s,
                                   hidden_layers=hidden_layers, unroll=True)
    return lm_logits(model.language_model, h), hidden, cache
