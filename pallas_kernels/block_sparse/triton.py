"""Block-sparse flash attention in the Pallas Triton lowering.

One program per (query block, query head, batch). It keeps its query tile in registers and
follows the layout's key-block list: contiguous key tiles are sliced (key windows of a
``kv_windows`` layout: a tile at any start, the keys outside the window masked), permuted key tiles are
gathered row by row through `kv_perm`, and single key columns are gathered into dense
``block_k``-wide tiles. The causal mask (original positions, minus the layout's causal ``gap``) is computed only for tiles
that can contain a masked pair: a tile whose largest key position is beyond the smallest
query position of the block, or that holds padding. Softmax runs in base 2 with float32
statistics; masked scores are -inf and fully masked rows end as out = 0, lse = -inf. Non-finite
inputs follow `pallas_kernels.nonfinite` (a visible NaN / inf makes the row NaN, NaN lse). The QSA
kernel's flag-based poison (per-row q / k flags made by the wrapper, `online_softmax.masked_flag_tile`)
was tried here and measured 33-34% slower on an H200 (2026-11-25: dense 32k 20.1 -> 26.7 ms), so each
tile checks its own scores. That check costs 15-20% by itself, so the wrapper runs the kernel without it
(``poison=False``) when q, k and v are all finite: one device-side `nonfinite.all_finite` read of the
inputs picks the branch (`nonfinite.checked_if_nonfinite`; both kernels are compiled). Same run on an H100 (2026-11-25,
`tools/poison_cost.py`, 28 / 4 heads, D 128, bf16, 128x64 tiles; cuDNN 12.08 / 211.9 ms): dense 32k
19.99 -> 16.98 ms, dense 128k 327.6 -> 273.2 ms, random 10% at 128k 33.3 -> 28.1 ms.

Queries permuted per head are gathered once by the wrapper (one pass over q, which also
moves heads in front), so the kernel reads them as contiguous tiles; keys are gathered in
the kernel so that GQA groups never materialise per-query-head copies of k and v.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.block_sparse.layout import BlockLayout
from pallas_kernels.nonfinite import checked_if_nonfinite, finish, poison_keys
from pallas_kernels.online_softmax import masked_tile, softmax_step, softmax_update, unmasked_tile
from pallas_kernels.tiling import LOG2E, inverse_permutation, round_up
from pallas_kernels.tiling import next_pow2 as _next_pow2
from pallas_kernels.tiling import pad_to as _pad_to


def _kernel(
    q_ref, k_ref, v_ref, blocks_ref, count_ref, *refs,
    sm_scale: float, causal: bool, block_q: int, block_k: int, num_q_blocks: int,
    kv_len: int, num_kv_blocks: int, q_offset: int, gap: int, window: int, leads: dict[str, tuple[bool, bool]],
    has_qperm: bool, has_kvperm: bool, has_cols: bool, windows: bool, poison: bool = True,
):
    refs = list(refs)
    qpos_ref = refs.pop(0) if has_qperm else None
    kvperm_ref = refs.pop(0) if has_kvperm else None
    cols_ref, ccount_ref = (refs.pop(0), refs.pop(0)) if has_cols else (None, None)
    o_ref, lse_ref = refs

    qi = num_q_blocks - 1 - pl.program_id(0)  # longest causal rows start first
    head, batch = pl.program_id(1), pl.program_id(2)

    def lead(name):
        """(batch, head, query block) index into a layout array; size-1 dims broadcast."""
        has_b, has_n, has_q = leads[name]
        return (batch if has_b else 0, head if has_n else 0, qi if has_q else 0)

    q = q_ref[...]
    d_pad = q.shape[-1]
    s_pad = num_kv_blocks * block_k
    scale = sm_scale * LOG2E
    iota_k = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    if has_qperm:
        q_pos = qpos_ref[*lead('q_perm')[:2], pl.ds(qi * block_q, block_q)] + q_offset
        q_min, q_max = jnp.min(q_pos), jnp.max(q_pos)
    else:
        q_pos = qi * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0) + q_offset
        q_min, q_max = qi * block_q + q_offset, qi * block_q + block_q - 1 + q_offset

    def masked(k_pos):
        ok = k_pos[None, :] < kv_len
        if causal:
            ok = ok & (k_pos[None, :] + gap <= q_pos[:, None])
            if window:
                ok = ok & (k_pos[None, :] + window > q_pos[:, None])
        return ok

    def block_body(j, carry):
        if windows:
            carry, prev_end = carry[:3], carry[3]
            start_raw = blocks_ref[*lead('kv_blocks'), j]
            in_range = (start_raw > -block_k) & (start_raw < kv_len)  # a window outside contributes nothing
            start = jnp.clip(start_raw, 0, s_pad - block_k)  # load a tile inside k / v, mask the rest
        else:
            blk = blocks_ref[*lead('kv_blocks'), j]
            in_range = (blk >= 0) & (blk < num_kv_blocks)  # an id out of range contributes nothing
            start = jnp.where(in_range, blk, 0) * block_k
        if has_kvperm:
            k_pos = kvperm_ref[*lead('kv_perm')[:2], pl.ds(start, block_k)]
            k = k_ref[k_pos, :]
            v = v_ref[k_pos, :]
            k_last, k_first = jnp.max(k_pos), jnp.min(k_pos)
        else:
            k_pos = start + iota_k
            k = k_ref[pl.ds(start, block_k), :]
            v = v_ref[pl.ds(start, block_k), :]
            k_last, k_first = start + block_k - 1, start
        need = ((k_last + gap > q_min) if causal else (k_last >= kv_len)) | ~in_range
        if causal and window:
            need = need | (k_first + window <= q_max)
        if windows:  # keys of the window [start_raw, start_raw + bk), from the previous window's end on
            lo = jnp.maximum(start_raw, prev_end)
            idx = start + iota_k
            in_range = in_range & (idx >= lo) & (idx < start_raw + block_k)
            need = need | (lo != start) | (start_raw != start)
        k_pos = jnp.where(in_range, k_pos, kv_len)
        s = pltriton.dot(q, k, trans_b=True) * scale  # [bq, bk] f32
        s, row_poison = lax.cond(need, lambda: masked_tile(s, masked(k_pos), poison),
                                 lambda: unmasked_tile(s, poison))
        carry = softmax_update(carry, s, row_poison, v)
        return (*carry, start_raw + block_k) if windows else carry

    carry = (
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, d_pad), jnp.float32),
    )
    if windows:
        carry = lax.fori_loop(0, count_ref[*lead('kv_block_count')], block_body, carry + (jnp.int32(-(2 ** 30)),))[:3]
    else:
        carry = lax.fori_loop(0, count_ref[*lead('kv_block_count')], block_body, carry)

    if has_cols:
        def col_body(t, carry):
            idx = cols_ref[*lead('kv_columns'), pl.ds(t * block_k, block_k)]
            valid = ((t * block_k + iota_k < ccount_ref[*lead('kv_column_count')])
                     & (idx >= 0) & (idx < kv_len))  # a column out of range contributes nothing
            idx = jnp.where(valid, idx, 0)
            k_pos = kvperm_ref[*lead('kv_perm')[:2], idx] if has_kvperm else idx
            k = k_ref[k_pos, :]
            v = v_ref[k_pos, :]
            s = pltriton.dot(q, k, trans_b=True) * scale
            return softmax_step(carry, s, v, masked(jnp.where(valid, k_pos, kv_len)), poison)

        n_tiles = (ccount_ref[*lead('kv_column_count')] + block_k - 1) // block_k
        carry = lax.fori_loop(0, n_tiles, col_body, carry)

    out, lse = finish(*carry, base2=True)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


# Shared memory the software pipeline may use for its k/v stages. Hopper has 227 KB per
# block and A100 164 KB; 160 KB leaves room for Triton's own layout conversions on both.
_STAGE_SMEM_BUDGET = 160 * 1024


def default_launch(block_q: int, block_k: int, d_pad: int, dtype) -> tuple[int, int]:
    """(num_warps, num_stages) defaults. Measured on an H200 (2026-11-21, dense causal
    layout, 128k tokens, D=128, bf16): 128x64 tiles with 4 warps and 3 stages were fastest;
    8 warps only pay for 128x128 tiles. Stages are capped so that k/v stages fit in shared
    memory (fp32 128x128 tiles get one stage)."""
    num_warps = 4 if block_q * block_k <= 128 * 64 else 8
    stage_bytes = 2 * block_k * d_pad * jnp.dtype(dtype).itemsize
    num_stages = max(1, min(3, _STAGE_SMEM_BUDGET // stage_bytes))
    return num_warps, num_stages


def _lead_flags(x: jax.Array) -> tuple[bool, bool, bool]:
    """Which of the (batch, head, query-block) dims are not broadcast (size > 1). For the
    permutations the third dim is the sequence, which the kernel slices itself."""
    return (x.shape[0] > 1, x.shape[1] > 1, x.shape[2] > 1)


def prepare_operands(q: jax.Array, k: jax.Array, v: jax.Array, layout: BlockLayout, poison: bool = True):
    """Everything the wrapper does besides the kernel: moving non-finite values onto their
    keys (`poison_keys`), padding T, S and D to the tiles, gathering permuted queries per
    head, clamping counts and permutations, padding the permutations and column lists. Returns (q_in, k_in, v_in, layout operands, static
    metadata). Benchmarks time this separately as "layout handling"."""
    b, t, n, d = q.shape
    s = k.shape[1]
    bq, bk = layout.block_q, layout.block_k
    nq, nk = layout.num_q_blocks, layout.num_kv_blocks
    t_pad, s_pad = nq * bq, nk * bk
    d_pad = max(16, _next_pow2(d))
    if poison:
        k, v = poison_keys(k, v)  # a non-finite value row becomes a NaN key (one fused pass)
    k_in = _pad_to(_pad_to(k, 3, d_pad), 1, s_pad)
    v_in = _pad_to(_pad_to(v, 3, d_pad), 1, s_pad)
    ops = {  # ids out of range are skipped in the kernel; counts are clamped here
        "kv_blocks": layout.kv_blocks,
        "kv_block_count": jnp.clip(layout.kv_block_count, 0, layout.max_blocks),
    }
    if layout.q_perm is not None:
        q_perm = jnp.clip(layout.q_perm, 0, t - 1)
        tail = jnp.broadcast_to(jnp.arange(t, t_pad, dtype=jnp.int32), q_perm.shape[:2] + (t_pad - t,))
        ops["q_perm"] = jnp.concatenate([q_perm, tail], axis=-1)
        qh = jnp.take_along_axis(
            jnp.einsum("btnd->bntd", q), jnp.broadcast_to(q_perm, (b, n, t))[..., None], axis=2
        )
        q_in = _pad_to(_pad_to(qh, 3, d_pad), 2, t_pad)  # [B, N, Tp, Dp]
    else:
        q_in = _pad_to(_pad_to(q, 3, d_pad), 1, t_pad)  # [B, Tp, N, Dp]
    if layout.kv_perm is not None:
        kv_perm = jnp.clip(layout.kv_perm, 0, s - 1)
        tail = jnp.broadcast_to(jnp.arange(s, s_pad, dtype=jnp.int32), kv_perm.shape[:2] + (s_pad - s,))
        ops["kv_perm"] = jnp.concatenate([kv_perm, tail], axis=-1)
    if layout.kv_columns is not None:
        mc = layout.max_columns
        mc_pad = max(bk, round_up(mc, bk))
        ops["kv_columns"] = _pad_to(layout.kv_columns, 3, mc_pad)
        ops["kv_column_count"] = jnp.clip(layout.kv_column_count, 0, mc)
    return q_in, k_in, v_in, ops


def launch(
    q_in: jax.Array, k_in: jax.Array, v_in: jax.Array, ops: dict[str, jax.Array],
    layout: BlockLayout, *, heads: int, sm_scale: float, causal: bool, interpret: bool,
    num_warps: int | None, num_stages: int | None, poison: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Run the kernel on prepared operands (``poison=False``: every input is known finite, no tile checks
    its scores). Returns padded (out, lse): out is
    ``[B, Tp, N, Dp]``, or ``[B, N, Tp, Dp]`` in permuted row order when the layout permutes
    queries; lse ``[B, N, Tp]`` in the kernel's row order."""
    has_qperm = "q_perm" in ops
    b = q_in.shape[0]
    n = heads
    groups = n // k_in.shape[2]
    bq, bk = layout.block_q, layout.block_k
    nq = layout.num_q_blocks
    s_pad, d_pad = k_in.shape[1], k_in.shape[3]
    t_pad = nq * bq
    if has_qperm:
        q_spec = pl.BlockSpec((None, None, bq, d_pad), lambda i, h, z: (z, h, nq - 1 - i, 0))
    else:
        q_spec = pl.BlockSpec((None, bq, None, d_pad), lambda i, h, z: (z, nq - 1 - i, h, 0))
    kv_spec = pl.BlockSpec((None, s_pad, None, d_pad), lambda i, h, z: (z, 0, h // groups, 0))
    order = ["kv_blocks", "kv_block_count", "q_perm", "kv_perm", "kv_columns", "kv_column_count"]
    names = [name for name in order if name in ops]
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale, causal=causal, block_q=bq, block_k=bk, num_q_blocks=nq,
        kv_len=layout.kv_len, num_kv_blocks=layout.num_kv_blocks, q_offset=layout.q_offset, gap=layout.gap,
        window=layout.window,
        leads={name: _lead_flags(ops[name]) for name in names},
        has_qperm=has_qperm, has_kvperm="kv_perm" in ops, has_cols="kv_columns" in ops, windows=layout.kv_windows,
        poison=poison,
    )
    if num_warps is None:
        num_warps, _ = default_launch(bq, bk, d_pad, q_in.dtype)
    if num_stages is None:
        _, num_stages = default_launch(bq, bk, d_pad, q_in.dtype)
    return pl.pallas_call(
        kernel,
        grid=(nq, n, b),
        in_specs=[q_spec, kv_spec, kv_spec] + [pl.no_block_spec] * len(names),
        out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, h, z: (z, h, nq - 1 - i))],
        out_shape=[
            jax.ShapeDtypeStruct(q_in.shape, q_in.dtype),
            jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="block_sparse_attention",
    )(q_in, k_in, v_in, *[ops[name] for name in names])


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "causal", "interpret", "num_warps", "num_stages", "poison"),
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
    poison: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """q ``[B,T,N,D]``, k/v ``[B,S,K,D]`` -> out ``[B,T,N,D]``, lse ``[B,N,T]`` f32.

    Inputs are assumed validated (see `api.block_sparse_attention`). Traced layouts can never
    make the kernel read out of bounds: ids and columns out of range contribute nothing,
    counts and permutation entries are clamped (as in the reference).

    ``poison``: None (default) runs the kernel without non-finite checks when q, k and v are all finite
    (`nonfinite.all_finite`, one read of the inputs, chosen on the device by ``lax.cond``) and with them
    otherwise; True / False force one of the two.
    """
    run = functools.partial(_attention, q, k, v, layout, sm_scale=sm_scale, causal=causal, interpret=interpret,
                            num_warps=num_warps, num_stages=num_stages)
    return checked_if_nonfinite(run, q, k, v) if poison is None else run(poison)


def _attention(q, k, v, layout, poison, *, sm_scale, causal, interpret, num_warps, num_stages):
    b, t, n, d = q.shape
    q_in, k_in, v_in, ops = prepare_operands(q, k, v, layout, poison)
    out, lse = launch(
        q_in, k_in, v_in, ops, layout, heads=n, sm_scale=sm_scale, causal=causal,
        interpret=interpret, num_warps=num_warps, num_stages=num_stages, poison=poison,
    )
    lse = lse[:, :, :t]
    if layout.q_perm is not None:
        inv = jnp.broadcast_to(inverse_permutation(jnp.clip(layout.q_perm, 0, t - 1)), (b, n, t))
        out = jnp.take_along_axis(out[:, :, :t, :d], inv[..., None], axis=2)
        out = jnp.einsum("bntd->btnd", out)
        lse = jnp.take_along_axis(lse, inv, axis=2)
    else:
        out = out[:, :t, :, :d]
    return out, lse
