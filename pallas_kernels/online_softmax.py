"""The online-softmax step shared by the Pallas Triton kernels (flash-attention style, base 2),
with the non-finite contract of `pallas_kernels.nonfinite`.

A step takes raw scores and a visibility mask: masked scores become -inf, and a visible
non-finite score adds NaN to the row's normaliser ``l`` (it stays NaN: the row ends NaN out,
NaN lse). Kernels that mask only some tiles split the step in two: `masked_tile` /
`unmasked_tile` (chosen by a ``lax.cond`` on the tile) and `softmax_update`, so that the
matrix products stay outside the condition. `masked_flag_tile` / `unmasked_flag_tile` make the same
poison from per-row input flags (the QSA kernel), without looking at every score.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.nonfinite import score_poison


def masked_tile(s: jax.Array, ok: jax.Array, poison: bool = True) -> tuple[jax.Array, jax.Array]:
    """s ``[R, bk]`` float32 scaled scores, ok bool broadcastable to ``[R, bk]`` -> (scores
    with masked pairs -inf, poison ``[R]``: NaN for a row with a visible non-finite score, else 0).
    The poison is reduced to one value per row here: a second ``[R, bk]`` tensor carried out of
    the tile's condition costs registers the matrix products need. ``poison=False`` (the caller
    knows every input is finite) skips the check: the poison is 0."""
    masked = jnp.where(ok, s, -jnp.inf)
    if not poison:
        return masked, jnp.zeros(s.shape[:1], jnp.float32)
    return masked, jnp.sum(score_poison(s, ok), axis=1)


def unmasked_tile(s: jax.Array, poison: bool = True) -> tuple[jax.Array, jax.Array]:
    """Every pair visible: (s, poison ``[R]``) as in `masked_tile`."""
    if not poison:
        return s, jnp.zeros(s.shape[:1], jnp.float32)
    return s, jnp.sum(score_poison(s), axis=1)


def masked_flag_tile(s: jax.Array, ok: jax.Array, q_flag: jax.Array, k_flag: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`masked_tile` with the poison from per-row input flags instead of the scores: q_flag ``[R]``
    and k_flag ``[bk]`` are 0, or NaN for a query / key row holding a NaN or an inf (a score is
    non-finite exactly then, unless finite inputs overflow: +inf still ends NaN in the exponent,
    -inf counts as weight 0). The flags are made once by the kernel's wrapper."""
    return jnp.where(ok, s, -jnp.inf), jnp.sum(jnp.where(ok, q_flag[:, None] + k_flag[None, :], 0.0), axis=1)


def unmasked_flag_tile(s: jax.Array, q_flag: jax.Array, k_flag: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every pair visible: (s, poison ``[R]``) as in `masked_flag_tile`, ``[bk]`` work instead of
    `unmasked_tile`'s ``[R, bk]``."""
    return s, q_flag + jnp.sum(k_flag)


def max_sum_update(m_prev: jax.Array, l_prev: jax.Array, s: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Fold a tile of scores into a row tile's running maximum and sum of exp2 (no output accumulator).

    m_prev / l_prev float32 ``[R]``, s ``[R, bk]`` float32 base-2 scores, masked pairs -inf. Returns (m_new, l_new,
    alpha ``[R]``: the factor the earlier sum was scaled by, p ``[R, bk]``: the tile's exp2(s - m_new)); a row that
    has seen no key keeps m = -inf, l = 0."""
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_prev - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    return m_new, l_prev * alpha + jnp.sum(p, axis=1), alpha, p


def softmax_update(carry: tuple[jax.Array, jax.Array, jax.Array], s: jax.Array, poison: jax.Array,
                   v: jax.Array):
    """Fold one key tile into the running (max, sum, accumulator) of a row tile.

    carry: m ``[R]``, l ``[R]``, acc ``[R, D]`` float32; s ``[R, bk]`` float32 scores already
    scaled by ``sm_scale * log2(e)`` and masked (-inf); poison ``[R]`` from `masked_tile`;
    v ``[bk, D]`` (masked keys' values must be finite: zero them or `poison_keys` them first).
    Rows that have seen no key keep m = -inf, l = 0, acc = 0. Returns the new carry.
    """
    m_prev, l_prev, acc = carry
    m_new, l_new, alpha, p = max_sum_update(m_prev, l_prev, s)
    acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v)
    return m_new, l_new + poison, acc


def softmax_step(carry: tuple[jax.Array, jax.Array, jax.Array], s: jax.Array, v: jax.Array,
                 ok: jax.Array | None = None, poison: bool = True):
    """`softmax_update` after `masked_tile` (``ok`` given) or `unmasked_tile` (None)."""
    s, poison = unmasked_tile(s, poison) if ok is None else masked_tile(s, ok, poison)
    return softmax_update(carry, s, poison, v)
