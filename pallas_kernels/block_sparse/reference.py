"""Pure-JAX block-sparse attention: the definition of correct.

For every (batch, head, query block) it gathers the listed key blocks and columns, applies
the causal mask on original positions (key windows of ``kv_windows`` layouts: the keys
`window_keys` names), and runs an online softmax in float32 over chunks
of keys. Memory is O(B * N * block_q * chunk), never T x S, so 32k tokens run on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.block_sparse.layout import BlockLayout, window_keys
from pallas_kernels.nonfinite import finish, poison_keys, score_poison
from pallas_kernels.tiling import inverse_permutation

_NEG_INF = float("-inf")


def _gather_heads(x: jax.Array, idx: jax.Array, groups: int) -> jax.Array:
    """x ``[B,K,S,D]``, idx int ``[B,N,L]`` (N = K * groups) -> ``[B,N,L,D]``."""
    b, kh, _, d = x.shape
    n, length = idx.shape[1], idx.shape[2]
    flat = idx.reshape(b, kh, groups * length)
    out = jnp.take_along_axis(x, flat[..., None], axis=2, mode="clip")
    return out.reshape(b, n, length, d)


def _online_update(carry, scores, ok, values):
    """One online-softmax step. scores ``[B,N,Q,L]`` raw, ok bool ``[B,N,Q,L]`` visible pairs,
    values ``[B,N,L,D]`` (finite: non-finite values were moved onto their keys)."""
    m_prev, l_prev, acc = carry
    poison = score_poison(scores, ok)
    scores = jnp.where(ok, scores, _NEG_INF)
    m_new = jnp.maximum(m_prev, scores.max(-1))
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    corr = jnp.exp(m_prev - m_safe)
    p = jnp.exp(scores - m_safe[..., None])
    l_new = corr * l_prev + (p + poison).sum(-1)
    acc = corr[..., None] * acc + jnp.einsum("bnql,bnld->bnqd", p, values)
    return m_new, l_new, acc


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "chunk_blocks"))
def block_sparse_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, layout: BlockLayout, *,
                                     sm_scale: float, causal: bool = True, chunk_blocks: int = 8
                                     ) -> tuple[jax.Array, jax.Array]:
    """q ``[B,T,N,D]``, k/v ``[B,S,K,D]`` -> out ``[B,T,N,D]`` (q.dtype), lse ``[B,N,T]`` f32.

    Inputs are assumed validated (see `api.block_sparse_attention`). Non-finite inputs follow
    `pallas_kernels.nonfinite`; listed ids outside ``[0, num_kv_blocks)`` and columns outside
    ``[0, S)`` contribute nothing, counts are clamped to ``[0, max]`` and permutation entries to
    the sequence (the kernel does the same).
    """
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    bq, bk = layout.block_q, layout.block_k
    nq, nk = layout.num_q_blocks, layout.num_kv_blocks
    t_pad = nq * bq

    def full(x):
        """Broadcast size-1 batch / head / query-block dims of a layout array."""
        return None if x is None else jnp.broadcast_to(x, (b, n, nq) + x.shape[3:])

    q_pos, k_pos = layout.positions()
    q_orig = jnp.clip(jnp.broadcast_to(q_pos, (b, n, t)) - layout.q_offset, 0, t - 1)  # original query index
    q_pos = q_orig + layout.q_offset
    k_pos = jnp.clip(jnp.broadcast_to(k_pos, (b, n, s)), 0, s - 1)
    k, v = poison_keys(k, v)

    qh = jnp.einsum("btnd->bntd", q).astype(jnp.float32)
    qh = jnp.take_along_axis(qh, q_orig[..., None], axis=2)  # permuted query order
    pad_t = t_pad - t
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, pad_t), (0, 0)))
    q_pos_p = jnp.pad(q_pos, ((0, 0), (0, 0), (0, pad_t)), constant_values=-1)
    kh_ = jnp.einsum("bskd->bksd", k).astype(jnp.float32)
    vh_ = jnp.einsum("bskd->bksd", v).astype(jnp.float32)

    blocks, count = full(layout.kv_blocks), full(layout.kv_block_count)
    mb = blocks.shape[-1]
    cb = max(1, min(chunk_blocks, mb))
    n_chunks = -(-mb // cb)
    if layout.kv_windows:  # keys [a_j, a_j + bk) from the previous window's end on (layout docstring)
        win_keys, win_ok = window_keys(blocks, count, bk, s)
        pad4 = ((0, 0), (0, 0), (0, 0), (0, n_chunks * cb - mb), (0, 0))
        win_keys, win_ok = jnp.pad(win_keys, pad4), jnp.pad(win_ok, pad4)
    blocks = jnp.pad(blocks, ((0, 0), (0, 0), (0, 0), (0, n_chunks * cb - mb)))
    has_cols = layout.kv_columns is not None
    if has_cols:
        cols, ccount = full(layout.kv_columns), full(layout.kv_column_count)
        mc = cols.shape[-1]
        cc = cb * bk
        n_col_chunks = max(1, -(-mc // cc))
        cols = jnp.pad(cols, ((0, 0), (0, 0), (0, 0), (0, n_col_chunks * cc - mc)))

    def keys_step(carry, perm_idx, valid, qpos):
        """perm_idx/valid ``[B,N,L]`` permuted key indices; qpos ``[B,N,Q]``."""
        safe = jnp.where(valid, perm_idx, 0)
        kpos = jnp.take_along_axis(k_pos, safe, axis=-1)  # original key index
        kk = _gather_heads(kh_, kpos, groups)
        vv = _gather_heads(vh_, kpos, groups)
        qblk = carry[3]
        scores = jnp.einsum("bnqd,bnld->bnql", qblk, kk) * sm_scale
        ok = valid[:, :, None, :]
        if causal:
            ok = ok & (kpos[:, :, None, :] + layout.gap <= qpos[..., None])
            if layout.window:
                ok = ok & (kpos[:, :, None, :] + layout.window > qpos[..., None])
        return _online_update(carry[:3], scores, ok, vv) + (qblk,)

    def one_q_block(i):
        qblk = jax.lax.dynamic_slice_in_dim(qh, i * bq, bq, axis=2)  # [B,N,bq,D]
        qpos = jax.lax.dynamic_slice_in_dim(q_pos_p, i * bq, bq, axis=2)
        carry = (
            jnp.full((b, n, bq), _NEG_INF, jnp.float32),
            jnp.zeros((b, n, bq), jnp.float32),
            jnp.zeros((b, n, bq, d), jnp.float32),
            qblk,
        )
        blk_i = blocks[:, :, i]  # [B,N,n_chunks*cb]
        cnt_i = count[:, :, i]

        def window_chunk(carry, c):
            idx = jax.lax.dynamic_slice_in_dim(win_keys[:, :, i], c * cb, cb, axis=2).reshape(b, n, cb * bk)
            valid = jax.lax.dynamic_slice_in_dim(win_ok[:, :, i], c * cb, cb, axis=2).reshape(b, n, cb * bk)
            return keys_step(carry, idx, valid, qpos), None

        def block_chunk(carry, c):
            ids = jax.lax.dynamic_slice_in_dim(blk_i, c * cb, cb, axis=2)
            slot = c * cb + jnp.arange(cb)
            idx = (ids[..., None] * bk + jnp.arange(bk)).reshape(b, n, cb * bk)
            valid = ((slot[None, None, :, None] < cnt_i[..., None, None])
                     & (ids[..., None] >= 0) & (ids[..., None] < nk)
                     & ((ids[..., None] * bk + jnp.arange(bk)) < s))
            return keys_step(carry, idx, valid.reshape(b, n, cb * bk), qpos), None

        carry, _ = jax.lax.scan(window_chunk if layout.kv_windows else block_chunk, carry, jnp.arange(n_chunks))
        if has_cols:
            col_i, ccnt_i = cols[:, :, i], ccount[:, :, i]

            def col_chunk(carry, c):
                idx = jax.lax.dynamic_slice_in_dim(col_i, c * cc, cc, axis=2)
                valid = ((c * cc + jnp.arange(cc)) < ccnt_i[..., None]) & (idx >= 0) & (idx < s)
                return keys_step(carry, idx, valid, qpos), None

            carry, _ = jax.lax.scan(col_chunk, carry, jnp.arange(n_col_chunks))
        return finish(*carry[:3])

    out, lse = jax.lax.map(one_q_block, jnp.arange(nq))  # [nq,B,N,bq,D], [nq,B,N,bq]
    out = jnp.einsum("ibnqd->bniqd", out).reshape(b, n, t_pad, d)[:, :, :t]
    lse = jnp.einsum("ibnq->bniq", lse).reshape(b, n, t_pad)[:, :, :t]
    # Back to original query order.
    inv = inverse_permutation(q_orig)
    out = jnp.take_along_axis(out, inv[..., None], axis=2)
    lse = jnp.take_along_axis(lse, inv, axis=2)
    return jnp.einsum("bntd->btnd", out).astype(q.dtype), lse
