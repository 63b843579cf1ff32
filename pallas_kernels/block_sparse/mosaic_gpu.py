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

Causality is decided on original positions. Without permutations a row's position is
``row + q_offset`` and a key's its index, and the mask is only computed for blocks whose
last key can be past a row of the warpgroup (or that hold padding / an id out of range).
With permutations the wrapper gathers q (and k / v) into permuted order once, the kernel
reads the original positions from int32 vectors and masks every block (except the entries every
row of their query block sees whole, `visible_entries`). Single key columns run as a second pass
(the Triton kernel's, or this kernel's over key tiles gathered per query block) merged with
`merge_attention`; columns shared by every query block and head (SF-fixed's summary tokens) are
gathered once per key / value head and appended to the keys of the block pass's own launch
(`_fused_column_pass`).

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
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_fa3 as fa3
from pallas_kernels.block_sparse.layout import BlockLayout
from pallas_kernels.block_sparse.merge import merge_attention, merge_chunks, scatter_rows
from pallas_kernels.block_sparse.triton import block_sparse_attention_triton
from pallas_kernels.checks import check_int
from pallas_kernels.nonfinite import checked_if_nonfinite, poison_keys
from pallas_kernels.platform import num_cores
from pallas_kernels.tiling import LOG2E, inverse_permutation
from pallas_kernels.tiling import pad_to as _pad_to

BLOCK_Q = 128  # two consumer warpgroups of 64 rows
WG_ROWS = fa3.WG_ROWS
BLOCK_QS = (WG_ROWS, BLOCK_Q)
BLOCK_KS = (32, 64, 128)
# Shared memory per CTA on sm90 (the opt-in maximum); `smem_bytes` counts what the kernel asks for.
_SMEM_LIMIT = 227 * 1024
_SMEM_ALIGN = 1024  # Mosaic GPU pads every shared-memory buffer to this
_BARRIER_BYTES = 8
_MAX_STAGES = 4
COLUMN_PASSES = ("fused", "mosaic", "triton")
TMA_ROWS = 8  # TMA copies a key tile from a row that is a multiple of this
# Each consumer keeps its rows' sums as [64, SUM_COLUMNS] column partials (`mosaic_fa3.init_rows`), reduced once at
# the end: 2-7% faster than a shuffle reduction every step (one H100, 2026-11-27, commit 2850066; README).
SUM_COLUMNS = 8
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
# sort (`auto_persistent` allows 7,168).
RANK_ORDER_ITEMS = 8192


def one_tile_windows(layout: BlockLayout) -> bool:
    """The layout's key windows all start on multiples of `TMA_ROWS` (``window_align``), so `window_tiles` loads
    each as one tile."""
    return layout.window_align % TMA_ROWS == 0


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


def _rings(block_q: int) -> int:
    """K/V rings of stages: one shared by both consumers (``block_q`` 128), one per consumer (64)."""
    return 2 if block_q == WG_ROWS else 1


def _align(x: int) -> int:
    return -(-x // _SMEM_ALIGN) * _SMEM_ALIGN


def _pair_v_stages(stages: int, block_q: int, block_k: int) -> int:
    """V stages per ring with `key_pairs` steps of ``2 * block_k`` keys: one per consumer with 64-row query blocks
    and 128-key steps (K keeps ``stages``, so the next K pair loads during a step while V, needed only after the
    softmax, is refilled behind ``P V``; two rings of two K and two V stages of 128 keys do not fit), else
    ``stages``."""
    return 1 if block_q == WG_ROWS and 2 * block_k > 64 else stages


def smem_bytes(block_k: int, head_dim: int, stages: int, block_q: int = BLOCK_Q, *, pair: bool = False,
               persistent: bool = False) -> int:
    """Shared memory the kernel requests with ``stages`` K/V stages per ring and original positions (the larger
    case): the two Q/O tiles, the K and V rings, the lse / positions buffer, and the barriers, counted as Mosaic
    GPU does (matches its byte count on every configuration we compiled, e.g. 298,344 for 64-row query blocks,
    64-key tiles, D 128, 4 stages). ``pair``: steps of two list entries (``2 * block_k`` keys per stage, V
    stages `_pair_v_stages`); ``persistent``: the persistent grid's two O tiles of their own (the next item's Q
    loads while O is stored). block_k in `BLOCK_KS`, head_dim a multiple of 64, stages >= 1, block_q in
    `BLOCK_QS`."""
    for name, value, ok, want in (("block_k", block_k, block_k in BLOCK_KS, f"one of {BLOCK_KS}"),
                                  ("head_dim", head_dim, head_dim > 0 and head_dim % 64 == 0, "a multiple of 64"),
                                  ("stages", stages, stages >= 1, "an int >= 1"),
                                  ("block_q", block_q, block_q in BLOCK_QS, f"one of {BLOCK_QS}")):
        if not ok:
            raise ValueError(f"{name}: expected {want}; received {value!r}")
    kt = block_k * (2 if pair else 1)
    k_slots = _rings(block_q) * stages
    v_slots = _rings(block_q) * (_pair_v_stages(stages, block_q, block_k) if pair else stages)
    tiles = ((2 if persistent else 1) * _align(2 * WG_ROWS * head_dim * 2) + _align(k_slots * kt * head_dim * 2)
             + _align(v_slots * kt * head_dim * 2))
    positions = _align(max(2 * WG_ROWS * 4, (2 * WG_ROWS + v_slots * kt) * 4))
    # K ready / K free per K slot; V ready / key positions / V free per V slot; Q tiles and positions; schedule
    barriers = 2 * k_slots + 3 * v_slots + 5
    return tiles + positions + barriers * _BARRIER_BYTES


def max_stages(block_k: int, head_dim: int, block_q: int = BLOCK_Q, *, pair: bool = False,
               persistent: bool = False) -> int:
    """Most K/V stages per ring (at most 4) that fit in shared memory; 0 when two do not fit."""
    fit = [st for st in range(2, _MAX_STAGES + 1)
           if smem_bytes(block_k, head_dim, st, block_q, pair=pair, persistent=persistent) <= _SMEM_LIMIT]
    return max(fit, default=0)


def default_stages(block_k: int, head_dim: int, block_q: int = BLOCK_Q) -> int:
    """K/V stages per ring (per consumer with ``block_q`` 64): as many as fit 220 KiB next to the two Q/O tiles,
    in [2, 4] (4 for 64-key tiles, 2 for 128-key tiles and for 64-row query blocks at D 128). One H100,
    2026-11-27 (``tools/mosaic_stages_bench.py``, ``bench/results/mosaic-stages-fit_*``): the third stage that
    `max_stages` allows there runs slower, 1.72 -> 1.79 / 7.31 -> 7.62 / 32.1 -> 32.8 ms on MInference's top-100
    mask (64x64) at 32k / 128k / 512k and 13.2 -> 13.3 / 209 -> 213 ms dense (128x128) at 32k / 128k."""
    tiles = 2 * WG_ROWS * head_dim * 2
    stage_bytes = _rings(block_q) * 2 * block_k * head_dim * 2
    return max(2, min(_MAX_STAGES, (220 * 1024 - tiles) // stage_bytes))


def auto_key_pairs(layout: BlockLayout, num_stages: int | None) -> bool:
    """`block_sparse_attention_mosaic_gpu`'s default for ``key_pairs``: on for 128-row query blocks over 64-key
    lists when no stage count is given (a given ``num_stages`` counts 64-key stages). One H100, 2026-11-27
    (``tools/minference_side_by_side.py``, ``bench/results/minference-side-by-side-pairs-{block,vs128k,bq64}_*``;
    ``tools/bench_mosaic_gpu.py --pairs``, ``mosaic-gpu-key-pairs_*``): 128-key steps there ran 501 -> 570 /
    471 -> 525 TFLOP/s on the 128-row union of MInference's top-100 lists at 128k / 512k
    and 50.5 -> 46.2 ms on its Vertical-Slash index at 128k (aligned blocks); with 64-row query blocks (one V
    stage per consumer) they gained nothing (1.76 / 7.33 / 31.77 -> 1.79 / 7.47 / 31.84 ms on the top-100 mask
    at 32k / 128k / 512k), so those stay on one entry per step. Dense 64-key layouts at 32k / 128k / 512k: 14.54 /
    235.6 / 3915 ms -> 12.70 / 208.8 / 3434 ms (cuDNN 12.31 / 217.5 / 3914). Always on for 32-key lists (a step of
    one 32-key entry does not lower)."""
    return layout.block_k == 32 or (layout.block_q == BLOCK_Q and layout.block_k == 64 and num_stages is None)


PERSISTENT_ITEMS = 7168  # `auto_persistent`: at most this many work items (28 heads x 32k rows, the size measured)
PERSISTENT_STEPS = 128  # and lists of at most this many steps


def auto_persistent(q: jax.Array, layout: BlockLayout, pair: bool, stages: int | None = None, *,
                    max_entries: int | None = None) -> bool:
    """`block_sparse_attention_mosaic_gpu`'s default for ``persistent`` (q ``[B, T, N, D]``, its layout): the
    persistent grid for short work, at most `PERSISTENT_ITEMS` work items (batch x heads x 128-row blocks) with lists
    of at most `PERSISTENT_STEPS` steps (``max_entries`` entries, default ``layout.max_blocks``, two per step with
    ``pair``), where its O tiles fit next to two stages (or the ``stages`` asked for).

    One H100, 2026-11-27, same calls (``tools/bench_mosaic_gpu.py --grids --fixed-lists``, `mosaic-gpu-grids-queued-*`,
    `mosaic-gpu-fixed-lists_*`; ``tools/minference_side_by_side.py``, `minference-side-by-side-persistent_*`), TFLOP/s
    on computed tiles over cuDNN's dense at 32k tokens, 28 / 4 heads, persistent against one CTA per item: random 3%
    0.60-0.61 / 0.54 (64-key) and 0.63-0.64 / 0.58 (128-key), random 10% 0.84-0.85 / 0.82-0.85 and 0.89-0.90 /
    0.89-0.90, lists of 4 / 8 / 16 / 32 / 64 random blocks 1-12% faster (but 64 128-key blocks: 1% slower),
    MInference's top-100 mask (8 heads, 2,048 items) 1.65 / 1.71 against 1.73 / 1.70 ms in two calls; dense (256
    steps) 0.95-0.99x cuDNN against 0.98-1.02x. At 128k / 512k (28,672 / 114,688 items) neither grid wins
    throughout: on the fixed lists at 128k the persistent grid ran up to 27% faster (16 64-key blocks) and 33%
    slower (16 128-key blocks), at 512k within -4% / +7%; dense 128-key blocks at 128k 0.99x cuDNN against 1.10x;
    the top-100 mask at 128k (8,192 items) 7.19 against 7.12 ms."""
    entries = layout.max_blocks if max_entries is None else max_entries
    steps = -(-entries // 2) if pair else entries
    items = q.shape[0] * q.shape[2] * -(-layout.num_q_blocks * layout.block_q // BLOCK_Q)
    fits = max_stages(layout.block_k, fa3.padded_head_dim(q.shape[-1]), layout.block_q, pair=pair, persistent=True)
    return items <= PERSISTENT_ITEMS and steps <= PERSISTENT_STEPS and fits >= max(2, stages or 0)


def check_supported(q: jax.Array, layout: BlockLayout, stages: int | None, pair: bool | None = None, *,
                    persistent: bool = False) -> None:
    """The Mosaic GPU kernel's own limits (raised before anything is traced); ``pair``: `key_pairs` steps (None: as
    the kernel runs by default, `auto_key_pairs`); ``persistent``: the persistent grid (two more O tiles in shared
    memory)."""
    if pair is None:
        pair = auto_key_pairs(layout, stages)
    fa3.check_q(q)
    if layout.block_q not in BLOCK_QS:
        raise ValueError(f"layout.block_q: expected one of {BLOCK_QS} for implementation='mosaic_gpu' "
                         f"(two warpgroups of {WG_ROWS} rows on one query block or on one each); "
                         f"received {layout.block_q}")
    if layout.block_k not in BLOCK_KS:
        raise ValueError(f"layout.block_k: expected one of {BLOCK_KS} for implementation='mosaic_gpu'; "
                         f"received {layout.block_k}")
    if pair and layout.block_k > 64:
        raise ValueError(f"layout.block_k: expected 32 or 64 with key_pairs=True (steps of two list entries, at "
                         f"most 128 keys); received {layout.block_k}")
    d = q.shape[-1]
    d_pad = fa3.padded_head_dim(d)
    fit = max_stages(layout.block_k, d_pad, layout.block_q, pair=pair, persistent=persistent)
    if not fit:
        what = ", key_pairs" if pair else ""
        raise ValueError(f"layout.block_k: block_q={layout.block_q} with block_k={layout.block_k}{what} and "
                         f"D={d_pad} needs "
                         f"{smem_bytes(layout.block_k, d_pad, 2, layout.block_q, pair=pair, persistent=persistent)} "
                         f"bytes of shared memory for two K/V stages per consumer"
                         f"{' on the persistent grid' if persistent else ''} (at most {_SMEM_LIMIT}); use "
                         f"block_k=64 or block_q=128{', or key_pairs=False' if pair else ''}")
    if stages is not None:
        if not isinstance(stages, int) or isinstance(stages, bool) or not 2 <= stages <= fit:
            raise ValueError(f"num_stages: expected an int in [2, {fit}] (K/V stages in shared "
                             f"memory for block_q={layout.block_q}, block_k={layout.block_k}, D={d_pad}"
                             f"{', key_pairs' if pair else ''}{', persistent' if persistent else ''}); "
                             f"received {stages!r}")


def preferred(q: jax.Array, layout: BlockLayout, kv_heads: int) -> bool:
    """The kernel supports these inputs and is the faster choice on an sm90 GPU.

    Block lists: measured on an H200 (2026-11-23, tools/bench_mosaic_gpu.py) at 1.0-1.1x cuDNN on dense causal
    layouts and about 2x Triton on random 10% layouts; with 64-row query blocks on MInference's pooled top-100
    block mask 0.99-1.23x Triton's speed at 32k-512k (H200 and H100, 2026-11-26, tools/minference_side_by_side.py).

    Single key columns (the columns in a Triton pass, the kernel's default ``column_pass``): on MInference's
    Vertical-Slash index (1000 / 6096, one H100, 2026-11-27, `minference-side-by-side-vs-aligned_*`) the
    pattern's default form, 128-row aligned 64-key blocks plus columns, took 3.43 / 42.2 / 322.9 ms against
    Triton's 4.45 / 54.7 / 425.6 at 32k / 128k / 512k (1.30-1.32x), and 64-row aligned blocks 3.28 / 40.7 / 290.4
    against 4.03 / 51.4 / 357.9; with 32-key entries (`minference-side-by-side-vs-32key-*`) 64-row aligned blocks
    3.29 / 35.6 / 248.4 ms against Triton's 4.21 / 49.4 / 328.1. Not when the layout permutes keys per query head
    over grouped heads (``kv_heads``, k's heads, fewer than q's): this kernel would copy k / v once per query head
    (2 x 14.7 GB at 1M tokens, 28 / 4 heads), Triton gathers the permuted rows in the kernel.

    Key windows only with ``layout.window_align`` a multiple of 8 (`window_tiles` loads a window that does not
    start on a multiple of 8 as two tiles; unaligned windows stay on Triton). Aligned windows ran faster on every
    layout timed: 64-row 64-key windows from multiples of 8, 3.50 / 38.8 / 256 ms against Triton's unaligned
    3.78 / 46.1 / 304.5, and 64-row 32-key windows 3.21 / 34.8 / 228.4 ms (tails <= 12 as columns), 1.28 / 1.31 /
    1.40x MInference's kernel, where Triton's unaligned 32-key windows ran 1.09 / 1.10 / 1.12x; on one layout, 128-row
    32-key windows from multiples of 8 (tails <= 4 as columns), 3.96 / 48.3 ms against Triton's 4.98 / 58.0 at 32k /
    128k (`minference-side-by-side-vs128-32key-aligned_*`)."""
    try:
        check_supported(q, layout, None)
    except ValueError:
        return False
    if layout.kv_windows and not one_tile_windows(layout):
        return False
    if layout.kv_columns is None:
        return True
    per_head_perm = layout.kv_perm is not None and layout.kv_perm.shape[1] > 1
    return not (per_head_perm and kv_heads < q.shape[2])


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _kernel(q_ref, k_ref, v_ref, blocks_ref, count_ref, *refs, cfg: MosaicConfig):
    refs = list(refs)
    order_ref = refs.pop(0) if cfg.persistent else None
    lo_ref, hi_ref = (refs.pop(0), refs.pop(0)) if cfg.windows else (None, None)
    qpos_ref, kpos_ref = (refs.pop(0), refs.pop(0)) if cfg.has_pos else (None, None)
    vis_ref = refs.pop(0) if cfg.visible else None
    out_ref, lse_ref = refs
    leads = dict(cfg.leads)
    bk, dp, stages = cfg.block_k, cfg.head_dim, cfg.stages
    v_stages = cfg.v_stages or stages
    per = 2 if cfg.pair else 1  # list entries per step
    kt = per * bk  # keys per step (one K / V stage)
    split = cfg.block_q == WG_ROWS  # one query block (and key list) per consumer warpgroup
    rings = _rings(cfg.block_q)
    dtype = q_ref.dtype
    ctas = q_ref.shape[1] // BLOCK_Q
    heads = q_ref.shape[2]
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

    def body(scoped):
        (qo_smem, k_smem, v_smem, lse_pos, *o_tiles), (k_bar, v_bar, q_bar, p_bar), (k_free, v_free), sched = scoped
        o_smem = o_tiles[0] if cfg.persistent else qo_smem  # the consumers' O tiles (the Q tiles on one item)
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
                row0 = it.cta * BLOCK_Q + wg * WG_ROWS
                plgpu.copy_gmem_to_smem(q_ref.at[it.batch, pl.ds(row0, WG_ROWS), it.head], q_smem, q_bar.at[wg])

            def run_item(t, done):
                """Item t of this CTA; ``done``: K/V stages of this consumer's ring used by earlier items."""
                it = Item.of(t)
                row0 = it.cta * BLOCK_Q + wg * WG_ROWS
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

                def masked(j, s):
                    """S of step j with its masked pairs -inf; by index, only for a tile that can hold a masked pair
                    (a ``lax.cond``)."""
                    halves = [half_params(e, ok) for e, ok in it.entries(j, wg)]
                    if cfg.has_pos:
                        plgpu.barrier_wait(p_bar.at[v_stage(j)])  # the keys' positions (waited for in any case)
                        if not cfg.visible:
                            return mask_by_position(s, v_stage(j), *per_column(s, halves))
                        need = functools.reduce(jnp.logical_or,
                                                [~(it.whole(e, wg) & ok) for e, ok in it.entries(j, wg)])
                        return lax.cond(need, lambda x: mask_by_position(x, v_stage(j), *per_column(x, halves)),
                                        lambda x: x, s)
                    need = functools.reduce(jnp.logical_or, [needs_mask(*h) for h in halves])
                    return lax.cond(need, lambda x: mask_by_index(x, *per_column(x, halves)), lambda x: x, s)

                def step(j, carry):
                    acc, m, l = carry
                    ks, vs = k_stage(j), v_stage(j)

                    with jax.named_scope("qk"):  # (named regions: the profiler's ranges, see `launch`)
                        s = fa3.qk(q_smem, k_smem.at[ks], pp, kt)
                    plgpu.barrier_arrive(k_free.at[ks])
                    if cfg.persistent:
                        pl.when(j == count - 1)(prefetch_q)
                    with jax.named_scope("softmax"):
                        sm = fa3.softmax_step(masked(j, s), m, l, acc, scale=scale, dtype=dtype)
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

                    def soft(j, s, m, l):
                        sm = fa3.softmax_step(masked(j, s), m, l, None, scale=scale, dtype=dtype)
                        handshake()
                        return sm

                    def first(_):
                        """Step 0's S and softmax (count > 0); O is still 0: nothing to rescale."""
                        ks = k_stage(0)
                        plgpu.barrier_wait(k_bar.at[ks])
                        s = fa3.qk(q_smem, k_smem.at[ks], pp, kt)
                        plgpu.barrier_arrive(k_free.at[ks])
                        sm = soft(0, s, m, l)
                        return sm.m, sm.l, sm.p

                    def ostep(j, carry):
                        """Step j + 1's S, then step j's P V; step j + 1's softmax while P V runs."""
                        acc, m, l, p = carry
                        vs, ks = v_stage(j), k_stage(j + 1)
                        plgpu.barrier_wait(k_bar.at[ks])
                        plgpu.barrier_wait(v_bar.at[vs])
                        acc, sm = fa3.qk_then_pv(acc, p, v_smem.at[vs], q_smem, k_smem.at[ks], kt,
                                                 lambda s: soft(j + 1, s, m, l), pp,
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

                with jax.named_scope("write"):
                    if cfg.persistent:  # the last item's stores have read o_smem / l_smem
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    fa3.write_rows(acc, m, fa3.row_sums(l), o_smem.at[wg], l_smem,
                                   out_ref.at[it.batch, pl.ds(row0, WG_ROWS), it.head],
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
            *([plgpu.SMEM((2, WG_ROWS, dp), dtype, transforms=transforms)] if cfg.persistent else []),
        ),
        (  # a paired stage is ready once both its halves arrived
            plgpu.Barrier(num_arrivals=per, num_barriers=n_k),
            plgpu.Barrier(num_arrivals=per, num_barriers=n_v),
            plgpu.Barrier(num_barriers=4),  # q tiles, q positions
            plgpu.Barrier(num_arrivals=per, num_barriers=n_v) if cfg.has_pos else None,
        ),
        # a slot is freed by the consumers that read it: both (one shared list) or its own (split)
        (plgpu.Barrier(num_arrivals=1 if split else 2, num_barriers=n_k),
         plgpu.Barrier(num_arrivals=1 if split else 2, num_barriers=n_v)),
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )


def item_order(count: jax.Array, *, block_q: int, ctas: int, batch: int, heads: int, pair: bool,
               heads_first: bool = False, method: str = "auto") -> jax.Array:
    """The persistent grid's item order: int32 ``[batch * heads * ctas]`` item indices (item w is batch ``w // (heads
    * ctas)``, head ``w // ctas % heads``, 128-row block ``ctas - 1 - w % ctas``; ``heads_first``: head ``w %
    heads``, block ``ctas - 1 - w // heads % ctas``), most steps first (stably: equal items keep that
    order: query blocks (or heads) fastest, the last rows first). count int32 ``[B|1, N|1, nq]``;
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


def _lead_flags(x: jax.Array) -> tuple[bool, bool, bool]:
    return (x.shape[0] > 1, x.shape[1] > 1, x.shape[2] > 1)


def launch(q_in, k_in, v_in, blocks, count, q_pos, k_pos, *, groups: int, num_kv_blocks: int,
           kv_len: int, q_offset: int, block_k: int, causal: bool, gap: int, window: int,
           sm_scale: float, stages: int, block_q: int = BLOCK_Q,
           persistent: bool = False, ranges: tuple[jax.Array, jax.Array] | None = None,
           pair: bool = False, profile: tuple[int, str] | None = None,
           overlap: bool = False, pingpong: bool = True,
           skip_visible_masks: bool = True, heads_first: bool = False) -> tuple[jax.Array, jax.Array]:
    """The kernel on prepared operands (``persistent``: one CTA per multiprocessor, each running its share of the
    work items; else one CTA per item: see `block_sparse_attention_mosaic_gpu`; ``pair``: steps of two list
    entries, ``stages`` K stages and `_pair_v_stages` V stages per ring).

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
      profile: None, or (ranges, directory): Mosaic GPU's profiler records the kernel's named regions (``qk``,
        ``softmax``, ``wait_v``, ``pv`` / ``next_k`` per consumer step; per item ``wait_q``, ``wait_first_k``,
        ``offset`` / ``resync`` (the second consumer's half-step lag, taken at its start and made up at its end)
        and ``write`` (O and lse out); ``k_free`` / ``v_free`` waits of the producer), at most ``ranges`` per
        warpgroup and CTA (in shared memory, next to the kernel's), into a Chrome trace ``<ns>-trace.json`` in the
        directory (timestamps in SM clock cycles / 1000; `tools/mosaic_profile.py`).

    Returns:
      out ``[B, Tp, N, Dp]`` in q's dtype and lse ``[B, N, Tp]`` float32, in row order of q_in.
    """
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
    cfg = MosaicConfig(
        block_k=block_k, head_dim=dp, stages=stages, groups=groups, num_kv_blocks=num_kv_blocks,
        kv_len=kv_len, q_offset=q_offset, causal=causal, gap=gap, window=window, sm_scale=sm_scale,
        leads=tuple((name, _lead_flags(x)) for name, x in names.items()), has_pos=has_pos,
        block_q=block_q, num_q_blocks=count.shape[2], windows=ranges is not None,
        pair=pair, v_stages=_pair_v_stages(stages, block_q, block_k) if pair else stages, overlap=overlap,
        pingpong=pingpong, persistent=persistent, visible=vis is not None, heads_first=heads_first,
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


def _prepared_kv(k, v, layout: BlockLayout, groups: int, d_pad: int) -> tuple[jax.Array, jax.Array, int]:
    """(k, v, groups) as the kernel reads them: in the layout's key order (a permutation per query head over grouped
    heads copies k / v once per query head, groups 1), head dim padded to ``d_pad``, keys to whole blocks."""
    s = k.shape[1]
    s_pad = layout.num_kv_blocks * layout.block_k
    if layout.kv_perm is not None:
        kv_perm = jnp.clip(layout.kv_perm, 0, s - 1)
        if kv_perm.shape[1] > 1 and groups > 1:  # a permutation per query head: one copy per head
            k, v, groups = _expand_heads(k, groups), _expand_heads(v, groups), 1
        k, v = _gather_rows(k, kv_perm), _gather_rows(v, kv_perm)
    return _pad_to(_pad_to(k, 3, d_pad), 1, s_pad), _pad_to(_pad_to(v, 3, d_pad), 1, s_pad), groups


def _block_pass(q_in, k, v, layout: BlockLayout, *, sm_scale, causal, stages, t_pad, d_pad, persistent, pair,
                overlap, pingpong, heads_first=False, profile=None):
    """The layout's key blocks; q_in is padded and in the layout's row order."""
    s = k.shape[1]
    bk, nk = layout.block_k, layout.num_kv_blocks
    s_pad = nk * bk
    has_pos = layout.q_perm is not None or layout.kv_perm is not None
    k_in, v_in, groups = _prepared_kv(k, v, layout, q_in.shape[2] // k.shape[2], d_pad)
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
                  overlap=overlap, pingpong=pingpong, heads_first=heads_first)


def row_range_pass(layout: BlockLayout) -> bool:
    """`block_sparse_attention_mosaic_gpu` runs the layout as `_rows_pass` (one CTA per work item; unless
    ``persistent=True`` or ``profile`` is asked for): it names a ``q_block_range`` and lists key blocks only (no
    single columns, no key windows)."""
    return layout.q_block_range is not None and layout.kv_columns is None and not layout.kv_windows


def chunk_lists(layout: BlockLayout, chunk: int) -> tuple[jax.Array, jax.Array]:
    """The lists of the query blocks in ``q_block_range`` cut into ``C = ceil(max_blocks / e)`` chunks of ``e <=
    chunk`` entries (``e`` even): (blocks int32 ``[B|1, N|1, C * nb, e]``, counts ``[B|1, N|1, C * nb]``), chunk
    c of query block i at ``c * nb + i``."""
    lo, hi = layout.q_block_range
    nb, m = hi - lo, layout.max_blocks
    c = -(-m // chunk)
    e = _round_up(-(-m // c), 2)
    count = jnp.clip(jnp.broadcast_to(layout.kv_block_count, layout.kv_block_count.shape[:2] + (layout.num_q_blocks,)),
                     0, m)[..., lo:hi]
    blocks = layout.kv_blocks if layout.kv_blocks.shape[2] == 1 else layout.kv_blocks[:, :, lo:hi]
    lead = blocks.shape[:2]
    blocks = jnp.pad(jnp.broadcast_to(blocks, lead + (nb, m)), ((0, 0), (0, 0), (0, 0), (0, c * e - m)))
    blocks = jnp.moveaxis(blocks.reshape(lead + (nb, c, e)), 3, 2).reshape(lead + (c * nb, e))
    counts = jnp.stack([jnp.clip(count - j * e, 0, e) for j in range(c)], axis=2)
    return blocks, counts.reshape(count.shape[:2] + (c * nb,)).astype(jnp.int32)


def row_chunk_entries(max_blocks: int, copy_bytes: int, chunk: int = ROW_CHUNK) -> int:
    """List entries per chunk of `_rows_pass`: ``chunk``, or more where ``ceil(max_blocks / chunk)`` copies of the
    rows (``copy_bytes`` each) would pass `ROW_COPY_BYTES`."""
    most = max(1, ROW_COPY_BYTES // max(copy_bytes, 1))
    return max(chunk, -(-max_blocks // most))


def _rows_pass(q, k, v, layout: BlockLayout, *, sm_scale, causal, stages, d_pad, pair, overlap, pingpong):
    """The layout over the rows of its ``q_block_range`` alone: (rows int32 ``[B|1, N|1, R]`` as `range_rows`,
    out ``[B, R, N, D]`` in q's dtype, lse ``[B, N, R]``). The rows are gathered once (through ``q_perm``) and
    repeated once per chunk of their lists (`chunk_lists`, `row_chunk_entries`: `ROW_CHUNK` entries, longer where
    the copies would pass `ROW_COPY_BYTES`): each (query block, chunk) is one work item,
    with the rows' original positions; the chunks are merged by lse."""
    b, t, n, d = q.shape
    s = k.shape[1]
    bk, nk = layout.block_k, layout.num_kv_blocks
    rows = layout.range_rows()
    r = rows.shape[-1]
    blocks, count = chunk_lists(layout, row_chunk_entries(layout.max_blocks, b * r * n * d_pad * q.dtype.itemsize,
                                                          ROW_CHUNK))
    c = count.shape[2] // (r // layout.block_q)
    t_pad = _round_up(c * r, BLOCK_Q)
    q_in = _pad_to(_pad_to(jnp.tile(_gather_rows(q, jnp.minimum(rows, t - 1)), (1, c, 1, 1)), 3, d_pad), 1, t_pad)
    q_pos = _pad_to(jnp.tile(rows + layout.q_offset, (1, 1, c)), 2, t_pad)
    k_in, v_in, groups = _prepared_kv(k, v, layout, n // k.shape[2], d_pad)
    k_pos = _positions_or_iota(layout.kv_perm, s, nk * bk, 0)
    out, lse = launch(q_in, k_in, v_in, blocks, count, q_pos, k_pos, groups=groups, num_kv_blocks=nk,
                      kv_len=layout.kv_len, q_offset=layout.q_offset, block_k=bk, causal=causal, gap=layout.gap,
                      window=layout.window, sm_scale=sm_scale, stages=stages, block_q=layout.block_q, pair=pair,
                      overlap=overlap, pingpong=pingpong)
    out = out[:, :c * r, :, :d].reshape(b, c, r, n, d)
    lse = lse[:, :, :c * r].reshape(b, n, c, r)
    return (rows, *merge_chunks(out, lse))


def shared_columns(layout: BlockLayout) -> bool:
    """The layout's single columns are one list for every query block and head (each block reads a prefix of it,
    its count), in a key order shared by the heads: `_column_pass` gathers them once per key / value head."""
    return (layout.kv_columns is not None and layout.kv_columns.shape[1:3] == (1, 1)
            and (layout.kv_perm is None or layout.kv_perm.shape[1] == 1))


def _shared_column_keys(k, v, layout: BlockLayout, d_pad: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The `shared_columns` list's keys gathered once per key / value head: (k_c, v_c ``[B, tiles * block_k, K,
    Dp]``, their original positions int32 ``[B|1, 1, tiles * block_k]`` (``kv_len`` for unused slots), the count
    of columns each query block reads int32 ``[B|1, N|1, nq|1]``)."""
    s = k.shape[1]
    bk, mc = layout.block_k, layout.max_columns
    tiles = -(-mc // bk)
    cols = _pad_to(layout.kv_columns, 3, tiles * bk)[:, :, 0]  # [B|1, 1, mcp]
    ok = (cols >= 0) & (cols < s)
    orig = jnp.where(ok, cols, 0)
    if layout.kv_perm is not None:
        orig = jnp.take_along_axis(jnp.clip(layout.kv_perm, 0, s - 1), orig, axis=-1)
    k_c = _pad_to(_gather_rows(k, orig), 3, d_pad)  # [B, mcp, K, Dp]
    v_c = _pad_to(_gather_rows(v, orig), 3, d_pad)
    k_pos = jnp.where(ok, orig, layout.kv_len).astype(jnp.int32)
    return k_c, v_c, k_pos, jnp.clip(layout.kv_column_count, 0, mc)


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


def _fused_column_pass(q_in, k, v, layout: BlockLayout, *, sm_scale, causal, stages, t_pad, d_pad, persistent,
                       pair, overlap, pingpong, heads_first=False, profile=None):
    """The block pass and the `shared_columns` in one launch (``column_pass="fused"``): the columns' keys gathered
    once per key / value head (`_shared_column_keys`) are appended to the prepared k / v, each query block's list
    goes on with its column tiles (`fused_lists`), and every key carries its original position; no second output
    and no merge."""
    s = k.shape[1]
    bk, nk = layout.block_k, layout.num_kv_blocks
    k_in, v_in, groups = _prepared_kv(k, v, layout, q_in.shape[2] // k.shape[2], d_pad)
    k_c, v_c, pos_c, ccount = _shared_column_keys(k, v, layout, d_pad)
    tiles = k_c.shape[1] // bk
    k_in, v_in = jnp.concatenate([k_in, k_c], axis=1), jnp.concatenate([v_in, v_c], axis=1)
    pos_b = _positions_or_iota(layout.kv_perm, s, nk * bk, 0)
    lead = jnp.broadcast_shapes(pos_b.shape[:2], pos_c.shape[:2])
    k_pos = jnp.concatenate([jnp.broadcast_to(pos_b, lead + pos_b.shape[2:]),
                             jnp.broadcast_to(pos_c, lead + pos_c.shape[2:])], axis=-1)
    q_pos = _positions_or_iota(layout.q_perm, layout.q_len, t_pad, layout.q_offset)
    starts, lo, hi, count = fused_lists(layout.kv_blocks, jnp.clip(layout.kv_block_count, 0, layout.max_blocks),
                                        ccount, block_k=bk, num_kv_blocks=nk, tiles=tiles)
    return launch(q_in, k_in, v_in, starts, count, q_pos, k_pos, groups=groups, num_kv_blocks=nk + tiles,
                  kv_len=layout.kv_len, q_offset=layout.q_offset, block_k=bk, causal=causal, gap=layout.gap,
                  window=layout.window, sm_scale=sm_scale, stages=stages, block_q=layout.block_q,
                  persistent=persistent, ranges=(lo, hi), pair=pair, profile=profile, overlap=overlap,
                  pingpong=pingpong, heads_first=heads_first)


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
                                             "pingpong", "poison", "heads_first"))
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
) -> tuple[jax.Array, jax.Array]:
    """q ``[B,T,N,D]``, k/v ``[B,S,K,D]`` (bf16 / fp16) -> out ``[B,T,N,D]``, lse ``[B,N,T]`` f32.

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
    `auto_persistent` (short work: at most 7,168 items with lists of at most 128 steps). Its first form (items
    ``pid, pid + grid, ...``, Q loaded at each item's start) lost everywhere but on short lists (one H200, 2026-11-26,
    ``tools/bench_mosaic_gpu.py --grids``: dense 0.89 / 0.92 / 0.95x cuDNN at 32k / 128k / 512k against 0.97 /
    1.04 / 1.15x); the numbers of this form are in `auto_persistent`.

    ``key_pairs``: each step computes two consecutive entries of a 32- or 64-key list as one tile of 64 / 128 keys
    (one online softmax update and one schedule hand-over per step), with ``num_stages`` stages of that many keys.
    With 64-row query blocks and 128-key steps V has one stage per consumer (`_pair_v_stages`). None (default):
    `auto_key_pairs`; 32-key lists always run in pairs (False is refused).

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
        column_pass = ("fused" if fused_columns(layout) else "mosaic") if shared_columns(layout) else "triton"
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
    if row_range_pass(layout) and not persistent and profile is None:  # its rows alone, lists in chunks
        rows, out, lse = _rows_result(q, k, v, layout, sm_scale=sm_scale, causal=causal, num_stages=num_stages,
                                      key_pairs=key_pairs, overlap=overlap, pingpong=pingpong, poison=poison)
        return scatter_rows(rows, out, lse, t)
    fused = layout.kv_columns is not None and column_pass == "fused"
    if persistent is None:  # (fused: the lists go on with the column tiles)
        entries = layout.max_blocks + (-(-layout.max_columns // layout.block_k) if fused else 0)
        persistent = auto_persistent(q, layout, key_pairs, num_stages, max_entries=entries)
    elif persistent:  # its own O tiles take shared memory
        check_supported(q, layout, num_stages, pair=key_pairs, persistent=True)
    stages = num_stages or default_stages(layout.block_k * (2 if key_pairs else 1), d_pad, layout.block_q)
    if persistent:
        stages = min(stages, max_stages(layout.block_k, d_pad, layout.block_q, pair=key_pairs, persistent=True))
    t_pad = _round_up(layout.num_q_blocks * layout.block_q, BLOCK_Q)
    q_orig, k_orig, v_orig = q, k, v
    if layout.q_perm is not None:
        q_perm = jnp.clip(layout.q_perm, 0, t - 1)
        q = _gather_rows(q, q_perm)  # [B, T, N, D] in permuted row order per head
    q_in = _pad_to(_pad_to(q, 3, d_pad), 1, t_pad)
    kw = {"sm_scale": sm_scale, "causal": causal, "stages": stages, "t_pad": t_pad, "d_pad": d_pad,
          "persistent": persistent, "pair": key_pairs, "overlap": overlap,
          "pingpong": pingpong, "heads_first": heads_first}

    def passes(kp, vp):
        """The Mosaic passes on k / v as `_on_keys` gives them."""
        out, lse = (_fused_column_pass if fused else _block_pass)(q_in, kp, vp, layout, profile=profile, **kw)
        out, lse = out[:, :t, :, :d], lse[:, :, :t]
        if layout.kv_columns is not None and column_pass == "mosaic":
            out_c, lse_c = _column_pass(q_in, kp, vp, layout, **kw)
            out, lse = merge_attention(out, lse, out_c[:, :t, :, :d], lse_c[:, :, :t])
        return out, lse

    out, lse = _on_keys(passes, k, v, poison)
    if layout.q_perm is not None:
        inv = inverse_permutation(jnp.clip(layout.q_perm, 0, t - 1))  # [B|1, N|1, T]
        out = _gather_rows(out, inv)
        lse = jnp.take_along_axis(lse, jnp.broadcast_to(inv, lse.shape), axis=2)
    if layout.kv_columns is not None and column_pass == "triton":  # rows in the original order on both sides
        columns_only = layout.replace(kv_block_count=jnp.zeros_like(layout.kv_block_count))
        out_c, lse_c = block_sparse_attention_triton(q_orig, k_orig, v_orig, columns_only, sm_scale=sm_scale,
                                                     causal=causal)
        out, lse = merge_attention(out, lse, out_c, lse_c)
    return out, lse


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


def _rows_result(q, k, v, layout: BlockLayout, *, sm_scale, causal, num_stages, key_pairs, overlap, pingpong,
                 poison):
    """`_rows_pass` with the kernel's defaults (stages; keys poisoned as ``poison`` says, None: unless every value
    is finite); key_pairs resolved."""
    d_pad = fa3.padded_head_dim(q.shape[3])
    stages = num_stages or default_stages(layout.block_k * (2 if key_pairs else 1), d_pad, layout.block_q)

    return _on_keys(lambda kp, vp: _rows_pass(q, kp, vp, layout, sm_scale=sm_scale, causal=causal, stages=stages,
                                              d_pad=d_pad, pair=key_pairs, overlap=overlap, pingpong=pingpong),
                    k, v, poison)


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
