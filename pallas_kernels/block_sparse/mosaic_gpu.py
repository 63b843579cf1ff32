"""Block-sparse flash attention forward for Hopper (sm90) in Pallas Mosaic GPU: the public entry
(`block_sparse_attention_mosaic_gpu`, `block_sparse_attention_rows_mosaic_gpu`) and its passes over a layout.

The kernel itself, a warp-specialised FlashAttention-3 design over key-block lists, is `mosaic_kernel.launch`; its
limits and measured defaults are in `mosaic_options`, its list operands in `mosaic_lists`. Here: the layout's
permutations (q, and k / v, gathered into permuted order once; the kernel masks on original positions), the block
pass (`_block_pass`), a layout's row range alone with its lists in chunks (`_rows_pass`), single key columns as a
second pass (the Triton kernel's, or this kernel's over key tiles gathered per query block) merged with
`merge_attention`, columns shared by every query block and head (SF-fixed's summary tokens) gathered once per key /
value head and appended to the keys of the block pass's own launch (`_fused_column_pass`), and the keys poisoned
where a value row is not finite (`_on_keys`).

Out: ``[B, T, N, D]`` in q's dtype, lse ``[B, N, T]`` float32 (natural log); the kernel's limits and why it has no
CPU path: `mosaic_kernel`'s docstring. CPU tests run the passes with an emulated launch
(tests/pallas_kernels/block_sparse/test_rows.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import mosaic_fa3 as fa3
from pallas_kernels.block_sparse.layout import BlockLayout
from pallas_kernels.block_sparse.merge import merge_attention, merge_chunks, merge_onto, merge_rows, scatter_rows
from pallas_kernels.block_sparse.mosaic_kernel import launch
from pallas_kernels.block_sparse.mosaic_lists import (
    ROW_CHUNK,
    chunk_entries,
    chunk_lists,
    fused_lists,
    in_range,
    range_lists,
    row_chunk_entries,
    window_tiles,
)
from pallas_kernels.block_sparse.mosaic_options import (
    BLOCK_Q,
    auto_key_pairs,
    auto_persistent,
    check_supported,
    default_stages,
    max_stages,
    one_tile_windows,
)
from pallas_kernels.block_sparse.triton import block_sparse_attention_triton
from pallas_kernels.checks import check_int
from pallas_kernels.nonfinite import checked_if_nonfinite, poison_keys
from pallas_kernels.tiling import inverse_permutation, round_up
from pallas_kernels.tiling import pad_to as _pad_to

COLUMN_PASSES = ("fused", "mosaic", "triton")


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x ``[B, L, H, D]``, idx int32 ``[B|1, H|1, M]`` -> ``[B, M, H', D]`` with
    ``out[b, m, h] = x[b, idx[b, h, m], h]`` (H' = H, or idx's head count when H == 1)."""
    xh = jnp.einsum("blhd->bhld", x)
    heads = max(xh.shape[1], idx.shape[1])
    xh = jnp.broadcast_to(xh, (xh.shape[0], heads) + xh.shape[2:])
    idx = jnp.broadcast_to(idx, (xh.shape[0], heads, idx.shape[2]))
    return jnp.einsum("bhld->blhd", jnp.take_along_axis(xh, idx[..., None], axis=2))


def _positions_or_iota(perm, length: int, padded: int, offset: int) -> jax.Array:
    """int32 ``[B|1, N|1, padded]`` original positions (+ offset) of permuted rows; padding
    rows get positions >= length + offset."""
    if perm is None:
        return (jnp.arange(padded, dtype=jnp.int32) + offset)[None, None]
    perm = jnp.clip(perm, 0, length - 1)
    tail = jnp.broadcast_to(jnp.arange(length, padded, dtype=jnp.int32), perm.shape[:2] + (padded - length,))
    return jnp.concatenate([perm, tail], axis=-1) + offset


def _expand_heads(x: jax.Array, groups: int) -> jax.Array:
    """``[B, S, K, D]`` -> ``[B, S, K * groups, D]`` (query head n reads key head n // groups)."""
    return jnp.repeat(x, groups, axis=2) if groups > 1 else x


def _check_heads(q_heads, kv_heads) -> None:
    check_int("q_heads", q_heads, 1)
    check_int("kv_heads", kv_heads, 1)
    if q_heads % kv_heads:
        raise ValueError(f"kv_heads: expected a divisor of q_heads={q_heads}; received {kv_heads}")


def per_head_key_orders(layout: BlockLayout, q_heads: int, kv_heads: int) -> bool:
    """Static: the layout names a key order per query head (``kv_perm [B|1, N, S]``) over grouped heads (q_heads N a
    multiple of kv_heads K, N > K), so the passes would copy k / v once per query head (`_prepared_kv`) unless the
    heads of each group agree (`same_key_orders`)."""
    _check_heads(q_heads, kv_heads)
    return layout.kv_perm is not None and layout.kv_perm.shape[1] > 1 and q_heads > kv_heads


