"""`last_q_scores` in the Pallas Triton lowering: the estimation rows' scores never leave the chip as a matrix.

The estimation rows (the last L queries, or L chosen ones at original positions P_r) of each head are padded in front
to ``Lp`` rows (a power of two >= 16; padding rows, and rows whose query is not finite, get position -1 and see no
key). Two kernels walk the keys in tiles:

1. statistics, one program per (key chunk, query head, batch): an online maximum and sum of exp2 of each row's
   scaled logits over its chunk's tiles of ``stats_block`` keys -> ``[B, N, C, Lp]`` partial maxima and sums,
   merged in XLA into each row's base-2 log-sum-exp (``+inf`` for a row that sees no key);
2. scores, one program per (lane, query head, batch): for every ``lanes``-th tile of ``block_k`` keys it recomputes
   the logits, turns them into probabilities ``exp2(s - lse)``, stores their column sums (the vertical scores) and
   sums them along diagonals: row r of the ``[Lp, block_k]`` tile is stored ``P_max - P_r`` places to the right in
   the program's own ``[Lp, 2 block_k]`` scratch (global memory, small enough to stay in L2), so every diagonal
   becomes a column (global column c + P_max - P_r holds offset d = P_r - c = P_max - column); after a barrier the
   program reads the scratch back and sums its columns into the tile's ``2 block_k`` partial diagonal sums.
   Neighbouring tiles' partials overlap by ``block_k`` columns and are folded in XLA. The rows' positions must
   therefore span at most ``block_k`` (`rows_fit`): the last L rows always do (L - 1 <= block_k).

So the float32 ``[L, S]`` probabilities of a head are never written out: HBM traffic is two reads of k plus the
``[B, N, S]`` outputs, against the reference's matrix written once and read by each of its reductions. Masking,
normalisation and non-finite rules are the reference's (`pallas_kernels.last_q_scores.api`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.online_softmax import max_sum_update
from pallas_kernels.platform import num_cores
from pallas_kernels.tiling import LOG2E, cdiv, next_pow2, pad_to, round_up

# programs per streaming multiprocessor each kernel's grid aims at (key chunks / lanes per head follow from it). On
# an H100 (2026-12-07, 28 / 4 heads, 64 rows) 8 took 1.62 / 12.6 ms at 128k / 1M against 1.88 / 14.8 with 4.
PROGRAMS_PER_CORE = 8


def _seen(q_pos, k_pos, kv_len: int, valid_ref, start, block: int):
    """[Lp, block] bool: the key is real, valid and at or before the row (position -1: the row sees nothing)."""
    seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_len)
    if valid_ref is not None:
        seen = seen & (valid_ref[pl.ds(start, block)] != 0)[None, :]
    return seen


def _stats_kernel(q_ref, k_ref, pos_ref, *refs, scale: float, block: int, tiles_per_chunk: int, num_tiles: int,
                  kv_len: int, has_valid: bool):
    valid_ref = refs[0] if has_valid else None
    m_ref, l_ref = refs[-2:]
    q = q_ref[...]  # [Lp, Dp]
    lp = q.shape[0]
    q_pos = pos_ref[...]
    iota_k = lax.broadcasted_iota(jnp.int32, (block,), 0)
    first = pl.program_id(0) * tiles_per_chunk

    def body(t, carry):
        m, l = carry
        start = t * block
        s = pltriton.dot(q, k_ref[pl.ds(start, block), :], trans_b=True) * (scale * LOG2E)  # [Lp, block] base 2
        seen = _seen(q_pos, start + iota_k, kv_len, valid_ref, start, block)
        s = jnp.where(seen & jnp.isfinite(s), s, -jnp.inf)  # a non-finite logit counts nothing here
        return max_sum_update(m, l, s)[:2]

    init = (jnp.full((lp,), -jnp.inf, jnp.float32), jnp.zeros((lp,), jnp.float32))
    m, l = lax.fori_loop(first, jnp.minimum(first + tiles_per_chunk, num_tiles), body, init)
    m_ref[...] = m
    l_ref[...] = l


def _scores_kernel(q_ref, k_ref, pos_ref, shift_ref, lse_ref, *refs, scale: float, block: int, lanes: int,
                   num_tiles: int, kv_len: int, last_q: int, has_valid: bool, barrier: bool):
    valid_ref = refs[0] if has_valid else None
    vert_ref, diag_ref, scratch_ref = refs[-3:]
    q = q_ref[...]  # [Lp, Dp]
    lp = q.shape[0]
    lse = lse_ref[...]  # [Lp] base 2; +inf: the row sees nothing
    q_pos = pos_ref[...]
    shift = shift_ref[...]  # [Lp] in [0, block]: P_max - P_r
    iota_k = lax.broadcasted_iota(jnp.int32, (block,), 0)
    row = lax.broadcasted_iota(jnp.int32, (lp, block), 0)
    shifted = lax.broadcasted_iota(jnp.int32, (lp, block), 1) + shift[:, None]  # row r moved shift_r right
    col_w = lax.broadcasted_iota(jnp.int32, (lp, 2 * block), 1) - shift[:, None]  # the tile column stored there
    written = (col_w >= 0) & (col_w < block)
    lane = pl.program_id(0)

    def body(i, carry):
        t = lane + i * lanes
        start = t * block
        s = pltriton.dot(q, k_ref[pl.ds(start, block), :], trans_b=True) * (scale * LOG2E)
        seen = _seen(q_pos, start + iota_k, kv_len, valid_ref, start, block)
        bad = seen & ~jnp.isfinite(s)  # a finite query meets a non-finite key: its vertical score is +inf
        p = jnp.where(seen & ~bad, jnp.exp2(s - lse[:, None]), 0.0)  # [Lp, block]
        any_bad = jnp.max(bad.astype(jnp.int32), axis=0) > 0
        vert_ref[pl.ds(start, block)] = jnp.where(any_bad, jnp.inf, jnp.sum(p, axis=0) / last_q)
        scratch_ref[row, shifted] = p
        if barrier:  # every row's store lands before any thread reads the scratch back
            pltriton.debug_barrier()
        diag_ref[pl.ds(t * 2 * block, 2 * block)] = jnp.sum(jnp.where(written, scratch_ref[...], 0.0), axis=0) / last_q
        if barrier:  # and every read before the next tile overwrites it
            pltriton.debug_barrier()
        return carry

    lax.fori_loop(0, (num_tiles - lane + lanes - 1) // lanes, body, 0)  # tiles lane, lane + lanes, ...


def _merged_lse(m: jax.Array, l: jax.Array) -> jax.Array:
    """Partial base-2 maxima / sums ``[B, N, C, Lp]`` -> each row's base-2 log-sum-exp ``[B, N, Lp]`` (+inf where the
    row saw no key, so its probabilities are exp2(s - inf) = 0)."""
    top = jnp.max(m, axis=2)
    top_safe = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jnp.sum(l * jnp.exp2(m - top_safe[:, :, None]), axis=2)
    return jnp.where(total > 0, top_safe + jnp.log2(jnp.where(total > 0, total, 1.0)), jnp.inf)


def _fold_diagonals(diag: jax.Array, block: int, s: int, top: jax.Array) -> jax.Array:
    """Per-tile partial diagonal sums ``[B, N, tiles * 2 block]`` (tile t's column u is global column t block + u)
    -> slash ``[B, N, S]``: global column c holds the offset d = top - c (``top`` int ``[B]``: P_max)."""
    b, n = diag.shape[:2]
    halves = diag.reshape(b, n, -1, 2, block)
    cols = halves[:, :, :, 0] + jnp.pad(halves[:, :, :-1, 1], ((0, 0), (0, 0), (1, 0), (0, 0)))
    col = top[:, None] - jnp.arange(s, dtype=jnp.int32)[None, :]  # [B, S]: the column of offset d
    got = jnp.take_along_axis(cols.reshape(b, n, -1), jnp.clip(col, 0, s - 1)[:, None, :], axis=-1)
    return jnp.where(col[:, None, :] >= 0, got, 0.0)


def padded_rows(last_q: int) -> int:
    """Lp: the estimation rows padded to a power of two >= 16 (the dot's smallest tile)."""
    return max(16, next_pow2(last_q))


def scores_block(last_q: int) -> int:
    """Keys per tile of the scores kernel by default, max(64, Lp): also the widest span of row positions it takes."""
    return max(64, padded_rows(last_q))


def rows_fit(rows: jax.Array, block_k: int) -> jax.Array:
    """bool scalar: chosen rows ``[B, L]`` (query indices) span at most ``block_k`` positions in every batch row, so
    the scores kernel's scratch holds their diagonals."""
    return jnp.all(jnp.max(rows, axis=1) - jnp.min(rows, axis=1) <= block_k)


@functools.partial(jax.jit, static_argnames=("last_q", "sm_scale", "interpret", "block_k", "stats_block", "lanes",
                                             "chunks", "num_warps"))
def last_q_scores_triton(q: jax.Array, k: jax.Array, *, last_q: int, sm_scale: float, rows: jax.Array | None = None,
                         k_valid: jax.Array | None = None, interpret: bool = False, block_k: int | None = None,
                         stats_block: int | None = None, lanes: int | None = None, chunks: int | None = None,
                         num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
    """q ``[B,T,N,D]``, k ``[B,S,K,D]`` -> (vertical, slash) float32 ``[B,N,S]`` of the last ``last_q`` queries, or
    of chosen ``rows`` int ``[B, last_q]`` whose positions span at most ``block_k`` (`rows_fit`; wider spans give
    wrong slash sums, so the api checks first); inputs assumed validated (`pallas_kernels.last_q_scores.api`).

    block_k: keys per tile of the scores kernel (a power of two >= Lp; default `scores_block`); stats_block: of the
    statistics kernel (default max(128, Lp)); lanes / chunks: programs per head of the scores / statistics kernel
    (default: about `PROGRAMS_PER_CORE` programs per core over all heads, at most one per tile).
    """
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    lp = padded_rows(last_q)
    block_k = scores_block(last_q) if block_k is None else block_k
    stats_block = max(128, lp) if stats_block is None else stats_block
    d_pad = max(16, next_pow2(d))
    s_pad = round_up(s, max(block_k, stats_block))
    tiles, stats_tiles = s_pad // block_k, s_pad // stats_block
    want = cdiv(PROGRAMS_PER_CORE * num_cores(), b * n)
    lanes = min(tiles, want) if lanes is None else min(lanes, tiles)
    chunks = min(stats_tiles, want) if chunks is None else min(chunks, stats_tiles)
    per_chunk = cdiv(stats_tiles, chunks)
    chunks = cdiv(stats_tiles, per_chunk)

    if rows is None:
        q_last = q[:, t - last_q:]
        pos = jnp.broadcast_to(jnp.arange(s - last_q, s, dtype=jnp.int32), (b, last_q))
    else:
        q_last = jnp.take_along_axis(q, rows[:, :, None, None].astype(jnp.int32), axis=1)
        pos = rows.astype(jnp.int32) + (s - t)
    q_last = jnp.einsum("blnd->bnld", q_last)  # [B, N, L, D]
    top = jnp.max(pos, axis=1)  # [B]: P_max
    front = ((0, 0), (0, 0), (lp - last_q, 0))  # padding rows first
    shift_in = jnp.pad(top[:, None] - pos, front[1:])  # [B, Lp]; padding rows 0
    pos_in = jnp.where(jnp.all(jnp.isfinite(q_last), axis=-1), pos[:, None, :], -1)  # [B, N, L]: -1 sees nothing
    pos_in = jnp.pad(pos_in, front, constant_values=-1)
    q_in = jnp.pad(pad_to(q_last, 3, d_pad), front + ((0, 0),))
    k_in = pad_to(pad_to(k, 3, d_pad), 1, s_pad)
    extra = [] if k_valid is None else [pad_to(k_valid.astype(jnp.int32), 1, s_pad)]

    q_spec = pl.BlockSpec((None, None, lp, d_pad), lambda x, h, z: (z, h, 0, 0))
    k_spec = pl.BlockSpec((None, s_pad, None, d_pad), lambda x, h, z: (z, 0, h // groups, 0))
    row_spec = pl.BlockSpec((None, None, lp), lambda x, h, z: (z, h, 0))
    shift_spec = pl.BlockSpec((None, lp), lambda x, h, z: (z, 0))
    valid_specs = [] if k_valid is None else [pl.BlockSpec((None, s_pad), lambda x, h, z: (z, 0))]
    common = dict(scale=sm_scale, kv_len=s, has_valid=k_valid is not None)

    part_spec = pl.BlockSpec((None, None, None, lp), lambda c, h, z: (z, h, c, 0))
    m, l = pl.pallas_call(
        functools.partial(_stats_kernel, block=stats_block, tiles_per_chunk=per_chunk, num_tiles=stats_tiles,
                          **common),
        grid=(chunks, n, b),
        in_specs=[q_spec, k_spec, row_spec] + valid_specs,
        out_specs=[part_spec, part_spec],
        out_shape=[jax.ShapeDtypeStruct((b, n, chunks, lp), jnp.float32)] * 2,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=interpret,
        name="last_q_scores_stats",
    )(q_in, k_in, pos_in, *extra)
    lse = _merged_lse(m, l)

    vert, diag, _ = pl.pallas_call(
        functools.partial(_scores_kernel, block=block_k, lanes=lanes, num_tiles=tiles, last_q=last_q,
                          barrier=not interpret, **common),
        grid=(lanes, n, b),
        in_specs=[q_spec, k_spec, row_spec, shift_spec, row_spec] + valid_specs,
        out_specs=[pl.BlockSpec((None, None, s_pad), lambda x, h, z: (z, h, 0)),
                   pl.BlockSpec((None, None, tiles * 2 * block_k), lambda x, h, z: (z, h, 0)),
                   pl.BlockSpec((None, None, None, lp, 2 * block_k), lambda x, h, z: (z, h, x, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, n, s_pad), jnp.float32),
                   jax.ShapeDtypeStruct((b, n, tiles * 2 * block_k), jnp.float32),
                   jax.ShapeDtypeStruct((b, n, lanes, lp, 2 * block_k), jnp.float32)],  # scratch, dropped
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="last_q_scores",
    )(q_in, k_in, pos_in, shift_in, lse, *extra)
    return vert[..., :s], _fold_diagonals(diag, block_k, s, top)
