"""A text-only causal LM on the shared decoder (Llama, Qwen3, Qwen3-MoE): forward, prefill and decode
step as pure functions over the NNX model.

The functions have the names and argument order of ``models.qwen2_5_vl.model`` (``prepare_inputs``,
``visual_inputs``, ``prefill_language_model``, ``prompt_embeddings``, ``prefill_chunk``,
``final_logits``, ``init_cache``, ``decode_step``), so ``mmjax.prefill`` / ``mmjax.decode_step`` run
both kinds of model through one code path. Text models have no visual features and no modality:
``token_types`` is None and the attention gets ``modality=None``. Rotary positions are 1-D, ``[B, T]``:
``cumsum(attention_mask) - 1`` (transformers' ``generate`` rule), so a left-padded row computes what
the unpadded row does.
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
from models.causal_lm.config import CausalLMConfig
from models.common import PREFILL_XLA_OPTIONS
from models.kv_cache import KVCache
from models.rotary import rope_cos_sin
from models.text_decoder import (LayerInputs, TextDecoder, check_token_inputs, decode_token, embed_tokens,
                                 last_token_logits, lm_logits, run_decoder)

VISUAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


class CausalLM(nnx.Module):
    """Parameters of a text-only causal LM: ``language_model`` (TextDecoder); ``config`` (CausalLMConfig)."""

    def __init__(self, config: CausalLMConfig, *, dtype=jnp.float32, key: jax.Array | None = None):
        self.config = config
        self.language_model = TextDecoder(config.text, dtype=dtype, key=jax.random.key(0) if key is None else key)


@dataclasses.dataclass(frozen=True)
class PreparedInputs:
    """Validated inputs: input_ids int32 [B, T], attention_mask bool [B, T], position_ids int32 [B, T]
    (1-D rotary positions), rope_deltas int32 [B] (next position minus the row's valid tokens; 0
    unless ``position_ids`` were given), token_types None (text only)."""

    input_ids: Any
    attention_mask: Any
    position_ids: Any
    rope_deltas: Any
    token_types: None = None


def prepare_inputs(config: CausalLMConfig, *, input_ids, attention_mask=None, position_ids=None,
                   **visual) -> PreparedInputs:
    """Validate HF tokenizer outputs. ``position_ids`` [B, T] overrides the default ``cumsum(mask) - 1``
    (0 at padding). Images or videos (``pixel_values``, ...) raise a ValueError: the model reads text."""
    given = sorted(k for k, v in visual.items() if v is not None)
    unknown = sorted(set(visual) - set(VISUAL_KEYS))
    if unknown:
        raise ValueError(f"prepare_inputs: unexpected arguments {unknown}")
    if given:
        raise ValueError(f"{given[0]}: a text-only {config.family} model takes no images or videos")
    ids, mask = check_token_inputs(input_ids, attention_mask, config.text.vocab_size)
    if position_ids is None:
        pos = np.where(mask, np.cumsum(mask, axis=-1) - 1, 0)
        deltas = np.zeros(ids.shape[0], np.int64)
    else:
        pos = np.asarray(position_ids)
        if pos.shape != ids.shape or not np.issubdtype(pos.dtype, np.integer):
            raise ValueError(f"position_ids: expected an integer array of shape {ids.shape}, got {pos.dtype} "
                             f"{pos.shape}")
        deltas = pos.max(axis=-1, initial=-1) + 1 - mask.sum(-1)
    return PreparedInputs(jnp.asarray(ids, jnp.int32), jnp.asarray(mask), jnp.asarray(pos, jnp.int32),
                          jnp.asarray(deltas, jnp.int32))


def frame_tokens(config: CausalLMConfig, p: PreparedInputs) -> None:
    """Tokens per video frame: None (a text LM has no video)."""
    del config, p
    return None


def visual_inputs(model: CausalLM, p: PreparedInputs, frames_per_chunk: int | None = None):
    """(image features, video features): (None, None), a text model has none."""
    return None, None


def _no_visual(image_feats, video_feats):
    if image_feats is not None or video_feats is not None:
        raise ValueError("image_feats / video_feats: a text-only model takes no visual features (expected None)")


def _layer_inputs(config: CausalLMConfig, position_ids, q_positions, kv_valid, modality, write_index):
    cos, sin = rope_cos_sin(position_ids, config.rope.inv_freq(config.text.head_dim), config.rope.attention_scaling)
    return LayerInputs(cos, sin, q_positions, kv_valid, modality, jnp.asarray(write_index, jnp.int32))


@functools.partial(jax.jit, static_argnames=("attention", "mlp_chunk"))
def _lm_forward(model, input_ids, position_ids, mask, attention, mlp_chunk):
    b, t = mask.shape
    x = embed_tokens(model.language_model, input_ids)
    li = _layer_inputs(model.config, position_ids, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), mask,
                       None, 0)
    h, _, _ = run_decoder(model.language_model, x, li, attention, mlp_chunk=mlp_chunk)
    return lm_logits(model.language_model, h)


def forward(model: CausalLM, *, input_ids, attention_mask=None, position_ids=None, attention: Any = "dense",
            mlp_chunk: int | None = None) -> jax.Array:
    """Full-sequence logits float32 [B, T, V] (transformers' argument names; ``position_ids`` [B, T]
    default ``cumsum(attention_mask) - 1``)."""
    p = prepare_inputs(model.config, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return _lm_forward(model, p.input_ids, p.position_ids, p.attention_mask, resolve_attention(attention), mlp_chunk)


def init_cache(config: CausalLMConfig, batch: int, max_length: int, dtype, kv_dtype=None) -> KVCache:
    """An empty KV cache (see ``models.kv_cache.KVCache.empty``)."""
    return KVCache.empty(config.text, batch, max_length, dtype, kv_dtype)


@functools.partial(jax.jit, static_argnames=("attention", "max_length", "hidden_layers", "mlp_chunk", "kv_dtype"),
                   compiler_options=PREFILL_XLA_OPTIONS)
def prefill_language_model(model: CausalLM, input_ids, image_feats, video_feats, position_ids, mask, types,
                           rope_deltas, *, attention: LayerAttention, max_length: int, hidden_layers: tuple = (),
                           mlp_chunk: int | None = None, kv_dtype=None):
    """Run the decoder over the prompt and fill a fresh cache of ``max_length`` slots.
    input_ids / mask / position_ids: [B, T]; image_feats / video_feats: None; types: the attention's
    modality (None for text); rope_deltas: [B]. ``kv_dtype``: the cache's storage dtype.

    Returns (logits of each row's last valid token float32 [B, V], KVCache, hidden [n, B, T, H]).
    """
    _no_visual(image_feats, video_feats)
    b, t = mask.shape
    if max_length < t:
        raise ValueError(f"max_length: expected at least the prompt length {t}, got {max_length}")
    x = embed_tokens(model.language_model, input_ids)
    cache = init_cache(model.config, b, max_length, x.dtype, kv_dtype)
    li = _layer_inputs(model.config, position_ids, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), mask,
                       types, 0)
    h, cache, hidden = run_decoder(model.language_model, x, li, attention, cache=cache, hidden_layers=hidden_layers,
                                   mlp_chunk=mlp_chunk)
    n_valid = jnp.sum(mask, axis=-1).astype(jnp.int32)
    valid = jnp.zeros((b, max_length), bool).at[:, :t].set(mask)
    cache = dataclasses.replace(cache, valid=valid, length=jnp.asarray(t, jnp.int32),
                                next_position=n_valid + rope_deltas)
    return last_token_logits(model.language_model, h, mask), cache, hidden


@jax.jit
def prompt_embeddings(model: CausalLM, input_ids, types=None, image_feats=None, video_feats=None) -> jax.Array:
    """Token embeddings [B, T, H] (``types`` / features: None for a text model)."""
    _no_visual(image_feats, video_feats)
    return embed_tokens(model.language_model, input_ids)


@jax.jit
def final_logits(model: CausalLM, h: jax.Array) -> jax.Array:
    """h: final-normed states [B, H] -> logits float32 [B, V]."""
    return lm_logits(model.language_model, h[:, None])[:, 0]


@functools.partial(jax.jit, static_argnames=("attention", "start", "hidden_layers", "mlp_chunk"),
                   donate_argnames=("cache",), compiler_options=PREFILL_XLA_OPTIONS)
def prefill_chunk(model: CausalLM, cache: KVCache, embeds, position_ids, mask, types, *, attention: LayerAttention,
                  start: int, hidden_layers: tuple = (), mlp_chunk: int | None = None):
    """Chunked prefill: the prompt tokens ``start .. start + C - 1`` (embeds [B, C, H], position_ids
    [B, C]) against the cache holding the tokens before ``start``; written at slots ``start ..``,
    attending causally to the first ``start + C`` slots. mask: [B, start + C]; types: None (the
    attention's modality). The cache is donated; its ``valid`` / ``length`` are not changed.

    Returns (final normed hidden [B, C, H], KVCache, hidden [n, B, C, H]).
    """
    b, c = embeds.shape[:2]
    end = start + c
    if mask.shape != (b, end) or position_ids.shape != (b, c):
        raise ValueError(f"mask / position_ids: expected [{b}, {end}] / [{b}, {c}], got {mask.shape} / "
                         f"{position_ids.shape}")
    q_slots = jnp.broadcast_to(start + jnp.arange(c, dtype=jnp.int32), (b, c))
    li = _layer_inputs(model.config, position_ids, q_slots, mask, types, start)
    return run_decoder(model.language_model, embeds, li, attention, cache=cache, kv_len=end,
                       hidden_layers=hidden_layers, mlp_chunk=mlp_chunk)


@functools.partial(jax.jit, static_argnames=("attention",), donate_argnames=("cache",))
def decode_step(model: CausalLM, cache: KVCache, tokens: jax.Array, attention: LayerAttention | None = None):
    """One decoding step. tokens: int [B] -> (logits float32 [B, V], updated cache; the input cache is donated).

    The token is written at slot ``cache.length`` with rotary position ``cache.next_position``. Past
    the cache's end the logits are NaN, the length stops growing and the last slot is overwritten.
    """
    attention = resolve_attention("dense") if attention is None else attention
    return decode_token(model.language_model, cache, tokens, attention,
                        lambda slots, valid, slot: _layer_inputs(model.config, cache.next_position[:, None], slots,
                                                                 valid, None, slot))
