"""Range arithmetic -> block lists: the vectorised helpers every pattern builder uses to turn
per-row key-block ranges into the ascending, distinct lists of a `BlockLayout`.

All functions are jit-able; sizes that shape arrays are static Python ints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tiling import cdiv


def query_block_bounds(q_len: int, kv_len: int, block_q: int) -> tuple[jax.Array, jax.Array]:
    """Original positions of the first and last query of each query block: int32 ``[nq]``."""
    nq = cdiv(q_len, block_q)
    off = kv_len - q_len
    start = np.arange(nq) * block_q + off
    end = np.minimum((np.arange(nq) + 1) * block_q, q_len) - 1 + off
    return jnp.asarray(start, jnp.int32), jnp.asarray(end, jnp.int32)


# At most this many ranges a row: sort the ranges and write them out (`ascending_ranges_to_lists`, which compares each
# of the L entries with every range end, L x R); more (Vertical-Slash's anchors, SF-strided's slashes): sort the L
# candidate blocks themselves (twice, L log L), cheaper there.
SORTED_RANGES_UP_TO = 16


def ranges_to_lists(groups: list[tuple[jax.Array, jax.Array, int]], num_kv_blocks: int
                    ) -> tuple[jax.Array, jax.Array]:
    """Union of inclusive block ranges per row -> ascending, distinct block lists.

    groups: ``(lo, hi, max_width)`` with lo, hi int32 ``[..., R]`` (one group's ranges are
    at most ``max_width`` blocks wide, static: a wider one keeps its first ``max_width`` blocks; a range with hi < lo
    is empty; ranges may overlap). Ids are clipped to ``[0, num_kv_blocks)``, so a group is never wider than
    ``num_kv_blocks`` whatever its bound. Returns (blocks int32 ``[..., L]`` with L = sum of
    R * min(max_width, num_kv_blocks), zero past the count; count ``[...]``).

    With at most `SORTED_RANGES_UP_TO` ranges a row (Grid's lines: 5, against 1,285 candidate blocks a query block at
    1M with searched strides) the ranges are sorted by their first block and written out; with more, the candidate
    blocks are sorted (the same lists either way).
    """
    clipped, total = [], 0
    for lo, hi, max_width in groups:
        width = max(1, min(int(max_width), num_kv_blocks))
        lo = jnp.maximum(lo, 0).astype(jnp.int32)
        clipped.append((lo, jnp.minimum(jnp.minimum(hi, lo + (width - 1)), num_kv_blocks - 1).astype(jnp.int32),
                        width))
        total += lo.shape[-1] * width
    if sum(lo.shape[-1] for lo, _, _ in clipped) <= SORTED_RANGES_UP_TO:
        lo = jnp.concatenate([lo for lo, _, _ in clipped], -1)
        hi = jnp.concatenate([hi for _, hi, _ in clipped], -1)
        lo, hi = jax.lax.sort((lo, hi), dimension=lo.ndim - 1, num_keys=1)
        return ascending_ranges_to_lists(lo, hi, total)
    big = jnp.int32(np.iinfo(np.int32).max)
    flats = []
    for lo, hi, width in clipped:
        cand = lo[..., None] + jnp.arange(width, dtype=jnp.int32)  # [..., R, W]
        flats.append(jnp.where(cand <= hi[..., None], cand, big).reshape(lo.shape[:-1] + (-1,)))
    flat = jnp.sort(jnp.concatenate(flats, -1), axis=-1)
    dup = jnp.concatenate([jnp.zeros_like(flat[..., :1], bool), flat[..., 1:] == flat[..., :-1]], -1)
    flat = jnp.sort(jnp.where(dup, big, flat), axis=-1)
    count = (flat != big).sum(-1).astype(jnp.int32)
    return jnp.where(flat == big, 0, flat).astype(jnp.int32), count


def ascending_ranges_to_lists(lo: jax.Array, hi: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """Block ranges ``[..., R]`` (inclusive; ``lo`` non-decreasing along R; empty when
    hi < lo) -> ascending distinct lists ``[..., width]`` and counts, without a sort."""
    prev_hi = jax.lax.cummax(hi, axis=hi.ndim - 1)
    prev_hi = jnp.concatenate([jnp.full_like(hi[..., :1], -1), prev_hi[..., :-1]], -1)
    start = jnp.maximum(lo, prev_hi + 1)
    length = jnp.maximum(hi - start + 1, 0)
    end = jnp.cumsum(length, -1)
    j = jnp.arange(width, dtype=jnp.int32)
    r = (end[..., None, :] <= j[:, None]).sum(-1)  # range holding entry j
    r = jnp.minimum(r, lo.shape[-1] - 1)
    first = jnp.take_along_axis(end - length, r, -1)
    blocks = jnp.take_along_axis(start, r, -1) + j - first
    count = jnp.minimum(end[..., -1], width).astype(jnp.int32)
    return jnp.where(j < count[..., None], blocks, 0).astype(jnp.int32), count


def bisect_right(values: jax.Array, lo: jax.Array, hi: jax.Array, x: jax.Array) -> jax.Array:
    """First index i in ``[lo, hi)`` with ``values[..., i] > x``, else hi, where values ascend on ``[lo, hi)`` (a
    vectorised bisection, e.g. the causal end of one run of a sorted key order): values ``[B|1, N|1, L]``, lo / hi /
    x int ``[B, N, R]`` -> int32 ``[B, N, R]``.

    Its log2(L) steps are unrolled, each behind an optimization barrier: as an XLA while loop every step is a launch
    plus copies of the loop state (Grid's layout at 128k: about 230 steps and 480 device copies a build, H100 trace
    of 2026-12-07), and unrolled without the barriers XLA fuses the steps into one expression that doubles with each
    step (a Grid layout at 32k did not compile in 10 minutes on this CPU)."""
    if values.ndim != 3 or any(a.ndim != 3 or not jnp.issubdtype(a.dtype, jnp.integer) for a in (lo, hi, x)):
        raise ValueError(f"values, lo, hi, x: expected values [B|1, N|1, L] and int arrays [B, N, R]; received "
                         f"{[list(a.shape) for a in (values, lo, hi, x)]}")
    last = values.shape[-1] - 1

    def step(_, bounds):
        a, b = bounds
        mid = (a + b) // 2
        right = jnp.take_along_axis(values, jnp.clip(mid, 0, last), -1) <= x
        open_ = a < b
        return jnp.where(open_ & right, mid + 1, a), jnp.where(open_ & ~right, mid, b)

    bounds = (lo.astype(jnp.int32), hi.astype(jnp.int32))
    for i in range(max(1, int(values.shape[-1]).bit_length())):
        bounds = jax.lax.optimization_barrier(step(i, bounds))
    return bounds[0]


def bisect_many(values: jax.Array, queries: list, shape: tuple[int, ...]) -> list[jax.Array]:
    """`bisect_right` of several (lo, hi, x) queries (each broadcast to ``shape`` ``[B, N, R]``) in one bisection,
    side by side along the last axis: one set of unrolled steps for all of them. Returns a list of int32 ``shape``."""
    if not queries:
        return []
    cat = [jnp.concatenate([jnp.broadcast_to(q[i], shape).astype(jnp.int32) for q in queries], -1) for i in range(3)]
    return jnp.split(bisect_right(values, *cat), len(queries), -1)
