"""Vertical-Slash: top vertical columns and top slash diagonals estimated from the last
queries, compiled to key blocks (slashes) plus single gathered columns (verticals).

Slashes may become key windows (``windows=True``, `VerticalSlash._window_layout`): a slash's keys
for a query block are a diagonal range that starts anywhere, so aligned key blocks cover up to
twice the pairs it names; windows start where the ranges start. Measured on one H100 (2026-11-25,
`mmjax bench slash_windows`, 1000 / 6096, 8 heads): at 32k windows compute 1.116x the named pairs
(blocks 1.163x) but the Triton kernel runs them 3-4% slower per tile, so they were not faster at any
length (at 128k / 512k both forms hit the same ``max_blocks`` cap); on video-like inputs under the
cap the aligned blocks also keep more attention mass (their extra keys sit next to the slashes).
Aligned blocks stay the default. A run's few keys past its last whole window (``window_tail``) are
single columns rather than one more window: with 64-row blocks and 32-key windows, computed / named
pairs 1.097 -> 1.067 at 32k and 1.101 -> 1.075 at 128k, 4% faster on Triton (one H100, 2026-11-26,
`tools/minference_side_by_side.py`). On the Mosaic GPU kernel (sm90) windows from multiples of 8 are one tile each
and the fastest form measured: ``VerticalSlash(block_q=64, block_k=32, windows=True, window_align=8,
window_tail=12, window_tail_cap=4096)`` ran 1.28 / 1.31 / 1.40x MInference's kernel on its index at 32k / 128k /
512k, computing 1.06 / 1.07 / 1.08x the named pairs (one H100, 2026-11-27; README). It is not the default: its
lists are about 3x the default's at 1M tokens (768 windows per 64-row query block against 512 blocks per 128-row
one), and on `bench patterns`' video input at 128k it kept less attention (recall 0.548 against 0.580) and ran
slower (kernel 65.4 against 60.4 ms) while computing fewer pairs (density 0.201 against 0.258; one H100,
2026-11-27, `patterns-vs-windows-128k_*`).

Conversion to aligned blocks (the default; vectorised, per head): with ``block_q = r * block_k``, the key blocks a slash
at offset o touches for query block i are ``i * r + u`` for u in a range that does not
depend on i. So the covered blocks are one shared set U of relative offsets per head
(adjacent ranges merge by construction); U is capped at ``max_blocks`` relative blocks
chosen by slash mass, and each query block's list is ``i * r + U`` clipped to the causal
range. Verticals not inside a listed block become the row's single columns. Cost: one
scatter of ``slash_size`` ranges and a sort of ``[nq, vertical_size]`` per head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mmjax.sparse import placement as plc
from mmjax.sparse.block_lists import ranges_to_lists
from mmjax.sparse.patterns.base import Pattern
from pallas_kernels import BlockLayout
from pallas_kernels.checks import check_int
from pallas_kernels.last_q_scores import last_q_scores
from pallas_kernels.tiling import cdiv


def default_max_blocks(slash_size: int, block_k: int, r: int) -> int:
    """Relative key blocks kept per head: every slash's r + 1 blocks when slashes are few;
    for many slashes, what contiguous runs of them need plus 256 blocks of scattered ones
    (bounds the lists at 1M tokens to ~0.5 GB for 28 heads)."""
    return min(slash_size * (r + 1), 4 * cdiv(slash_size, block_k) + 256)


def range_cover(lo: jax.Array, hi: jax.Array, size: int, weight: jax.Array | None = None) -> jax.Array:
    """Per (batch, head), the summed ``weight`` of the ranges ``[lo_j, hi_j)`` over each index of ``[0, size)``
    (a difference array and one cumsum, no ``[ranges, size]`` mask). lo, hi int ``[B, N, R]`` in ``[0, size]``
    (a range at ``size`` adds nothing); weight ``[B, N, R]`` (default 1, int32). Returns ``[B, N, size]``."""
    w = jnp.ones(lo.shape, jnp.int32) if weight is None else weight
    delta = jax.vmap(jax.vmap(lambda a, b, x: jnp.zeros((size + 1,), x.dtype).at[a].add(x).at[b].add(-x)))(lo, hi, w)
    return jnp.cumsum(delta, -1)[..., :size]


def compact_columns(cols: jax.Array, keep: jax.Array) -> jax.Array:
    """cols int ``[B, N, vs]`` (or ``[B, N, nq, vs]``, per query block), keep bool ``[B, N, nq, vs]`` -> int32
    ``[B, N, nq, vs]``: each query block's kept columns moved to the front in order (a prefix sum and one scatter,
    no sort); the rest 0."""
    vs = cols.shape[-1]
    slot = jnp.where(keep, jnp.cumsum(keep, -1) - 1, vs)
    out = jnp.zeros(keep.shape[:-1] + (vs + 1,), jnp.int32)
    values = cols if cols.ndim == keep.ndim else cols[..., None, :]
    return jnp.put_along_axis(out, slot, jnp.broadcast_to(values, slot.shape).astype(jnp.int32),
                              axis=-1, inplace=False)[..., :vs]


@dataclasses.dataclass(frozen=True)
class VerticalSlash(Pattern):
    """MInference/MMInference Vertical-Slash head.

    vertical_size: columns kept per head; slash_size: diagonals kept per head; last_q: rows
    used for estimation; keep_first: first columns always kept (attention sink);
    keep_local: nearest diagonals always kept (local window); max_blocks: cap on key blocks
    (windows) per query block (default `default_max_blocks`); past the cap, those with the least
    slash mass are dropped. windows: slashes as ``block_k``-wide key windows at any start
    (`BlockLayout.kv_windows`: the diagonal ranges are computed, not the aligned blocks around
    them; on Triton not faster on an H100, module docstring); False (default) gives aligned key blocks
    (Boundary wrappers always use aligned blocks in their packed key order). window_tail: with
    windows, a run of slash keys whose last window would hold at most this many keys computes
    them as single columns instead (0: off); window_tail_cap: at most this many such keys per
    head (a static size: the query blocks' column lists grow by it; at 512k with 1000 / 6096, 64-row blocks and
    32-key windows a cap of 256 left 1.111x the named pairs and 1024 gives 1.080; at 32k / 128k it does not
    bind). window_align: with windows, each run's windows start at key positions that are multiples of this (the
    run's first window reaches back to the multiple below its first key; 1: windows start at the run's first key).
    The Mosaic GPU kernel loads a window with one TMA copy only where its start is a multiple of 8 (else two
    tiles); with ``block_q=64, windows=True, window_align=8`` it ran MInference's index 1.18 / 1.25 / 1.30x
    faster than MInference at 32k / 128k / 512k (one H100, 2026-11-27, README), and with ``block_k=32,
    window_tail=12, window_tail_cap=4096`` added 1.28 / 1.31 / 1.40x while computing 1.059 / 1.074 / 1.082x the
    pairs the index names. The layouts carry ``window_align``; aligned to 8 they run on the Mosaic GPU kernel by
    default on sm90 (`mosaic_options.preferred`).
    """

    vertical_size: int = 1000
    slash_size: int = 4096
    last_q: int = 64
    keep_first: int = 64
    keep_local: int = 128
    max_blocks: int | None = None
    block_q: int = 128
    block_k: int = 64
    windows: bool = False
    window_tail: int = 4
    window_tail_cap: int = 1024
    window_align: int = 1

    def validate(self) -> None:
        for name in ("vertical_size", "slash_size", "last_q"):
            check_int(name, getattr(self, name), 1)
        check_int("keep_first", self.keep_first, 0)
        check_int("keep_local", self.keep_local, 0)
        check_int("window_tail", self.window_tail, 0)
        check_int("window_tail_cap", self.window_tail_cap, 1)
        check_int("window_align", self.window_align, 1)
        if self.windows and (self.block_q % self.window_align or self.block_k % self.window_align):
            raise ValueError(f"window_align: expected a divisor of block_q={self.block_q} and block_k={self.block_k}; "
                             f"received {self.window_align}")
        if self.max_blocks is not None:
            check_int("max_blocks", self.max_blocks, 1)
        if self.block_q % self.block_k:
            raise ValueError(f"block_q: expected a multiple of block_k={self.block_k}; received {self.block_q}")

    def estimate(self, q, k, *, rows=None, k_valid=None) -> tuple[jax.Array, jax.Array]:
        """Top columns (ascending) int32 ``[B,N,vs]``, top slash offsets int32 ``[B,N,ss]``
        and the slash scores float32 ``[B,N,S]`` (forced diagonals are +inf). rows /
        k_valid: estimation rows and keys as in `last_q_scores` (invalid keys are never
        forced columns)."""
        t, s = q.shape[1], k.shape[1]
        if self.last_q > t:
            raise ValueError(f"last_q: expected last_q <= T={t} (query length); received {self.last_q}")
        vertical, slash = last_q_scores(q, k, last_q=self.last_q, rows=rows, k_valid=k_valid)
        pos = jnp.arange(s)
        forced = pos < self.keep_first
        if k_valid is not None:
            forced = forced & k_valid[:, None, :]
        vertical = jnp.where(forced, jnp.inf, vertical)
        slash = jnp.where(pos < self.keep_local, jnp.inf, slash)
        _, cols = jax.lax.top_k(vertical, min(self.vertical_size, s))
        _, offs = jax.lax.top_k(slash, min(self.slash_size, s))
        return jnp.sort(cols, -1).astype(jnp.int32), offs.astype(jnp.int32), slash

    def layout_from_index(self, cols, offsets, slash_score, t: int, s: int) -> BlockLayout:
        """cols ``[B,N,vs]``, offsets ``[B,N,ss]`` (key offsets d = i - j), slash_score
        ``[B,N,S]`` -> layout with per-row key windows (``windows``) or block lists, and single columns."""
        if self.windows:
            return self._window_layout(cols, offsets, slash_score, t, s)
        bq, bk = self.block_q, self.block_k
        r = bq // bk
        nq, nk = cdiv(t, bq), cdiv(s, bk)
        off = s - t
        # Relative block u (block = i * r + u) covered by offset o for a full query block:
        # keys [i*bq + off - o, i*bq + off + bq - 1 - o].
        # Block i * r + u lies in [0, nk) for i < nq, so u in [-(nk + r), nk); index = u + shift.
        shift = nk + r
        n_rel = 2 * nk + r
        u_lo = jnp.floor_divide(off - offsets, bk)
        u_hi = jnp.floor_divide(off + bq - 1 - offsets, bk)
        valid = offsets < s
        lead = offsets.shape[:2]
        delta = jnp.zeros(lead + (n_rel + 1,), jnp.int32)
        lo_i = jnp.clip(u_lo + shift, 0, n_rel)
        hi_i = jnp.clip(u_hi + shift + 1, 0, n_rel)
        one = valid.astype(jnp.int32)
        delta = jax.vmap(jax.vmap(lambda dl, lo, hi, o: dl.at[lo].add(o).at[hi].add(-o)))(delta, lo_i, hi_i, one)
        covered = jnp.cumsum(delta, -1)[..., :n_rel] > 0  # [B,N,n_rel]
        # Mass per relative block: slash mass of the offsets it holds (for the cap).
        d = jnp.arange(s)
        d_lo = jnp.floor_divide(off - d, bk) + shift
        d_hi = jnp.floor_divide(off + bq - 1 - d, bk) + shift
        chosen = jax.vmap(jax.vmap(lambda o: jnp.zeros((s,), bool).at[o].set(True)))(offsets)
        d_mass = jnp.where(chosen, jnp.where(jnp.isinf(slash_score), 1.0, slash_score), 0.0)
        mass = jnp.zeros(lead + (n_rel,), jnp.float32)
        for w in range(r + 1):  # an offset touches r or r + 1 relative blocks
            u = d_lo + w
            mass = mass.at[..., jnp.clip(u, 0, n_rel - 1)].add(jnp.where(u <= d_hi, d_mass, 0.0))
        cap = min(n_rel, self.max_blocks or default_max_blocks(self.slash_size, bk, r))
        score = jnp.where(covered, mass + 1.0, -1.0)  # covered first, then by mass
        top_score, top_u = jax.lax.top_k(score, cap)
        keep = top_score >= 0
        rel = jnp.sort(jnp.where(keep, top_u - shift, nk), -1)  # ascending; invalid = nk, last
        qi = jnp.arange(nq)
        qe = jnp.minimum((qi + 1) * bq, t) - 1 + off
        blocks = qi[:, None] * r + rel[..., None, :]  # [B,N,nq,cap]
        ok = (rel[..., None, :] < nk) & (blocks >= 0) & (blocks <= (qe // bk)[:, None])
        # rel is ascending, so the valid entries of a row are one contiguous run: shift it left.
        first = (blocks < 0).sum(-1, keepdims=True)
        idx = jnp.minimum(jnp.arange(cap) + first, cap - 1)
        count = ok.sum(-1).astype(jnp.int32)
        blocks = jnp.where(jnp.arange(cap) < count[..., None],
                           jnp.take_along_axis(blocks, idx, -1), 0).astype(jnp.int32)
        # Verticals: causal, and not inside one of the row's listed blocks.
        sel_rel = jnp.zeros(lead + (n_rel + 1,), bool)
        sel_rel = jax.vmap(jax.vmap(lambda z, u, kp: z.at[jnp.where(kp, u, n_rel)].set(True)))(
            sel_rel, jnp.clip(top_u, 0, n_rel - 1), keep)
        u_col = (cols[..., None, :] // bk) - qi[:, None] * r + shift  # [B,N,nq,vs]
        in_block = jnp.take_along_axis(
            sel_rel[..., None, :], jnp.clip(u_col, 0, n_rel), axis=-1) & (u_col >= 0) & (u_col < n_rel)
        col_ok = (cols[..., None, :] <= qe[:, None]) & ~in_block
        kv_cols = compact_columns(cols, col_ok)
        ccount = col_ok.sum(-1).astype(jnp.int32)
        return BlockLayout(kv_blocks=blocks, kv_block_count=count, kv_columns=kv_cols,
                           kv_column_count=ccount, block_q=bq, block_k=bk, q_len=t, kv_len=s)

    def _window_layout(self, cols, offsets, slash_score, t: int, s: int) -> BlockLayout:
        """The slashes as key windows (``BlockLayout.kv_windows``). For query block i the keys of
        offset o are ``base_i + x`` with ``x`` in ``[-o, block_q - 1 - o]`` and ``base_i = i * block_q + S - T``:
        one set X of relative keys per head (the union over the offsets), tiled into ``block_k``-wide
        windows from the start of each of its runs; the last ``W mod block_k <= window_tail`` keys of a run of
        W keys become single columns instead of one more window (at most ``window_tail_cap`` per head, runs
        in key order; keys some kept window covers stay there). Past ``max_blocks`` windows, those with
        the least slash mass are dropped. Query block i lists ``base_i + x_j`` for the windows that reach keys
        ``>= 0`` and start at or before its last causal key; its columns are the verticals in no listed window
        or tail and the causal tail keys. Arrays of ``S + block_q`` relative keys per head; no sort over them."""
        bq, bk = self.block_q, self.block_k
        r = bq // bk
        nq = cdiv(t, bq)
        off = s - t
        span = s + bq  # relative key x lives at index x + s - 1, x in [-(s - 1), bq - 1]
        lead = offsets.shape[:2]
        valid = offsets < s
        score = jnp.where(jnp.isinf(slash_score), 1.0, slash_score)
        o_mass = jnp.where(valid, jnp.take_along_axis(score, jnp.clip(offsets, 0, s - 1), -1), 0.0) + 1.0
        lo = jnp.where(valid, s - 1 - offsets, span)
        hi = jnp.where(valid, s - 1 - offsets + bq, span)
        covered = range_cover(lo, hi, span) > 0  # [B, N, span]
        density = range_cover(lo, hi, span, o_mass / bq)  # slash mass per relative key
        x = jnp.arange(span, dtype=jnp.int32)
        run_start = covered & ~jnp.concatenate([jnp.zeros(lead + (1,), bool), covered[..., :-1]], -1)
        run_first = jax.lax.cummax(jnp.where(run_start, x, -1), axis=2)
        # windows tile a run from the multiple of window_align at or below its first key (absolute key of
        # relative index x in query block i: i * bq + off + x - (s - 1); bq is a multiple of window_align)
        run_first = run_first - (run_first + off - (s - 1)) % self.window_align
        # Tails: a run's keys past its last whole window, where they are few (window_tail).
        run_stop = covered & ~jnp.concatenate([covered[..., 1:], jnp.zeros(lead + (1,), bool)], -1)
        run_end = jax.lax.cummin(jnp.where(run_stop, x + 1, span), axis=2, reverse=True)  # one past the run
        width = run_end - run_first
        tail = covered & (x - run_first >= width // bk * bk) & (width % bk <= self.window_tail)
        # Whole run tails in key order while they fit the cap (a tail's keys are contiguous: its last key's
        # prefix count decides).
        seen = jnp.cumsum(tail, -1)
        tail = tail & (jnp.take_along_axis(seen, jnp.clip(run_end - 1, 0, span - 1), -1) <= self.window_tail_cap)
        is_start = covered & ~tail & (((x - run_first) % bk == 0) | run_start)
        win_start = jnp.maximum(x - (x - run_first) % bk, 0)  # start of the window holding relative key x
        n_max = min(span, self.slash_size * (r + 1))
        slot = jnp.where(is_start, jnp.cumsum(is_start, -1) - 1, n_max)
        win_id = jnp.where(covered, jnp.cumsum(is_start, -1) - 1, n_max)
        put = jax.vmap(jax.vmap(lambda i, w: jnp.zeros((n_max + 1,), w.dtype).at[i].add(w)))
        starts = put(slot, jnp.where(is_start, win_start, 0))[..., :n_max]
        mass = put(win_id, jnp.where(covered & ~tail, density, 0.0))[..., :n_max]
        n_win = is_start.sum(-1)  # [B, N]
        cap = min(n_max, self.max_blocks or default_max_blocks(self.slash_size, bk, r))
        listed = jnp.arange(n_max) < n_win[..., None]
        top, pick = jax.lax.top_k(jnp.where(listed, mass + 1.0, -1.0), cap)
        rel = jnp.sort(jnp.where(top >= 0, jnp.take_along_axis(starts, pick, -1), span), -1)  # [B, N, cap]
        if self.window_align > 1:  # a run's first window may reach back to the last window of the run before
            same = jnp.concatenate([jnp.zeros(lead + (1,), bool), rel[..., 1:] == rel[..., :-1]], -1)
            rel = jnp.sort(jnp.where(same, span, rel), -1)
        kept = rel < span
        rel = rel - (s - 1)
        # Per query block: absolute starts, the run that reaches keys >= 0 and starts by the causal end.
        qi = jnp.arange(nq)
        base = qi * bq + off
        qe = jnp.minimum((qi + 1) * bq, t) - 1 + off
        absolute = base[:, None] + rel[..., None, :]  # [B, N, nq, cap]
        ok = kept[..., None, :] & (absolute + bk > 0) & (absolute <= qe[:, None])
        first = (kept[..., None, :] & (absolute + bk <= 0)).sum(-1, keepdims=True)
        count = ok.sum(-1).astype(jnp.int32)
        idx = jnp.minimum(jnp.arange(cap) + first, cap - 1)
        blocks = jnp.where(jnp.arange(cap) < count[..., None], jnp.take_along_axis(absolute, idx, -1), 0)
        # Tail keys no kept window covers, then the verticals: causal and in no kept window or tail (relative
        # key c - base_i outside their union).
        inside = range_cover(jnp.where(kept, rel + s - 1, span + bk), jnp.where(kept, rel + s - 1 + bk, span + bk),
                             span + bk + 1) > 0  # [B, N, span + bk + 1]
        tail = tail & ~inside[..., :span]
        cap_t = min(self.window_tail_cap, span)
        put_t = jax.vmap(jax.vmap(lambda i, w: jnp.zeros((cap_t + 1,), w.dtype).at[i].set(w)))
        tail_rel = put_t(jnp.where(tail, jnp.cumsum(tail, -1) - 1, cap_t),
                         jnp.broadcast_to(x, tail.shape))[..., :cap_t] - (s - 1)  # [B, N, cap_t]
        t_abs = base[:, None] + tail_rel[..., None, :]  # [B, N, nq, cap_t]
        t_ok = (jnp.arange(cap_t) < tail.sum(-1)[..., None, None]) & (t_abs >= 0) & (t_abs <= qe[:, None])
        taken = inside.at[..., :span].set(inside[..., :span] | tail)
        c_rel = cols[..., None, :] - base[:, None] + s - 1  # [B, N, nq, vs]
        in_win = jnp.take_along_axis(taken[..., None, :], jnp.clip(c_rel, 0, span + bk), -1) & (c_rel >= 0)
        col_ok = jnp.concatenate([(cols[..., None, :] <= qe[:, None]) & ~in_win, t_ok], -1)
        all_cols = jnp.concatenate([jnp.broadcast_to(cols[..., None, :], c_rel.shape), t_abs], -1)
        kv_cols = compact_columns(all_cols, col_ok)
        return BlockLayout(kv_blocks=blocks.astype(jnp.int32), kv_block_count=count, kv_columns=kv_cols,
                           kv_column_count=col_ok.sum(-1).astype(jnp.int32), block_q=bq, block_k=bk, q_len=t,
                           kv_len=s, kv_windows=True, window_align=self.window_align)

    def build_layout(self, q, k, *, modality=None) -> BlockLayout:
        cols, offsets, slash = self.estimate(q, k)
        return self.layout_from_index(cols, offsets, slash, q.shape[1], k.shape[1])

    def build_placed(self, q, k, placement) -> BlockLayout:
        """Vertical-Slash inside a boundary wrapper (see `placed_from_index`)."""
        cols, offsets, slash = self.estimate(q, k, rows=placement.est_rows(self.last_q),
                                             k_valid=placement.k_valid)
        return self.placed_from_index(cols, offsets, slash, placement, q.shape[1], k.shape[1])

    def placed_from_index(self, cols, offsets, slash_score, placement, t: int, s: int) -> BlockLayout:
        """Slashes and verticals on original positions, keys in the placement's packed order.

        An offset o takes a row in position block c (``block_k`` positions) to key position
        block ``c - o // block_k`` or one less; these relative blocks (capped at
        ``max_blocks`` by slash mass) are applied to anchor position blocks of each of the
        block's two row runs (`placement.row_runs`): the run's first block, every second
        block after it (``block_q / block_k`` blocks), and its last block. That covers every
        row of a block made of one or two contiguous stretches; rows of a third stretch keep
        their verticals only. Each covered position block becomes the
        packed key blocks holding its keys; verticals are single columns outside them.
        """
        bq, bk = self.block_q, self.block_k
        r = bq // bk
        nkp = cdiv(s, bk)
        order = plc.pack_keys(placement)
        q_perm, q_pos = plc.q_positions(placement, s)
        runs = plc.row_runs(q_pos, bq)  # two runs of positions per block, [B, 1, nq] each
        q_max = runs[1][1]
        # Relative position blocks rho (key block = anchor - rho) and their slash mass.
        valid = offsets < s
        score = jnp.where(jnp.isinf(slash_score), 1.0, slash_score)
        o_mass = jnp.where(valid, jnp.take_along_axis(score, jnp.clip(offsets, 0, s - 1), -1), 0.0)
        rho = offsets // bk
        lead = offsets.shape[:2]
        mass = jnp.zeros(lead + (nkp + 1,), jnp.float32)
        hit = jnp.zeros(lead + (nkp + 1,), bool)
        for w in (0, 1):
            idx = jnp.where(valid, jnp.clip(rho + w, 0, nkp), nkp)
            mass = jax.vmap(jax.vmap(lambda m, i, x: m.at[i].add(x)))(mass, idx, o_mass + 1.0)
            hit = jax.vmap(jax.vmap(lambda h, i: h.at[i].set(True)))(hit, idx)
        cap = min(nkp, self.max_blocks or default_max_blocks(self.slash_size, bk, r))
        top, rel = jax.lax.top_k(jnp.where(hit, mass, -1.0)[..., :nkp], cap)  # [B, N, cap]
        rel_ok = top >= 0
        anchors = []
        for lo_run, hi_run in runs:
            anchors += [jnp.minimum(lo_run // bk + 2 * j, hi_run // bk) for j in range(cdiv(r, 2) + 1)]
            anchors.append(hi_run // bk)
        anchor = jnp.stack(anchors, -1)  # [B, 1, nq, A]
        kblock = anchor[..., None] - rel[..., None, None, :]  # [B, N, nq, A, cap]
        ok = rel_ok[..., None, None, :] & (kblock >= 0)
        kblock = kblock.reshape(kblock.shape[:3] + (-1,))
        ok = ok.reshape(kblock.shape)
        lo_pos = jnp.where(ok, kblock * bk, 1)
        hi_pos = jnp.where(ok, kblock * bk + bk - 1, 0)
        hi_pos = jnp.minimum(hi_pos, q_max[..., None])  # causal
        groups = [(lo // bk, jnp.where(hi >= lo, hi // bk, lo // bk - 1), 2)
                  for lo, hi in plc.segment_ranges(order, 0, lo_pos, hi_pos)]
        blocks, count = ranges_to_lists(groups, cdiv(s, bk))
        # Verticals: causal, valid, not inside one of the row's listed blocks (packed order).
        inv = plc.key_inverse(order)  # [B, N|1, S]
        col_idx = jnp.take_along_axis(jnp.broadcast_to(inv, cols.shape[:2] + (s,)), cols, -1)  # [B, N, vs]
        col_ok = cols[..., None, :] <= q_max[..., None]  # [B, N, nq, vs]
        if placement.k_valid is not None:
            col_ok = col_ok & jnp.take_along_axis(
                jnp.broadcast_to(placement.k_valid[:, None], cols.shape[:2] + (s,)), cols, -1)[..., None, :]
        big = jnp.int32(2 ** 30)
        listed = jnp.where(jnp.arange(blocks.shape[-1]) < count[..., None], blocks, big)
        cb = jnp.broadcast_to(col_idx[..., None, :] // bk, col_ok.shape)
        pos = jax.vmap(jax.vmap(jax.vmap(lambda a, v: jnp.searchsorted(a, v))))(
            jnp.broadcast_to(listed, col_ok.shape[:3] + listed.shape[-1:]), cb)
        found = jnp.take_along_axis(jnp.broadcast_to(listed, col_ok.shape[:3] + listed.shape[-1:]),
                                    jnp.minimum(pos, listed.shape[-1] - 1), -1) == cb
        col_ok = col_ok & ~found
        kv_cols = compact_columns(col_idx, col_ok)
        return BlockLayout(kv_blocks=blocks, kv_block_count=count, kv_columns=kv_cols,
                           kv_column_count=col_ok.sum(-1).astype(jnp.int32), q_perm=q_perm,
                           kv_perm=order.perm, block_q=bq, block_k=bk, q_len=t, kv_len=s)


def index_pairs(cols: jax.Array, offsets: jax.Array, t: int, s: int, block_q: int) -> jax.Array:
    """Query-key pairs a Vertical-Slash index names at query-block granularity (what a
    diagonal-window kernel such as MInference's computes at best), float32 ``[B, N]``: for each
    query block, its rows times the keys up to its last causal key that lie on one of its slash
    ranges (``[base - o, base + block_q - 1 - o]``, base = its first query position) or are a
    vertical. cols ``[B,N,vs]`` and offsets ``[B,N,ss]`` as from `VerticalSlash.estimate`
    (offsets >= S name nothing). Compare with ``layout.density() * causal_pairs(t, s)``."""
    nq, off, span = cdiv(t, block_q), s - t, s + block_q
    valid = offsets < s
    covered = range_cover(jnp.where(valid, s - 1 - offsets, span), jnp.where(valid, s - 1 - offsets + block_q, span),
                          span) > 0  # relative key x at index x + s - 1
    prefix = jnp.concatenate([jnp.zeros(covered.shape[:2] + (1,), jnp.int32), jnp.cumsum(covered, -1)], -1)
    qi = jnp.arange(nq)
    base = qi * block_q + off
    qe = jnp.minimum((qi + 1) * block_q, t) - 1 + off
    rows = (jnp.minimum((qi + 1) * block_q, t) - qi * block_q).astype(jnp.float32)
    first = jnp.clip(s - 1 - base, 0, span)  # relative key -base (key 0)
    last = jnp.clip(qe - base + s, 0, span)  # one past relative key qe - base
    slash_keys = prefix[..., last] - prefix[..., first]  # [B, N, nq]
    c_rel = cols[..., None, :] - base[:, None] + s - 1
    on_slash = jnp.take_along_axis(covered[..., None, :], jnp.clip(c_rel, 0, span - 1), -1) & (c_rel < span)
    vert = ((cols[..., None, :] <= qe[:, None]) & ~on_slash).sum(-1)
    return ((slash_keys + vert).astype(jnp.float32) * rows).sum(-1)
