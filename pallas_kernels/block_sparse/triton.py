"""Block-sparse flash attention in the Pallas Triton lowering.

One program per (query block, query head, batch). It keeps its query tile in registers and
follows the layout's key-block list: contiguous key tiles are sliced, permuted key tiles are
gathered row by row through `kv_perm`, and single key columns are gathered into dense
``block_k``-wide tiles. The causal mask (original positions) is computed only for tiles
that can contain a masked pair: a tile whose largest key position is beyond the smallest
query position of the block, or that holds padding. Softmax runs in base 2 with float32
statistics; masked scores are -inf and fully masked rows end as out = 0, lse = -inf.

Queries permuted per head are gathered once by the wrapper (one pass over q, which also
moves heads in front), so the kernel reads them as contiguous tiles; keys are gathered in
the kernel so that GQA groups never materialise per-query-head copies of k and v.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.block_sparse.layout import BlockLayout

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _kernel(
    q_ref, k_ref, v_ref, blocks_ref, count_ref, *refs,
    sm_scale: float, causal: bool, block_q: int, block_k: int, num_q_blocks: int,
    kv_len: int, q_offset: int, lead_b: bool, lead_n: bool,
    has_qperm: bool, has_kvperm: bool, has_cols: bool,
):
    refs = list(refs)
    qpos_ref = refs.pop(0) if has_qperm else None
    kvperm_ref = refs.pop(0) if has_kvperm else None
    cols_ref, ccount_ref = (refs.pop(0), refs.pop(0)) if has_cols else (None, None)
    o_ref, lse_ref = refs

    qi = num_q_blocks - 1 - pl.program_id(0)  # longest causal rows start first
    lb = pl.program_id(2) if lead_b else 0
    ln = pl.program_id(1) if lead_n else 0

    q = q_ref[...]
    d_pad = q.shape[-1]
    scale = sm_scale * LOG2E
    iota_k = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    if has_qperm:
        q_pos = qpos_ref[lb, ln, pl.ds(qi * block_q, block_q)] + q_offset
        q_min = jnp.min(q_pos)
    else:
        q_pos = qi * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0) + q_offset
        q_min = qi * block_q + q_offset

    def update(carry, k, v, s_mask):
        m_prev, l_prev, acc = carry
        s = pltriton.dot(q, k, trans_b=True) * scale  # [bq, bk] f32
        s = s_mask(s)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l_new = l_prev * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v)
        return m_new, l_new, acc

    def masked(k_pos):
        ok = k_pos[None, :] < kv_len
        if causal:
            ok = ok & (k_pos[None, :] <= q_pos[:, None])
        return lambda s: jnp.where(ok, s, -jnp.inf)

    def block_body(j, carry):
        blk = blocks_ref[lb, ln, qi, j]
        start = blk * block_k
        if has_kvperm:
            k_pos = kvperm_ref[lb, ln, pl.ds(start, block_k)]
            k = k_ref[k_pos, :]
            v = v_ref[k_pos, :]
            k_last = jnp.max(k_pos)
        else:
            k_pos = start + iota_k
            k = k_ref[pl.ds(start, block_k), :]
            v = v_ref[pl.ds(start, block_k), :]
            k_last = start + block_k - 1
        need = (k_last > q_min) if causal else (k_last >= kv_len)
        mask_fn = masked(k_pos)
        return update(
            carry, k, v,
            lambda s: lax.cond(need, mask_fn, lambda x: x, s),
        )

    carry = (
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, d_pad), jnp.float32),
    )
    carry = lax.fori_loop(0, count_ref[lb, ln, qi], block_body, carry)

    if has_cols:
        def col_body(t, carry):
            idx = cols_ref[lb, ln, qi, pl.ds(t * block_k, block_k)]
            valid = t * block_k + iota_k < ccount_ref[lb, ln, qi]
            k_pos = kvperm_ref[lb, ln, idx] if has_kvperm else idx
            rows = jnp.where(valid, k_pos, 0)
            k = k_ref[rows, :]
            v = v_ref[rows, :]
            return update(carry, k, v, masked(jnp.where(valid, k_pos, kv_len)))

        n_tiles = (ccount_ref[lb, ln, qi] + block_k - 1) // block_k
        carry = lax.fori_loop(0, n_tiles, col_body, carry)

    m, l, acc = carry
    has_mass = l > 0.0
    l_safe = jnp.where(has_mass, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has_mass, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "causal", "interpret", "num_warps", "num_stages"),
)
def block_sparse_attention_triton(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layout: BlockLayout,
    *,
    sm_scale: float,
    causal: bool = True,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """q ``[B,T,N,D]``, k/v ``[B,S,K,D]`` -> out ``[B,T,N,D]``, lse ``[B,N,T]`` f32.

    Inputs are assumed validated (see `api.block_sparse_attention`); ids and counts are
    clamped so that traced layouts can never make the kernel read out of bounds.
    """
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    bq, bk = layout.block_q, layout.block_k
    nq, nk = layout.num_q_blocks, layout.num_kv_blocks
    t_pad, s_pad = nq * bq, nk * bk
    d_pad = max(16, _next_pow2(d))
    lead = layout.lead_shape
    lead_b, lead_n = lead[0] > 1, lead[1] > 1
    has_qperm = layout.q_perm is not None
    has_kvperm = layout.kv_perm is not None
    has_cols = layout.kv_columns is not None

    def pad_to(x, axis, size):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, size - x.shape[axis])
        return jnp.pad(x, widths) if size != x.shape[axis] else x

    k = pad_to(pad_to(k, 3, d_pad), 1, s_pad)
    v = pad_to(pad_to(v, 3, d_pad), 1, s_pad)
    mb = layout.max_blocks
    blocks = jnp.clip(layout.kv_blocks, 0, nk - 1)
    count = jnp.clip(layout.kv_block_count, 0, mb)
    operands = [blocks, count]
    specs = [pl.no_block_spec, pl.no_block_spec]
    if has_qperm:
        q_perm = jnp.clip(layout.q_perm, 0, t - 1)
        pad_ids = jnp.broadcast_to(jnp.arange(t, t_pad, dtype=jnp.int32), q_perm.shape[:2] + (t_pad - t,))
        operands.append(jnp.concatenate([q_perm, pad_ids], axis=-1))
        specs.append(pl.no_block_spec)
        qh = jnp.take_along_axis(
            jnp.einsum("btnd->bntd", q),
            jnp.broadcast_to(q_perm, (b, n, t))[..., None],
            axis=2,
        )
        q_in = pad_to(pad_to(qh, 3, d_pad), 2, t_pad)  # [B, N, Tp, Dp]
        q_spec = pl.BlockSpec((None, None, bq, d_pad), lambda i, h, z: (z, h, nq - 1 - i, 0))
        o_shape = (b, n, t_pad, d_pad)
    else:
        q_in = pad_to(pad_to(q, 3, d_pad), 1, t_pad)  # [B, Tp, N, Dp]
        q_spec = pl.BlockSpec((None, bq, None, d_pad), lambda i, h, z: (z, nq - 1 - i, h, 0))
        o_shape = (b, t_pad, n, d_pad)
    if has_kvperm:
        kv_perm = jnp.clip(layout.kv_perm, 0, s - 1)
        pad_ids = jnp.broadcast_to(jnp.arange(s, s_pad, dtype=jnp.int32), kv_perm.shape[:2] + (s_pad - s,))
        operands.append(jnp.concatenate([kv_perm, pad_ids], axis=-1))
        specs.append(pl.no_block_spec)
    if has_cols:
        mc = layout.max_columns
        mc_pad = max(bk, -(-mc // bk) * bk)
        operands.append(pad_to(jnp.clip(layout.kv_columns, 0, s - 1), 3, mc_pad))
        operands.append(jnp.clip(layout.kv_column_count, 0, mc))
        specs += [pl.no_block_spec, pl.no_block_spec]

    kv_spec = pl.BlockSpec((None, s_pad, None, d_pad), lambda i, h, z: (z, 0, h // groups, 0))
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale, causal=causal, block_q=bq, block_k=bk, num_q_blocks=nq,
        kv_len=s, q_offset=s - t, lead_b=lead_b, lead_n=lead_n,
        has_qperm=has_qperm, has_kvperm=has_kvperm, has_cols=has_cols,
    )
    if num_warps is None:
        num_warps = 4 if d_pad <= 64 else 8
    if num_stages is None:
        num_stages = 2
    out, lse = pl.pallas_call(
        kernel,
        grid=(nq, n, b),
        in_specs=[q_spec, kv_spec, kv_spec] + specs,
        out_specs=[
            q_spec,
            pl.BlockSpec((None, None, bq), lambda i, h, z: (z, h, nq - 1 - i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(o_shape, q.dtype),
            jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="block_sparse_attention",
    )(q_in, k, v, *operands)
    lse = lse[:, :, :t]
    if has_qperm:
        inv = jnp.argsort(jnp.broadcast_to(layout.q_perm, (b, n, t)), axis=-1)
        out = jnp.take_along_axis(out[:, :, :t, :d], inv[..., None], axis=2)
        out = jnp.einsum("bntd->btnd", out)
        lse = jnp.take_along_axis(lse, inv, axis=2)
    else:
        out = out[:, :t, :, :d]
    return out, lse
