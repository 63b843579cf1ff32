"""MOMO ("Measure Once, Mask Once"): query-sparse measurement, one block mask, delta
correction.

1. `qsa_topk` (one fused kernel): dense causal attention of every gamma-th query (rows
   ``t ≡ 0 mod gamma``) -> O_gamma, and an online top-k of key blocks (size ``block``)
   per sampled row, scored by S(j) = logsumexp of the block's scaled logits.
2. `union_trim` (MOMO Algorithm 2): per query block of ``query_block`` (chi) rows, merge
   the selections of its ``chi / gamma`` sampled rows and keep the ``k_trim`` best block ids
   (ties to the lower id) by one of two rules (``Momo.trim_rule``; "auto", the default, is
   "mass", except "mean" for the "estimated" top-k scanning in id order):

   * ``"mass"``: the summed softmax mass the sampled rows put on the block,
     ``sum_g exp(S_g(j) - lse_g)`` over the rows g that kept j (0 for the others): an
     estimate of the query block's own mass in block j, the quantity the best shared block
     list maximises. Exact when every row keeps its true top k (a block a row did not keep
     has less mass there than the row's k-th block);
   * ``"mean"``: the mean score S(j) over the rows that kept j (Algorithm 2 as written),
     which does not assume that a block a row left out is worth nothing there; it helps
     only when the selections miss good blocks (the estimated top-k in id order).

   `assemble_layout` adds the forced blocks (sink blocks, and every block from the local
   window of the query block's first row to its diagonal block) and builds a `BlockLayout`.

   Why MOMO lost 3-8 points of mass on video-like inputs, and what closed it (CPU, reference
   implementations, 2026-11-23; `bench.momo.video_like`: frames of 1024 tokens, scores that
   rise with recency; every row of 2 random query blocks of the second half; 2 query / 1 key
   heads, fp32; default budget gamma 16, k = k_trim = 128, chi 128, beta 64;
   `bench/results/momo-mass{,128k}_cpu_2026-11-23.json`). Against the per-row oracle part of the
   gap is granularity (each row of a 128-row query block keeps its own best blocks, which no
   layout with one list per query block reaches); the target is judged against the best
   shared list per query block ("oracle_block"). The rest had two causes:

   * the "estimated" top-k scanned the blocks oldest first. Its running quantile assumes the
     scores arrive in random order; with recency-rising scores it lags, the append-only slots
     fill with old blocks and the recent frames, which hold most of the mass, find none free
     (32k: a sampled row kept 0.39 of its mass against 0.49 for its exact top 128). The
     kernel now offers most candidates in a golden-ratio order (``scan="golden"``;
     `pallas_kernels.qsa_topk.common`): the same blocks and work, another order, and the
     estimated selection is within 0.5 points of the exact one per row. Since 2026-11-27 the
     default is ``scan="golden_pairs"``, the same order over pairs of neighbouring blocks, which
     the fused Mosaic GPU kernel reads as 128-key tiles: QSA + top-k at 1M 1198 -> 1029 ms on an
     H100, same captured mass (video gap 0.41 points at 1M, 1.15 at 128k, both as "golden";
     `bench/results/momo-mass-golden-pairs_*`);
   * the "mean" rule (see above): once the selections are right, "mass" ranks better.

   Captured / shared-list oracle, gap in points (video; the default's gap is <= 0.06 points
   on needle and <= 0.56 on mixed video + text, every variant's <= 0.9): 32k 0.382 / 0.397, 1.47 (default: estimated, golden, "mass"; was
   3.90 with the id-order scan and "mean"); 64k 0.274 / 0.288, 1.47 (was 3.84); 128k 0.142 /
   0.153, 1.05 (was 2.31). The exact top-k with "mass" is at 0.93 / 1.42 / 1.04: what is left
   is the sampling of 8 rows per query block, the same for every modality, so no
   per-modality variant is needed.
   Re-rank (``rerank=c``; the default, None, is c = 4 with every 2nd row: ``rerank_factor``, ``rerank_rows``;
   ``rerank=0`` is MOMO as published). On the mixed video + text input the gap grows with the
   length (CPU, reference kernels, 2 query / 1 key heads, fp32, exact top-k, "mass" trim, 2026-11-25:
   0.29 points at 128k, 3.30 at 256k; 5.5 at 1M on an H200). It is the sampling of the rows: the
   best list for the 8 sampled rows' *true* masses (no per-row top-k at all) has the same gap
   (3.26 at 256k), and a larger per-row k (512) changes nothing, while that list's candidates
   contain the best list of all 128 rows. So union + trim keeps ``c * k_trim`` candidates and
   `pallas_kernels.candidate_mass` scores each with the mass the query block's rows (every
   ``rerank_stride``-th; each row normalised by its gamma group's sampled row's lse) put on it;
   the best ``k_trim`` are kept. 256k mixed, c = 2: gap 3.30 -> 0.58 points (rows every 1),
   0.95 (every 2), 1.22 (every 4); with the "estimated" top-k its candidates miss blocks (gap 5.53,
   re-rank 4x: 4.09); with ``k_exact=32`` and c = 2 it is 1.37 (exact top-k: 0.58). Extra work: the ``[rows / stride, block]`` score tiles of
   ``c * k_trim`` blocks per query block, no values. One H100 at 128k (2026-11-25): MOMO 89.3 ms,
   with c = 2 every row 141.0 ms, every 4th row 115.5 ms (the candidate-mass kernel alone, tuned since:
   51.1 / 18.5 ms). At 1M on an H100 (``k_exact=32``, estimated top-k) the mixed gap is 6.51 points, 3.12
   with c = 2 every row: still above 1.5; video 0.42 -> 0.23, needle 0.07 -> 0.04. Hence it was off by default then.
   Why it grows with the length (CPU, 256k, `tools/momo_sink_gap.py`): the mixed family's per-frame sinks give
   more near-equal sink blocks than k_trim (224 at 256k); the estimated top-k keeps the first good ones it meets.
   Sinks on / off, points: estimated 4.15 / 0.75, exact 2.38 / 0.47, exact + re-rank c = 2 0.45 / 0.24.
   The estimated top-k's threshold now counts its scores (``quantile="histogram"``, default since 2026-11-26;
   `pallas_kernels.qsa_topk.topk`) and chooses within the sink cluster: one H200 at 1M, mixed gap 8.03 ->
   5.62 points (exact top-k 5.47), 2.99 with re-rank c = 2 every 4th row; MOMO 2607 ms = 6.29x cuDNN.
   On by default since 2026-11-26 (one H100 at 1M, the fused Mosaic QSA and the Mosaic candidate-mass kernel,
   `bench/results/momo-{1m-default-rerank-timing-final,mass-1m-16blocks-default}_*`): c = 4 with every
   2nd row keeps the mixed / video / needle gaps at 1.36 / 0.23 / 0.04 points (without re-rank 4.41 / 0.44 /
   0.07), MOMO 2153 ms = 7.58x cuDNN (1767 ms = 9.24x without).
   Since 2026-11-28 it scores only ``rerank_share`` (5/8) of each head's query blocks: those whose union puts the
   largest share of its value past its first k_trim blocks (`UnionCandidates.tail`), where union + trim alone is
   least sure; the others keep union + trim's k_trim. One H200 at 1M (`tools/momo_rerank_variants.py --adaptive`,
   `momo-rerank-adaptive_*`, the bench's inputs and blocks): gaps 1.41 / 0.27 / 0.06 points (all blocks: 1.36 /
   0.23 / 0.04; 3/4 of them: 1.36 / 0.25 / 0.05; 5/8 chosen at random: 2.66 mixed), and MOMO 1535 ms = 10.17x
   cuDNN's 15.62 s, the re-rank 214 ms instead of 337 (`momo-1m-timing-share_*`).
3. Key-sparse attention of all queries on that layout (`block_sparse_attention`) -> O_*.
4. Delta correction (Eq. 3): ``out[t] = O_*[t] + (O_gamma - O_*)[gamma * (t // gamma)]``,
   so the sampled rows equal dense attention and every row of a gamma group is shifted by
   its sampled row's error. The returned lse is the key-sparse lse, with the dense lse on
   the sampled rows.

Forced blocks never compete for the k slots (the kernel offers a row only blocks before
its local window and after the sink), so k and k_trim count selected blocks beyond them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mmjax.sparse.layouts import KernelOptions
from mmjax.sparse.patterns.base import Pattern
from pallas_kernels import BlockLayout, QSATopKResult, block_sparse_attention, qsa_topk
from pallas_kernels.candidate_mass import candidate_mass
from pallas_kernels.checks import check_int, check_pow2
from pallas_kernels.platform import is_sm90
from pallas_kernels.qsa_topk.common import SCAN_ORDERS
from pallas_kernels.qsa_topk.mosaic_gpu import check_supported as check_qsa_mosaic
from pallas_kernels.qsa_topk.topk import check_quantile
from pallas_kernels.tiling import cdiv

TOPK_ALGORITHMS = ("exact", "tournament", "estimated")
DEFAULT_RERANK = 4  # the re-rank's candidates per kept block by default (``Momo.rerank=None``)
DEFAULT_RERANK_STRIDE = 2  # its rows: every 2nd row of a query block (``Momo.rerank_stride=None``)
DEFAULT_RERANK_SHARE = 0.625  # the share of the query blocks it scores (``Momo.rerank_share``)


# ----------------------------------------------------------------- forced blocks
def forced_blocks(q_len: int, kv_len: int, *, query_block: int, block: int, sink_blocks: int,
                  local: int) -> tuple[np.ndarray, np.ndarray]:
    """Static forced key blocks per query block: (ids int32 ``[nq, F]`` ascending, padded
    with 0; count int32 ``[nq]``). Query block c forces the sink blocks it may see and every
    block in ``[max(first - local, 0) // block, last // block]`` (first/last: positions of
    its first and last rows)."""
    nq = cdiv(q_len, query_block)
    offset = kv_len - q_len
    first = np.arange(nq) * query_block + offset
    last = np.minimum((np.arange(nq) + 1) * query_block, q_len) - 1 + offset
    lo, hi = np.maximum(first - local, 0) // block, last // block
    lists = [sorted(set(range(min(sink_blocks, lo[c]))) | set(range(lo[c], hi[c] + 1)))
             for c in range(nq)]
    width = max(len(x) for x in lists)
    ids = np.zeros((nq, width), np.int32)
    count = np.array([len(x) for x in lists], np.int32)
    for c, x in enumerate(lists):
        ids[c, : len(x)] = x
    return ids, count


def window_start(q_len: int, kv_len: int, *, query_block: int, block: int, local: int) -> np.ndarray:
    """int32 ``[nq]``: first forced local block of each query block (candidates lie below)."""
    nq = cdiv(q_len, query_block)
    first = np.arange(nq) * query_block + kv_len - q_len
    return (np.maximum(first - local, 0) // block).astype(np.int32)


# -------------------------------------------------------------- union and trim
TRIM_RULES = ("mass", "mean")
MOMO_TRIM_RULES = ("auto",) + TRIM_RULES


def union_trim(block_idx: jax.Array, block_score: jax.Array, *, q_len: int, kv_len: int,
               gamma: int, query_block: int, block: int, k_trim: int, sink_blocks: int,
               local: int, rule: str = "mean", lse: jax.Array | None = None, total: bool = False
               ) -> tuple[jax.Array, ...]:
    """MOMO Algorithm 2 on the QSA selections.

    Args:
      block_idx, block_score: ``[B, N, Tg, k]`` from `qsa_topk` (-1 / -inf for empty slots).
      rule: "mean" (mean score over the sampled rows that selected a block) or "mass"
        (summed ``exp(score - lse)`` over them; needs ``lse``).
      lse: ``[B, N, Tg]`` log-sum-exp of the sampled rows (`qsa_topk`'s ``lse_gamma``).

    Returns (ids int32 ``[B, N, nq, k_trim]``, values f32 ``[B, N, nq, k_trim]``): per query
    block the k_trim blocks with the highest value (ties to the lower id), forced blocks
    excluded; by value descending, empty slots -1 / -inf. Three stages: `union_pairs`, a sort by id, `run_values`.
    ``total``: also the sum of every block's value in the union (float32 ``[B, N, nq]``), as a third output.
    """
    ids, sc = union_pairs(block_idx, block_score, q_len=q_len, kv_len=kv_len, gamma=gamma, query_block=query_block,
                          block=block, sink_blocks=sink_blocks, local=local, rule=rule, lse=lse)
    ids, sc = lax.sort((ids, sc), dimension=3, num_keys=1)  # ascending id, empties last
    mean, seg_id = run_values(ids, sc, rule=rule, big=cdiv(kv_len, block))
    m = ids.shape[-1]
    take = min(k_trim, m)
    vals, pos = lax.top_k(mean, take)  # segments are in id order: ties go to the lower id
    out_ids = jnp.take_along_axis(seg_id, pos, axis=-1)
    empty = jnp.isneginf(vals)
    out_ids = jnp.where(empty, -1, out_ids).astype(jnp.int32)
    if take < k_trim:
        widths = ((0, 0), (0, 0), (0, 0), (0, k_trim - take))
        out_ids = jnp.pad(out_ids, widths, constant_values=-1)
        vals = jnp.pad(vals, widths, constant_values=-jnp.inf)
    if total:
        return out_ids, vals, jnp.sum(jnp.where(jnp.isfinite(mean), mean, 0.0), axis=-1)
    return out_ids, vals


def union_pairs(block_idx: jax.Array, block_score: jax.Array, *, q_len: int, kv_len: int, gamma: int,
                query_block: int, block: int, sink_blocks: int, local: int, rule: str = "mean",
                lse: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`union_trim`'s first stage: each query block's sampled selections as (ids int32, values float32) ``[B, N,
    nq, (query_block / gamma) * k]``, the value a selection's score ("mean") or ``exp(score - lse)`` ("mass");
    forced and empty selections get id ``ceil(kv_len / block)`` and value 0."""
    if rule not in TRIM_RULES:
        raise ValueError(f"rule: expected one of {TRIM_RULES}; received {rule!r}")
    if rule == "mass":
        if lse is None or tuple(lse.shape) != tuple(block_idx.shape[:3]):
            got = None if lse is None else list(lse.shape)
            raise ValueError(f"lse: expected shape {list(block_idx.shape[:3])} ([B, N, Tg]) with rule='mass'; "
                             f"received {got}")
        finite = jnp.isfinite(lse)[..., None]
        block_score = jnp.where(finite, jnp.exp(block_score - jnp.where(finite, lse[..., None], 0.0)), 0.0)
    b, n, tg, k = block_idx.shape
    per = query_block // gamma
    nq = cdiv(q_len, query_block)
    pad = nq * per - tg
    ids = jnp.pad(block_idx, ((0, 0), (0, 0), (0, max(pad, 0)), (0, 0)), constant_values=-1)
    sc = jnp.pad(block_score, ((0, 0), (0, 0), (0, max(pad, 0)), (0, 0)), constant_values=-jnp.inf)
    ids = ids[:, :, : nq * per].reshape(b, n, nq, per * k)
    sc = sc[:, :, : nq * per].reshape(b, n, nq, per * k)
    lo = jnp.asarray(window_start(q_len, kv_len, query_block=query_block, block=block, local=local))
    big = cdiv(kv_len, block)
    valid = (ids >= sink_blocks) & (ids < lo[None, None, :, None])
    return jnp.where(valid, ids, big), jnp.where(valid, sc, 0.0)


def run_values(ids: jax.Array, sc: jax.Array, *, rule: str, big: int) -> tuple[jax.Array, jax.Array]:
    """`union_trim`'s third stage, on `union_pairs`' output sorted by id (``[B, N, nq, M]``): each run of one id
    at its run number (the runs in id order), as (value float32: the run's summed values ("mass") or their mean
    ("mean"), -inf past the last run and for id ``big``; the run's id)."""
    if rule not in TRIM_RULES:
        raise ValueError(f"rule: expected one of {TRIM_RULES}; received {rule!r}")
    if ids.ndim != 4 or sc.shape != ids.shape:
        raise ValueError(f"ids, sc: expected two arrays of one shape [B, N, nq, M]; received {list(ids.shape)} and "
                         f"{list(sc.shape)}")
    b, n, nq, m = ids.shape
    first = jnp.concatenate([jnp.ones(ids.shape[:-1] + (1,), bool), ids[..., 1:] != ids[..., :-1]], -1)
    seg = jnp.cumsum(first, axis=-1) - 1  # segment number within the row, [.., M]
    flat = (jnp.arange(b * n * nq).reshape(b, n, nq, 1) * m + seg).ravel()
    total = jax.ops.segment_sum(sc.ravel(), flat, num_segments=b * n * nq * m)
    count = jax.ops.segment_sum(jnp.ones_like(sc).ravel(), flat, num_segments=b * n * nq * m)
    seg_id = jax.ops.segment_max(ids.ravel(), flat, num_segments=b * n * nq * m)
    shape = (b, n, nq, m)
    total, count, seg_id = total.reshape(shape), count.reshape(shape), seg_id.reshape(shape)
    value = total if rule == "mass" else total / jnp.maximum(count, 1.0)
    return jnp.where((count > 0) & (seg_id < big), value, -jnp.inf), seg_id


def rerank_pick(candidates: jax.Array, mass: jax.Array, *, k_trim: int) -> jax.Array:
    """The re-rank's choice: the ``k_trim`` of ``candidates`` (int ids ``[B, N, nq, C]``, -1 empty) with the most
    ``mass`` (float, same shape); int32 ids ``[B, N, nq, k_trim]``, -1 where fewer candidates are left (ties to the
    earlier candidate)."""
    if candidates.ndim != 4:
        raise ValueError(f"candidates: expected a 4-D array [B, N, nq, C]; received shape {list(candidates.shape)}")
    c = candidates.shape[-1]
    if tuple(mass.shape) != tuple(candidates.shape):
        raise ValueError(f"mass: expected the candidates' shape [B, N, nq, C] = {list(candidates.shape)}; received "
                         f"{list(mass.shape)}")
    if not 1 <= k_trim <= c:
        raise ValueError(f"k_trim: expected 1 <= k_trim <= {c} (the candidates); received {k_trim}")
    top, pick = lax.top_k(jnp.where(candidates >= 0, mass, -jnp.inf), k_trim)
    return jnp.where(top > -jnp.inf, jnp.take_along_axis(candidates, pick, -1), -1).astype(jnp.int32)


def assemble_layout(trim_ids: jax.Array, *, q_len: int, kv_len: int, query_block: int,
                    block: int, sink_blocks: int, local: int) -> BlockLayout:
    """Forced blocks ∪ selected blocks ``trim_ids [B, N, nq, k']`` (-1 = empty, never a
    forced id) -> `BlockLayout` with ascending distinct lists (block_q = query_block,
    block_k = block)."""
    b, n, nq, _ = trim_ids.shape
    nk = cdiv(kv_len, block)
    f_ids, f_count = forced_blocks(q_len, kv_len, query_block=query_block, block=block,
                                   sink_blocks=sink_blocks, local=local)
    f_ids = np.where(np.arange(f_ids.shape[1]) < f_count[:, None], f_ids, nk)
    forced = jnp.broadcast_to(jnp.asarray(f_ids, jnp.int32), (b, n) + f_ids.shape)
    chosen = jnp.where(trim_ids >= 0, trim_ids, nk)
    lists = jnp.sort(jnp.concatenate([forced, chosen], axis=-1), axis=-1)
    count = (lists < nk).sum(-1).astype(jnp.int32)
    width = min(lists.shape[-1], nk)
    lists = jnp.where(lists[..., :width] < nk, lists[..., :width], 0).astype(jnp.int32)
    return BlockLayout(kv_blocks=lists, kv_block_count=count, block_q=query_block, block_k=block,
                       q_len=q_len, kv_len=kv_len)


# -------------------------------------------------------------- delta correction
def delta_correct(out_star: jax.Array, lse_star: jax.Array, out_gamma: jax.Array,
                  lse_gamma: jax.Array, gamma: int) -> tuple[jax.Array, jax.Array]:
    """Eq. 3: out_star ``[B, T, N, D]``, out_gamma ``[B, Tg, N, D]`` -> out ``[B, T, N, D]``
    (out_star's dtype) with ``out[t] = out_star[t] + (out_gamma - out_star[::gamma])[t //
    gamma]``; lse ``[B, N, T]`` = lse_star with lse_gamma on the sampled rows."""
    t = out_star.shape[1]
    delta = out_gamma.astype(jnp.float32) - out_star[:, ::gamma].astype(jnp.float32)
    out = out_star.astype(jnp.float32) + jnp.repeat(delta, gamma, axis=1)[:, :t]
    lse = lse_star.at[:, :, ::gamma].set(lse_gamma)
    return out.astype(out_star.dtype), lse


# ------------------------------------------------------------------- pattern
def _measure_implementation(options: KernelOptions) -> str | None:
    """The implementation of the measuring kernels (QSA + top-k, candidate mass) for ``options``, which name the
    block-sparse kernel's: "mosaic_gpu" runs them with their default (on an sm90 GPU the candidate mass takes its
    Mosaic GPU kernel where it supports the inputs, else Triton); `Momo.qsa_kernel` then takes the fused Mosaic GPU
    QSA + top-k where it supports the config."""
    return None if options.implementation == "mosaic_gpu" else options.implementation


class UnionCandidates(NamedTuple):
    """`Momo.union_candidates`: each query block's candidates and how sure union + trim is of its first ``k_trim``."""
    ids: jax.Array  # int32 [B, N, nq, C]: by union value, descending; -1 empty
    tail: jax.Array  # float32 [B, N, nq]: the share of the union's summed value past its first k_trim blocks


class MomoPlan(NamedTuple):
    """What MOMO measures once: the QSA result and the layout built from it."""

    qsa: QSATopKResult
    layout: BlockLayout


@dataclasses.dataclass(frozen=True)
class Momo(Pattern):
    """MOMO pattern (hyper-parameters static).

    Attributes:
      gamma: query sampling stride (rows ``t ≡ 0 mod gamma`` are measured and corrected).
      block: key block size beta (power of two >= 16).
      k: blocks kept per sampled row by the online top-k (<= number of key blocks).
      k_exact: exact slots of the "estimated" hybrid (0 <= k_exact <= k; ignored otherwise).
      k_trim: blocks kept per query block after union and trim (default k).
      query_block: chi, the layout's query block (power of two, a multiple of gamma).
      topk: "exact" | "tournament" | "estimated".
      sink: leading tokens forced in (rounded up to whole blocks).
      local: local window in tokens forced in (with the diagonal blocks).
      trim_rule: how union + trim ranks the sampled rows' blocks: "mass" (summed softmax
        mass), "mean" (mean score, Algorithm 2 as written) or "auto" (default: "mass" for
        the exact / tournament top-k, "mean" for "estimated"); see the module docstring.
      scan: order in which the "estimated" top-k is offered the key blocks: "golden_pairs"
        (default: a golden-ratio permutation of most candidates per kernel tile, in pairs of
        neighbouring blocks, which the Mosaic GPU kernel reads as one 128-key tile), "golden"
        (the same block by block) or "natural" (id order, oldest first); see the module docstring.
      quantile: how the "estimated" top-k sets its acceptance threshold: "histogram" (default: the
        Gaussian quantile raised where counts at frozen edges show more scores above it than free
        slots) or "gaussian" (the rule before 2026-11-25); see `pallas_kernels.qsa_topk.topk`.
      rerank: c >= 1: union + trim keeps ``c * k_trim`` candidates per query block, and
        `pallas_kernels.candidate_mass` scores them with the block's rows (every ``rerank_stride``-th) before the
        best ``k_trim`` are kept; 0: off (MOMO as published); None (default): `DEFAULT_RERANK` where the union of a
        query block's sampled selections holds that many candidates, else the most it holds (off below 2); see
        the module docstring ("Re-rank") and `rerank_factor`.
      rerank_stride: the rows of a query block the re-rank uses (a power of two, query_block / stride >= 16);
        None (default): `DEFAULT_RERANK_STRIDE` where the query block has 16 rows per stride, else 1.
      rerank_fp8: the re-rank's scores from float8 copies of q and k where its Mosaic GPU kernel runs (head dim
        128; `pallas_kernels.candidate_mass`'s ``qk_fp8``): one H200 at 1M, the re-rank 337 -> 265 ms (`Momo()`
        9.50x -> 10.02x cuDNN) and the mixed family's gap 1.36 -> 1.53 points (video / needle unchanged), so off by
        default.
      rerank_share: the share of each (batch, head)'s query blocks the re-rank scores (0 < share <= 1): those whose
        union puts the largest share of its value past its first ``k_trim`` blocks (`UnionCandidates.tail`, where
        union + trim alone is least sure); the others keep union + trim's ``k_trim``. Default `DEFAULT_RERANK_SHARE`
        (5/8: one H200 at 1M, mixed gap 1.41 points against 1.36 with every block, the re-rank 214 instead of 337 ms,
        MOMO 10.17x cuDNN; module docstring); the "mean" trim rule scores every query block (`rerank_fraction`).
    """

    gamma: int = 16
    block: int = 64
    k: int = 128
    k_exact: int = 8
    k_trim: int | None = None
    query_block: int = 128
    topk: str = "estimated"
    sink: int = 64
    local: int = 128
    trim_rule: str = "auto"
    scan: str = "golden_pairs"
    quantile: str = "histogram"
    rerank: int | None = None
    rerank_stride: int | None = None
    rerank_fp8: bool = False
    rerank_share: float = DEFAULT_RERANK_SHARE

    def __post_init__(self) -> None:
        self.validate()  # names block / query_block (the base class would say block_q / block_k)
        super().__post_init__()

    @property
    def block_q(self) -> int:  # type: ignore[override]
        return self.query_block

    @property
    def block_k(self) -> int:  # type: ignore[override]
        return self.block

    @property
    def trim(self) -> int:
        return self.k if self.k_trim is None else self.k_trim

    @property
    def rule(self) -> str:
        """The trim rule in use ("auto" resolved)."""
        if self.trim_rule != "auto":
            return self.trim_rule
        return "mean" if (self.topk, self.scan) == ("estimated", "natural") else "mass"

    @property
    def sink_blocks(self) -> int:
        return cdiv(self.sink, self.block)

    @property
    def rerank_factor(self) -> int:
        """The re-rank's c in use (0: off): ``rerank``, or for None `DEFAULT_RERANK` capped by the union of a query
        block's sampled selections (``query_block / gamma * k`` candidates over ``k_trim``), 0 below 2."""
        if self.rerank is not None:
            return self.rerank
        c = min(DEFAULT_RERANK, (self.query_block // self.gamma) * self.k // self.trim)
        return c if c >= 2 else 0

    @property
    def rerank_fraction(self) -> float:
        """The share of the query blocks the re-rank scores: ``rerank_share`` with the "mass" trim rule, 1 with
        "mean" (its union values are scores, whose tail says nothing)."""
        return self.rerank_share if self.rule == "mass" else 1.0

    @property
    def rerank_rows(self) -> int:
        """The re-rank's row stride in use (``rerank_stride``, or for None `DEFAULT_RERANK_STRIDE` where it leaves
        16 rows per query block, else 1)."""
        if self.rerank_stride is not None:
            return self.rerank_stride
        return DEFAULT_RERANK_STRIDE if self.query_block // DEFAULT_RERANK_STRIDE >= 16 else 1

    def validate(self) -> None:
        check_int("gamma", self.gamma, 1)
        check_pow2("block", self.block)
        check_pow2("query_block", self.query_block)
        check_int("k", self.k, 1)
        check_int("k_exact", self.k_exact, 0)
        if self.topk == "estimated" and self.k_exact > self.k:
            raise ValueError(f"k_exact: expected 0 <= k_exact <= k={self.k}; received {self.k_exact}")
        if self.k_trim is not None:
            check_int("k_trim", self.k_trim, 1)
        if not isinstance(self.rerank_fp8, bool):
            raise ValueError(f"rerank_fp8: expected a bool; received {self.rerank_fp8!r}")
        if isinstance(self.rerank_share, bool) or not isinstance(self.rerank_share, (int, float)) or not (
                0.0 < self.rerank_share <= 1.0):
            raise ValueError(f"rerank_share: expected a number in (0, 1]; received {self.rerank_share!r}")
        if self.query_block % self.gamma:
            raise ValueError(f"gamma: expected a divisor of query_block={self.query_block}; "
                             f"received {self.gamma}")
        if self.topk not in TOPK_ALGORITHMS:
            raise ValueError(f"topk: expected one of {TOPK_ALGORITHMS}; received {self.topk!r}")
        check_int("sink", self.sink, 0)
        check_int("local", self.local, 0)
        if self.scan not in SCAN_ORDERS:
            raise ValueError(f"scan: expected one of {SCAN_ORDERS}; received {self.scan!r}")
        check_quantile(self.quantile)
        if self.trim_rule not in MOMO_TRIM_RULES:
            raise ValueError(f"trim_rule: expected one of {MOMO_TRIM_RULES}; received {self.trim_rule!r}")
        if self.rerank is not None:
            check_int("rerank", self.rerank, 0)
        if self.rerank_stride is not None:
            check_pow2("rerank_stride", self.rerank_stride, 1)
            if self.query_block // self.rerank_stride < 16:
                raise ValueError(f"rerank_stride: expected query_block / rerank_stride >= 16 (query_block="
                                 f"{self.query_block}); received {self.rerank_stride}")
        union = (self.query_block // self.gamma) * self.k
        if self.rerank_factor * self.trim > union:
            raise ValueError(f"rerank: expected rerank * k_trim <= the union of a query block's sampled selections "
                             f"(query_block / gamma * k = {union}); received rerank={self.rerank}, k_trim={self.trim}")

    def check_lengths(self, kv_len: int) -> None:
        nk = cdiv(kv_len, self.block)
        if self.k > nk:
            raise ValueError(f"k: expected k <= number of key blocks ceil(S / block) = {nk} "
                             f"(S={kv_len}, block={self.block}); received {self.k}")

    def qsa_kernel(self, q: jax.Array, options: KernelOptions = KernelOptions(), rows: int = 64
                   ) -> tuple[str | None, int]:
        """(implementation, rows) of the QSA + top-k kernel for ``options``: under "mosaic_gpu", or by default
        (``implementation=None``, not interpreted) on a Hopper GPU, the fused Mosaic GPU kernel (128-row tiles) where it
        supports this config ("estimated" top-k, bf16 / fp16, ``k_exact`` a multiple of 8, ...); else
        `_measure_implementation` with ``rows`` sampled rows per tile. The tile size is part of the golden scan's
        order, so the two paths pick slightly different blocks per sampled row (about 4% at 1M tokens on random
        inputs; the trimmed layouts of the bench's mass runs came out identical)."""
        default_hopper = options.implementation is None and not options.interpret and is_sm90()
        if options.implementation == "mosaic_gpu" or default_hopper:
            try:
                check_qsa_mosaic(q, topk=self.topk, block_kv=self.block, k_exact=self.k_exact, rows=128,
                                 scan=self.scan)
                return "mosaic_gpu", 128
            except ValueError:
                pass
        return _measure_implementation(options), rows

    def plan(self, q: jax.Array, k: jax.Array, v: jax.Array, *,
             options: KernelOptions = KernelOptions()) -> MomoPlan:
        """QSA + top-k, then union/trim and the layout (jit-able)."""
        t, s = q.shape[1], k.shape[1]
        res = self.qsa(q, k, v, options=options)
        cands = self.union_candidates(res, t, s)
        ids = self.rerank_candidates(q, k, cands, res.lse_gamma, options) if self.rerank_factor else cands.ids
        return MomoPlan(res, assemble_layout(ids, **self._geometry(t, s)))

    def qsa(self, q: jax.Array, k: jax.Array, v: jax.Array, *,
            options: KernelOptions = KernelOptions()) -> QSATopKResult:
        """MOMO's first stage: `qsa_topk` (every ``gamma``-th row against all keys, each sampled row's top ``k``
        blocks) on the kernel `qsa_kernel` picks."""
        self.check_lengths(k.shape[1])
        qsa_impl, rows = self.qsa_kernel(q, options)
        return qsa_topk(q, k, v, gamma=self.gamma, block_kv=self.block, top_k=self.k,
                        k_exact=self.k_exact, topk=self.topk, sink_blocks=self.sink_blocks,
                        local=self.local, scan=self.scan, quantile=self.quantile, sm_scale=options.sm_scale,
                        implementation=qsa_impl, interpret=options.interpret, rows=rows,
                        check_finite=options.check_finite)

    def _geometry(self, q_len: int, kv_len: int) -> dict:
        return dict(q_len=q_len, kv_len=kv_len, query_block=self.query_block, block=self.block,
                    sink_blocks=self.sink_blocks, local=self.local)

    def union_candidates(self, res: QSATopKResult, q_len: int, kv_len: int) -> UnionCandidates:
        """Union + trim of the sampled rows' selections (``res`` from `qsa_topk`): `UnionCandidates` with ``C =
        k_trim``, or ``rerank_factor * k_trim`` candidates for `rerank_candidates` when it re-ranks."""
        ids, vals, total = union_trim(res.block_idx, res.block_score, gamma=self.gamma,
                                      k_trim=self.trim * max(1, self.rerank_factor), rule=self.rule,
                                      lse=res.lse_gamma, total=True, **self._geometry(q_len, kv_len))
        kept = jnp.sum(jnp.where(jnp.isfinite(vals[..., :self.trim]), vals[..., :self.trim], 0.0), axis=-1)
        tail = jnp.maximum(total - kept, 0.0) / jnp.where(total > 0, total, 1.0)  # in [0, 1]; 0 for an empty union
        return UnionCandidates(ids, jnp.minimum(tail, 1.0))

    def rerank_candidates(self, q, k, candidates: UnionCandidates, lse_gamma,
                          options: KernelOptions = KernelOptions()) -> jax.Array:
        """The kept ``k_trim`` blocks per query block, int32 ids ``[B, N, nq, k_trim]`` (-1 empty): in the
        ``rerank_share`` of each (batch, head)'s query blocks with the largest ``candidates.tail``, the candidates
        (``[B, N, nq, rerank_factor * k_trim]``) with the most mass over the query block's rows (every
        ``rerank_rows``-th); elsewhere union + trim's first ``k_trim``."""
        ids = candidates.ids
        nq = ids.shape[2]
        n_sel = min(nq, max(1, math.ceil(self.rerank_fraction * nq)))
        kw = dict(query_block=self.query_block, block=self.block, gamma=self.gamma, stride=self.rerank_rows,
                  sm_scale=options.sm_scale, implementation=_measure_implementation(options),
                  interpret=options.interpret, qk_fp8=self.rerank_fp8)
        if n_sel == nq:
            return rerank_pick(ids, candidate_mass(q, k, ids, lse_gamma, **kw), k_trim=self.trim)
        sel = jnp.sort(lax.top_k(candidates.tail, n_sel)[1], axis=-1).astype(jnp.int32)  # [B, N, n_sel]
        chosen = jnp.take_along_axis(ids, sel[..., None], axis=2)
        picked = rerank_pick(chosen, candidate_mass(q, k, chosen, lse_gamma, query_blocks=sel, **kw), k_trim=self.trim)
        return jnp.put_along_axis(ids[..., :self.trim], jnp.broadcast_to(sel[..., None], picked.shape), picked, axis=2,
                                  inplace=False)

    def build_layout(self, q: jax.Array, k: jax.Array, *, modality=None) -> BlockLayout:
        """The MOMO layout (``modality`` is ignored: MOMO measures every head directly). The
        QSA pass needs values only for O_gamma, so k stands in for v here; `attend` runs
        one QSA pass with the real values and reuses it."""
        return self.plan(q, k, k).layout

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, modality=None,
               options: KernelOptions = KernelOptions()) -> tuple[jax.Array, jax.Array]:
        """out ``[B, T, N, D]``, lse ``[B, N, T]``: key-sparse attention plus the delta
        correction (see the module docstring)."""
        plan = self.plan(q, k, v, options=options)
        out, lse = block_sparse_attention(
            q, k, v, plan.layout, sm_scale=options.sm_scale,
            implementation=options.implementation, interpret=options.interpret,
            check_finite=options.check_finite,
        )
        return delta_correct(out, lse, plan.qsa.out_gamma, plan.qsa.lse_gamma, self.gamma)
