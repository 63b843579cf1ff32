"""`BlockLayout`: which key blocks (and single key columns) each query block computes.

Index spaces
------------
Queries and keys may be *permuted* (Grid heads, modality boundaries). A layout speaks in
the permuted order:

* query block ``i`` holds the permuted query rows ``[i * block_q, (i + 1) * block_q)``;
  permuted row ``r`` is original query ``q_perm[r]`` (identity when ``q_perm`` is None);
* key block ``j`` holds permuted key rows ``[j * block_k, (j + 1) * block_k)``; permuted key
  ``c`` is original key ``kv_perm[c]``; ``kv_columns`` hold permuted key indices too.

Causality is always decided on *original* positions. Queries are the last ``q_len`` of
``kv_len`` positions (suffix / chunked prefill): original query ``t`` sits at position
``t + kv_len - q_len``; key ``s`` sits at position ``s``. A layout may ask for a causal
*gap* (``gap`` g >= 0, static): the query at position p then sees keys at positions
``<= p - g`` only; with a causal *window* (``window`` w >= 1, static; 0 = none) it sees keys
at positions ``> p - w`` only. A layout with ``window=g`` and one with ``gap=g`` split every
query's causal keys exactly (near / far), whatever blocks they list.

Key windows (``kv_windows=True``, static)
-----------------------------------------
Diagonal bands (Vertical-Slash slashes) cover, for a query block, key ranges that start anywhere,
not on ``block_k`` boundaries. A layout with ``kv_windows`` lists *window starts* instead of
block ids: entry ``a_j`` (a permuted key index, may be negative) names the keys
``[a_j, a_j + block_k)``; the entries of a query block ascend strictly, and entry ``j >= 1``
computes only the keys from ``a_{j-1} + block_k`` on (``[max(a_j, a_{j-1} + block_k),
a_j + block_k) ∩ [0, kv_len)``), so windows tiled independently over overlapping ranges never
count a key twice. Entries with ``a_j <= -block_k`` or ``a_j >= kv_len`` contribute nothing.

Every array has leading dims ``[B|1, N|1]``: a size-1 batch or head dim is broadcast, so one
dense-causal list serves all heads. Block and column lists (and their counts) may also have a
size-1 query-block dim: one list shared by every query block, each row using its own count
(the dense-causal layout is one ``arange`` list plus per-row counts).

Contract on the values (what a layout must hold; the kernel adds up what it is given)
------------------------------------------------------------------------------------
1. ``0 <= kv_block_count <= max_blocks`` and ``0 <= kv_column_count <= max_cols``;
2. the first ``kv_block_count`` ids of a list lie in ``[0, num_kv_blocks)`` and are
   distinct (with ``kv_windows``: starts in ``(-block_k, kv_len)``, strictly ascending); the first
   ``kv_column_count`` columns lie in ``[0, kv_len)``, are distinct and fall in no listed block
   or window (a repeated key would be counted twice: + ln 2 on the lse);
3. ``q_perm`` / ``kv_perm`` are permutations of ``0 .. q_len - 1`` / ``0 .. kv_len - 1``.

Every builder in this project guarantees 1-3 by construction (`dense_causal`,
`from_block_mask`, `random_causal`, and every pattern and boundary wrapper of ``mmjax.sparse``;
the tests check them with the same checks). `block_sparse_attention` checks concrete layouts before
tracing; a traced layout cannot be checked there, so both implementations neutralise what is
cheap to neutralise: counts are clamped into range, ids and columns out of range contribute
nothing, permutation entries are clamped into range. Repeated ids and non-permutations are
not neutralised (it would cost a sort per call): a layout built by other code inside
``jax.jit`` should be checked with `BlockLayout.check` under ``checkify``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from pallas_kernels.tiling import cdiv, inverse_permutation


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Block-sparse attention layout (a pytree; sizes are static).

    Attributes:
      kv_blocks: int32 ``[B|1, N|1, nq|1, max_blocks]`` key-block ids per query block,
        ``nq = ceil(q_len / block_q)``. Entries past the count are ignored.
      kv_block_count: int32 ``[B|1, N|1, nq]`` number of valid entries in ``kv_blocks``.
      kv_columns: optional int32 ``[B|1, N|1, nq|1, max_cols]`` single key indices (permuted
        key order) computed in addition to the blocks, gathered into dense tiles.
      kv_column_count: int32 ``[B|1, N|1, nq]``, required with ``kv_columns``.
      q_perm: optional int32 ``[B|1, N|1, q_len]``: original query index of each permuted row.
      kv_perm: optional int32 ``[B|1, N|1, kv_len]``: original key index of each permuted key.
      block_q, block_k: block sizes (static).
      q_len, kv_len: the sequence lengths T and S the layout was built for (static).
      gap: causal gap (static, >= 0): with causal attention a query at position p sees
        keys at positions <= p - gap (0: plain causal).
      window: causal window (static, >= 0): with causal attention a query at position p sees
        keys at positions > p - window only (0: no window).
      kv_windows: ``kv_blocks`` holds key-window starts rather than block ids (static; module
        docstring, "Key windows").
      window_align: with ``kv_windows``, every listed window start > 0 is a multiple of this (static,
        >= 1; 1 = any start; a start <= 0 computes from key 0). A promise the builder makes (checked on
        concrete layouts): the Mosaic GPU kernel loads a window starting on a multiple of 8 as one tile,
        else as two, so `mosaic_options.preferred` takes window layouts only with ``window_align % 8 == 0``.
      q_block_range: None, or static ``(lo, hi)`` with ``0 <= lo < hi <= nq``: a promise that only the query blocks
        ``[lo, hi)`` list anything (every other count, of blocks and of columns, is 0; checked on concrete
        layouts). A part with work in a few query blocks (TriShape's last rows, Grid's horizontal lines) then runs
        on those rows alone: the Mosaic GPU kernel takes their lists in chunks, one work item each, and merges
        the chunks (`mosaic_lists.ROW_CHUNK`), and `mmjax.sparse.layouts.attend` merges only those rows.
      q_row_stride: 0, or a static promise about ``q_perm`` (checked on concrete layouts): the rows of every query
        block are its first row plus multiples of this stride, ``q_perm[i * block_q + j] = q_perm[i * block_q] +
        j * q_row_stride``, the first row's frame ``q_perm[i * block_q] // q_row_stride`` a multiple of 8 (Grid's
        phase-major rows: one phase, ``block_q`` consecutive frames from a multiple of ``block_q``), with ``q_len``
        a multiple of the stride and of ``block_q``. The Mosaic GPU kernel then reads Q and writes O as strided
        boxes of the original arrays (no gather of q, no output put back, `mosaic_gpu.strided_rows`); the other
        implementations use ``q_perm`` as always.
    """

    kv_blocks: jax.Array
    kv_block_count: jax.Array
    kv_columns: jax.Array | None = None
    kv_column_count: jax.Array | None = None
    q_perm: jax.Array | None = None
    kv_perm: jax.Array | None = None
    block_q: int = dataclasses.field(default=128, metadata=dict(static=True))
    block_k: int = dataclasses.field(default=128, metadata=dict(static=True))
    q_len: int = dataclasses.field(default=0, metadata=dict(static=True))
    kv_len: int = dataclasses.field(default=0, metadata=dict(static=True))
    gap: int = dataclasses.field(default=0, metadata=dict(static=True))
    window: int = dataclasses.field(default=0, metadata=dict(static=True))
    kv_windows: bool = dataclasses.field(default=False, metadata=dict(static=True))
    window_align: int = dataclasses.field(default=1, metadata=dict(static=True))
    q_block_range: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))
    q_row_stride: int = dataclasses.field(default=0, metadata=dict(static=True))

    # ------------------------------------------------------------------ sizes
    @property
    def num_q_blocks(self) -> int:
        return cdiv(self.q_len, self.block_q)

    @property
    def num_kv_blocks(self) -> int:
        return cdiv(self.kv_len, self.block_k)

    @property
    def max_blocks(self) -> int:
        return int(self.kv_blocks.shape[-1])

    @property
    def max_columns(self) -> int:
        return 0 if self.kv_columns is None else int(self.kv_columns.shape[-1])

    @property
    def q_offset(self) -> int:
        """Original position of query 0 (queries are the last ``q_len`` positions)."""
        return self.kv_len - self.q_len

    @property
    def lead_shape(self) -> tuple[int, int]:
        """The ``[B|1, N|1]`` leading dims shared by all arrays."""
        return tuple(int(d) for d in self.kv_block_count.shape[:2])  # type: ignore[return-value]

    # ----------------------------------------------------------- constructors
    @classmethod
    def dense_causal(
        cls,
        q_len: int,
        kv_len: int,
        *,
        block_q: int = 128,
        block_k: int = 128,
        batch: int = 1,
        heads: int = 1,
    ) -> "BlockLayout":
        """Every key block that some query of the block may see causally.

        Returns a layout with leading dims ``[batch, heads]`` (default ``[1, 1]``, broadcast).
        """
        _check_sizes(q_len, kv_len, block_q, block_k)
        nq, nk = cdiv(q_len, block_q), cdiv(kv_len, block_k)
        offset = kv_len - q_len
        last_q = np.minimum((np.arange(nq) + 1) * block_q, q_len) - 1 + offset
        count = (last_q // block_k + 1).astype(np.int32)
        blocks = np.arange(nk, dtype=np.int32)[None, None, None]  # one list for every row
        return cls(
            kv_blocks=jnp.asarray(blocks),
            kv_block_count=jnp.asarray(np.broadcast_to(count, (batch, heads, nq))),
            block_q=block_q,
            block_k=block_k,
            q_len=q_len,
            kv_len=kv_len,
        )

    @classmethod
    def from_block_mask(
        cls,
        mask: jax.Array,
        *,
        q_len: int,
        kv_len: int,
        block_q: int = 128,
        block_k: int = 128,
        max_blocks: int | None = None,
        kv_columns: jax.Array | None = None,
        kv_column_count: jax.Array | None = None,
        q_perm: jax.Array | None = None,
        kv_perm: jax.Array | None = None,
    ) -> "BlockLayout":
        """Boolean ``[B, N, nq, nk]`` block mask -> ascending key-block lists. jit-able.

        ``max_blocks`` (static) bounds the list length; it defaults to ``nk``. Rows with more
        than ``max_blocks`` set blocks keep their lowest ``max_blocks`` ids.
        """
        _check_sizes(q_len, kv_len, block_q, block_k)
        nq, nk = cdiv(q_len, block_q), cdiv(kv_len, block_k)
        if mask.ndim != 4 or tuple(mask.shape[2:]) != (nq, nk):
            raise ValueError(
                f"mask: expected a boolean array of shape [B, N, {nq}, {nk}] "
                f"(nq = ceil(q_len / block_q), nk = ceil(kv_len / block_k)); received "
                f"shape {tuple(mask.shape)}"
            )
        if mask.dtype != jnp.bool_:
            raise ValueError(f"mask: expected dtype bool; received {mask.dtype}")
        max_blocks = nk if max_blocks is None else int(max_blocks)
        if not 1 <= max_blocks <= nk:
            raise ValueError(f"max_blocks: expected 1 <= max_blocks <= {nk}; received {max_blocks}")
        mask = jnp.asarray(mask)
        # Stable sort of "not set" puts set blocks first, in ascending id order.
        order = jnp.argsort(~mask, axis=-1, stable=True)[..., :max_blocks].astype(jnp.int32)
        count = jnp.minimum(mask.sum(-1), max_blocks).astype(jnp.int32)
        valid = jnp.arange(max_blocks) < count[..., None]
        blocks = jnp.where(valid, order, 0).astype(jnp.int32)
        return cls(
            kv_blocks=blocks,
            kv_block_count=count,
            kv_columns=kv_columns,
            kv_column_count=kv_column_count,
            q_perm=q_perm,
            kv_perm=kv_perm,
            block_q=block_q,
            block_k=block_k,
            q_len=q_len,
            kv_len=kv_len,
        )

    @classmethod
    def random_causal(
        cls,
        key: jax.Array,
        q_len: int,
        kv_len: int,
        *,
        keep: float,
        block_q: int = 128,
        block_k: int = 128,
        batch: int = 1,
        heads: int = 1,
        always_diagonal: bool = True,
    ) -> "BlockLayout":
        """Random layout keeping about ``keep`` of each query block's causal key blocks.

        Used by tests and benchmarks. Each row keeps ``max(1, round(keep * n_causal))``
        distinct causal blocks chosen uniformly (the diagonal block first when
        ``always_diagonal``), listed in ascending order. Drawn one (batch, head) at a time
        (``lax.map`` over split keys) from one float32 ``[nq, nk]`` score array, so a layout
        of 28 heads at 1M tokens with 64-key blocks needs 0.5 GB of scores, not 15 GB.
        """
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"keep: expected 0 < keep <= 1; received {keep}")
        dense = cls.dense_causal(q_len, kv_len, block_q=block_q, block_k=block_k)
        nq, nk = dense.num_q_blocks, dense.num_kv_blocks
        n_causal = dense.kv_block_count[0, 0]  # [nq]
        count = jnp.maximum(1, jnp.round(keep * n_causal)).astype(jnp.int32)
        max_blocks = int(min(nk, max(1, math.ceil(keep * nk) + 1)))
        ids = jnp.arange(nk, dtype=jnp.int32)
        causal = ids[None, :] < n_causal[:, None]
        valid = jnp.arange(max_blocks) < count[:, None]

        def one_head(k: jax.Array) -> jax.Array:  # [nq, max_blocks] ascending ids
            scores = jnp.where(causal, jax.random.uniform(k, (nq, nk)), -1.0)
            if always_diagonal:
                scores = jnp.where(ids[None, :] == (n_causal - 1)[:, None], 2.0, scores)
            _, picked = jax.lax.top_k(scores, max_blocks)
            picked = jnp.where(valid, picked, nk)  # invalid entries sort last
            return jnp.sort(picked, axis=-1)

        blocks = jax.lax.map(one_head, jax.random.split(key, batch * heads))
        blocks = jnp.where(blocks == nk, 0, blocks).astype(jnp.int32).reshape(batch, heads, nq, max_blocks)
        return cls(
            kv_blocks=blocks,
            kv_block_count=jnp.broadcast_to(count, (batch, heads, nq)),
            block_q=block_q,
            block_k=block_k,
            q_len=q_len,
            kv_len=kv_len,
        )

    # ----------------------------------------------------------- inspection
    def positions(self) -> tuple[jax.Array, jax.Array]:
        """Original positions of permuted rows: (q_pos ``[B|1,N|1,T]``, k_pos ``[B|1,N|1,S]``)."""
        q_idx = (
            jnp.arange(self.q_len, dtype=jnp.int32)[None, None]
            if self.q_perm is None
            else self.q_perm.astype(jnp.int32)
        )
        k_idx = (
            jnp.arange(self.kv_len, dtype=jnp.int32)[None, None]
            if self.kv_perm is None
            else self.kv_perm.astype(jnp.int32)
        )
        return q_idx + self.q_offset, k_idx

    def range_rows(self) -> jax.Array:
        """int32 ``[B|1, N|1, R]``: the original query index of each row of the query blocks ``q_block_range``
        names (``R = (hi - lo) * block_q``, in permuted row order), ``q_len`` for rows past the last query."""
        if self.q_block_range is None:
            raise ValueError("layout.q_block_range: expected (lo, hi) for range_rows; received None")
        lo, hi = self.q_block_range
        t = self.q_len
        r = lo * self.block_q + jnp.arange((hi - lo) * self.block_q, dtype=jnp.int32)
        if self.q_perm is None:
            return jnp.where(r < t, r, t)[None, None]
        perm = jnp.take(self.q_perm.astype(jnp.int32), jnp.minimum(r, t - 1), axis=-1)
        return jnp.where(r < t, jnp.clip(perm, 0, t - 1), t)

    def computed_pairs_permuted(self) -> jax.Array:
        """bool ``[B|1, N|1, T, S]`` in permuted order: (row, key) pairs the layout computes,
        before the causal mask. Materialises T x S: for tests and small inputs only."""
        nk = self.num_kv_blocks
        lead = self.kv_blocks.shape[:2]
        if self.kv_windows:
            starts, count = self._full_lists()
            keys, ok = window_keys(starts, count, self.block_k, self.kv_len)
            flat = jnp.where(ok, keys, self.kv_len).reshape(-1, self.max_blocks * self.block_k)
            key_mask = jnp.zeros((flat.shape[0], self.kv_len + 1), bool)
            key_mask = key_mask.at[jnp.arange(flat.shape[0])[:, None], flat].set(True)[:, : self.kv_len]
            key_mask = key_mask.reshape(count.shape + (self.kv_len,))  # [b, n, nq, S]
            pairs = jnp.repeat(key_mask, self.block_q, axis=2)[:, :, : self.q_len]
            lead = count.shape[:2]
        else:
            valid = jnp.arange(self.max_blocks) < self.kv_block_count[..., None]
            onehot = jax.nn.one_hot(jnp.where(valid, self.kv_blocks, nk), nk + 1, dtype=jnp.int32)
            block_mask = onehot[..., :nk].sum(-2) > 0  # [b, n, nq, nk]
            pairs = jnp.repeat(jnp.repeat(block_mask, self.block_q, axis=2), self.block_k, axis=3)
            pairs = pairs[:, :, : self.q_len, : self.kv_len]
        if self.kv_columns is not None:
            cvalid = jnp.arange(self.max_columns) < self.kv_column_count[..., None]
            cols = jnp.where(cvalid & (self.kv_columns >= 0) & (self.kv_columns < self.kv_len), self.kv_columns,
                             self.kv_len)  # unused slots and ids out of range land past the end
            rows = cols.reshape(-1, cols.shape[-1])  # one scatter row per (b, n, query block): nq x S memory
            col_mask = jnp.zeros((rows.shape[0], self.kv_len + 1), bool)
            col_mask = col_mask.at[jnp.arange(rows.shape[0])[:, None], rows].set(True)[:, : self.kv_len]
            col_mask = col_mask.reshape(cols.shape[:-1] + (self.kv_len,))  # [b, n, nq, S]
            col_rows = jnp.repeat(col_mask, self.block_q, axis=2)[:, :, : self.q_len]
            lead = jnp.broadcast_shapes(lead, self.kv_columns.shape[:2])
            pairs = jnp.broadcast_to(pairs, lead + pairs.shape[2:]) | col_rows
        return pairs

    def to_dense_mask(self, causal: bool = True) -> jax.Array:
        """bool ``[B|1, N|1, T, S]`` in *original* order: the attention mask this layout
        computes (causal on original positions when ``causal``). For tests; T x S memory."""
        pairs = self.computed_pairs_permuted()
        q_pos, k_pos = self.positions()
        lead = jnp.broadcast_shapes(pairs.shape[:2], q_pos.shape[:2], k_pos.shape[:2])
        pairs = jnp.broadcast_to(pairs, lead + pairs.shape[2:])
        q_pos = jnp.broadcast_to(q_pos, lead + q_pos.shape[2:])
        k_pos = jnp.broadcast_to(k_pos, lead + k_pos.shape[2:])
        if causal:
            pairs = pairs & (k_pos[..., None, :] + self.gap <= q_pos[..., :, None])
            if self.window:
                pairs = pairs & (k_pos[..., None, :] + self.window > q_pos[..., :, None])
        # Scatter permuted rows/cols back to original order.
        q_orig = q_pos - self.q_offset
        inv_q = inverse_permutation(q_orig)
        inv_k = inverse_permutation(k_pos)
        pairs = jnp.take_along_axis(pairs, inv_q[..., :, None], axis=-2)
        pairs = jnp.take_along_axis(pairs, inv_k[..., None, :], axis=-1)
        return pairs

    def density(self, causal: bool = True) -> jax.Array:
        """float32 ``[B|1, N|1]``: computed query-key pairs (whole tiles the kernel
        multiplies, clipped to the valid T x S range) over the pairs of causal attention
        (or of full attention when not ``causal``). 1.0 for the dense causal layout up to
        the diagonal tiles; the FLOP fraction the kernel does relative to dense."""
        nq, nk = self.num_q_blocks, self.num_kv_blocks
        # float32 throughout: pair counts overflow int32 beyond ~64k tokens.
        rows = jnp.minimum(self.block_q, self.q_len - jnp.arange(nq) * self.block_q).astype(jnp.float32)
        cols_per_block = jnp.minimum(
            self.block_k, self.kv_len - jnp.arange(nk) * self.block_k
        ).astype(jnp.float32)  # [nk]
        valid = jnp.arange(self.max_blocks) < self.kv_block_count[..., None]
        if self.kv_windows:  # whole windows (the kernel multiplies all block_k keys), clipped to [0, S)
            a = self.kv_blocks
            width = jnp.clip(jnp.minimum(a + self.block_k, self.kv_len) - jnp.maximum(a, 0), 0, self.block_k)
            keys = jnp.where(valid, width.astype(jnp.float32), 0.0).sum(-1)
        else:
            ids = jnp.clip(self.kv_blocks, 0, nk - 1)
            keys = jnp.where(valid, cols_per_block[ids], 0.0).sum(-1)  # [b, n, nq]
        if self.kv_columns is not None:
            keys = keys + self.kv_column_count.astype(jnp.float32)
        computed = (keys * rows).sum(-1)
        if causal:
            total = causal_pairs(self.q_len, self.kv_len)
        else:
            total = float(self.q_len * self.kv_len)
        return computed / jnp.float32(total)

    def _full_lists(self) -> tuple[jax.Array, jax.Array]:
        """(kv_blocks ``[B|1, N|1, nq, max_blocks]``, kv_block_count ``[B|1, N|1, nq]``) with a shared
        list (query-block dim 1) repeated for every query block."""
        lead = jnp.broadcast_shapes(self.kv_blocks.shape[:3], self.kv_block_count.shape)
        return (jnp.broadcast_to(self.kv_blocks, lead + (self.max_blocks,)),
                jnp.broadcast_to(self.kv_block_count, lead))

    def replace(self, **changes: Any) -> "BlockLayout":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------ contract
    def check(self) -> None:
        """Check the value contract (module docstring, 1-3) with ``jax.experimental.checkify``.

        Eagerly a violation raises ``checkify.JaxRuntimeError`` naming the field; inside
        ``jax.jit`` wrap the caller: ``err, out = checkify.checkify(f)(...); err.throw()``.
        Memory O(B * N * nq * (max_blocks + max_cols) + B * N * (T + S))."""
        nk, mb = self.num_kv_blocks, self.max_blocks
        count = self.kv_block_count
        checkify.check(jnp.all((count >= 0) & (count <= mb)),
                       f"layout.kv_block_count: expected 0 <= count <= max_blocks={mb}; received values in "
                       "[{lo}, {hi}]", lo=jnp.min(count), hi=jnp.max(count))
        lead = jnp.broadcast_shapes(self.kv_blocks.shape[:3], count.shape)
        blocks = jnp.broadcast_to(self.kv_blocks, lead + (mb,))
        used = jnp.arange(mb) < jnp.broadcast_to(count, lead)[..., None]
        ids = jnp.where(used, blocks, 0)
        if self.kv_windows:
            checkify.check(jnp.all((ids > -self.block_k) & (ids < self.kv_len)),
                           f"layout.kv_blocks: expected window starts in ({-self.block_k}, {self.kv_len}) "
                           f"(kv_windows, block_k={self.block_k}); received starts in [{{lo}}, {{hi}}]",
                           lo=jnp.min(ids), hi=jnp.max(ids))
            checkify.check(~jnp.any(used[..., 1:] & (blocks[..., 1:] <= blocks[..., :-1])),
                           "layout.kv_blocks: expected strictly ascending window starts per query block "
                           "(kv_windows)")
            checkify.check(jnp.all((ids <= 0) | (ids % self.window_align == 0)),
                           f"layout.kv_blocks: expected window starts > 0 that are multiples of window_align="
                           f"{self.window_align}")
            listed = jnp.where(used, blocks, self.kv_len + self.block_k)  # ascending, unused last
        else:
            checkify.check(jnp.all((ids >= 0) & (ids < nk)),
                           f"layout.kv_blocks: expected listed ids in [0, {nk}) (kv_len={self.kv_len}, "
                           f"block_k={self.block_k}); received ids in [{{lo}}, {{hi}}]",
                           lo=jnp.min(ids), hi=jnp.max(ids))
            listed = jnp.sort(jnp.where(used, blocks, nk + jnp.arange(mb)), axis=-1)  # unused: distinct, last
            checkify.check(~jnp.any(listed[..., 1:] == listed[..., :-1]),
                           "layout.kv_blocks: expected distinct ids per query block; received a repeated id "
                           "(it would be counted twice)")
        if (self.kv_columns is None) != (self.kv_column_count is None):
            raise ValueError("layout.kv_columns / kv_column_count: expected both or neither")
        if self.kv_columns is not None:
            mc = self.max_columns
            ccount = self.kv_column_count
            checkify.check(jnp.all((ccount >= 0) & (ccount <= mc)),
                           f"layout.kv_column_count: expected 0 <= count <= max_cols={mc}; received values in "
                           "[{lo}, {hi}]", lo=jnp.min(ccount), hi=jnp.max(ccount))
            clead = jnp.broadcast_shapes(lead, self.kv_columns.shape[:3], ccount.shape)
            cols = jnp.broadcast_to(self.kv_columns, clead + (mc,))
            cused = jnp.arange(mc) < jnp.broadcast_to(ccount, clead)[..., None]
            cids = jnp.where(cused, cols, 0)
            checkify.check(jnp.all((cids >= 0) & (cids < self.kv_len)),
                           f"layout.kv_columns: expected key indices in [0, {self.kv_len}); received indices in "
                           "[{lo}, {hi}]", lo=jnp.min(cids), hi=jnp.max(cids))
            csorted = jnp.sort(jnp.where(cused, cols, self.kv_len + jnp.arange(mc)), axis=-1)
            checkify.check(~jnp.any(csorted[..., 1:] == csorted[..., :-1]),
                           "layout.kv_columns: expected distinct columns per query block; received a repeated "
                           "column (it would be counted twice)")
            rows = jnp.broadcast_to(listed, clead + (mb,)).reshape(-1, mb)
            if self.kv_windows:  # the last start <= column, and the column inside its window
                cpos = jnp.where(cused, cids, -2 * self.block_k).reshape(-1, mc)
                pos = jax.vmap(lambda a, c: jnp.searchsorted(a, c, side="right"))(rows, cpos) - 1
                start = jnp.take_along_axis(rows, jnp.maximum(pos, 0), axis=-1)
                hit, cblk = (pos >= 0) & (cpos < start + self.block_k), cpos
            else:
                cblk = jnp.where(cused, cids // self.block_k, -1).reshape(-1, mc)
                pos = jax.vmap(jnp.searchsorted)(rows, cblk)
                hit = jnp.take_along_axis(rows, jnp.minimum(pos, mb - 1), axis=-1) == cblk
            checkify.check(~jnp.any(hit & (cblk >= 0)),
                           "layout.kv_columns: expected columns outside the listed key blocks; received a "
                           "column inside one (it would be counted twice)")
        if self.q_block_range is not None:
            lo, hi = self.q_block_range
            outside = (jnp.arange(self.num_q_blocks) < lo) | (jnp.arange(self.num_q_blocks) >= hi)
            for name, c in (("kv_block_count", count), ("kv_column_count", self.kv_column_count)):
                if c is not None:
                    checkify.check(~jnp.any(outside & (c > 0)),
                                   f"layout.{name}: expected 0 outside q_block_range={self.q_block_range}")
        for name, length in (("q_perm", self.q_len), ("kv_perm", self.kv_len)):
            perm = getattr(self, name)
            if perm is not None:
                checkify.check(jnp.all(jnp.sort(perm, axis=-1) == jnp.arange(length)),
                               f"layout.{name}: expected a permutation of 0..{length - 1} per (batch, head)")
        if self.q_row_stride:
            checkify.check(jnp.all(strided_rows_hold(self)),
                           f"layout.q_perm: expected the rows of each query block to step by q_row_stride="
                           f"{self.q_row_stride} from its first row")


def strided_rows_hold(layout: BlockLayout, xp=jnp) -> jax.Array:
    """bool ``[B|1, N|1, nq]``: query block i's rows are ``q_perm[i * block_q] + j * q_row_stride``, its first
    row's frame a multiple of 8 (the ``q_row_stride`` promise; False everywhere without ``q_perm``, a stride, or
    ``q_len`` a multiple of ``block_q`` and of the stride). ``xp``: ``numpy`` for a host ``q_perm`` (the value
    checks: computed there, they stay concrete inside a jit trace)."""
    st, bq, t = layout.q_row_stride, layout.block_q, layout.q_len
    if layout.q_perm is None or st <= 0 or t % bq or t % st:
        lead = (1, 1) if layout.q_perm is None else layout.q_perm.shape[:2]
        return xp.zeros(lead + (layout.num_q_blocks,), bool)
    rows = layout.q_perm.reshape(layout.q_perm.shape[:2] + (t // bq, bq))
    return xp.all(rows == rows[..., :1] + st * xp.arange(bq), axis=-1) & ((rows[..., 0] // st) % 8 == 0)


def window_keys(starts: jax.Array, count: jax.Array, block_k: int, kv_len: int) -> tuple[jax.Array, jax.Array]:
    """Keys of key windows (``kv_windows`` layouts). starts int32 ``[..., W]`` (ascending), count
    ``[...]`` -> (keys int32 ``[..., W, block_k]``: ``a_j + i``, computed bool ``[..., W, block_k]``):
    listed, inside ``[0, kv_len)`` and not before the previous window's end (module docstring)."""
    w = starts.shape[-1]
    first = jnp.full(starts.shape[:-1] + (1,), -(2 ** 30), starts.dtype)
    prev_end = jnp.concatenate([first, starts[..., :-1]], axis=-1) + block_k
    keys = starts[..., None] + jnp.arange(block_k, dtype=starts.dtype)
    listed = jnp.arange(w) < count[..., None]
    ok = listed[..., None] & (keys >= prev_end[..., None]) & (keys >= 0) & (keys < kv_len)
    return keys, ok


def causal_pairs(q_len: int, kv_len: int) -> float:
    """Query-key pairs of causal attention when the queries are the last ``q_len`` of ``kv_len``
    positions (query t sees keys 0 .. kv_len - q_len + t)."""
    return q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2


def _check_sizes(q_len: int, kv_len: int, block_q: int, block_k: int) -> None:
    for name, val in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name}: expected a positive int; received {val!r}")
    if q_len > kv_len:
        raise ValueError(
            f"q_len: expected q_len <= kv_len (queries are the last q_len positions); "
            f"received q_len={q_len}, kv_len={kv_len}"
        )
    for name, val in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(val, (int, np.integer)) or val < 16 or val & (val - 1):
            raise ValueError(f"{name}: expected a power of two >= 16; received {val!r}")
