"""Qwen2.5-VL vision tower: patch embedding, 2D-rotary window/full attention blocks, patch merger.

Attention never crosses a frame (full-attention blocks attend within one temporal patch, window
blocks within one ``window_units`` x ``window_units`` window of merged units), so the tower runs
frame-chunk by frame-chunk under ``lax.map``.

Token order. When every window of the frame is full (the frame's merged grid is a multiple of
``window_units`` on both sides, e.g. 448 x 448 pixels), the patches are put in window order once,
before the first block (rotary angles with them), so a window block is a reshape to
``[windows, window_patches]``; the merger's units stay contiguous in that order and the merged
features are put back in the processor's order once at the end. Otherwise (``windows="gather"``, or
partial windows at the frame's edge) tokens stay in the processor's order and every window block
gathers its patches into padded ``[windows, window_patches]`` tiles and scatters them back.

Matmuls. The programs that run the tower are compiled with `XLA_OPTIONS` (cuBLAS, not XLA's Triton GEMM
fusions). A tower quantized by `models.fp8_linear.quantize_tower` runs its blocks' matmuls as fp8 GEMMs.

Attention. ``attention="cudnn"`` runs both kinds of block through cuDNN flash attention
(``jax.nn.dot_product_attention``; bf16 / fp16 on a GPU; padded window tiles as sequence lengths);
``"xla"`` computes window tiles as an einsum + softmax and full blocks with
``models.attention.dense_attention`` (blocked online softmax on big frames); ``"auto"`` is cuDNN for
bf16 / fp16 weights on a GPU, XLA otherwise. The XLA form materialises float32 scores (a
``[frames, heads, P, P]`` tensor in full blocks), which made the tower memory-bound.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import dense_attention
from models.common import rms_norm, scaled_normal
from models.fp8_linear import VISION_FP8_WEIGHTS, fp8_matmul, fp8_swiglu_mlp, normed_fp8_matmul
from models.qwen2_5_vl.config import VisionConfig
from models.rotary import apply_rotary, vision_cos_sin
from models.vision_attention import attention_form, tile_attention


def vision_param_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    L, C, N, D, F, M = c.depth, c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size, c.merge_unit * c.hidden_size
    return {
        "patch_embed": (c.patch_dim, C),
        "norm1": (L, C), "wqkv": (L, C, 3, N, D), "bqkv": (L, 3, N, D), "wproj": (L, N, D, C), "bproj": (L, C),
        "norm2": (L, C), "w_gate": (L, C, F), "b_gate": (L, F), "w_up": (L, C, F), "b_up": (L, F),
        "w_down": (L, F, C), "b_down": (L, C),
        "merger_norm": (C,), "merger_w1": (M, M), "merger_b1": (M,), "merger_w2": (M, c.out_hidden_size),
        "merger_b2": (c.out_hidden_size,),
    }


BLOCK_PARAMS = ("norm1", "wqkv", "bqkv", "wproj", "bproj", "norm2", "w_gate", "b_gate", "w_up", "b_up", "w_down",
                "b_down")


class VisionTower(nnx.Module):
    def __init__(self, config: VisionConfig, *, dtype=jnp.float32, key: jax.Array, init_std: float = 0.02):
        self.config = config
        keys = iter(jax.random.split(key, 32))
        for name, shape in vision_param_shapes(config).items():
            if "norm" in name:
                value = jnp.ones(shape, dtype)
            else:
                value = scaled_normal(next(keys), shape, dtype, init_std)
            setattr(self, name, nnx.Param(value))


def frame_geometry(c: VisionConfig, h: int, w: int):
    """Per-patch (row, col) and window id of one frame, in the processor's patch order.

    The processor orders patches by merged unit (row-major over (h/m, w/m)) and then row-major
    inside each m x m unit. Returns int32 arrays hpos, wpos, window_id of shape [h * w].
    """
    m = c.spatial_merge_size
    if h % m or w % m:
        raise ValueError(f"grid_thw: h and w must be multiples of spatial_merge_size={m}, got h={h}, w={w}")
    uh, uw = np.meshgrid(np.arange(h // m), np.arange(w // m), indexing="ij")
    si, sj = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
    hpos = (uh[:, :, None, None] * m + si[None, None]).reshape(-1)
    wpos = (uw[:, :, None, None] * m + sj[None, None]).reshape(-1)
    ws = c.window_units
    wid = ((uh // ws) * (w // m + ws) + (uw // ws))[:, :, None, None] + 0 * si[None, None]
    return hpos.astype(np.int32), wpos.astype(np.int32), wid.reshape(-1).astype(np.int32)


def window_layout(wid: np.ndarray):
    """Padded window tiles of one frame from per-patch window ids [P].

    Returns gather [n_win, W] (patch index of each tile slot, 0 in padding), valid bool [n_win, W]
    and scatter [P] (flat tile slot of each patch), W being the largest window's patch count.
    """
    ids, inverse = np.unique(wid, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    sizes = np.bincount(inverse, minlength=len(ids))
    width = int(sizes.max())
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    slot = np.empty_like(order)
    slot[order] = np.arange(len(order)) - np.repeat(starts, sizes)
    gather = np.zeros((len(ids), width), np.int32)
    valid = np.zeros((len(ids), width), bool)
    gather[inverse, slot] = np.arange(len(wid))
    valid[inverse, slot] = True
    return gather, valid, (inverse * width + slot).astype(np.int32)


WINDOW_FORMS = ("auto", "gather")
# XLA options of every program that runs the tower (`model.vision_features`, `mmjax.parallel.vision`): with
# XLA's Triton GEMM fusions (norms and the gated activation fused into the matmuls) the MLP's matmuls ran at
# about 550 (gate, up) and 280 (down) TFLOP/s; with cuBLAS the tower took 198 instead of 253 ms for 64 frames of
# 448 x 448 (1.28x; one H100, 2026-11-25, `mmjax bench vision`). Harmless on other backends.
XLA_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def _tile_attention(qw, kw, vw, sizes, scale, attention):
    """Attention inside each window tile: q/k/v [F, n_win, W, N, D] -> [F, n_win, W, N, D]; sizes int32 [n_win]
    (the tile's valid patches, a prefix of it) or None when every tile is full."""
    f, nw = qw.shape[:2]
    flat = lambda x: x.reshape((f * nw,) + x.shape[2:])
    lengths = None if sizes is None else jnp.tile(sizes, f)
    return tile_attention(flat(qw), flat(kw), flat(vw), scale=scale, lengths=lengths,
                          attention=attention).reshape(qw.shape)


def _window_attention(q, k, v, windows, scale, attention):
    """q/k/v [F, P, N, D] -> [F, P, N, D], attention inside each window. ``windows``: the window size W when
    the tokens are in window order (every window full: a reshape to [F, P / W, W]), else (gather, sizes,
    scatter) from `window_layout` (sizes None when every tile is full)."""
    f, p = q.shape[:2]
    if isinstance(windows, int):
        tiles = lambda x: x.reshape((f, p // windows, windows) + x.shape[2:])
        return _tile_attention(tiles(q), tiles(k), tiles(v), None, scale, attention).reshape(q.shape)
    gather, sizes, scatter = windows
    o = _tile_attention(q[:, gather], k[:, gather], v[:, gather], sizes, scale, attention)
    return o.reshape((f, -1) + o.shape[3:])[:, scatter]


def _full_attention(q, k, v, scale, attention):
    f, n = q.shape[:2]
    if attention == "cudnn":
        return tile_attention(q, k, v, scale=scale, lengths=None, attention="cudnn")
    return dense_attention(q, k, v, q_positions=jnp.zeros((f, n), jnp.int32), kv_valid=jnp.ones((f, n), bool),
                           sm_scale=scale, causal=False)


def _block(c: VisionConfig, p, x, cos, sin, is_full, windows, attention):
    """x: [F, P, C]; cos/sin: [P, D]; is_full: bool scalar (frame-wide vs window attention)."""
    fp8 = "fp8_wqkv" in p  # fp8 GEMMs (`models.fp8_linear.quantize_tower`), the norms folded into them
    if fp8:
        inner = c.num_heads * c.head_dim
        parts = normed_fp8_matmul(x, p["norm1"], c.rms_norm_eps, p["fp8_wqkv"], p["fp8_wqkv_scale"],
                                  splits=(inner, 2 * inner))
        qkv = [a.reshape(x.shape[:2] + (c.num_heads, c.head_dim)) + b for a, b in zip(parts, p["bqkv"])]
    else:
        h = rms_norm(x, p["norm1"], c.rms_norm_eps)
        qkv = jnp.einsum("fpc,cind->ifpnd", h, p["wqkv"]) + p["bqkv"][:, None, None]
    q, k, v = apply_rotary(qkv[0], cos, sin), apply_rotary(qkv[1], cos, sin), qkv[2]
    scale = c.head_dim ** -0.5
    o = jax.lax.cond(is_full, lambda q, k, v: _full_attention(q, k, v, scale, attention),
                     lambda q, k, v: _window_attention(q, k, v, windows, scale, attention), q, k, v)
    if fp8:
        x = x + fp8_matmul(o.reshape(o.shape[:2] + (-1,)), p["fp8_wproj"], p["fp8_wproj_scale"]) + p["bproj"]
    else:
        x = x + jnp.einsum("fpnd,ndc->fpc", o, p["wproj"]) + p["bproj"]
    if fp8:  # the MLP width padded to fp (zero weights and biases: those channels stay 0)
        pad = (0, p["fp8_w_down"].shape[1] - c.intermediate_size)
        bias = jnp.concatenate([jnp.pad(p["b_gate"], pad), jnp.pad(p["b_up"], pad)])
        s = p["fp8_w_gate_up_scale"]  # [2]: the gate's and the up weight's per-tensor scales
        return x + fp8_swiglu_mlp(x, p["norm2"], c.rms_norm_eps, p["fp8_w_gate_up"], p["fp8_w_down"],
                                  p["fp8_w_down_scale"], s[:1], s[1:], bias) + p["b_down"]
    h = rms_norm(x, p["norm2"], c.rms_norm_eps)
    g = jnp.einsum("npc,ci->npi", h, p["w_gate"]) + p["b_gate"]
    u = jnp.einsum("npc,ci->npi", h, p["w_up"]) + p["b_up"]
    return x + jnp.einsum("npi,ic->npc", jax.nn.silu(g) * u, p["w_down"]) + p["b_down"]


def window_order(wid: np.ndarray, merge_unit: int) -> np.ndarray | None:
    """The patch permutation that puts one frame in window order (window after window, processor order
    inside a window), or None when some window is partial or a merged unit would not stay contiguous."""
    gather, valid, _ = window_layout(wid)
    return _order_of(gather, valid, merge_unit)


def _order_of(gather: np.ndarray, valid: np.ndarray, merge_unit: int) -> np.ndarray | None:
    """`window_order` from the frame's `window_layout` tiles."""
    if not valid.all():
        return None
    order = gather.reshape(-1)
    units = order.reshape(-1, merge_unit)
    if not np.array_equal(units, units[:, :1] // merge_unit * merge_unit + np.arange(merge_unit)):
        return None
    return order


# Patches a vision-tower chunk encodes together by default: the 7B tower at 262k video tokens (1M patches) on an
# H200 took 2.23 s with 32k, 2.29 s with 16k (bench/results/fpc32_*, base_* of 2026-11-26); a chunk's temporaries
# stay below 1 GB
PATCHES_PER_CHUNK = 32768


def encode_grid(model: VisionTower, pixels: jax.Array, grid: Sequence[int], *, frames_per_chunk: int | None = None,
                return_pre_merge: bool = False, attention: str = "auto", windows: str = "auto") -> jax.Array:
    """Encode one image or video.

    pixels: [t * h * w, patch_dim] flattened patches in the processor's order; grid: static (t, h, w)
    in patches. Returns merged features [t * h * w / m**2, out_hidden_size] (or, with
    ``return_pre_merge``, the last block's output [t * h * w, hidden_size]), in the processor's order.
    ``frames_per_chunk`` temporal patches are encoded together (default: about `PATCHES_PER_CHUNK` patches a
    chunk).
    ``attention``: "auto" | "xla" | "cudnn"; ``windows``: "auto" (window order once when every window is
    full) | "gather" (per-block gathers); see the module docstring. Both change speed, not the result.
    """
    c = model.config
    t, h, w = (int(g) for g in grid)
    n = h * w
    if pixels.ndim != 2 or pixels.shape != (t * n, c.patch_dim):
        raise ValueError(f"pixels: expected shape {(t * n, c.patch_dim)} for grid {(t, h, w)}, got {pixels.shape}")
    if windows not in WINDOW_FORMS:
        raise ValueError(f"windows: expected one of {WINDOW_FORMS}, got {windows!r}")
    dtype = model.patch_embed[...].dtype
    attention = attention_form(attention, dtype, c.head_dim)
    hpos, wpos, wid = frame_geometry(c, h, w)
    gather, valid, scatter = window_layout(wid)
    order = _order_of(gather, valid, c.merge_unit) if windows == "auto" else None
    if order is not None:  # tokens in window order from here on
        hpos, wpos = hpos[order], wpos[order]
        win = gather.shape[1]
    else:
        sizes = None if valid.all() else jnp.asarray(valid.sum(1), jnp.int32)
        win = (jnp.asarray(gather), sizes, jnp.asarray(scatter))
    cos, sin = vision_cos_sin(jnp.asarray(hpos), jnp.asarray(wpos), c.head_dim, c.rope_theta)
    full = jnp.asarray([i in c.fullatt_block_indexes for i in range(c.depth)])
    blocks = {name: getattr(model, name)[...] for name in BLOCK_PARAMS}
    if getattr(model, "fp8_wqkv", None) is not None:
        blocks.update({n: getattr(model, n)[...] for base in VISION_FP8_WEIGHTS for n in (base, base + "_scale")})
    f = frames_per_chunk or max(1, PATCHES_PER_CHUNK // n)
    f = min(f, t)
    chunks = -(-t // f)
    x = pixels.astype(dtype).reshape(t, n, c.patch_dim)
    if order is not None:
        x = x[:, order]
    x = jnp.pad(x, ((0, chunks * f - t), (0, 0), (0, 0))).reshape(chunks, f, n, c.patch_dim)

    def one_chunk(xc):
        hc = jnp.einsum("fpk,kc->fpc", xc, model.patch_embed[...])

        def step(hc, xs):
            p, is_full = xs
            return _block(c, p, hc, cos, sin, is_full, win, attention), None

        hc, _ = jax.lax.scan(step, hc, (blocks, full))
        if return_pre_merge:
            return hc if order is None else hc[:, np.argsort(order)]
        hm = rms_norm(hc, model.merger_norm[...], 1e-6).reshape(f, n // c.merge_unit, c.merge_unit * c.hidden_size)
        hm = jnp.einsum("fuk,kj->fuj", hm, model.merger_w1[...]) + model.merger_b1[...]
        hm = jax.nn.gelu(hm, approximate=False)
        out = jnp.einsum("fuj,jo->fuo", hm, model.merger_w2[...]) + model.merger_b2[...]
        if order is not None:  # merged units back in the processor's order
            out = out[:, np.argsort(order[::c.merge_unit] // c.merge_unit)]
        return out

    out = jax.lax.map(one_chunk, x)
    return out.reshape((chunks * f * out.shape[2], out.shape[3]))[: t * out.shape[2]]
