"""What the block-sparse Mosaic GPU kernel (`mosaic_kernel`) supports, and its measured defaults.

Shared memory per configuration (`smem_bytes`, `max_stages`, `default_stages`), the steps of two list entries and
the persistent grid by default (`auto_key_pairs`, `auto_persistent`), the limits checked before anything is traced
(`check_supported`) and where ``implementation="auto"`` takes the kernel (`preferred`). Host-side only: nothing here
traces the kernel.
"""

from __future__ import annotations

import jax

from pallas_kernels import mosaic_fa3 as fa3
from pallas_kernels.block_sparse.layout import BlockLayout
from pallas_kernels.tiling import cdiv, round_up

BLOCK_Q = 128  # two consumer warpgroups of 64 rows
WG_ROWS = fa3.WG_ROWS
BLOCK_QS = (WG_ROWS, BLOCK_Q)
BLOCK_KS = (32, 64, 128)
# Shared memory per CTA on sm90 (the opt-in maximum); `smem_bytes` counts what the kernel asks for.
_SMEM_LIMIT = 227 * 1024
_SMEM_ALIGN = 1024  # Mosaic GPU pads every shared-memory buffer to this
_BARRIER_BYTES = 8
_MAX_STAGES = 4
TMA_ROWS = 8  # TMA copies a key tile from a row that is a multiple of this


def one_tile_windows(layout: BlockLayout) -> bool:
    """The layout's key windows all start on multiples of `TMA_ROWS` (``window_align``), so `window_tiles` loads
    each as one tile."""
    return layout.window_align % TMA_ROWS == 0


def ring_count(block_q: int) -> int:
    """K/V rings of stages: one shared by both consumers (``block_q`` 128), one per consumer (64)."""
    return 2 if block_q == WG_ROWS else 1


def _align(x: int) -> int:
    return round_up(x, _SMEM_ALIGN)


def pair_v_stages(stages: int, block_q: int, block_k: int) -> int:
    """V stages per ring with `key_pairs` steps of ``2 * block_k`` keys: one per consumer with 64-row query blocks
    and 128-key steps (K keeps ``stages``, so the next K pair loads during a step while V, needed only after the
    softmax, is refilled behind ``P V``; two rings of two K and two V stages of 128 keys do not fit), else
    ``stages``."""
    return 1 if block_q == WG_ROWS and 2 * block_k > 64 else stages


def smem_bytes(block_k: int, head_dim: int, stages: int, block_q: int = BLOCK_Q, *, pair: bool = False,
               persistent: bool = False, prior: bool = False) -> int:
    """Shared memory the kernel requests with ``stages`` K/V stages per ring and original positions (the larger
    case): the two Q/O tiles, the K and V rings, the lse / positions buffer, and the barriers, counted as Mosaic
    GPU does (matches its byte count on every configuration we compiled, e.g. 298,344 for 64-row query blocks,
    64-key tiles, D 128, 4 stages). ``pair``: steps of two list entries (``2 * block_k`` keys per stage, V
    stages `pair_v_stages`); ``persistent``: the persistent grid's two O tiles of their own (the next item's Q
    loads while O is stored); ``prior``: a prior result merged in (`MosaicConfig.prior`: O tiles of their own, the
    prior rows' lse, a row mask (`MosaicConfig.row_mask`) and a barrier per consumer). block_k in `BLOCK_KS`,
    head_dim a multiple of 64, stages >= 1, block_q in `BLOCK_QS`."""
    for name, value, ok, want in (("block_k", block_k, block_k in BLOCK_KS, f"one of {BLOCK_KS}"),
                                  ("head_dim", head_dim, head_dim > 0 and head_dim % 64 == 0, "a multiple of 64"),
                                  ("stages", stages, stages >= 1, "an int >= 1"),
                                  ("block_q", block_q, block_q in BLOCK_QS, f"one of {BLOCK_QS}")):
        if not ok:
            raise ValueError(f"{name}: expected {want}; received {value!r}")
    kt = block_k * (2 if pair else 1)
    k_slots = ring_count(block_q) * stages
    v_slots = ring_count(block_q) * (pair_v_stages(stages, block_q, block_k) if pair else stages)
    tiles = ((2 if persistent or prior else 1) * _align(2 * WG_ROWS * head_dim * 2)
             + _align(k_slots * kt * head_dim * 2) + _align(v_slots * kt * head_dim * 2))
    positions = _align(max(2 * WG_ROWS * 4, (2 * WG_ROWS + v_slots * kt) * 4))
    # K ready / K free per K slot; V ready / key positions / V free per V slot; Q tiles and positions; schedule
    barriers = 2 * k_slots + 3 * v_slots + 5
    if prior:  # the prior rows' lse and the rows' mask; a barrier per consumer
        positions += 2 * _align(2 * WG_ROWS * 4)
        barriers += 2
    return tiles + positions + barriers * _BARRIER_BYTES


