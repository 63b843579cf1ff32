"""Public attention entry points over sparse patterns: `build_layout`, `sparse_attention`,
`attention_recall`.

Shapes: q ``[B, T, N, D]`` (the last T of S positions), k/v ``[B, S, K, D]``, N % K == 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mmjax.layout_ops import AnyLayout, LayoutSet, attend_layout
from mmjax.patterns.base import KernelOptions, Pattern
from pallas_kernels import BlockLayout, block_sparse_attention
from pallas_kernels.block_sparse import validation


def _check_pattern(pattern) -> Pattern:
    if not isinstance(pattern, Pattern):
        raise ValueError(
            f"pattern: expected an mmjax.patterns pattern (Dense, AShape, TriShape, SFFixed, "
            f"SFStrided, VerticalSlash, Grid, ...); received {type(pattern).__name__}"
        )
    return pattern


def build_layout(q: jax.Array, k: jax.Array, pattern: Pattern, modality=None) -> AnyLayout:
    """Estimate the pattern's index online from q/k and build its layout (jit-able).

    Returns a `BlockLayout`, or a `LayoutSet` for patterns made of disjoint parts (Grid,
    TriShape)."""
    validation.check_qkv(q, k, k)
    return _check_pattern(pattern).build_layout(q, k, modality=modality)


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, pattern: Pattern, modality=None, *,
                     options: KernelOptions = KernelOptions()) -> jax.Array:
    """Attention with one sparse pattern for every head: out ``[B, T, N, D]`` in q's dtype."""
    validation.check_qkv(q, k, v)
    out, _ = _check_pattern(pattern).attend(q, k, v, modality=modality, options=options)
    return out


def _lse(q, k, v, layout: AnyLayout, options: KernelOptions) -> jax.Array:
    _, lse = attend_layout(q, k, v, layout, sm_scale=options.sm_scale,
                           implementation=options.implementation, interpret=options.interpret)
    return lse


def attention_recall(q: jax.Array, k: jax.Array, v: jax.Array, pattern: Pattern | AnyLayout,
                     modality=None, *, options: KernelOptions = KernelOptions()) -> jax.Array:
    """Fraction of causal softmax mass the pattern's layout keeps, float32 ``[B, N]``.

    Per query row the kept mass is ``exp(lse_layout - lse_dense)`` (the kernel's lse over the
    layout's keys against the lse over all causal keys); rows are averaged. Chunked through
    the block-sparse kernel, so it never forms S x S and runs at 128k tokens on a GPU.
    ``pattern`` may also be a prebuilt layout. ``Dense`` gives exactly 1.
    """
    validation.check_qkv(q, k, v)
    layout = pattern if isinstance(pattern, (BlockLayout, LayoutSet)) else build_layout(q, k, pattern, modality)
    block_q = (layout.parts[0] if isinstance(layout, LayoutSet) else layout).block_q
    dense = BlockLayout.dense_causal(q.shape[1], k.shape[1], block_q=block_q, block_k=64)
    lse_sparse = _lse(q, k, v, layout, options)
    lse_dense = _lse(q, k, v, dense, options)
    kept = jnp.exp(jnp.minimum(lse_sparse - lse_dense, 0.0))
    return kept.mean(-1)
