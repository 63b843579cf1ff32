"""Qwen2 text decoder (GQA with q/k/v bias, SwiGLU MLP, RMSNorm, M-RoPE) with stacked layer weights.

Weights of all layers are stacked on a leading layer axis so the layers can run under ``lax.scan``
(fast compiles) or unrolled (per-layer attention functions). Attention is injected through
``models.attention.LayerAttention``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import LayerAttention
from models.common import chunked_over_axis, rms_norm
from models.rotary import apply_rotary


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """Qwen2 decoder hyper-parameters; defaults are transformers' ``Qwen2_5_VLTextConfig`` defaults."""

    vocab_size: int = 152064
    hidden_size: int = 8192
    intermediate_size: int = 29568
    num_hidden_layers: int = 80
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, ...] = (16, 24, 24)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} not divisible by num_key_value_heads "
                             f"{self.num_key_value_heads}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: expected 'silu', got {self.hidden_act!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# name -> shape (with L = layers, H = hidden, N/K = heads, D = head dim, F = intermediate)
def layer_param_shapes(c: TextConfig) -> dict[str, tuple[int, ...]]:
    L, H, N, K, D, F = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                        c.head_dim, c.intermediate_size)
    return {
        "input_norm": (L, H), "wq": (L, H, N, D), "bq": (L, N, D), "wk": (L, H, K, D), "bk": (L, K, D),
        "wv": (L, H, K, D), "bv": (L, K, D), "wo": (L, N, D, H), "post_norm": (L, H),
        "w_gate": (L, H, F), "w_up": (L, H, F), "w_down": (L, F, H),
    }


class Qwen2Text(nnx.Module):
    """Parameters of the decoder. ``embed``: [V, H]; ``lm_head``: [V, H] or None when tied."""

    def __init__(self, config: TextConfig, *, dtype=jnp.float32, key: jax.Array, init_std: float = 0.02):
        self.config = config
        keys = iter(jax.random.split(key, 16))
        normal = lambda shape: nnx.Param(init_std * jax.random.normal(next(keys), shape, dtype))
        self.embed = normal((config.vocab_size, config.hidden_size))
        for name, shape in layer_param_shapes(config).items():
            if name.endswith("norm"):
                setattr(self, name, nnx.Param(jnp.ones(shape, dtype)))
            else:
                setattr(self, name, normal(shape))
        self.final_norm = nnx.Param(jnp.ones((config.hidden_size,), dtype))
        self.lm_head = None if config.tie_word_embeddings else normal((config.vocab_size, config.hidden_size))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in layer_param_shapes(self.config)}


def embed_tokens(model: Qwen2Text, input_ids: jax.Array) -> jax.Array:
    """input_ids: int [B, T] -> [B, T, H]."""
    return jnp.take(model.embed[...], input_ids, axis=0)


def lm_logits(model: Qwen2Text, h: jax.Array) -> jax.Array:
    """h: [B, T, H] (final-normed) -> logits float32 [B, T, V]."""
    w = model.embed[...] if model.lm_head is None else model.lm_head[...]
    return jnp.einsum("bth,vh->btv", h, w, preferred_element_type=jnp.float32)


def _mlp(p, x, chunk):
    def f(xc):
        g = jnp.einsum("bth,hf->btf", xc, p["w_gate"])
        u = jnp.einsum("bth,hf->btf", xc, p["w_up"])
        return jnp.einsum("btf,fh->bth", jax.nn.silu(g) * u, p["w_down"])
    return chunked_over_axis(f, x, 1, chunk)


@dataclasses.dataclass(frozen=True)
class LayerInputs:
    """Per-call arrays shared by all layers (a pytree).

    cos, sin: [B, T, D] rotary tables for the new tokens; q_positions: int32 [B, T] slot of each new
    token; kv_valid: bool [B, S] validity of the attended keys; modality: int32 [B, S] or None;
    write_index: int32 scalar, first cache slot written.
    """

    cos: jax.Array
    sin: jax.Array
    q_positions: jax.Array
    kv_valid: jax.Array
    modality: jax.Array | None
    write_index: jax.Array


jax.tree_util.register_dataclass(LayerInputs, data_fields=["cos", "sin", "q_positions", "kv_valid", "modality",
                                                           "write_index"], meta_fields=[])


def _layer(c: TextConfig, p, x, ck, cv, li: LayerInputs, attn_fn, layer, attend_cache: bool, mlp_chunk):
    """One decoder layer. x: [B, T, H]; ck/cv: [B, S, K, D] cache of this layer or None.
    Returns (x, ck, cv) with the new keys/values written at ``li.write_index``."""
    h = rms_norm(x, p["input_norm"], c.rms_norm_eps)
    q = jnp.einsum("bth,hnd->btnd", h, p["wq"]) + p["bq"]
    k = jnp.einsum("bth,hkd->btkd", h, p["wk"]) + p["bk"]
    v = jnp.einsum("bth,hkd->btkd", h, p["wv"]) + p["bv"]
    cos, sin = li.cos.astype(x.dtype), li.sin.astype(x.dtype)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if ck is not None:
        ck = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), li.write_index, axis=1)
        cv = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), li.write_index, axis=1)
    ka, va = (ck, cv) if attend_cache else (k, v)
    o = attn_fn(q, ka, va, layer=layer, q_positions=li.q_positions, kv_valid=li.kv_valid, modality=li.modality)
    x = x + jnp.einsum("btnd,ndh->bth", o.astype(x.dtype), p["wo"])
    x = x + _mlp(p, rms_norm(x, p["post_norm"], c.rms_norm_eps), mlp_chunk)
    return x, ck, cv


