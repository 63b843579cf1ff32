"""Static patterns (no estimation): Dense, A-shape, Tri-shape and the Sparse Transformer
baselines SF-fixed / SF-strided of MMInference Tables 1-2. Each builds block lists from
range arithmetic only (no nq x nk mask), identical for every batch and head.

Block granularity: a pattern lists every key block that one of its token-level rules
touches for some query of the block; the kernel then computes those blocks exactly (causal
on original positions). ``layout.to_dense_mask()`` is the mask that is computed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.sparse import placement as plc
from mmjax.sparse.block_lists import ascending_ranges_to_lists, query_block_bounds, ranges_to_lists
from mmjax.sparse.layouts import LayoutSet
from mmjax.sparse.patterns.base import Pattern
from pallas_kernels import BlockLayout
from pallas_kernels.checks import check_int
from pallas_kernels.tiling import cdiv


def _lens(q: jax.Array, k: jax.Array) -> tuple[int, int]:
    return int(q.shape[1]), int(k.shape[1])


def _layout(blocks, count, p: Pattern, t: int, s: int, **extra) -> BlockLayout:
    return BlockLayout(kv_blocks=blocks[None, None], kv_block_count=count[None, None],
                       block_q=p.block_q, block_k=p.block_k, q_len=t, kv_len=s, **extra)


@dataclasses.dataclass(frozen=True)
class Dense(Pattern):
    """Dense causal attention through the block-sparse kernel (all causal blocks)."""

    block_q: int = 128
    block_k: int = 64

    def build_layout(self, q, k, *, modality=None) -> BlockLayout:
        t, s = _lens(q, k)
        return BlockLayout.dense_causal(t, s, block_q=self.block_q, block_k=self.block_k)

    def build_placed(self, q, k, placement) -> BlockLayout:
        """Every valid key at a position <= the block's last row (one causal prefix per key
        segment, listed without a sort)."""
        t, s = _lens(q, k)
        order = plc.pack_keys(placement)
        q_perm, q_pos = plc.q_positions(placement, s)
        _, q_max = plc.row_bounds(q_pos, self.block_q)
        return _placed_prefix(self, order, q_perm, q_max, t, s)


def _placed_prefix(p: Pattern, order, q_perm, q_max, t: int, s: int) -> BlockLayout:
    """Causal prefixes (positions <= q_max ``[B, N|1, nq]``) of every key segment."""
    ranges = plc.segment_prefix(order, 0, q_max)
    lo = jnp.stack([r[0] // p.block_k for r in ranges], -1)
    hi = jnp.stack([jnp.where(r[1] >= r[0], r[1] // p.block_k, r[0] // p.block_k - 1) for r in ranges], -1)
    blocks, count = ascending_ranges_to_lists(lo, hi, cdiv(s, p.block_k))
    return BlockLayout(kv_blocks=blocks, kv_block_count=count, q_perm=q_perm, kv_perm=order.perm,
                       block_q=p.block_q, block_k=p.block_k, q_len=t, kv_len=s)


def placed_ashape(p, sink: int, local: int, order, q_perm, q_pos, t: int, s: int) -> BlockLayout:
    """A-shape in a placement (``p``: the pattern whose block sizes are used; ``order``: the packed
    `placement.KeyOrder`; ``q_perm`` / ``q_pos``: `placement.q_positions`): the first ``sink`` valid keys of the
    packed order plus the position windows of each block's row runs, in every key segment."""
    bk = p.block_k
    windows, width = plc.run_windows(q_pos, p.block_q, local)
    q_max = windows[1][1]
    groups = [g for lo_w, hi_w in windows
              for g in plc.to_block_ranges(plc.segment_ranges(order, 0, lo_w, hi_w), bk, width)]
    if sink:  # the first valid keys: from packed index `order.first()` (0 unless the keys are in place)
        first = order.first()[..., None]  # [B, N|1, 1]
        n_sink = jnp.minimum(order.n_valid, sink)[..., None]
        lo = jnp.broadcast_to(first // bk, q_max.shape)
        hi = jnp.broadcast_to(jnp.where(n_sink > 0, (first + n_sink - 1) // bk, first // bk - 1), q_max.shape)
        groups.append((lo[..., None], hi[..., None], cdiv(sink, bk) + (order.start is not None)))
    blocks, count = ranges_to_lists(groups, cdiv(s, bk))
    return BlockLayout(kv_blocks=blocks, kv_block_count=count, q_perm=q_perm, kv_perm=order.perm,
                       block_q=p.block_q, block_k=bk, q_len=t, kv_len=s)


@dataclasses.dataclass(frozen=True)
class AShape(Pattern):
    """The first ``sink`` tokens plus a causal local window of ``local`` tokens."""

    sink: int = 128
    local: int = 4096
    block_q: int = 128
    block_k: int = 64

    def validate(self) -> None:
        check_int("sink", self.sink, 0)
        check_int("local", self.local, 1)

    def ranges(self, t: int, s: int) -> list[tuple[jax.Array, jax.Array, int]]:
        """Per query block: the sink and local block ranges as `ranges_to_lists` groups."""
        bk = self.block_k
        qs, qe = query_block_bounds(t, s, self.block_q)
        n_sink = cdiv(self.sink, bk) if self.sink else 0
        hi = qe // bk
        sink_lo = jnp.zeros_like(qs)
        sink_hi = jnp.minimum(n_sink - 1, hi)
        loc_lo = jnp.maximum(qs - self.local + 1, 0) // bk
        return [(sink_lo[:, None], sink_hi[:, None], max(n_sink, 1)),
                (loc_lo[:, None], hi[:, None], cdiv(self.local + self.block_q, bk) + 1)]

    def build_layout(self, q, k, *, modality=None) -> BlockLayout:
        t, s = _lens(q, k)
        blocks, count = ranges_to_lists(self.ranges(t, s), cdiv(s, self.block_k))
        return _layout(blocks, count, self, t, s)

    def build_placed(self, q, k, placement) -> BlockLayout:
        t, s = _lens(q, k)
        order = plc.pack_keys(placement)
        q_perm, q_pos = plc.q_positions(placement, s)
        return placed_ashape(self, self.sink, self.local, order, q_perm, q_pos, t, s)


@dataclasses.dataclass(frozen=True)
class TriShape(Pattern):
    """A-shape plus dense rows for the last ``last`` queries (a `LayoutSet`: A-shape lists
    for the other query blocks, one shared dense list for the blocks holding the last rows; that part names them
    as its ``q_block_range``, so it runs on those rows alone)."""

    sink: int = 128
    local: int = 4096
    last: int = 128
    block_q: int = 128
    block_k: int = 64

    def validate(self) -> None:
        AShape(self.sink, self.local, self.block_q, self.block_k)
        check_int("last", self.last, 1)

    def build_layout(self, q, k, *, modality=None) -> LayoutSet:
        t, s = _lens(q, k)
        if self.last > t:
            raise ValueError(f"last: expected last <= T={t} (query length); received {self.last}")
        ashape = AShape(self.sink, self.local, self.block_q, self.block_k)
        blocks, count = ranges_to_lists(ashape.ranges(t, s), cdiv(s, self.block_k))
        nq = cdiv(t, self.block_q)
        dense_rows = jnp.arange(nq) >= (t - self.last) // self.block_q
        dense = BlockLayout.dense_causal(t, s, block_q=self.block_q, block_k=self.block_k)
        return LayoutSet((
            _layout(blocks, jnp.where(dense_rows, 0, count), self, t, s),
            dense.replace(kv_block_count=jnp.where(dense_rows, dense.kv_block_count, 0),
                          q_block_range=((t - self.last) // self.block_q, nq)),
        ))

    def build_placed(self, q, k, placement) -> LayoutSet:
        """A-shape for every block, dense causal prefixes for the blocks holding the last
        ``last`` rows of the row order (the last queries of the wrapper's modality)."""
        t, s = _lens(q, k)
        if self.last > t:
            raise ValueError(f"last: expected last <= T={t} (query length); received {self.last}")
        order = plc.pack_keys(placement)
        q_perm, q_pos = plc.q_positions(placement, s)
        _, q_max = plc.row_bounds(q_pos, self.block_q)
        dense_rows = jnp.arange(cdiv(t, self.block_q)) >= (t - self.last) // self.block_q
        a = placed_ashape(self, self.sink, self.local, order, q_perm, q_pos, t, s)
        d = _placed_prefix(self, order, q_perm, q_max, t, s)
        return LayoutSet((a.replace(kv_block_count=jnp.where(dense_rows, 0, a.kv_block_count)),
                          d.replace(kv_block_count=jnp.where(dense_rows, d.kv_block_count, 0),
                                    q_block_range=((t - self.last) // self.block_q, cdiv(t, self.block_q)))))


@dataclasses.dataclass(frozen=True)
class SFFixed(Pattern):
    """Sparse Transformer "fixed": each query sees its own frame of ``stride`` tokens and a
    local window of ``local`` tokens, plus the last ``summary`` tokens of every earlier frame
    (gathered as single columns from one shared sorted list)."""

    local: int = 4096
    stride: int = 256
    summary: int = 16
    block_q: int = 128
    block_k: int = 64

    def validate(self) -> None:
        check_int("local", self.local, 1)
        check_int("stride", self.stride, 1)
        check_int("summary", self.summary, 1)
        if self.summary > self.stride:
            raise ValueError(f"summary: expected summary <= stride={self.stride}; received {self.summary}")

    def build_layout(self, q, k, *, modality=None) -> BlockLayout:
        t, s = _lens(q, k)
        bk = self.block_k
        qs, qe = query_block_bounds(t, s, self.block_q)
        frame_lo = (qs // self.stride) * self.stride
        lo = jnp.minimum(frame_lo, jnp.maximum(qs - self.local + 1, 0)) // bk
        hi = qe // bk
        width = cdiv(self.local + self.stride + self.block_q, bk) + 1
        blocks, count = ranges_to_lists([(lo[:, None], hi[:, None], width)], cdiv(s, bk))
        pos = np.arange(s)
        cols = pos[pos % self.stride >= self.stride - self.summary].astype(np.int32)
        if cols.size == 0:  # shorter than one frame: no summary columns exist
            cols = np.zeros((1,), np.int32)
            ccount = jnp.zeros_like(lo)
        else:  # every summary column left of the row's first listed block
            ccount = jnp.searchsorted(jnp.asarray(cols), lo * bk, side="left").astype(jnp.int32)
        return _layout(blocks, count, self, t, s, kv_columns=jnp.asarray(cols)[None, None, None],
                       kv_column_count=ccount[None, None])


@dataclasses.dataclass(frozen=True)
class SFStrided(Pattern):
    """Sparse Transformer "strided": a local window of ``local`` tokens plus the periodic
    diagonals ``(i - j) % stride == 0``. At block granularity each diagonal touches
    ``block_q / block_k + 1`` key blocks per query block, so short strides end up nearly
    dense: the baseline's weakness on a block-sparse kernel, reported by its density."""

    local: int = 4096
    stride: int = 256
    block_q: int = 128
    block_k: int = 64

    def validate(self) -> None:
        check_int("local", self.local, 1)
        check_int("stride", self.stride, 1)

    def build_layout(self, q, k, *, modality=None) -> BlockLayout:
        t, s = _lens(q, k)
        bk = self.block_k
        qs, qe = query_block_bounds(t, s, self.block_q)
        offsets = jnp.arange(1, cdiv(s, self.stride) + 1, dtype=jnp.int32) * self.stride  # [M]
        lo_slash = jnp.maximum(qs[:, None] - offsets, 0) // bk
        hi_slash = jnp.where(qe[:, None] - offsets >= 0, (qe[:, None] - offsets) // bk, -1)
        lo_loc = (jnp.maximum(qs - self.local + 1, 0) // bk)[:, None]
        hi_loc = (qe // bk)[:, None]
        blocks, count = ranges_to_lists(
            [(lo_loc, hi_loc, cdiv(self.local + self.block_q, bk) + 1),
             (lo_slash, hi_slash, cdiv(self.block_q, bk) + 1)], cdiv(s, bk))
        return _layout(blocks, count, self, t, s)
