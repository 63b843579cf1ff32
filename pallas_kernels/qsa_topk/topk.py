"""Online top-k structures over a left-to-right scan of block scores.

Every function works on a batch of R independent rows at once and uses only elementwise
ops, iotas and row reductions, so the same code runs inside the Pallas Triton kernel (rows
of one program, state in registers) and in the pure-JAX reference (a `lax.scan`).

A scan offers, at step ``j``, one score ``x [R]`` (block id ``j``) to every row where
``active [R]`` is set. Three structures:

* **exact**: a buffer of ``k`` (value, id) slots per row plus the tracked weakest slot
  (minimum value; among equal values the highest id). A score replaces the weakest slot
  when strictly greater, so among equal scores the lower block id is kept: the final set
  is exactly `lax.top_k`'s selection (which prefers lower indices on ties). O(k) vector
  work per update (a row reduction over the buffer).
* **tournament**: a winner tree over the slots (leaves padded to a power of two, 2k - 1
  nodes): every internal node holds the weakest of its two children, the root the slot to
  evict. An update replaces the root's leaf and replays its path to the root, O(log k)
  nodes. In registers on a SIMT GPU each node access is a masked select over its level,
  so the vector work is O(k) per update as for the exact buffer, with a larger constant
  (three masked reductions per level). Measured on an H200 (2026-11-21, 128k tokens, the
  fused kernel): 36 / 281 / 913 ms at k = 16 / 128 / 256 vs 27 / 63 / 172 ms for the exact
  buffer, 32 / 34 / 38 ms for the estimated hybrid (k_exact = 8) and 25 ms without any
  top-k. A tree in global memory would need per-level
  barriers that Pallas Triton does not expose; we kept the register version. The selection
  is identical to the exact buffer's.
* **estimated** (hybrid): ``k_exact`` exact slots; whatever the exact buffer rejects or
  evicts (the *spill*) is offered to ``k - k_exact`` append-only slots, accepted when its
  score is at least a running estimate of the score above which the offers still to come hold
  about as many items as there are free slots: the quantile ``p = 1 - remaining_slots /
  remaining_offers`` of the row's scores. When ``remaining_slots >= remaining_offers``
  (p <= 0) everything is accepted, so a row with at least k candidates always fills its k
  slots. With fewer than two scores seen the threshold is +inf unless p <= 0. Two estimates
  of that quantile (``quantile=``):

  - ``"gaussian"``: ``m + sqrt(2) * sigma * erfinv(2p - 1)`` from the running mean m and
    population variance sigma^2 (Welford) of all scores seen so far;
  - ``"histogram"`` (default): the Gaussian threshold, raised where counts show more scores
    above it than slots. Once `HIST_WARMUP` scores are seen, m and sigma are frozen and the row
    counts, for `HIST_BINS` edges ``m + sigma * HIST_WIDTH * b`` (b = 0 .. 15, up to 7.5
    sigma), how many later scores reached each edge: every score until `HIST_MIN_COUNT` are
    counted, then about one block id in `HIST_COUNT_EVERY` (a hash of the id, `_hash`). The
    offers still to come that reach edge b are estimated as ``count_b * remaining_offers /
    counted``; the histogram threshold lies between the last edge where that exceeds
    ``remaining_slots`` and the next one (log-linear in the count; one bin width past the top
    edge when every edge has too many), recomputed every `HIST_REFRESH_EVERY`-th step and used
    from `HIST_MIN_COUNT` counted scores on. It needs the scores in a random-like order
    (``scan="golden"``).

  Why: the Gaussian quantile assumes a bell-shaped upper tail. Video rows have a cluster of
  near-equal high scores (a sink key in every frame: ~900 blocks per row at 1M tokens), more
  than the slots and far above the bell; every one of them clears the Gaussian threshold, so
  the slots fill with the first of them the scan meets rather than the best. The counts place
  the threshold inside the cluster. Taking the larger of the two keeps the Gaussian's
  precision where the scores are bell-shaped (the histogram alone, from fewer scores, lost
  3-5 points of mass on i.i.d. normal rows of 256 scores, k = 16). Mass of the row held by
  its 128 blocks, gaussian / histogram / exact top 128 (`tools/topk_threshold_mass.py`, CPU,
  the MOMO bench's inputs, 2 / 1 heads, fp32, k_exact = 8, golden order, 32 rows of the second
  half; `bench/results/topk-threshold-mass_cpu_2026-11-26.jsonl`): mixed video +
  text at 1M 0.194 / 0.337 / 0.345, at 256k 0.361 / 0.421 / 0.427, at 64k 0.511 / 0.511 /
  0.515; video at 1M 0.044 / 0.049 / 0.050, at 64k 0.297 / 0.296 / 0.300; needle within
  0.001 of the Gaussian at 64k, 256k and 1M.
  (An exponential-tail fit to the exact slots instead of the counts kept 0.310 at 1M mixed
  but lost 9-16 points on needles, whose small cluster it extrapolated.)

  Cost in the fused kernel (one H200, 2026-11-26, 1M tokens, `tools/qsa_quantile_cost.py`):
  2211 ms against 2125 ms with the Gaussian rule and 1564 ms without a top-k. What costs is
  registers, not arithmetic: a [64, 16] edge array per program and the threshold at every
  step took 2807 ms, the threshold every 8th step 2521, counting one block in 4 2527, and
  holding base and width per row instead of the edges 2211. Counting at even steps only was
  biased (the golden order visits only even blocks at even steps, and per-frame sinks sit on
  a fixed residue of the block id), hence the hash.

  O(k_exact + HIST_BINS) vector work per update: the kernel writes accepted items straight
  to its output (one scattered store per row), so the k - k_exact estimated slots never
  occupy registers.

Empty slots hold value -inf and a distinct negative id (``-1 - slot``); padding slots
(when k is not a power of two) hold +inf and are never evicted. `finalize` maps both to
(-inf, -1) and sorts by (value desc, id asc) as `lax.top_k` orders its output.

Non-finite scores: a NaN score (a block holding a visible non-finite q . k) ranks above every
finite score, as `lax.top_k` ranks it, so its block is always selected and the NaN reaches the
attention of the rows that see it. Inside the structures it is held as `RANK_NAN` (the largest
float32, below the +inf padding). The exact and tournament structures therefore keep the
first k NaN blocks; the estimated hybrid keeps the first ``k_exact`` in its exact slots and
accepts later ones whenever an append-only slot is still free, keeping them out of its
running statistics. `finalize` turns them back into NaN.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.tiling import next_pow2

ALGORITHMS = ("exact", "tournament", "estimated")
QUANTILES = ("histogram", "gaussian")  # the "estimated" hybrid's threshold (see the module docstring)
HIST_BINS = 16
HIST_WIDTH = 0.5  # bin width in running standard deviations
HIST_WARMUP = 64  # scores seen before the mean and deviation are frozen and counting starts
HIST_COUNT_EVERY = 4  # count the scores of about one block in n (a power of two; by a hash of the block id)
HIST_MIN_COUNT = 64  # counted scores before the histogram threshold takes part
HIST_REFRESH_EVERY = 8  # recompute the histogram threshold every n-th scan step (a power of two)
_INT_MIN = -(2**31)
RANK_NAN = float(jnp.finfo(jnp.float32).max)  # how a NaN score ranks: above every finite score


def rank_value(x: jax.Array) -> jax.Array:
    """Scores as the structures compare them: NaN (and +inf) -> `RANK_NAN`."""
    return jnp.where(jnp.isnan(x) | (x == jnp.inf), RANK_NAN, x)


def unrank_value(x: jax.Array) -> jax.Array:
    """Inverse of `rank_value` on selected scores: `RANK_NAN` -> NaN."""
    return jnp.where(x == RANK_NAN, jnp.nan, x)


_IOTA = [None]  # set while a Mosaic GPU kernel traces the structures (`mosaic_tracing`)
_COUNT_ALL_UNTIL = [None]  # the scan step from which the histogram count may skip un-hashed blocks (ditto)


@contextlib.contextmanager
def mosaic_tracing(iota, first_active_step: int | None = None):
    """Trace the structures for a Mosaic GPU kernel: ``iota(dtype, shape, dimension)`` makes their 2-D iotas
    (Mosaic GPU needs the layout), and the histogram count is not branched on a reduction over the rows (which
    Mosaic GPU does not lower).

    ``first_active_step=None``: the count runs at every step (per row, the same results). With an int the caller
    promises that each row is offered finite scores at every step from ``first_active_step`` until its last offer
    (the kernel's rows on finite inputs). A row then has counted `HIST_MIN_COUNT` scores by step
    ``first_active_step + HIST_WARMUP + HIST_MIN_COUNT``; from that step on the count runs only at steps whose
    block hashes in, a branch on the scalar block id, with the same results for such rows."""
    _IOTA[0] = iota
    _COUNT_ALL_UNTIL[0] = None if first_active_step is None else first_active_step + HIST_WARMUP + HIST_MIN_COUNT
    try:
        yield
    finally:
        _IOTA[0] = None
        _COUNT_ALL_UNTIL[0] = None


def _iota(rows: int, size: int, dtype=jnp.int32) -> jax.Array:
    if _IOTA[0] is not None:
        return _IOTA[0](dtype, (rows, size), 1)
    return lax.broadcasted_iota(jnp.int32, (rows, size), 1).astype(dtype)


def _ones_where(mask: jax.Array) -> jax.Array:
    """f32 1 where ``mask`` else 0 (a select: Mosaic GPU converts no 2-D bool arrays)."""
    return jnp.where(mask, 1.0, 0.0).astype(jnp.float32)


def _empty_slots(rows: int, k: int) -> tuple[jax.Array, jax.Array]:
    """(vals, ids) ``[rows, next_pow2(k)]``: k empty slots, then +inf padding."""
    size = next_pow2(k)
    slot = _iota(rows, size)
    vals = jnp.where(slot < k, -jnp.inf, jnp.inf).astype(jnp.float32)
    return vals, -1 - slot


def _weakest(vals: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row: the minimum value and, among slots holding it, the highest id."""
    mn = jnp.min(vals, axis=1)
    ev = jnp.max(jnp.where(vals == mn[:, None], ids, _INT_MIN), axis=1)
    return mn, ev


# ------------------------------------------------------------------------- exact
class ExactState(NamedTuple):
    vals: jax.Array  # f32 [R, k_pad]
    ids: jax.Array  # int32 [R, k_pad]
    min_val: jax.Array  # f32 [R] value of the slot to evict
    min_id: jax.Array  # int32 [R] id of the slot to evict


def exact_init(rows: int, k: int) -> ExactState:
    vals, ids = _empty_slots(rows, k)
    return ExactState(vals, ids, *_weakest(vals, ids))


def exact_offer(state: ExactState, x: jax.Array, j, active: jax.Array):
    """Offer score ``x [R]`` of block ``j`` -> (state, spill). ``spill`` is (value, id, ok):
    what the buffer rejected or evicted (ok is False when nothing real left it)."""
    take = active & (x > state.min_val)
    hit = (state.ids == state.min_id[:, None]) & take[:, None]
    j_arr = jnp.full(x.shape, j, jnp.int32)
    vals = jnp.where(hit, x[:, None], state.vals)
    ids = jnp.where(hit, j_arr[:, None], state.ids)
    spill_val = jnp.where(take, state.min_val, x)
    spill_id = jnp.where(take, state.min_id, j_arr)
    spill_ok = active & (spill_val > -jnp.inf)
    new = ExactState(vals, ids, *_weakest(vals, ids))
    new = ExactState(*(jnp.where(take if a.ndim == 1 else take[:, None], a, b)
                       for a, b in zip(new, state)))
    return new, (spill_val, spill_id, spill_ok)


def exact_result(state: ExactState) -> tuple[jax.Array, jax.Array]:
    return state.vals, state.ids


# -------------------------------------------------------------------- tournament
class TournamentState(NamedTuple):
    """levels[0] is the leaves (value, id); levels[l] for l >= 1 the internal nodes of
    height l, ``[R, k_pad >> l]``, each (value, id, leaf slot) of the weakest leaf below."""

    leaf_vals: jax.Array
    leaf_ids: jax.Array
    node_vals: tuple[jax.Array, ...]
    node_ids: tuple[jax.Array, ...]
    node_slots: tuple[jax.Array, ...]


def tournament_init(rows: int, k: int) -> TournamentState:
    leaf_vals, leaf_ids = _empty_slots(rows, k)
    size = leaf_vals.shape[1]
    levels = int(math.log2(size))
    nv, ni, ns = [], [], []
    for lev in range(1, levels + 1):
        first = _iota(rows, size >> lev) << lev  # weakest below a node: its first leaf
        nv.append(jnp.where(first < k, -jnp.inf, jnp.inf).astype(jnp.float32))
        ni.append(-1 - first)
        ns.append(first)
    return TournamentState(leaf_vals, leaf_ids, tuple(nv), tuple(ni), tuple(ns))


def _root(state: TournamentState):
    if not state.node_vals:  # k_pad == 1: the single leaf is the root
        return state.leaf_vals[:, 0], state.leaf_ids[:, 0], jnp.zeros_like(state.leaf_ids[:, 0])
    return state.node_vals[-1][:, 0], state.node_ids[-1][:, 0], state.node_slots[-1][:, 0]


def tournament_offer(state: TournamentState, x: jax.Array, j, active: jax.Array):
    """Replace the root's leaf when ``x`` beats it, then replay that leaf's path."""
    rows, size = state.leaf_vals.shape
    root_val, root_id, root_slot = _root(state)
    take = active & (x > root_val)
    j_arr = jnp.full(x.shape, j, jnp.int32)
    hit = (_iota(rows, size) == root_slot[:, None]) & take[:, None]
    vals = jnp.where(hit, x[:, None], state.leaf_vals)
    ids = jnp.where(hit, j_arr[:, None], state.leaf_ids)
    child_v, child_i, child_s = vals, ids, _iota(rows, size)
    nv, ni, ns = [], [], []
    for lev in range(1, len(state.node_vals) + 1):
        parent = root_slot >> lev  # [R]
        pair = (_iota(rows, size >> (lev - 1)) >> 1) == parent[:, None]
        mv = jnp.min(jnp.where(pair, child_v, jnp.inf), axis=1)
        mi = jnp.max(jnp.where(pair & (child_v == mv[:, None]), child_i, _INT_MIN), axis=1)
        ms = jnp.max(jnp.where(pair & (child_i == mi[:, None]), child_s, -1), axis=1)
        at = (_iota(rows, size >> lev) == parent[:, None]) & take[:, None]
        child_v = jnp.where(at, mv[:, None], state.node_vals[lev - 1])
        child_i = jnp.where(at, mi[:, None], state.node_ids[lev - 1])
        child_s = jnp.where(at, ms[:, None], state.node_slots[lev - 1])
        nv.append(child_v)
        ni.append(child_i)
        ns.append(child_s)
    spill = (jnp.where(take, root_val, x), jnp.where(take, root_id, j_arr),
             active & (jnp.where(take, root_val, x) > -jnp.inf))
    return TournamentState(vals, ids, tuple(nv), tuple(ni), tuple(ns)), spill


def tournament_result(state: TournamentState) -> tuple[jax.Array, jax.Array]:
    return state.leaf_vals, state.leaf_ids


# --------------------------------------------------------------------- estimated
def erfinv(x: jax.Array) -> jax.Array:
    """Inverse error function for |x| < 1 (M. Giles' single-precision approximation,
    relative error ~1e-7): elementwise, so it lowers inside Triton kernels."""
    w = -jnp.log((1.0 - x) * (1.0 + x))
    wa = w - 2.5
    pa = 2.81022636e-08
    for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
              -0.00417768164, 0.246640727, 1.50140941):
        pa = c + pa * wa
    wb = jnp.sqrt(jnp.maximum(w, 5.0)) - 3.0
    pb = -0.000200214257
    for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
              0.00943887047, 1.00167406, 2.83297682):
        pb = c + pb * wb
    return jnp.where(w < 5.0, pa, pb) * x


