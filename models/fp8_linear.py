"""FP8 (e4m3) matmuls for prefill: weights quantized once (per output channel, MLP gates per tensor), tokens per row.

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

Both MLPs (`fp8_swiglu_mlp`: the decoder's and the vision tower's) hand the gate / up GEMM's result to one kernel
that forms ``silu(g) * u`` and quantizes it per row for the down GEMM (`pallas_kernels.swiglu_quantize`: y read
once; XLA's two fusions read it and the bf16 product, 1.41 ms against 0.48 ms per 16,384 tokens of the 7B decoder
on an H200). That kernel takes per-row scales only, so gate weights are quantized with one scale per layer (per
tensor, as common fp8 W8A8 schemes do). The decoder folds the up weight's per-channel scales into the down weight:
``u_j = s_x c_j y_j`` makes ``sum_j silu(g_j) u_j W_down[j] = sum_j silu(g_j) (s_x y_j) (c_j W_down[j])``, so
``c_j W_down[j]`` is what gets quantized (per output column, as every other weight). The tower's MLP has biases,
which that fold would divide by ``c_j`` (a near-zero up column would blow its bias up and crush the row's other
values in the row-wise quantization), so the tower quantizes up per tensor too.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.kv_cache import FP8_MAX
from pallas_kernels.swiglu_quantize import swiglu_quantize

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
    if getattr(x, "ndim", 0) < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: expected a float array [..., K]; received {type(x).__name__} "
                         f"{getattr(x, 'shape', '')} {getattr(x, 'dtype', '')}")
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (x.astype(jnp.float32) / scale).astype(FP8), scale


def quantize_weight(w: jax.Array, in_dims: int, *, pad_out: int = 0, pad_in: int = 0, per_tensor: bool = False,
                    in_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """w [L, *in, *out] (the first ``in_dims`` axes after L contracted) -> (float8 [L, prod(out) + pad_out,
    prod(in) + pad_in], float32 scale [L, prod(out) + pad_out]), one scale per output column (``per_tensor``: one
    per layer, repeated over the columns); the padding is zero (cuBLASLt's fp8 GEMM takes sizes that are multiples
    of 16). ``in_scale`` [L, prod(in)]: each input row of w multiplied by it first (float32). Layers are quantized
    one at a time (`jax.lax.map`), so the float32 temporaries are one layer's, not the stack's."""
    shape = getattr(w, "shape", None)
    if shape is None or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w: expected a float array [L, *in, *out]; received {type(w).__name__} "
                         f"{getattr(w, 'dtype', '')}")
    if not isinstance(in_dims, int) or isinstance(in_dims, bool) or not 1 <= in_dims <= len(shape) - 2:
        raise ValueError(f"in_dims: expected an int in [1, {len(shape) - 2}] for w of shape {tuple(shape)} (L, then "
                         f"at least one input and one output axis); received {in_dims!r}")
    for name, pad in (("pad_out", pad_out), ("pad_in", pad_in)):
        if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
            raise ValueError(f"{name}: expected an int >= 0; received {pad!r}")
    want = (shape[0], math.prod(shape[1:1 + in_dims]))
    if in_scale is not None and getattr(in_scale, "shape", None) != want:
        raise ValueError(f"in_scale: expected [{want[0]}, {want[1]}] (L and the input size of w {tuple(shape)}); "
                         f"received {getattr(in_scale, 'shape', None)}")
    return _quantize_weight(w, in_dims, pad_out=pad_out, pad_in=pad_in, per_tensor=bool(per_tensor),
                            in_scale=in_scale)


@functools.partial(jax.jit, static_argnames=("in_dims", "pad_out", "pad_in", "per_tensor"))
def _quantize_weight(w, in_dims, *, pad_out, pad_in, per_tensor, in_scale):
    n_layers = w.shape[0]
    k = math.prod(w.shape[1:1 + in_dims])
    w = w.reshape(n_layers, k, -1)

    def one(args):
        wl = args[0].astype(jnp.float32)
        if in_scale is not None:
            wl = wl * args[1][:, None]
        w2 = jnp.pad(wl.T, ((0, pad_out), (0, pad_in)))  # [N, K]
        if per_tensor:
            q, scale = quantize_rows(w2.reshape(1, -1))
            return q.reshape(w2.shape), jnp.broadcast_to(scale[:, 0], w2.shape[:1])
        q, scale = quantize_rows(w2)
        return q, scale[:, 0]
    return jax.lax.map(one, (w,) if in_scale is None else (w, in_scale.astype(jnp.float32)))


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
    xq, scale = quantize_normed_rows(x.reshape(-1, k), norm_weight, eps)
    return _scaled(fp8_gemm(xq, w), scale, w_scale, x.dtype, lead, splits)


def quantize_normed_rows(x: jax.Array, norm_weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """x [M, K] (not normed), norm_weight [K] -> (float8_e4m3fn [M, K], float32 [M, 1]) with ``q * scale`` the
    quantized ``rms_norm(x) * norm_weight`` (`normed_fp8_matmul` says how the norm is folded in)."""
    if getattr(x, "ndim", None) != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: expected a float array [M, K]; received {getattr(x, 'shape', type(x).__name__)} "
                         f"{getattr(x, 'dtype', '')}")
    if getattr(norm_weight, "shape", None) != x.shape[1:]:
        raise ValueError(f"norm_weight: expected [{x.shape[1]}] (K of x [M, K]); received "
                         f"{getattr(norm_weight, 'shape', None)}")
    xf = x.astype(jnp.float32)
    xg = xf * norm_weight.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    ok = amax > 0
    xq = (xg * jnp.where(ok, FP8_MAX / amax, 1.0)).astype(FP8)
    return xq, jnp.where(ok, r * amax / FP8_MAX, 1.0) + jnp.where(jnp.isfinite(amax), 0.0, jnp.nan)


def fp8_swiglu_mlp(x: jax.Array, norm_weight: jax.Array, eps: float, w_gate_up: jax.Array, w_down: jax.Array,
                   w_down_scale: jax.Array, gate_scale: jax.Array, up_scale: jax.Array | None = None,
                   bias: jax.Array | None = None) -> jax.Array:
    """``down(silu(gate(h)) * up(h))`` with ``h = rms_norm(x) * norm_weight``, all in fp8 GEMMs: x [..., H] (not
    normed), w_gate_up float8 [2F, H] (gate rows then up rows, each part quantized per tensor with scale
    ``gate_scale`` / ``up_scale`` [1]; ``up_scale`` None: the up rows' per-channel scales are folded into w_down),
    ``bias`` [2F] or None (gate then up biases, added after scaling), w_down float8 [H, F] with scales [H] ->
    [..., H] in x's dtype (without the down projection's bias). The SwiGLU and its quantization are one pass
    (`pallas_kernels.swiglu_quantize`; its pure-JAX form off a GPU, or when F is not a multiple of 16)."""
    lead, k = x.shape[:-1], x.shape[-1]
    two_f = w_gate_up.shape[0]
    if (w_gate_up.ndim != 2 or w_gate_up.shape[1] != k or two_f % 2 or w_down.shape != (k, two_f // 2)
            or w_down_scale.shape != (k,) or gate_scale.shape != (1,) or getattr(up_scale, "shape", (1,)) != (1,)
            or getattr(bias, "shape", (two_f,)) != (two_f,)):
        raise ValueError(f"w_gate_up / w_down / w_down_scale / gate_scale / up_scale / bias: expected [2F, {k}], "
                         f"[{k}, F], [{k}], [1], [1], [2F] for x [..., {k}]; got {w_gate_up.shape} / {w_down.shape} / "
                         f"{w_down_scale.shape} / {gate_scale.shape} / {getattr(up_scale, 'shape', None)} / "
                         f"{getattr(bias, 'shape', None)}")
    xq, rs = quantize_normed_rows(x.reshape(-1, k), norm_weight, eps)
    y = fp8_gemm(xq, w_gate_up)
    hq, hs = swiglu_quantize(y, rs * gate_scale, rs if up_scale is None else rs * up_scale, bias,
                             implementation=None if two_f % 32 == 0 else "reference")
    return _scaled(fp8_gemm(hq, w_down), hs, w_down_scale, x.dtype, lead, ())


def _with_fp8_copies(module, copies: dict[str, list[tuple[jax.Array, jax.Array]]]):
    """A copy of the NNX ``module`` (arrays shared) with, per name, the (float8, scale) pieces of ``copies``
    concatenated along the output axis as Params ``name`` and ``name + "_scale"``."""
    graph, state = nnx.split(module)
    new = nnx.merge(graph, state)
    for name, pieces in copies.items():
        setattr(new, name, nnx.Param(jnp.concatenate([q for q, _ in pieces], axis=1)))
        setattr(new, name + "_scale", nnx.Param(jnp.concatenate([sc for _, sc in pieces], axis=1)))
    return new


def quantize_swiglu_mlp(p: dict[str, jax.Array]) -> dict[str, list[tuple[jax.Array, jax.Array]]]:
    """The fp8 copies `fp8_swiglu_mlp` takes from stacked ``w_gate`` / ``w_up`` [L, H, F] and ``w_down`` [L, F, H]:
    ``{"fp8_w_gate_up": [(float8 [L, 2F, H], gate scale [L, 1])], "fp8_w_down": [(float8 [L, H, F], [L, H])]}``,
    gate per tensor, up per channel with those scales folded into the down weight's rows."""
    shapes = {name: getattr(p.get(name), "shape", None) for name in ("w_gate", "w_up", "w_down")}
    lhf = shapes["w_gate"]
    if lhf is None or len(lhf) != 3 or shapes["w_up"] != lhf or shapes["w_down"] != (lhf[0], lhf[2], lhf[1]):
        raise ValueError(f"p: expected w_gate / w_up [L, H, F] and w_down [L, F, H]; received {shapes}")
    gate, gate_scale = quantize_weight(p["w_gate"], 1, per_tensor=True)
    up, up_scale = quantize_weight(p["w_up"], 1)
    return {"fp8_w_gate_up": [(jnp.concatenate([gate, up], axis=1), gate_scale[:, :1])],
            "fp8_w_down": [quantize_weight(p["w_down"], 1, in_scale=up_scale)]}


