"""Exact combination of partial attention results over disjoint key sets."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _combine(outs: list[jax.Array], lses: list[jax.Array], dtype) -> tuple[jax.Array, jax.Array]:
    """The lse-weighted sum of partial outputs ``[B,T,N,D]`` with lses float32 ``[B,N,T]`` (rules of
    `merge_attention`)."""
    lses = [x.astype(jnp.float32) for x in lses]
    m = lses[0]
    for x in lses[1:]:
        m = jnp.maximum(m, x)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    ws = [jnp.exp(x - m_safe) for x in lses]
    total = ws[0]
    for w in ws[1:]:
        total = total + w
    empty = total == 0.0  # NaN weights are not empty: they propagate
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))
    inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))
    out = None
    for w, o in zip(ws, outs, strict=True):
        w = jnp.einsum("bnt->btn", w * inv)[..., None]
        term = jnp.where(w == 0.0, 0.0, w * o.astype(jnp.float32))
        out = term if out is None else out + term
    return out.astype(dtype), lse


def merge_attention(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Merge softmax-normalised partial outputs by their log-sum-exps.

    out_a/out_b ``[B,T,N,D]``, lse_a/lse_b float32 ``[B,N,T]`` (``-inf`` for rows with no
    keys) -> (out ``[B,T,N,D]`` in out_a's dtype, lse ``[B,N,T]`` float32). A row empty in
    both inputs stays out = 0, lse = -inf; an empty part (lse -inf) contributes nothing
    whatever its out holds; a NaN lse in either part gives NaN out and NaN lse
    (`pallas_kernels.nonfinite`).
    """
    for name, x, rank in (("out_a", out_a, 4), ("lse_a", lse_a, 3), ("out_b", out_b, 4), ("lse_b", lse_b, 3)):
        if getattr(x, "ndim", None) != rank:
            raise ValueError(f"{name}: expected rank {rank}; received shape {getattr(x, 'shape', None)}")
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_b: expected shape {out_a.shape} (of out_a); received {out_b.shape}")
    b, t, n, _ = out_a.shape
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.shape != (b, n, t):
            raise ValueError(f"{name}: expected shape {(b, n, t)} ([B, N, T] from out_a); received {x.shape}")
    return _combine([out_a, out_b], [lse_a, lse_b], out_a.dtype)


def merge_attention_all(outs, lses) -> tuple[jax.Array, jax.Array]:
    """`merge_attention` of any number of partial results in one pass: outs, a sequence of ``[B,T,N,D]`` (one
    shape), lses, a sequence of float32 ``[B,N,T]`` as long -> (out ``[B,T,N,D]`` in ``outs[0]``'s dtype, lse
    ``[B,N,T]`` float32). k parts are read once and one result written, where k - 1 pairwise merges read and write
    k - 1 whole results (and round to the out dtype between them); every part's output is held until the merge.
    One part is returned as it is (lse in float32)."""
    outs, lses = list(outs), list(lses)
    if not outs or len(lses) != len(outs):
        raise ValueError(f"outs, lses: expected two sequences of one length >= 1; received {len(outs)} and "
                         f"{len(lses)}")
    for i, (o, x) in enumerate(zip(outs, lses)):
        if getattr(o, "ndim", None) != 4 or o.shape != outs[0].shape:
            raise ValueError(f"outs[{i}]: expected shape {getattr(outs[0], 'shape', None)} ([B,T,N,D], as outs[0]); "
                             f"received {getattr(o, 'shape', None)}")
        b, t, n, _ = o.shape
        if getattr(x, "shape", None) != (b, n, t):
            raise ValueError(f"lses[{i}]: expected shape {(b, n, t)} ([B, N, T] from outs[{i}]); received "
                             f"{getattr(x, 'shape', None)}")
    if len(outs) == 1:
        return outs[0], lses[0].astype(jnp.float32)
    return _combine(outs, lses, outs[0].dtype)