class EstimatedState(NamedTuple):
    exact: ExactState  # k_exact slots (a 1-slot dummy that takes nothing when k_exact = 0)
    est_vals: jax.Array | None  # f32 [R, next_pow2(k - k_exact)]; None: kept by the caller
    est_ids: jax.Array | None  # int32
    count: jax.Array  # int32 [R] filled estimated slots
    n: jax.Array  # f32 [R] scores seen (Welford)
    mean: jax.Array  # f32 [R]
    m2: jax.Array  # f32 [R] sum of squared deviations
    # quantile="histogram" only (None for "gaussian"):
    hist: jax.Array | None = None  # f32 [R, HIST_BINS] counted scores since the freeze that reached each edge
    hist_base: jax.Array | None = None  # f32 [R] frozen mean (edge 0)
    hist_width: jax.Array | None = None  # f32 [R] frozen deviation * HIST_WIDTH (edge b: base + b * width)
    hist_counted: jax.Array | None = None  # f32 [R] scores counted since the freeze (-1: not frozen yet)
    hist_thr: jax.Array | None = None  # f32 [R] the histogram threshold of the last refresh (-inf: none yet)


def check_quantile(quantile: str) -> None:
    """ValueError naming ``quantile`` unless it is one of `QUANTILES`."""
    if quantile not in QUANTILES:
        raise ValueError(f"quantile: expected one of {QUANTILES}; received {quantile!r}")


