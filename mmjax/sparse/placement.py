"""`Placement`: how a pattern inside a boundary wrapper sees its rows and keys.

A boundary wrapper hands the inner pattern the *original* q / k plus a `Placement`:

* ``rows`` int32 ``[B, T]``: the wrapper's row order (original query index of each row;
  QBoundary moves one modality's rows last). Permuted query block i holds rows
  ``rows[:, i*block_q:(i+1)*block_q]``.
* ``k_group`` int32 ``[B, S]``: an outer group per key (KBoundary: the modality kind, so keys
  are packed by modality; otherwise 0), ``num_groups`` groups (static).
* ``k_valid`` bool ``[B, S]`` or None: the keys the pattern may list (TwoDBoundary: keys of
  the pair's key modality).
* ``est_order`` int32 ``[B, T]`` or None: rows whose last ones the pattern estimates from, where
  they are not the last of ``rows`` (a wrapper that keeps a modality's rows in place: its
  rows in the original order, estimation from that modality's last rows).
* ``frame_tokens`` (static int or None): tokens per video frame, from the wrapper's
  `Modality` (a Grid with ``stride="frame"`` uses it). Invalid keys are packed last and never computed: a key block
  straddling the valid / invalid boundary is replaced by single columns of its valid keys,
  so each key is attended exactly by the pattern of its own modality.
* ``keys_in_place`` (static bool): the valid keys are one run of positions ``[start, end)`` in every batch row and
  every query row the wrapper keeps lies before ``end`` (a video between a prompt and a question, for the video's
  rows). The plain key order (`Placement.plain_keys`) is then the original one: its packed index is the position,
  ranges are cut below ``start`` (`KeyOrder.start`) and keys from ``end`` on are left to causality (no row that
  is kept sees them); the wrapper cuts the parts in that order below ``start`` (`restrict_from`), so their key
  blocks are the pattern's aligned blocks, with no key gather.

Patterns state their rules on **original positions** (local windows, slash offsets, Grid line
phases, causal cut-offs) and pack keys by ``(invalid, group, inner class, position)``: the
inner class is the pattern's own key split (Grid packs its own codes: phase groups). Within a segment (one
group and one inner class) keys ascend by position, so a window of positions is one
contiguous run of packed keys per segment, found by a binary search on the packed codes.
Order-based rules (A-shape's ``sink``: the first keys of the packed order) act on the packed
order: inside KBoundary the sink keys are the first keys of the first modality.

A permuted query block is summarised by the smallest and largest position of its rows;
windows are taken from that interval (exact when the block's rows are contiguous, a
superset when the block spans a gap between two runs of its modality).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import BlockLayout
from pallas_kernels.tiling import cdiv, inverse_permutation


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Placement:
    """Row order, key groups and valid keys (see the module docstring); shapes ``[B, T]`` /
    ``[B, S]``; ``num_groups`` static."""

    rows: jax.Array
    k_group: jax.Array
    k_valid: jax.Array | None = None
    est_order: jax.Array | None = None
    num_groups: int = dataclasses.field(default=1, metadata=dict(static=True))
    frame_tokens: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    keys_in_place: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @functools.cached_property
    def row_perm(self) -> jax.Array:
        """int32 ``[B, 1, T]``: ``rows`` as a layout's ``q_perm``; `q_positions` returns this very array for a
        pattern without a row order of its own, so a wrapper can tell its parts in its own row order (``part.q_perm
        is placement.row_perm``) from parts with an inner order (Grid's lines). A placement rebuilt from its
        leaves (through a jit boundary) has a new one: its parts then look like parts with an order of their own."""
        return self.rows[:, None].astype(jnp.int32)

    @functools.cached_property
    def plain_keys(self) -> "KeyOrder":
        """`pack_keys` without an inner split, one object per placement, so a wrapper can tell the parts whose keys
        are in this order (``part.kv_perm is placement.plain_keys.perm``): with every key valid and one group it
        is the original order; with ``keys_in_place`` too (the valid keys from `KeyOrder.start` on)."""
        return _in_place_keys(self) if self.keys_in_place else _pack(self, None, 1)

    @classmethod
    def identity(cls, b: int, t: int, s: int) -> "Placement":
        return cls(rows=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                   k_group=jnp.zeros((b, s), jnp.int32))

    def est_rows(self, last_q: int) -> jax.Array:
        """int32 ``[B, last_q]``: the last rows of ``est_order`` (default: the row order), used for estimation."""
        t = self.rows.shape[1]
        if not 1 <= last_q <= t:
            raise ValueError(f"last_q: expected 1 <= last_q <= T={t} (query length); received {last_q}")
        order = self.rows if self.est_order is None else self.est_order
        return order[:, t - last_q:]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyOrder:
    """Packed key order: ``perm`` int32 ``[B, N|1, S]`` (original key of each packed index),
    ``code`` the ascending packed codes, ``n_valid`` int32 ``[B, N|1]``; ``start`` int32 ``[B, 1]`` or None: the
    packed index of the first valid key (keys in place, `Placement.keys_in_place`; None: 0, the valid keys first)."""

    perm: jax.Array
    code: jax.Array
    n_valid: jax.Array
    num_groups: int = dataclasses.field(metadata=dict(static=True))
    num_inner: int = dataclasses.field(metadata=dict(static=True))
    start: jax.Array | None = None

    def first(self) -> jax.Array:
        """int32 ``[B, 1|N]``: the packed index of the first valid key."""
        return jnp.zeros_like(self.n_valid) if self.start is None else self.start

    @property
    def kv_len(self) -> int:
        return int(self.perm.shape[-1])


def pack_keys(pl: Placement, inner: jax.Array | None = None, num_inner: int = 1) -> KeyOrder:
    """Pack keys by (invalid, group, inner class, position). inner: int32 ``[B|1, N|1, S]``
    in ``[0, num_inner)`` (original key order) or None. Without ``inner`` this is the
    placement's own `Placement.plain_keys` (the same object on every call)."""
    if inner is None and num_inner == 1:
        return pl.plain_keys
    return _pack(pl, inner, num_inner)


def _pack(pl: Placement, inner: jax.Array | None, num_inner: int) -> KeyOrder:
    b, s = pl.k_group.shape
    pos = jnp.arange(s, dtype=jnp.int32)
    invalid = jnp.zeros((b, s), jnp.int32) if pl.k_valid is None else (~pl.k_valid).astype(jnp.int32)
    seg = (invalid * pl.num_groups + pl.k_group)[:, None] * num_inner
    if inner is not None:
        seg = seg + inner
    code = seg * (s + 1) + pos  # unique; int32 for S * segments < 2**31
    perm = jnp.argsort(code, axis=-1).astype(jnp.int32)
    code = jnp.take_along_axis(code, perm, -1)
    n_valid = (code < pl.num_groups * num_inner * (s + 1)).sum(-1).astype(jnp.int32)
    return KeyOrder(perm, code, n_valid, pl.num_groups, num_inner)


def _in_place_keys(pl: Placement) -> KeyOrder:
    """The original key order for a placement with ``keys_in_place``: packed index = position, the valid keys one run
    from ``start`` (the first valid key) on."""
    b, s = pl.k_group.shape
    pos = jnp.arange(s, dtype=jnp.int32)
    valid = jnp.ones((b, s), bool) if pl.k_valid is None else pl.k_valid
    start = jnp.argmax(valid, axis=-1).astype(jnp.int32)[:, None]  # [B, 1]
    n_valid = valid.sum(-1).astype(jnp.int32)[:, None]
    return KeyOrder(jnp.broadcast_to(pos, (b, 1, s)), jnp.broadcast_to(pos, (b, 1, s)), n_valid, 1, 1, start)


def _search(sorted_: jax.Array, values: jax.Array, side: str) -> jax.Array:
    """Batched searchsorted: sorted_ ``[B, H, S]``, values ``[B, H, ...]``."""
    lead = jnp.broadcast_shapes(sorted_.shape[:2], values.shape[:2])
    a = jnp.broadcast_to(sorted_, lead + sorted_.shape[2:])
    v = jnp.broadcast_to(values, lead + values.shape[2:])
    fn = lambda x, y: jnp.searchsorted(x, y.ravel(), side=side).reshape(y.shape).astype(jnp.int32)
    return jax.vmap(jax.vmap(fn))(a, v)


def segment_ranges(order: KeyOrder, inner: int, lo_pos: jax.Array, hi_pos: jax.Array
                   ) -> list[tuple[jax.Array, jax.Array]]:
    """Packed index ranges (inclusive) of the keys of inner class ``inner`` whose positions
    lie in ``[lo_pos, hi_pos]`` (int32 ``[B|1, N|1, ...]``), one range per key group. Keys in place
    (``order.start``): from the first valid key on (the keys past the valid run are left to causality)."""
    s = order.kv_len
    lo_pos = jnp.clip(lo_pos, 0, s)
    hi_pos = jnp.clip(hi_pos, -1, s - 1)
    if order.start is not None:
        lo_pos = jnp.maximum(lo_pos, order.start.reshape(order.start.shape + (1,) * (lo_pos.ndim - 2)))
    out = []
    for g in range(order.num_groups):
        base = (g * order.num_inner + inner) * (s + 1)
        lo = _search(order.code, base + lo_pos, "left")
        hi = _search(order.code, base + hi_pos, "right") - 1
        out.append((lo, jnp.where(hi_pos >= lo_pos, hi, lo - 1)))
    return out


def segment_prefix(order: KeyOrder, inner: int, hi_pos: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """`segment_ranges` for all positions ``<= hi_pos`` (a causal prefix of each segment)."""
    return segment_ranges(order, inner, jnp.zeros_like(hi_pos), hi_pos)


def to_block_ranges(ranges, block_k: int, max_keys: int) -> list[tuple[jax.Array, jax.Array, int]]:
    """Inclusive key index ranges -> `ranges_to_lists` groups of block ranges; ``max_keys``
    bounds the keys of one range (static)."""
    groups = []
    for lo, hi in ranges:
        b_lo, b_hi = lo // block_k, jnp.where(hi >= lo, hi // block_k, lo // block_k - 1)
        groups.append((b_lo[..., None], b_hi[..., None], cdiv(max_keys, block_k) + 1))
    return groups


def row_bounds(q_pos: jax.Array, block_q: int) -> tuple[jax.Array, jax.Array]:
    """q_pos int32 ``[B, N|1, T]`` (position of each permuted row) -> (min, max) position of
    each query block, int32 ``[B, N|1, nq]`` (padding rows repeat the last row)."""
    t = q_pos.shape[-1]
    nq = cdiv(t, block_q)
    qp = jnp.pad(q_pos, ((0, 0), (0, 0), (0, nq * block_q - t)), mode="edge")
    qp = qp.reshape(q_pos.shape[:2] + (nq, block_q))
    return qp.min(-1), qp.max(-1)


def row_runs(q_pos: jax.Array, block_q: int) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """Each query block's row positions split at their largest gap into two runs:
    ((lo1, hi1), (lo2, hi2)), int32 ``[B, N|1, nq]`` each (lo1 = min, hi2 = max). A block
    whose rows are one or two contiguous stretches is described exactly."""
    t = q_pos.shape[-1]
    nq = cdiv(t, block_q)
    qp = jnp.pad(q_pos, ((0, 0), (0, 0), (0, nq * block_q - t)), mode="edge")
    qp = jnp.sort(qp.reshape(q_pos.shape[:2] + (nq, block_q)), axis=-1)
    if block_q == 1:
        return (qp[..., 0], qp[..., 0]), (qp[..., 0], qp[..., 0])
    cut = jnp.argmax(jnp.diff(qp, axis=-1), axis=-1)[..., None]  # last row of run 1
    hi1 = jnp.take_along_axis(qp, cut, -1)[..., 0]
    lo2 = jnp.take_along_axis(qp, cut + 1, -1)[..., 0]
    return (qp[..., 0], hi1), (lo2, qp[..., -1])


def run_windows(q_pos: jax.Array, block_q: int, local: int) -> tuple[list[tuple[jax.Array, jax.Array]], int]:
    """Position windows ``[lo - local + 1, hi]`` of a block's two row runs (`row_runs`),
    each clipped to ``local + block_q`` positions below its end (static bound, returned)."""
    width = local + block_q
    return [(jnp.maximum(lo - local + 1, hi - width + 1), hi) for lo, hi in row_runs(q_pos, block_q)], width


def restrict_to_valid(part: BlockLayout, n_valid: jax.Array) -> BlockLayout:
    """Drop listed keys at packed index >= ``n_valid`` (int32 ``[B, N|1]``): blocks past the
    boundary go, the block straddling it becomes single columns of its valid keys (merged
    with the existing columns, which stay distinct and outside listed blocks; a part without
    columns and ``n_valid`` ``[B, 1]`` gets them as one list shared by every query block and
    head, ``[B, 1, 1, block_k]``, each block reading the valid prefix where it listed the block)."""
    bk = part.block_k
    nv = n_valid[..., None, None]  # [B, N|1, 1, 1]
    return _cut(part, nv // bk, nv % bk > 0, lambda ids: ids < nv // bk, lambda cols: cols < nv,
                (nv // bk) * bk + jnp.arange(bk, dtype=jnp.int32), nv % bk)


def restrict_from(part: BlockLayout, start: jax.Array) -> BlockLayout:
    """Drop listed keys at packed index < ``start`` (int32 ``[B, N|1]``; keys in place, `Placement.keys_in_place`):
    blocks below it go, the block straddling it becomes single columns of its keys from ``start`` on (the same
    column forms as `restrict_to_valid`: one list ``[B, 1, 1, block_k]`` from ``start`` on for a part without
    columns, each block reading its prefix where it listed the block)."""
    bk = part.block_k
    st = start[..., None, None]  # [B, N|1, 1, 1]
    cut = st % bk > 0
    return _cut(part, st // bk, cut, lambda ids: ids * bk >= st, lambda cols: cols >= st,
                st + jnp.arange(bk, dtype=jnp.int32), jnp.where(cut, bk - st % bk, 0))


def _cut(part: BlockLayout, straddle_id, has_straddle, block_ok, col_ok, extra, n_extra) -> BlockLayout:
    """`restrict_to_valid` / `restrict_from`: keep the listed blocks with ``block_ok(ids)`` and the columns with
    ``col_ok(cols)`` outside the straddling block ``straddle_id`` (``has_straddle``: it holds valid and invalid
    keys; both ``[B, N|1, 1, 1]``); where a query block listed it, its valid keys (the first ``n_extra`` of
    ``extra``, ``[B, N|1, 1, block_k]`` packed indices) become columns."""
    bk = part.block_k
    nq = part.kv_block_count.shape[-1]
    lead = jnp.broadcast_shapes(part.kv_block_count.shape[:2], straddle_id.shape[:2])
    blocks = jnp.broadcast_to(part.kv_blocks, lead + (nq, part.kv_blocks.shape[-1]))
    count = jnp.broadcast_to(part.kv_block_count, lead + (nq,))
    used = jnp.arange(blocks.shape[-1]) < count[..., None]
    keep = used & block_ok(blocks)
    straddle = (used & (blocks == straddle_id) & has_straddle).any(-1)  # [B, N, nq]
    order = jnp.argsort(~keep, axis=-1, stable=True)
    new_count = keep.sum(-1).astype(jnp.int32)
    new_blocks = jnp.take_along_axis(blocks, order, -1)
    new_blocks = jnp.where(jnp.arange(blocks.shape[-1]) < new_count[..., None], new_blocks, 0).astype(jnp.int32)
    if part.kv_columns is None and straddle_id.shape[1] == 1:
        # one column list for every query block and head: the straddling block's valid keys, each block reading them
        # (a prefix) where it listed the block (`shared_columns`: the Mosaic kernel runs them in the block pass's own
        # launch)
        cols = extra[:, :, :1].astype(jnp.int32)  # [B, 1, 1, bk]
        ccount = jnp.where(straddle, n_extra[..., 0], 0).astype(jnp.int32)  # [B, N, nq]
        return part.replace(kv_blocks=new_blocks, kv_block_count=new_count, kv_columns=cols,
                            kv_column_count=ccount)
    # Columns: existing valid ones outside the straddling block, then the block's valid keys.
    if part.kv_columns is not None:
        cols = jnp.broadcast_to(part.kv_columns, lead + (nq, part.kv_columns.shape[-1]))
        ccount = jnp.broadcast_to(part.kv_column_count, lead + (nq,))
        cused = jnp.arange(cols.shape[-1]) < ccount[..., None]
        in_straddle = straddle[..., None] & (cols // bk == straddle_id)
        ckeep = cused & col_ok(cols) & ~in_straddle
    else:
        cols = jnp.zeros(lead + (nq, 0), jnp.int32)
        ckeep = jnp.zeros(cols.shape, bool)
    extra = jnp.broadcast_to(extra, lead + (nq, bk))
    ekeep = straddle[..., None] & (jnp.arange(bk) < n_extra)
    all_cols = jnp.concatenate([cols, extra.astype(jnp.int32)], -1)
    all_keep = jnp.concatenate([ckeep, ekeep], -1)
    corder = jnp.argsort(~all_keep, axis=-1, stable=True)
    new_ccount = all_keep.sum(-1).astype(jnp.int32)
    new_cols = jnp.take_along_axis(all_cols, corder, -1)
    new_cols = jnp.where(jnp.arange(all_cols.shape[-1]) < new_ccount[..., None], new_cols, 0).astype(jnp.int32)
    return part.replace(kv_blocks=new_blocks, kv_block_count=new_count, kv_columns=new_cols,
                        kv_column_count=new_ccount)


def q_positions(pl: Placement, s: int, inner_rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(q_perm int32 ``[B, N|1, T]`` original query index of each permuted row, positions of
    those rows); ``inner_rows`` (``[B, N|1, T]``, indices into the wrapper's row order) is a
    pattern's own row order on top of the wrapper's."""
    t = pl.rows.shape[1]
    q_perm = pl.row_perm  # the wrapper's own array where the pattern has no row order of its own
    if inner_rows is not None:
        lead = jnp.broadcast_shapes(q_perm.shape[:2], inner_rows.shape[:2])
        q_perm = jnp.take_along_axis(jnp.broadcast_to(q_perm, lead + (t,)),
                                     jnp.broadcast_to(inner_rows, lead + (t,)), -1).astype(jnp.int32)
    return q_perm, q_perm + (s - t)


def key_inverse(order: KeyOrder) -> jax.Array:
    """int32 ``[B, N|1, S]``: packed index of each original key."""
    return inverse_permutation(order.perm)
