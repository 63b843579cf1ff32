"""Injectable attention for the decoder layers.

An *attention function* has the signature::

    attn_fn(q, k, v, *, layer, q_positions, kv_valid, modality) -> out

    q:           [B, T, N, D]   queries (rotary already applied)
    k, v:        [B, S, K, D]   keys / values, N % K == 0 (grouped-query attention)
    layer:       decoder layer index (a Python int, or a traced int32 scalar when the layers run
                 under ``lax.scan``; see ``LayerAttention``)
    q_positions: int32 [B, T]   index in the key sequence of each query (causal: key j is visible to
                 query i iff j <= q_positions[i]); prefill passes arange(T), decode the cache slot
    kv_valid:    bool [B, S]    False for padding / unwritten cache slots; dense attention also takes
                 a per-query mask bool [B, T, S] (tree attention in speculative decoding)
    modality:    int32 [B, S] or None   token type of each key position: 0 text, 1 image, 2 video
                 (queries are the last T of the S positions in prefill); None in decode
    out:         [B, T, N, D] in q.dtype

A function with the attribute ``reads_stacked_cache = True`` (`dense_attention`)
is handed, when a layer attends to its whole cache (decode), the stacked cache arrays ``[L, B, S, K, D]``
instead of the layer's slice (a Pallas kernel can read the layer in place; the slice would be copied).

``LayerAttention`` says which function each layer uses. ``resolve_attention`` builds one from
``"dense"``, ``"cudnn"``, a callable, a sequence of callables (one per layer), or any object with a
``uniform_attention() -> attn_fn`` (one function for every layer, ``layer`` traced under
``lax.scan``; how an mmjax ``SparseConfig`` plugs in) or ``layer_attention(layer_idx) -> attn_fn``
method (per layer, unrolled).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp

from models.decode_attention import SPLIT_K_MIN_SLOTS, reduce_attention, split_k_decode_attention
from pallas_kernels import nonfinite
from pallas_kernels.checks import check_sm_scale
from pallas_kernels.nonfinite import finish, poison_keys, score_poison


class AttentionFn(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, *, layer: Any, q_positions: jax.Array,
                 kv_valid: jax.Array, modality: jax.Array | None) -> jax.Array: ...


def _check_qkv(q, k, v, q_positions, kv_valid):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"q/k/v: expected q [B,T,N,D] and k == v [B,S,K,D], got {q.shape}, {k.shape}, {v.shape}")
    b, t, n, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or n % k.shape[2]:
        raise ValueError(f"k: expected [B={b}, S, K, D={d}] with N={n} divisible by K, got {k.shape}")
    if q_positions.shape != (b, t):
        raise ValueError(f"q_positions: expected shape {(b, t)}, got {q_positions.shape}")
    if kv_valid.shape not in ((b, k.shape[1]), (b, t, k.shape[1])):
        raise ValueError(f"kv_valid: expected shape {(b, k.shape[1])} or per query {(b, t, k.shape[1])}, "
                         f"got {kv_valid.shape}")


def _direct(q, k, v, q_positions, kv_valid, scale, causal):
    b, t, n, d = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, d)
    k, v = poison_keys(k, v)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = kv_valid[:, None, None, None, :] if kv_valid.ndim == 2 else kv_valid[:, None, None, :, :]
    if causal:
        mask = mask & (q_positions[:, None, None, :, None] >= jnp.arange(s_len)[None, None, None, None, :])
    poison = jnp.sum(score_poison(s, mask), axis=-1, keepdims=True)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True) + poison  # NaN for a row that sees a non-finite input
    p = (p / jnp.where(l == 0, 1.0, l)).astype(v.dtype)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, n, d).astype(q.dtype)


def _blocked(q, k, v, q_positions, kv_valid, scale, causal, block_q, block_k):
    """Online-softmax attention over key blocks (flash-style, pure XLA); skips key blocks past the
    last visible position of each query block when causal."""
    b, t, n, d = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    nq, nk = -(-t // block_q), -(-s_len // block_k)
    tp, sp = nq * block_q, nk * block_k
    qg = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0))).reshape(b, nq, block_q, kh, g, d)
    qpos = jnp.pad(q_positions, ((0, 0), (0, tp - t))).reshape(b, nq, block_q)
    k, v = poison_keys(k, v)
    kp = jnp.pad(k, ((0, 0), (0, sp - s_len), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (0, sp - s_len), (0, 0), (0, 0)))
    per_query = kv_valid.ndim == 3
    if per_query:  # [B, T, S] -> [nq, B, bq, sp]
        valid = jnp.pad(kv_valid, ((0, 0), (0, tp - t), (0, sp - s_len))).reshape(b, nq, block_q, sp)
        valid = jnp.moveaxis(valid, 1, 0)
    else:
        valid = jnp.pad(kv_valid, ((0, 0), (0, sp - s_len)))

    def one_q_block(args):
        qc, qp, vq = args  # [B, bq, K, G, D], [B, bq], [B, bq, sp] per-query mask or None
        hi = jnp.minimum(nk, jnp.max(qp) // block_k + 1) if causal else nk

        def body(j, carry):
            m, l, acc = carry
            start = j * block_k
            kc = jax.lax.dynamic_slice_in_dim(kp, start, block_k, axis=1)
            vc = jax.lax.dynamic_slice_in_dim(vp, start, block_k, axis=1)
            if per_query:
                ok = jax.lax.dynamic_slice_in_dim(vq, start, block_k, axis=2)[:, None, None, :, :]
            else:
                ok = jax.lax.dynamic_slice_in_dim(valid, start, block_k, axis=1)[:, None, None, None, :]
            if causal:
                ok = ok & (qp[:, None, None, :, None] >= (start + jnp.arange(block_k))[None, None, None, None, :])
            s = jnp.einsum("bqkgd,bskd->bkgqs", qc, kc, preferred_element_type=jnp.float32) * scale
            poison = score_poison(s, ok)
            s = jnp.where(ok, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            l = l * alpha + jnp.sum(p + poison, axis=-1)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vc, preferred_element_type=jnp.float32)
            return m_new, l, acc * alpha[..., None] + pv

        init = (jnp.full((b, kh, g, block_q), -jnp.inf, jnp.float32), jnp.zeros((b, kh, g, block_q), jnp.float32),
                jnp.zeros((b, kh, g, block_q, d), jnp.float32))
        out, _ = finish(*jax.lax.fori_loop(0, hi, body, init))
        return jnp.einsum("bkgqd->bqkgd", out).astype(q.dtype)

    out = jax.lax.map(one_q_block, (jnp.moveaxis(qg, 1, 0), jnp.moveaxis(qpos, 1, 0),
                                    valid if per_query else None))  # [nq, B, bq, K, G, D]
    out = jnp.moveaxis(out, 0, 1).reshape(b, tp, n, d)
    return out[:, :t]


def dense_attention(q, k, v, *, layer=None, q_positions, kv_valid, modality=None, sm_scale: float | None = None,
                    causal: bool = True, block_q: int = 512, block_k: int = 1024,
                    direct_max_scores: int = 1 << 24, check_finite: bool = False,
                    decode_form: str = "auto") -> jax.Array:
    """Exact softmax attention in pure JAX (the reference every other implementation is checked against).

    Shapes as in the module docstring. Softmax statistics in float32; a fully masked row gives 0. Non-finite
    inputs follow ``pallas_kernels.nonfinite``: a row that sees a NaN / inf score or value gives NaN; masked keys
    (padding, unwritten cache slots, the future) contribute nothing whatever they hold. ``check_finite``
    raises ``NonFiniteError`` instead (a ``checkify`` error under ``jax.jit``). Small problems
    (T * S <= ``direct_max_scores``) build the score matrix at once; larger ones run an online softmax over
    ``block_k``-wide key blocks for each ``block_q`` queries. ``decode_form``: "auto" computes a decode
    step (one query per row) on CUDA over at least ``SPLIT_K_MIN_SLOTS`` cache slots with the split-K kernel,
    over fewer slots with B > 1 in the multiply-reduce form (both ``models.decode_attention``; no transposed
    copy of the cache; same results), everything else with the einsum form; "einsum" always uses the einsum
    form.
    """
    del modality
    if decode_form not in ("auto", "einsum"):
        raise ValueError(f"decode_form: expected 'auto' or 'einsum', got {decode_form!r}")
    if k.ndim == 5:
        return _dense_on_stacked(q, k, v, layer, q_positions, kv_valid, sm_scale, causal, block_q, block_k,
                                 direct_max_scores, check_finite, decode_form)
    _check_qkv(q, k, v, q_positions, kv_valid)
    scale = check_sm_scale(sm_scale, q.shape[-1])
    if check_finite:
        nonfinite.check_finite(q=q, k=k, v=v)
    if q.shape[1] * k.shape[1] <= direct_max_scores:
        one_query = decode_form == "auto" and q.shape[1] == 1 and kv_valid.ndim == 2
        cuda = None
        if _split_k_step(q, kv_valid, k.shape[1], decode_form):
            cuda = functools.partial(split_k_decode_attention, implementation="triton", interpret=False)
        elif one_query and q.shape[0] > 1:
            cuda = reduce_attention
        if cuda is not None:
            return jax.lax.platform_dependent(
                q, k, v, q_positions, kv_valid,
                default=lambda *a: _direct(*a, scale, causal),
                cuda=lambda *a: cuda(*a[:3], q_positions=a[3], kv_valid=a[4], sm_scale=scale, causal=causal))
        return _direct(q, k, v, q_positions, kv_valid, scale, causal)
    return _blocked(q, k, v, q_positions, kv_valid, scale, causal, block_q, block_k)


dense_attention.reads_stacked_cache = True


def _split_k_step(q, kv_valid, slots: int, decode_form: str) -> bool:
    """The decode steps `dense_attention` gives the split-K kernel on CUDA: one query per row with per-row masks
    over at least ``SPLIT_K_MIN_SLOTS`` cache slots (``decode_form="auto"``)."""
    return decode_form == "auto" and q.shape[1] == 1 and kv_valid.ndim == 2 and slots >= SPLIT_K_MIN_SLOTS


def _dense_on_stacked(q, k, v, layer, q_positions, kv_valid, sm_scale, causal, block_q, block_k,
                      direct_max_scores, check_finite, decode_form) -> jax.Array:
    """`dense_attention` handed the stacked cache ``[L, B, S, K, D]`` (``reads_stacked_cache``: the decoder does
    so when a layer attends to its whole cache in the compute dtype). A decode step of an unrolled decoder
    (``layer`` a Python int, one query per row, per-row masks) over at least ``SPLIT_K_MIN_SLOTS`` slots runs
    the split-K kernel on layer ``layer`` where it lies on CUDA: slicing it out first made XLA copy the
    layer's keys and values every step (one H100, 25.6k slots, 2026-11-25: 8.01 -> 7.12 ms at B=1,
    12.18 -> 8.14 at B=4, 29.83 -> 14.16 at B=16). Everything else attends to the layer's slice."""
    if k.ndim != 5 or v.shape != k.shape:
        raise ValueError(f"k/v: expected the stacked cache [L, B, S, K, D] (both the same shape), got {k.shape}, "
                         f"{v.shape}")
    if layer is None:
        raise ValueError("layer: expected the layer index with a stacked cache k/v [L, B, S, K, D], got None")
    rest = dict(sm_scale=sm_scale, causal=causal, block_q=block_q, block_k=block_k,
                direct_max_scores=direct_max_scores, check_finite=check_finite, decode_form=decode_form)

    def sliced(q, k, v, q_positions, kv_valid):
        k, v = jax.lax.dynamic_index_in_dim(k, layer, 0, False), jax.lax.dynamic_index_in_dim(v, layer, 0, False)
        return dense_attention(q, k, v, q_positions=q_positions, kv_valid=kv_valid, **rest)

    in_place = (isinstance(layer, int) and not check_finite and q.ndim == 4
                and _split_k_step(q, kv_valid, k.shape[2], decode_form))
    if not in_place:
        return sliced(q, k, v, q_positions, kv_valid)
    _check_qkv(q, k[0], v[0], q_positions, kv_valid)
    if not 0 <= layer < k.shape[0]:
        raise ValueError(f"layer: expected 0 <= layer < {k.shape[0]} (stacked cache layers), got {layer}")
    scale = check_sm_scale(sm_scale, q.shape[-1])
    return jax.lax.platform_dependent(
        q, k, v, q_positions, kv_valid,
        default=sliced,
        cuda=lambda *a: split_k_decode_attention(*a[:3], layer=layer, q_positions=a[3], kv_valid=a[4],
                                                 sm_scale=scale, causal=causal, stacked=True,
                                                 implementation="triton", interpret=False))


