"""Vectorised helpers that turn per-row block ranges into `BlockLayout` lists, and
`LayoutSet`: several layouts over disjoint (query, key) pairs, merged by their lse.

All functions are jit-able; sizes that shape arrays are static Python ints.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import BlockLayout, block_sparse_attention, merge_attention
from pallas_kernels.block_sparse.layout import cdiv


def query_block_bounds(q_len: int, kv_len: int, block_q: int) -> tuple[jax.Array, jax.Array]:
    """Original positions of the first and last query of each query block: int32 ``[nq]``."""
    nq = cdiv(q_len, block_q)
    off = kv_len - q_len
    start = np.arange(nq) * block_q + off
    end = np.minimum((np.arange(nq) + 1) * block_q, q_len) - 1 + off
    return jnp.asarray(start, jnp.int32), jnp.asarray(end, jnp.int32)


def ranges_to_lists(groups: list[tuple[jax.Array, jax.Array, int]], num_kv_blocks: int
                    ) -> tuple[jax.Array, jax.Array]:
    """Union of inclusive block ranges per row -> ascending, distinct block lists.

    groups: ``(lo, hi, max_width)`` with lo, hi int32 ``[..., R]`` (one group's ranges are
    at most ``max_width`` blocks wide, static; a range with hi < lo is empty; ranges may
    overlap). Ids are clipped to ``[0, num_kv_blocks)``. Returns (blocks int32
    ``[..., L]`` with L = sum of R * max_width, count ``[...]``).
    """
    big = jnp.int32(np.iinfo(np.int32).max)
    flats = []
    for lo, hi, max_width in groups:
        cand = lo[..., None] + jnp.arange(max_width, dtype=jnp.int32)  # [..., R, W]
        valid = (cand <= hi[..., None]) & (cand >= 0) & (cand < num_kv_blocks)
        flats.append(jnp.where(valid, cand, big).reshape(lo.shape[:-1] + (-1,)))
    flat = jnp.sort(jnp.concatenate(flats, -1), axis=-1)
    dup = jnp.concatenate([jnp.zeros_like(flat[..., :1], bool), flat[..., 1:] == flat[..., :-1]], -1)
    flat = jnp.sort(jnp.where(dup, big, flat), axis=-1)
    count = (flat != big).sum(-1).astype(jnp.int32)
    return jnp.where(flat == big, 0, flat).astype(jnp.int32), count


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayoutSet:
    """Layouts that together list each (query, key) pair at most once; attention over the
    union is the lse-merge of attention over each part (exact)."""

    parts: tuple[BlockLayout, ...]

    def to_dense_mask(self, causal: bool = True) -> jax.Array:
        masks = [p.to_dense_mask(causal) for p in self.parts]
        out = masks[0]
        for m in masks[1:]:
            out = out | m
        return out

    def density(self, causal: bool = True) -> jax.Array:
        return summed_density(self.parts, causal)

    @property
    def q_len(self) -> int:
        return self.parts[0].q_len

    @property
    def kv_len(self) -> int:
        return self.parts[0].kv_len


AnyLayout = BlockLayout | LayoutSet


def summed_density(parts, causal: bool = True) -> jax.Array:
    """Sum of the parts' densities (the tiles all their kernel launches compute), ``[B|1, N|1]``."""
    total = parts[0].density(causal)
    for p in parts[1:]:
        total = total + p.density(causal)
    return total


def attend_layout(q, k, v, layout: AnyLayout, *, sm_scale=None, implementation=None,
                  interpret=False) -> tuple[jax.Array, jax.Array]:
    """Block-sparse attention over a layout or a `LayoutSet` (parts merged by lse)."""
    parts = layout.parts if isinstance(layout, LayoutSet) else (layout,)
    out, lse = None, None
    for part in parts:
        o, l = block_sparse_attention(q, k, v, part, sm_scale=sm_scale,
                                      implementation=implementation, interpret=interpret)
        out, lse = (o, l) if out is None else merge_attention(out, lse, o, l)
    return out, lse
