"""Grid head (MMInference Algorithm 1): lines at a regular stride, permuted into dense blocks.

Estimation: the column mass of A = softmax(Q[-last_q:] K^T) viewed as ``[S / s, s]`` gives
the mass of every phase p of every candidate stride s. The stride whose best phases carry
the most concentrated lines (lift = mass * s / phases) is taken down to its smallest divisor
that keeps 70% of that lift, so neither multiples nor divisors of the true stride are picked.

Layout: keys at the chosen phases (vertical lines) are moved to the front of the key order,
queries at those phases (horizontal lines) to the front of the query order; everything
else keeps its original order. Then
* vertical lines are the first key blocks, computed by every query block (causal prefix);
* horizontal-line rows are the first query blocks and compute every key block;
* the local band along the diagonal (``use_slash``, ``local`` tokens) is one contiguous
  range of the remaining keys for each remaining query block.
The horizontal rows go in a second part of a `LayoutSet` (one shared ``arange`` list), so
no part needs an nq x nk list. Causality is applied on original positions by the kernel.
Horizontal lines reuse the vertical phases: in video, the token that every frame attends
to at a spatial position also attends every frame (the grid is symmetric); the last_q rows
cannot observe other row phases.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.sparse import placement as plc
from mmjax.sparse.block_lists import ascending_ranges_to_lists
from mmjax.sparse.estimate import last_q_scores
from mmjax.sparse.layouts import LayoutSet
from mmjax.sparse.patterns.base import Pattern
from pallas_kernels import BlockLayout
from pallas_kernels.checks import check_int
from pallas_kernels.tiling import cdiv

# Multiples of 16 and the token counts of common square patch grids (e.g. 14 x 14 = 196),
# from 64 up: the smallest stride bounds the vertical-line list length (S / stride keys).
DEFAULT_STRIDES = tuple(sorted(set(range(64, 1025, 16)) | {81, 100, 144, 196, 225, 324, 400,
                                                           484, 576, 676, 784, 900}))


LIFT_TOLERANCE = 0.7


def phase_mass(vertical: jax.Array, stride: int) -> jax.Array:
    """vertical ``[B,N,S]`` -> mass per phase ``[B,N,stride]`` (positions j with j % stride = p)."""
    s = vertical.shape[-1]
    pad = (-s) % stride
    v = jnp.pad(vertical, ((0, 0), (0, 0), (0, pad)))
    return v.reshape(v.shape[:2] + (-1, stride)).sum(-2)


@dataclasses.dataclass(frozen=True)
class Grid(Pattern):
    """Grid head: vertical / horizontal lines every ``stride`` tokens plus a local band."""

    stride_space: tuple[int, ...] = DEFAULT_STRIDES
    max_stride: int = 1024
    use_hline: bool = True
    use_vline: bool = True
    use_slash: bool = True
    last_q: int = 64
    local: int = 1024
    phases: int = 1
    block_q: int = 128
    block_k: int = 64

    def validate(self) -> None:
        if not self.stride_space or any(not isinstance(x, int) or x < 1 for x in self.stride_space):
            raise ValueError(f"stride_space: expected a non-empty tuple of ints >= 1; received {self.stride_space!r}")
        check_int("max_stride", self.max_stride, 1)
        check_int("last_q", self.last_q, 1)
        check_int("local", self.local, 1)
        check_int("phases", self.phases, 1)
        if not (self.use_hline or self.use_vline or self.use_slash):
            raise ValueError("use_hline / use_vline / use_slash: expected at least one True")
        if self.phases > min(self.stride_space):
            raise ValueError(f"phases: expected phases <= the smallest stride {min(self.stride_space)}; "
                             f"received {self.phases}")

    def candidate_strides(self, s: int) -> tuple[int, ...]:
        cands = tuple(x for x in self.stride_space if x <= min(self.max_stride, s))
        if not cands:
            raise ValueError(f"stride_space: expected a stride <= min(max_stride={self.max_stride}, "
                             f"S={s}); received {self.stride_space!r}")
        return cands

    def estimate(self, q, k, *, rows=None, k_valid=None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Stride int32 ``[B,N]``, phases int32 ``[B,N,phases]`` and lift float32 ``[B,N]``
        (mass of the chosen phases per key kept, relative to uniform attention). rows /
        k_valid: estimation rows and keys as in `last_q_scores`."""
        t, s = q.shape[1], k.shape[1]
        if self.last_q > t:
            raise ValueError(f"last_q: expected last_q <= T={t} (query length); received {self.last_q}")
        vertical, _ = last_q_scores(q, k, last_q=self.last_q, rows=rows, k_valid=k_valid)
        cands = self.candidate_strides(s)
        lifts, masses, phases = [], [], []
        for stride in cands:
            mass, ph = jax.lax.top_k(phase_mass(vertical, stride), self.phases)
            masses.append(mass.sum(-1))
            lifts.append(mass.sum(-1) * stride / self.phases)
            phases.append(ph)
        lift = jnp.stack(lifts, -1)  # [B,N,C]
        # The best-lift stride may be a multiple m * s of the true stride s (its best phase
        # holds 1/m of the lines on 1/m of the keys: the same lift, and it wins on noise).
        # Walk down to the smallest divisor of it that keeps LIFT_TOLERANCE of its lift; a
        # divisor of the true stride s / m keeps only ~1/m and is passed over.
        best = jnp.argmax(lift, axis=-1)
        divides = jnp.asarray(np.array(cands)[None, :] % np.array(cands)[:, None] == 0)  # [i, j]: c_i | c_j
        best_lift = jnp.take_along_axis(lift, best[..., None], -1)
        ok = divides[:, best].transpose(1, 2, 0) & (lift >= LIFT_TOLERANCE * best_lift)
        pick = jnp.argmax(ok, axis=-1)  # candidates ascend: the smallest qualifying divisor
        stride = jnp.asarray(cands, jnp.int32)[pick]
        phase_all = jnp.stack(phases, -2)  # [B,N,C,phases]
        phase = jnp.take_along_axis(phase_all, pick[..., None, None], axis=-2)[..., 0, :]
        return stride, phase.astype(jnp.int32), jnp.take_along_axis(lift, pick[..., None], -1)[..., 0]

    def layout_from_index(self, stride, phase, t: int, s: int) -> LayoutSet:
        """stride ``[B,N]``, phase ``[B,N,P]`` -> two-part permuted `LayoutSet`."""
        bq, bk = self.block_q, self.block_k
        nq, nk = cdiv(t, bq), cdiv(s, bk)
        off = s - t
        k_pos = jnp.arange(s, dtype=jnp.int32)
        q_pos = jnp.arange(t, dtype=jnp.int32) + off

        def on_line(pos):  # [B,N,L] bool: position at one of the head's phases
            return (pos[None, None, :, None] % stride[..., None, None] == phase[..., None, :]).any(-1)

        k_line = on_line(k_pos) if self.use_vline else jnp.zeros((1, 1, s), bool)
        q_line = on_line(q_pos) if self.use_hline else jnp.zeros((1, 1, t), bool)
        lead = stride.shape
        k_line = jnp.broadcast_to(k_line, lead + (s,))
        q_line = jnp.broadcast_to(q_line, lead + (t,))
        kv_perm = jnp.argsort(jnp.where(k_line, 0, s) + k_pos, axis=-1).astype(jnp.int32)
        q_perm = jnp.argsort(jnp.where(q_line, 0, t) + jnp.arange(t), axis=-1).astype(jnp.int32)
        n_kline = k_line.sum(-1)  # [B,N]
        n_qline = q_line.sum(-1)

        # Query blocks: positions in permuted order (padding rows use the last position).
        qp = jnp.pad(q_perm + off, ((0, 0), (0, 0), (0, nq * bq - t)), mode="edge").reshape(lead + (nq, bq))
        q_min, q_max = qp.min(-1), qp.max(-1)  # [B,N,nq]
        h_rows = jnp.arange(nq) * bq < n_qline[..., None]  # block holds a horizontal row

        # Vertical prefix: line keys (sorted by position) visible to the block.
        line_pos = jnp.where(jnp.arange(s) < n_kline[..., None], kv_perm, s)  # sorted, then s
        n_vis = jax.vmap(jax.vmap(lambda lp, qm: jnp.searchsorted(lp, qm, side="right")))(line_pos, q_max)
        n_vblocks = jnp.where(n_vis > 0, (n_vis - 1) // bk + 1, 0) if self.use_vline else jnp.zeros_like(n_vis)
        max_line_blocks = cdiv(cdiv(s, min(self.candidate_strides(s))) * self.phases, bk) + 1
        width = (max_line_blocks if self.use_vline else 0) + (cdiv(self.local + bq, bk) + 2 if self.use_slash else 0)
        if self.use_slash:
            rest_pos = jnp.where(jnp.arange(s) >= n_kline[..., None], kv_perm, -1)  # sorted after -1s
            band_lo_pos = jnp.maximum(q_min - self.local + 1, 0)
            lo_idx = jax.vmap(jax.vmap(lambda rp, x: jnp.searchsorted(rp, x, side="left")))(rest_pos, band_lo_pos)
            hi_idx = jax.vmap(jax.vmap(lambda rp, x: jnp.searchsorted(rp, x, side="right")))(rest_pos, q_max) - 1
            lo_idx = jnp.maximum(lo_idx, n_kline[..., None])
            b_lo = jnp.maximum(lo_idx // bk, n_vblocks)  # the shared boundary block is listed once
            n_band = jnp.where(hi_idx >= lo_idx, jnp.maximum(hi_idx // bk - b_lo + 1, 0), 0)
        else:
            b_lo, n_band = n_vblocks, jnp.zeros_like(n_vblocks)
        # [0, n_vblocks) then [b_lo, b_lo + n_band): ascending and distinct, no sort needed.
        j = jnp.arange(width, dtype=jnp.int32)
        blocks = jnp.where(j < n_vblocks[..., None], j, b_lo[..., None] + j - n_vblocks[..., None])
        count = (n_vblocks + n_band).astype(jnp.int32)
        blocks = jnp.where(j < count[..., None], blocks, 0).astype(jnp.int32)
        count = jnp.where(h_rows, 0, count)
        common = dict(q_perm=q_perm, kv_perm=kv_perm, block_q=bq, block_k=bk, q_len=t, kv_len=s)
        lines = BlockLayout(kv_blocks=blocks, kv_block_count=count, **common)
        full = BlockLayout(kv_blocks=jnp.arange(nk, dtype=jnp.int32)[None, None, None],
                           kv_block_count=jnp.where(h_rows, nk, 0).astype(jnp.int32), **common)
        return LayoutSet((lines, full))

    def build_layout(self, q, k, *, modality=None) -> LayoutSet:
        stride, phase, _ = self.estimate(q, k)
        return self.layout_from_index(stride, phase, q.shape[1], k.shape[1])

    def build_placed(self, q, k, placement) -> LayoutSet:
        """Grid inside a boundary wrapper: stride and phases estimated from the last rows of
        the row order over the valid keys; line keys (position % stride at a phase) packed
        first within each key group, line rows first; lines, band and full rows as in
        `layout_from_index`, all on original positions."""
        stride, phase, _ = self.estimate(q, k, rows=placement.est_rows(self.last_q), k_valid=placement.k_valid)
        return self.placed_from_index(stride, phase, placement, q.shape[1], k.shape[1])

    def placed_from_index(self, stride, phase, placement, t: int, s: int) -> LayoutSet:
        bq, bk = self.block_q, self.block_k
        nq, nk = cdiv(t, bq), cdiv(s, bk)

        def on_line(pos):  # pos [B|1, L] -> bool [B, N, L]
            return (pos[:, None, :, None] % stride[..., None, None] == phase[..., None, :]).any(-1)

        lead = stride.shape
        k_line = on_line(jnp.arange(s, dtype=jnp.int32)[None]) if self.use_vline else jnp.zeros((1, 1, s), bool)
        order = plc.pack_keys(placement, jnp.broadcast_to(jnp.where(k_line, 0, 1), lead + (s,)).astype(jnp.int32), 2)
        row_pos = placement.rows + (s - t)
        q_line = on_line(row_pos) if self.use_hline else jnp.zeros(lead + (t,), bool)
        q_line = jnp.broadcast_to(q_line, lead + (t,))
        inner_rows = jnp.argsort(jnp.where(q_line, 0, t) + jnp.arange(t), axis=-1).astype(jnp.int32)
        q_perm, q_pos = plc.q_positions(placement, s, inner_rows)
        _, q_max = plc.row_bounds(q_pos, bq)
        h_rows = jnp.arange(nq) * bq < q_line.sum(-1)[..., None]  # [B, N, nq]
        lo, hi = [], []
        n_line_keys = cdiv(s, min(self.candidate_strides(s))) * self.phases
        (w1, w2), band_keys = plc.run_windows(q_pos, bq, self.local)
        width = 0
        # Packed order: per key group, line keys then the rest; ranges in that order ascend.
        for v_rng, b1, b2 in zip(plc.segment_prefix(order, 0, q_max), plc.segment_ranges(order, 1, *w1),
                                 plc.segment_ranges(order, 1, *w2)):
            for (a, b), on in ((v_rng, self.use_vline), (b1, self.use_slash), (b2, self.use_slash)):
                lo.append(a // bk)
                hi.append(jnp.where((b >= a) & on, b // bk, a // bk - 1))
            width += (cdiv(n_line_keys, bk) + 1 if self.use_vline else 0) + (
                2 * (cdiv(band_keys, bk) + 1) if self.use_slash else 0)
        blocks, count = ascending_ranges_to_lists(jnp.stack(lo, -1), jnp.stack(hi, -1), min(width, nk))
        common = dict(q_perm=q_perm, kv_perm=order.perm, block_q=bq, block_k=bk, q_len=t, kv_len=s)
        lines = BlockLayout(kv_blocks=blocks, kv_block_count=jnp.where(h_rows, 0, count), **common)
        n_valid_blocks = (order.n_valid + bk - 1) // bk
        full = BlockLayout(kv_blocks=jnp.arange(nk, dtype=jnp.int32)[None, None, None],
                           kv_block_count=jnp.where(h_rows, n_valid_blocks[..., None], 0).astype(jnp.int32),
                           **common)
        return LayoutSet((lines, full))