def cudnn_attention(q, k, v, *, layer=None, q_positions, kv_valid, modality=None,
                    sm_scale: float | None = None) -> jax.Array:
    """cuDNN flash attention via ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, bf16/fp16).

    Assumes prefill layout: queries are the first T positions (``q_positions == arange(T)``), keys
    are causal from position 0 and the valid keys of each row are a prefix (right padding).
    """
    del layer, modality, q_positions
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"q: cudnn attention needs bfloat16 or float16, got {q.dtype}")
    kv_len = jnp.sum(kv_valid, axis=-1).astype(jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, scale=sm_scale, is_causal=True, key_value_seq_lengths=kv_len,
                                        implementation="cudnn")


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """Which attention each decoder layer runs.

    ``uniform``: one function for every layer; layers may then run under ``lax.scan`` and ``layer``
    is a traced int32. ``per_layer``: ``layer_idx -> attn_fn``; layers are unrolled and ``layer`` is a
    Python int, so different layers can have differently shaped (static) sparse patterns.
    """

    uniform: Callable | None = None
    per_layer: Callable[[int], Callable] | None = None

    def __post_init__(self):
        if (self.uniform is None) == (self.per_layer is None):
            raise ValueError("LayerAttention: expected exactly one of uniform / per_layer")

    @property
    def scannable(self) -> bool:
        return self.uniform is not None

    def for_layer(self, layer: int) -> Callable:
        return self.uniform if self.uniform is not None else self.per_layer(layer)