def quantize_decoder(decoder, min_rows: int = FP8_MIN_ROWS):
    """A copy of ``decoder`` (a `models.text_decoder.TextDecoder`; the bf16 arrays are shared, not copied) holding fp8
    copies of its projection and dense-MLP weights (`FP8_WEIGHTS`, each with a ``_scale``; the MLP's as
    `fp8_swiglu_mlp` takes them), which its calls with at least ``min_rows`` tokens (B x T) use. A MoE decoder's
    experts stay in the model's dtype. For the 7B decoder the copies take 6.5 GB."""
    if not callable(getattr(decoder, "stacked", None)):  # models.text_decoder imports this module: no isinstance
        raise ValueError(f"decoder: expected a models.text_decoder.TextDecoder, got {type(decoder).__name__}")
    if not isinstance(min_rows, int) or isinstance(min_rows, bool) or min_rows < 1:
        raise ValueError(f"min_rows: expected an int >= 1; received {min_rows!r}")
    p = decoder.stacked()
    copies = {name: [quantize_weight(p[part], 2 if part == "wo" else 1) for part in FP8_WEIGHTS[name]]
              for name in ("fp8_wqkv", "fp8_wo")}
    if "w_gate" in p:  # MoE: no dense MLP
        copies.update(quantize_swiglu_mlp(p))
    new = _with_fp8_copies(decoder, copies)
    new.fp8_min_rows = min_rows
    return new