def estimated_init(rows: int, k: int, k_exact: int, *, buffers: bool = True,
                   quantile: str = "histogram") -> EstimatedState:
    """``buffers=False``: the append-only slots are not held in the state; the caller
    stores each accepted item itself (the kernel writes it straight to its output)."""
    check_quantile(quantile)
    k_est = k - k_exact
    est_vals, est_ids = _empty_slots(rows, max(k_est, 1))
    if k_est == 0:
        est_vals = jnp.full_like(est_vals, jnp.inf)  # no estimated slot: padding only
    if not buffers:
        est_vals = est_ids = None
    zeros = jnp.zeros((rows,), jnp.float32)
    hist = ()
    if quantile == "histogram":
        hist = (jnp.zeros((rows, HIST_BINS), jnp.float32), zeros, zeros, zeros - 1.0, zeros - jnp.inf)
    return EstimatedState(exact_init(rows, max(k_exact, 1)), est_vals, est_ids,
                          jnp.zeros((rows,), jnp.int32), zeros, zeros, zeros, *hist)


def _histogram_threshold(state: EstimatedState, slots_left: jax.Array, remaining: jax.Array) -> jax.Array:
    """f32 [R]: the score above which the offers still to come are estimated to hold
    ``slots_left`` items (see the module docstring); -inf before `HIST_MIN_COUNT` scores were counted."""
    counted = state.hist_counted
    too_many = state.hist * remaining[:, None] > (slots_left * counted)[:, None]  # decreasing in b
    b = jnp.sum(_ones_where(too_many), axis=1)
    # Between the last edge with too many (b - 1) and the first that fits (b): log-linear in the count.
    bins = _iota(*state.hist.shape, dtype=jnp.float32)
    c_lo = jnp.sum(jnp.where(bins == (b - 1.0)[:, None], state.hist, 0.0), axis=1)  # too many
    c_hi = jnp.sum(jnp.where(bins == b[:, None], state.hist, 0.0), axis=1)  # fits
    target = slots_left * counted / jnp.maximum(remaining, 1.0)
    lo, hi = jnp.maximum(c_lo, 0.5), jnp.maximum(c_hi, 0.5)
    frac = jnp.log(lo / jnp.maximum(target, 0.5)) / jnp.maximum(jnp.log(lo / hi), 1e-6)
    frac = jnp.where((b > 0.0) & (b < HIST_BINS), jnp.clip(frac, 0.0, 1.0), 1.0)
    return jnp.where(counted >= HIST_MIN_COUNT, state.hist_base + state.hist_width * (b - 1.0 + frac), -jnp.inf)


