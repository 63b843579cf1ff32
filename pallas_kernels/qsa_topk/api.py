"""`qsa_topk`: validation and dispatch to an implementation."""

from __future__ import annotations

import jax

from pallas_kernels import nonfinite
from pallas_kernels.checks import check_int, check_pow2, check_qkv, check_sm_scale
from pallas_kernels.platform import chosen_implementation
from pallas_kernels.qsa_topk.common import SCAN_ORDERS, QSATopKResult
from pallas_kernels.qsa_topk.mosaic_gpu import check_supported as check_mosaic
from pallas_kernels.qsa_topk.mosaic_gpu import qsa_topk_mosaic_gpu
from pallas_kernels.qsa_topk.reference import qsa_topk_reference
from pallas_kernels.qsa_topk.topk import ALGORITHMS, check_quantile
from pallas_kernels.qsa_topk.triton import qsa_topk_triton
from pallas_kernels.tiling import cdiv

IMPLEMENTATIONS = ("reference", "triton", "mosaic_gpu")


def qsa_topk(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    gamma: int = 16,
    block_kv: int = 64,
    top_k: int = 128,
    k_exact: int = 8,
    topk: str = "exact",
    sink_blocks: int = 0,
    local: int = 0,
    scan: str = "natural",
    quantile: str = "histogram",
    sm_scale: float | None = None,
    implementation: str | None = None,
    interpret: bool = False,
    rows: int = 64,
    num_warps: int | None = None,
    num_stages: int | None = None,
    check_finite: bool = False,
) -> QSATopKResult:
    """Query-sparse attention of every gamma-th query with an online top-k of key blocks.

    Args:
      q: ``[B, T, N, D]`` queries, the last T of S positions; bf16, fp16 or fp32.
      k, v: ``[B, S, K, D]``, N % K == 0 (GQA).
      gamma: sample every gamma-th query (query indices ``t ≡ 0 mod gamma``).
      block_kv: key block size beta (a power of two >= 16).
      top_k: blocks kept per sampled row (``1 <= top_k <= ceil(S / block_kv)``). Named
        ``top_k`` because ``k`` is the key array.
      k_exact: exact slots of the "estimated" hybrid (``0 <= k_exact <= top_k``); ignored
        (not checked against top_k) by the other algorithms.
      topk: "exact" | "tournament" | "estimated" (see `topk.py`).
      sink_blocks: leading key blocks forced in (never candidates).
      local: local window in tokens forced in; with the diagonal block, never candidates.
        A row at position p offers blocks ``sink_blocks <= j < max(0, p - local) // block_kv``.
      scan: the order in which the "estimated" top-k is offered the blocks: "natural" (id
        order) or "golden" (per tile of ``rows`` sampled rows, most candidates in a
        golden-ratio order, so the running quantile sees a sample of the whole row early
        instead of the oldest blocks first; see `common.py`) or "golden_pairs" (the same with
        pairs of neighbouring blocks as the unit, so a kernel step can read 128 contiguous keys:
        the Mosaic GPU kernel's 128-key tiles at ``block_kv=64``). Ignored by "exact" and
        "tournament", whose selection does not depend on the order. With the golden orders the
        selection depends on ``rows``; the reference takes the same ``rows``.
      quantile: how the "estimated" top-k sets its acceptance threshold: "histogram" (counts at
        frozen edges; default) or "gaussian" (a normal quantile of the running mean and
        deviation); see `topk.py`. Ignored by "exact" and "tournament".
      sm_scale: a finite float > 0; default ``D ** -0.5``.
      implementation: "reference" | "triton" | "mosaic_gpu" | None (triton on a GPU or when ``interpret``).
        "mosaic_gpu" (Hopper sm90; 1.5x the Triton kernel's speed at 1M tokens on an H100): ``topk="estimated"``,
        bf16 / fp16, D <= 128, ``block_kv`` 64 or 128 (64 with "golden_pairs"), ``k_exact`` a multiple of 8,
        ``rows=128`` (its tile of sampled rows); inputs holding a NaN / inf run the Triton kernel instead (same results, same ``rows``).
        `mmjax.sparse.patterns.Momo` takes it by default on Hopper where its config allows.
      rows, num_warps, num_stages: Triton tile (sampled rows per program; also the tile of
        the "golden" scan order in both implementations) and launch.
      check_finite: raise `NonFiniteError` (under ``jax.jit`` a ``checkify`` error) when q, k
        or v holds a NaN or an inf, instead of propagating it.

    Returns:
      `QSATopKResult` (out_gamma ``[B, Tg, N, D]``, lse_gamma ``[B, N, Tg]``, block_idx and
      block_score ``[B, N, Tg, top_k]``), ``Tg = ceil(T / gamma)``. Non-finite inputs
      (`pallas_kernels.nonfinite`): a sampled row that sees a non-finite score or value has
      NaN out and lse; a candidate block with a visible non-finite score has score NaN and is
      selected before every finite one (as `lax.top_k` ranks NaN).
    """
    check_qkv(q, k, v)
    check_int("gamma", gamma, 1)
    check_pow2("block_kv", block_kv)
    nk = cdiv(k.shape[1], block_kv) if isinstance(block_kv, int) else 0
    check_int("top_k", top_k, 1)
    if top_k > nk:
        raise ValueError(f"top_k: expected top_k <= number of key blocks ceil(S / block_kv) = {nk} "
                         f"(S={k.shape[1]}, block_kv={block_kv}); received {top_k}")
    check_int("k_exact", k_exact, 0)
    if topk == "estimated" and k_exact > top_k:
        raise ValueError(f"k_exact: expected 0 <= k_exact <= top_k={top_k}; received {k_exact}")
    if topk not in ALGORITHMS:
        raise ValueError(f"topk: expected one of {ALGORITHMS}; received {topk!r}")
    check_int("sink_blocks", sink_blocks, 0)
    check_int("local", local, 0)
    check_pow2("rows", rows)
    if scan not in SCAN_ORDERS:
        raise ValueError(f"scan: expected one of {SCAN_ORDERS}; received {scan!r}")
    check_quantile(quantile)
    implementation = chosen_implementation(implementation, interpret, IMPLEMENTATIONS)
    sm_scale = check_sm_scale(sm_scale, q.shape[-1])
    if check_finite:
        nonfinite.check_finite(q=q, k=k, v=v)
    kw = dict(gamma=gamma, block_kv=block_kv, top_k=top_k, k_exact=k_exact, topk=topk,
              sink_blocks=sink_blocks, local=local, sm_scale=sm_scale, scan=scan, rows=rows,
              quantile=quantile)
    if implementation == "mosaic_gpu":
        if interpret:
            raise ValueError("interpret: expected False for implementation='mosaic_gpu' (Mosaic GPU's interpreter "
                             "cannot run the kernel; use implementation='triton' with interpret=True)")
        check_mosaic(q, topk=topk, block_kv=block_kv, k_exact=k_exact, rows=rows, scan=scan)
        kw.pop("topk")
        kw.pop("rows")

        def run(poison):
            if poison:
                return qsa_topk_triton(q, k, v, topk="estimated", rows=rows, poison=True, **kw)
            return qsa_topk_mosaic_gpu(q, k, v, **kw)

        return nonfinite.checked_if_nonfinite(run, q[:, ::gamma], k, v)
    if implementation == "reference":
        return qsa_topk_reference(q, k, v, **kw)
    return qsa_topk_triton(q, k, v, interpret=interpret, num_warps=num_warps,
                           num_stages=num_stages, **kw)
