"""Pure-JAX query-sparse attention with block top-k: the definition of correct.

Dense causal attention of the sampled rows (a scan over key blocks, online softmax in
float32) and the score S(j) of every key block per row; the selection is `lax.top_k` over
the candidate blocks for "exact" and "tournament" (both are exact algorithms), and the
sequential estimated algorithm of `topk.py` run as a `lax.scan` for "estimated", offering
the blocks in the kernel's scan order (`common.py`: id order or the tile's golden order).
Memory is O(B * N * Tg * (block_kv + nk)).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.nonfinite import finish, score_poison, value_poison
from pallas_kernels.qsa_topk import topk as topk_lib
from pallas_kernels.qsa_topk.common import (
    QSATopKResult,
    candidate_end,
    sampled_positions,
    scan_block_ids,
    scan_table,
    scan_unit,
)
from pallas_kernels.tiling import cdiv


def block_scores(qg: jax.Array, pos: jax.Array, k: jax.Array, v: jax.Array | None, *,
                 block_kv: int, sm_scale: float, chunk: int = 1):
    """Causal attention of arbitrary rows and the score of every key block.

    Args:
      qg: ``[B, R, N, D]`` query rows; pos: int32 ``[R]`` their positions.
      k, v: ``[B, S, K, D]`` (``v`` None: scores and lse only).
      chunk: key blocks per scan step (memory ``B * N * R * chunk * block_kv``).

    Returns (out ``[B, R, N, D]`` f32 or None, lse ``[B, N, R]``, scores ``[B, N, R, nk]``
    f32; -inf for blocks with no visible key, NaN for blocks with a visible non-finite score).
    out / lse follow `pallas_kernels.nonfinite` (a non-finite value poisons the rows that see
    it; it does not change block scores).
    """
    b, r, n, d = qg.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    nk = cdiv(s, block_kv)
    steps = cdiv(nk, chunk)
    width = chunk * block_kv
    qg = jnp.einsum("btkgd->bkgtd", qg.astype(jnp.float32).reshape(b, r, kh, groups, d))
    pad = steps * width - s
    kf = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    vf = vp = None
    if v is not None:
        vp = jnp.pad(value_poison(v), ((0, 0), (0, pad), (0, 0)))  # [B, S', K]: 0 or NaN per key
        vf = jnp.pad(jnp.where(jnp.isnan(value_poison(v))[..., None], 0.0, v.astype(jnp.float32)),
                     ((0, 0), (0, pad), (0, 0), (0, 0)))

    def step(carry, i):
        m, l, acc = carry
        kb = lax.dynamic_slice_in_dim(kf, i * width, width, axis=1)  # [B, W, K, D]
        kpos = i * width + jnp.arange(width)
        sc = jnp.einsum("bkgtd,bckd->bkgtc", qg, kb, precision=lax.Precision.HIGHEST) * sm_scale
        ok = (kpos[None, :] <= pos[:, None]) & (kpos < s)[None, :]  # [R, W]
        zb = score_poison(sc, ok).reshape(sc.shape[:-1] + (chunk, block_kv))
        sc = jnp.where(ok, sc, -jnp.inf).reshape(sc.shape[:-1] + (chunk, block_kv))
        mb = sc.max(-1)  # [B, K, G, R, chunk]
        mb_safe = jnp.where(jnp.isneginf(mb), 0.0, mb)
        pb = jnp.exp(sc - mb_safe[..., None])
        lb = (pb + zb).sum(-1)  # NaN for a block with a visible non-finite score
        score = jnp.where(lb == 0, -jnp.inf, mb_safe + jnp.log(jnp.where(lb == 0, 1.0, lb)))
        m_new = jnp.maximum(m, mb.max(-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        w = jnp.exp(mb_safe - m_safe[..., None])  # [B, K, G, R, chunk]
        l = l * alpha + (lb * w).sum(-1)
        if vf is not None:
            vb = lax.dynamic_slice_in_dim(vf, i * width, width, axis=1)
            vpb = lax.dynamic_slice_in_dim(vp, i * width, width, axis=1)  # [B, W, K]
            l = l + jnp.sum(jnp.where(ok, jnp.einsum("bck->bkc", vpb)[:, :, None, None, :], 0.0), axis=-1)
            pw = (pb * w[..., None]).reshape(pb.shape[:-2] + (width,))
            pv = jnp.einsum("bkgtc,bckd->bkgtd", pw, vb, precision=lax.Precision.HIGHEST)
            acc = acc * alpha[..., None] + pv
        return (m_new, l, acc), score

    shape = (b, kh, groups, r)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + ((d,) if vf is not None else (1,)), jnp.float32))
    (m, l, acc), scores = lax.scan(step, init, jnp.arange(steps))
    out, lse = finish(m, l, acc)
    lse = lse.reshape(b, n, r)
    scores = jnp.einsum("ibkgtc->bkgtic", scores).reshape(b, n, r, steps * chunk)[..., :nk]
    if vf is None:
        return None, lse, scores
    return jnp.einsum("bkgtd->btkgd", out).reshape(b, r, n, d), lse, scores


def sampled_block_scores(q: jax.Array, k: jax.Array, v: jax.Array | None, *, gamma: int,
                         block_kv: int, sm_scale: float):
    """`block_scores` of the sampled rows ``q[:, ::gamma]``: (out ``[B, Tg, N, D]`` or None,
    lse ``[B, N, Tg]``, scores ``[B, N, Tg, nk]``)."""
    pos = sampled_positions(q.shape[1], k.shape[1], gamma)
    return block_scores(q[:, ::gamma], pos, k, v, block_kv=block_kv, sm_scale=sm_scale)


def candidates(tg_pos: jax.Array, nk: int, *, block_kv: int, sink_blocks: int, local: int):
    """(active bool ``[Tg, nk]``, remaining int32 ``[Tg, nk]``) for the scan."""
    lo = candidate_end(tg_pos, block_kv=block_kv, local=local)[:, None]
    j = jnp.arange(nk, dtype=jnp.int32)[None, :]
    return (j >= sink_blocks) & (j < lo), lo - j


def select_blocks(scores: jax.Array, active: jax.Array, remaining: jax.Array, *, algorithm: str,
                  top_k: int, k_exact: int, order: jax.Array | None = None, quantile: str = "histogram"
                  ) -> tuple[jax.Array, jax.Array]:
    """scores ``[..., nk]`` -> (block_score, block_idx) ``[..., top_k]`` (see `QSATopKResult`).

    ``order`` (int32, broadcastable to scores): the block the "estimated" scan offers at each
    step (`common.scan_block_ids`; default id order). ``active`` / ``remaining`` are given per
    step; they are the same functions of the step as of the id in id order (`candidates`).
    ``quantile``: the "estimated" threshold rule (`topk.py`)."""
    lead, nk = scores.shape[:-1], scores.shape[-1]
    active = jnp.broadcast_to(active, scores.shape)
    if algorithm in ("exact", "tournament"):
        masked = jnp.where(active, topk_lib.rank_value(scores), -jnp.inf)
        take = min(top_k, nk)
        vals, ids = lax.top_k(masked, take)
        vals = topk_lib.unrank_value(vals)
        empty = jnp.isneginf(vals)
        vals, ids = jnp.where(empty, -jnp.inf, vals), jnp.where(empty, -1, ids)
        if take < top_k:
            fill = [(0, 0)] * (vals.ndim - 1) + [(0, top_k - take)]
            vals = jnp.pad(vals, fill, constant_values=-jnp.inf)
            ids = jnp.pad(ids, fill, constant_values=-1)
        return vals, ids.astype(jnp.int32)
    rem = jnp.broadcast_to(remaining, scores.shape).reshape(-1, nk)
    block_ids = None
    if order is not None:
        order = jnp.broadcast_to(jnp.asarray(order, jnp.int32), scores.shape)
        scores = jnp.take_along_axis(scores, order, axis=-1)
        block_ids = order.reshape(-1, nk)
    vals, ids = topk_lib.run_scan(algorithm, scores.reshape(-1, nk), active.reshape(-1, nk), rem,
                                  k=top_k, k_exact=k_exact, block_ids=block_ids, quantile=quantile)
    return vals.reshape(lead + (top_k,)), ids.reshape(lead + (top_k,))


@functools.partial(jax.jit, static_argnames=(
    "gamma", "block_kv", "top_k", "k_exact", "topk", "sink_blocks", "local", "sm_scale", "scan",
    "rows", "quantile"))
def qsa_topk_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, gamma: int, block_kv: int,
                       top_k: int, k_exact: int, topk: str, sink_blocks: int, local: int,
                       sm_scale: float, scan: str = "natural", rows: int = 64,
                       quantile: str = "histogram") -> QSATopKResult:
    """See `api.qsa_topk`; inputs are assumed validated. ``scan`` / ``rows``: the scan order
    of the "estimated" top-k and the tile it is defined on (`common.py`)."""
    t, s = q.shape[1], k.shape[1]
    nk = cdiv(s, block_kv)
    out, lse, scores = sampled_block_scores(q, k, v, gamma=gamma, block_kv=block_kv,
                                            sm_scale=sm_scale)
    pos = sampled_positions(t, s, gamma)
    active, remaining = candidates(pos, nk, block_kv=block_kv, sink_blocks=sink_blocks, local=local)
    order = None
    if topk == "estimated" and scan != "natural":
        table = scan_table(t, s, gamma=gamma, block_kv=block_kv, local=local,
                           sink_blocks=sink_blocks, rows=rows, order=scan)
        tiles = scan_block_ids(table, sink_blocks=sink_blocks, n_steps=nk, unit=scan_unit(scan))
        # The barrier keeps XLA from constant-folding the [Tg, nk] gather indices (seconds).
        order = lax.optimization_barrier(jnp.asarray(tiles))[np.arange(cdiv(t, gamma)) // rows]  # [Tg, nk]
    vals, ids = select_blocks(scores, active, remaining, algorithm=topk, top_k=top_k,
                              k_exact=k_exact, order=order, quantile=quantile)
    return QSATopKResult(out.astype(q.dtype), lse, ids, vals)
