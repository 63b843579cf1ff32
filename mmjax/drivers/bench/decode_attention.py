"""Decode-attention variants `mmjax bench decode` compares with XLA's dense attention
(``models.attention.dense_attention``), all with the ``models.attention`` protocol.

* `einsum_attention`: XLA's einsum form of dense attention at every batch size (the decode default
  before ``dense_attention`` took the multiply-reduce form of ``models.decode_attention`` for batched
  single-query steps on CUDA).
* `reduce_attention` (``models.decode_attention``): that multiply-reduce form at every batch size.
* `split_k_attention`: the split-K Pallas kernel of ``pallas_kernels.tree_decode`` with the new
  token as a one-slot block.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from models.attention import dense_attention
from pallas_kernels.tree_decode import tree_decode_attention

einsum_attention = functools.partial(dense_attention, decode_form="einsum")


def split_k_attention(q, k, v, *, layer=None, q_positions, kv_valid, modality=None):
    """Decode attention (every row's new token at the same slot) through the split-K Pallas kernel
    ``pallas_kernels.tree_decode_attention``: the prefix is every valid slot before the new token's,
    the block is the new token's slot. q [B, T=1, N, D]; k, v [B, S, K, D]; q_positions int32 [B, 1];
    kv_valid bool [B, S]. Returns [B, 1, N, D]."""
    del layer, modality
    b, t = q_positions.shape
    if t != 1 or kv_valid.ndim != 2:
        raise ValueError(f"q_positions / kv_valid: expected [B, 1] / [B, S] (one new token per row), got "
                         f"{q_positions.shape} / {kv_valid.shape}")
    slot = q_positions[0, 0]
    prefix = kv_valid & (jnp.arange(kv_valid.shape[1], dtype=jnp.int32)[None] < slot)
    return tree_decode_attention(q, k, v, prefix, slot, jnp.ones((b, 1, 1), bool))
