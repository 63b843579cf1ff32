"""The online-softmax step shared by the Pallas Triton kernels (flash-attention style, base 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton


def softmax_step(carry: tuple[jax.Array, jax.Array, jax.Array], s: jax.Array, v: jax.Array):
    """Fold one key tile into the running (max, sum, accumulator) of a row tile.

    carry: m ``[R]``, l ``[R]``, acc ``[R, D]`` float32; s ``[R, bk]`` float32 scores already
    scaled by ``sm_scale * log2(e)`` (masked pairs ``-inf``); v ``[bk, D]``. Rows that have seen
    no key keep m = -inf, l = 0, acc = 0. Returns the new carry.
    """
    m_prev, l_prev, acc = carry
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_prev - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    l_new = l_prev * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v)
    return m_new, l_new, acc