def max_stages(block_k: int, head_dim: int, block_q: int = BLOCK_Q, *, pair: bool = False,
               persistent: bool = False, prior: bool = False) -> int:
    """Most K/V stages per ring (at most 4) that fit in shared memory; 0 when two do not fit."""
    fit = [st for st in range(2, _MAX_STAGES + 1)
           if smem_bytes(block_k, head_dim, st, block_q, pair=pair, persistent=persistent, prior=prior)
           <= _SMEM_LIMIT]
    return max(fit, default=0)


def default_stages(block_k: int, head_dim: int, block_q: int = BLOCK_Q) -> int:
    """K/V stages per ring (per consumer with ``block_q`` 64): as many as fit 220 KiB next to the two Q/O tiles,
    in [2, 4] (4 for 64-key tiles, 2 for 128-key tiles and for 64-row query blocks at D 128). One H100,
    2026-11-27 (``tools/mosaic_stages_bench.py``, ``bench/results/mosaic-stages-fit_*``): the third stage that
    `max_stages` allows there runs slower, 1.72 -> 1.79 / 7.31 -> 7.62 / 32.1 -> 32.8 ms on MInference's top-100
    mask (64x64) at 32k / 128k / 512k and 13.2 -> 13.3 / 209 -> 213 ms dense (128x128) at 32k / 128k."""
    tiles = 2 * WG_ROWS * head_dim * 2
    stage_bytes = ring_count(block_q) * 2 * block_k * head_dim * 2
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
SHORT_STEPS = (2, 6)  # or, at any number of items, lists of this many steps (at least, at most)


def auto_persistent(q: jax.Array, layout: BlockLayout, pair: bool, stages: int | None = None, *,
                    max_entries: int | None = None) -> bool:
    """`block_sparse_attention_mosaic_gpu`'s default for ``persistent`` (q ``[B, T, N, D]``, its layout): the
    persistent grid for short work, at most `PERSISTENT_ITEMS` work items (batch x heads x 128-row blocks) with lists
    of at most `PERSISTENT_STEPS` steps (``max_entries`` entries, default ``layout.max_blocks``, two per step with
    ``pair``), and any number of items with lists of 2 to 6 steps (`SHORT_STEPS`), where its O tiles fit next to two
    stages (or the ``stages`` asked for).

    Short lists at any length (one H200, 2026-11-29, ``tools/bench_mosaic_gpu.py --fixed-lists 2,4,6,8,12 --lens
    131072``, `mosaic-gpu-fixed-lists-128k_*`; every query block lists N random causal blocks, 28,672 items),
    persistent / item grid ms: 2 / 3 / 4 steps 1.77 / 2.17 / 2.60 against 2.23 / 2.44 / 2.83 (64-key blocks, two
    a step), 1.97 / 2.45 against 2.43 / 2.80 (2 / 4 128-key blocks); 6 steps 3.40 / 3.30 against 3.57 / 3.48, 8
    and 12 steps even (4.02 / 4.06, 5.51 / 5.53); but lists of one step 1.96 against 1.65. Grid's band (at most 5
    64-key entries, 3 steps): 1.59 against 1.92 ms at 128k (`pattern-parts-128k-trace_*`), 12.04 against 15.93 at
    1M (`pattern-parts-1m-band-grids_*`).

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
    steps = cdiv(entries, 2) if pair else entries
    items = q.shape[0] * q.shape[2] * cdiv(layout.num_q_blocks * layout.block_q, BLOCK_Q)
    fits = max_stages(layout.block_k, fa3.padded_head_dim(q.shape[-1]), layout.block_q, pair=pair, persistent=True)
    short = SHORT_STEPS[0] <= steps <= SHORT_STEPS[1]
    return (short or (items <= PERSISTENT_ITEMS and steps <= PERSISTENT_STEPS)) and fits >= max(2, stages or 0)


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