def _histogram_count(state: EstimatedState, x: jax.Array, stat: jax.Array, n, mean, sigma):
    """Count ``x`` at the frozen edges, or freeze mean / deviation once `HIST_WARMUP` scores
    are seen -> (hist, hist_base, hist_width, hist_counted). Before the freeze the counts stay
    0 (``take`` is false). The edges are recomputed here rather than held: registers, not
    arithmetic, are what the kernel's top-k structures cost."""
    frozen = state.hist_counted >= 0.0
    take = stat & frozen
    edges = state.hist_base[:, None] + state.hist_width[:, None] * _iota(x.shape[0], HIST_BINS, dtype=jnp.float32)
    hist = state.hist + _ones_where(take[:, None] & (x[:, None] >= edges))
    freeze = stat & (state.hist_counted < 0.0) & (n >= HIST_WARMUP)  # not frozen (no bool negation: Mosaic GPU)
    return (hist, jnp.where(freeze, mean, state.hist_base), jnp.where(freeze, sigma * HIST_WIDTH, state.hist_width),
            jnp.where(freeze, 0.0, state.hist_counted + take.astype(jnp.float32)))


def _every(period: int, step, run, keep):
    """``run()`` where the scalar ``step`` is a multiple of ``period`` (a power of two), ``keep()``
    elsewhere: a branch the kernel tile takes or skips (none when ``period`` is 1). Bitwise, not
    ``%``: the Triton lowering of ``rem`` by a constant fails (jax 0.11.2)."""
    if period == 1:
        return run()
    return lax.cond((jnp.asarray(step, jnp.int32) & (period - 1)) == 0, run, keep)


