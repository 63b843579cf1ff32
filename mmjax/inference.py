"""Functional, jit-compiled prefill and decode for the model ports in ``models`` (Qwen2.5-VL; the text LMs
Llama, Qwen3, Qwen3-MoE). Each model class has a row in ``RUNNERS``: the module of pure functions that runs
it, all with the same names and arguments.

Attention is chosen per decoder layer (see ``models.attention`` for the full protocol):

* ``"dense"``: exact pure-JAX attention (blocked online softmax for long sequences);
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, bf16, prefill only);
* a callable ``attn_fn(q, k, v, *, layer, q_positions, kv_valid, modality) -> out`` used for every
  layer (``layer`` is the Python int of the layer), or a sequence with one callable per layer;
* a sparse configuration (`mmjax.SparseConfig`, or any object with ``uniform_attention()`` /
  ``layer_attention(layer_idx)``): per layer, per head patterns using ``modality`` (0 text, 1 image,
  2 video per token); the layers still run under one ``lax.scan`` (`mmjax.sparse.model_attention`).

Memory: the decoder layers run under ``lax.scan`` with the KV cache and the residual stream as loop
state updated in place, norms / projections / MLP in sequence chunks of ``mlp_chunk`` tokens and
logits only at each row's last token, so the peak is about weights + KV cache + one layer's working
set whatever the depth. ``chunk_tokens`` bounds it further (chunked prefill: each chunk attends to
the cache so far), ``kv_dtype=jnp.float8_e4m3fn`` halves the cache.

q: [B, T, N, D], k/v: [B, S, K, D] with rotary applied, q_positions int32 [B, T], kv_valid bool [B, S].
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.parallel import run as parallel
from mmjax.parallel import vision as parallel_vision
from mmjax.parallel.attention import decode_attention, prefill_attention
from mmjax import video_upload
from mmjax.progress import progress_bar
from mmjax.sparse.config import SparseConfig
from mmjax.sparse.patterns import Dense
from models.attention import LayerAttention, resolve_attention
from models.causal_lm import model as causal_lm
from models.kv_cache import KVCache
from models.llava_onevision import model as llava_ov
from models.qwen2_5_vl import model as qwen_vl
from models.sharding import SP, axis_size

PROCESSOR_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
                  "video_grid_thw", "second_per_grid_ts", "image_sizes", "batch_num_images")


@dataclasses.dataclass(frozen=True)
class PrefillOutput:
    """logits: float32 [B, V] at each row's last valid token; cache: KVCache preallocated to
    ``max_length`` slots; hidden_states: {HF hidden-state index: [B, T, H]} (0 = embeddings, i = output
    of layer i-1, L = final normed); token_types: int32 [B, T] (0 text, 1 image, 2 video), None for a
    text LM; rope_deltas: int32 [B]; input_ids: int32 [B, T]; position_ids: int32 [3, B, T] (M-RoPE
    ids), [B, T] for a text LM; attention_mask: bool [B, T]."""

    logits: jax.Array
    cache: KVCache
    hidden_states: dict[int, jax.Array]
    token_types: jax.Array
    rope_deltas: jax.Array
    input_ids: jax.Array
    position_ids: jax.Array
    attention_mask: jax.Array


# model class -> the module that runs it: prepare_inputs, frame_tokens, visual_inputs, prefill_language_model,
# prompt_embeddings, prefill_chunk, final_logits, init_cache, decode_step (same names and arguments in every module);
# the targets of speculative decoding also have cached_forward
RUNNERS = ((qwen_vl.Qwen2_5_VL, qwen_vl), (llava_ov.LlavaOnevision, llava_ov), (causal_lm.CausalLM, causal_lm))


def runner(model):
    """The module of ``RUNNERS`` that runs ``model``; ValueError for anything else."""
    for cls, module in RUNNERS:
        if isinstance(model, cls):
            return module
    names = " or ".join(f"{cls.__module__.rsplit('.', 1)[0]}.{cls.__name__}" for cls, _ in RUNNERS)
    raise ValueError(f"model: expected {names}, got {type(model).__name__}")


def check_model(model) -> None:
    """Raise ValueError unless ``model`` is a model these entry points run."""
    runner(model)


def prefill(model, inputs: Mapping[str, Any], attention: Any = "dense", *, hidden_layers: Sequence[int] = (),
            max_length: int | None = None, mlp_chunk: int | None = 8192, frames_per_chunk: int | None = None,
            chunk_tokens: int | None = None, kv_dtype=None, progress: bool = False, mesh=None) -> PrefillOutput:
    """Encode images/videos, merge them into the token stream and run the decoder, filling a KV cache.

    inputs: HF processor outputs (``input_ids`` [B, T] and optionally ``attention_mask``,
    ``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` + ``video_grid_thw``,
    ``second_per_grid_ts``); other keys (e.g. ``mm_token_type_ids``) are ignored.
    max_length: cache slots (default T + 256). mlp_chunk: tokens per chunk of the position-wise work
    (norms, projections, MLP). frames_per_chunk: temporal patches encoded together by the vision
    tower. chunk_tokens: prefill the prompt in chunks of this many tokens, each attending to the
    cache so far (bounds the working set for GPUs smaller than the prompt needs; one compilation
    per chunk length and offset; "cudnn" then runs as the block-sparse kernel's dense causal layout,
    which takes queries that end their keys; patterns that estimate their index online estimate it
    from each chunk's own last queries). kv_dtype: the cache's storage dtype (default the
    model's; ``jnp.float8_e4m3fn`` stores k / v in 8 bits with a per-vector scale). progress: a bar
    on stderr over the chunks. mesh: a ``jax.sharding.Mesh`` with axes "tp" (heads: whole GQA groups
    per device, weights split as in `models.sharding`, one all-reduce after the output and the down
    projection) and / or "sp" (tokens; attention swaps to whole sequences of fewer heads, so sparse
    patterns stay exact; ``max_length`` is rounded up to a multiple of sp and the prompt right-padded to
    it with masked tokens, so the split cache is written in place) over which the model's
    parameters are laid out (``mmjax.parallel.shard_model`` or ``mmjax.load(..., mesh=)``); videos are
    encoded split by frames, the cache comes back split by key head and slot (see ``mmjax.parallel``).
    """
    run = runner(model)
    if "input_ids" not in inputs:
        raise ValueError("inputs: expected an 'input_ids' entry")
    p = run.prepare_inputs(model.config, **{k: inputs[k] for k in PROCESSOR_KEYS if k in inputs})
    attention = with_frame_tokens(attention, run.frame_tokens(model.config, p))
    b, t = p.input_ids.shape
    max_length = t + 256 if max_length is None else int(max_length)
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool)
                                     or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens: expected None or an int >= 1; received {chunk_tokens!r}")
    if max_length < t:
        raise ValueError(f"max_length: expected at least the prompt length {t}; received {max_length}")
    if isinstance(attention, str) and attention == "cudnn":
        mask = np.asarray(p.attention_mask)
        if not np.array_equal(mask, np.arange(t)[None] < mask.sum(-1, keepdims=True)):
            raise ValueError("attention_mask: 'cudnn' attention needs right padding (each row a prefix of valid "
                             "tokens); use 'dense' for left-padded batches")
    hidden_layers = tuple(int(i) for i in hidden_layers)
    if mesh is not None:
        mesh = parallel.check(model, mesh)
        max_length = parallel.round_slots(max_length, mesh)
        if chunk_tokens is not None and chunk_tokens < t and axis_size(mesh, SP) > 1:
            raise ValueError("chunk_tokens: a sequence-parallel mesh (sp > 1) prefills the prompt in one piece; "
                             "expected None")
    if video_upload.streams(model, p, mesh):  # one long video: pixels uploaded piece by piece, overlapping the tower
        image_feats, video_feats = video_upload.visual_inputs(model, p, frames_per_chunk, mesh)
    elif mesh is not None and isinstance(model, (qwen_vl.Qwen2_5_VL, llava_ov.LlavaOnevision)):
        image_feats, video_feats = parallel_vision.visual_inputs(model, p, frames_per_chunk, mesh)
    else:
        image_feats, video_feats = run.visual_inputs(model, p, frames_per_chunk)
    if image_feats is not None or video_feats is not None:
        p = dataclasses.replace(p, pixel_values=None, pixel_values_videos=None)  # free the pixels on the device
    if mesh is not None and (chunk_tokens is None or chunk_tokens >= t):
        logits, cache, hidden = parallel.prefill_language_model(
            run.prefill_language_model, model, p.input_ids, image_feats, video_feats, p.position_ids,
            p.attention_mask, p.token_types, p.rope_deltas,
            attention=prefill_attention(resolve_attention(attention), mesh, model.config.text.num_key_value_heads, t),
            max_length=max_length, hidden_layers=hidden_layers, mlp_chunk=mlp_chunk, kv_dtype=kv_dtype, mesh=mesh)
    elif chunk_tokens is None or chunk_tokens >= t:
        logits, cache, hidden = run.prefill_language_model(
            model, p.input_ids, image_feats, video_feats, p.position_ids, p.attention_mask, p.token_types,
            p.rope_deltas, attention=resolve_attention(attention), max_length=max_length,
            hidden_layers=hidden_layers, mlp_chunk=mlp_chunk, kv_dtype=kv_dtype)
    else:
        embeds = run.prompt_embeddings(model, p.input_ids, p.token_types, image_feats, video_feats)
        del image_feats, video_feats
        attn = _chunk_attention(model, attention)
        with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):  # a MoE's experts read the mesh
            logits, cache, hidden = _chunked_prefill(run, model, p, embeds, attn if mesh is None else
                                                     decode_attention(attn, mesh), max_length, hidden_layers,
                                                     mlp_chunk, chunk_tokens, kv_dtype, progress, mesh)
    return PrefillOutput(logits, cache, {i: hidden[j] for j, i in enumerate(hidden_layers)}, p.token_types,
                         p.rope_deltas, p.input_ids, p.position_ids, p.attention_mask)


def with_frame_tokens(attention: Any, frame_tokens: int | None) -> Any:
    """A `SparseConfig` as the attention of every layer told the video's tokens per frame (Grid heads: the stride
    of ``stride="frame"``, the one `Grid.frame_first` tries); any other attention, or no frame size, unchanged."""
    if frame_tokens is None or not isinstance(attention, SparseConfig):
        return attention
    return LayerAttention(uniform=attention.uniform_attention(frame_tokens=frame_tokens))


def _chunk_attention(model, attention):
    """The attention of a chunked prefill: cuDNN's causal mask assumes queries that start their
    keys, so "cudnn" runs as the block-sparse kernel's dense causal layout (queries end their keys)."""
    if isinstance(attention, str) and attention == "cudnn":
        c = model.config.text
        attention = SparseConfig.uniform(Dense(), num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads)
    return resolve_attention(attention)


def _chunked_prefill(run, model, p, embeds, attention, max_length, hidden_layers, mlp_chunk, chunk, kv_dtype,
                     progress, mesh=None):
    """Prefill in chunks of ``chunk`` tokens (``run``: the model's row of ``RUNNERS``; ``mesh``: None or a
    heads-only mesh the cache is laid out on): (logits [B, V], KVCache, hidden [n, B, T, H])."""
    b, t = p.input_ids.shape
    cache = run.init_cache(model.config, b, max_length, embeds.dtype, kv_dtype)
    if mesh is not None:
        cache = parallel.place_cache(cache, mesh)
    mask = p.attention_mask
    last = t - 1 - jnp.argmax(mask[:, ::-1], axis=-1)  # each row's last valid token
    h_last = jnp.zeros((b, embeds.shape[-1]), embeds.dtype)
    hidden = []
    starts = range(0, t, chunk)
    bar = progress_bar(len(starts), "prefill chunks", progress)
    for start in starts:
        end = min(start + chunk, t)
        h, cache, hid = run.prefill_chunk(
            model, cache, embeds[:, start:end], p.position_ids[..., start:end], mask[:, :end],
            None if p.token_types is None else p.token_types[:, :end], attention=attention, start=start,
            hidden_layers=hidden_layers, mlp_chunk=mlp_chunk)
        here = (last >= start) & (last < end)
        pick = jnp.take_along_axis(h, jnp.clip(last - start, 0, end - start - 1)[:, None, None], axis=1)[:, 0]
        h_last = jnp.where(here[:, None], pick, h_last)
        hidden.append(hid)
        bar.update(1)
    bar.close()
    n_valid = jnp.sum(mask, axis=-1).astype(jnp.int32)
    cache = dataclasses.replace(cache, valid=jnp.zeros((b, max_length), bool).at[:, :t].set(mask),
                                length=jnp.asarray(t, jnp.int32), next_position=n_valid + p.rope_deltas)
    return run.final_logits(model, h_last), cache, jnp.concatenate(hidden, axis=2)


def enable_compilation_cache(directory: str | os.PathLike, *, min_compile_time_s: float = 1.0) -> None:
    """Keep compiled programs in ``directory`` across processes (JAX's persistent compilation cache):
    a second run of the same prefill shape skips its compile. Programs that compiled faster than
    ``min_compile_time_s`` are not stored."""
    path = os.fspath(directory)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def decode_step(model, cache: KVCache, tokens: jax.Array, attention: Any = "dense", *, mesh=None):
    """One jit-compiled decode step: tokens int [B] -> (logits float32 [B, V], new cache).

    The cache argument is donated (do not reuse it). Positions continue the rotary ids (M-RoPE or 1-D):
    ``n_valid_tokens + rope_delta``. mesh: the mesh of the prefill that made ``cache`` (see `prefill`);
    with an "sp" axis the attention is dense, each device attending its cache slots.
    """
    run = runner(model)
    if tokens.ndim not in (1, 2) or tokens.shape[0] != cache.valid.shape[0] or tokens.size != cache.valid.shape[0]:
        raise ValueError(f"tokens: expected shape [{cache.valid.shape[0]}] (one token per row), got {tokens.shape}")
    if isinstance(attention, str) and attention == "cudnn":
        raise ValueError("attention: 'cudnn' is prefill-only; decode with 'dense' or a callable")
    if mesh is None:
        return run.decode_step(model, cache, tokens, resolve_attention(attention))
    mesh = parallel.check(model, mesh)
    if axis_size(mesh, SP) > 1 and not (isinstance(attention, str) and attention == "dense"):
        raise ValueError(f"attention: a sequence-parallel decode (sp > 1) attends densely; expected 'dense', got "
                         f"{attention!r}")
    return parallel.decode_step(run.decode_step, model, cache, tokens,
                                attention=decode_attention(resolve_attention(attention), mesh), mesh=mesh)


jax.tree_util.register_dataclass(PrefillOutput, data_fields=[f.name for f in dataclasses.fields(PrefillOutput)],
                                 meta_fields=[])
