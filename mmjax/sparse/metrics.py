"""MOMO metrics: attention mass a layout captures vs the oracle block top-k (MOMO Fig. 2e),
sparsity (Eq. 9), and the mean-pooled block selection MOMO is compared with.

All mass metrics evaluate a set of query rows (indices into q) against every key, in
chunks of key blocks, so they run at 1M tokens on a GPU for a few hundred rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.sparse.patterns.momo import assemble_layout, window_start
from pallas_kernels import BlockLayout
from pallas_kernels.block_sparse.layout import causal_pairs
from pallas_kernels.qsa_topk.reference import block_scores
from pallas_kernels.tiling import cdiv


def block_mass(q: jax.Array, k: jax.Array, rows: jax.Array, *, block: int,
               sm_scale: float | None = None, chunk: int = 16) -> jax.Array:
    """Softmax mass of every key block for the query rows ``rows`` (int ``[R]``).

    q ``[B, T, N, D]``, k ``[B, S, K, D]`` -> float32 ``[B, N, R, nk]`` (rows sum to 1 over
    causal blocks; 0 for blocks after the row)."""
    t, s = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    rows = jnp.asarray(rows, jnp.int32)
    _, lse, scores = block_scores(q[:, rows], rows + (s - t), k, None, block_kv=block,
                                  sm_scale=scale, chunk=chunk)
    return jnp.exp(scores - lse[..., None])


def _row_blocks(layout: BlockLayout, rows: jax.Array, batch: int, heads: int) -> jax.Array:
    """bool ``[B, N, R, nk]``: blocks the layout computes for each row's query block."""
    if layout.kv_windows:
        raise ValueError("layout: expected a layout of key-block ids (captured_mass counts whole key blocks); "
                         "received one with kv_windows=True (measure it with mmjax.attention_recall)")
    nk = layout.num_kv_blocks
    blocks = layout.kv_blocks
    count = layout.kv_block_count
    qb = rows // layout.block_q

    def per_row(x):  # lead dims and the query-block dim may broadcast
        x = jnp.broadcast_to(x, (batch, heads) + x.shape[2:])
        return x[:, :, qb] if x.shape[2] > 1 else jnp.repeat(x, rows.shape[0], axis=2)

    blocks, count = per_row(blocks), per_row(count)  # [B, N, R, mb], [B, N, R]
    valid = jnp.arange(blocks.shape[-1]) < count[..., None]
    ids = jnp.where(valid, blocks, nk)
    # A scatter per row, not a one-hot sum: [B, N, R, mb, nk] int32 was 58 GiB at 1M tokens
    # (28 heads, 256 rows, 133 blocks per row, 16k key blocks) and ran an 80 GB GPU out of memory.
    flat = ids.reshape(-1, ids.shape[-1])
    rows_idx = jnp.arange(flat.shape[0])[:, None]
    marks = jnp.zeros((flat.shape[0], nk + 1), bool).at[rows_idx, flat].set(True)
    return marks[:, :nk].reshape(ids.shape[:-1] + (nk,))