def quantize_tower(tower):
    """A copy of a Qwen2.5-VL `models.qwen2_5_vl.vision.VisionTower` (bf16 arrays shared) holding fp8 copies of its
    blocks' qkv, output, gate / up and down weights (`VISION_FP8_WEIGHTS`; the MLP width padded to a multiple of 16
    with zero rows and columns), which `models.qwen2_5_vl.vision.encode_grid` uses for every patch. Gate and up are
    quantized per tensor (``fp8_w_gate_up_scale`` [L, 2]: gate, up), so `fp8_swiglu_mlp` needs no per-channel
    scale besides the MLP's biases."""
    f = tower.config.intermediate_size
    fp = padded(f) - f
    gate, gate_scale = quantize_weight(tower.w_gate[...], 1, pad_out=fp, per_tensor=True)
    up, up_scale = quantize_weight(tower.w_up[...], 1, pad_out=fp, per_tensor=True)
    return _with_fp8_copies(tower, {
        "fp8_wqkv": [quantize_weight(tower.wqkv[...], 1)], "fp8_wproj": [quantize_weight(tower.wproj[...], 2)],
        "fp8_w_gate_up": [(gate, gate_scale[:, :1]), (up, up_scale[:, :1])],
        "fp8_w_down": [quantize_weight(tower.w_down[...], 1, pad_in=fp)]})


VISION_FP8_WEIGHTS = ("fp8_wqkv", "fp8_wproj", "fp8_w_gate_up", "fp8_w_down")


def is_quantized(decoder) -> bool:
    """Whether ``decoder`` holds the fp8 weights of `quantize_decoder`."""
    return getattr(decoder, "fp8_wqkv", None) is not None
