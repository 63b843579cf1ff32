"""Pure-JAX tree-decode attention: the definition of correct.

One softmax over two key sets, as in verification of a speculative draft tree: the cached
prefix (a per-key mask ``prefix_valid [B, S]`` shared by every query) and a block of W slots
starting at ``block_start`` (a per-query mask ``block_mask [B, T, W]``: each query's
ancestors and itself). Scores and softmax statistics in float32; a query that sees no key
gives 0; a query that sees a non-finite score or value gives NaN, and masked slots (an
unwritten cache slot holding NaN) contribute nothing (`pallas_kernels.nonfinite`). Memory is O(B * N * T * S) for the scores, fine for T <= 64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.nonfinite import finish, poison_keys, score_poison


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def tree_decode_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    prefix_valid: jax.Array,
    block_start: jax.Array,
    block_mask: jax.Array,
    *,
    sm_scale: float,
) -> jax.Array:
    """q ``[B,T,N,D]``, k/v ``[B,S,K,D]``, prefix_valid bool ``[B,S]``, block_start int32 ``[]``,
    block_mask bool ``[B,T,W]`` -> out ``[B,T,N,D]`` in q's dtype.

    Inputs are assumed validated (see `api.tree_decode_attention`). The block slice is
    ``dynamic_slice`` semantics (a start past ``S - W`` is clamped).
    """
    b, t, n, d = q.shape
    kh, w = k.shape[2], block_mask.shape[-1]
    k, v = poison_keys(k, v)
    qg = q.reshape(b, t, kh, n // kh, d)
    kb = jax.lax.dynamic_slice_in_dim(k, block_start, w, axis=1)
    vb = jax.lax.dynamic_slice_in_dim(v, block_start, w, axis=1)
    ok1 = prefix_valid[:, None, None, None, :]
    ok2 = block_mask[:, None, None, :, :]
    s1 = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    s2 = jnp.einsum("btkgd,bwkd->bkgtw", qg, kb, preferred_element_type=jnp.float32) * sm_scale
    poison = jnp.sum(score_poison(s1, ok1), axis=-1) + jnp.sum(score_poison(s2, ok2), axis=-1)
    s1 = jnp.where(ok1, s1, -jnp.inf)
    s2 = jnp.where(ok2, s2, -jnp.inf)
    m = jnp.maximum(jnp.max(s1, axis=-1), jnp.max(s2, axis=-1))
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)[..., None]
    p1, p2 = jnp.exp(s1 - m_safe), jnp.exp(s2 - m_safe)
    l = jnp.sum(p1, axis=-1) + jnp.sum(p2, axis=-1) + poison
    o = (jnp.einsum("bkgts,bskd->bkgtd", p1.astype(v.dtype), v, preferred_element_type=jnp.float32)
         + jnp.einsum("bkgtw,bwkd->bkgtd", p2.astype(v.dtype), vb, preferred_element_type=jnp.float32))
    o, _ = finish(m, l, o)
    return jnp.einsum("bkgtd->btkgd", o).reshape(b, t, n, d).astype(q.dtype)
