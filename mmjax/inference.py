"""Functional, jit-compiled prefill and decode for the VLM ports in ``models``.

Attention is chosen per decoder layer (see ``models.attention`` for the full protocol):

* ``"dense"``: exact pure-JAX attention (blocked online softmax for long sequences);
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, bf16, prefill only);
* a callable ``attn_fn(q, k, v, *, layer, q_positions, kv_valid, modality) -> out`` used for every
  layer (``layer`` is the Python int of the layer), or a sequence with one callable per layer;
* a sparse configuration: any object with a ``layer_attention(layer_idx) -> attn_fn`` method. This is
  the hook an ``mmjax.SparseConfig`` implements: it returns, for each layer, a function that runs that
  layer's per-head patterns on (q, k, v) using ``modality`` (0 text, 1 image, 2 video per token).

q: [B, T, N, D], k/v: [B, S, K, D] with rotary applied, q_positions int32 [B, T], kv_valid bool [B, S].
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from models.attention import resolve_attention
from models.qwen2_5_vl import model as qwen_vl
from models.qwen2_text import KVCache

PROCESSOR_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
                  "video_grid_thw", "second_per_grid_ts")


@dataclasses.dataclass(frozen=True)
class PrefillOutput:
    """logits: float32 [B, V] at each row's last valid token; cache: KVCache preallocated to
    ``max_length`` slots; hidden_states: {HF hidden-state index: [B, T, H]} (0 = embeddings, i = output
    of layer i-1, L = final normed); token_types: int32 [B, T] (0 text, 1 image, 2 video);
    rope_deltas: int32 [B]; input_ids: int32 [B, T]; position_ids: int32 [3, B, T] (M-RoPE ids);
    attention_mask: bool [B, T]."""

    logits: jax.Array
    cache: KVCache
    hidden_states: dict[int, jax.Array]
    token_types: jax.Array
    rope_deltas: jax.Array
    input_ids: jax.Array
    position_ids: jax.Array
    attention_mask: jax.Array


def check_model(model) -> None:
    """Raise ValueError unless ``model`` is a model these entry points run."""
    if not isinstance(model, qwen_vl.Qwen2_5_VL):
        raise ValueError(f"model: expected models.qwen2_5_vl.Qwen2_5_VL, got {type(model).__name__}")


def prefill(model, inputs: Mapping[str, Any], attention: Any = "dense", *, hidden_layers: Sequence[int] = (),
            max_length: int | None = None, mlp_chunk: int | None = 8192,
            frames_per_chunk: int | None = None) -> PrefillOutput:
    """Encode images/videos, merge them into the token stream and run the decoder, filling a KV cache.

    inputs: HF processor outputs (``input_ids`` [B, T] and optionally ``attention_mask``,
    ``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` + ``video_grid_thw``,
    ``second_per_grid_ts``); other keys (e.g. ``mm_token_type_ids``) are ignored.
    max_length: cache slots (default T + 256). mlp_chunk: tokens per MLP chunk (bounds activation
    memory on long inputs). frames_per_chunk: temporal patches encoded together by the vision tower.
    """
    check_model(model)
    if "input_ids" not in inputs:
        raise ValueError("inputs: expected an 'input_ids' entry")
    p = qwen_vl.prepare_inputs(model.config, **{k: inputs[k] for k in PROCESSOR_KEYS if k in inputs})
    b, t = p.input_ids.shape
    max_length = t + 256 if max_length is None else int(max_length)
    layer_attention = resolve_attention(attention)
    if isinstance(attention, str) and attention == "cudnn":
        mask = np.asarray(p.attention_mask)
        if not np.array_equal(mask, np.arange(t)[None] < mask.sum(-1, keepdims=True)):
            raise ValueError("attention_mask: 'cudnn' attention needs right padding (each row a prefix of valid "
                             "tokens); use 'dense' for left-padded batches")
    hidden_layers = tuple(int(i) for i in hidden_layers)
    image_feats, video_feats = qwen_vl.visual_inputs(model, p, frames_per_chunk)
    logits, cache, hidden = qwen_vl.prefill_language_model(
        model, p.input_ids, image_feats, video_feats, p.position_ids, p.attention_mask, p.token_types, p.rope_deltas, attention=layer_attention,
        max_length=max_length, hidden_layers=hidden_layers, mlp_chunk=mlp_chunk)
    return PrefillOutput(logits, cache, {i: hidden[j] for j, i in enumerate(hidden_layers)}, p.token_types,
                         p.rope_deltas, p.input_ids, p.position_ids, p.attention_mask)


def decode_step(model, cache: KVCache, tokens: jax.Array, attention: Any = "dense"):
    """One jit-compiled decode step: tokens int [B] -> (logits float32 [B, V], new cache).

    The cache argument is donated (do not reuse it). Positions continue the multimodal RoPE ids:
    ``n_valid_tokens + rope_delta``.
    """
    check_model(model)
    if tokens.ndim not in (1, 2) or tokens.shape[0] != cache.valid.shape[0] or tokens.size != cache.valid.shape[0]:
        raise ValueError(f"tokens: expected shape [{cache.valid.shape[0]}] (one token per row), got {tokens.shape}")
    if isinstance(attention, str) and attention == "cudnn":
        raise ValueError("attention: 'cudnn' is prefill-only; decode with 'dense' or a callable")
    return qwen_vl.decode_step(model, cache, tokens, resolve_attention(attention))


jax.tree_util.register_dataclass(PrefillOutput, data_fields=[f.name for f in dataclasses.fields(PrefillOutput)],
                                 meta_fields=[])