@dataclasses.dataclass(frozen=True)
class _PerLayer:
    fns: tuple

    def __call__(self, layer: int):
        if not 0 <= layer < len(self.fns):
            raise ValueError(f"attention: got {len(self.fns)} per-layer callables, layer {layer} has none")
        return self.fns[layer]


@dataclasses.dataclass(frozen=True)
class _Same:
    fn: Callable

    def __call__(self, layer: int):
        return self.fn


def resolve_attention(spec: Any = "dense") -> LayerAttention:
    """Turn an attention spec into a ``LayerAttention``.

    "dense" / None -> ``dense_attention``; "cudnn" -> ``cudnn_attention`` (both layer-uniform, scanned);
    an object with ``uniform_attention()`` -> that function for every layer (scanned, ``layer`` traced;
    how an mmjax ``SparseConfig`` plugs in); an object with ``layer_attention(layer_idx)`` -> per layer;
    a list/tuple of callables -> per layer;
    any other callable -> called for every layer with a Python int ``layer`` (unrolled).
    """
    if isinstance(spec, LayerAttention):
        return spec
    if spec is None or (isinstance(spec, str) and spec == "dense"):
        return LayerAttention(uniform=dense_attention)
    if isinstance(spec, str) and spec == "cudnn":
        return LayerAttention(uniform=cudnn_attention)
    if isinstance(spec, str):
        raise ValueError(f"attention: expected 'dense', 'cudnn', a callable or a per-layer hook, got {spec!r}")
    uniform = getattr(spec, "uniform_attention", None)
    if callable(uniform):
        return LayerAttention(uniform=uniform())
    hook = getattr(spec, "layer_attention", None)
    if callable(hook):
        return LayerAttention(per_layer=hook)
    if isinstance(spec, (list, tuple)):
        fns = tuple(spec)
        if not all(callable(f) for f in fns):
            raise ValueError("attention: a sequence must hold one callable per layer")
        return LayerAttention(per_layer=_PerLayer(fns))
    if callable(spec):
        return LayerAttention(per_layer=_Same(spec))
    raise ValueError(f"attention: expected 'dense', 'cudnn', a callable or an object with layer_attention(), "
                     f"got {type(spec).__name__}")
