"""`candidate_mass`: validation and dispatch to an implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.candidate_mass.mosaic_gpu import candidate_mass_mosaic_gpu, check_supported
from pallas_kernels.candidate_mass.reference import candidate_mass_reference
from pallas_kernels.candidate_mass.triton import candidate_mass_triton
from pallas_kernels.checks import check_int, check_pow2, check_sm_scale, concrete, fmt_shape
from pallas_kernels.mosaic_fa3 import padded_head_dim
from pallas_kernels.platform import default_implementation, is_sm90

IMPLEMENTATIONS = ("reference", "triton", "mosaic_gpu")


def candidate_mass(q: jax.Array, k: jax.Array, candidates: jax.Array, ref_lse: jax.Array, *, query_block: int,
                   block: int, gamma: int, stride: int = 1, sm_scale: float | None = None,
                   implementation: str | None = None, interpret: bool = False, qk_fp8: bool = False,
                   query_blocks: jax.Array | None = None) -> jax.Array:
    """Softmax mass the rows of each query block put on each of its candidate key blocks.

    For query block i, candidate c (key block ``j = candidates[b, h, i, c]``, keys ``[j * block, (j + 1) *
    block)``) and the rows r of the block with ``r % stride == 0``: ``sum_r exp(lse_r(j) - ref_r)``, where
    ``lse_r(j)`` is the log-sum-exp of row r's scaled logits over the block's keys at or before its position
    (queries are the last T of S positions) and ``ref_r = ref_lse[r // gamma]`` the log-sum-exp of its gamma
    group's sampled row over all its keys (MOMO's QSA pass), so each row's term estimates its softmax mass there.

    Args:
      q: ``[B, T, N, D]``; k: ``[B, S, K, D]`` (N a multiple of K); bf16, fp16 or fp32.
      candidates: int32 ``[B, N, ceil(T / query_block), C]`` key-block ids; ids outside ``[0, ceil(S / block))``
        (e.g. -1 for an empty slot) give 0.
      ref_lse: float32 ``[B, N, ceil(T / gamma)]``; a row whose reference is -inf counts nothing.
      query_block, block: powers of two >= 16; gamma: a divisor of query_block; stride: a power of two with
        ``query_block / stride >= 16`` (rows per program).
      implementation: "reference", "triton", "mosaic_gpu" (Hopper; `mosaic_gpu.check_supported` names its limits)
        or None: "mosaic_gpu" on an sm90 GPU where it supports the inputs, else Triton on a GPU or when
        ``interpret``, else the reference.
      qk_fp8: where the Mosaic GPU kernel runs and the head dim pads to 128, the scores come from float8 (e4m3)
        copies of q and k, each head scaled by its largest magnitude (about 0.6% median and 3% largest relative
        error in a mass on random inputs; half the bytes per key block, `mosaic_gpu.candidate_mass_mosaic_gpu`);
        elsewhere it is ignored and the scores keep the inputs' precision.

      query_blocks: None, or int ``[B, N, M]``: list m of (b, h) belongs to query block ``query_blocks[b, h, m]``
        (distinct, in ``[0, nq)``), and ``candidates`` is ``[B, N, M, C]``: only those lists are scored (the Mosaic
        GPU kernel does only their work; elsewhere they are scored as parts of the whole ``[B, N, nq, C]``).

    Returns float32 ``[B, N, nq, C]`` (``[B, N, M, C]`` with ``query_blocks``).
    """
    for name, x, nd in (("q", q, 4), ("k", k, 4), ("candidates", candidates, 4), ("ref_lse", ref_lse, 3)):
        if getattr(x, "ndim", None) != nd:
            raise ValueError(f"{name}: expected a {nd}-D array; received shape {fmt_shape(getattr(x, 'shape', ()))}")
    b, t, n, d = q.shape
    check_pow2("query_block", query_block, 16)
    check_pow2("block", block, 16)
    check_int("gamma", gamma, 1)
    check_pow2("stride", stride, 1)
    if query_block % gamma:
        raise ValueError(f"gamma: expected a divisor of query_block={query_block}; received {gamma}")
    if query_block // stride < 16:
        raise ValueError(f"stride: expected query_block / stride >= 16 rows per program (query_block={query_block}); "
                         f"received {stride}")
    if k.shape[0] != b or k.shape[3] != d or n % k.shape[2]:
        raise ValueError(f"k: expected [B={b}, S, K, D={d}] with N={n} a multiple of K; received {fmt_shape(k.shape)}")
    if q.dtype != k.dtype or jnp.dtype(q.dtype) not in map(jnp.dtype, (jnp.bfloat16, jnp.float16, jnp.float32)):
        raise ValueError(f"q / k: expected one dtype of bfloat16, float16, float32; received {q.dtype} / {k.dtype}")
    nq = -(-t // query_block)
    lists = nq
    if query_blocks is not None:
        m = getattr(query_blocks, "shape", (None,) * 3)[-1]
        if getattr(query_blocks, "ndim", None) != 3 or query_blocks.shape[:2] != (b, n) or not 1 <= m <= nq or \
                not jnp.issubdtype(query_blocks.dtype, jnp.integer):
            raise ValueError(f"query_blocks: expected an integer array [B={b}, N={n}, M] with 1 <= M <= nq={nq}; "
                             f"received {getattr(query_blocks, 'dtype', None)} "
                             f"{fmt_shape(getattr(query_blocks, 'shape', ()))}")
        host = concrete(query_blocks)
        if host is not None:  # concrete: the values too
            _check_query_blocks(host, nq)
        lists = m
    if candidates.shape[:3] != (b, n, lists) or not jnp.issubdtype(candidates.dtype, jnp.integer):
        name = "nq" if query_blocks is None else "M"
        raise ValueError(f"candidates: expected an integer array [B={b}, N={n}, {name}={lists}, C]; received "
                         f"{candidates.dtype} {fmt_shape(candidates.shape)}")
    tg = -(-t // gamma)
    if ref_lse.shape != (b, n, tg):
        raise ValueError(f"ref_lse: expected [B={b}, N={n}, ceil(T / gamma)={tg}]; received {fmt_shape(ref_lse.shape)}")
    scale = check_sm_scale(sm_scale, d)
    if implementation is None:
        implementation = default_implementation(bool(interpret))
        if implementation == "triton" and not interpret and is_sm90():
            try:
                check_supported(q, query_block=query_block, block=block, stride=stride)
                implementation = "mosaic_gpu"
            except ValueError:
                pass
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation: expected one of {IMPLEMENTATIONS} or None; received {implementation!r}")
    kw = dict(query_block=query_block, block=block, stride=stride, gamma=gamma, sm_scale=scale)
    cands = candidates.astype(jnp.int32)
    if query_blocks is not None and implementation != "mosaic_gpu":  # the chosen lists as parts of the whole
        sel = jnp.broadcast_to(jnp.clip(query_blocks.astype(jnp.int32), 0, nq - 1)[..., None], cands.shape)
        whole = jnp.put_along_axis(jnp.full((b, n, nq, cands.shape[-1]), -1, jnp.int32), sel, cands, axis=2,
                                   inplace=False)
        mass = candidate_mass(q, k, whole, ref_lse, implementation=implementation, interpret=interpret, **kw)
        return jnp.take_along_axis(mass, sel, axis=2)
    if implementation == "reference":
        return candidate_mass_reference(q, k, cands, ref_lse, **kw)
    if implementation == "mosaic_gpu":
        if interpret:
            raise ValueError("interpret: expected False for implementation='mosaic_gpu' (Mosaic GPU's interpreter "
                             "cannot run the kernel; use 'triton' or 'reference' on a CPU); received True")
        check_supported(q, query_block=query_block, block=block, stride=stride)
        fp8 = bool(qk_fp8) and padded_head_dim(d) == 128
        return candidate_mass_mosaic_gpu(q, k, cands, ref_lse, qk_fp8=fp8, query_blocks=query_blocks, **kw)
    return candidate_mass_triton(q, k, cands, ref_lse, interpret=interpret, **kw)


def _check_query_blocks(qb: np.ndarray, nq: int) -> None:
    """Concrete ``query_blocks`` ``[B, N, M]``: every value in ``[0, nq)`` and distinct within each (b, h) (a repeat
    would score one query block's list twice and, off the Mosaic kernel, drop the other list it stands for)."""
    bad = np.argwhere((qb < 0) | (qb >= nq))
    if bad.size:
        where = tuple(int(i) for i in bad[0])
        raise ValueError(f"query_blocks: expected values in [0, nq={nq}); received {int(qb[where])} at index "
                         f"{list(where)}")
    srt = np.sort(qb, axis=-1)
    rep = np.argwhere(srt[..., 1:] == srt[..., :-1])
    if rep.size:
        bb, hh, mm = (int(i) for i in rep[0])
        raise ValueError(f"query_blocks: expected distinct query blocks in each (batch, head); received "
                         f"{int(srt[bb, hh, mm])} twice at (batch {bb}, head {hh})")
