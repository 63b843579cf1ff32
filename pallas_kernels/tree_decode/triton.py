"""Split-K ("flash-decoding") tree-decode attention in the Pallas Triton lowering.

A few new tokens (T <= 64, e.g. the nodes of a speculative draft tree) attend to a long
cache, so one query head alone would give a matrix product of T rows: far too little work
per key tile. The kernel instead gives each program all ``G * T`` query rows of one key
head (GQA group G = N / K, rows ordered (g, t)), cut into row tiles of ``block_r`` rows, and
splits the key axis into ``num_splits`` slices, so that B * K * row_tiles * num_splits
programs stream the cache once between them.

Grid ``(row_tiles, num_splits, B * K)``; the row tile varies fastest, so the programs that
read the same key slice run side by side and share it through L2. Each program

* reads its batch's range of key tiles ``[first, end)`` (the tiles holding valid prefix
  keys, from the wrapper) and takes slice ``split`` of it (balanced over the valid range,
  not over S, so a short prefix in a long buffer still spreads over all programs);
* per ``block_k`` tile: ``s = q k^T`` (float32, base 2), masked by the tile's
  ``prefix_valid`` entries, online-softmax update of (m, l, acc) in float32;
* writes the normalised partial ``o = acc / l`` ``[block_r, D]`` and its natural-log
  ``lse`` (``-inf`` when the slice saw no key).

Only whole tiles are read (keys ``[0, S - S % block_k)``), so the cache is never padded or
copied (except for head dims that are not powers of two). The wrapper then does the small
part in plain JAX: the ``S % block_k`` tail keys (per-key mask) and the W block keys
(per-query mask ``block_mask``) form one extra partial, and all partials merge by
log-sum-exp. A query that sees no key gives 0; non-finite inputs follow
`pallas_kernels.nonfinite` (the kernel zeroes invalid slots' values in the tile and poisons a
row whose accumulator turns non-finite, so the cache is never copied).

Measured on an H200 (2026-11-22, B=1, N=28, K=4, D=128, bf16, S=26112, tree block of T
slots; bench/tree_decode.py): T=31 0.074 ms per call (XLA 0.28, cuDNN on the prefix alone
0.42), T=49 0.089-0.092 ms (XLA 0.40, cuDNN 0.42); T=1 and S=1024 take 0.05-0.06 ms like
XLA (host dispatch bound). 128-key tiles were slower than 64 (T=49: 0.17 vs 0.10 ms).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.nonfinite import finish, poison_keys, score_poison
from pallas_kernels.online_softmax import softmax_step
from pallas_kernels.tiling import LOG2E, cdiv, next_pow2
from pallas_kernels.tiling import pad_to as _pad_to

# Shared memory the software pipeline may use for its k/v stages (as in block_sparse:
# Hopper has 227 KB per block, A100 164 KB).
_STAGE_SMEM_BUDGET = 160 * 1024


def default_block_r(rows: int) -> int:
    """Query rows per program: ``G * T`` rounded up to a power of two in [16, 128]."""
    return min(128, max(16, next_pow2(rows)))


def default_launch(block_r: int, block_k: int, d_pad: int, dtype) -> tuple[int, int]:
    """(num_warps, num_stages): 4 warps; up to 3 k/v stages within the shared-memory budget
    (bf16 64x128 tiles: 3, fp32: 2)."""
    del block_r
    stage_bytes = 2 * block_k * d_pad * jnp.dtype(dtype).itemsize
    return 4, max(1, min(3, _STAGE_SMEM_BUDGET // stage_bytes))


def default_num_splits(batch: int, kv_heads: int, row_tiles: int, full_tiles: int,
                       num_cores: int) -> int:
    """Key slices per (batch, key head, row tile): one program per SM (``num_cores``), but
    at least 2 key tiles per slice. Measured on an H200 (2026-11-22, 7B shape, bf16, S=26k,
    bench/tree_decode.py): one program per SM beat two per SM (T=31: 0.074 vs 0.087 ms per
    call, T=49: 0.092 vs 0.102 ms; four per SM was slower still); T=1 is dispatch-bound."""
    want = cdiv(num_cores, batch * kv_heads * row_tiles)
    return max(1, min(want, full_tiles // 2))


def _kernel(range_ref, pv_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
            sm_scale: float, block_k: int, num_splits: int, kv_heads: int):
    split = pl.program_id(1)
    batch = pl.program_id(2) // kv_heads
    first = range_ref[batch, 0]
    end = range_ref[batch, 1]
    per = (end - first + num_splits - 1) // num_splits
    lo = first + split * per
    hi = jnp.maximum(jnp.minimum(lo + per, end), lo)

    q = q_ref[...]  # [R, Dp]
    scale = sm_scale * LOG2E

    def body(j, carry):
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        ok = pv_ref[pl.ds(start, block_k)] != 0
        v = jnp.where(ok[:, None], v, 0)  # an invalid slot's value never meets a zero weight
        s = pltriton.dot(q, k, trans_b=True) * scale  # [R, bk] f32, base 2
        return softmax_step(carry, s, v, ok[None, :])

    rows = q.shape[0]
    carry = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, q.shape[1]), jnp.float32),
    )
    # A valid slot's non-finite value reaches acc (every row sees every valid prefix slot).
    o_ref[...], lse_ref[...] = finish(*lax.fori_loop(lo, hi, body, carry), base2=True, check_acc=True)


def prefix_tile_range(prefix_valid: jax.Array, full_tiles: int, block_k: int) -> jax.Array:
    """bool ``[B, S]`` -> int32 ``[B, 2]``: per batch the key tiles ``[first, end)`` of the
    first ``full_tiles`` whole tiles that hold a valid key (``[0, 0)`` when none does)."""
    pv = prefix_valid[:, :full_tiles * block_k]
    idx = jnp.arange(pv.shape[1], dtype=jnp.int32)
    end = cdiv_arr(jnp.max(jnp.where(pv, idx + 1, 0), axis=1), block_k)
    first = jnp.minimum(jnp.min(jnp.where(pv, idx, pv.shape[1]), axis=1) // block_k, end)
    return jnp.stack([first, end], axis=1).astype(jnp.int32)


def cdiv_arr(a: jax.Array, b: int) -> jax.Array:
    """Ceil division of an int array by a Python int."""
    return (a + b - 1) // b


def partials_triton(q, k, v, prefix_valid, *, sm_scale, block_k, block_r, num_splits,
                    interpret, num_warps, num_stages, layer: int | None = None):
    """The kernel on the first ``S // block_k`` whole key tiles.

    q ``[B,T,N,D]``, k/v ``[B,S,K,D]`` (or, with ``layer``, a stacked cache ``[L,B,S,K,D]`` of which the
    kernel reads layer ``layer`` in place), prefix_valid bool ``[B,S]`` -> (o ``[B,K,J,G,T,D]``
    float32 normalised partials, lse ``[B,K,J,G,T]`` float32 natural log, -inf for a slice
    with no visible key), J = num_splits. Requires ``S >= block_k``.
    """
    b, t, n, d = q.shape
    s, kh = k.shape[-3], k.shape[-2]
    g = n // kh
    if layer is not None and max(16, next_pow2(d)) != d:  # the head dim is padded: take the layer's copy
        k, v, layer = k[layer], v[layer], None
    full_tiles = s // block_k
    rows = g * t
    row_tiles = cdiv(rows, block_r)
    r_pad = row_tiles * block_r
    d_pad = max(16, next_pow2(d))
    q_in = jnp.einsum("btkgd->bkgtd", q.reshape(b, t, kh, g, d)).reshape(b, kh, rows, d)
    q_in = _pad_to(_pad_to(q_in, 3, d_pad), 2, r_pad)  # [B, K, Rp, Dp]
    k_in = _pad_to(k, k.ndim - 1, d_pad)  # a copy only when D is not a power of two >= 16
    v_in = _pad_to(v, v.ndim - 1, d_pad)
    pv_in = prefix_valid[:, :full_tiles * block_k].astype(jnp.int32)  # [B, S_full]
    tiles = prefix_tile_range(prefix_valid, full_tiles, block_k)  # [B, 2]
    if num_warps is None or num_stages is None:
        dw, ds = default_launch(block_r, block_k, d_pad, q.dtype)
        num_warps = dw if num_warps is None else num_warps
        num_stages = ds if num_stages is None else num_stages
    kernel = functools.partial(_kernel, sm_scale=sm_scale, block_k=block_k,
                               num_splits=num_splits, kv_heads=kh)
    q_spec = pl.BlockSpec((None, None, block_r, d_pad), lambda i, j, z: (z // kh, z % kh, i, 0))
    if layer is None:
        kv_spec = pl.BlockSpec((None, s, None, d_pad), lambda i, j, z: (z // kh, 0, z % kh, 0))
    else:  # one layer of the stacked cache, read where it lies
        kv_spec = pl.BlockSpec((None, None, s, None, d_pad), lambda i, j, z: (layer, z // kh, 0, z % kh, 0))
    pv_spec = pl.BlockSpec((None, full_tiles * block_k), lambda i, j, z: (z // kh, 0))
    o_spec = pl.BlockSpec((None, None, None, block_r, d_pad),
                          lambda i, j, z: (z // kh, z % kh, j, i, 0))
    lse_spec = pl.BlockSpec((None, None, None, block_r), lambda i, j, z: (z // kh, z % kh, j, i))
    o, lse = pl.pallas_call(
        kernel,
        grid=(row_tiles, num_splits, b * kh),
        in_specs=[pl.no_block_spec, pv_spec, q_spec, kv_spec, kv_spec],
        out_specs=[o_spec, lse_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, num_splits, r_pad, d_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, num_splits, r_pad), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="tree_decode_attention",
    )(tiles, pv_in, q_in, k_in, v_in)
    o = o[:, :, :, :rows, :d].reshape(b, kh, num_splits, g, t, d)
    lse = lse[:, :, :, :rows].reshape(b, kh, num_splits, g, t)
    return o, lse


def extra_partial(q, k, v, prefix_valid, block_start, block_mask, *, sm_scale, tail_start):
    """Plain-JAX partial over the keys the kernel does not read: the tail ``[tail_start, S)``
    (per-key mask ``prefix_valid``) and the W block keys at ``block_start`` (per-query mask
    ``block_mask [B,T,W]``).

    Returns (o ``[B,K,G,T,D]`` float32 normalised, lse ``[B,K,G,T]`` float32, -inf for a
    query that sees none of these keys).
    """
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    w = block_mask.shape[-1]
    qg = q.reshape(b, t, kh, n // kh, d)
    keys = [lax.dynamic_slice_in_dim(k, block_start, w, axis=1)]
    vals = [lax.dynamic_slice_in_dim(v, block_start, w, axis=1)]
    masks = [jnp.broadcast_to(block_mask[:, None, None], (b, kh, n // kh, t, w))]
    if tail_start < s:
        keys.append(k[:, tail_start:])
        vals.append(v[:, tail_start:])
        masks.append(jnp.broadcast_to(prefix_valid[:, None, None, None, tail_start:],
                                      (b, kh, n // kh, t, s - tail_start)))
    kx, vx = poison_keys(jnp.concatenate(keys, axis=1), jnp.concatenate(vals, axis=1))
    mask = jnp.concatenate(masks, axis=-1)
    sc = jnp.einsum("btkgd,bxkd->bkgtx", qg, kx, preferred_element_type=jnp.float32) * sm_scale
    poison = jnp.sum(score_poison(sc, mask), axis=-1)
    sc = jnp.where(mask, sc, -jnp.inf)
    m = jnp.max(sc, axis=-1)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(sc - m_safe[..., None])
    l = jnp.sum(p, axis=-1) + poison
    o = jnp.einsum("bkgtx,bxkd->bkgtd", p.astype(v.dtype), vx, preferred_element_type=jnp.float32)
    return finish(m, l, o)


def merge_partials(o_parts: jax.Array, lse_parts: jax.Array, o_extra: jax.Array,
                   lse_extra: jax.Array) -> jax.Array:
    """Log-sum-exp merge of the kernel's slices and the extra partial: o_parts
    ``[B,K,J,G,T,D]``, lse_parts ``[B,K,J,G,T]``, o_extra ``[B,K,G,T,D]``, lse_extra
    ``[B,K,G,T]`` (natural log, -inf = empty) -> ``[B,K,G,T,D]`` float32 (0 where every part
    is empty). No concatenation, so XLA reads the partials once in one fusion."""
    m = jnp.maximum(jnp.max(lse_parts, axis=2), lse_extra)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w_parts = jnp.exp(lse_parts - m_safe[:, :, None])  # 0 for empty parts, NaN for poisoned ones
    w_extra = jnp.exp(lse_extra - m_safe)
    total = jnp.sum(w_parts, axis=2) + w_extra
    # An elementwise sum, not a dot: a float32 dot could run in TF32 on the GPU. An empty
    # part contributes exactly nothing; a NaN weight propagates.
    o = (jnp.sum(jnp.where(w_parts[..., None] == 0.0, 0.0, w_parts[..., None] * o_parts), axis=2)
         + jnp.where(w_extra[..., None] == 0.0, 0.0, w_extra[..., None] * o_extra))
    return o / jnp.where(total == 0.0, 1.0, total)[..., None]


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_k", "block_r", "num_splits", "interpret", "num_warps",
                     "num_stages", "layer"),
)
def tree_decode_attention_triton(q, k, v, prefix_valid, block_start, block_mask, *,
                                 sm_scale: float, block_k: int, block_r: int, num_splits: int,
                                 interpret: bool = False, num_warps: int | None = None,
                                 num_stages: int | None = None, layer: int | None = None) -> jax.Array:
    """See `api.tree_decode_attention`; inputs are assumed validated.

    q ``[B,T,N,D]``, k/v ``[B,S,K,D]`` (with ``layer``: ``[L,B,S,K,D]``), prefix_valid bool ``[B,S]``,
    block_start int32 ``[]``, block_mask bool ``[B,T,W]`` -> ``[B,T,N,D]`` in q's dtype.
    """
    b, t, n, d = q.shape
    s = k.shape[-3]
    tail_start = (s // block_k) * block_k
    k_l, v_l = (k, v) if layer is None else (k[layer], v[layer])  # only slices of it reach XLA's fusions
    o_x, lse_x = extra_partial(q, k_l, v_l, prefix_valid, block_start, block_mask,
                               sm_scale=sm_scale, tail_start=tail_start)
    if tail_start == 0:  # S < block_k: nothing for the kernel
        o = o_x
    else:
        o_p, lse_p = partials_triton(q, k, v, prefix_valid, sm_scale=sm_scale, block_k=block_k,
                                     block_r=block_r, num_splits=num_splits, interpret=interpret,
                                     num_warps=num_warps, num_stages=num_stages, layer=layer)
        o = merge_partials(o_p, lse_p, o_x, lse_x)
    return jnp.einsum("bkgtd->btkgd", o).reshape(b, t, n, d).astype(q.dtype)
