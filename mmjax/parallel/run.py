"""The ports' prefill and decode step over a mesh: the port's own jit-compiled functions (its row of
``mmjax.inference.RUNNERS``) called inside one more ``jax.jit`` that pins the layouts XLA propagates from:
prompt arrays split by token over "sp", the KV cache by slot ("sp") and key head ("tp")
(`models.sharding.cache_sharding`), logits replicated. The model's parameters carry their own layout
(`models.sharding.shard_model`, or loaded into it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.attention import LayerAttention
from models.fp8_linear import is_quantized
from models.kv_cache import KVCache
from models.sharding import SP, axis_size, cache_sharding, check_mesh, is_laid_out
from pallas_kernels.tiling import round_up


def check(model: nnx.Module, mesh: Any) -> Mesh:
    """The mesh to run ``model`` on (`models.sharding.check_mesh`); ValueError when the model's
    parameters are not laid out on it."""
    config = model.language_model.config
    if is_quantized(model.language_model):
        raise ValueError("model: its fp8 weights (mmjax.quantize_fp8) run on one device; pass mesh=None or the "
                         "unquantized model")
    mesh = check_mesh(mesh, config)
    if not is_laid_out(model, mesh):
        raise ValueError("model: its parameters are not laid out on the mesh; call "
                         "mmjax.parallel.shard_model(model, mesh) or load it with mmjax.load(..., mesh=mesh)")
    return mesh


def round_slots(max_length: int, mesh: Mesh) -> int:
    """Cache slots rounded up to a multiple of the "sp" size (each device holds the same number)."""
    n = axis_size(mesh, SP)
    return round_up(max_length, n)


def _by_token(x, mesh: Mesh):
    """x [..., B, T] (ids, masks, M-RoPE ids) split by token over "sp"."""
    if x is None or axis_size(mesh, SP) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*([None] * (x.ndim - 1)), SP)))


def _pin_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    shardings = cache_sharding(cache, mesh)
    return jax.tree.map(jax.lax.with_sharding_constraint, cache, shardings)


def _on_mesh(arrays, mesh: Mesh):
    """Host or single-device arrays (prompt ids, masks, tokens) replicated on ``mesh`` (None stays None).

    Arrays already laid out over exactly the mesh's devices (the visual features, split by frames by
    `mmjax.parallel.vision`) are passed as they are: the program gathers them with one collective,
    instead of a `jax.device_put` to the replicated layout copying them between devices before the
    program can start."""
    rep = NamedSharding(mesh, P())
    devices = set(mesh.devices.flat)

    def place(a):
        if a is None or (isinstance(a, jax.Array) and a.sharding.device_set == devices):
            return a
        return jax.device_put(a, rep)
    return tuple(place(a) for a in arrays)


def prefill_language_model(fn, model, *arrays, attention: LayerAttention, max_length: int, hidden_layers: tuple,
                           mlp_chunk: int | None, kv_dtype, mesh: Mesh):
    """``fn`` (a port's ``prefill_language_model``) on ``mesh``: arrays = (input_ids, image_feats, video_feats,
    position_ids, mask, types, rope_deltas), as ``fn`` takes them. Returns (logits float32 [B, V]
    replicated, KVCache in its layout, hidden [n, B, T, H] split by token over "sp")."""
    with jax.set_mesh(mesh):  # traced under the mesh: the decoder's chunked position-wise work reads its "sp" split
        return prefill_program(fn, model, *_on_mesh(arrays, mesh), attention=attention, max_length=max_length,
                               hidden_layers=hidden_layers, mlp_chunk=mlp_chunk, kv_dtype=kv_dtype, mesh=mesh)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("attention", "max_length", "hidden_layers",
                                                                   "mlp_chunk", "kv_dtype", "mesh"))
def prefill_program(fn, model, input_ids, image_feats, video_feats, position_ids, mask, types, rope_deltas, *,
                    attention: LayerAttention, max_length: int, hidden_layers: tuple, mlp_chunk: int | None, kv_dtype,
                    mesh: Mesh):
    """The jit-compiled program of `prefill_language_model` (its arrays already on ``mesh``; traced under
    ``jax.set_mesh(mesh)``, see `models.common.map_chunks`)."""
    # With the slots split over "sp", a cache longer than the prompt cannot be written at a traced slot
    # without XLA gathering it (the prompt's token split and the cache's slot split differ), and appending
    # the free slots afterwards copies the whole cache (XLA's plan at 2M tokens of the 7B shape on 2 devices:
    # cache carried + padded copy = 4 x 28 GiB per device). So the prompt is right-padded to the cache's
    # ``max_length`` slots (a multiple of sp) with masked text tokens: token split and slot split coincide,
    # the cache written is the one returned, and the pad slots stay invalid (decoding overwrites them from
    # slot t on). Costs the compute of max_length - t masked tokens.
    t = input_ids.shape[1]
    pad = max_length - t if axis_size(mesh, SP) > 1 else 0
    if pad:
        input_ids, mask, types = (_right_pad(x, pad, v) for x, v in ((input_ids, 0), (mask, False), (types, 0)))
        position_ids = _right_pad(position_ids, pad, None)
    fn = getattr(fn, "__wrapped__", fn)  # traced inline: a nested jit may not carry the port's compiler options
    logits, cache, hidden = fn(model, _by_token(input_ids, mesh), image_feats, video_feats,
                               _by_token(position_ids, mesh), _by_token(mask, mesh), _by_token(types, mesh),
                               rope_deltas, attention=attention, max_length=max_length, hidden_layers=hidden_layers,
                               mlp_chunk=mlp_chunk, kv_dtype=kv_dtype)
    if pad:
        cache = dataclasses.replace(cache, length=jnp.asarray(t, jnp.int32))
        hidden = hidden[:, :, :t]
    rep = NamedSharding(mesh, P())
    sp = SP if axis_size(mesh, SP) > 1 else None
    hidden = jax.lax.with_sharding_constraint(hidden, NamedSharding(mesh, P(None, None, sp, None)))
    return jax.lax.with_sharding_constraint(logits, rep), _pin_cache(cache, mesh), hidden


def decode_step(fn, model, cache: KVCache, tokens: jax.Array, *, attention: LayerAttention, mesh: Mesh):
    """``fn`` (a port's ``decode_step``) on ``mesh``: (logits float32 [B, V] replicated, cache in its layout);
    the cache (moved into its layout first when it is not there) is donated."""
    (tokens,) = _on_mesh((tokens,), mesh)
    with jax.set_mesh(mesh):  # traced under the mesh: a MoE's expert-parallel MLP reads its "tp" split
        return decode_program(fn, model, place_cache(cache, mesh), tokens, attention=attention, mesh=mesh)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("attention", "mesh"), donate_argnames=("cache",))
def decode_program(fn, model, cache: KVCache, tokens: jax.Array, *, attention: LayerAttention, mesh: Mesh):
    """The jit-compiled program of `decode_step` (cache and tokens already on ``mesh``; the cache is donated)."""
    logits, cache = fn(model, cache, tokens, attention)
    return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P())), _pin_cache(cache, mesh)


def _right_pad(x, pad: int, value):
    """x [..., T] with ``pad`` entries appended on the token axis: ``value``, or the last entry (None)."""
    if x is None:
        return None
    widths = [(0, 0)] * (x.ndim - 1) + [(0, pad)]
    return jnp.pad(x, widths, mode="edge") if value is None else jnp.pad(x, widths, constant_values=value)


def place_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    """``cache`` moved into its layout on ``mesh`` (nothing moves when it is there)."""
    shardings = cache_sharding(cache, mesh)
    return dataclasses.replace(cache, **{f.name: jax.device_put(getattr(cache, f.name), getattr(shardings, f.name))
                                         for f in dataclasses.fields(cache) if getattr(cache, f.name) is not None})
