"""MInference's sparse-index formats, rebuilt in JAX, so that its Triton kernels and ours can run on the same
index in `minference_side_by_side.py`.

Two formats (queries and keys at the same positions 0 .. S - 1, causal; 64-row query blocks):

* **Block index** (MInference's ``block_sparse_attention``): per 64-row query block ``m`` the ``top_k`` key
  blocks of 64 with the largest pooled score ``mean(q rows of m) . mean(k rows of the block)`` among the
  blocks ``<= m``, ids ascending. Its kernel computes the first ``min(m + 1, top_k)`` entries, so early rows
  with fewer than ``top_k`` causal blocks compute exactly their causal blocks.
* **Vertical-Slash index** (MInference's ``vertical_slash_sparse_attention``): vertical columns (ascending) and
  slash offsets ``o = query - key`` (descending). Per 64-row query block ending at ``e`` (exclusive) each
  slash ``o < e`` names the key range ``[x - 64, x)`` with ``x = max(e - o, 64)``; walking the ``x`` in
  ascending order, a range that starts more than 64 past the current range's end opens a new range, one
  that ends past the current end extends it by one 64-key tile, and every tile of every range is one
  *block offset* (a 64-key window at any start). Verticals before the last range's end that fall in no range
  are the block's *columns*, computed in 64-wide gathered tiles. This is the conversion MInference does in
  CUDA (``convert_vertical_slash_indexes``); here it is a ``lax.scan`` over the slashes, emitting each tile at
  the step that creates it (a range's tiles are created in ascending order, as MInference saves them).

Everything is jit-able and runs on a CPU (the tests compare it with a plain Python walk).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 64  # MInference's 64 x 64 tiles


def pooled_block_index(q: jax.Array, k: jax.Array, top_k: int, block: int = BLOCK) -> jax.Array:
    """q ``[B, S, N, D]``, k ``[B, S, N, D]`` (S a multiple of ``block``) -> int32 ``[B, N, S / block, top_k]``:
    per query block the ``top_k`` causal key blocks by pooled score, ascending (entries past a row's
    ``m + 1`` causal blocks are the non-causal leftovers of the top-k, which the kernel never reads)."""
    if getattr(q, "ndim", None) != 4 or getattr(k, "shape", None) != q.shape:
        raise ValueError(f"q, k: expected two arrays [B, S, N, D] of one shape; received {getattr(q, 'shape', None)} "
                         f"and {getattr(k, 'shape', None)}")
    b, s, n, d = q.shape
    if s % block:
        raise ValueError(f"q: expected a length that is a multiple of {block}; received shape {tuple(q.shape)}")
    nb = s // block
    qp = q.astype(jnp.float32).reshape(b, nb, block, n, d).mean(2)  # [B, nb, N, D]
    kp = k.astype(jnp.float32).reshape(b, nb, block, n, d).mean(2)
    return causal_top_k(jnp.einsum("bmnd,bjnd->bnmj", qp, kp), top_k)


def causal_top_k(score: jax.Array, top_k: int) -> jax.Array:
    """score float ``[..., nb, nb]`` (query block m, key block j) -> int32 ``[..., nb, min(top_k, nb)]``: per query
    block the ``top_k`` key blocks ``j <= m`` of the largest score, ascending (entries past a row's ``m + 1``
    causal blocks are non-causal leftovers)."""
    if getattr(score, "ndim", 0) < 2 or score.shape[-1] != score.shape[-2]:
        raise ValueError(f"score: expected an array [..., nb, nb]; received shape {getattr(score, 'shape', None)}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k: expected an int >= 1; received {top_k!r}")
    nb = score.shape[-1]
    causal = jnp.arange(nb)[:, None] >= jnp.arange(nb)[None, :]
    _, ids = lax.top_k(jnp.where(causal, score, -jnp.inf), min(top_k, nb))
    return jnp.sort(ids, axis=-1).astype(jnp.int32)


def block_index_counts(idx: jax.Array) -> jax.Array:
    """int32 ``[B, N, nq]``: how many entries of each query block's list MInference's kernel computes,
    ``min(m + 1, top_k)``."""
    nq, top_k = idx.shape[-2], idx.shape[-1]
    return jnp.broadcast_to(jnp.minimum(jnp.arange(nq, dtype=jnp.int32) + 1, top_k), idx.shape[:-1])


def merge_row_pairs(idx: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The lists of query blocks ``2i`` and ``2i + 1`` merged (for a kernel with 128-row query blocks):
    ``idx [B, N, nq, K]`` with ``count [B, N, nq]`` -> (ids int32 ``[B, N, ceil(nq / 2), 2K]`` distinct and
    ascending, then padding; counts int32 ``[B, N, ceil(nq / 2)]``)."""
    if getattr(idx, "ndim", None) != 4 or getattr(count, "shape", None) != idx.shape[:3]:
        raise ValueError(f"idx, count: expected [B, N, nq, K] and [B, N, nq]; received {getattr(idx, 'shape', None)} "
                         f"and {getattr(count, 'shape', None)}")
    b, n, nq, kk = idx.shape
    big = jnp.iinfo(jnp.int32).max
    valid = jnp.arange(kk) < count[..., None]
    ids = jnp.where(valid, idx, big)
    if nq % 2:
        ids = jnp.concatenate([ids, jnp.full((b, n, 1, kk), big, ids.dtype)], axis=2)
    ids = jnp.sort(ids.reshape(b, n, -1, 2 * kk), axis=-1)
    dup = jnp.concatenate([jnp.zeros(ids.shape[:-1] + (1,), bool), ids[..., 1:] == ids[..., :-1]], axis=-1)
    ids = jnp.sort(jnp.where(dup, big, ids), axis=-1)
    merged_count = jnp.sum(ids != big, axis=-1).astype(jnp.int32)
    return jnp.where(ids == big, 0, ids).astype(jnp.int32), merged_count


