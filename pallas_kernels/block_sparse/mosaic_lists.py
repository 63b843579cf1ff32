"""The block-sparse Mosaic GPU kernel's list operands, built from a layout with jax.numpy (pure functions, tested on
the CPU): the persistent grid's item order (`item_order`), the entries whose position mask the kernel skips
(`visible_entries`), key windows as TMA tiles (`window_tiles`), a row range's lists in chunks (`range_lists`,
`chunk_lists`, `chunk_entries`, `row_chunk_entries`) and shared columns appended to each list (`fused_lists`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.block_sparse.layout import BlockLayout
from pallas_kernels.block_sparse.mosaic_options import TMA_ROWS, WG_ROWS
from pallas_kernels.tiling import cdiv, round_up

# A layout with a `BlockLayout.q_block_range` runs its rows alone with lists cut into chunks of at most this many
# entries, one work item each (`_rows_pass`), so a few query blocks with long lists fill the GPU ...
ROW_CHUNK = 128
# ... with the rows repeated once per chunk in at most this many bytes (longer chunks where the rows are many): at
# 1M tokens Grid's horizontal lines (16,384 rows x 28 heads, 128 chunks) took a 15 GB copy and ran 3% slower than
# without the range (one H100, 2026-11-28, `pattern-parts-1m_*`); capped (2 chunks of 8,192 entries) Grid took
# 338.2 ms against 351.5 without the range (`pattern-parts-1m-capped_*`).
ROW_COPY_BYTES = 256 << 20
# `item_order` places up to this many items by counting (`stable_descending_order`, n^2 comparisons in one
# reduction: 12 us at 7,168 items on an H200 against 43 us for XLA's sort, 2026-11-28, README) rather than with XLA's
# sort (`auto_persistent` allows 7,168 items, and any number with lists of at most 6 steps: those take XLA's sort).
RANK_ORDER_ITEMS = 8192


def item_order(count: jax.Array, *, block_q: int, ctas: int, batch: int, heads: int, pair: bool,
               heads_first: bool = False, method: str = "auto", groups: int = 0) -> jax.Array:
    """The persistent grid's item order: int32 ``[batch * heads * ctas]`` item indices (item w is batch ``w // (heads
    * ctas)``, head ``w // ctas % heads``, 128-row block ``ctas - 1 - w % ctas``; ``heads_first``: head ``w %
    heads``, block ``ctas - 1 - w // heads % ctas``), most steps first (stably: equal items keep that
    order: query blocks (or heads) fastest, the last rows first). ``groups`` > 0: the query heads of one key / value
    head (``groups`` consecutive heads) and batch go together, key / value heads slowest, each group's items most
    steps first, so the items running at once read one key / value head's tiles. Not used by `launch`: one H100,
    2026-12-08, 32k (`short-work-trace-kv-major_*`), 1-2% on random 10% / 3% layouts (within the default's spread),
    6-9% slower on MInference's top-100 mask. count int32 ``[B|1, N|1, nq]``;
    an item's steps are its list's (``block_q`` 128) or the longer of its two 64-row blocks' lists, in entries or
    (``pair``) pairs of entries. ``method``: "sort" (``jnp.argsort``), "rank" (`stable_descending_order`, the same
    order), "auto" (default): "rank" up to `RANK_ORDER_ITEMS` items."""
    if method not in ("auto", "rank", "sort"):
        raise ValueError(f"method: expected 'auto', 'rank' or 'sort'; received {method!r}")
    nq = count.shape[2]
    steps = jnp.broadcast_to(count, (batch, heads, nq))
    if pair:
        steps = (steps + 1) // 2
    if block_q == WG_ROWS:  # two query blocks per item (a missing last one has no steps)
        steps = jnp.pad(steps, ((0, 0), (0, 0), (0, 2 * ctas - nq))).reshape(batch, heads, ctas, 2).max(-1)
    cost = steps[..., ::-1]  # [batch, heads, ctas], the last rows first
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 0:
        raise ValueError(f"groups: expected an int >= 0 (0: no grouping); received {groups!r}")
    if groups:
        if heads % groups:
            raise ValueError(f"groups: expected a divisor of heads={heads} (query heads per key / value head); "
                             f"received {groups}")
        group = (jnp.arange(batch)[:, None] * heads + jnp.arange(heads)) // groups  # [batch, heads], in item order
        cost = (batch * heads // groups - 1 - group)[..., None] * (jnp.max(cost) + 1) + cost  # earlier groups first
    cost = (jnp.swapaxes(cost, 1, 2) if heads_first else cost).reshape(-1)  # by item index
    if method == "auto":
        method = "rank" if cost.shape[0] <= RANK_ORDER_ITEMS else "sort"
    if method == "sort":
        return jnp.argsort(-cost, stable=True).astype(jnp.int32)
    return stable_descending_order(cost)


def stable_descending_order(cost: jax.Array) -> jax.Array:
    """int32 ``[n]`` (>= 0) -> int32 ``[n]``: ``jnp.argsort(-cost, stable=True)`` without a sort. Each item gets the
    key ``cost * n + n - 1 - i`` (distinct; larger goes first), its place is the number of larger keys, counted over
    all n x n pairs in one reduction, and the order is the scatter of each item to its place: O(n^2) work in two
    small kernels, against the several passes of XLA's sort (see `RANK_ORDER_ITEMS`). Costs above ``(2^31 - 1) // n
    - 1`` (over 262,000 steps at n = 8,192) count as that much, so the key stays in int32; their items keep index
    order among themselves."""
    n = cost.shape[0]
    if n == 0:
        return jnp.zeros(0, jnp.int32)
    i = jnp.arange(n, dtype=jnp.int32)
    key = jnp.minimum(cost.astype(jnp.int32), (2**31 - 1) // n - 1) * n + (n - 1 - i)
    place = jnp.sum(key[None, :] > key[:, None], axis=1, dtype=jnp.int32)
    return jnp.zeros(n, jnp.int32).at[place].set(i, unique_indices=True)


VISIBLE_MAX_ENTRIES = 1 << 25  # `visible_entries` builds its table only up to this many entries (128 MiB)


def visible_entries(blocks: jax.Array, nq: int, q_pos: jax.Array, k_pos: jax.Array,
                    ranges: tuple[jax.Array, jax.Array] | None, *, block_q: int, block_k: int, kv_len: int,
                    causal: bool, gap: int, window: int) -> jax.Array | None:
    """Which list entries every row of their query block sees whole, so the kernel can skip their position mask:
    int32 ``[B', N', nq, M]`` (1: whole), or None where that table would pass `VISIBLE_MAX_ENTRIES` (a list shared
    by many query blocks, e.g. a permuted dense prefix).

    blocks int32 ``[B|1, N|1, nq|1, M]`` (block ids, or with ``ranges`` (lo, hi) tile starts that are multiples of
    8 and each entry's keys ``[lo, hi)``); q_pos ``[B|1, N|1, Tp]`` / k_pos ``[B|1, N|1, Sp]`` the rows' and keys'
    original positions (keys at ``kv_len`` or past it: padding). An entry is whole when its tile's keys are all
    real, all causally visible to the block's first row (``gap`` included) and, with a ``window``, all inside the
    window of its last row, and (``ranges``) it computes its whole tile."""
    lead = jnp.broadcast_shapes(blocks.shape[:2], q_pos.shape[:2], k_pos.shape[:2])
    m = blocks.shape[-1]
    if math.prod(lead) * nq * m > VISIBLE_MAX_ENTRIES:
        return None
    sp = k_pos.shape[-1]
    if ranges is None:  # per key block
        kp = k_pos.reshape(k_pos.shape[:2] + (sp // block_k, block_k))
        kmax, kmin, unit = kp.max(-1), kp.min(-1), block_k
    else:  # per tile start (a multiple of 8): the max / min over bk / 8 groups of 8 keys from it
        kp = k_pos.reshape(k_pos.shape[:2] + (sp // TMA_ROWS, TMA_ROWS))
        span = block_k // TMA_ROWS
        pad = ((0, 0), (0, 0), (0, span - 1))
        kmax = lax.reduce_window(jnp.pad(kp.max(-1), pad, constant_values=kv_len), -(2 ** 31 - 1), lax.max,
                                 (1, 1, span), (1, 1, 1), "VALID")
        kmin = lax.reduce_window(jnp.pad(kp.min(-1), pad), 2 ** 31 - 1, lax.min, (1, 1, span), (1, 1, 1), "VALID")
        unit = TMA_ROWS
    n_units = kmax.shape[-1]
    ids = jnp.broadcast_to(blocks, lead + (nq, m))
    ok = (ids >= 0) & (ids < n_units * unit if ranges is not None else ids < n_units)
    at = jnp.clip(ids // unit if ranges is not None else ids, 0, n_units - 1).reshape(lead + (nq * m,))

    def take(x):  # [B|1, N|1, units] at each entry -> [B', N', nq, M]
        return jnp.take_along_axis(jnp.broadcast_to(x, lead + (n_units,)), at, -1).reshape(lead + (nq, m))

    hi_key = take(kmax)
    whole = ok & (hi_key < kv_len)
    if ranges is not None:
        lo, hi = (jnp.broadcast_to(x, lead + (nq, m)) for x in ranges)
        whole = whole & (lo == ids) & (hi == ids + block_k)
    if causal:
        qp = jnp.pad(q_pos, ((0, 0), (0, 0), (0, max(0, nq * block_q - q_pos.shape[-1]))), mode="edge")
        qp = qp[..., :nq * block_q].reshape(q_pos.shape[:2] + (nq, block_q))
        whole = whole & (hi_key + gap <= jnp.broadcast_to(qp.min(-1), lead + (nq,))[..., None])
        if window:
            whole = whole & (take(kmin) + window > jnp.broadcast_to(qp.max(-1), lead + (nq,))[..., None])
    return whole.astype(jnp.int32)


def window_tiles(starts: jax.Array, count: jax.Array, block_k: int, kv_len: int, s_pad: int, *, aligned: bool = False
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Key windows as the kernel's tiles: TMA copies a tile from a key row that is a multiple of 8.

    starts int32 ``[B|1, N|1, nq|1, M]`` (window starts, ascending), count int32 ``[B|1, N|1, nq]`` ->
    (tile starts, lo, hi) int32 ``[B|1, N|1, nq|1, 2M]`` and counts ``[B|1, N|1, nq]``. Window j computes the keys
    ``[lo, hi)`` with ``lo = max(a_j, a_{j-1} + block_k, 0)`` and ``hi = min(a_j + block_k, kv_len)`` (the layout's
    rule); they lie in the tile from ``t = min(8 * floor(lo / 8), s_pad - block_k)`` or, when the window does not
    start on a multiple of 8, in that tile and the next one (its keys from ``t + block_k`` on). Windows with
    nothing to compute give no tile; the tiles keep the windows' order.

    ``aligned`` (the layout's ``window_align`` is a multiple of 8, so every window start is): each window is one
    tile, and the outputs are ``M`` wide, the first ``M`` entries of the general form (half its memory: at 1M tokens
    with 64-row query blocks and 768 windows each, 3 x 1.4 GB for 28 heads instead of 3 x 2.8 GB). A traced layout
    whose starts break its ``window_align`` loses the keys of a window past its tile (reads stay in bounds)."""
    if starts.ndim != 4 or count.ndim != 3 or not (jnp.issubdtype(starts.dtype, jnp.integer)
                                                   and jnp.issubdtype(count.dtype, jnp.integer)):
        raise ValueError(f"starts, count: expected int arrays [B|1, N|1, nq|1, M] and [B|1, N|1, nq]; received "
                         f"{starts.dtype}{list(starts.shape)} and {count.dtype}{list(count.shape)}")
    if block_k % TMA_ROWS or s_pad < block_k or s_pad % block_k or not 0 < kv_len <= s_pad:
        raise ValueError(f"block_k, kv_len, s_pad: expected block_k a multiple of 8 and s_pad a multiple of block_k "
                         f"with 0 < kv_len <= s_pad; received {block_k}, {kv_len}, {s_pad}")
    m = starts.shape[-1]
    prev_end = jnp.concatenate([jnp.full(starts.shape[:-1] + (1,), -(2 ** 30), jnp.int32), starts[..., :-1] + block_k],
                               -1)
    lo = jnp.maximum(jnp.maximum(starts, prev_end), 0)
    hi = jnp.minimum(starts + block_k, kv_len)
    ok = lo < hi
    t0 = jnp.minimum(lo // TMA_ROWS * TMA_ROWS, s_pad - block_k)
    two = None if aligned else ok & (hi > t0 + block_k)
    n = ok.astype(jnp.int32) if aligned else ok.astype(jnp.int32) + two
    first = jnp.cumsum(n, -1) - n  # the entry's first tile
    dump = m if aligned else 2 * m  # tiles of entries with nothing to compute land past the end
    put = functools.partial(jnp.put_along_axis, axis=-1, inplace=False)
    out = jnp.zeros(starts.shape[:-1] + (dump + 1,), jnp.int32)
    at1 = jnp.where(ok, first, dump)
    tiles, lo_t, hi_t = put(out, at1, t0), put(out, at1, lo), put(out, at1, jnp.minimum(hi, t0 + block_k))
    if not aligned:  # the second tile of a window off a multiple of TMA_ROWS
        at2 = jnp.where(two, first + 1, dump)
        tiles = put(tiles, at2, jnp.minimum(t0 + block_k, s_pad - block_k))
        lo_t, hi_t = put(lo_t, at2, t0 + block_k), put(hi_t, at2, hi)
    tiles, lo_t, hi_t = tiles[..., :dump], lo_t[..., :dump], hi_t[..., :dump]
    lead = jnp.broadcast_shapes(starts.shape[:-1], count.shape)
    cum, count = jnp.broadcast_to(jnp.cumsum(n, -1), lead + (m,)), jnp.broadcast_to(count, lead)
    new_count = jnp.where(count > 0, jnp.take_along_axis(cum, jnp.clip(count - 1, 0, m - 1)[..., None], -1)[..., 0], 0)
    return tiles, lo_t, hi_t, new_count.astype(jnp.int32)


def chunk_lists(layout: BlockLayout, chunk: int) -> tuple[jax.Array, jax.Array]:
    """The lists of the query blocks in ``q_block_range`` cut into ``C = ceil(max_blocks / e)`` chunks of ``e <=
    chunk`` entries (``e`` even): (blocks int32 ``[B|1, N|1, C * nb, e]``, counts ``[B|1, N|1, C * nb]``), chunk
    c of query block i at ``c * nb + i``."""
    blocks, count = range_lists(layout)
    (blocks,), counts = chunk_entries((blocks,), count, chunk)
    return blocks, counts


def range_lists(layout: BlockLayout) -> tuple[jax.Array, jax.Array]:
    """The key-block lists of the query blocks in ``q_block_range`` (``nb`` of them): (blocks int32 ``[B|1, N|1,
    nb|1, M]``, counts ``[B|1, N|1, nb]`` clipped into ``[0, M]``)."""
    count = jnp.broadcast_to(layout.kv_block_count, layout.kv_block_count.shape[:2] + (layout.num_q_blocks,))
    return in_range(layout.kv_blocks, layout), jnp.clip(in_range(count, layout), 0, layout.max_blocks)


def in_range(x: jax.Array, layout: BlockLayout) -> jax.Array:
    """A per-query-block array ``[B|1, N|1, nq|1, ...]`` of ``layout`` on the blocks of its ``q_block_range`` (a
    broadcast query-block axis stays 1)."""
    if layout.q_block_range is None:
        raise ValueError("layout.q_block_range: expected (lo, hi) (the query blocks that list anything); received None")
    if x.ndim < 3 or x.shape[2] not in (1, layout.num_q_blocks):
        raise ValueError(f"x: expected [B|1, N|1, nq|1, ...] with nq = {layout.num_q_blocks}; received "
                         f"{list(x.shape)}")
    lo, hi = layout.q_block_range
    return x if x.shape[2] == 1 else x[:, :, lo:hi]


def chunk_entries(entries: tuple[jax.Array, ...], count: jax.Array, chunk: int
                  ) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """Lists of ``nb`` query blocks cut into ``C = ceil(M / e)`` chunks of ``e <= chunk`` entries (``e`` even, so a
    step of two entries stays in one chunk): ``entries`` are int arrays ``[B|1, N|1, nb|1, M]`` of one list (block
    ids, or a window's start, lo and hi), ``count`` ``[B|1, N|1, nb]`` (clipped into ``[0, M]``) -> (each entry
    array ``[B', N', C * nb, e]``, counts int32 ``[B|1, N|1, C * nb]``), chunk c of query block i at ``c * nb +
    i``."""
    if (not entries or count.ndim != 3 or not jnp.issubdtype(count.dtype, jnp.integer)
            or any(x.ndim != 4 or not jnp.issubdtype(x.dtype, jnp.integer) or x.shape[-1] != entries[0].shape[-1]
                   or x.shape[2] not in (1, count.shape[2]) for x in entries)):
        raise ValueError(f"entries, count: expected int arrays [B|1, N|1, nb|1, M] (one M) and [B|1, N|1, nb]; "
                         f"received {[f'{x.dtype}{list(x.shape)}' for x in entries]} and "
                         f"{count.dtype}{list(count.shape)}")
    if not isinstance(chunk, int) or chunk < 2:
        raise ValueError(f"chunk: expected an int >= 2 (entries per chunk, even); received {chunk!r}")
    nb, m = count.shape[2], entries[0].shape[-1]
    c = cdiv(m, chunk)
    e = round_up(cdiv(m, c), 2)
    count = jnp.clip(count, 0, m)
    lead = jnp.broadcast_shapes(*(x.shape[:2] for x in entries))
    out = []
    for x in entries:
        x = jnp.pad(jnp.broadcast_to(x, lead + (nb, m)), ((0, 0), (0, 0), (0, 0), (0, c * e - m)))
        out.append(jnp.moveaxis(x.reshape(lead + (nb, c, e)), 3, 2).reshape(lead + (c * nb, e)))
    counts = jnp.stack([jnp.clip(count - j * e, 0, e) for j in range(c)], axis=2)
    return tuple(out), counts.reshape(count.shape[:2] + (c * nb,)).astype(jnp.int32)


def row_chunk_entries(max_blocks: int, copy_bytes: int, chunk: int = ROW_CHUNK) -> int:
    """List entries per chunk of `_rows_pass`: ``chunk``, or more where ``ceil(max_blocks / chunk)`` copies of the
    rows (``copy_bytes`` each) would pass `ROW_COPY_BYTES`."""
    most = max(1, ROW_COPY_BYTES // max(copy_bytes, 1))
    return max(chunk, -(-max_blocks // most))


def fused_lists(blocks: jax.Array, count: jax.Array, column_count: jax.Array, *, block_k: int, num_kv_blocks: int,
                tiles: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Each query block's key blocks, then its shared column tiles, as one list of key windows (`launch`'s
    ``ranges``) over keys ``[0, nk * block_k)`` followed by ``tiles`` gathered column tiles.

    blocks int32 ``[B|1, N|1, nq|1, M]`` (block ids; ids outside ``[0, num_kv_blocks)`` compute nothing), count
    ``[B|1, N|1, nq]``, column_count ``[B|1, N|1, nq|1]`` (columns read, in ``[0, tiles * block_k]``) -> (tile
    starts, lo, hi) int32 ``[B', N', nq, M + tiles]`` and counts ``[B', N', nq]``: entry j < count[i] is block
    ``blocks[..., i, j]`` whole; the next ``ceil(column_count[i] / block_k)`` entries are column tiles, the last
    one only up to the count."""
    if (blocks.ndim != 4 or count.ndim != 3 or column_count.ndim != 3
            or not all(jnp.issubdtype(x.dtype, jnp.integer) for x in (blocks, count, column_count))):
        raise ValueError(f"blocks, count, column_count: expected int arrays [B|1, N|1, nq|1, M], [B|1, N|1, nq] and "
                         f"[B|1, N|1, nq|1]; received {blocks.dtype}{list(blocks.shape)}, {count.dtype}"
                         f"{list(count.shape)} and {column_count.dtype}{list(column_count.shape)}")
    if block_k % TMA_ROWS or num_kv_blocks < 1 or tiles < 1:
        raise ValueError(f"block_k, num_kv_blocks, tiles: expected a multiple of {TMA_ROWS} and ints >= 1; received "
                         f"{block_k}, {num_kv_blocks}, {tiles}")
    nq, m = count.shape[2], blocks.shape[-1]
    lead = jnp.broadcast_shapes(blocks.shape[:2], count.shape[:2], column_count.shape[:2])
    n_blk = jnp.broadcast_to(jnp.clip(count, 0, m), lead + (nq,))[..., None]
    n_col = jnp.broadcast_to(column_count, lead + (nq,))[..., None]
    j = jnp.arange(m + tiles, dtype=jnp.int32)
    ids = jnp.take_along_axis(jnp.broadcast_to(blocks, lead + (nq, m)),
                              jnp.broadcast_to(jnp.minimum(j, m - 1), lead + (nq, m + tiles)), axis=-1)
    ok = (ids >= 0) & (ids < num_kv_blocks)
    b_start = jnp.where(ok, ids, 0) * block_k
    t = jnp.clip(j - n_blk, 0, tiles - 1)
    c_start = (num_kv_blocks + t) * block_k
    c_hi = c_start + jnp.clip(n_col - t * block_k, 0, block_k)
    is_blk = j < n_blk
    starts = jnp.where(is_blk, b_start, c_start).astype(jnp.int32)
    hi = jnp.where(is_blk, jnp.where(ok, b_start + block_k, b_start), c_hi).astype(jnp.int32)
    total = n_blk[..., 0] + (n_col[..., 0] + block_k - 1) // block_k
    return starts, starts, hi, total.astype(jnp.int32)

