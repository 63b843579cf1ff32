"""Layout checks for `block_sparse_attention`, run before anything is traced into a kernel
(q / k / v are checked by `pallas_kernels.checks.check_qkv`).

Shape and dtype checks always run (they are static). Value checks (the contract of
`pallas_kernels.block_sparse.layout`: counts within the list, ids and columns in range and
distinct, permutations) run when the layout arrays are concrete; inside `jax.jit` they are
traced: the implementations then neutralise what is cheap (see the layout module) and
`BlockLayout.check` under ``checkify`` checks the rest.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.block_sparse.layout import BlockLayout, strided_rows_hold
from pallas_kernels.checks import check_int, concrete, fmt_shape
from pallas_kernels.tiling import cdiv


def check_layout_shapes(layout: BlockLayout, batch: int, heads: int, t: int, s: int) -> None:
    """Static checks of a layout against q ``[B,T,N,·]`` and k ``[B,S,·,·]``."""
    if not isinstance(layout, BlockLayout):
        raise ValueError(f"layout: expected a BlockLayout; received {type(layout).__name__}")
    if layout.q_len != t or layout.kv_len != s:
        raise ValueError(
            f"layout: expected q_len={t}, kv_len={s} (from q and k); received layout built "
            f"for q_len={layout.q_len}, kv_len={layout.kv_len}"
        )
    nq = cdiv(t, layout.block_q)

    def lead_ok(shape) -> bool:
        return shape[0] in (1, batch) and shape[1] in (1, heads)

    def check(name, arr, tail, dtype=jnp.int32, q_broadcast=False):
        if arr is None:
            return
        shown = [f"{x}|1" if (q_broadcast and i == 0) else str(x) for i, x in enumerate(tail)]
        exp = f"[{batch}|1, {heads}|1, " + ", ".join(shown) + "]"

        def dim_ok(i, x):
            got = arr.shape[2 + i]
            return not isinstance(x, int) or got == x or (q_broadcast and i == 0 and got == 1)

        if arr.ndim != 2 + len(tail) or not lead_ok(arr.shape) or not all(
            dim_ok(i, x) for i, x in enumerate(tail)
        ):
            raise ValueError(f"layout.{name}: expected shape {exp}; received {fmt_shape(arr.shape)}")
        if arr.dtype != dtype:
            raise ValueError(f"layout.{name}: expected dtype int32; received {arr.dtype}")

    check("kv_blocks", layout.kv_blocks, (nq, "max_blocks"), q_broadcast=True)
    check("kv_block_count", layout.kv_block_count, (nq,), q_broadcast=True)
    if (layout.kv_columns is None) != (layout.kv_column_count is None):
        raise ValueError(
            "layout.kv_columns / kv_column_count: expected both or neither; received "
            f"kv_columns={'set' if layout.kv_columns is not None else None}, "
            f"kv_column_count={'set' if layout.kv_column_count is not None else None}"
        )
    check("kv_columns", layout.kv_columns, (nq, "max_cols"), q_broadcast=True)
    check("kv_column_count", layout.kv_column_count, (nq,), q_broadcast=True)
    check("q_perm", layout.q_perm, (t,))
    check("kv_perm", layout.kv_perm, (s,))


def check_layout_values(layout: BlockLayout) -> None:
    """Value checks on concrete layouts (skipped for traced arrays)."""
    if not isinstance(layout.gap, (int, np.integer)) or isinstance(layout.gap, bool) or layout.gap < 0:
        raise ValueError(f"layout.gap: expected an int >= 0 (causal gap); received {layout.gap!r}")
    if not isinstance(layout.window, (int, np.integer)) or isinstance(layout.window, bool) or layout.window < 0:
        raise ValueError(f"layout.window: expected an int >= 0 (causal window, 0 = none); received {layout.window!r}")
    check_int("layout.window_align", layout.window_align, 1)
    if layout.window_align > 1 and not layout.kv_windows:
        raise ValueError(f"layout.window_align: expected 1 for a layout without kv_windows; received "
                         f"{layout.window_align}")
    _check_q_block_range(layout)
    _check_q_row_stride(layout)
    nk = layout.num_kv_blocks
    blocks, count = concrete(layout.kv_blocks), concrete(layout.kv_block_count)
    if blocks is not None and count is not None:
        mb = blocks.shape[-1]
        if count.min(initial=0) < 0 or count.max(initial=0) > mb:
            raise ValueError(
                f"layout.kv_block_count: expected 0 <= count <= max_blocks={mb}; received "
                f"values in [{count.min()}, {count.max()}]"
            )
        bb, cc = np.broadcast_arrays(blocks, count[..., None])
        used = np.arange(mb) < cc
        ids = bb[used]
        if layout.kv_windows:
            _check_windows(layout, bb, used, ids)
        elif ids.size and (ids.min() < 0 or ids.max() >= nk):
            raise ValueError(
                f"layout.kv_blocks: expected block ids in [0, {nk}) (kv_len={layout.kv_len}, "
                f"block_k={layout.block_k}); received ids in [{ids.min()}, {ids.max()}]"
            )
        if not layout.kv_windows and (np.diff(np.sort(np.where(used, bb, -1 - np.arange(mb)), axis=-1),
                                                axis=-1) == 0).any():
            raise ValueError("layout.kv_blocks: expected distinct block ids per query block; "
                             "received a repeated id (it would be counted twice)")
    cols, ccount = concrete(layout.kv_columns), concrete(layout.kv_column_count)
    if cols is not None and ccount is not None:
        mc = cols.shape[-1]
        if ccount.min(initial=0) < 0 or ccount.max(initial=0) > mc:
            raise ValueError(
                f"layout.kv_column_count: expected 0 <= count <= max_cols={mc}; received "
                f"values in [{ccount.min()}, {ccount.max()}]"
            )
        c_b, c_c = np.broadcast_arrays(cols, ccount[..., None])
        used = np.arange(mc) < c_c
        ids = c_b[used]
        if ids.size and (ids.min() < 0 or ids.max() >= layout.kv_len):
            raise ValueError(
                f"layout.kv_columns: expected key indices in [0, {layout.kv_len}); received "
                f"indices in [{ids.min()}, {ids.max()}]"
            )
        if blocks is not None and count is not None and ids.size and layout.kv_windows:
            _check_columns_outside_windows(layout, blocks, count, c_b, used)
        elif blocks is not None and count is not None and ids.size:
            lead = np.broadcast_shapes(cols.shape[:3], blocks.shape[:3])
            listed = np.zeros(lead + (nk + 1,), dtype=bool)
            b_b, b_u = np.broadcast_arrays(blocks, np.arange(blocks.shape[-1]) < count[..., None])
            b_b = np.broadcast_to(np.where(b_u, b_b, nk), lead + blocks.shape[3:])
            np.put_along_axis(listed, b_b, True, axis=-1)
            listed[..., nk] = False
            c_b = np.broadcast_to(np.where(used, c_b // layout.block_k, nk), lead + cols.shape[3:])
            if np.take_along_axis(listed, c_b, axis=-1).any():
                raise ValueError("layout.kv_columns: expected columns outside the listed key "
                                 "blocks; received a column inside one (it would be counted twice)")
    for name, n in (("q_perm", layout.q_len), ("kv_perm", layout.kv_len)):
        perm = concrete(getattr(layout, name))
        if perm is not None and not (np.sort(perm, axis=-1) == np.arange(n)).all():
            raise ValueError(f"layout.{name}: expected a permutation of 0..{n - 1} per (batch, head)")


def _check_q_block_range(layout: BlockLayout) -> None:
    """``q_block_range``: None or ``(lo, hi)`` ints with ``0 <= lo < hi <= nq``; on concrete counts, nothing listed
    outside it."""
    rng, nq = layout.q_block_range, layout.num_q_blocks
    if rng is None:
        return
    if not (isinstance(rng, tuple) and len(rng) == 2
            and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in rng)
            and 0 <= rng[0] < rng[1] <= nq):
        raise ValueError(f"layout.q_block_range: expected None or (lo, hi) ints with 0 <= lo < hi <= {nq} (query "
                         f"blocks); received {rng!r}")
    outside = (np.arange(nq) < rng[0]) | (np.arange(nq) >= rng[1])
    for name in ("kv_block_count", "kv_column_count"):
        c = concrete(getattr(layout, name))
        if c is None:
            continue
        c = np.broadcast_to(c, c.shape[:-1] + (nq,))
        bad = np.nonzero((c > 0).any(axis=(0, 1)) & outside)[0]
        if bad.size:
            raise ValueError(f"layout.{name}: expected 0 for the query blocks outside q_block_range={rng}; "
                             f"received a count > 0 at query block {int(bad[0])}")


def _check_q_row_stride(layout: BlockLayout) -> None:
    """``q_row_stride``: an int >= 0; with a stride, a ``q_perm`` and ``q_len`` a multiple of ``block_q`` and of the
    stride, and on a concrete ``q_perm`` every query block's rows stepping by it."""
    st = layout.q_row_stride
    check_int("layout.q_row_stride", st, 0)
    if not st:
        return
    if layout.q_perm is None or layout.q_len % layout.block_q or layout.q_len % st:
        raise ValueError(f"layout.q_row_stride: expected 0, or a q_perm and q_len={layout.q_len} a multiple of "
                         f"block_q={layout.block_q} and of the stride; received {st} "
                         f"({'no q_perm' if layout.q_perm is None else 'q_len not a multiple'})")
    perm = concrete(layout.q_perm)
    if perm is not None:
        holds = strided_rows_hold(layout.replace(q_perm=perm), xp=np)
        if not holds.all():
            b, h, i = (int(x[0]) for x in np.nonzero(~holds))
            raise ValueError(f"layout.q_perm: expected the rows of each query block to step by q_row_stride={st} "
                             f"from its first row; query block {i} (batch {b}, head {h}) does not")