def captured_mass(mass: jax.Array, layout: BlockLayout, rows: jax.Array) -> dict[str, jax.Array]:
    """Mass the layout captures vs two oracles with as many blocks as the layout computes
    (causal blocks only) for each row:

    * "oracle" (per row): every row keeps its own best blocks. No layout with one block
      list per query block reaches it when the rows of a query block prefer different
      blocks; it is the upper bound of the MOMO paper's Fig. 2e;
    * "oracle_block" (per query block): the rows of ``rows`` that share a query block keep
      the blocks with the most mass summed over those rows (the best shared list), each row
      as many as its own count. With whole query blocks in ``rows`` this is the best any
      block layout with the layout's counts can do; with one row per block it equals
      "oracle".

    Args:
      mass: ``[B, N, R, nk]`` from `block_mass` (same block size as ``layout.block_k``).
      rows: the query rows ``[R]`` mass was computed for.

    Returns dict of float32 ``[B, N]`` means over rows: "captured", "oracle", "ratio"
    (captured / oracle), "oracle_block", "ratio_block" and "blocks" (mean blocks per row).
    """
    b, n, r, nk = mass.shape
    rows = jnp.asarray(rows, jnp.int32)
    chosen = _row_blocks(layout, rows, b, n)
    pos = rows + layout.q_offset
    causal = (jnp.arange(nk) * layout.block_k <= pos[:, None])[None, None]
    chosen = chosen & causal
    captured = jnp.where(chosen, mass, 0.0).sum(-1)
    count = chosen.sum(-1)
    ranked = -jnp.sort(-mass, axis=-1)
    cum = jnp.cumsum(ranked, axis=-1)
    oracle = jnp.take_along_axis(cum, jnp.maximum(count - 1, 0)[..., None], -1)[..., 0]
    oracle = jnp.where(count > 0, oracle, 0.0)
    oracle_block = _shared_list_oracle(mass, rows // layout.block_q, count)
    return {
        "captured": captured.mean(-1),
        "oracle": oracle.mean(-1),
        "ratio": captured.mean(-1) / jnp.maximum(oracle.mean(-1), 1e-30),
        "oracle_block": oracle_block.mean(-1),
        "ratio_block": captured.mean(-1) / jnp.maximum(oracle_block.mean(-1), 1e-30),
        "blocks": count.astype(jnp.float32).mean(-1),
    }


def _shared_list_oracle(mass: jax.Array, group: jax.Array, count: jax.Array) -> jax.Array:
    """Per row ``[B, N, R]``: the mass it keeps when the rows with equal ``group`` (int
    ``[R]``, the query block) share one ranking of blocks by their summed mass and each row
    keeps the first ``count`` (``[B, N, R]``) of that ranking."""
    same = group[:, None] == group[None, :]  # [R, R]
    summed = jnp.einsum("rs,bnsk->bnrk", same.astype(mass.dtype), mass)
    order = jnp.argsort(-summed, axis=-1)
    ranked = jnp.take_along_axis(mass, order, axis=-1)
    cum = jnp.cumsum(ranked, axis=-1)
    kept = jnp.take_along_axis(cum, jnp.maximum(count - 1, 0)[..., None], -1)[..., 0]
    return jnp.where(count > 0, kept, 0.0)


def momo_sparsity(layout: BlockLayout, gamma: int) -> jax.Array:
    """Sparsity as we read MOMO Eq. 9: ``1 - (pairs of the key-sparse pass + pairs of the
    query-sparse pass) / causal pairs``, per (batch, head) ``[B|1, N|1]``. The QSA pass
    computes every causal key for the ``ceil(T / gamma)`` sampled rows."""
    t, s = layout.q_len, layout.kv_len
    pos = np.arange(0, t, gamma) + s - t
    qsa = float((pos + 1).sum())
    total = causal_pairs(t, s)
    return 1.0 - (layout.density() * total + qsa) / total


def mean_pooled_layout(q: jax.Array, k: jax.Array, *, query_block: int, block: int, k_trim: int,
                       sink_blocks: int, local: int, sm_scale: float | None = None) -> BlockLayout:
    """Baseline block selection: score(c, j) = mean-pooled q of query block c . mean-pooled
    k of key block j, keep the k_trim best candidates (the blocks before the query block's
    local window, after the sink) plus the same forced blocks as MOMO. One head at a time,
    so an nq x nk score matrix of one head is the largest temporary."""
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    scale = d ** -0.5 if sm_scale is None else sm_scale
    nq, nk = cdiv(t, query_block), cdiv(s, block)

    def pool(x, size, blocks):
        """[B, L, H, D] -> [B, blocks, H, D] means over each block's real rows."""
        length = x.shape[1]
        x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, blocks * size - length), (0, 0), (0, 0)))
        summed = x.reshape(x.shape[0], blocks, size, x.shape[2], x.shape[3]).sum(2)
        counts = jnp.minimum(size, length - jnp.arange(blocks) * size).astype(jnp.float32)
        return summed / counts[None, :, None, None]

    qp = pool(q, query_block, nq)  # [B, nq, N, D]
    kp = pool(k, block, nk)  # [B, nk, K, D]
    lo = jnp.asarray(window_start(t, s, query_block=query_block, block=block, local=local))
    j = jnp.arange(nk)
    cand = (j[None, :] >= sink_blocks) & (j[None, :] < lo[:, None])  # [nq, nk]
    take = min(k_trim, nk)

    def head(h):
        sc = jnp.einsum("bqd,bkd->bqk", qp[:, :, h], kp[:, :, h // groups]) * scale
        sc = jnp.where(cand[None], sc, -jnp.inf)
        vals, ids = jax.lax.top_k(sc, take)
        return jnp.where(jnp.isneginf(vals), -1, ids).astype(jnp.int32)

    ids = jax.lax.map(head, jnp.arange(n))  # [N, B, nq, take]
    ids = jnp.einsum("nbqk->bnqk", ids)
    return assemble_layout(ids, q_len=t, kv_len=s, query_block=query_block, block=block,
                           sink_blocks=sink_blocks, local=local)


# ------------------------------------------------------- oracle block masks (patterns)
def block_mass_matrix(q: jax.Array, k: jax.Array, *, block_q: int, block_k: int,
                      sm_scale: float | None = None) -> jax.Array:
    """Causal softmax mass of every (query block, key block) tile, summed over the tile's
    rows: float32 ``[B, N, nq, nk]`` (each query block's row sums to its row count). One
    query block at a time (``block_q x S`` scores per head), so it runs at 64k tokens on a
    CPU; the reference for recall-vs-density oracles."""
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    nq, nk = cdiv(t, block_q), cdiv(s, block_k)
    scale = d ** -0.5 if sm_scale is None else sm_scale
    qp = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, nq * block_q - t), (0, 0), (0, 0)))
    kf = jnp.repeat(k.astype(jnp.float32), n // kh, axis=2)
    k_pos = jnp.arange(s)

    def one(i):
        qb = jax.lax.dynamic_slice_in_dim(qp, i * block_q, block_q, axis=1)  # [B, bq, N, D]
        pos = i * block_q + jnp.arange(block_q) + (s - t)
        sc = jnp.einsum("bqnd,bsnd->bnqs", qb, kf, precision=jax.lax.Precision.HIGHEST) * scale
        ok = (k_pos[None, :] <= pos[:, None]) & (pos[:, None] < s)
        sc = jnp.where(ok, sc, -jnp.inf)
        m = sc.max(-1, keepdims=True)
        p = jnp.exp(sc - jnp.where(jnp.isfinite(m), m, 0.0))
        p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
        p = jnp.pad(p.sum(2), ((0, 0), (0, 0), (0, nk * block_k - s)))
        return p.reshape(b, n, nk, block_k).sum(-1)  # [B, N, nk]

    out = jax.lax.map(one, jnp.arange(nq))  # [nq, B, N, nk]
    return jnp.einsum("qbnk->bnqk", out)


def oracle_recall(mass: jax.Array, density: jax.Array, *, q_len: int, kv_len: int, block_q: int,
                  block_k: int) -> jax.Array:
    """Recall of the best block mask (original order) that computes at most ``density`` of
    the causal pairs, counting whole tiles as `BlockLayout.density` does.

    mass: ``[B, N, nq, nk]`` from `block_mass_matrix`; density: ``[B|1, N|1]`` or a float.
    Returns float32 ``[B, N]``: mass kept / rows. Tiles are taken by mass per pair (all
    causal tiles of one shape cost the same, edge tiles less), greedily."""
    b, n, nq, nk = mass.shape
    rows = jnp.minimum(block_q, q_len - jnp.arange(nq) * block_q).astype(jnp.float32)
    cols = jnp.minimum(block_k, kv_len - jnp.arange(nk) * block_k).astype(jnp.float32)
    cost = (rows[:, None] * cols[None, :]).ravel()  # [nq * nk]
    per_pair = (mass.reshape(b, n, -1) / cost)
    order = jnp.argsort(-per_pair, axis=-1)
    spent = jnp.cumsum(cost[order], axis=-1)
    kept = jnp.cumsum(jnp.take_along_axis(mass.reshape(b, n, -1), order, -1), axis=-1)
    budget = jnp.broadcast_to(jnp.asarray(density, jnp.float32), (b, n))[..., None] * causal_pairs(q_len, kv_len)
    take = (spent <= budget + 1e-3).sum(-1)  # tiles that fit
    got = jnp.take_along_axis(kept, jnp.maximum(take - 1, 0)[..., None], -1)[..., 0]
    return jnp.where(take > 0, got, 0.0) / q_len
