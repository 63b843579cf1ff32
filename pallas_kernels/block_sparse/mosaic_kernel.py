"""Block-sparse flash attention forward for Hopper (sm90) in Pallas Mosaic GPU.

One CTA per (128 query rows, query head, batch), three warpgroups:

* a producer warpgroup walks the layout's key-block list and brings each listed K and V
  tile into a ring of shared-memory stages with TMA, waiting for a stage to be released
  before refilling it;
* two consumer warpgroups own 64 query rows each (their Q tile stays in shared memory).
  For every listed block they issue ``S = Q K^T`` with wgmma, mask it when the block can
  hold a masked pair, update the online softmax (base 2, float32 statistics in registers),
  and issue ``O += P V`` with P from registers. A shared "schedule" barrier makes the two
  consumers alternate (one runs its softmax while the other's matrix products run), as
  in FlashAttention-3.

The grid runs one CTA per work item (128 query rows, head, batch), query blocks fastest and the longest causal
rows first. The persistent grid (``persistent``; by default for short work, `auto_persistent`) runs one CTA per
multiprocessor instead, each taking its items (longest lists first, `item_order`, in snake rounds) in turn with its
K / V rings carrying over, each consumer loading its next Q during its last step and storing O from a tile of its
own.

Two query-block sizes. With ``block_q == 128`` both consumers work on one query block and share its
list: every K/V tile is loaded once for 128 rows. With ``block_q == 64`` (the granularity of
MInference's kernels: a diagonal band or a query block's own list costs half the pairs) each consumer
owns one 64-row query block with its own list, and the producer fills one ring of stages per consumer;
the consumer with the shorter list runs the schedule handshakes of the remaining steps without work,
so the pair stays in step. Tried and reverted (commit e01c079, `minference-side-by-side-union-*` results): one
ring over the union of the two lists, each tile loaded once (20% fewer tiles on MInference's top-100 mask), ran
slower (35.7-40.1 against 31.9 ms at 512k on an H100), and so did consumers without the schedule barrier.

``key_pairs`` (default for 128-row query blocks over 64-key lists and for every 32-key list, `auto_key_pairs`): a
step loads two consecutive list entries into one stage of ``2 * block_k`` keys (two TMA copies onto one barrier)
and computes them as one tile, one online-softmax update per step; a list of odd length ends with a masked half.
32-key lists always run this way (wgmma's ``P V`` needs 64 keys with the 128-byte swizzle).

Causality is decided on original positions. Without permutations a row's position is ``row + q_offset`` and a key's
its index, and the mask is only computed for blocks whose last key can be past a row of the warpgroup (or that hold
padding / an id out of range). With positions (`launch`'s ``q_pos`` / ``k_pos``: permuted rows or keys, gathered
columns) the kernel reads them from int32 vectors and masks every block except the entries every row of their query
block sees whole (`mosaic_lists.visible_entries`). Key windows (``ranges``) compute part of a tile. The passes over a
layout (permutations, single columns, row ranges) and the public entry are in `mosaic_gpu`; the kernel's limits and
defaults in `mosaic_options`, its list operands in `mosaic_lists`.

Limits: bf16 / fp16 only; ``block_q`` 64 or 128; ``block_k`` 32, 64 or 128; head dims are
zero-padded to a multiple of 64, at most 128. Out: ``[B, T, N, D]`` in q's dtype, lse
``[B, N, T]`` float32 (natural log); empty rows give 0 / -inf; non-finite inputs follow
`pallas_kernels.nonfinite` (a visible NaN / inf key or value makes the row NaN).

CPU: Mosaic GPU's interpret mode in jax 0.11.2 cannot run this kernel (its interpreter
has no rule for ``run_state`` with a wgmma accumulator, and its wgmma takes the A operand
only from shared memory, not from registers as ``P V`` needs); tests of the kernel
itself run on a Hopper GPU (tests/pallas_kernels/block_sparse/test_mosaic_gpu_gpu.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_fa3 as fa3
from pallas_kernels.block_sparse.mosaic_lists import item_order, visible_entries
from pallas_kernels.block_sparse.mosaic_options import BLOCK_Q, TMA_ROWS, WG_ROWS, pair_v_stages, ring_count
from pallas_kernels.platform import num_cores
from pallas_kernels.tiling import LOG2E

# Each consumer keeps its rows' sums as [64, SUM_COLUMNS] column partials (`mosaic_fa3.init_rows`), reduced once at
# the end: 2-7% faster than a shuffle reduction every step (one H100, 2026-11-27, commit 2850066; README).
SUM_COLUMNS = 8


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Static parameters of one kernel launch.

    Attributes:
      block_k: key rows per list entry (32, 64 or 128).
      head_dim: padded head dim (64 or 128).
      stages: K/V shared-memory stages the producer runs ahead (>= 2).
      groups: query heads per key/value head of the kernel's k / v operands.
      num_kv_blocks: key tiles in the padded k / v (ids outside ``[0, num_kv_blocks)`` count nothing).
      kv_len: keys at or past this position are padding and never visible.
      q_offset: original position of query row 0 (without permutations).
      causal, gap, window: as in `BlockLayout` (positions original).
      sm_scale: softmax scale.
      leads: which of (batch, head, query block) dims each layout operand has (size > 1).
      has_pos: the kernel reads original positions from ``q_pos`` / ``k_pos`` operands.
      block_q: 128 (both consumers share one query block and its list) or 64 (each consumer has its own
        query block and list, and its own ring of K/V stages).
      num_q_blocks: query blocks of the layout.
      grid: CTAs launched; each runs the work items (128 query rows, head, batch) ``pid, pid + grid, ...``
        (`launch`: one per item, or with ``persistent`` one per multiprocessor, so a CTA's next item loads its
        first K / V tiles while the consumers finish the last one).
      windows: the lists hold tile starts (multiples of 8) of key windows (`window_tiles`), each with its own
        key range ``[lo, hi)`` (``kv_lo`` / ``kv_hi`` operands); the rest of the tile is masked.
      pair: each step computes two consecutive list entries as one tile of ``2 * block_k`` keys (a list of odd
        length ends with a masked half).
      v_stages: V stages per ring (0: ``stages``); K keeps ``stages``.
      overlap: each consumer issues step j + 1's ``S = Q K^T`` and step j's ``P V`` and runs step j + 1's mask and
        softmax while ``P V`` is in flight (`mosaic_fa3.qk_then_pv`).
      pingpong: the consumers alternate on the schedule barrier (one's softmax while the other's products run):
        two handshakes per step, after issuing ``S = Q K^T`` and after the softmax.
      visible: with original positions, a ``visible`` operand shaped like the lists says which entries every row of
        their query block sees whole (`visible_entries`); their position mask is skipped.
      persistent: ``grid`` CTAs (one per multiprocessor) take the items of an ``order`` operand (longest lists
        first) in rounds of ``grid``, in snake order (round r's position p is CTA p for even r, ``grid - 1 - p``
        for odd r); each consumer loads its next item's Q once its last ``S = Q K^T`` is done and stores O from
        an O tile of its own.
      heads_first: work items run query heads fastest (then query blocks, the last rows first), so the CTAs that run
        at the same time are the heads of a few query blocks, and the query heads of one key / value head read
        their shared tiles from L2; else query blocks fastest.
      row_stride: 0, or the rows of each query block are an arithmetic progression of this stride in the original
        order (Grid's phase-major rows: one phase, consecutive frames): q and out are the original arrays viewed
        as ``[B, T / row_stride, row_stride, N, Dp]``, a ``q_box`` operand holds each query block's first original
        row, and the kernel loads Q and stores O as strided boxes there (no gather of q, no output put back); lse
        stays in the layout's row order.
      prior: the kernel merges a result computed before over other keys into each row's: ``prior_out`` (shaped
        and viewed like q) and ``prior_lse`` (float32 ``[B, N, Tp]``, natural log, in the layout's row order)
        operands, loaded during each item into an O tile of the consumer's own (the persistent grid's) and merged
        by lse before the store, as `merge.merge_attention` would (an empty prior row, lse -inf, adds nothing).
      row_mask: a ``row_mask`` operand (int32 ``[B, N, Tp]`` in the layout's row order) names the rows the layout is
        for; on the others the kernel's own result is dropped before the store (they get the prior, or the empty
        result: O 0, lse -inf), whatever the layout lists there (`merge.merge_onto`).
    """

    block_k: int
    head_dim: int
    stages: int
    groups: int
    num_kv_blocks: int
    kv_len: int
    q_offset: int
    causal: bool
    gap: int
    window: int
    sm_scale: float
    leads: tuple[tuple[str, tuple[bool, bool, bool]], ...]
    has_pos: bool
    block_q: int = BLOCK_Q
    num_q_blocks: int = 1
    grid: int = 1
    windows: bool = False
    pair: bool = False
    v_stages: int = 0
    overlap: bool = False
    pingpong: bool = True
    persistent: bool = False
    visible: bool = False
    heads_first: bool = False
    row_stride: int = 0
    prior: bool = False
    row_mask: bool = False



