"""Public attention entry points over sparse patterns: `build_layout`, `sparse_attention`,
`attention_recall`.

Shapes: q ``[B, T, N, D]`` (the last T of S positions), k/v ``[B, S, K, D]``, N % K == 0.

Per-head dispatch: `sparse_attention` also takes one pattern per query head. Heads with an
identical pattern form a group that runs as one call of the pattern (one layout with
per-head lists, one kernel launch per layout part): the group's query heads are gathered,
with their key/value heads (whole GQA groups keep GQA; otherwise each query head gets its
own copy of its key/value head), and the group outputs are scattered back to their heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.sparse.layouts import KernelOptions, Layout, LayoutSet, RowSplit, attend
from mmjax.sparse.modality import as_modality
from mmjax.sparse.patterns.base import Pattern
from pallas_kernels import BlockLayout
from pallas_kernels.checks import check_qkv


def _check_pattern(pattern) -> Pattern:
    if not isinstance(pattern, Pattern):
        raise ValueError(
            f"pattern: expected an mmjax.sparse.patterns pattern (Dense, AShape, TriShape, SFFixed, "
            f"SFStrided, VerticalSlash, Grid, ...); received {type(pattern).__name__}"
        )
    return pattern


def build_layout(q: jax.Array, k: jax.Array, pattern: Pattern, modality=None) -> Layout:
    """Estimate the pattern's index online from q/k and build its layout (jit-able).

    Returns a `BlockLayout`, a `LayoutSet` for patterns made of disjoint parts (Grid,
    TriShape), or a `RowSplit` for query-boundary wrappers (rows owned by modality)."""
    check_qkv(q, k, k)
    return _check_pattern(pattern).build_layout(q, k, modality=as_modality(modality, q, k))


def head_groups(patterns: Sequence[Pattern], num_heads: int) -> list[tuple[Pattern, tuple[int, ...]]]:
    """Per-head patterns -> [(pattern, heads)] in order of first appearance; heads whose
    patterns compare equal (frozen dataclasses: same kind and hyper-parameters) share a group."""
    if isinstance(patterns, (str, bytes)) or not isinstance(patterns, Sequence):
        raise ValueError(f"patterns: expected a pattern or a sequence of one pattern per query head; "
                         f"received {type(patterns).__name__}")
    if len(patterns) != num_heads:
        raise ValueError(f"patterns: expected one pattern per query head (N={num_heads}); "
                         f"received {len(patterns)}")
    groups: dict[Pattern, list[int]] = {}
    for h, p in enumerate(patterns):
        groups.setdefault(_check_pattern(p), []).append(h)
    return [(p, tuple(hs)) for p, hs in groups.items()]


def gather_heads(q, k, v, heads: tuple[int, ...]):
    """The group's query heads and the key/value heads they read (GQA kept when the group
    is a union of whole GQA groups)."""
    n, kh = q.shape[2], k.shape[2]
    g = n // kh
    hs = np.asarray(heads)
    qg = q[:, :, hs]
    kv_heads = np.unique(hs // g)
    if len(hs) == len(kv_heads) * g and (np.sort(hs) == (kv_heads[:, None] * g + np.arange(g)).ravel()).all():
        return qg, k[:, :, kv_heads], v[:, :, kv_heads]  # heads are sorted: whole groups in order
    return qg, k[:, :, hs // g], v[:, :, hs // g]


def attend_heads(q: jax.Array, k: jax.Array, v: jax.Array, patterns: Pattern | Sequence[Pattern],
                 modality=None, *, options: KernelOptions = KernelOptions()) -> tuple[jax.Array, jax.Array]:
    """out ``[B, T, N, D]`` (q's dtype), lse ``[B, N, T]`` float32 for one pattern or one
    pattern per query head (see the module docstring). jit-able."""
    check_qkv(q, k, v)
    modality = as_modality(modality, q, k)
    if isinstance(patterns, (str, bytes)) or not isinstance(patterns, Sequence):
        return _check_pattern(patterns).attend(q, k, v, modality=modality, options=options)
    groups = head_groups(patterns, q.shape[2])
    if len(groups) == 1:
        return groups[0][0].attend(q, k, v, modality=modality, options=options)
    outs, lses, order = [], [], []
    for pattern, heads in groups:
        qg, kg, vg = gather_heads(q, k, v, heads)
        o, l = pattern.attend(qg, kg, vg, modality=modality, options=options)
        outs.append(o)
        lses.append(l)
        order.extend(heads)
    inv = np.argsort(np.asarray(order))
    out = jnp.concatenate(outs, axis=2)[:, :, inv]
    lse = jnp.concatenate(lses, axis=1)[:, inv]
    return out, lse


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, pattern: Pattern | Sequence[Pattern],
                     modality=None, *, options: KernelOptions = KernelOptions()) -> jax.Array:
    """Sparse attention: out ``[B, T, N, D]`` in q's dtype.

    pattern: one pattern for every head, or a sequence of N patterns (one per query head);
    heads sharing an identical pattern run together (one call of the pattern).
    modality: None, a `Modality`, or int ids ``[B, S]``; checked against k's ``[B, S]``.
    """
    out, _ = attend_heads(q, k, v, pattern, modality, options=options)
    return out


def _lse(q, k, v, layout: Layout, options: KernelOptions) -> jax.Array:
    return attend(q, k, v, layout, options)[1]


def attention_recall(q: jax.Array, k: jax.Array, v: jax.Array,
                     pattern: Pattern | Sequence[Pattern] | Layout, modality=None, *,
                     options: KernelOptions = KernelOptions()) -> jax.Array:
    """Fraction of causal softmax mass the pattern's layout keeps, float32 ``[B, N]``.

    Per query row the kept mass is ``exp(lse_layout - lse_dense)`` (the kernel's lse over the
    layout's keys against the lse over all causal keys); rows are averaged. Chunked through
    the block-sparse kernel, so it never forms S x S and runs at 128k tokens on a GPU.
    ``pattern`` may also be a prebuilt layout, or one pattern per query head (heads grouped
    as in `sparse_attention`). ``Dense`` gives exactly 1.
    """
    check_qkv(q, k, v)
    if isinstance(pattern, (BlockLayout, LayoutSet, RowSplit)):
        lse_sparse = _lse(q, k, v, pattern, options)
    elif isinstance(pattern, Sequence) and not isinstance(pattern, (str, bytes)):
        modality = as_modality(modality, q, k)
        lses, order = [], []
        for p, heads in head_groups(pattern, q.shape[2]):
            qg, kg, vg = gather_heads(q, k, v, heads)
            lses.append(_lse(qg, kg, vg, p.build_layout(qg, kg, modality=modality), options))
            order.extend(heads)
        lse_sparse = jnp.concatenate(lses, axis=1)[:, np.argsort(np.asarray(order))]
    else:
        lse_sparse = _lse(q, k, v, build_layout(q, k, pattern, modality), options)
    dense = BlockLayout.dense_causal(q.shape[1], k.shape[1], block_q=128, block_k=64)
    lse_dense = _lse(q, k, v, dense, options)
    kept = jnp.exp(jnp.minimum(lse_sparse - lse_dense, 0.0))
    return kept.mean(-1)
