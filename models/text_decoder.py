"""The shared text decoder of every port (Qwen2 / Qwen2.5-VL, Llama, Qwen3 dense and MoE).

Pre-norm layers: RMSNorm -> GQA attention (optional q/k/v and output biases, optional per-head q/k
RMSNorm as in Qwen3; rotary tables given by the caller, so M-RoPE and 1-D RoPE run on the same
layers) -> residual -> RMSNorm -> SwiGLU MLP or top-k mixture of experts -> residual. Weights of
all layers are stacked on a leading layer axis so the layers can run under ``lax.scan`` (fast
compiles) or unrolled (per-layer attention functions). Attention is injected through
``models.attention.LayerAttention``; the KV cache is ``models.kv_cache.KVCache``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.attention import LayerAttention
from models.common import context_axis_size, map_chunks, rms_norm, scaled_normal, token_split
from models.fp8_linear import FP8_WEIGHTS, fp8_matmul, fp8_swiglu_mlp, normed_fp8_matmul
from models.kv_cache import KVCache, read_kv, write_kv
from models.moe import local_experts_mlp, moe_mlp
from models.rotary import apply_rotary
from pallas_kernels.layer_matmul import layer_matmul


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """Decoder hyper-parameters; defaults are transformers' ``Qwen2_5_VLTextConfig`` defaults.

    head_dim: per-head width (None: ``hidden_size // num_attention_heads``; filled in on
    construction). qkv_bias / o_bias: biases of the q, k, v / output projections (Qwen2: q/k/v
    only; Llama's ``attention_bias``: all four). qk_norm: RMSNorm over each head's q and k before
    the rotary (Qwen3). num_experts > 0: every layer's MLP is a mixture of ``num_experts`` SwiGLU
    experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` per token (weights = the
    softmax over experts at the chosen ones, renormalised to sum 1 when ``norm_topk_prob``).
    rope_theta / mrope_section: the rotary settings of Qwen2.5-VL (callers compute the tables).
    """

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
    head_dim: int | None = None
    qkv_bias: bool = True
    o_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self):
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_attention_heads "
                                 f"{self.num_attention_heads} (and no head_dim given)")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even int >= 2, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} not divisible by num_key_value_heads "
                             f"{self.num_key_value_heads}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: expected 'silu', got {self.hidden_act!r}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts: expected an int >= 0, got {self.num_experts}")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size >= 1):
            raise ValueError(f"num_experts_per_tok / moe_intermediate_size: expected 1 <= num_experts_per_tok <= "
                             f"num_experts={self.num_experts} and moe_intermediate_size >= 1, got "
                             f"{self.num_experts_per_tok} / {self.moe_intermediate_size}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


# name -> shape (with L = layers, H = hidden, N/K = heads, D = head dim, F = intermediate, E = experts,
# M = expert intermediate); the set of names depends on the config's options
def layer_param_shapes(c: TextConfig) -> dict[str, tuple[int, ...]]:
    L, H, N, K, D, F = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                        c.head_dim, c.intermediate_size)
    bias = lambda shape: shape if c.qkv_bias else None
    shapes = {
        "input_norm": (L, H), "wq": (L, H, N, D), "bq": bias((L, N, D)), "wk": (L, H, K, D), "bk": bias((L, K, D)),
        "wv": (L, H, K, D), "bv": bias((L, K, D)), "wo": (L, N, D, H), "bo": (L, H) if c.o_bias else None,
        "q_norm": (L, D) if c.qk_norm else None, "k_norm": (L, D) if c.qk_norm else None, "post_norm": (L, H),
    }
    if c.is_moe:
        E, M = c.num_experts, c.moe_intermediate_size
        shapes.update({"router": (L, H, E), "e_gate_up": (L, E, H, 2 * M), "e_down": (L, E, M, H)})
    else:
        shapes.update({"w_gate": (L, H, F), "w_up": (L, H, F), "w_down": (L, F, H)})
    return {name: shape for name, shape in shapes.items() if shape is not None}


class TextDecoder(nnx.Module):
    """Parameters of the decoder: ``embed`` [V, H], the stacked layer weights of
    `layer_param_shapes`, ``final_norm`` [H] and ``lm_head`` [V, H] (None when tied)."""

    def __init__(self, config: TextConfig, *, dtype=jnp.float32, key: jax.Array, init_std: float = 0.02):
        self.config = config
        shapes = layer_param_shapes(config)
        keys = iter(jax.random.split(key, max(16, len(shapes) + 2)))
        normal = lambda shape: nnx.Param(scaled_normal(next(keys), shape, dtype, init_std))
        self.embed = normal((config.vocab_size, config.hidden_size))
        for name, shape in shapes.items():
            if name.endswith("norm"):
                setattr(self, name, nnx.Param(jnp.ones(shape, dtype)))
            else:
                setattr(self, name, normal(shape))
        self.final_norm = nnx.Param(jnp.ones((config.hidden_size,), dtype))
        self.lm_head = None if config.tie_word_embeddings else normal((config.vocab_size, config.hidden_size))

    def stacked(self, fp8: bool = False) -> dict[str, jax.Array]:
        """The stacked layer weights by name; with ``fp8`` also the fp8 copies of `models.fp8_linear.quantize_decoder`
        where the decoder holds them."""
        names = list(layer_param_shapes(self.config))
        if fp8:
            names += [n for base in FP8_WEIGHTS for n in (base, base + "_scale") if getattr(self, n, None) is not None]
        return {name: getattr(self, name)[...] for name in names}


def check_token_inputs(input_ids, attention_mask, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Host-side check of tokenizer outputs: input_ids integer [B, T] in [0, vocab_size), attention_mask
    [B, T] (None: all valid) -> (ids, mask bool [B, T]) as NumPy; ValueError naming the argument otherwise."""
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids: expected an integer array [B, T], got {ids.dtype} {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"input_ids: expected ids in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]")
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask: expected shape {ids.shape}, got {mask.shape}")
    return ids, mask


def embed_tokens(model: TextDecoder, input_ids: jax.Array) -> jax.Array:
    """input_ids: int [B, T] -> [B, T, H]."""
    return jnp.take(model.embed[...], input_ids, axis=0)


def lm_logits(model: TextDecoder, h: jax.Array) -> jax.Array:
    """h: [B, T, H] (final-normed) -> logits float32 [B, T, V]."""
    w = model.embed[...] if model.lm_head is None else model.lm_head[...]
    return jnp.einsum("bth,vh->btv", h, w, preferred_element_type=jnp.float32)


def last_token_logits(model: TextDecoder, h: jax.Array, mask: jax.Array) -> jax.Array:
    """Logits float32 [B, V] at each row's last valid token (h [B, T, H] final-normed, mask bool [B, T]).
    The row is picked by a masked sum over T, not a gather: with h split by token over devices a gather at a
    traced index makes XLA all-gather the whole h (14 GiB at 2M tokens of the 7B shape), a sum needs one
    all-reduce of [B, H]; exact (one term, the others exact zeros)."""
    t = mask.shape[1]
    last = t - 1 - jnp.argmax(mask[:, ::-1], axis=-1)
    pick = (jnp.arange(t)[None, :] == last[:, None])[:, :, None]
    return lm_logits(model, jnp.sum(jnp.where(pick, h, jnp.zeros((), h.dtype)), axis=1, keepdims=True))[:, 0]


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


def _qkv(c: TextConfig, p, x, cos, sin, chunk):
    """Normed projections of the new tokens with rotary applied, in sequence chunks:
    x [B, T, H] -> q [B, T, N, D], k / v [B, T, K, D]."""
    def f(xc, cc, sc):
        if "fp8_wqkv" in p:
            b, t = xc.shape[:2]
            n, kh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            qkv = normed_fp8_matmul(xc, p["input_norm"], c.rms_norm_eps, p["fp8_wqkv"], p["fp8_wqkv_scale"])
            q = qkv[..., :n * d].reshape(b, t, n, d)
            k = qkv[..., n * d:(n + kh) * d].reshape(b, t, kh, d)
            v = qkv[..., (n + kh) * d:].reshape(b, t, kh, d)
        else:
            h = rms_norm(xc, p["input_norm"], c.rms_norm_eps)
            q = jnp.einsum("bth,hnd->btnd", h, p["wq"])
            k = jnp.einsum("bth,hkd->btkd", h, p["wk"])
            v = jnp.einsum("bth,hkd->btkd", h, p["wv"])
        if c.qkv_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        if c.qk_norm:
            q, k = rms_norm(q, p["q_norm"], c.rms_norm_eps), rms_norm(k, p["k_norm"], c.rms_norm_eps)
        cc, sc = cc.astype(xc.dtype), sc.astype(xc.dtype)
        return apply_rotary(q, cc, sc), apply_rotary(k, cc, sc), v
    return map_chunks(f, (x, cos, sin), 1, chunk)


def _fp8_mlp(c: TextConfig, p, x):
    """The dense MLP with fp8 GEMMs (`models.fp8_linear.fp8_swiglu_mlp`), the post-attention norm folded into the
    first one: x [B, C, H] (not normed) -> [B, C, H]."""
    return fp8_swiglu_mlp(x, p["post_norm"], c.rms_norm_eps, p["fp8_w_gate_up"], p["fp8_w_down"], p["fp8_w_down_scale"],
                          p["fp8_w_gate_up_scale"])


def _mlp(c: TextConfig, p, h):
    """The position-wise MLP of one layer: h [B, C, H] (normed) -> [B, C, H]."""
    if c.is_moe and context_axis_size("tp") > 1:
        return _moe_expert_parallel(c, p, h)
    if c.is_moe:
        b, t, width = h.shape
        out = moe_mlp(h.reshape(b * t, width), p["router"], p["e_gate_up"], p["e_down"], top_k=c.num_experts_per_tok,
                      norm_topk_prob=c.norm_topk_prob)
        return out.reshape(b, t, width)
    g = jnp.einsum("bth,hf->btf", h, p["w_gate"])
    u = jnp.einsum("bth,hf->btf", h, p["w_up"])
    return jnp.einsum("btf,fh->bth", jax.nn.silu(g) * u, p["w_down"])


def _moe_expert_parallel(c: TextConfig, p, h):
    """The MoE MLP under a mesh in context (``jax.set_mesh``) whose "tp" axis splits the experts (each device a
    run of E / tp, `models.sharding`): every device routes its tokens over all experts, runs its own experts'
    pairs, and one all-reduce over "tp" adds the shares (float32, then h's dtype). h [B, C, H] (replicated
    over "tp"; split by token over "sp" when that axis splits the tokens) -> [B, C, H]."""
    sp = "sp" if token_split() > 1 and h.shape[1] % token_split() == 0 else None  # a decode step: tokens whole
    tokens = P(None, sp, None)

    def local(hl, router, w_gate_up, w_down):
        b, t, width = hl.shape
        first = jax.lax.axis_index("tp") * w_gate_up.shape[0]
        share = local_experts_mlp(hl.reshape(b * t, width), router, w_gate_up, w_down, top_k=c.num_experts_per_tok,
                                  norm_topk_prob=c.norm_topk_prob, first_expert=first)
        return jax.lax.psum(share, "tp").astype(hl.dtype).reshape(b, t, width)
    return jax.shard_map(local, in_specs=(tokens, P(), P("tp"), P("tp")), out_specs=tokens, check_vma=False)(
        h, p["router"], p["e_gate_up"], p["e_down"])


# Decode steps with at most this many tokens (B x T) on one GPU multiply by W_o inside the stacked weight
# (`pallas_kernels.layer_matmul`): XLA's few-row GEMM copies the layer's 24.5 MiB slice first (7B).
LAYER_MATMUL_MAX_ROWS = 16


def _wo_in_place(x: jax.Array, wo: jax.Array) -> bool:
    """The unrolled layers (static layer index) multiply by ``wo`` [L, N, D, H] in place: at most
    `LAYER_MATMUL_MAX_ROWS` tokens on one CUDA device, weights in the activations' dtype."""
    mesh = jax.sharding.get_abstract_mesh()
    return (jax.default_backend() == "gpu" and x.shape[0] * x.shape[1] <= LAYER_MATMUL_MAX_ROWS
            and wo.dtype == x.dtype and (mesh.empty or mesh.size == 1))


def _out_and_mlp(c: TextConfig, p, x, o, chunk, wo_layer=None):
    """x + o W_o, then + MLP(RMSNorm(.)), in sequence chunks written over ``x`` (donated in place):
    x [B, T, H], o [B, T, N, D] -> [B, T, H]. ``wo_layer``: (stacked wo [L, N, D, H], layer int) to
    multiply inside the stacked weight (`_wo_in_place`) instead of by ``p["wo"]``."""
    def f(xc, oc):
        if wo_layer is not None:
            w, i = wo_layer
            n_layers, heads, dim, hidden = w.shape
            rows = oc.reshape(-1, heads * dim).astype(xc.dtype)
            a = layer_matmul(rows, w.reshape(n_layers, heads * dim, hidden), i).reshape(xc.shape)
        elif "fp8_wo" in p:
            a = fp8_matmul(oc.reshape(*oc.shape[:2], -1).astype(xc.dtype), p["fp8_wo"], p["fp8_wo_scale"])
        else:
            a = jnp.einsum("btnd,ndh->bth", oc.astype(xc.dtype), p["wo"])
        xc = xc + (a + p["bo"] if c.o_bias else a)
        if "fp8_w_gate_up" in p:
            return xc + _fp8_mlp(c, p, xc)
        return xc + _mlp(c, p, rms_norm(xc, p["post_norm"], c.rms_norm_eps))
    return map_chunks(f, (x, o), 1, chunk, out=x)


def _layer(c: TextConfig, p, x, kv, li: LayerInputs, attn_fn, layer, kv_len: int | None, chunk, wo_layer=None):
    """One decoder layer. x: [B, T, H]; kv: the cache arrays ({"k", "v", "k_scale", "v_scale"}) or
    None. The new keys / values are written at ``li.write_index`` of layer ``layer``; attention sees
    them alone (``kv_len`` None: prefill from an empty cache) or the layer's first ``kv_len`` cache
    slots. ``wo_layer``: see `_out_and_mlp`. Returns (x, kv)."""
    q, k, v = _qkv(c, p, x, li.cos, li.sin, chunk)
    if kv is not None:
        kv = write_kv(kv, layer, li.write_index, k, v)
    if kv_len is not None:
        if (getattr(attn_fn, "reads_stacked_cache", False) and kv_len == kv["k"].shape[2] and "k_scale" not in kv
                and kv["k"].dtype == x.dtype):
            k, v = kv["k"], kv["v"]  # [L, B, S, K, D]: the function takes its layer where it lies
        else:
            k, v = read_kv(kv, layer, kv_len, x.dtype)
    o = attn_fn(q, k, v, layer=layer, q_positions=li.q_positions, kv_valid=li.kv_valid, modality=li.modality)
    return _out_and_mlp(c, p, x, o, chunk, wo_layer), kv


def run_decoder(model: TextDecoder, x: jax.Array, li: LayerInputs, attention: LayerAttention, *,
                cache: KVCache | None = None, kv_len: int | None = None, hidden_layers: Sequence[int] = (),
                mlp_chunk: int | None = None, unroll: bool = False):
    """Run all decoder layers and the final norm.

    x: [B, T, H] input embeddings. cache: the KV cache the new tokens' keys / values are written
    into (at ``li.write_index``), or None. ``kv_len``: attend to the first ``kv_len`` cache slots of
    each layer (decode, chunked prefill, tree verification; static) instead of only the new tokens'
    keys (prefill from an empty cache). hidden_layers: indices in HF ``output_hidden_states``
    numbering (0 = embeddings, i = output of layer i-1, L = final normed states). mlp_chunk: tokens
    per chunk of the position-wise work (norms, projections, MLP or experts), so no [T, intermediate]
    buffer exists. A layer-uniform attention runs the layers under ``lax.scan`` (one compiled layer
    body; the cache and the residual stream are loop state updated in place), unless ``unroll``: a
    Python loop over layers with static weight slices (a decode step on an H200 takes 6.4 instead of
    11.8 ms at the 7B shape, since the scan copies each layer's weights before the matrix-vector
    products); per-layer attention functions always unroll. A decoder quantized by
    `models.fp8_linear.quantize_decoder` runs its projections and dense MLP as fp8 GEMMs when the call has at least
    its ``fp8_min_rows`` tokens (B x T), its bf16 weights otherwise.
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
    params = model.stacked(fp8=x.shape[0] * x.shape[1] >= getattr(model, "fp8_min_rows", 0) > 0)
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
        in_place = _wo_in_place(x, params["wo"])
        for i in range(L):
            p = {n: a[i] for n, a in params.items() if not (in_place and n == "wo")}
            x, kv = _layer(c, p, x, kv, li, attention.for_layer(i), i, kv_len, mlp_chunk,
                           (params["wo"], i) if in_place else None)
            if i + 1 < L:
                buf = capture(buf, i + 1, x)
    x = rms_norm(x, model.final_norm[...], c.rms_norm_eps)
    buf = capture(buf, L, x)
    return x, (None if cache is None else dataclasses.replace(cache, **kv)), buf


def decode_token(model: TextDecoder, cache: KVCache, tokens: jax.Array, attention: LayerAttention,
                 layer_inputs: Callable[[jax.Array, jax.Array, jax.Array], LayerInputs]):
    """One decoding step of the decoder over its cache, shared by the ports.

    tokens: int [B]; the token is written at slot ``cache.length`` (rotary position
    ``cache.next_position``). ``layer_inputs(slots int32 [B, 1], kv_valid bool [B, S], slot)`` builds
    the port's `LayerInputs` (its rotary tables). Past the cache's end the logits are NaN, the length
    stops growing and the last slot is overwritten. Returns (logits float32 [B, V], updated cache).
    """
    b = cache.valid.shape[0]
    tokens = tokens.reshape(b, 1).astype(jnp.int32)
    s = cache.max_length
    full = cache.length >= s
    slot = jnp.minimum(cache.length, s - 1)
    x = embed_tokens(model, tokens)
    valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, jnp.ones((b, 1), bool), slot, axis=1)
    li = layer_inputs(jnp.full((b, 1), slot, jnp.int32), valid, slot)
    h, cache, _ = run_decoder(model, x, li, attention, cache=cache, kv_len=s, unroll=True)
    logits = jnp.where(full, jnp.nan, lm_logits(model, h)[:, 0])
    return logits, dataclasses.replace(cache, valid=valid, length=cache.length + (~full),
                                       next_position=cache.next_position + (~full))
