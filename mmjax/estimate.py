"""Online index estimation from the last queries (MMInference / MInference style).

A = softmax(Q[-last_q:] K^T * scale + causal mask) per head is reduced to
* vertical scores: column sums of A, ``[B, N, S]``;
* slash scores: sums along diagonals, ``slash[d] = sum_r A[r, pos_r - d]`` for the offset
  d = query position - key position, ``[B, N, S]``.
Both are normalised to sum to 1 per head. A is last_q x S and lives for one head at a time
(`lax.map` over heads), so no S x S buffer is ever formed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("last_q", "sm_scale"))
def last_q_scores(q: jax.Array, k: jax.Array, *, last_q: int, sm_scale: float | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """q ``[B,T,N,D]``, k ``[B,S,K,D]`` -> (vertical, slash), each float32 ``[B,N,S]``."""
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    if not 1 <= last_q <= t:
        raise ValueError(f"last_q: expected 1 <= last_q <= T={t}; received {last_q}")
    groups = n // kh
    scale = d ** -0.5 if sm_scale is None else sm_scale
    q_last = q[:, t - last_q:]  # [B, L, N, D]
    q_pos = s - last_q + jnp.arange(last_q)  # original positions of the last rows
    k_pos = jnp.arange(s)
    causal = k_pos[None, :] <= q_pos[:, None]  # [L, S]
    diag_idx = q_pos[:, None] - k_pos[None, :]  # [L, S]: key index for offset d = column

    def one_head(h):
        qh = jax.lax.dynamic_index_in_dim(q_last, h, axis=2, keepdims=False)  # [B, L, D]
        kk = jax.lax.dynamic_index_in_dim(k, h // groups, axis=2, keepdims=False)  # [B, S, D]
        logits = jnp.einsum("bld,bsd->bls", qh, kk, preferred_element_type=jnp.float32) * scale
        a = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)  # [B, L, S]
        vertical = a.sum(1)
        # slash[d] = sum_r a[r, pos_r - d]; indices < 0 are outside the sequence.
        gathered = jnp.take_along_axis(a, jnp.clip(diag_idx, 0, s - 1)[None], axis=-1)
        slash = jnp.where(diag_idx[None] >= 0, gathered, 0.0).sum(1)
        return vertical / last_q, slash / last_q

    vertical, slash = jax.lax.map(one_head, jnp.arange(n))  # [N, B, S]
    return jnp.einsum("nbs->bns", vertical), jnp.einsum("nbs->bns", slash)