def _where_rows(on: jax.Array, new, old):
    """Per row (``on [R]``), the leaves of ``new`` or of ``old``."""
    return jax.tree.map(lambda a, b: jnp.where(on[(...,) + (None,) * (a.ndim - 1)], a, b), new, old)


def _hash(j):
    """A scalar hash of block id ``j`` (Fibonacci hashing, the high bits of ``j * 2^32 / phi``):
    ``_hash(j) & (c - 1) == 0`` picks about one block in c with no relation to the block grid
    (``j`` a scalar in the kernel, per row ``[R]`` in the reference, whose rows may scan in
    different orders).
    A step or id parity would not do: the golden order visits only even blocks at even steps,
    and per-frame sinks sit on a fixed residue of the block id."""
    h = jnp.asarray(j, jnp.int32) * jnp.int32(-1640531535)  # 0x9E3779B1 as int32, wrapping
    return lax.shift_right_logical(h, jnp.int32(16))


def estimated_step(state: EstimatedState, x: jax.Array, j, active: jax.Array,
                   remaining: jax.Array, *, k: int, k_exact: int, step=0):
    """One offer -> (state, (accept [R], value [R], id [R], slot [R])): the item appended
    at ``slot`` of the estimated slots where ``accept``. ``remaining [R]``: offers this row
    still gets, this one included (the row's candidates are contiguous block ids, so the
    caller knows it in closed form). A `RANK_NAN` item is accepted whenever a slot is free
    and stays out of the running statistics. The threshold rule ("histogram" or "gaussian")
    is the one `estimated_init` built the state for. ``step`` (a scalar, the scan step): the
    histogram refreshes its threshold every `HIST_REFRESH_EVERY`-th step and, once a row has counted
    `HIST_MIN_COUNT` scores, counts about one block id in `HIST_COUNT_EVERY` (branches the whole
    kernel tile takes or skips; `_hash`)."""
    x = rank_value(x)
    # Welford over every finite score offered.
    stat = active & (x != RANK_NAN)
    n = state.n + stat.astype(jnp.float32)
    delta = jnp.where(stat, x - state.mean, 0.0)
    mean = jnp.where(stat, state.mean + delta / jnp.maximum(n, 1.0), state.mean)
    m2 = jnp.where(stat, state.m2 + delta * (x - mean), state.m2)
    if k_exact > 0:
        exact, (sv, si, ok) = exact_offer(state.exact, x, j, active)
    else:
        exact, sv, si, ok = state.exact, x, jnp.full(x.shape, j, jnp.int32), active
    k_est = k - k_exact
    slots_left = (k_est - state.count).astype(jnp.float32)
    rem = jnp.maximum(remaining, 1).astype(jnp.float32)
    p = 1.0 - slots_left / rem
    sigma = jnp.sqrt(jnp.maximum(m2, 0.0) / jnp.maximum(n, 1.0))
    z = erfinv(jnp.clip(2.0 * p - 1.0, -0.9999999, 0.9999999))
    thr = mean + math.sqrt(2.0) * sigma * z
    hist = ()
    if state.hist is not None:
        thr_h = _every(HIST_REFRESH_EVERY, step, lambda: _histogram_threshold(state, slots_left, rem),
                       lambda: state.hist_thr)
        thr = jnp.maximum(thr, thr_h)
        # Every score until HIST_MIN_COUNT are counted, then about one block in HIST_COUNT_EVERY.
        on = ((_hash(j) & (HIST_COUNT_EVERY - 1)) == 0) | (state.hist_counted < HIST_MIN_COUNT)
        keep = (state.hist, state.hist_base, state.hist_width, state.hist_counted)
        if _IOTA[0] is not None:  # Mosaic GPU (`mosaic_tracing`)
            def count():
                return _where_rows(on, _histogram_count(state, x, stat, n, mean, sigma), keep)
            if _COUNT_ALL_UNTIL[0] is None:
                counts = count()
            else:
                hashed_in = (_hash(j) & (HIST_COUNT_EVERY - 1)) == 0  # the kernel: a scalar (the tile's block)
                if hashed_in.ndim:  # run_scan: per row
                    hashed_in = jnp.max(hashed_in.astype(jnp.int32)) > 0
                counts = lax.cond(hashed_in | (jnp.asarray(step) <= _COUNT_ALL_UNTIL[0]), count, lambda: keep)
        else:
            counts = lax.cond(jnp.max(on.astype(jnp.int32)) > 0,  # (jnp.any: no Triton lowering of reduce_or)
                              lambda: _where_rows(on, _histogram_count(state, x, stat, n, mean, sigma), keep),
                              lambda: keep)
        hist = (*counts, thr_h)
    accept = ok & (slots_left > 0) & ((p <= 0.0) | (sv == RANK_NAN) | ((n >= 2.0) & (sv >= thr)))
    est_vals, est_ids = state.est_vals, state.est_ids
    if est_vals is not None:
        hit = (_iota(x.shape[0], est_vals.shape[1]) == state.count[:, None]) & accept[:, None]
        est_vals = jnp.where(hit, sv[:, None], est_vals)
        est_ids = jnp.where(hit, si[:, None], est_ids)
    new = EstimatedState(exact, est_vals, est_ids, state.count + accept.astype(jnp.int32), n, mean, m2, *hist)
    return new, (accept, sv, si, state.count)


