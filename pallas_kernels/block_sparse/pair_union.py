"""Two 64-row query blocks' key-block lists as one list for a 128-row work item.

The Mosaic GPU kernel's ``union_lists`` mode runs query blocks ``2c`` and ``2c + 1`` of a 64-row layout in one CTA:
the producer loads every block of the union of their lists once, and each consumer warpgroup computes only the
blocks of its own query block, passing the others. `union_of_pairs` builds the operands for it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class PairUnion(NamedTuple):
    """The lists of query-block pairs (``nc = ceil(nq / 2)`` pairs; ``L`` the layout's leading dims ``[B|1, N|1]``).

    Attributes:
      ids: int32 ``[*L, nc, 2M]``: the distinct block ids of both lists, ascending, then zeros.
      count: int32 ``[*L, nc]``: how many of ``ids`` are listed.
      own: int32 ``[*L, nc, 2, M]``: for query block ``2c + w``, the positions in ``ids`` of its own entries,
        ascending, then zeros.
      own_count: int32 ``[*L, nc, 2]``: how many of ``own`` are listed.
    """

    ids: jax.Array
    count: jax.Array
    own: jax.Array
    own_count: jax.Array


def union_of_pairs(blocks: jax.Array, count: jax.Array, num_kv_blocks: int) -> PairUnion:
    """blocks int32 ``[B|1, N|1, nq|1, M]`` (ids distinct per query block, any order), count int32
    ``[B|1, N|1, nq]`` -> the union lists of query blocks ``(2c, 2c + 1)`` (`PairUnion`, leading dims broadcast
    together). Entries past a count or outside ``[0, num_kv_blocks)`` count nothing and are dropped; an odd
    ``nq`` gets an empty last block. jit-able."""
    if (getattr(blocks, "ndim", None) != 4 or getattr(count, "ndim", None) != 3
            or not (jnp.issubdtype(blocks.dtype, jnp.integer) and jnp.issubdtype(count.dtype, jnp.integer))):
        raise ValueError(f"blocks, count: expected int arrays [B|1, N|1, nq|1, M] and [B|1, N|1, nq]; received "
                         f"{getattr(blocks, 'dtype', None)}{list(getattr(blocks, 'shape', ()))} and "
                         f"{getattr(count, 'dtype', None)}{list(getattr(count, 'shape', ()))}")
    if not isinstance(num_kv_blocks, int) or num_kv_blocks < 1:
        raise ValueError(f"num_kv_blocks: expected an int >= 1; received {num_kv_blocks!r}")
    m = blocks.shape[-1]
    lead = jnp.broadcast_shapes(blocks.shape[:-1], count.shape)
    blocks = jnp.broadcast_to(blocks, lead + (m,)).astype(jnp.int32)
    count = jnp.broadcast_to(count, lead).astype(jnp.int32)
    if lead[2] % 2:  # an empty last query block
        blocks = jnp.concatenate([blocks, jnp.zeros(lead[:2] + (1, m), jnp.int32)], axis=2)
        count = jnp.concatenate([count, jnp.zeros(lead[:2] + (1,), jnp.int32)], axis=2)
    nk = num_kv_blocks
    listed = (jnp.arange(m) < count[..., None]) & (blocks >= 0) & (blocks < nk)
    pairs = blocks.shape[:2] + (blocks.shape[2] // 2, 2 * m)
    ids = jnp.where(listed, blocks, nk).reshape(pairs)  # unlisted: past every id, sorted last
    tags = jnp.broadcast_to(jnp.repeat(jnp.array([1, 2], jnp.int32), m), pairs)  # which query block of the pair
    ids, tags = lax.sort((ids, tags), dimension=3, num_keys=1)
    before = jnp.concatenate([jnp.full(pairs[:-1] + (1,), -1, jnp.int32), ids[..., :-1]], axis=-1)
    same_next = jnp.concatenate([ids[..., 1:] == ids[..., :-1], jnp.zeros(pairs[:-1] + (1,), bool)], axis=-1)
    keep = (ids != before) & (ids < nk)  # the first of each id (an id is in at most one entry of each list)
    who = tags | jnp.where(same_next, jnp.roll(tags, -1, axis=-1), 0)
    at = jnp.cumsum(keep, axis=-1, dtype=jnp.int32) - 1  # position in the union list

    def compact(values, where_, size):
        """``values`` where ``where_``, in order, into ``size`` slots (then zeros)."""
        slot = jnp.where(where_, jnp.cumsum(where_, axis=-1, dtype=jnp.int32) - 1, size)
        out = jnp.zeros(pairs[:-1] + (size + 1,), jnp.int32)
        return jnp.put_along_axis(out, slot, values, axis=-1, inplace=False)[..., :size]

    union = compact(ids, keep, 2 * m)
    mine = [keep & ((who & (1 << w)) != 0) for w in range(2)]
    own = jnp.stack([compact(at, x, m) for x in mine], axis=-2)
    own_count = jnp.stack([jnp.sum(x, axis=-1, dtype=jnp.int32) for x in mine], axis=-1)
    return PairUnion(union, jnp.sum(keep, axis=-1, dtype=jnp.int32), own, own_count)
