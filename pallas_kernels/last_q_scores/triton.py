"""`last_q_scores` in the Pallas Triton lowering: the estimation rows' scores never leave the chip as a matrix.

The last L queries of each head are padded in front to ``Lp`` rows (a power of two >= 16), so padded row r sits at
position S - Lp + r. Two kernels walk the keys in tiles:

1. statistics, one program per (key chunk, query head, batch): an online maximum and sum of exp2 of each row's
   scaled logits over its chunk's tiles of ``stats_block`` keys -> ``[B, N, C, Lp]`` partial maxima and sums,
   merged in XLA into each row's base-2 log-sum-exp (``+inf`` for a row that sees no key);
2. scores, one program per (lane, query head, batch): for every ``lanes``-th tile of ``block_k`` keys it recomputes
   the logits, turns them into probabilities ``exp2(s - lse)``, stores their column sums (the vertical scores) and
   sums them along diagonals: row r of the ``[Lp, block_k]`` tile is stored ``Lp - 1 - r`` places to the right in
   the program's own ``[Lp, 2 block_k]`` scratch (global memory, small enough to stay in L2), so every diagonal
   becomes a column; after a barrier the program reads the scratch back and sums its columns into the tile's
   ``2 block_k`` partial diagonal sums. Neighbouring tiles' partials overlap by ``block_k`` columns and are folded
   in XLA.

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

from pallas_kernels.platform import num_cores
from pallas_kernels.tiling import LOG2E, cdiv, next_pow2, pad_to, round_up

# programs per streaming multiprocessor each kernel's grid aims at (key chunks / lanes per head follow from it)
PROGRAMS_PER_CORE = 4


def _seen(q_pos, ok, k_pos, kv_len: int, valid_ref, start, block: int):
    """[Lp, block] bool: the row's query is finite and the key is real, valid and at or before the row."""
    seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_len) & ok[:, None]
    if valid_ref is not None:
        seen = seen & (valid_ref[pl.ds(start, block)] != 0)[None, :]
    return seen


def _stats_kernel(q_ref, k_ref, ok_ref, *refs, scale: float, block: int, tiles_per_chunk: int, num_tiles: int,
                  kv_len: int, has_valid: bool):
    valid_ref = refs[0] if has_valid else None
    m_ref, l_ref = refs[-2:]
    q = q_ref[...]  # [Lp, Dp]
    lp = q.shape[0]
    ok = ok_ref[...] != 0
    q_pos = kv_len - lp + lax.broadcasted_iota(jnp.int32, (lp,), 0)
    iota_k = lax.broadcasted_iota(jnp.int32, (block,), 0)
    first = pl.program_id(0) * tiles_per_chunk

    def body(t, carry):
        m, l = carry
        start = t * block
        s = pltriton.dot(q, k_ref[pl.ds(start, block), :], trans_b=True) * (scale * LOG2E)  # [Lp, block] base 2
        seen = _seen(q_pos, ok, start + iota_k, kv_len, valid_ref, start, block)
        s = jnp.where(seen & jnp.isfinite(s), s, -jnp.inf)  # a non-finite logit counts nothing here
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        l = l * jnp.exp2(m - m_safe) + jnp.sum(jnp.exp2(s - m_safe[:, None]), axis=1)
        return m_new, l

    init = (jnp.full((lp,), -jnp.inf, jnp.float32), jnp.zeros((lp,), jnp.float32))
    m, l = lax.fori_loop(first, jnp.minimum(first + tiles_per_chunk, num_tiles), body, init)
    m_ref[...] = m
    l_ref[...] = l


def _scores_kernel(q_ref, k_ref, ok_ref, lse_ref, *refs, scale: float, block: int, lanes: int, num_tiles: int,
                   kv_len: int, last_q: int, has_valid: bool, barrier: bool):
    valid_ref = refs[0] if has_valid else None
    vert_ref, diag_ref, scratch_ref = refs[-3:]
    q = q_ref[...]  # [Lp, Dp]
    lp = q.shape[0]
    ok = ok_ref[...] != 0
    lse = lse_ref[...]  # [Lp] base 2; +inf: the row sees nothing
    q_pos = kv_len - lp + lax.broadcasted_iota(jnp.int32, (lp,), 0)
    iota_k = lax.broadcasted_iota(jnp.int32, (block,), 0)
    row = lax.broadcasted_iota(jnp.int32, (lp, block), 0)
    shifted = lax.broadcasted_iota(jnp.int32, (lp, block), 1) + (lp - 1) - row  # row r moved Lp - 1 - r right
    row_w = lax.broadcasted_iota(jnp.int32, (lp, 2 * block), 0)
    col_w = lax.broadcasted_iota(jnp.int32, (lp, 2 * block), 1) - (lp - 1) + row_w  # the tile column stored there
    written = (col_w >= 0) & (col_w < block)
    lane = pl.program_id(0)

    def body(i, carry):
        t = lane + i * lanes
        start = t * block
        s = pltriton.dot(q, k_ref[pl.ds(start, block), :], trans_b=True) * (scale * LOG2E)
        seen = _seen(q_pos, ok, start + iota_k, kv_len, valid_ref, start, block)
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


