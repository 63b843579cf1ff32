"""Shared test helpers: random inputs, masked dense attention, random layouts, lowering for CUDA on a CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import BlockLayout, block_sparse_attention


def random_qkv(seed: int, b: int, t: int, s: int, n: int, kh: int, d: int, dtype=jnp.float32):
    """Fresh normal inputs (never zeros): q [B,T,N,D], k/v [B,S,K,D]."""
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (b, t, n, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, kh, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, kh, d), jnp.float32).astype(dtype)
    return q, k, v


def masked_dense_attention(q, k, v, mask, sm_scale=None):
    """Float64-free dense reference on an explicit bool mask [B|1,N|1,T,S] (original order).

    Returns out [B,T,N,D] float32 and lse [B,N,T] (rows with no key: 0 and -inf)."""
    b, t, n, d = q.shape
    groups = n // k.shape[2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    kk = jnp.repeat(k.astype(jnp.float32), groups, axis=2)
    vv = jnp.repeat(v.astype(jnp.float32), groups, axis=2)
    s = jnp.einsum("btnd,bsnd->bnts", q.astype(jnp.float32), kk,
                   precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(mask, s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)
    l = p.sum(-1, keepdims=True)
    out = jnp.einsum("bnts,bsnd->btnd", p / jnp.where(l > 0, l, 1.0), vv,
                     precision=jax.lax.Precision.HIGHEST)
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)), -jnp.inf)
    return out, lse


def random_layout(rng: np.random.Generator, b, n, t, s, bq, bk, *, density=0.4, empty_rows=True,
                  perm=False, columns=0, lead_b=None, lead_n=None) -> BlockLayout:
    """Random layout with optional empty query blocks, permutations and single columns."""
    lb = b if lead_b is None else lead_b
    ln = n if lead_n is None else lead_n
    nq, nk = -(-t // bq), -(-s // bk)
    mask = rng.random((lb, ln, nq, nk)) < density
    if empty_rows and nq > 1:
        mask[..., rng.integers(0, nq), :] = False
    cols = ccount = None
    if columns:
        cols = np.zeros((lb, ln, nq, columns), np.int32)
        ccount = np.zeros((lb, ln, nq), np.int32)
        for idx in np.ndindex(lb, ln, nq):
            free = np.flatnonzero(~np.repeat(mask[idx], bk)[:s])
            m = int(rng.integers(0, min(columns, free.size) + 1))
            cols[idx][:m] = rng.choice(free, size=m, replace=False)
            ccount[idx] = m
        cols, ccount = jnp.asarray(cols), jnp.asarray(ccount)
    q_perm = kv_perm = None
    if perm:
        q_perm = jnp.asarray(np.stack([[rng.permutation(t) for _ in range(ln)] for _ in range(lb)]).astype(np.int32))
        kv_perm = jnp.asarray(np.stack([[rng.permutation(s) for _ in range(ln)] for _ in range(lb)]).astype(np.int32))
    return BlockLayout.from_block_mask(
        jnp.asarray(mask), q_len=t, kv_len=s, block_q=bq, block_k=bk,
        kv_columns=cols, kv_column_count=ccount, q_perm=q_perm, kv_perm=kv_perm,
    )


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


BAD = (np.nan, np.inf, -np.inf)


def plant_nonfinite(rng, q, k, v, count):
    """Put ``count`` NaN / +inf / -inf values at random elements of q, k, v."""
    arrays = [np.array(x, np.float32) for x in (q, k, v)]
    for _ in range(count):
        which = arrays[rng.integers(0, 3)]
        which[tuple(int(rng.integers(0, n)) for n in which.shape)] = BAD[rng.integers(0, 3)]
    return [jnp.asarray(a, q.dtype) for a in arrays]


def poisoned_rows(q, k, v, mask):
    """bool [B, N, T]: rows that see (``mask`` [B|1, N|1, T, S]) a non-finite query, key or value."""
    n, kh = q.shape[2], k.shape[2]
    q_bad = ~np.isfinite(np.asarray(q, np.float32)).all(-1)  # [B, T, N]
    kv_bad = ~(np.isfinite(np.asarray(k, np.float32)).all(-1) & np.isfinite(np.asarray(v, np.float32)).all(-1))
    kv_bad = np.repeat(kv_bad, n // kh, axis=2)  # [B, S, N]
    mask = np.asarray(mask)
    sees_bad_key = (mask & np.einsum("bsn->bns", kv_bad)[:, :, None, :]).any(-1)
    return sees_bad_key | (mask.any(-1) & np.einsum("btn->bnt", q_bad))


def expect_nonfinite_contract(out, lse, q, k, v, mask, atol):
    """Check (out [B,T,N,D], lse [B,N,T]) against the contract for ``mask``."""
    bad = poisoned_rows(q, k, v, mask)
    clean = [jnp.asarray(np.nan_to_num(np.asarray(x, np.float32), nan=0.0, posinf=0.0, neginf=0.0)) for x in (q, k, v)]
    ref_out, ref_lse = masked_dense_attention(*clean, mask)
    out = np.einsum("btnd->bntd", np.asarray(out, np.float32))
    ref_out = np.einsum("btnd->bntd", np.asarray(ref_out))
    assert np.isnan(out[bad]).all(), "a row that sees a non-finite input is not NaN"
    assert np.isfinite(out[~bad]).all(), "NaN / inf leaked into a row that does not see it"
    np.testing.assert_allclose(out[~bad], ref_out[~bad], atol=atol, rtol=atol)
    if lse is not None:
        lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
        assert np.isnan(lse[bad]).all()
        np.testing.assert_allclose(lse[~bad], ref_lse[~bad], atol=atol, rtol=atol)  # -inf == -inf for empty rows
    return bad


def lower_for_cuda(q_shape, k_shape, dtype, layout, attention=None, **kw) -> str:
    """The StableHLO text of ``attention(q, k, v, layout, **kw)`` (default: `block_sparse_attention` with
    implementation="mosaic_gpu") lowered for CUDA from abstract q ``q_shape`` / k, v ``k_shape`` in ``dtype``;
    asserts that a Mosaic GPU kernel is in it."""
    attention = attention or functools.partial(block_sparse_attention, implementation="mosaic_gpu")
    f = jax.jit(lambda q, k, v, lay: attention(q, k, v, lay, **kw))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), layout)
    args = (jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(k_shape, dtype),
            jax.ShapeDtypeStruct(k_shape, dtype), abstract)
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return text


def wholly_masked_entries(layout) -> np.ndarray:
    """bool ``[B', N', nq, max_blocks]`` (leading dims broadcast over the layout's operands): the listed entries of a
    concrete `BlockLayout` whose tile holds no pair a row of its query block sees (original positions: causal with
    the layout's gap / window, keys below ``kv_len``; a window entry's keys as `BlockLayout` counts them). A kernel
    computes such a tile wholly masked: time for nothing."""
    q_pos, k_pos = (np.asarray(x) for x in layout.positions())
    bq, bk, nq = layout.block_q, layout.block_k, layout.num_q_blocks
    blocks, count = np.asarray(layout.kv_blocks), np.asarray(layout.kv_block_count)
    lead = np.broadcast_shapes(q_pos.shape[:2], k_pos.shape[:2], blocks.shape[:2], count.shape[:2])
    blocks = np.broadcast_to(blocks, lead + (nq, blocks.shape[-1]))
    count = np.broadcast_to(count, lead + (nq,))
    t, s = layout.q_len, layout.kv_len
    rows = np.arange(nq)[:, None] * bq + np.arange(bq)  # [nq, bq]
    q_rows = np.take(np.broadcast_to(q_pos, lead + (t,)), np.minimum(rows, t - 1), axis=-1)  # [B', N', nq, bq]
    q_rows = np.where(rows < t, q_rows, np.iinfo(np.int32).min // 2)  # padding rows see nothing
    keys = blocks[..., None] + np.arange(bk) if layout.kv_windows else blocks[..., None] * bk + np.arange(bk)
    used = (keys >= 0) & (keys < s)
    if layout.kv_windows:  # entry j >= 1 computes its keys from the previous window's end on
        prev_end = np.concatenate([np.full(blocks.shape[:-1] + (1,), -bk), blocks[..., :-1] + bk], -1)
        used &= keys >= np.maximum(blocks, prev_end)[..., None]
    k_keys = np.take_along_axis(np.broadcast_to(k_pos, lead + (s,)), np.clip(keys, 0, s - 1).reshape(lead + (-1,)),
                                -1).reshape(keys.shape)  # [B', N', nq, m, bk]
    q_r, k_c = q_rows[:, :, :, None, :, None], k_keys[:, :, :, :, None, :]
    seen = used[:, :, :, :, None, :] & (k_c + layout.gap <= q_r)
    if layout.window:
        seen &= k_c > q_r - layout.window
    listed = np.arange(blocks.shape[-1]) < count[..., None]
    return listed & ~seen.any((-1, -2))