def estimated_offer(state: EstimatedState, x: jax.Array, j, active: jax.Array,
                    remaining: jax.Array, *, k: int, k_exact: int, step=0) -> EstimatedState:
    return estimated_step(state, x, j, active, remaining, k=k, k_exact=k_exact, step=step)[0]


def estimated_result(state: EstimatedState, k_exact: int):
    """Two (vals, ids) parts: the exact slots and the estimated slots."""
    ev, ei = state.exact.vals, state.exact.ids
    if k_exact == 0:
        ev = jnp.full_like(ev, jnp.inf)
    return (ev, ei), (state.est_vals, state.est_ids)


# ----------------------------------------------------------------- shared driver
def init(algorithm: str, rows: int, k: int, k_exact: int, quantile: str = "histogram"):
    """``algorithm`` may also be "none" (no structure: the kernel's attention alone, for
    benchmarks). ``quantile``: the "estimated" threshold rule (ignored by the others)."""
    if algorithm == "none":
        return ()
    if algorithm == "exact":
        return exact_init(rows, k)
    if algorithm == "tournament":
        return tournament_init(rows, k)
    return estimated_init(rows, k, k_exact, quantile=quantile)


def offer(algorithm: str, state, x, j, active, remaining, *, k: int, k_exact: int, step=0):
    """Offer score ``x [R]`` of block ``j`` at scan step ``step`` to the rows where ``active``
    (NaN ranks first)."""
    if algorithm == "none":
        return state
    x = rank_value(x)
    if algorithm == "exact":
        return exact_offer(state, x, j, active)[0]
    if algorithm == "tournament":
        return tournament_offer(state, x, j, active)[0]
    return estimated_offer(state, x, j, active, remaining, k=k, k_exact=k_exact, step=step)


