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
from models.common import map_chunks, rms_norm
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
    def empty(cls, config: TextConfig, batch: int, max_length: int, dtype, kv_dtype=None) -> "KVCache":
        """An empty cache of ``max_length`` slots; ``kv_dtype`` (default ``dtype``) is the storage
        dtype of k / v (``jnp.float8_e4m3fn`` halves the cache of a bf16 model)."""
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


def _write_kv(kv: dict, layer, index, k: jax.Array, v: jax.Array) -> dict:
    """Write the new tokens' k / v [B, T, K, D] at slot ``index`` of layer ``layer`` of the cache
    arrays ``kv`` ({"k", "v", "k_scale", "v_scale"}, [L, B, S, ...]), quantizing for fp8 storage."""
    out = dict(kv)
    for name, x in (("k", k), ("v", v)):
        stored, scale = quantize_kv(x, kv[name].dtype)
        out[name] = jax.lax.dynamic_update_slice(kv[name], stored[None], (layer, 0, index, 0, 0))
        if scale is not None:
            out[name + "_scale"] = jax.lax.dynamic_update_slice(kv[name + "_scale"], scale[None], (layer, 0, index, 0))
    return out


def _read_kv(kv: dict, layer, kv_len: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Layer ``layer``'s first ``kv_len`` slots of the cache arrays, [B, kv_len, K, D] in ``dtype``."""
    def one(name):
        x = jax.lax.dynamic_index_in_dim(kv[name], layer, 0, keepdims=False)[:, :kv_len]
        scale = kv.get(name + "_scale")
        if scale is not None:
            scale = jax.lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False)[:, :kv_len]
        return dequantize_kv(x, scale, dtype)
    return one("k"), one("v")


def _qkv(c: TextConfig, p, x, cos, sin, chunk):
    """Normed projections of the new tokens with rotary applied, in sequence chunks:
    x [B, T, H] -> q [B, T, N, D], k / v [B, T, K, D]."""
    def f(xc, cc, sc):
        h = rms_norm(xc, p["input_norm"], c.rms_norm_eps)
        q = jnp.einsum("bth,hnd->btnd", h, p["wq"]) + p["bq"]
        k = jnp.einsum("bth,hkd->btkd", h, p["wk"]) + p["bk"]
        v = jnp.einsum("bth,hkd->btkd", h, p["wv"]) + p["bv"]
        cc, sc = cc.astype(xc.dtype), sc.astype(xc.dtype)
        return apply_rotary(q, cc, sc), apply_rotary(k, cc, sc), v
    return map_chunks(f, (x, cos, sin), 1, chunk)


def _out_and_mlp(c: TextConfig, p, x, o, chunk):
    """x + o W_o, then + MLP(RMSNorm(.)), in sequence chunks written over ``x`` (donated in place):
    x [B, T, H], o [B, T, N, D] -> [B, T, H]."""
    def f(xc, oc):
        xc = xc + jnp.einsum("btnd,ndh->bth", oc.astype(xc.dtype), p["wo"])
        h = rms_norm(xc, p["post_norm"], c.rms_norm_eps)
        g = jnp.einsum("bth,hf->btf", h, p["w_gate"])
        u = jnp.einsum("bth,hf->btf", h, p["w_up"])
        return xc + jnp.einsum("btf,fh->bth", jax.nn.silu(g) * u, p["w_down"])
    return map_chunks(f, (x, o), 1, chunk, out=x)


def _layer(c: TextConfig, p, x, kv, li: LayerInputs, attn_fn, layer, kv_len: int | None, chunk):
    """One decoder layer. x: [B, T, H]; kv: the cache arrays ({"k", "v", "k_scale", "v_scale"}) or
    None. The new keys / values are written at ``li.write_index`` of layer ``layer``; attention sees
    them alone (``kv_len`` None: prefill from an empty cache) or the layer's first ``kv_len`` cache
    slots. Returns (x, kv)."""
    q, k, v = _qkv(c, p, x, li.cos, li.sin, chunk)
    if kv is not None:
        kv = _write_kv(kv, layer, li.write_index, k, v)
    if kv_len is not None:
        k, v = _read_kv(kv, layer, kv_len, x.dtype)
    o = attn_fn(q, k, v, layer=layer, q_positions=li.q_positions, kv_valid=li.kv_valid, modality=li.modality)
    return _out_and_mlp(c, p, x, o, chunk), kv


def run_decoder(model: Qwen2Text, x: jax.Array, li: LayerInputs, attention: LayerAttention, *,
                cache: KVCache | None = None, kv_len: int | None = None, hidden_layers: Sequence[int] = (),
                mlp_chunk: int | None = None, unroll: bool = False):
    """Run all decoder layers and the final norm.

    x: [B, T, H] input embeddings. cache: the KV cache the new tokens' keys / values are written
    into (at ``li.write_index``), or None. ``kv_len``: attend to the first ``kv_len`` cache slots of
    each layer (decode, chunked prefill, tree verification; static) instead of only the new tokens'
    keys (prefill from an empty cache). hidden_layers: indices in HF ``output_hidden_states``
    numbering (0 = embeddings, i = output of layer i-1, L = final normed states). mlp_chunk: tokens
    per chunk of the position-wise work (norms, projections, MLP), so no [T, intermediate] buffer
    exists. A layer-uniform attention runs the layers under ``lax.scan`` (one compiled layer body;
    the cache and the residual stream are loop state updated in place), unless ``unroll``: a Python
    loop over layers with static weight slices (a decode step on an H200 takes 6.4 instead of 11.8
    ms at the 7B shape, since the scan copies each layer's weights before the matrix-vector
    products); per-layer attention functions always unroll.
    Returns (final normed hidden [B, T, H], cache with the new keys / values, hidden [len(hidden_layers), B, T, H]).
    """
    c = model.config
    L = c.num_hidden_layers
    for i in hidden_layers:
        if not 0 <= i <= L:
            raise ValueError(f"hidden_layers: expected indices in [0, {L}], got {tuple(hidden_layers)}")
    if kv_len is not None and (cache is None or not 1 <= kv_len <= cache.max_length):
        raise ValueError(f"kv_len: expected None, or 1 <= kv_len <= the cache's slots with a cache; got {kv_len}")
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
    kv = None if cache is None else {n: getattr(cache, n) for n in ("k", "v", "k_scale", "v_scale")
                                     if getattr(cache, n) is not None}
    if attention.scannable and not unroll:
        fn = attention.uniform

        def step(carry, xs):
            h, kv, buf = carry
            p, idx = xs
            h, kv = _layer(c, p, h, kv, li, fn, idx, kv_len, mlp_chunk)
            return (h, kv, capture(buf, idx + 1, h)), None

        (x, kv, buf), _ = jax.lax.scan(step, (x, kv, buf), (params, jnp.arange(L, dtype=jnp.int32)))
    else:
        for i in range(L):
            p = {n: a[i] for n, a in params.items()}
            x, kv = _layer(c, p, x, kv, li, attention.for_layer(i), i, kv_len, mlp_chunk)
            if i + 1 < L:
                buf = capture(buf, i + 1, x)
    x = rms_norm(x, model.final_norm[...], c.rms_norm_eps)
    buf = capture(buf, L, x)
    return x, (None if cache is None else dataclasses.replace(cache, **kv)), buf


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