def merge_chunks(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`merge_attention` over C parts at once: out ``[B, C, T, N, D]``, lse float32 ``[B, N, C, T]`` (part c: the
    same T rows over the c-th of C disjoint key sets) -> (out ``[B, T, N, D]`` in out's dtype, lse ``[B, N, T]``)."""
    if out.ndim != 5 or lse.ndim != 4 or lse.shape != (out.shape[0], out.shape[3], out.shape[1], out.shape[2]):
        raise ValueError(f"out, lse: expected [B, C, T, N, D] and [B, N, C, T]; received {out.shape} and {lse.shape}")
    c = out.shape[1]
    return _combine([out[:, i] for i in range(c)], [lse[:, :, i] for i in range(c)], out.dtype)


def _check_rows(rows, out_rows, lse_rows) -> None:
    """rows int ``[B|1, N|1, R]``, out_rows ``[B, R, N, D]``, lse_rows ``[B, N, R]`` (raised before any indexing)."""
    if getattr(out_rows, "ndim", None) != 4:
        raise ValueError(f"out_rows: expected [B, R, N, D]; received shape {getattr(out_rows, 'shape', None)}")
    b, r, n, _ = out_rows.shape
    if getattr(lse_rows, "shape", None) != (b, n, r):
        raise ValueError(f"lse_rows: expected shape {(b, n, r)} ([B, N, R] from out_rows); received "
                         f"{getattr(lse_rows, 'shape', None)}")
    shape = getattr(rows, "shape", None)
    if (shape is None or len(shape) != 3 or shape[0] not in (1, b) or shape[1] not in (1, n) or shape[2] != r
            or not jnp.issubdtype(rows.dtype, jnp.integer)):
        raise ValueError(f"rows: expected an int array [{b}|1, {n}|1, {r}]; received "
                         f"{getattr(rows, 'dtype', type(rows).__name__)}{list(shape) if shape else ''}")


def _row_index(rows: jax.Array, b: int, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(batch, row, head) index arrays ``[B, R, N]`` of rows ``[B|1, N|1, R]``."""
    r = rows.shape[-1]
    rows_t = jnp.einsum("bnr->brn", jnp.broadcast_to(rows, (b, n, r)))
    return jnp.arange(b)[:, None, None], rows_t, jnp.arange(n)[None, None, :]


def scatter_rows(rows: jax.Array, out_rows: jax.Array, lse_rows: jax.Array, t: int) -> tuple[jax.Array, jax.Array]:
    """Attention of some rows as a whole result: rows int32 ``[B|1, N|1, R]`` (query indices; ``t`` or more: none),
    out_rows ``[B, R, N, D]``, lse_rows ``[B, N, R]`` -> out ``[B, t, N, D]`` (0 on the other rows), lse ``[B, N, t]``
    (-inf there)."""
    _check_rows(rows, out_rows, lse_rows)
    b, _, n, d = out_rows.shape
    bi, ri, ni = _row_index(rows, b, n)
    out = jnp.zeros((b, t, n, d), out_rows.dtype).at[bi, ri, ni].set(out_rows, mode="drop")
    lse = jnp.full((b, n, t), -jnp.inf, jnp.float32).at[bi, ni, ri].set(
        jnp.einsum("bnr->brn", lse_rows.astype(jnp.float32)), mode="drop")
    return out, lse


def gather_rows(out: jax.Array, lse: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """out ``[B, T, N, D]``, lse ``[B, N, T]`` at rows ``[B|1, N|1, R]`` (indices clamped into ``[0, T)``) ->
    ``[B, R, N, D]``, ``[B, N, R]``."""
    b, t, n, _ = out.shape
    bi, ri, ni = _row_index(jnp.clip(rows, 0, t - 1), b, n)
    return out[bi, ri, ni], jnp.einsum("brn->bnr", lse[bi, ni, ri])


def merge_rows(out: jax.Array, lse: jax.Array, rows: jax.Array, out_rows: jax.Array, lse_rows: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """`merge_attention` of a result over all rows (out ``[B, T, N, D]``, lse ``[B, N, T]``) with one over some rows
    (rows int32 ``[B|1, N|1, R]``, distinct per (batch, head); indices ``>= T`` are dropped; out_rows ``[B, R, N,
    D]``, lse_rows ``[B, N, R]``): only those rows are read and written."""
    _check_rows(rows, out_rows, lse_rows)
    if out_rows.shape[0] != out.shape[0] or out_rows.shape[2:] != out.shape[2:]:
        raise ValueError(f"out_rows: expected [B, R, N, D] with B, N, D of out {list(out.shape)}; received "
                         f"{list(out_rows.shape)}")
    b, t, n, _ = out.shape
    o_old, l_old = gather_rows(out, lse, rows)
    o_new, l_new = merge_attention(o_old, l_old, out_rows.astype(out.dtype), lse_rows)
    # The merged rows are computed before, not inside, the scatter's fusion: XLA on the GPU scatters into the
    # operand's buffer only if nothing else in that fusion reads it, so a gather of out fused there (as when out is
    # a kernel's output, which no fusion can take the gather into) costs a copy of the whole out.
    o_new, l_new = jax.lax.optimization_barrier((o_new, l_new))
    bi, ri, ni = _row_index(rows, b, n)
    return (out.at[bi, ri, ni].set(o_new, mode="drop"),
            lse.at[bi, ni, ri].set(jnp.einsum("bnr->brn", l_new), mode="drop"))


def merge_onto(prior, results, row_mask=None):
    """Results over disjoint key sets merged onto a prior one, on the rows of ``row_mask`` alone: prior None or (out
    ``[B, T, N, D]``, lse float32 ``[B, N, T]``); results a sequence of such (out, lse); row_mask None (every row) or
    bool ``[B, T]``: the other rows keep the prior as it is (out 0 / lse -inf without one), whatever the results hold
    there -> (out in the first out's dtype, lse float32), or None when there is nothing to merge. One pass
    (`merge_attention_all`) over the prior and the results' lses set to -inf off the mask."""
    results = list(results)
    if row_mask is not None:
        own = row_mask[:, None, :]
        results = [(o, jnp.where(own, x.astype(jnp.float32), -jnp.inf)) for o, x in results]
    merged = ([] if prior is None else [tuple(prior)]) + results
    if not merged:
        return None
    if len(merged) == 1 and prior is None and row_mask is not None:  # the empty result off the mask
        o, x = merged[0]
        return jnp.where(row_mask[:, :, None, None], o, jnp.zeros((), o.dtype)), x
    return merge_attention_all(*zip(*merged))