def run_decoder(model: Qwen2Text, x: jax.Array, li: LayerInputs, attention: LayerAttention, *,
                cache_k: jax.Array | None = None, cache_v: jax.Array | None = None, attend_cache: bool = False,
                hidden_layers: Sequence[int] = (), mlp_chunk: int | None = None, unroll: bool = False):
    """Run all decoder layers and the final norm.

    x: [B, T, H] input embeddings. cache_k/cache_v: [L, B, S, K, D] or None. ``attend_cache``: attend
    to the whole cache (decode) instead of only the new tokens' keys (prefill from an empty cache).
    hidden_layers: indices in HF ``output_hidden_states`` numbering (0 = embeddings, i = output of
    layer i-1, L = final normed states). ``unroll``: a Python loop over layers even for a uniform
    attention (static weight slices; a decode step on an H200 takes 6.4 instead of 11.8 ms at the 7B
    shape, since the scan copies each layer's weights before the matrix-vector products).
    Returns (final normed hidden [B, T, H], cache_k, cache_v, hidden [len(hidden_layers), B, T, H]).
    """
    c = model.config
    L = c.num_hidden_layers
    for i in hidden_layers:
        if not 0 <= i <= L:
            raise ValueError(f"hidden_layers: expected indices in [0, {L}], got {tuple(hidden_layers)}")
    if (cache_k is None) != (cache_v is None) or (attend_cache and cache_k is None):
        raise ValueError("cache_k/cache_v: give both (and a cache is required when attend_cache=True)")
    req = tuple(hidden_layers)
    req_arr = jnp.asarray(req if req else (-1,), jnp.int32)
    buf = jnp.zeros((len(req),) + x.shape, x.dtype)

    def capture(buf, idx, h):
        if not req:
            return buf
        hit = (req_arr == idx)[:, None, None, None]
        return jnp.where(hit, h[None], buf)

    buf = capture(buf, 0, x)
    params = model.stacked()
    has_cache = cache_k is not None
    if attention.scannable and not unroll:
        fn = attention.uniform

        def step(carry, xs):
            h, buf = carry
            p, ck, cv, idx = xs
            h, ck, cv = _layer(c, p, h, ck, cv, li, fn, idx, attend_cache, mlp_chunk)
            buf = capture(buf, idx + 1, h)
            return (h, buf), (ck, cv) if has_cache else None

        (x, buf), ys = jax.lax.scan(step, (x, buf), (params, cache_k, cache_v, jnp.arange(L, dtype=jnp.int32)))
        if has_cache:
            cache_k, cache_v = ys
    else:
        for i in range(L):
            p = {n: a[i] for n, a in params.items()}
            ck = cache_k[i] if has_cache else None
            cv = cache_v[i] if has_cache else None
            x, ck, cv = _layer(c, p, x, ck, cv, li, attention.for_layer(i), i, attend_cache, mlp_chunk)
            if has_cache:
                cache_k, cache_v = cache_k.at[i].set(ck), cache_v.at[i].set(cv)
            if i + 1 < L:
                buf = capture(buf, i + 1, x)
    x = rms_norm(x, model.final_norm[...], c.rms_norm_eps)
    buf = capture(buf, L, x)
    return x, cache_k, cache_v, buf


@dataclasses.dataclass(frozen=True)
class KVCache:
    """Preallocated decoder KV cache (a pytree).

    k, v: [L, B, S, K, D]; valid: bool [B, S] (slots holding real tokens); length: int32 scalar, slots
    written so far (same for every row; padding is marked invalid); next_position: int32 [B], rotary
    position of the next token (``n_valid + rope_delta``, identical on the three M-RoPE axes).
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    length: jax.Array
    next_position: jax.Array

    @property
    def max_length(self) -> int:
        return self.k.shape[2]


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v", "valid", "length", "next_position"], meta_fields=[])


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

    def move(x):  # x: [L, B, S, K, D]
        picked = jnp.take_along_axis(x, slots[None, :, :, None, None], axis=2)
        return jax.lax.dynamic_update_slice_in_dim(x, picked, write_slot, axis=2)

    keep = jnp.arange(c)[None, :] < count[:, None]
    valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, keep, write_slot, axis=1)
    return KVCache(move(cache.k), move(cache.v), valid, write_slot + jnp.max(count).astype(jnp.int32),
                   cache.next_position + count.astype(jnp.int32))
