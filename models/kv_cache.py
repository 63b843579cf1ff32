"""The decoder KV cache: preallocated per-layer keys / values (model dtype or fp8 with per-vector
scales), written and read by layer inside the scanned decoder, and compacted after speculative
verification."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array | None]:
    """Keys or values [..., D] in the cache's storage ``dtype``: as they are (scale None), or for
    ``float8_e4m3fn`` scaled per vector by its absolute maximum (scale float32 [...])."""
    if jnp.dtype(dtype) != jnp.dtype(jnp.float8_e4m3fn):
        return x.astype(dtype), None
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1), 1e-30) / FP8_MAX
    return (xf / scale[..., None]).astype(dtype), scale


def dequantize_kv(x: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """The inverse of `quantize_kv`, in the compute ``dtype``."""
    if scale is None:
        return x.astype(dtype)
    return (x.astype(jnp.float32) * scale[..., None]).astype(dtype)


@dataclasses.dataclass(frozen=True)
class KVCache:
    """Preallocated decoder KV cache (a pytree).

    k, v: [L, B, S, K, D] in the storage dtype (the model's, or float8_e4m3fn); k_scale, v_scale:
    float32 [L, B, S, K] per-vector scales for float8 storage, else None; valid: bool [B, S] (slots
    holding real tokens); length: int32 scalar, slots written so far (same for every row; padding is
    marked invalid); next_position: int32 [B], rotary position of the next token (``n_valid +
    rope_delta``, identical on the three M-RoPE axes).
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    length: jax.Array
    next_position: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def max_length(self) -> int:
        return self.k.shape[2]

    @classmethod
    def empty(cls, config, batch: int, max_length: int, dtype, kv_dtype=None) -> "KVCache":
        """An empty cache of ``max_length`` slots for a decoder ``config`` (``num_hidden_layers``,
        ``num_key_value_heads``, ``head_dim``); ``kv_dtype`` (default ``dtype``) is the storage dtype of
        k / v (``jnp.float8_e4m3fn`` halves the cache of a bf16 model)."""
        kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
        if kv_dtype not in (jnp.dtype(dtype), jnp.dtype(jnp.float8_e4m3fn)):
            raise ValueError(f"kv_dtype: expected None, the model dtype {jnp.dtype(dtype)} or float8_e4m3fn; "
                             f"received {kv_dtype}")
        shape = (config.num_hidden_layers, batch, max_length, config.num_key_value_heads, config.head_dim)
        fp8 = kv_dtype == jnp.dtype(jnp.float8_e4m3fn)
        scale = (lambda: jnp.ones(shape[:-1], jnp.float32)) if fp8 else (lambda: None)
        return cls(jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype), jnp.zeros((batch, max_length), bool),
                   jnp.zeros((), jnp.int32), jnp.zeros((batch,), jnp.int32), scale(), scale())


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v", "valid", "length", "next_position", "k_scale",
                                                       "v_scale"], meta_fields=[])


def write_kv(kv: dict, layer, index, k: jax.Array, v: jax.Array) -> dict:
    """Write the new tokens' k / v [B, T, K, D] at slot ``index`` of layer ``layer`` of the cache
    arrays ``kv`` ({"k", "v", "k_scale", "v_scale"}, [L, B, S, ...]), quantizing for fp8 storage."""
    out = dict(kv)
    for name, x in (("k", k), ("v", v)):
        stored, scale = quantize_kv(x, kv[name].dtype)
        out[name] = jax.lax.dynamic_update_slice(kv[name], stored[None], (layer, 0, index, 0, 0))
        if scale is not None:
            out[name + "_scale"] = jax.lax.dynamic_update_slice(kv[name + "_scale"], scale[None], (layer, 0, index, 0))
    return out


def read_kv(kv: dict, layer, kv_len: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Layer ``layer``'s first ``kv_len`` slots of the cache arrays, [B, kv_len, K, D] in ``dtype``."""
    def one(name):
        x = jax.lax.dynamic_index_in_dim(kv[name], layer, 0, keepdims=False)[:, :kv_len]
        scale = kv.get(name + "_scale")
        if scale is not None:
            scale = jax.lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False)[:, :kv_len]
        return dequantize_kv(x, scale, dtype)
    return one("k"), one("v")


def compact_cache(cache: KVCache, write_slot: jax.Array, src: jax.Array, count: jax.Array) -> KVCache:
    """Keep a per-row subsequence of a block of freshly written slots (speculative decoding).

    ``n`` slots starting at ``write_slot`` were written (e.g. a verified token tree). For each row b,
    slots ``write_slot + src[b, i]`` (i < count[b]) are moved to ``write_slot + i`` and marked valid;
    the other slots of the block stay invalid. The length grows by ``max(count)`` (rows that keep
    fewer slots leave invalid gaps); ``next_position`` grows by ``count``.

    write_slot: int32 scalar; src: int32 [B, C] offsets into the block, in increasing order;
    count: int32 [B] in [0, C].
    """
    b = cache.valid.shape[0]
    if src.ndim != 2 or src.shape[0] != b or count.shape != (b,):
        raise ValueError(f"src / count: expected [B={b}, C] / [{b}], got {src.shape} / {count.shape}")
    c = src.shape[1]
    slots = write_slot + src.astype(jnp.int32)  # [B, C]

    def move(x):  # x: [L, B, S, ...] (keys / values or their scales)
        if x is None:
            return None
        idx = slots.reshape((1,) + slots.shape + (1,) * (x.ndim - 3))
        picked = jnp.take_along_axis(x, idx, axis=2)
        return jax.lax.dynamic_update_slice_in_dim(x, picked, write_slot, axis=2)

    keep = jnp.arange(c)[None, :] < count[:, None]
    valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, keep, write_slot, axis=1)
    return KVCache(move(cache.k), move(cache.v), valid, write_slot + jnp.max(count).astype(jnp.int32),
                   cache.next_position + count.astype(jnp.int32), move(cache.k_scale), move(cache.v_scale))