def _kernel(q_ref, k_ref, v_ref, blocks_ref, count_ref, *refs, cfg: MosaicConfig):
    refs = list(refs)
    order_ref = refs.pop(0) if cfg.persistent else None
    lo_ref, hi_ref = (refs.pop(0), refs.pop(0)) if cfg.windows else (None, None)
    qpos_ref, kpos_ref = (refs.pop(0), refs.pop(0)) if cfg.has_pos else (None, None)
    vis_ref = refs.pop(0) if cfg.visible else None
    box_ref = refs.pop(0) if cfg.row_stride else None
    prior_o_ref, prior_lse_ref = (refs.pop(0), refs.pop(0)) if cfg.prior else (None, None)
    mask_ref = refs.pop(0) if cfg.row_mask else None
    out_ref, lse_ref = refs
    leads = dict(cfg.leads)
    bk, dp, stages = cfg.block_k, cfg.head_dim, cfg.stages
    v_stages = cfg.v_stages or stages
    per = 2 if cfg.pair else 1  # list entries per step
    kt = per * bk  # keys per step (one K / V stage)
    split = cfg.block_q == WG_ROWS  # one query block (and key list) per consumer warpgroup
    rings = ring_count(cfg.block_q)
    dtype = q_ref.dtype
    rows_total = q_ref.shape[1] * q_ref.shape[2] if cfg.row_stride else q_ref.shape[1]
    ctas = rows_total // BLOCK_Q
    heads = q_ref.shape[-2]
    items = ctas * heads * q_ref.shape[0]
    pid = lax.axis_index("items")

    def position(t):
        """This CTA's position in the item order of its t-th item (persistent: snake rounds of ``grid``)."""
        if not cfg.persistent:
            return pid + t * cfg.grid
        return t * cfg.grid + jnp.where(lax.rem(t, 2) == 0, pid, cfg.grid - 1 - pid)

    full, rest = divmod(items, cfg.grid)
    my_items = full + (position(full) < items).astype(jnp.int32) if rest else jnp.int32(full)

    class Item(NamedTuple):
        """One (128 query rows, head, batch) work item. Item indices run query blocks fastest (``heads_first``:
        query heads fastest, then query blocks), the last rows (the longest causal ones) first; the item grid takes
        them in that order, the persistent grid in `item_order`'s."""
        cta: jax.Array
        head: jax.Array
        batch: jax.Array
        kv_head: jax.Array  # the key / value head the query head reads

        @classmethod
        def of(cls, t):
            w = order_ref[position(t)] if cfg.persistent else position(t)
            if cfg.heads_first:
                head, row = lax.rem(w, heads), lax.rem(w // heads, ctas)
            else:
                head, row = lax.rem(w // ctas, heads), lax.rem(w, ctas)
            return cls(ctas - 1 - row, head, w // (ctas * heads), lax.div(head, cfg.groups))

        def lead(self, name, qb):
            has_b, has_n, has_q = leads[name]
            return (self.batch if has_b else 0, self.head if has_n else 0, qb if has_q else 0)

        def query_block(self, w):
            """Query block of consumer w, clamped into the layout (split: block 2 * cta + w)."""
            return jnp.minimum(self.cta * 2 + w, cfg.num_q_blocks - 1) if split else self.cta

        def count(self, w):
            c = count_ref[self.lead("kv_block_count", self.query_block(w))]
            return jnp.where(self.cta * 2 + w < cfg.num_q_blocks, c, 0) if split else c

        def steps(self, w):
            """Steps of consumer w's list (``per`` entries each)."""
            return (self.count(w) + per - 1) // per if per > 1 else self.count(w)

        def entries(self, j, w):
            """(entry, present) of each half of step j: a half past the list loads the list's last entry again,
            and masks it."""
            if per == 1:
                return ((j, True),)
            last = jnp.maximum(self.count(w) - 1, 0)
            return tuple((jnp.minimum(per * j + h, last), per * j + h < self.count(w)) for h in range(per))

        def tile(self, j, w):
            """(first key row of the tile loaded, entry in range) of entry j of consumer w's list."""
            raw = blocks_ref[*self.lead("kv_blocks", self.query_block(w)), j]
            if cfg.windows:  # prepared by `window_tiles`: inside k / v, a multiple of 8
                return pl.multiple_of(raw, TMA_ROWS), True
            ok = (raw >= 0) & (raw < cfg.num_kv_blocks)
            return jnp.where(ok, raw, 0) * bk, ok

        def whole(self, j, w):
            """Entry j of consumer w's list is seen whole by every row of its query block (`visible_entries`)."""
            return vis_ref[*self.lead("visible", self.query_block(w)), j] != 0

        def window(self, j, w):
            """Keys ``[lo, hi)`` entry j of a window list computes."""
            at = (*self.lead("kv_lo", self.query_block(w)), j)
            return lo_ref[at], hi_ref[at]

        def rows(self, ref, wg):
            """Consumer wg's 64 rows of ``ref`` (q or out, ``[B, T, N, Dp]``; ``row_stride``: the strided box of its
            query block in the ``[B, T / stride, stride, N, Dp]`` view)."""
            if not cfg.row_stride:
                return ref.at[self.batch, pl.ds(self.cta * BLOCK_Q + wg * WG_ROWS, WG_ROWS), self.head]
            first = box_ref[*self.lead("q_box", self.query_block(wg))]
            frame = pl.multiple_of(first // cfg.row_stride + (0 if split else wg * WG_ROWS), TMA_ROWS)
            return ref.at[self.batch, pl.ds(frame, WG_ROWS), lax.rem(first, cfg.row_stride), self.head]

    def body(scoped):
        (qo_smem, k_smem, v_smem, lse_pos, *extra), (k_bar, v_bar, q_bar, p_bar, epilogue_bar), (k_free, v_free), \
            sched = scoped
        own_o = cfg.persistent or cfg.prior  # the consumers have O tiles of their own (else the Q tiles hold O)
        o_smem = extra.pop(0) if own_o else qo_smem
        prior_l_smem = extra.pop(0) if cfg.prior else None
        mask_smem = extra.pop(0) if cfg.row_mask else None
        epilogue = cfg.prior or cfg.row_mask  # operands the store merges in, loaded during the item
        lse_smem, pos_smem = lse_pos if cfg.has_pos else (lse_pos, None)

        def q_pos_smem(wg):
            return pos_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)]

        def k_pos_smem(slot, half=0, width=kt):
            """The key positions of V slot ``slot`` (its keys ``[half * bk, half * bk + width)``)."""
            return pos_smem.at[pl.ds(2 * WG_ROWS + slot * kt + half * bk, width)]
        schedule = functools.partial(fa3.schedule, sched)
        pp = sched if cfg.pingpong else None  # the schedule barrier, for the handshake inside a product
        handshake = schedule if cfg.pingpong else (lambda: None)

        def consumer(wg):
            q_smem, l_smem = qo_smem.at[wg], lse_smem.at[wg]
            ring_k, ring_v = (wg * stages, wg * v_stages) if split else (0, 0)
            scale = cfg.sm_scale * LOG2E

            def load_q(it):
                """Item ``it``'s Q rows of this consumer into its Q tile."""
                plgpu.copy_gmem_to_smem(it.rows(q_ref, wg), q_smem, q_bar.at[wg])

            def load_epilogue(it, row0):
                """Item ``it``'s prior result rows of this consumer into its O tile and prior lse row, and its rows'
                mask."""
                if cfg.prior:
                    plgpu.copy_gmem_to_smem(it.rows(prior_o_ref, wg), o_smem.at[wg], epilogue_bar.at[wg])
                    plgpu.copy_gmem_to_smem(prior_lse_ref.at[it.batch, it.head, pl.ds(row0, WG_ROWS)],
                                            prior_l_smem.at[wg], epilogue_bar.at[wg])
                if cfg.row_mask:
                    plgpu.copy_gmem_to_smem(mask_ref.at[it.batch, it.head, pl.ds(row0, WG_ROWS)],
                                            mask_smem.at[wg], epilogue_bar.at[wg])

            def masked_rows(acc, m, l):
                """(acc, m, l) emptied on the rows outside the mask (their keys dropped, NaN included)."""
                with jax.named_scope("row_mask"):
                    own = plgpu.load(mask_smem.at[wg], layout=fa3.ROW, optimized=False).astype(jnp.float32)
                    off = own == 0.0
                    off_rows = fa3.by_row(own, acc.shape) == 0.0
                    return (jnp.where(off_rows, 0.0, acc), jnp.where(off, -jnp.inf, m), jnp.where(off, 0.0, l))

            def merged_with_prior(acc, m, l):
                """(acc, m, l) with the prior result as one more key: its lse (base 2) as the logit, its O row as
                the value (`merge.merge_attention`'s rules: an empty prior row adds nothing whatever its O)."""
                with jax.named_scope("prior"):
                    lp = plgpu.load(prior_l_smem.at[wg], layout=fa3.ROW, optimized=False) * LOG2E
                    o_p = o_smem.at[wg][...].astype(jnp.float32)
                    m_new = jnp.maximum(m, lp)
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                    alpha, beta = jnp.exp2(m - m_use), jnp.exp2(lp - m_use)
                    beta_rows = fa3.by_row(beta, o_p.shape)
                    term = jnp.where(beta_rows == 0.0, 0.0, o_p * beta_rows)
                    return acc * fa3.by_row(alpha, acc.shape) + term, m_new, l * alpha + beta

            def run_item(t, done):
                """Item t of this CTA; ``done``: K/V stages of this consumer's ring used by earlier items."""
                with jax.named_scope("item"):  # the item's order entry and list lengths (scalar global loads)
                    it = Item.of(t)
                    row0 = it.cta * BLOCK_Q + wg * WG_ROWS
                    if epilogue:  # (the prior into the O tile, once the last item's stores have read it)
                        if cfg.persistent and cfg.prior:
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        load_epilogue(it, row0)
                    count = it.steps(wg)  # steps of this consumer's list
                    steps = jnp.maximum(it.steps(0), it.steps(1)) if split else count
                if cfg.persistent:  # this item's Q was loaded during the last one; the next one's loads after the
                    # last S = Q K^T of this one (`prefetch_q`)
                    nxt = Item.of(jnp.minimum(t + 1, my_items - 1))

                    def prefetch_q():
                        pl.when(t + 1 < my_items)(lambda: load_q(nxt))
                else:  # q_smem / l_smem held no earlier item's O / lse
                    load_q(it)
                q_vec = None
                if cfg.has_pos:  # the rows' original positions, through shared memory
                    if cfg.persistent:  # l_smem (over the positions) held the last item's lse: its store read it
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.copy_gmem_to_smem(qpos_ref.at[*it.lead("q_pos", 0)[:2], pl.ds(row0, WG_ROWS)],
                                            q_pos_smem(wg), q_bar.at[wg + 2])
                    plgpu.barrier_wait(q_bar.at[wg + 2])
                    q_vec = plgpu.load(q_pos_smem(wg), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                with jax.named_scope("wait_q"):  # (an item's start and end: profiler ranges of their own)
                    plgpu.barrier_wait(q_bar.at[wg])
                q_first = row0 + cfg.q_offset

                def in_window(ok, cols, start, keys):
                    """Only the keys ``[lo, hi)`` of a window entry (column c is key start + c)."""
                    if keys is None:
                        return ok
                    lo, hi = keys
                    return ok & (cols >= lo - start) & (cols < hi - start)

                def mask_by_index(s, start, limit, keys):
                    """Positions are indices: row r at q_first + r, key c at start + c."""
                    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                    ok = in_window(cols < limit - start, cols, start, keys)
                    if cfg.causal:  # a bound per row (not a tile of c - r: fewer registers live across steps)
                        rows = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS,), 0, layout=fa3.ROW)
                        # key start + c visible to row r iff start + c <= q_first + r - gap: c against a bound per
                        # row where start is one value, start + c where it is one per column (paired entries)
                        base, key = (start, cols) if jnp.ndim(start) == 0 else (0, cols + start)
                        ok = ok & (key <= fa3.by_row(rows + (q_first - base - cfg.gap), s.shape))
                        if cfg.window:
                            ok = ok & (key > fa3.by_row(rows + (q_first - base - cfg.window), s.shape))
                    return jnp.where(ok, s, -jnp.inf)

                def mask_by_position(s, slot, start, limit, keys):
                    k_vec = plgpu.load(k_pos_smem(slot), layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                    kp = lax.broadcast_in_dim(k_vec, s.shape, [1])
                    qp = lax.broadcast_in_dim(q_vec, s.shape, [0])
                    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                    ok = in_window(kp < limit, cols, start, keys)
                    if cfg.causal:
                        ok = ok & (kp + cfg.gap <= qp)
                        if cfg.window:
                            ok = ok & (kp + cfg.window > qp)
                    return jnp.where(ok, s, -jnp.inf)

                def k_stage(j):
                    return ring_k + lax.rem(done + j, stages)

                def v_stage(j):
                    return ring_v + lax.rem(done + j, v_stages)

                def half_params(e, present):
                    """(first key, keys visible below, key range or None) of list entry e."""
                    start, in_range = it.tile(e, wg)
                    limit = jnp.where(in_range & present, cfg.kv_len, 0)  # an entry out of range shows nothing
                    return start, limit, (it.window(e, wg) if cfg.windows else None)

                def needs_mask(start, limit, keys):
                    need = (start + bk > limit)
                    if keys is not None:
                        need = need | (keys[0] != start) | (keys[1] != start + bk)
                    if cfg.causal:
                        need = need | (start + bk - 1 + cfg.gap > q_first)
                        if cfg.window:
                            need = need | (start + cfg.window <= q_first + WG_ROWS - 1)
                    return need

                def per_column(s, halves):
                    """(start, limit, keys) of the step's tile: the entry's own, or with ``per`` entries a value
                    per column of S (column c of half h is key ``start_h + c - h * bk``)."""
                    if per == 1:
                        return halves[0]
                    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                    first = cols < bk
                    (s0, l0, w0), (s1, l1, w1) = halves
                    pick = lambda a, b: jnp.where(first, a, b)  # noqa: E731
                    keys = None if w0 is None else (pick(w0[0], w1[0]), pick(w0[1], w1[1]))
                    return pick(s0, s1 - bk), pick(l0, l1), keys

                def mask_plan(j):
                    """(each half's (start, limit, keys), whether step j's tile is masked (None: always)) from the
                    layout's operands. Read before the step's ``S = Q K^T`` is issued: they are global loads, which
                    LLVM does not move above the product's wait (an asm that may write memory), so read after it
                    their latency would sit on the softmax's path; read first, they complete under the product (one
                    H200, 2026-11-29: a 128-key step's softmax 1,655 -> 1,601 cycles,
                    `mosaic-profile-random3-32k-bk128-mask-plan_*`)."""
                    entries = it.entries(j, wg)
                    halves = [half_params(e, ok) for e, ok in entries]
                    if cfg.has_pos and not cfg.visible:
                        return halves, None  # every tile is masked by position
                    need = ([~(it.whole(e, wg) & ok) for e, ok in entries] if cfg.has_pos else
                            [needs_mask(*h) for h in halves])
                    return halves, functools.reduce(jnp.logical_or, need)

                def masked(j, plan, s):
                    """S of step j with its masked pairs -inf (``plan``: `mask_plan(j)`); by index, only for a tile
                    that can hold a masked pair (a ``lax.cond``)."""
                    halves, need = plan
                    if cfg.has_pos:
                        plgpu.barrier_wait(p_bar.at[v_stage(j)])  # the keys' positions (waited for in any case)
                        if not cfg.visible:
                            return mask_by_position(s, v_stage(j), *per_column(s, halves))
                        return lax.cond(need, lambda x: mask_by_position(x, v_stage(j), *per_column(x, halves)),
                                        lambda x: x, s)
                    return lax.cond(need, lambda x: mask_by_index(x, *per_column(x, halves)), lambda x: x, s)

                def step(j, carry):
                    acc, m, l = carry
                    ks, vs = k_stage(j), v_stage(j)
                    with jax.named_scope("plan"):
                        plan = mask_plan(j)  # before S = Q K^T is issued
                    with jax.named_scope("qk"):  # (named regions: the profiler's ranges, see `launch`)
                        s = fa3.qk(q_smem, k_smem.at[ks], pp, kt)
                    plgpu.barrier_arrive(k_free.at[ks])
                    if cfg.persistent:
                        pl.when(j == count - 1)(prefetch_q)
                    with jax.named_scope("softmax"):
                        sm = fa3.softmax_step(masked(j, plan, s), m, l, acc, scale=scale, dtype=dtype)
                    with jax.named_scope("wait_v"):
                        if cfg.pingpong:
                            plgpu.barrier_arrive(sched)  # softmax done
                        plgpu.barrier_wait(v_bar.at[vs])
                        if cfg.pingpong:
                            plgpu.barrier_wait(sched)  # the tensor cores are ours

                    def wait_next_k():
                        with jax.named_scope("next_k"):
                            pl.when(j + 1 < count)(lambda: plgpu.barrier_wait(k_bar.at[k_stage(j + 1)]))

                    with jax.named_scope("pv"):
                        acc = fa3.pv(sm.acc, sm.p, v_smem.at[vs], wait_next_k)
                    plgpu.barrier_arrive(v_free.at[vs])
                    return acc, sm.m, sm.l

                def idle(j, carry):
                    """A step past this consumer's list while the other one still computes (split): the two
                    schedule handshakes of a step, so the consumers stay paired."""
                    schedule()
                    schedule()
                    return carry

                def overlapped(acc, m, l):
                    """Steps 0 .. count - 1 pipelined within the warpgroup in FlashAttention-3's order: step j + 1's
                    ``S = Q K^T``, then step j's ``P V``; step j + 1's mask and softmax while ``P V`` runs
                    (`fa3.qk_then_pv`)."""

                    def soft(j, plan, s, m, l):
                        sm = fa3.softmax_step(masked(j, plan, s), m, l, None, scale=scale, dtype=dtype)
                        handshake()
                        return sm

                    def first(_):
                        """Step 0's S and softmax (count > 0); O is still 0: nothing to rescale."""
                        ks = k_stage(0)
                        with jax.named_scope("plan"):
                            plan = mask_plan(0)
                        plgpu.barrier_wait(k_bar.at[ks])
                        s = fa3.qk(q_smem, k_smem.at[ks], pp, kt)
                        plgpu.barrier_arrive(k_free.at[ks])
                        sm = soft(0, plan, s, m, l)
                        return sm.m, sm.l, sm.p

                    def ostep(j, carry):
                        """Step j + 1's S, then step j's P V; step j + 1's softmax while P V runs."""
                        acc, m, l, p = carry
                        vs, ks = v_stage(j), k_stage(j + 1)
                        with jax.named_scope("plan"):
                            plan = mask_plan(j + 1)
                        plgpu.barrier_wait(k_bar.at[ks])
                        plgpu.barrier_wait(v_bar.at[vs])
                        acc, sm = fa3.qk_then_pv(acc, p, v_smem.at[vs], q_smem, k_smem.at[ks], kt,
                                                 lambda s: soft(j + 1, plan, s, m, l), pp,
                                                 lambda: plgpu.barrier_arrive(k_free.at[ks]))
                        plgpu.barrier_arrive(v_free.at[vs])
                        return acc * fa3.by_row(sm.alpha, acc.shape), sm.m, sm.l, sm.p

                    def two_steps(i, carry):
                        """Steps 2i and 2i + 1, so that each step's new P has registers of its own (one step a
                        loop iteration would write it into the loop's P, which that step's P V reads in flight:
                        ptxas then serialises every wgmma, note C7513)."""
                        return ostep(2 * i + 1, ostep(2 * i, carry))

                    def last(a, p):
                        """The last step's P V."""
                        vs = v_stage(count - 1)
                        plgpu.barrier_wait(v_bar.at[vs])
                        a = fa3.pv(a, p, v_smem.at[vs], handshake)
                        handshake()
                        plgpu.barrier_arrive(v_free.at[vs])
                        return a

                    def odd_step_and_last(c):
                        """The step `two_steps` leaves and the last P V in one branch (a step's P returned by a
                        ``lax.cond`` shares the registers of the cond's input P, which its P V reads in flight)."""
                        acc, m, l, p = ostep(count - 2, c)
                        return last(acc, p), m, l

                    p0 = plgpu.layout_cast(jnp.zeros((WG_ROWS, kt), dtype), plgpu.Layout.WGMMA)
                    m, l, p = lax.cond(count > 0, first, lambda _: (m, l, p0), None)
                    carry = lax.fori_loop(0, (count - 1) // 2, two_steps, (acc, m, l, p))
                    which = jnp.where(count == 0, 0, jnp.where(count % 2 == 1, 1, 2))
                    return lax.switch(which, [lambda c: c[:3], lambda c: (last(c[0], c[3]), *c[1:3]),
                                              odd_step_and_last], carry)

                acc, m, l = fa3.init_rows(dp, SUM_COLUMNS)
                if not cfg.overlap:
                    with jax.named_scope("wait_first_k"):
                        pl.when(count > 0)(lambda: plgpu.barrier_wait(k_bar.at[k_stage(0)]))
                with jax.named_scope("offset"):
                    pl.when(wg == 1)(handshake)  # the two consumers run half a step apart
                if cfg.overlap:  # count + 1 units of two handshakes (the last P V is one of its own)
                    acc, m, l = overlapped(acc, m, l)
                    units = lambda c: c + (c > 0).astype(c.dtype)  # noqa: E731
                else:
                    acc, m, l = lax.fori_loop(0, count, step, (acc, m, l))
                    units = lambda c: c  # noqa: E731
                if cfg.persistent and cfg.overlap:
                    prefetch_q()
                elif cfg.persistent:  # the last step loaded it (`step`), unless there was none
                    pl.when(count == 0)(prefetch_q)
                if split and cfg.pingpong:
                    lax.fori_loop(units(count), units(steps), idle, jnp.int32(0))
                with jax.named_scope("resync"):
                    pl.when(wg == 0)(handshake)

                with jax.named_scope("finish"):  # the row sums; the prior and row mask merged in
                    l = fa3.row_sums(l)
                    if epilogue:
                        plgpu.barrier_wait(epilogue_bar.at[wg])
                    if cfg.row_mask:
                        acc, m, l = masked_rows(acc, m, l)
                    if cfg.prior:
                        acc, m, l = merged_with_prior(acc, m, l)
                with jax.named_scope("write"):
                    if cfg.persistent and not cfg.prior:  # the last item's stores have read o_smem / l_smem
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    fa3.write_rows(acc, m, l, o_smem.at[wg], l_smem, it.rows(out_ref, wg),
                                   lse_ref.at[it.batch, it.head, pl.ds(row0, WG_ROWS)], dtype)
                return done + count

            if cfg.persistent:
                load_q(Item.of(0))
            lax.fori_loop(0, my_items, run_item, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

        def producer():
            def half_tile(ref, slot, h):
                return ref.at[slot] if per == 1 else ref.at[slot, pl.ds(h * bk, bk)]

            def fetch_k(it, start, slot, h):
                plgpu.copy_gmem_to_smem(k_ref.at[it.batch, pl.ds(start, bk), it.kv_head], half_tile(k_smem, slot, h),
                                        k_bar.at[slot])

            def fetch_v(it, start, slot, h):
                """V tile (and, with positions, the keys' positions: both freed after P V); h: the half of a
                paired stage."""
                plgpu.copy_gmem_to_smem(v_ref.at[it.batch, pl.ds(start, bk), it.kv_head], half_tile(v_smem, slot, h),
                                        v_bar.at[slot])
                if cfg.has_pos:
                    plgpu.copy_gmem_to_smem(kpos_ref.at[*it.lead("k_pos", 0)[:2], pl.ds(start, bk)],
                                            k_pos_smem(slot, h, bk), p_bar.at[slot])

            def run_item(t, done):
                """Item t's K / V tiles into the rings; ``done``: tiles each ring took for earlier items (a
                stage is refilled once the consumers released it, from the ``stages``-th tile of the kernel on)."""
                it = Item.of(t)
                counts = [it.steps(w) for w in range(rings)]

                def starts(j, w):
                    return [it.tile(e, w)[0] for e, _ in it.entries(j, w)]

                def load(j, w, ring_stages, free, fetch, name):
                    """Tile j of ring w into its stage, once the consumers freed the stage (K or V)."""
                    g = done[w] + j
                    slot = w * ring_stages + lax.rem(g, ring_stages)
                    with jax.named_scope(name):
                        pl.when(g >= ring_stages)(lambda: plgpu.barrier_wait(free.at[slot]))
                    for h, start in enumerate(starts(j, w)):
                        fetch(it, start, slot, h)

                load_k = functools.partial(load, ring_stages=stages, free=k_free, fetch=fetch_k, name="k_free")
                load_v = functools.partial(load, ring_stages=v_stages, free=v_free, fetch=fetch_v, name="v_free")

                def fill(j):
                    for w in range(rings):
                        @pl.when(j < counts[w])
                        def _():
                            load_k(j, w)
                            load_v(j, w)

                def fill_k_ahead(j):
                    """K tile j and V tile j - 1: with `overlap` a consumer waits for K tile j + 1 with V tile j,
                    before it frees V tile j, so a K load must not wait behind the release of a V stage (with one
                    producer for both rings, the consumers would wait on each other through the schedule barrier
                    and the producer)."""
                    for w in range(rings):
                        pl.when(j < counts[w])(lambda: load_k(j, w))
                    for w in range(rings):
                        pl.when((j >= 1) & (j - 1 < counts[w]))(lambda: load_v(j - 1, w))

                most = functools.reduce(jnp.maximum, counts)
                if cfg.overlap:
                    pl.loop(0, most + 1)(fill_k_ahead)
                else:
                    pl.loop(0, most)(fill)
                return tuple(d + c for d, c in zip(done, counts, strict=True))

            lax.fori_loop(0, my_items, run_item, (jnp.int32(0),) * rings)

        fa3.warp_specialized(consumer, producer)

    transforms = fa3.SMEM_TRANSFORMS
    n_k, n_v = rings * stages, rings * v_stages
    pl.run_scoped(
        lambda *scoped: body(scoped),
        (
            plgpu.SMEM((2, WG_ROWS, dp), dtype, transforms=transforms),
            plgpu.SMEM((n_k, kt, dp), dtype, transforms=transforms),
            plgpu.SMEM((n_v, kt, dp), dtype, transforms=transforms),
            # Each consumer's lse row (written after its last step) shares memory with its query rows' positions
            # (read into registers before its first step). The positions: both consumers' query rows, then the
            # keys of each K/V slot, in one buffer (every shared-memory buffer is padded to 1 KiB).
            plgpu.RefUnion(plgpu.SMEM((2, WG_ROWS), jnp.float32),
                           plgpu.SMEM((2 * WG_ROWS + n_v * kt,), jnp.int32))
            if cfg.has_pos else plgpu.SMEM((2, WG_ROWS), jnp.float32),
            *([plgpu.SMEM((2, WG_ROWS, dp), dtype, transforms=transforms)] if cfg.persistent or cfg.prior else []),
            *([plgpu.SMEM((2, WG_ROWS), jnp.float32)] if cfg.prior else []),  # the prior rows' lse
            *([plgpu.SMEM((2, WG_ROWS), jnp.int32)] if cfg.row_mask else []),  # the rows' mask
        ),
        (  # a paired stage is ready once both its halves arrived
            plgpu.Barrier(num_arrivals=per, num_barriers=n_k),
            plgpu.Barrier(num_arrivals=per, num_barriers=n_v),
            plgpu.Barrier(num_barriers=4),  # q tiles, q positions
            plgpu.Barrier(num_arrivals=per, num_barriers=n_v) if cfg.has_pos else None,
            # a consumer's prior O and lse, its rows' mask
            plgpu.Barrier(num_arrivals=2 * int(cfg.prior) + int(cfg.row_mask), num_barriers=2)
            if cfg.prior or cfg.row_mask else None,
        ),
        # a slot is freed by the consumers that read it: both (one shared list) or its own (split)
        (plgpu.Barrier(num_arrivals=1 if split else 2, num_barriers=n_k),
         plgpu.Barrier(num_arrivals=1 if split else 2, num_barriers=n_v)),
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )



def _lead_flags(x: jax.Array) -> tuple[bool, bool, bool]:
    return (x.shape[0] > 1, x.shape[1] > 1, x.shape[2] > 1)


def launch(q_in, k_in, v_in, blocks, count, q_pos, k_pos, *, groups: int, num_kv_blocks: int,
           kv_len: int, q_offset: int, block_k: int, causal: bool, gap: int, window: int,
           sm_scale: float, stages: int, block_q: int = BLOCK_Q,
           persistent: bool = False, ranges: tuple[jax.Array, jax.Array] | None = None,
           pair: bool = False, profile: tuple[int, str] | None = None,
           overlap: bool = False, pingpong: bool = True,
           skip_visible_masks: bool = True, heads_first: bool = False,
           q_box: jax.Array | None = None, row_stride: int = 0,
           prior: tuple[jax.Array, jax.Array] | None = None,
           row_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The kernel on prepared operands (``persistent``: one CTA per multiprocessor, each running its share of the
    work items; else one CTA per item: see `block_sparse_attention_mosaic_gpu`; ``pair``: steps of two list
    entries, ``stages`` K stages and `pair_v_stages` V stages per ring).

    Args:
      q_in: ``[B, Tp, N, Dp]`` (Tp a multiple of 128, Dp of 64), rows in the layout's order.
      k_in, v_in: ``[B, Sp, H, Dp]`` with N == H * groups, Sp >= num_kv_blocks * block_k.
      blocks: int32 ``[B|1, N|1, nq|1, max_blocks]`` block ids (``windows``: key-window starts); count: int32
        ``[B|1, N|1, nq]`` in ``[0, max_blocks]``; ``nq`` query blocks of ``block_q`` rows.
      q_pos, k_pos: None, or int32 ``[B|1, N|1, Tp]`` / ``[B|1, N|1, Sp]`` original positions
        (keys at positions >= kv_len are never visible).
      ranges: None, or (lo, hi) int32 shaped like blocks: ``blocks`` then holds tile starts (multiples of 8 in
        ``[0, Sp - block_k]``) and entry j computes only the keys ``[lo_j, hi_j)`` of its tile (`window_tiles`).
      overlap, pingpong, heads_first: as in `MosaicConfig` (overlap is refused with original positions and one V stage
        per ring: the next step's key positions arrive with its V tile).
      skip_visible_masks: with original positions, skip the position mask of entries every row of their query
        block sees whole (`visible_entries`; where that table stays small).
      q_box, row_stride: with ``row_stride`` > 0, q_in is ``[B, Tp / row_stride, row_stride, N, Dp]`` (the original
        rows, viewed) and ``q_box`` int32 ``[B|1, N|1, nq]`` each query block's first original row; its rows are
        that row plus multiples of ``row_stride`` (`MosaicConfig.row_stride`); out comes back in that view.
      prior: None, or (out, lse) of attention over other keys: out shaped and viewed like q_in in its dtype, lse
        float32 ``[B, N, Tp]`` in q_in's row order; the kernel returns the merge of its result with it
        (`MosaicConfig.prior`).
      row_mask: None, or int32 ``[B, N, Tp]`` in q_in's row order, nonzero on the rows the layout is for; the others
        get the prior (or the empty result) whatever the layout lists there (`MosaicConfig.row_mask`).
      profile: None, or (ranges, directory): Mosaic GPU's profiler records the kernel's named regions (``plan``
        (the step's list entries and mask decision), ``qk``, ``softmax``, ``wait_v``, ``pv`` / ``next_k`` per
        consumer step; per item ``item`` (its order entry and list lengths), ``wait_q``, ``wait_first_k``,
        ``offset`` / ``resync`` (the second consumer's half-step lag, taken at its start and made up at its end),
        ``finish`` (row sums, prior and row mask) and ``write`` (O and lse out); ``k_free`` / ``v_free`` waits of
        the producer), at most ``ranges`` per warpgroup and CTA (in shared memory, next to the kernel's), into a
        Chrome trace ``<ns>-trace.json`` in the directory (timestamps in SM clock cycles / 1000;
        `tools/mosaic_profile.py`).

    Returns:
      out ``[B, Tp, N, Dp]`` in q's dtype and lse ``[B, N, Tp]`` float32, in row order of q_in (``row_stride``: out
      in q_in's view, the original order; lse in the layout's row order).
    """
    if row_stride:
        b, frames, _, n, dp = q_in.shape
        tp = frames * row_stride
    else:
        b, tp, n, dp = q_in.shape
    names = {"kv_blocks": blocks, "kv_block_count": count[..., None]}
    operands = [q_in, k_in, v_in, blocks, count]
    if persistent:
        operands.append(item_order(count, block_q=block_q, ctas=tp // BLOCK_Q, batch=b, heads=n, pair=pair,
                                   heads_first=heads_first))
    if ranges is not None:
        names["kv_lo"] = ranges[0]
        operands += list(ranges)
    has_pos = q_pos is not None
    vis = None
    if has_pos:
        names.update(q_pos=q_pos[..., None], k_pos=k_pos[..., None])
        operands += [q_pos, k_pos]
        if skip_visible_masks:
            vis = visible_entries(blocks, count.shape[2], q_pos, k_pos, ranges, block_q=block_q, block_k=block_k,
                                  kv_len=kv_len, causal=causal, gap=gap, window=window)
        if vis is not None:
            names["visible"] = vis
            operands.append(vis)
    if row_stride:
        if q_box is None or q_box.ndim != 3 or q_box.shape[2] != count.shape[2]:
            raise ValueError(f"q_box: expected int32 [B|1, N|1, {count.shape[2]}] (each query block's first row) "
                             f"with row_stride={row_stride}; received {getattr(q_box, 'shape', None)}")
        names["q_box"] = q_box[..., None]
        operands.append(q_box.astype(jnp.int32))
    if prior is not None:
        p_out, p_lse = prior
        if p_out.shape != q_in.shape or p_out.dtype != q_in.dtype or p_lse.shape != (b, n, tp) or (
                p_lse.dtype != jnp.float32):
            raise ValueError(f"prior: expected out {q_in.dtype}{list(q_in.shape)} (as q_in) and lse float32"
                             f"{[b, n, tp]}; received {p_out.dtype}{list(p_out.shape)} and "
                             f"{p_lse.dtype}{list(p_lse.shape)}")
        operands += [p_out, p_lse]
    if row_mask is not None:
        if row_mask.shape != (b, n, tp) or row_mask.dtype != jnp.int32:
            raise ValueError(f"row_mask: expected int32{[b, n, tp]}; received {row_mask.dtype}{list(row_mask.shape)}")
        operands.append(row_mask)
    cfg = MosaicConfig(
        block_k=block_k, head_dim=dp, stages=stages, groups=groups, num_kv_blocks=num_kv_blocks,
        kv_len=kv_len, q_offset=q_offset, causal=causal, gap=gap, window=window, sm_scale=sm_scale,
        leads=tuple((name, _lead_flags(x)) for name, x in names.items()), has_pos=has_pos,
        block_q=block_q, num_q_blocks=count.shape[2], windows=ranges is not None,
        pair=pair, v_stages=pair_v_stages(stages, block_q, block_k) if pair else stages, overlap=overlap,
        pingpong=pingpong, persistent=persistent, visible=vis is not None, heads_first=heads_first,
        row_stride=row_stride, prior=prior is not None, row_mask=row_mask is not None,
    )
    if overlap and has_pos and cfg.v_stages < 2:
        raise ValueError(f"overlap: needs two V stages per ring with original positions (the next step's key "
                         f"positions load with its V tile); received a layout with positions, block_q={block_q}, "
                         f"block_k={block_k}, key_pairs={pair} ({cfg.v_stages} V stage)")
    items = (tp // BLOCK_Q) * n * b
    cfg = dataclasses.replace(cfg, grid=min(items, num_cores()) if persistent else items)
    kernel = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg),
        out_type=(jax.ShapeDtypeStruct(q_in.shape, q_in.dtype),
                  jax.ShapeDtypeStruct((b, n, tp), jnp.float32)),
        grid=(cfg.grid,),
        grid_names=("items",),
        num_threads=3,
        thread_name="wg",
        # the row max / sum reduce inside each warp (no cross-warp scratch to reserve)
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                             **({} if profile is None else dict(
                                                 profile_space=profile[0], profile_dir=profile[1],
                                                 profile_bounds_check=True))),
    )
    return kernel(*operands)
