"""`last_q_scores` in plain JAX (XLA): the reference of the Triton kernel, the CPU path and the path for chosen rows
spread wider than the kernel takes.

A = softmax(Q[rows] K^T * scale + causal mask) per head is reduced to
* vertical scores: column sums of A, ``[B, N, S]``;
* slash scores: sums along diagonals, ``slash[d] = sum_r A[r, pos_r - d]`` for the offset
  d = query position - key position, ``[B, N, S]``.
A is last_q x S and lives for a few heads of one key / value head at a time (`lax.map` over the key / value heads,
each sliced out once, and within one over its query heads, one a step by default or as many as fit `STEP_BYTES`),
so no S x S buffer is ever formed; it is written to memory and read back by each reduction, which the kernel avoids.
Non-finite inputs: see `pallas_kernels.last_q_scores.api`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.checks import check_int

# float32 scores [B, heads, last_q, S] of one step of `last_q_scores_reference` with ``step_heads=None`` (several
# query heads of one key / value head at once while they fit: all 7 of a group at 128k, one at a time from 512k with
# 64 rows)
STEP_BYTES = 256 << 20


def heads_per_step(b: int, last_q: int, s: int, groups: int, budget: int = STEP_BYTES) -> int:
    """The most query heads of one GQA group (a divisor of ``groups``) whose float32 scores ``[B, heads, last_q, S]``
    fit ``budget`` bytes; at least 1. All arguments are ints >= 1."""
    for name, value in (("b", b), ("last_q", last_q), ("s", s), ("groups", groups)):
        check_int(name, value, 1)
    check_int("budget", budget, 1, 1 << 62)
    fit = max(1, budget // (4 * b * last_q * s))
    return max(h for h in range(1, groups + 1) if groups % h == 0 and h <= fit)


def diagonal_sums(a: jax.Array) -> jax.Array:
    """a ``[..., L, S]``, row r the query at position S - L + r (the last L of S) -> ``[..., S]``: entry d the sum
    over rows of ``a[r, S - L + r - d]`` (0 where that key index is below 0). No gather: each row padded in front by
    L - 1 zeros, the rows laid end to end and read back with one more element a row, so row r moves r places and
    every diagonal of ``a`` becomes a column; then a column sum, reversed."""
    lq, s = a.shape[-2:]
    lead = [(0, 0)] * (a.ndim - 2)
    width = s + lq - 1
    flat = jnp.pad(a, lead + [(0, 0), (lq - 1, 0)]).reshape(a.shape[:-2] + (lq * width,))
    skewed = jnp.pad(flat, lead + [(0, lq)]).reshape(a.shape[:-2] + (lq, width + 1))[..., :s]
    return skewed.sum(-2)[..., ::-1]


@functools.partial(jax.jit, static_argnames=("last_q", "sm_scale", "step_heads"))
def last_q_scores_reference(q: jax.Array, k: jax.Array, *, last_q: int, sm_scale: float, rows: jax.Array | None = None,
                            k_valid: jax.Array | None = None, step_heads: int | None = 1
                            ) -> tuple[jax.Array, jax.Array]:
    """Shapes and meaning as in `pallas_kernels.last_q_scores.api.last_q_scores`; inputs assumed validated.

    step_heads: query heads of one key / value head scored together (a divisor of N / K; None: `heads_per_step`, the
    most whose scores fit `STEP_BYTES`): one matmul for them. Default 1: on an H100 (2026-12-07, 28 / 4 heads, 128k)
    one head a step took 3.60 ms against 4.53 with the 7 of a group (XLA transposes their scores); the key head is
    sliced out once per key head either way.
    """
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    consecutive = rows is None  # the last queries: slash sums along diagonals without a gather (`diagonal_sums`)
    if rows is None:
        rows = jnp.broadcast_to(jnp.arange(t - last_q, t, dtype=jnp.int32), (b, last_q))
    groups = n // kh
    hs = heads_per_step(b, last_q, s, groups) if step_heads is None else step_heads
    chunks = groups // hs
    q_last = jnp.take_along_axis(q, rows[:, :, None, None], axis=1)  # [B, L, N, D]
    q_ok = jnp.all(jnp.isfinite(q_last), axis=-1)  # [B, L, N]: rows with a finite query
    # [B, K, chunks, hs, L, D]: each step's query heads in front of their rows, so that its logits come out of one
    # matmul as [B, hs * L, S], already in the [B, hs, L, S] order the reductions read (no transpose of the scores)
    q_steps = jnp.moveaxis(q_last.reshape(b, last_q, kh, chunks, hs, d), 1, 4)
    ok_steps = jnp.moveaxis(q_ok.reshape(b, last_q, kh, chunks, hs), 1, 4)  # [B, K, chunks, hs, L]
    q_pos = rows + (s - t)  # original positions of the estimation rows, [B, L]
    k_pos = jnp.arange(s)
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, L, S]
    if k_valid is not None:
        allowed = allowed & k_valid[:, None, :]
    if not consecutive:
        diag_idx = q_pos[:, :, None] - k_pos[None, None, :]  # [B, L, S]: key index for offset d = column

    def one_step(qh, ok, kk):
        """qh ``[B, hs, L, D]``, ok ``[B, hs, L]``, kk ``[B, S, D]`` -> (vertical, slash) ``[B, hs, S]``."""
        logits = jnp.einsum("bmd,bsd->bms", qh.reshape(b, hs * last_q, d), kk,
                            preferred_element_type=jnp.float32).reshape(b, hs, last_q, s) * sm_scale
        seen = allowed[:, None] & ok[..., None]  # [B, hs, L, S]
        bad = seen & ~jnp.isfinite(logits)  # a finite query meets a non-finite key
        logits = jnp.where(seen & ~bad, logits, -jnp.inf)
        m = logits.max(-1, keepdims=True)
        e = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
        a = e / jnp.maximum(e.sum(-1, keepdims=True), 1e-30)  # [B, hs, L, S]; 0 for empty rows
        vertical = jnp.where(bad.any(2), jnp.inf, a.sum(2))
        # slash[d] = sum_r a[r, pos_r - d]; indices < 0 are outside the sequence.
        if consecutive:
            slash = diagonal_sums(a)
        else:
            gathered = jnp.take_along_axis(a, jnp.clip(diag_idx, 0, s - 1)[:, None], axis=-1)
            slash = jnp.where(diag_idx[:, None] >= 0, gathered, 0.0).sum(2)
        return vertical / last_q, slash / last_q  # [B, hs, S]

    def one_key_head(j):  # its key head sliced out once, then its query heads hs at a time
        kk = jax.lax.dynamic_index_in_dim(k, j, axis=2, keepdims=False)  # [B, S, D]
        qj = jax.lax.dynamic_index_in_dim(q_steps, j, axis=1, keepdims=False)  # [B, chunks, hs, L, D]
        okj = jax.lax.dynamic_index_in_dim(ok_steps, j, axis=1, keepdims=False)
        return jax.lax.map(lambda c: one_step(jax.lax.dynamic_index_in_dim(qj, c, axis=1, keepdims=False),
                                              jax.lax.dynamic_index_in_dim(okj, c, axis=1, keepdims=False), kk),
                           jnp.arange(chunks))  # [chunks, B, hs, S]

    vertical, slash = jax.lax.map(one_key_head, jnp.arange(kh))  # [K, chunks, B, hs, S]
    return (jnp.einsum("jcbhs->bjchs", vertical).reshape(b, n, s), jnp.einsum("jcbhs->bjchs", slash).reshape(b, n, s))
