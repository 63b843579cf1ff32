"""`last_q_scores` in the Pallas Triton lowering: the estimation rows' scores never leave the chip as a matrix.

The estimation rows (the last L queries, or L chosen ones at original positions P_r) of each head are padded in front
to ``Lp`` rows (a power of two >= 16; padding rows, and rows whose query is not finite, get position -1 and see no
key). Two kernels walk the keys in tiles:

1. statistics, one program per (key chunk, query head, batch): an online maximum and sum of exp2 of each row's
   scaled logits over its chunk's tiles of ``stats_block`` keys -> ``[B, N, C, Lp]`` partial maxima and sums,
   merged in XLA into each row's base-2 log-sum-exp (``+inf`` for a row that sees no key);
2. scores, one program per (lane, query head, batch): for every ``lanes``-th round of ``round_tiles`` tiles of
   ``block_k`` keys it recomputes the logits, turns them into probabilities ``exp2(s - lse)``, stores their column
   sums (the vertical scores) and sums them along diagonals: row r of the round's u-th ``[Lp, block_k]`` tile is
   stored ``P_max - P_r + u block_k`` places to the right in the program's own ``[Lp, (round_tiles + 1) block_k]``
   scratch (global memory, small enough to stay in L2), so every diagonal becomes a column (global column c + P_max
   - P_r holds offset d = P_r - c = P_max - column); after a barrier the program reads the scratch back and sums its
   columns into the round's ``(round_tiles + 1) block_k`` partial diagonal sums. Neighbouring rounds' partials
   overlap by ``block_k`` columns and are folded in XLA. The rows' positions must therefore span at most
   ``block_k`` (`rows_fit`): the last L rows always do (L - 1 <= block_k). Rounds of several tiles pay the two
   barriers and the scratch's round trip once per round (`ROUND_TILES`: one, the fastest measured).

So the float32 ``[L, S]`` probabilities of a head are never written out: HBM traffic is two reads of k plus the
``[B, N, S]`` outputs, against the reference's matrix written once and read by each of its reductions. Masking,
normalisation and non-finite rules are the reference's (`pallas_kernels.last_q_scores.api`).
"""

from __future__ import annotations

import functools
import math

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
# tiles the scores kernel stores into its scratch between two barriers (one read-back of the round's diagonals). More
# were slower on an H100 (2026-12-07, same shapes, `last-q-scores-rounds_*`): 1 / 2 / 4 tiles 1.64 / 2.04 / 3.51 ms at
# 128k and 12.3 / 16.1 / 27.8 ms at 1M (Triton's pipeliner stages every tile's keys in shared memory: 8 tiles asked
# for 288 KiB), so a round is one tile.
ROUND_TILES = 1
# program order of both kernels: query heads fastest (a group's heads share key tiles through L2) or not
HEADS_FASTEST = False


def _seen(q_pos, k_pos, kv_len: int, valid_ref, start, block: int):
    """[Lp, block] bool: the key is real, valid and at or before the row (position -1: the row sees nothing)."""
    seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_len)
    if valid_ref is not None:
        seen = seen & (valid_ref[pl.ds(start, block)] != 0)[None, :]
    return seen


def _stats_kernel(q_ref, k_ref, pos_ref, *refs, scale: float, block: int, tiles_per_chunk: int, num_tiles: int,
                  kv_len: int, has_valid: bool, lane_axis: int):
    valid_ref = refs[0] if has_valid else None
    m_ref, l_ref = refs[-2:]
    q = q_ref[...]  # [Lp, Dp]
    lp = q.shape[0]
    q_pos = pos_ref[...]
    iota_k = lax.broadcasted_iota(jnp.int32, (block,), 0)
    first = pl.program_id(lane_axis) * tiles_per_chunk

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


