"""FP8 (e4m3) matmuls for the decoder's prefill: weights quantized once per output channel, activations per row.

A product ``x [M, K] @ W [K, N]`` runs as ``(q(x) @ q(W)) * s_x[:, None] * s_w[None, :]`` where ``q(x) = x / s_x``
rounded to float8_e4m3fn with ``s_x = max|x_row| / 448`` (one scale per token) and ``q(W)`` likewise per output
column. Row and column scales factor out of the sum, so the only error is the rounding of each operand to 3
mantissa bits (about 3.7% relative error of a product of random matrices, against 0.17% for bf16 inputs;
`tools/fp8_matmul_bench.py`). The GEMM is one ``dot_general`` of two float8 arrays with a bf16 result, which XLA
runs as cuBLASLt's fp8 GEMM on Hopper (``__cublas$lt$matmul$f8``); the weight is stored ``[N, K]`` (K minor), the
layout that GEMM takes without a transpose. The scales multiply the bf16 result in the consumer's fusion.

`quantize_decoder` adds the quantized copies next to a `models.text_decoder.TextDecoder`'s bf16 weights (the
attention projections fused into one ``[(N + 2K) D, H]`` matrix, gate and up into one ``[2F, H]``), so the
decoder keeps its bf16 weights for decode steps, which read weights rather than compute, and for the MoE experts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.kv_cache import FP8_MAX

FP8 = jnp.float8_e4m3fn
# name of the fp8 weight -> the bf16 layer weights it holds, concatenated along the output axis
FP8_WEIGHTS = {"fp8_wqkv": ("wq", "wk", "wv"), "fp8_wo": ("wo",), "fp8_w_gate_up": ("w_gate", "w_up"),
               "fp8_w_down": ("w_down",)}
# By default calls with fewer tokens (B x T) than this keep the bf16 weights: decode steps and small trees read
# weights, they are not compute-bound
FP8_MIN_ROWS = 1024


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] -> (float8_e4m3fn [..., K], float32 scale [..., 1]) with ``x ~ q * scale`` (scale 1 for an all-zero
    row). A NaN in a row stays NaN in q and an inf makes the scale inf, so the row's products are NaN, never silently
    finite."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (x.astype(jnp.float32) / scale).astype(FP8), scale


def quantize_weight(w: jax.Array, in_dims: int, *, pad_out: int = 0, pad_in: int = 0) -> tuple[jax.Array, jax.Array]:
    """w [L, *in, *out] (the first ``in_dims`` axes after L contracted) -> (float8 [L, prod(out) + pad_out,
    prod(in) + pad_in], float32 scale [L, prod(out) + pad_out]), one scale per output column; the padding is zero
    (cuBLASLt's fp8 GEMM takes sizes that are multiples of 16)."""
    n_layers = w.shape[0]
    k = math.prod(w.shape[1:1 + in_dims])
    w2 = w.reshape(n_layers, k, -1).swapaxes(1, 2)  # [L, N, K]
    q, scale = quantize_rows(jnp.pad(w2, ((0, 0), (0, pad_out), (0, pad_in))))
    return q, scale[..., 0]


def padded(n: int, multiple: int = 16) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def _check_weight(k: int, w: jax.Array, w_scale: jax.Array) -> None:
    if w.shape[-1] != k or w.ndim != 2 or w_scale.shape != w.shape[:1]:
        raise ValueError(f"w / w_scale: expected [N, {k}] float8 and [N] scales for x [..., {k}]; got {w.shape} / "
                         f"{w_scale.shape}")


def fp8_gemm(xq: jax.Array, w: jax.Array) -> jax.Array:
    """The fp8 GEMM alone: xq float8 [M, K] times w float8 [N, K] -> bf16 [M, N] (no scales applied)."""
    return jax.lax.dot_general(xq, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


def _scaled(y: jax.Array, row_scale: jax.Array, w_scale: jax.Array, dtype, lead: tuple[int, ...],
            splits: tuple[int, ...]):
    """The GEMM result y [M, N] times its row [M, 1] and column [N] scales, in ``dtype``, shaped [*lead, n]: whole,
    or as the parts between the column offsets ``splits``, each scaled on its own (so each part's scaling fuses into
    its consumer instead of the whole product being scaled and written once more)."""
    def part(a: int, b: int) -> jax.Array:
        return (y[:, a:b].astype(jnp.float32) * row_scale * w_scale[None, a:b]).astype(dtype).reshape(*lead, b - a)
    if not splits:
        return part(0, y.shape[1])
    bounds = (0, *splits, y.shape[1])
    return tuple(part(a, b) for a, b in zip(bounds[:-1], bounds[1:]))


def fp8_matmul(x: jax.Array, w: jax.Array, w_scale: jax.Array) -> jax.Array:
    """x [..., K] (bf16 / fp16 / fp32) times a quantized weight w float8 [N, K] with scales float32 [N] ->
    [..., N] in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    _check_weight(k, w, w_scale)
    xq, xs = quantize_rows(x.reshape(-1, k))
    return _scaled(fp8_gemm(xq, w), xs, w_scale, x.dtype, lead, ())


def normed_fp8_matmul(x: jax.Array, norm_weight: jax.Array, eps: float, w: jax.Array, w_scale: jax.Array,
                      splits: tuple[int, ...] = ()):
    """``fp8_matmul(rms_norm(x, norm_weight, eps), w, w_scale)`` without the normed activations ever being written:
    with ``h = x * r * g`` (``r = rsqrt(mean(x^2) + eps)`` per row, ``g`` the norm's weight) the quantized values
    ``h / (max|h| / 448) = x * g * 448 / max|x * g|`` do not depend on r, which enters the row scale
    ``r * max|x * g| / 448`` only; both row reductions read x alone, so XLA fuses them into one pass (then one pass
    converts). x [..., K], norm_weight [K] -> [..., N] in x's dtype. The norm runs in float32 (`models.common.rms_norm`
    rounds the normed row to x's dtype before the weight). ``splits``: column offsets at which the result is returned
    as a tuple of parts, each scaled on its own (`_scaled`; q / k / v, gate / up)."""
    lead, k = x.shape[:-1], x.shape[-1]
    _check_weight(k, w, w_scale)
    xf = x.reshape(-1, k).astype(jnp.float32)
    xg = xf * norm_weight.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    ok = amax > 0
    xq = (xg * jnp.where(ok, FP8_MAX / amax, 1.0)).astype(FP8)
    scale = jnp.where(ok, r * amax / FP8_MAX, 1.0) + jnp.where(jnp.isfinite(amax), 0.0, jnp.nan)
    return _scaled(fp8_gemm(xq, w), scale, w_scale, x.dtype, lead, splits)


def _with_fp8_copies(module, copies: dict[str, list[tuple[jax.Array, jax.Array]]]):
    """A copy of the NNX ``module`` (arrays shared) with, per name, the (float8, scale) pieces of ``copies``
    concatenated along the output axis as Params ``name`` and ``name + "_scale"``."""
    graph, state = nnx.split(module)
    new = nnx.merge(graph, state)
    for name, pieces in copies.items():
        setattr(new, name, nnx.Param(jnp.concatenate([q for q, _ in pieces], axis=1)))
        setattr(new, name + "_scale", nnx.Param(jnp.concatenate([sc for _, sc in pieces], axis=1)))
    return new


def quantize_decoder(decoder, min_rows: int = FP8_MIN_ROWS):
    """A copy of ``decoder`` (a `models.text_decoder.TextDecoder`; the bf16 arrays are shared, not copied) holding fp8
    copies of its projection and dense-MLP weights (`FP8_WEIGHTS`, each with a ``_scale``), which its calls with at
    least ``min_rows`` tokens (B x T) use. A MoE decoder's experts stay in the model's dtype. For the 7B decoder the
    copies take 6.5 GB."""
    if not callable(getattr(decoder, "stacked", None)):  # models.text_decoder imports this module: no isinstance
        raise ValueError(f"decoder: expected a models.text_decoder.TextDecoder, got {type(decoder).__name__}")
    if not isinstance(min_rows, int) or isinstance(min_rows, bool) or min_rows < 1:
        raise ValueError(f"min_rows: expected an int >= 1; received {min_rows!r}")
    p = decoder.stacked()
    new = _with_fp8_copies(decoder, {
        name: [quantize_weight(p[part], 2 if parts == ("wo",) else 1) for part in parts]
        for name, parts in FP8_WEIGHTS.items() if all(part in p for part in parts)})  # MoE: no dense MLP
    new.fp8_min_rows = min_rows
    return new


def quantize_tower(tower):
    """A copy of a Qwen2.5-VL `models.qwen2_5_vl.vision.VisionTower` (bf16 arrays shared) holding fp8 copies of its
    blocks' qkv, output, gate / up and down weights (`VISION_FP8_WEIGHTS`; the MLP width padded to a multiple of 16
    with zero rows and columns), which `models.qwen2_5_vl.vision.encode_grid` uses for every patch."""
    f = tower.config.intermediate_size
    fp = padded(f) - f
    return _with_fp8_copies(tower, {
        "fp8_wqkv": [quantize_weight(tower.wqkv[...], 1)], "fp8_wproj": [quantize_weight(tower.wproj[...], 2)],
        "fp8_w_gate_up": [quantize_weight(tower.w_gate[...], 1, pad_out=fp),
                          quantize_weight(tower.w_up[...], 1, pad_out=fp)],
        "fp8_w_down": [quantize_weight(tower.w_down[...], 1, pad_in=fp)]})


VISION_FP8_WEIGHTS = ("fp8_wqkv", "fp8_wproj", "fp8_w_gate_up", "fp8_w_down")


def is_quantized(decoder) -> bool:
    """Whether ``decoder`` holds the fp8 weights of `quantize_decoder`."""
    return getattr(decoder, "fp8_wqkv", None) is not None