def _group_orders(kv_perm: jax.Array, kv_heads: int) -> jax.Array:
    """``kv_perm [B|1, N, S]`` -> ``[B|1, K, N / K, S]``: the key orders of each key / value head's query heads."""
    return kv_perm.reshape(kv_perm.shape[0], kv_heads, kv_perm.shape[1] // kv_heads, kv_perm.shape[2])


def same_key_orders(layout: BlockLayout, kv_heads: int) -> jax.Array:
    """bool ``[]``, on the device: every query head of each key / value head's group has the same key order (Grid
    with searched strides where the heads found the same stride), so one copy of k / v per key / value head serves
    the group (`_prepared_kv` with ``grouped``). One read of ``kv_perm``; the layout must have one, ``[B|1, N, S]``
    with N a multiple of ``kv_heads``."""
    perm = layout.kv_perm
    if perm is None or perm.ndim != 3:
        raise ValueError(f"layout.kv_perm: expected int32 [B|1, N, S]; received "
                         f"{None if perm is None else perm.shape}")
    _check_heads(perm.shape[1], kv_heads)
    orders = _group_orders(perm, kv_heads)
    return jnp.all(orders == orders[:, :, :1])


def _prepared_kv(k, v, layout: BlockLayout, groups: int, d_pad: int,
                 grouped: bool = False) -> tuple[jax.Array, jax.Array, int]:
    """(k, v, groups) as the kernel reads them: in the layout's key order (a permutation per query head over grouped
    heads copies k / v once per query head, groups 1; with ``grouped``, the caller's promise that each group's heads
    share their order (`same_key_orders`), once per key / value head), head dim padded to ``d_pad``, keys to whole
    blocks."""
    s = k.shape[1]
    s_pad = layout.num_kv_blocks * layout.block_k
    if layout.kv_perm is not None:
        kv_perm = jnp.clip(layout.kv_perm, 0, s - 1)
        if per_head_key_orders(layout, k.shape[2] * groups, k.shape[2]):
            if grouped:  # the group's first head's order, [B|1, K, S]
                kv_perm = _group_orders(kv_perm, k.shape[2])[:, :, 0]
            else:  # one copy per query head
                k, v, groups = _expand_heads(k, groups), _expand_heads(v, groups), 1
        k, v = _gather_rows(k, kv_perm), _gather_rows(v, kv_perm)
    return _pad_to(_pad_to(k, 3, d_pad), 1, s_pad), _pad_to(_pad_to(v, 3, d_pad), 1, s_pad), groups


def _block_pass(q_in, k, v, layout: BlockLayout, *, sm_scale, causal, stages, t_pad, d_pad, persistent, pair,
                overlap, pingpong, heads_first=False, profile=None, boxes=None, grouped=False, prior=None,
                row_mask=None):
    """The layout's key blocks; q_in is padded and in the layout's row order (``boxes``: (q_box, row_stride), q_in
    the original rows in `strided_rows`' view; ``grouped``: `_prepared_kv`'s; ``prior`` / ``row_mask``: `launch`'s,
    merged in)."""
    s = k.shape[1]
    bk, nk = layout.block_k, layout.num_kv_blocks
    s_pad = nk * bk
    has_pos = layout.q_perm is not None or layout.kv_perm is not None
    k_in, v_in, groups = _prepared_kv(k, v, layout, q_in.shape[-2] // k.shape[2], d_pad, grouped)
    q_pos = k_pos = None
    if has_pos:
        q_pos = _positions_or_iota(layout.q_perm, layout.q_len, t_pad, layout.q_offset)
        k_pos = _positions_or_iota(layout.kv_perm, s, s_pad, 0)
    count = jnp.clip(layout.kv_block_count, 0, layout.max_blocks)
    blocks, ranges = layout.kv_blocks, None
    if layout.kv_windows:
        blocks, lo, hi, count = window_tiles(blocks, count, bk, layout.kv_len, s_pad,
                                             aligned=one_tile_windows(layout))
        ranges = (lo, hi)
    return launch(q_in, k_in, v_in, blocks, count, q_pos, k_pos, groups=groups,
                  num_kv_blocks=nk, kv_len=layout.kv_len, q_offset=layout.q_offset, block_k=bk,
                  causal=causal, gap=layout.gap, window=layout.window, sm_scale=sm_scale, stages=stages,
                  block_q=layout.block_q, persistent=persistent, ranges=ranges, pair=pair, profile=profile,
                  overlap=overlap, pingpong=pingpong, heads_first=heads_first, prior=prior, row_mask=row_mask,
                  **_box_args(boxes))


def row_range_pass(layout: BlockLayout, column_pass: str | None = None) -> bool:
    """`block_sparse_attention_mosaic_gpu` runs the layout as `_rows_pass` (one CTA per work item; unless
    ``persistent=True`` or ``profile`` is asked for): it names a ``q_block_range`` and lists key blocks (no key
    windows) and no single columns, or only `fused_columns` with ``column_pass`` None or ``"fused"`` (the
    straddling keys a boundary wrapper's part lists, `mmjax.sparse.placement.restrict_to_valid`)."""
    if layout.q_block_range is None or layout.kv_windows:
        return False
    return layout.kv_columns is None or (fused_columns(layout) and column_pass in (None, "fused"))


def _rows_pass(q, k, v, layout: BlockLayout, *, sm_scale, causal, stages, d_pad, pair, overlap, pingpong,
              grouped=False):
    """The layout over the rows of its ``q_block_range`` alone: (rows int32 ``[B|1, N|1, R]`` as `range_rows`,
    out ``[B, R, N, D]`` in q's dtype, lse ``[B, N, R]``). The rows are gathered once (through ``q_perm``) and
    repeated once per chunk of their lists (`chunk_entries`, `row_chunk_entries`: `ROW_CHUNK` entries, longer where
    the copies would pass `ROW_COPY_BYTES`): each (query block, chunk) is one work item,
    with the rows' original positions; the chunks are merged by lse. `fused_columns` go on each list as key tiles
    appended to the keys (`fused_lists`, as in `_fused_column_pass`) before it is cut into chunks. ``grouped``:
    `_prepared_kv`'s."""
    b, t, n, d = q.shape
    s = k.shape[1]
    bk, nk = layout.block_k, layout.num_kv_blocks
    lo, hi = layout.q_block_range
    rows = layout.range_rows()
    r = rows.shape[-1]
    copy_bytes = b * r * n * d_pad * q.dtype.itemsize
    if layout.kv_columns is None:
        k_in, v_in, groups = _prepared_kv(k, v, layout, n // k.shape[2], d_pad, grouped)
        k_pos = _positions_or_iota(layout.kv_perm, s, nk * bk, 0)
        blocks, count = chunk_lists(layout, row_chunk_entries(layout.max_blocks, copy_bytes, ROW_CHUNK))
        ranges, num_kv_blocks = None, nk
    else:  # fused_columns: each list goes on with its column tiles, as key windows
        k_in, v_in, k_pos, ccount, tiles = _keys_with_columns(k, v, layout, d_pad)
        groups = n // k.shape[2]
        blocks, count = range_lists(layout)
        starts, w_lo, w_hi, total = fused_lists(blocks, count, in_range(ccount, layout), block_k=bk,
                                                num_kv_blocks=nk, tiles=tiles)
        (blocks, w_lo, w_hi), count = chunk_entries(
            (starts, w_lo, w_hi), total, row_chunk_entries(starts.shape[-1], copy_bytes, ROW_CHUNK))
        ranges, num_kv_blocks = (w_lo, w_hi), nk + tiles
    c = count.shape[2] // (hi - lo)
    t_pad = round_up(c * r, BLOCK_Q)
    q_in = _pad_to(_pad_to(jnp.tile(_gather_rows(q, jnp.minimum(rows, t - 1)), (1, c, 1, 1)), 3, d_pad), 1, t_pad)
    q_pos = _pad_to(jnp.tile(rows + layout.q_offset, (1, 1, c)), 2, t_pad)
    out, lse = launch(q_in, k_in, v_in, blocks, count, q_pos, k_pos, groups=groups, num_kv_blocks=num_kv_blocks,
                      kv_len=layout.kv_len, q_offset=layout.q_offset, block_k=bk, causal=causal, gap=layout.gap,
                      window=layout.window, sm_scale=sm_scale, stages=stages, block_q=layout.block_q, pair=pair,
                      overlap=overlap, pingpong=pingpong, ranges=ranges)
    out = out[:, :c * r, :, :d].reshape(b, c, r, n, d)
    lse = lse[:, :, :c * r].reshape(b, n, c, r)
    return (rows, *merge_chunks(out, lse))


def shared_columns(layout: BlockLayout) -> bool:
    """The layout's single columns are one list for every query block and head (each block reads a prefix of it,
    its count), in a key order shared by the heads: `_column_pass` gathers them once per key / value head."""
    return (layout.kv_columns is not None and layout.kv_columns.shape[1:3] == (1, 1)
            and (layout.kv_perm is None or layout.kv_perm.shape[1] == 1))


def _shared_column_index(layout: BlockLayout, s: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where the `shared_columns` list's keys are: (their original indices int32 ``[B|1, 1, tiles * block_k]``
    (0 for unused slots), their original positions (``kv_len`` for unused slots, never visible), the count of columns
    each query block reads int32 ``[B|1, N|1, nq|1]``)."""
    bk, mc = layout.block_k, layout.max_columns
    tiles = -(-mc // bk)
    cols = _pad_to(layout.kv_columns, 3, tiles * bk)[:, :, 0]  # [B|1, 1, mcp]
    ok = (cols >= 0) & (cols < s)
    orig = jnp.where(ok, cols, 0)
    if layout.kv_perm is not None:
        orig = jnp.take_along_axis(jnp.clip(layout.kv_perm, 0, s - 1), orig, axis=-1)
    k_pos = jnp.where(ok, orig, layout.kv_len).astype(jnp.int32)
    return orig.astype(jnp.int32), k_pos, jnp.clip(layout.kv_column_count, 0, mc)


def _shared_column_keys(k, v, layout: BlockLayout, d_pad: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The `shared_columns` list's keys gathered once per key / value head: (k_c, v_c ``[B, tiles * block_k, K,
    Dp]``, their original positions int32 ``[B|1, 1, tiles * block_k]`` (``kv_len`` for unused slots), the count
    of columns each query block reads int32 ``[B|1, N|1, nq|1]``)."""
    orig, k_pos, ccount = _shared_column_index(layout, k.shape[1])
    return _pad_to(_gather_rows(k, orig), 3, d_pad), _pad_to(_gather_rows(v, orig), 3, d_pad), k_pos, ccount


def _shared_column_pass(q_in, k, v, layout: BlockLayout, *, sm_scale, causal, stages, t_pad, d_pad, persistent,
                        pair, overlap, pingpong, heads_first=False):
    """`_column_pass` for `shared_columns`: the list's keys gathered once into ``ceil(max_cols / block_k)`` tiles
    per key / value head (`_shared_column_keys`), each query block reading the first ``count`` of them as key
    windows (its last tile only up to its count), with the original position of every gathered key."""
    kh, bk = k.shape[2], layout.block_k
    k_c, v_c, k_pos, ccount = _shared_column_keys(k, v, layout, d_pad)
    tiles = k_c.shape[1] // bk
    starts = jnp.arange(tiles, dtype=jnp.int32) * bk
    hi = (starts + jnp.clip(ccount[..., None] - starts, 0, bk)).astype(jnp.int32)
    lo = jnp.broadcast_to(starts, hi.shape)
    q_pos = _positions_or_iota(layout.q_perm, layout.q_len, t_pad, layout.q_offset)
    return launch(q_in, k_c, v_c, lo, ((ccount + bk - 1) // bk).astype(jnp.int32), q_pos, k_pos,
                  groups=q_in.shape[2] // kh, num_kv_blocks=tiles, kv_len=layout.kv_len, q_offset=layout.q_offset,
                  block_k=bk, causal=causal, gap=layout.gap, window=layout.window, sm_scale=sm_scale, stages=stages,
                  block_q=layout.block_q, persistent=persistent, ranges=(lo, hi), pair=pair, overlap=overlap,
                  pingpong=pingpong, heads_first=heads_first)


def fused_columns(layout: BlockLayout) -> bool:
    """``column_pass="fused"`` takes the layout: `shared_columns`, and its lists name key blocks (no key windows)."""
    return shared_columns(layout) and not layout.kv_windows


def _keys_with_columns(k, v, layout: BlockLayout, d_pad: int):
    """The keys of a `fused_columns` launch, gathered in one pass: the keys in the layout's key order, padded to whole
    blocks (a padding slot reads the last key at a position no query sees), then the `shared_columns`' keys
    (`_shared_column_index`, ``tiles`` tiles of ``block_k``), and every key's original position -> (k_in, v_in
    ``[B, (nk + tiles) * block_k, K, Dp]``: key / value heads as given, the key order being shared by the heads),
    k_pos int32 ``[B|1, 1, (nk + tiles) * block_k]``, the columns each query block reads ``[B|1, N|1, nq]``, tiles).
    One gather rather than the key order's gather, then a concatenation with the column tiles (a second copy of k /
    v)."""
    if not shared_columns(layout):  # one key order and one column list for every head: the gather's index
        raise ValueError("layout: expected shared columns ([B|1, 1, 1, C]) and a key order shared by the heads "
                         f"(kv_perm [B|1, 1, S] or None); received {getattr(layout.kv_columns, 'shape', None)} / "
                         f"{None if layout.kv_perm is None else layout.kv_perm.shape}")
    s, bk = k.shape[1], layout.block_k
    orig_c, pos_c, ccount = _shared_column_index(layout, s)
    pos_b = _positions_or_iota(layout.kv_perm, s, layout.num_kv_blocks * bk, 0)  # `shared_columns`: [B|1, 1, .]
    lead = jnp.broadcast_shapes(pos_b.shape[:2], pos_c.shape[:2])

    def joined(blocks, columns):
        return jnp.concatenate([jnp.broadcast_to(blocks, lead + blocks.shape[2:]),
                                jnp.broadcast_to(columns, lead + columns.shape[2:])], axis=-1)

    idx = joined(jnp.minimum(pos_b, s - 1), orig_c)
    k_in, v_in = _pad_to(_gather_rows(k, idx), 3, d_pad), _pad_to(_gather_rows(v, idx), 3, d_pad)
    return k_in, v_in, joined(pos_b, pos_c), ccount, orig_c.shape[-1] // bk


def _fused_column_pass(q_in, k, v, layout: BlockLayout, *, sm_scale, causal, stages, t_pad, d_pad, persistent,
                       pair, overlap, pingpong, heads_first=False, profile=None, boxes=None, prior=None,
                       row_mask=None):
    """The block pass and the `shared_columns` in one launch (``column_pass="fused"``): the keys in the layout's
    order and the columns' keys gathered in one pass (`_keys_with_columns`), each query block's list going on with
    its column tiles (`fused_lists`), every key with its original position; no second output and no merge."""
    bk, nk = layout.block_k, layout.num_kv_blocks
    k_in, v_in, k_pos, ccount, tiles = _keys_with_columns(k, v, layout, d_pad)
    q_pos = _positions_or_iota(layout.q_perm, layout.q_len, t_pad, layout.q_offset)
    starts, lo, hi, count = fused_lists(layout.kv_blocks, jnp.clip(layout.kv_block_count, 0, layout.max_blocks),
                                        ccount, block_k=bk, num_kv_blocks=nk, tiles=tiles)
    return launch(q_in, k_in, v_in, starts, count, q_pos, k_pos, groups=q_in.shape[-2] // k.shape[2],
                  num_kv_blocks=nk + tiles, kv_len=layout.kv_len, q_offset=layout.q_offset, block_k=bk, causal=causal,
                  gap=layout.gap, window=layout.window, sm_scale=sm_scale, stages=stages, block_q=layout.block_q,
                  persistent=persistent, ranges=(lo, hi), pair=pair, profile=profile, overlap=overlap,
                  pingpong=pingpong, heads_first=heads_first, prior=prior, row_mask=row_mask, **_box_args(boxes))


def _box_args(boxes) -> dict:
    return {} if boxes is None else dict(q_box=boxes[0], row_stride=boxes[1])


def strided_rows(layout: BlockLayout, q: jax.Array, column_pass: str | None) -> bool:
    """Whether the Mosaic passes read Q and write O as strided boxes of the original arrays (the layout's
    ``q_row_stride`` promise, `MosaicConfig.row_stride`): a stride and a ``q_perm``, q ``[B, T, N, D]`` with T = the
    layout's ``q_len`` (a multiple of 128) and D a multiple of 64 (no padding), no row-range pass and no
    separate column pass."""
    t, d = q.shape[1], q.shape[3]
    return (layout.q_row_stride > 0 and layout.q_perm is not None and t == layout.q_len and t % BLOCK_Q == 0
            and d % 64 == 0 and not row_range_pass(layout, column_pass)
            and (layout.kv_columns is None or column_pass == "fused"))


def _column_pass(q_in, k, v, layout: BlockLayout, *, sm_scale, causal, stages, t_pad, d_pad, persistent, pair,
                 overlap, pingpong, heads_first=False):
    """The layout's single key columns: for each (batch, head, query block) its columns are
    gathered into dense ``block_k`` tiles of one key array (``nq * ceil(max_cols / block_k)``
    tiles per query head), and the kernel runs over the tiles of its query block with the
    original position of every gathered key (unused slots get a position no query sees).
    Columns shared by every query block and head: `_shared_column_pass`."""
    if shared_columns(layout):
        return _shared_column_pass(q_in, k, v, layout, sm_scale=sm_scale, causal=causal, stages=stages,
                                   t_pad=t_pad, d_pad=d_pad, persistent=persistent, pair=pair, overlap=overlap,
                                   pingpong=pingpong, heads_first=heads_first)
    b, s, kh, _ = k.shape
    n = q_in.shape[2]
    groups = n // kh
    bk, nq = layout.block_k, layout.num_q_blocks
    mc = layout.max_columns
    tiles = -(-mc // bk)
    mcp = tiles * bk
    cols = jnp.broadcast_to(_pad_to(layout.kv_columns, 3, mcp), (b, n, nq, mcp))
    ccount = jnp.broadcast_to(jnp.clip(layout.kv_column_count, 0, mc), (b, n, nq))
    used = (jnp.arange(mcp) < ccount[..., None]) & (cols >= 0) & (cols < s)
    perm_idx = jnp.where(used, cols, 0).reshape(b, n, nq * mcp)
    if layout.kv_perm is not None:
        kv_perm = jnp.broadcast_to(jnp.clip(layout.kv_perm, 0, s - 1), (b, n, s))
        orig = jnp.take_along_axis(kv_perm, perm_idx, axis=-1)
    else:
        orig = perm_idx
    k_c = _pad_to(_gather_rows(_expand_heads(k, groups), orig), 3, d_pad)  # [B, nq*mcp, N, Dp]
    v_c = _pad_to(_gather_rows(_expand_heads(v, groups), orig), 3, d_pad)
    blocks = (jnp.arange(nq, dtype=jnp.int32)[:, None] * tiles + jnp.arange(tiles, dtype=jnp.int32))[None, None]
    count = ((ccount + bk - 1) // bk).astype(jnp.int32)
    k_pos = jnp.where(used.reshape(b, n, nq * mcp), orig, layout.kv_len).astype(jnp.int32)
    q_pos = _positions_or_iota(layout.q_perm, layout.q_len, t_pad, layout.q_offset)
    return launch(q_in, k_c, v_c, blocks, count, q_pos, k_pos, groups=1, num_kv_blocks=nq * tiles,
                  kv_len=layout.kv_len, q_offset=layout.q_offset, block_k=bk, causal=causal,
                  gap=layout.gap, window=layout.window, sm_scale=sm_scale, stages=stages, block_q=layout.block_q,
                  persistent=persistent, pair=pair, overlap=overlap, pingpong=pingpong, heads_first=heads_first)


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "num_stages", "persistent", "column_pass",
                                             "key_pairs", "profile", "overlap",
                                             "pingpong", "poison", "heads_first", "merge_in_launch"))
def block_sparse_attention_mosaic_gpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layout: BlockLayout,
    *,
    sm_scale: float,
    causal: bool = True,
    num_stages: int | None = None,
    persistent: bool | None = None,
    column_pass: str | None = None,
    key_pairs: bool | None = None,
    profile: tuple[int, str] | None = None,
    overlap: bool = False,
    pingpong: bool = True,
    poison: bool | None = True,
    heads_first: bool = False,
    prior: tuple[jax.Array, jax.Array] | None = None,
    row_mask: jax.Array | None = None,
    merge_in_launch: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """q ``[B,T,N,D]``, k/v ``[B,S,K,D]`` (bf16 / fp16) -> out ``[B,T,N,D]``, lse ``[B,N,T]`` f32.

    ``prior``: None, or (out ``[B,T,N,D]`` in q's dtype, lse float32 ``[B,N,T]``), attention over keys this layout
    does not list; the result is then `merge_attention` of the prior with this layout's, merged afterwards unless
    ``merge_in_launch``: then, where the kernel's rows are the original rows (`prior_in_launch`: no ``q_perm``, or
    `strided_rows`), its launch merges the prior in before its store (`mosaic_kernel.MosaicConfig.prior`: one read
    of the prior, no merge pass over two results; its lse gathered into the layout's row order). Off by default:
    one H100, 2026-12-07, 128k (`tools/issue16_targets.sh prior`, `pattern-parts-128k-merge-in-launch_*`), Grid
    8.30 -> 8.25 ms and Grid(frame) 7.06 -> 6.95 ms: the kernels took about the time the merge pass saved.
    ``row_mask``: None, or
    bool ``[B, T]``: the layout is for those rows alone; the others keep the prior (or the empty result without one)
    whatever the layout lists there (`merge.merge_onto`; in the launch with ``merge_in_launch``, as a row operand).

    A key order per query head over grouped heads (``kv_perm [B|1, N, S]``, Grid with searched strides): k / v are
    gathered once per key / value head where each group's query heads agree (`same_key_orders`, a ``lax.cond`` on
    the device), else once per query head. One H100, 2026-12-07, Grid (searched) on `bench patterns`' input, every
    head at stride 256: 8.66 -> 8.17 ms at 128k, 233.8 -> 230.8 ms at 1M (`pattern-parts-*-grid-search-shared-key-
    order*`).

    ``heads_first``: the work items run query heads fastest, so the query heads of one key / value head run at the
    same time and read the tiles their lists share from L2 (`MosaicConfig`); False (default): query blocks fastest.
    Not faster where measured (one H200, 2026-11-28, `tools/heads_first_bench.py`, `heads-first_*.jsonl`, 28 / 4
    heads; time with query blocks fastest over time with heads fastest): `Momo()`'s key-sparse layout 0.99x at 128k
    and 1.01x at 1M (262.5 / 259.6 ms: that pass is not bound by its HBM reads), dense 0.99-1.00x, random 10% / 3%
    0.92-0.96x at 32k and 128k. The same results bit for bit (GPU test). A layout with a ``q_block_range`` run as
    `block_sparse_attention_rows_mosaic_gpu`'s work items keeps that pass's order.

    ``persistent``: one CTA per multiprocessor, each running its share of the work items (longest lists first,
    `item_order`, in snake rounds), its next item's first K / V tiles loading while the consumers finish the last
    one and each consumer's next Q during its last step; False: one CTA per item; None (default):
    `auto_persistent` (short work: at most 7,168 items with lists of at most 128 steps, or lists of 2 to 6 steps at
    any length). Its first form (items ``pid, pid + grid, ...``, Q loaded at each item's start) lost everywhere but
    on short lists (one H200, 2026-11-26, ``tools/bench_mosaic_gpu.py --grids``: dense 0.89 / 0.92 / 0.95x cuDNN
    at 32k / 128k / 512k against 0.97 / 1.04 / 1.15x); the numbers of this form are in `auto_persistent`.

    ``key_pairs``: each step computes two consecutive entries of a 32- or 64-key list as one tile of 64 / 128 keys
    (one online softmax update and one schedule hand-over per step), with ``num_stages`` stages of that many keys.
    With 64-row query blocks and 128-key steps V has one stage per consumer (`mosaic_options.pair_v_stages`). None
    (default): `auto_key_pairs`; 32-key lists always run in pairs (False is refused).

    ``profile``: (ranges, directory): a Mosaic GPU profiler trace of the block pass (see `launch`).

    ``overlap``: FlashAttention-3's intra-warpgroup pipelining in its paper's order. Each consumer issues step j +
    1's ``S = Q K^T``, then step j's ``P V``, waits for S alone and runs step j + 1's mask and softmax while ``P V``
    is on the tensor cores (`mosaic_fa3.qk_then_pv`). Refused with original positions (permutations, the column
    pass) where a ring has one V stage. With 64-row query blocks ptxas keeps its wgmma asynchronous
    (`mosaic-ptxas-fa3-order_*`; each step's new P needs registers of its own, see `overlapped`), but it is not
    faster, so it is off by default. One H100, 2026-11-27, MInference's top-100 mask with 64-row query blocks
    (`minference-side-by-side-overlap-fa3_*`): 1.91 / 7.77 / 33.64 ms against the default's 1.71 / 7.57 / 33.15 at
    32k / 128k / 512k (same run). With 128-row blocks it is slower still (dense 32k 0.62x cuDNN against 0.85x,
    `mosaic-gpu-overlap-fa3_*`; with 128-key steps ptxas runs out of registers, note C7512). An earlier form, S two
    steps ahead of ``P V`` (`minference-side-by-side-overlap*`, 2.63 / 10.89 / 46.87 ms), had too few registers
    for the wgmma pipeline (note C7511).

    ``pingpong`` (default): the two consumers alternate on a schedule barrier, one's softmax while the other's
    products run (FlashAttention-3's inter-warpgroup schedule); False lets them run freely.

    ``poison``: the kernel multiplies whole V tiles, so a non-finite value row of a masked key would reach the
    output through ``0 * NaN``; `poison_keys` (a pass over k and v) turns such a row into a NaN key and a 0 value
    row first. True (default): always; None: only when some value is not finite, decided on the device
    (`nonfinite.checked_if_nonfinite`: one read of v and a ``lax.cond``; both branches are compiled); False: never
    (the caller knows every value is finite). One H100, 2026-11-28, 32k, 28 / 4 heads, random 10% / 3% layouts
    with 64- and 128-key blocks (``tools/short_work_trace.py``, `short-work-trace-poison_*`): None 1.484 / 1.378 /
    0.596 / 0.554 ms against True's 1.563 / 1.407 / 0.606 / 0.578, but the ``lax.cond`` waits for its predicate on
    the host (about 35 us with the GPU idle, as much as the poisoning pass it saves) and the call compiled in 3.69 s
    against 1.71 s, so poisoning stays the default.

    ``column_pass``: how the layout's single key columns are computed: ``"triton"`` runs the Pallas Triton kernel on
    the columns alone (it gathers them inside the kernel); ``"mosaic"`` gathers them into key tiles per query block
    and runs this kernel over them (`_column_pass`; ``nq * max_cols`` gathered keys per head, out of memory at 512k
    on an H100), or, for columns shared by every query block and head (`shared_columns`, e.g. SF-fixed's summary
    columns), once per key / value head (`_shared_column_pass`); either pass is merged with the block pass by
    `merge_attention`. ``"fused"`` (shared columns over key-block lists, `fused_columns`) appends the gathered
    columns to the keys and runs them in the block pass's own launch (`_fused_column_pass`): one output, no merge.
    None (default): ``"fused"`` where it applies, else ``"mosaic"`` for shared columns and ``"triton"`` for the
    rest. One H100, 2026-11-28, SF-fixed's layout at 128k (28 / 4 heads, `tools/pattern_parts_profile.py`,
    `pattern-parts-128k-reps7_*`, 7 samples of queued calls): Triton column pass 25.96 ms, Mosaic 19.64, fused 18.47
    (18.07 on the persistent grid; 17.21 and 19.03 in two 3-sample calls, so the grid stays `auto_persistent`'s
    choice), cuDNN's dense 216.91; at 32k 2.28 -> 1.95 ms, at 512k / 1M even. One H100, 2026-11-27,
    Vertical-Slash 64-row windows: Triton column pass 3.50 / 38.8 / 256 ms, Mosaic 3.93 / 41.5 / 275 ms at 32k /
    128k / 512k.

    Inputs are assumed validated (see `api.block_sparse_attention` and `check_supported`).
    Traced layouts cannot make the kernel read out of bounds: ids out of range are loaded
    as block 0 and masked entirely, counts and permutation entries are clamped, columns out
    of range contribute nothing.
    """
    if profile is not None:
        if not (isinstance(profile, tuple) and len(profile) == 2 and isinstance(profile[1], str) and profile[1]):
            raise ValueError(f"profile: expected None or (ranges per warpgroup, trace directory); received "
                             f"{profile!r}")
        check_int("profile[0] (profiler ranges per warpgroup)", profile[0], 1)
    if column_pass is None:
        column_pass = default_column_pass(layout)
    if column_pass not in COLUMN_PASSES:
        raise ValueError(f"column_pass: expected None or one of {COLUMN_PASSES}; received {column_pass!r}")
    if column_pass == "fused" and layout.kv_columns is not None and not fused_columns(layout):
        raise ValueError("column_pass: 'fused' needs columns shared by every query block and head in a key order "
                         "the heads share, and lists of key blocks (no kv_windows); use 'mosaic' or 'triton'")
    t, d = q.shape[1], q.shape[3]
    d_pad = fa3.padded_head_dim(d)
    if key_pairs is None:
        key_pairs = auto_key_pairs(layout, num_stages)
    elif key_pairs:  # block_k 32 or 64, and num_stages paired stages that fit
        check_supported(q, layout, num_stages, pair=True)
    elif layout.block_k == 32:
        raise ValueError("key_pairs: expected True or None for layout.block_k=32 (32-key entries run two per step: "
                         "the P V product needs 64 keys); received False")
    _check_poison(poison)
    if not isinstance(heads_first, bool):
        raise ValueError(f"heads_first: expected True or False; received {heads_first!r}")
    if row_range_pass(layout, column_pass) and not persistent and profile is None:  # its rows alone, lists in chunks
        rows, out, lse = _rows_result(q, k, v, layout, sm_scale=sm_scale, causal=causal, num_stages=num_stages,
                                      key_pairs=key_pairs, overlap=overlap, pingpong=pingpong, poison=poison)
        if row_mask is None:
            return scatter_rows(rows, out, lse, t) if prior is None else merge_rows(*prior, rows, out, lse)
        return merge_onto(prior, [scatter_rows(rows, out, lse, t)], row_mask)
    fused = layout.kv_columns is not None and column_pass == "fused"
    if persistent is None:  # (fused: the lists go on with the column tiles)
        entries = layout.max_blocks + (-(-layout.max_columns // layout.block_k) if fused else 0)
        persistent = auto_persistent(q, layout, key_pairs, num_stages, max_entries=entries)
    elif persistent:  # its own O tiles take shared memory
        check_supported(q, layout, num_stages, pair=key_pairs, persistent=True)
    stages = num_stages or default_stages(layout.block_k * (2 if key_pairs else 1), d_pad, layout.block_q)
    if persistent:
        stages = min(stages, max_stages(layout.block_k, d_pad, layout.block_q, pair=key_pairs, persistent=True))
    t_pad = round_up(layout.num_q_blocks * layout.block_q, BLOCK_Q)
    q_orig, k_orig, v_orig = q, k, v
    strided = strided_rows(layout, q, column_pass)  # (D a multiple of 64: no head-dim padding)
    boxes = None
    if strided:  # the original rows, viewed so that each query block is one strided box (no gather)
        st = layout.q_row_stride
        q_in = q.reshape(q.shape[0], t // st, st, *q.shape[2:])
        boxes = (jnp.clip(layout.q_perm[..., ::layout.block_q], 0, t - 1).astype(jnp.int32), st)
    else:
        if layout.q_perm is not None:
            q = _gather_rows(q, jnp.clip(layout.q_perm, 0, t - 1))  # [B, T, N, D] in permuted row order per head
        q_in = _pad_to(_pad_to(q, 3, d_pad), 1, t_pad)
    prior_in = None
    if not isinstance(merge_in_launch, bool):
        raise ValueError(f"merge_in_launch: expected True or False; received {merge_in_launch!r}")
    merging = prior is not None or row_mask is not None
    if merge_in_launch and merging and prior_in_launch(q, layout, column_pass):  # if its tiles fit
        fit = max_stages(layout.block_k, d_pad, layout.block_q, pair=key_pairs, persistent=persistent, prior=True)
        if fit >= 2:
            stages = min(stages, fit)
            prior_in = _prior_operands(prior, row_mask, layout, q_in.shape, t_pad, d_pad, strided)
    kw = {"sm_scale": sm_scale, "causal": causal, "stages": stages, "t_pad": t_pad, "d_pad": d_pad,
          "persistent": persistent, "pair": key_pairs, "overlap": overlap,
          "pingpong": pingpong, "heads_first": heads_first}

    def passes(kp, vp, grouped=False):
        """The Mosaic passes on k / v as `_on_keys` gives them (``grouped``: `_prepared_kv`'s)."""
        merged_in = prior_in or {}
        if fused:  # (`shared_columns`: one key order for every head)
            out, lse = _fused_column_pass(q_in, kp, vp, layout, profile=profile, boxes=boxes, **merged_in, **kw)
        else:
            out, lse = _block_pass(q_in, kp, vp, layout, profile=profile, boxes=boxes, grouped=grouped, **merged_in,
                                   **kw)
        out = out.reshape(out.shape[0], t, *out.shape[3:]) if strided else out
        out, lse = out[:, :t, :, :d], lse[:, :, :t]
        if layout.kv_columns is not None and column_pass == "mosaic":
            out_c, lse_c = _column_pass(q_in, kp, vp, layout, **kw)
            out, lse = merge_attention(out, lse, out_c[:, :t, :, :d], lse_c[:, :, :t])
        return out, lse

    out, lse = _on_keys(_by_key_orders(passes, layout, q.shape[2], k.shape[2]), k, v, poison)
    if layout.q_perm is not None:  # (strided: out is in the original order already, lse in the layout's)
        inv = inverse_permutation(jnp.clip(layout.q_perm, 0, t - 1))  # [B|1, N|1, T]
        out = out if strided else _gather_rows(out, inv)
        lse = jnp.take_along_axis(lse, jnp.broadcast_to(inv, lse.shape), axis=2)
    if layout.kv_columns is not None and column_pass == "triton":  # rows in the original order on both sides
        columns_only = layout.replace(kv_block_count=jnp.zeros_like(layout.kv_block_count))
        out_c, lse_c = block_sparse_attention_triton(q_orig, k_orig, v_orig, columns_only, sm_scale=sm_scale,
                                                     causal=causal)
        out, lse = merge_attention(out, lse, out_c, lse_c)
    if merging and prior_in is None:
        out, lse = merge_onto(prior, [(out, lse)], row_mask)
    return out, lse


def default_column_pass(layout: BlockLayout) -> str:
    """`block_sparse_attention_mosaic_gpu`'s ``column_pass`` when None is given."""
    return ("fused" if fused_columns(layout) else "mosaic") if shared_columns(layout) else "triton"


def prior_in_launch(q: jax.Array, layout: BlockLayout, column_pass: str | None = None) -> bool:
    """Whether `block_sparse_attention_mosaic_gpu` can merge a ``prior`` (and a ``row_mask``) in its launch: its rows
    are the original rows (no ``q_perm``) or strided boxes of them (`strided_rows`), it is no row-range pass (whose
    rows are merged with `merge_rows`) and has no separate column pass (whose result is merged after the launch).
    (Where its tiles and the prior's do not fit in shared memory it merges afterwards.)"""
    column_pass = default_column_pass(layout) if column_pass is None else column_pass
    if row_range_pass(layout, column_pass) or (layout.kv_columns is not None and column_pass != "fused"):
        return False
    return layout.q_perm is None or strided_rows(layout, q, column_pass)


def _prior_operands(prior, row_mask, layout: BlockLayout, q_in_shape, t_pad: int, d_pad: int, strided: bool) -> dict:
    """`launch`'s ``prior`` and ``row_mask`` from (out ``[B,T,N,D]``, lse ``[B,N,T]``) and bool ``[B, T]`` in the
    original row order: out viewed as q_in (`strided_rows`; else padded to ``[B, t_pad, N, d_pad]``, no ``q_perm``),
    lse and the mask (int32 ``[B, N, Tp]``) in the layout's row order (gathered by ``q_perm``; padded rows: lse -inf,
    outside the mask)."""
    b, n = q_in_shape[0], q_in_shape[-2]
    t = layout.q_len

    def in_row_order(x, fill):  # [B, N, T] in the original order -> the layout's
        if strided:
            return jnp.take_along_axis(x, jnp.broadcast_to(jnp.clip(layout.q_perm, 0, t - 1), x.shape), axis=2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, t_pad - t)), constant_values=fill)

    operands = {}
    if prior is not None:
        out, lse = prior
        operands["prior"] = (out.reshape(q_in_shape) if strided else _pad_to(_pad_to(out, 3, d_pad), 1, t_pad),
                             in_row_order(lse.astype(jnp.float32), -jnp.inf))
    if row_mask is not None:
        mask = jnp.broadcast_to(row_mask[:, None, :].astype(jnp.int32), (b, n, t))
        operands["row_mask"] = in_row_order(mask, 0)
    return operands


def _check_poison(poison) -> None:
    if poison is not None and not isinstance(poison, bool):
        raise ValueError(f"poison: expected None, True or False; received {poison!r}")


def _on_keys(run, k, v, poison: bool | None):
    """``run(k', v')`` with the keys poisoned (`poison_keys`: a non-finite value row becomes a NaN key and a 0 value
    row) when ``poison`` is True, as given when False, and, when None, poisoned only if some value is not finite
    (`nonfinite.checked_if_nonfinite`, decided on the device; both branches are compiled)."""
    def branch(poisoned: bool):
        return run(*poison_keys(k, v)) if poisoned else run(k, v)

    return checked_if_nonfinite(branch, v) if poison is None else branch(poison)


def _by_key_orders(run, layout: BlockLayout, q_heads: int, kv_heads: int):
    """``run(k, v, grouped)`` as a function of (k, v): with `per_head_key_orders`, a ``lax.cond`` on
    `same_key_orders` (decided on the device, both branches compiled) between one copy of k / v per key / value head
    (``grouped``) and one per query head; else ``run(k, v)``."""
    if not per_head_key_orders(layout, q_heads, kv_heads):
        return run
    same = same_key_orders(layout, kv_heads)
    return lambda k, v: jax.lax.cond(same, lambda: run(k, v, True), lambda: run(k, v, False))


def _rows_result(q, k, v, layout: BlockLayout, *, sm_scale, causal, num_stages, key_pairs, overlap, pingpong,
                 poison):
    """`_rows_pass` with the kernel's defaults (stages; keys poisoned as ``poison`` says, None: unless every value
    is finite); key_pairs resolved."""
    d_pad = fa3.padded_head_dim(q.shape[3])
    stages = num_stages or default_stages(layout.block_k * (2 if key_pairs else 1), d_pad, layout.block_q)

    def rows(kp, vp, grouped=False):
        return _rows_pass(q, kp, vp, layout, sm_scale=sm_scale, causal=causal, stages=stages, d_pad=d_pad,
                          pair=key_pairs, overlap=overlap, pingpong=pingpong, grouped=grouped)

    return _on_keys(_by_key_orders(rows, layout, q.shape[2], k.shape[2]), k, v, poison)


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "num_stages", "key_pairs", "overlap", "pingpong",
                                             "poison"))
def block_sparse_attention_rows_mosaic_gpu(q: jax.Array, k: jax.Array, v: jax.Array, layout: BlockLayout, *,
                                           sm_scale: float, causal: bool = True, num_stages: int | None = None,
                                           key_pairs: bool | None = None, overlap: bool = False,
                                           pingpong: bool = True, poison: bool | None = True
                                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The rows of a layout with a ``q_block_range`` (`row_range_pass`): q ``[B,T,N,D]``, k/v ``[B,S,K,D]`` ->
    (rows int32 ``[B|1, N|1, R]``, `BlockLayout.range_rows`: the query index of each row, T for none; out ``[B, R,
    N, D]``; lse ``[B, N, R]``). Each (query block, chunk of `ROW_CHUNK` list entries) is one work item and the
    chunks are merged by lse, so a few query blocks with long lists (TriShape's last rows, Grid's horizontal lines)
    fill the GPU; `pallas_kernels.block_sparse.merge.merge_rows` merges the rows into a whole result. Options as in
    `block_sparse_attention_mosaic_gpu`; inputs assumed validated."""
    if not row_range_pass(layout):
        raise ValueError("layout: expected a q_block_range and key blocks only (no kv_columns, no kv_windows); "
                         f"received q_block_range={layout.q_block_range}, kv_columns "
                         f"{'set' if layout.kv_columns is not None else None}, kv_windows={layout.kv_windows}")
    _check_poison(poison)
    if key_pairs is None:
        key_pairs = auto_key_pairs(layout, num_stages)
    return _rows_result(q, k, v, layout, sm_scale=sm_scale, causal=causal, num_stages=num_stages,
                        key_pairs=key_pairs, overlap=overlap, pingpong=pingpong, poison=poison)