def _scores_kernel(q_ref, k_ref, pos_ref, shift_ref, lse_ref, *refs, scale: float, block: int, round_tiles: int,
                   lanes: int, num_rounds: int, kv_len: int, last_q: int, has_valid: bool, barrier: bool,
                   lane_axis: int):
    valid_ref = refs[0] if has_valid else None
    vert_ref, diag_ref, scratch_ref = refs[-3:]
    q = q_ref[...]  # [Lp, Dp]
    lp = q.shape[0]
    lse = lse_ref[...]  # [Lp] base 2; +inf: the row sees nothing
    q_pos = pos_ref[...]
    shift = shift_ref[...]  # [Lp] in [0, block]: P_max - P_r
    span = round_tiles * block  # keys of one round
    iota_k = lax.broadcasted_iota(jnp.int32, (block,), 0)
    row = lax.broadcasted_iota(jnp.int32, (lp, block), 0)
    shifted = lax.broadcasted_iota(jnp.int32, (lp, block), 1) + shift[:, None]  # row r moved shift_r right
    lane = pl.program_id(lane_axis)

    def body(i, carry):
        first = (lane + i * lanes) * span
        for u in range(round_tiles):  # the round's tiles, each stored shift_r + u * block places right
            start = first + u * block
            s = pltriton.dot(q, k_ref[pl.ds(start, block), :], trans_b=True) * (scale * LOG2E)
            seen = _seen(q_pos, start + iota_k, kv_len, valid_ref, start, block)
            bad = seen & ~jnp.isfinite(s)  # a finite query meets a non-finite key: its vertical score is +inf
            p = jnp.where(seen & ~bad, jnp.exp2(s - lse[:, None]), 0.0)  # [Lp, block]
            any_bad = jnp.max(bad.astype(jnp.int32), axis=0) > 0
            vert_ref[pl.ds(start, block)] = jnp.where(any_bad, jnp.inf, jnp.sum(p, axis=0) / last_q)
            scratch_ref[row, shifted + u * block] = p
        if barrier:  # every row's stores land before any thread reads the scratch back
            pltriton.debug_barrier()
        out = (lane + i * lanes) * (span + block)
        for c in range(round_tiles + 1):  # read back a block of columns at a time: the round's diagonal partials
            col_w = lax.broadcasted_iota(jnp.int32, (lp, block), 1) + (c * block) - shift[:, None]  # round column
            written = (col_w >= 0) & (col_w < span)
            part = jnp.where(written, scratch_ref[:, pl.ds(c * block, block)], 0.0)
            diag_ref[pl.ds(out + c * block, block)] = jnp.sum(part, axis=0) / last_q
        if barrier:  # and every read before the next round overwrites it
            pltriton.debug_barrier()
        return carry

    lax.fori_loop(0, (num_rounds - lane + lanes - 1) // lanes, body, 0)  # rounds lane, lane + lanes, ...


def _merged_lse(m: jax.Array, l: jax.Array) -> jax.Array:
    """Partial base-2 maxima / sums ``[B, N, C, Lp]`` -> each row's base-2 log-sum-exp ``[B, N, Lp]`` (+inf where the
    row saw no key, so its probabilities are exp2(s - inf) = 0)."""
    top = jnp.max(m, axis=2)
    top_safe = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jnp.sum(l * jnp.exp2(m - top_safe[:, :, None]), axis=2)
    return jnp.where(total > 0, top_safe + jnp.log2(jnp.where(total > 0, total, 1.0)), jnp.inf)


def _fold_diagonals(diag: jax.Array, block: int, round_tiles: int, s: int, top: jax.Array) -> jax.Array:
    """Per-round partial diagonal sums ``[B, N, rounds * (round_tiles + 1) * block]`` (round g's column u is global
    column ``g * round_tiles * block + u``) -> slash ``[B, N, S]``: global column c holds the offset d = top - c
    (``top`` int ``[B]``: P_max)."""
    b, n = diag.shape[:2]
    parts = diag.reshape(b, n, -1, round_tiles + 1, block)
    head = parts[:, :, :, 0] + jnp.pad(parts[:, :, :-1, round_tiles], ((0, 0), (0, 0), (1, 0), (0, 0)))
    cols = jnp.concatenate([head[:, :, :, None], parts[:, :, :, 1:round_tiles]], axis=3)
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
                                             "chunks", "num_warps", "round_tiles", "heads_fastest"))