def vertical_slash_index(vertical: jax.Array, slash: jax.Array, seq_len: int, block: int = BLOCK
                         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """MInference's (block_count, block_offset, column_count, column_index) for one Vertical-Slash index.

    Args:
      vertical: int32 ``[B, N, V]`` key columns (any order; sorted ascending here).
      slash: int32 ``[B, N, L]`` offsets ``query - key`` (any order; sorted descending here), at least one
        ``< block`` per head (the main diagonal), as every Vertical-Slash estimate forces.
      seq_len: S (queries and keys), a multiple of ``block``.

    Returns:
      block_count int32 ``[B, N, R]`` (R = S / block), block_offset int32 ``[B, N, R, L]`` (window starts,
      ascending; entries past the count are 0), column_count int32 ``[B, N, R]``, column_index int32
      ``[B, N, R, V]`` (ascending; entries past the count are 0).
    """
    shapes = getattr(vertical, "shape", None), getattr(slash, "shape", None)
    if None in shapes or len(shapes[0]) != 3 or len(shapes[1]) != 3 or shapes[0][:2] != shapes[1][:2]:
        raise ValueError(f"vertical, slash: expected [B, N, V] and [B, N, L]; received {shapes[0]} and {shapes[1]}")
    b, n, nv = vertical.shape
    nl = slash.shape[-1]
    if seq_len % block:
        raise ValueError(f"seq_len: expected a multiple of {block}; received {seq_len}")
    rows = seq_len // block
    vertical = jnp.sort(vertical.astype(jnp.int32), axis=-1)
    slash = -jnp.sort(-slash.astype(jnp.int32), axis=-1)
    end = (jnp.arange(rows, dtype=jnp.int32) + 1) * block  # [R] exclusive end of each query block
    flat = b * n * rows

    def step(carry, o):  # o: [B, N] one slash per head
        stop, count, offsets = carry  # [flat] end of the current range (-1: none yet), tiles so far
        o = jnp.broadcast_to(o[..., None], (b, n, rows)).reshape(flat)
        e = jnp.broadcast_to(end, (b, n, rows)).reshape(flat)
        active = o < e
        x = jnp.maximum(e - o, block)
        new = active & ((stop < 0) | (x > stop + block))
        grow = active & ~new & (x > stop)
        tile = jnp.where(new, x - block, stop)
        emit = new | grow
        slot = jnp.where(emit, count, nl)  # out of range: dropped
        offsets = offsets.at[jnp.arange(flat), slot].set(tile, mode="drop")
        stop = jnp.where(new, x, jnp.where(grow, stop + block, stop))
        return (stop, count + emit.astype(jnp.int32), offsets), None

    init = (jnp.full(flat, -1, jnp.int32), jnp.zeros(flat, jnp.int32), jnp.zeros((flat, nl), jnp.int32))
    (stop, count, offsets), _ = lax.scan(step, init, jnp.moveaxis(slash, -1, 0))
    offsets = offsets.reshape(b, n, rows, nl)
    count = count.reshape(b, n, rows)
    stop = stop.reshape(b, n, rows)
    # A vertical is a column when it lies before the last range's end and in no tile. Tiles ascend per row
    # (padding past the count is pushed to the end by a large value).
    big = jnp.iinfo(jnp.int32).max // 2
    tiles = jnp.where(jnp.arange(nl) < count[..., None], offsets, big)
    v = jnp.broadcast_to(vertical[:, :, None, :], (b, n, rows, nv))
    pos = jax.vmap(jax.vmap(jax.vmap(lambda t, q: jnp.searchsorted(t, q, side="right"))))(tiles, v) - 1
    covering = jnp.take_along_axis(tiles, jnp.clip(pos, 0, nl - 1), axis=-1)
    inside = (pos >= 0) & (v < covering + block)
    keep = ~inside & (v < stop[..., None])
    column_count = jnp.sum(keep, axis=-1).astype(jnp.int32)
    order = jnp.argsort(~keep, axis=-1, stable=True)  # kept columns first, in ascending order
    column_index = jnp.where(jnp.arange(nv) < column_count[..., None], jnp.take_along_axis(v, order, axis=-1), 0)
    return count, offsets, column_count, column_index.astype(jnp.int32)


def vertical_slash_pairs(block_count: jax.Array, column_count: jax.Array, block: int = BLOCK) -> jax.Array:
    """float32 ``[B, N]``: query-key pairs MInference's Vertical-Slash kernel computes (whole 64 x 64 tiles:
    every block offset, and the columns in tiles of 64)."""
    tiles = block_count + (column_count + block - 1) // block
    return jnp.sum(tiles, axis=-1).astype(jnp.float32) * block * block


def block_index_pairs(count: jax.Array, block: int = BLOCK) -> jax.Array:
    """float32 ``[B, N]``: pairs of whole tiles MInference's block kernel computes."""
    return jnp.sum(count, axis=-1).astype(jnp.float32) * block * block