def _check_windows(layout: BlockLayout, starts: np.ndarray, used: np.ndarray, ids: np.ndarray) -> None:
    """Key-window starts (``kv_windows``): in ``(-block_k, kv_len)``, strictly ascending per query block,
    those > 0 multiples of ``window_align``."""
    bk, s = layout.block_k, layout.kv_len
    if ids.size and (ids.min() <= -bk or ids.max() >= s):
        raise ValueError(f"layout.kv_blocks: expected window starts in ({-bk}, {s}) (kv_windows, block_k={bk}); "
                         f"received starts in [{ids.min()}, {ids.max()}]")
    if (used[..., 1:] & (np.diff(starts, axis=-1) <= 0)).any():
        raise ValueError("layout.kv_blocks: expected strictly ascending window starts per query block "
                         "(kv_windows)")
    bad = ids[(ids > 0) & (ids % layout.window_align != 0)]
    if bad.size:
        raise ValueError(f"layout.kv_blocks: expected window starts > 0 that are multiples of layout.window_align="
                         f"{layout.window_align}; received e.g. {int(bad[0])}")


def _check_columns_outside_windows(layout: BlockLayout, starts, count, cols, col_used) -> None:
    """No listed column inside a listed key window (it would be counted twice). One searchsorted over
    all rows: row r's starts and columns are shifted into their own range ``[r * big, (r + 1) * big)``."""
    bk, s = layout.block_k, layout.kv_len
    lead = np.broadcast_shapes(cols.shape[:3], starts.shape[:3], count.shape)
    mb, mc = starts.shape[-1], cols.shape[-1]
    st = np.broadcast_to(starts, lead + (mb,)).reshape(-1, mb).astype(np.int64)
    used = np.arange(mb) < np.broadcast_to(count, lead).reshape(-1, 1)
    cc = np.broadcast_to(cols, lead + (mc,)).reshape(-1, mc).astype(np.int64)
    cu = np.broadcast_to(col_used, lead + (mc,)).reshape(-1, mc)
    big = s + 2 * bk
    base = np.arange(st.shape[0], dtype=np.int64)[:, None] * big
    flat = (base + np.where(used, st + bk, big - 1)).reshape(-1)  # ascending: rows in order, unused last
    key = (base + cc + bk)[cu]
    pos = np.searchsorted(flat, key, side="right") - 1
    row_of_key = np.broadcast_to(base, cc.shape)[cu]
    start = flat[np.maximum(pos, 0)]
    if ((pos >= 0) & (start >= row_of_key) & (key < start + bk)).any():
        raise ValueError("layout.kv_columns: expected columns outside the listed key windows; received a "
                         "column inside one (it would be counted twice)")
