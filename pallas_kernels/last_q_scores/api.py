"""`last_q_scores`: validation and dispatch to an implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.checks import SUPPORTED_DTYPES, check_sm_scale, concrete, fmt_shape
from pallas_kernels.last_q_scores.reference import last_q_scores_reference
from pallas_kernels.last_q_scores.triton import last_q_scores_triton, rows_fit, scores_block
from pallas_kernels.platform import chosen_implementation

IMPLEMENTATIONS = ("reference", "triton")
# What ``implementation=None`` runs on a GPU: the fused kernel, 1.9-2.2x faster than the XLA form on an H100
# (2026-12-07, 28 / 4 heads, 64 rows: 3.49 -> 1.62 ms at 128k, 26.0 -> 12.6 ms at 1M, `last-q-scores-kernel_*`).
DEFAULT_GPU_IMPLEMENTATION = "triton"


def last_q_scores(q: jax.Array, k: jax.Array, *, last_q: int, sm_scale: float | None = None,
                  rows: jax.Array | None = None, k_valid: jax.Array | None = None, step_heads: int | None = 1,
                  implementation: str | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Vertical and slash scores of the estimation rows (MMInference / MInference's online index estimation).

    A = softmax(Q[rows] K^T * scale + causal mask) per head, reduced to
    * vertical: column sums of A, indexed by key position;
    * slash: sums along diagonals, ``slash[d] = sum_r A[r, pos_r - d]``, indexed by the offset d = query position -
      key position;
    each divided by ``last_q`` (a head's scores sum to 1 over rows that see some key).

    Args:
      q: ``[B, T, N, D]``; k: ``[B, S, K, D]`` (N a multiple of K, T <= S: the queries are the last T of S
        positions); one dtype of bf16, fp16, fp32.
      last_q: number of estimation rows, 1 <= last_q <= T.
      rows: None (the last ``last_q`` queries) or int ``[B, last_q]`` query indices in ``[0, T)`` (chosen rows). The
        kernel takes chosen rows whose indices span at most `triton.scores_block` (64 for up to 64 rows) in every
        batch row; wider ones go through the reference (decided on the device by ``lax.cond`` when ``rows`` is
        traced; an error with ``implementation="triton"`` when it is concrete).
      k_valid: None or bool ``[B, S]``: keys taking part (invalid keys score 0).
      step_heads: the reference's query heads scored per step (None or a divisor of N / K; see
        `reference.last_q_scores_reference`); the kernel ignores it.
      implementation: "reference" (XLA), "triton" (the fused kernel) or None: the reference, or Triton when
        ``interpret`` (`DEFAULT_GPU_IMPLEMENTATION` on a GPU).

    Non-finite inputs: an estimation row whose query holds a NaN or an inf adds nothing (its own attention will be
    NaN anyway); a non-finite logit of any other row makes its key's vertical score +inf, which ranks it first
    (level with a pattern's own forced keys, lower position first, within its budget such as Vertical-Slash's
    vertical_size), so the key is kept and the attention kernel propagates the NaN to exactly the rows that see it.
    Finite logits are normalised among themselves; no score is ever NaN.

    Returns (vertical, slash), each float32 ``[B, N, S]``.
    """
    for name, x in (("q", q), ("k", k)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name}: expected a 4-D array; received shape {fmt_shape(getattr(x, 'shape', ()))}")
    b, t, n, d = q.shape
    s = k.shape[1]
    if k.shape[0] != b or k.shape[3] != d or n % k.shape[2] or s < t:
        raise ValueError(f"k: expected [B={b}, S >= T={t}, K, D={d}] with N={n} a multiple of K; received "
                         f"{fmt_shape(k.shape)}")
    if q.dtype != k.dtype or jnp.dtype(q.dtype) not in map(jnp.dtype, SUPPORTED_DTYPES):
        raise ValueError(f"q / k: expected one dtype of bfloat16, float16, float32; received {q.dtype} / {k.dtype}")
    if not isinstance(last_q, int) or isinstance(last_q, bool) or not 1 <= last_q <= t:
        raise ValueError(f"last_q: expected an int with 1 <= last_q <= T={t}; received {last_q!r}")
    if rows is not None and (tuple(getattr(rows, "shape", ())) != (b, last_q)
                             or not jnp.issubdtype(rows.dtype, jnp.integer)):
        raise ValueError(f"rows: expected an integer array of shape [{b}, {last_q}] ([B, last_q]); received "
                         f"{getattr(rows, 'dtype', None)} {fmt_shape(getattr(rows, 'shape', ()))}")
    if k_valid is not None and (tuple(getattr(k_valid, "shape", ())) != (b, s) or k_valid.dtype != jnp.bool_):
        raise ValueError(f"k_valid: expected a bool array of shape [{b}, {s}] ([B, S]); received "
                         f"{getattr(k_valid, 'dtype', None)} {fmt_shape(getattr(k_valid, 'shape', ()))}")
    groups = n // k.shape[2]
    if step_heads is not None and (not isinstance(step_heads, int) or step_heads < 1 or groups % step_heads):
        raise ValueError(f"step_heads: expected None or a divisor of N / K = {groups}; received {step_heads!r}")
    scale = check_sm_scale(sm_scale, d)
    host = None if rows is None else concrete(rows)
    if host is not None and ((host < 0) | (host >= t)).any():
        raise ValueError(f"rows: expected query indices in [0, T={t}); received values in "
                         f"[{int(host.min())}, {int(host.max())}]")
    named = implementation  # None: chosen rows the kernel cannot take fall back instead of raising
    implementation = chosen_implementation(implementation, interpret, IMPLEMENTATIONS, DEFAULT_GPU_IMPLEMENTATION)

    def reference():
        return last_q_scores_reference(q, k, last_q=last_q, sm_scale=scale, rows=rows, k_valid=k_valid,
                                       step_heads=step_heads)

    def kernel():
        return last_q_scores_triton(q, k, last_q=last_q, sm_scale=scale, rows=rows, k_valid=k_valid,
                                    interpret=bool(interpret))

    if implementation == "reference" or rows is None:
        return reference() if implementation == "reference" else kernel()
    block = scores_block(last_q)
    if host is not None:  # concrete rows: decided here
        span = int((host.max(axis=1) - host.min(axis=1)).max())
        if span <= block:
            return kernel()
        if named == "triton":
            raise ValueError(f"rows: expected indices spanning at most {block} positions in each batch row for "
                             f"implementation='triton' (the kernel's diagonal scratch); received a span of {span}")
        return reference()
    return jax.lax.cond(rows_fit(rows, block), kernel, reference)