def _fold_diagonals(diag: jax.Array, block: int, s: int) -> jax.Array:
    """Per-tile partial diagonal sums ``[B, N, tiles * 2 block]`` (tile t's column u is global column t block + u)
    -> slash ``[B, N, S]``: global column c holds the offset d = S - 1 - c."""
    b, n = diag.shape[:2]
    halves = diag.reshape(b, n, -1, 2, block)
    cols = halves[:, :, :, 0] + jnp.pad(halves[:, :, :-1, 1], ((0, 0), (0, 0), (1, 0), (0, 0)))
    return cols.reshape(b, n, -1)[..., :s][..., ::-1]


@functools.partial(jax.jit, static_argnames=("last_q", "sm_scale", "interpret", "block_k", "stats_block", "lanes",
                                             "chunks", "num_warps"))
def last_q_scores_triton(q: jax.Array, k: jax.Array, *, last_q: int, sm_scale: float,
                         k_valid: jax.Array | None = None, interpret: bool = False, block_k: int | None = None,
                         stats_block: int | None = None, lanes: int | None = None, chunks: int | None = None,
                         num_warps: int = 4) -> tuple[jax.Array, jax.Array]:
    """q ``[B,T,N,D]``, k ``[B,S,K,D]`` -> (vertical, slash) float32 ``[B,N,S]`` of the last ``last_q`` queries;
    inputs assumed validated (`pallas_kernels.last_q_scores.api.last_q_scores`).

    block_k: keys per tile of the scores kernel (a power of two >= Lp; default max(64, Lp)); stats_block: of the
    statistics kernel (default max(128, Lp)); lanes / chunks: programs per head of the scores / statistics kernel
    (default: about `PROGRAMS_PER_CORE` programs per core over all heads, at most one per tile).
    """
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    lp = max(16, next_pow2(last_q))
    block_k = max(64, lp) if block_k is None else block_k
    stats_block = max(128, lp) if stats_block is None else stats_block
    d_pad = max(16, next_pow2(d))
    s_pad = round_up(s, max(block_k, stats_block))
    tiles, stats_tiles = s_pad // block_k, s_pad // stats_block
    want = cdiv(PROGRAMS_PER_CORE * num_cores(), b * n)
    lanes = min(tiles, want) if lanes is None else min(lanes, tiles)
    chunks = min(stats_tiles, want) if chunks is None else min(chunks, stats_tiles)
    per_chunk = cdiv(stats_tiles, chunks)
    chunks = cdiv(stats_tiles, per_chunk)

    q_last = jnp.einsum("blnd->bnld", q[:, t - last_q:])  # [B, N, L, D]
    ok = jnp.all(jnp.isfinite(q_last), axis=-1)  # [B, N, L]
    q_in = jnp.pad(pad_to(q_last, 3, d_pad), ((0, 0), (0, 0), (lp - last_q, 0), (0, 0)))  # real rows last
    ok_in = jnp.pad(ok, ((0, 0), (0, 0), (lp - last_q, 0))).astype(jnp.int32)
    k_in = pad_to(pad_to(k, 3, d_pad), 1, s_pad)
    extra = [] if k_valid is None else [pad_to(k_valid.astype(jnp.int32), 1, s_pad)]

    q_spec = pl.BlockSpec((None, None, lp, d_pad), lambda x, h, z: (z, h, 0, 0))
    k_spec = pl.BlockSpec((None, s_pad, None, d_pad), lambda x, h, z: (z, 0, h // groups, 0))
    row_spec = pl.BlockSpec((None, None, lp), lambda x, h, z: (z, h, 0))
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
    )(q_in, k_in, ok_in, *extra)
    lse = _merged_lse(m, l)

    vert, diag, _ = pl.pallas_call(
        functools.partial(_scores_kernel, block=block_k, lanes=lanes, num_tiles=tiles, last_q=last_q,
                          barrier=not interpret, **common),
        grid=(lanes, n, b),
        in_specs=[q_spec, k_spec, row_spec, row_spec] + valid_specs,
        out_specs=[pl.BlockSpec((None, None, s_pad), lambda x, h, z: (z, h, 0)),
                   pl.BlockSpec((None, None, tiles * 2 * block_k), lambda x, h, z: (z, h, 0)),
                   pl.BlockSpec((None, None, None, lp, 2 * block_k), lambda x, h, z: (z, h, x, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, n, s_pad), jnp.float32),
                   jax.ShapeDtypeStruct((b, n, tiles * 2 * block_k), jnp.float32),
                   jax.ShapeDtypeStruct((b, n, lanes, lp, 2 * block_k), jnp.float32)],  # scratch, dropped
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="last_q_scores",
    )(q_in, k_in, ok_in, lse, *extra)
    return vert[..., :s], _fold_diagonals(diag, block_k, s)