def weakest_value(algorithm: str, state) -> jax.Array:
    """f32 ``[R]``: the score an offer must beat to enter the exact or tournament structure."""
    if algorithm == "exact":
        return state.min_val
    return _root(state)[0]


def parts(algorithm: str, state, k_exact: int) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """The state's slots as one or two (vals ``[R, P]``, ids ``[R, P]``) parts."""
    if algorithm == "none":
        return ()
    if algorithm == "exact":
        return (exact_result(state),)
    if algorithm == "tournament":
        return (tournament_result(state),)
    return estimated_result(state, k_exact)


def finalize(vals: jax.Array, ids: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Slots ``[..., P]`` (any order, padding +inf, empties negative ids) -> (scores, ids)
    ``[..., k]`` sorted by score descending then id ascending; empty slots are (-inf, -1)
    and come last; `RANK_NAN` items come first and are returned as NaN."""
    empty = (ids < 0) | (vals == jnp.inf)
    vals = jnp.where(empty, -jnp.inf, vals)
    ids = jnp.where(empty, -1, ids)
    key_id = jnp.where(empty, jnp.iinfo(jnp.int32).max, ids)
    _, _, vals, ids = lax.sort((-vals, key_id, vals, ids), dimension=vals.ndim - 1, num_keys=2)
    return unrank_value(vals[..., :k]), ids[..., :k]


def run_scan(algorithm: str, scores: jax.Array, active: jax.Array, remaining: jax.Array,
             *, k: int, k_exact: int = 0, block_ids: jax.Array | None = None, quantile: str = "histogram"
             ) -> tuple[jax.Array, jax.Array]:
    """Run a structure over scores ``[R, nb]`` left to right (``active``/``remaining``
    ``[R, nb]``) -> finalized (scores, ids) ``[R, k]``. The scan the kernel performs, as a
    `lax.scan`: used by the reference and the tests. ``block_ids`` (int32 ``[R, nb]``): the
    id of the block offered at each step (default: the step, id order); scores, active and
    remaining are then per step. ``quantile``: the "estimated" threshold rule."""
    rows, nb = scores.shape
    if block_ids is None:
        block_ids = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (rows, nb))

    def step(state, xs):
        x, a, rem, j, i = xs
        return offer(algorithm, state, x, j, a, rem, k=k, k_exact=k_exact, step=i), None

    state, _ = lax.scan(step, init(algorithm, rows, k, k_exact, quantile),
                        (scores.T, active.T, remaining.T, jnp.asarray(block_ids, jnp.int32).T,
                         jnp.arange(nb, dtype=jnp.int32)))
    ps = parts(algorithm, state, k_exact)
    vals = jnp.concatenate([v for v, _ in ps], axis=1)
    ids = jnp.concatenate([i for _, i in ps], axis=1)
    return finalize(vals, ids, k)
