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
from models.kv_cache import KVCache
from models.sharding import SP, axis_size, cache_sharding, check_mesh, is_laid_out


def check(model: nnx.Module, mesh: Any) -> Mesh:
    """The mesh to run ``model`` on (`models.sharding.check_mesh`); ValueError when the model's
    parameters are not laid out on it."""
    config = model.language_model.config
    mesh = check_mesh(mesh, config)
    if not is_laid_out(model, mesh):
        raise ValueError("model: its parameters are not laid out on the mesh; call "
                         "mmjax.parallel.shard_model(model, mesh) or load it with mmjax.load(..., mesh=mesh)")
    return mesh


def round_slots(max_length: int, mesh: Mesh) -> int:
    """Cache slots rounded up to a multiple of the "sp" size (each device holds the same number)."""
    n = axis_size(mesh, SP)
    return -(-max_length // n) * n


def _by_token(x, mesh: Mesh):
    """x [..., B, T] (ids, masks, M-RoPE ids) split by token over "sp"."""
    if x is None or axis_size(mesh, SP) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*([None] * (x.ndim - 1)), SP)))


def _pin_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    shardings = cache_sharding(cache, mesh)
    return jax.tree.map(jax.lax.with_sharding_constraint, cache, shardings)


def _on_mesh(arrays, mesh: Mesh):
    """Host or single-device arrays (prompt ids, masks, visual features, tokens) replicated on ``mesh``, so
    that XLA's layout of the program's inputs is fixed (None stays None)."""
    rep = NamedSharding(mesh, P())
    return tuple(None if a is None else jax.device_put(a, rep) for a in arrays)


def prefill_language_model(fn, model, *arrays, attention: LayerAttention, max_length: int, hidden_layers: tuple,
                           mlp_chunk: int | None, kv_dtype, mesh: Mesh):
    """``fn`` (a port's ``prefill_language_model``) on ``mesh``: arrays = (input_ids, image_feats, video_feats,
    position_ids, mask, types, rope_deltas), as ``fn`` takes them. Returns (logits float32 [B, V]
    replicated, KVCache in its layout, hidden [n, B, T, H] split by token over "sp")."""
    return prefill_program(fn, model, *_on_mesh(arrays, mesh), attention=attention, max_length=max_length,
                    hidden_layers=hidden_layers, mlp_chunk=mlp_chunk, kv_dtype=kv_dtype, mesh=mesh)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("attention", "max_length", "hidden_layers",
                                                                   "mlp_chunk", "kv_dtype", "mesh"))
def prefill_program(fn, model, input_ids, image_feats, video_feats, position_ids, mask, types, rope_deltas, *,
                    attention: LayerAttention, max_length: int, hidden_layers: tuple, mlp_chunk: int | None, kv_dtype,
                    mesh: Mesh):
    """The jit-compiled program of `prefill_language_model` (its arrays already on ``mesh``)."""
    # With the slots split over "sp", the decoder writes a cache of exactly the prompt's slots (a write at a
    # traced slot into a split axis makes XLA gather the whole cache); the free slots are appended after.
    # Measured in the compiled HLO on 4 CPU devices: no gather of the cache when sp divides the prompt
    # length, a gather of it at the writes otherwise (still exact).
    t = input_ids.shape[1]
    slots = t if axis_size(mesh, SP) > 1 else max_length
    logits, cache, hidden = fn(model, _by_token(input_ids, mesh), image_feats, video_feats,
                               _by_token(position_ids, mesh), _by_token(mask, mesh), _by_token(types, mesh),
                               rope_deltas, attention=attention, max_length=slots, hidden_layers=hidden_layers,
                               mlp_chunk=mlp_chunk, kv_dtype=kv_dtype)
    if slots < max_length:
        cache = extend_cache(cache, max_length)
    rep = NamedSharding(mesh, P())
    sp = SP if axis_size(mesh, SP) > 1 else None
    hidden = jax.lax.with_sharding_constraint(hidden, NamedSharding(mesh, P(None, None, sp, None)))
    return jax.lax.with_sharding_constraint(logits, rep), _pin_cache(cache, mesh), hidden


def decode_step(fn, model, cache: KVCache, tokens: jax.Array, *, attention: LayerAttention, mesh: Mesh):
    """``fn`` (a port's ``decode_step``) on ``mesh``: (logits float32 [B, V] replicated, cache in its layout);
    the cache (moved into its layout first when it is not there) is donated."""
    (tokens,) = _on_mesh((tokens,), mesh)
    return decode_program(fn, model, place_cache(cache, mesh), tokens, attention=attention, mesh=mesh)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("attention", "mesh"), donate_argnames=("cache",))
def decode_program(fn, model, cache: KVCache, tokens: jax.Array, *, attention: LayerAttention, mesh: Mesh):
    """The jit-compiled program of `decode_step` (cache and tokens already on ``mesh``; the cache is donated)."""
    logits, cache = fn(model, cache, tokens, attention)
    return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P())), _pin_cache(cache, mesh)


def extend_cache(cache: KVCache, max_length: int) -> KVCache:
    """``cache`` with free slots appended up to ``max_length`` (invalid; zero k / v, unit fp8 scales)."""
    extra = max_length - cache.max_length

    def pad(x, axis, value):
        if x is None:
            return None
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths, constant_values=value)
    return dataclasses.replace(cache, k=pad(cache.k, 2, 0), v=pad(cache.v, 2, 0), k_scale=pad(cache.k_scale, 2, 1),
                               v_scale=pad(cache.v_scale, 2, 1), valid=pad(cache.valid, 1, False))


def place_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    """``cache`` moved into its layout on ``mesh`` (nothing moves when it is there)."""
    shardings = cache_sharding(cache, mesh)
    return dataclasses.replace(cache, **{f.name: jax.device_put(getattr(cache, f.name), getattr(shardings, f.name))
                                         for f in dataclasses.fields(cache) if getattr(cache, f.name) is not None})