def last_q_scores_triton(q: jax.Array, k: jax.Array, *, last_q: int, sm_scale: float, rows: jax.Array | None = None,
                         k_valid: jax.Array | None = None, interpret: bool = False, block_k: int | None = None,
                         stats_block: int | None = None, lanes: int | None = None, chunks: int | None = None,
                         num_warps: int = 4, round_tiles: int = ROUND_TILES,
                         heads_fastest: bool = HEADS_FASTEST) -> tuple[jax.Array, jax.Array]:
    """q ``[B,T,N,D]``, k ``[B,S,K,D]`` -> (vertical, slash) float32 ``[B,N,S]`` of the last ``last_q`` queries, or
    of chosen ``rows`` int ``[B, last_q]`` whose positions span at most ``block_k`` (`rows_fit`; wider spans give
    wrong slash sums, so the api checks first); inputs assumed validated (`pallas_kernels.last_q_scores.api`).

    block_k: keys per tile of the scores kernel (a power of two >= Lp; default `scores_block`); round_tiles: tiles
    of it per scratch round (`ROUND_TILES`); stats_block: keys per tile of the statistics kernel (default max(128,
    Lp)); lanes / chunks: programs per head of the scores / statistics kernel (default: about `PROGRAMS_PER_CORE`
    programs per core over all heads, at most one per round / chunk); heads_fastest: both grids run the query heads
    fastest, so the heads of one key / value head read the same key tiles at about the same time (from L2), else
    each head's chunks / lanes fastest (`HEADS_FASTEST`).
    """
    if not isinstance(round_tiles, int) or round_tiles < 1:
        raise ValueError(f"round_tiles: expected an int >= 1 (tiles per scratch round); received {round_tiles!r}")
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    lp = padded_rows(last_q)
    block_k = scores_block(last_q) if block_k is None else block_k
    stats_block = max(128, lp) if stats_block is None else stats_block
    d_pad = max(16, next_pow2(d))
    span = round_tiles * block_k
    s_pad = round_up(s, math.lcm(span, stats_block))
    rounds, stats_tiles = s_pad // span, s_pad // stats_block
    want = cdiv(PROGRAMS_PER_CORE * num_cores(), b * n)
    lanes = min(rounds, want) if lanes is None else min(lanes, rounds)
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

    def spec(shape, index):
        """A BlockSpec whose index map takes (lane or chunk, head, batch) whichever way the grid runs."""
        return pl.BlockSpec(shape, (lambda h, x, z: index(x, h, z)) if heads_fastest else index)

    def grid(lanes_or_chunks):
        return (n, lanes_or_chunks, b) if heads_fastest else (lanes_or_chunks, n, b)

    q_spec = spec((None, None, lp, d_pad), lambda x, h, z: (z, h, 0, 0))
    k_spec = spec((None, s_pad, None, d_pad), lambda x, h, z: (z, 0, h // groups, 0))
    row_spec = spec((None, None, lp), lambda x, h, z: (z, h, 0))
    shift_spec = spec((None, lp), lambda x, h, z: (z, 0))
    valid_specs = [] if k_valid is None else [spec((None, s_pad), lambda x, h, z: (z, 0))]
    common = dict(scale=sm_scale, kv_len=s, has_valid=k_valid is not None, lane_axis=1 if heads_fastest else 0)

    part_spec = spec((None, None, None, lp), lambda c, h, z: (z, h, c, 0))
    m, l = pl.pallas_call(
        functools.partial(_stats_kernel, block=stats_block, tiles_per_chunk=per_chunk, num_tiles=stats_tiles,
                          **common),
        grid=grid(chunks),
        in_specs=[q_spec, k_spec, row_spec] + valid_specs,
        out_specs=[part_spec, part_spec],
        out_shape=[jax.ShapeDtypeStruct((b, n, chunks, lp), jnp.float32)] * 2,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=interpret,
        name="last_q_scores_stats",
    )(q_in, k_in, pos_in, *extra)
    lse = _merged_lse(m, l)

    vert, diag, _ = pl.pallas_call(
        functools.partial(_scores_kernel, block=block_k, round_tiles=round_tiles, lanes=lanes, num_rounds=rounds,
                          last_q=last_q, barrier=not interpret, **common),
        grid=grid(lanes),
        in_specs=[q_spec, k_spec, row_spec, shift_spec, row_spec] + valid_specs,
        out_specs=[spec((None, None, s_pad), lambda x, h, z: (z, h, 0)),
                   spec((None, None, rounds * (span + block_k)), lambda x, h, z: (z, h, 0)),
                   spec((None, None, None, lp, span + block_k), lambda x, h, z: (z, h, x, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, n, s_pad), jnp.float32),
                   jax.ShapeDtypeStruct((b, n, rounds * (span + block_k)), jnp.float32),
                   jax.ShapeDtypeStruct((b, n, lanes, lp, span + block_k), jnp.float32)],  # scratch, dropped
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="last_q_scores",
    )(q_in, k_in, pos_in, shift_in, lse, *extra)
    return vert[..., :s], _fold_diagonals(diag, block_k, round_tiles, s, top)
