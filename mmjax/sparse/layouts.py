"""What a pattern builds and how it is attended: `BlockLayout` parts, `LayoutSet`, `RowSplit`
and the one `attend(q, k, v, layout)`.

* `BlockLayout` (``pallas_kernels``): for each (batch, head, query block) the key blocks and
  single key columns to compute, optional row / key permutations; one kernel launch.
* `LayoutSet`: layouts over disjoint (query, key) pairs; attention over their union is the
  lse-merge of attention over each part (exact). Tri-shape, Grid and each (query, key)
  modality pair of a TwoDBoundary build one.
* `RowSplit`: layouts whose rows are owned by query modality (QBoundary / TwoDBoundary): row t
  takes the result of the part of its own kind (each part merged into one result on its kind's
  rows only).

``Layout`` is any of the three; ``AnyLayout`` a `BlockLayout` or a `LayoutSet` (what an inner
pattern builds). `KernelOptions` says how the kernel runs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import BlockLayout
from pallas_kernels.block_sparse import (
    block_sparse_attention_parts,
    block_sparse_attention_rows,
    merge_rows,
    scatter_rows,
)
from pallas_kernels.checks import check_sm_scale


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the block-sparse kernel is run (static). ``check_finite``: raise instead of
    propagating a NaN / inf input (see `pallas_kernels.block_sparse_attention`)."""

    implementation: str | None = None  # None: mosaic_gpu / triton on GPU (see block_sparse_attention; MOMO's QSA
    # + top-k: the fused Mosaic GPU kernel on Hopper, `Momo.qsa_kernel`), reference on CPU
    interpret: bool = False
    sm_scale: float | None = None
    check_finite: bool = False
    merge_in_launch: bool = False  # a LayoutSet's parts on the Mosaic GPU kernel each merge the result so far in
    # before their store (`block_sparse_attention_parts`); off: one H100, 128k, Grid(frame) 7.06 -> 6.95 ms

    def __post_init__(self) -> None:
        if self.implementation not in (None, "reference", "triton", "mosaic_gpu"):
            raise ValueError(f"implementation: expected None, 'reference', 'triton' or 'mosaic_gpu'; received "
                             f"{self.implementation!r}")
        for name in ("interpret", "check_finite", "merge_in_launch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool; received {getattr(self, name)!r}")
        if self.sm_scale is not None:
            check_sm_scale(self.sm_scale, 1)


class _Parts:
    """Sizes and density of a layout made of ``parts`` (every part is built for the same T, S)."""

    parts: tuple

    @property
    def q_len(self) -> int:
        return self.parts[0].q_len

    @property
    def kv_len(self) -> int:
        return self.parts[0].kv_len

    def density(self, causal: bool = True) -> jax.Array:
        """Tiles all the parts' kernel launches compute over the causal pairs, ``[B|1, N|1]``."""
        return summed_density(self.parts, causal)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayoutSet(_Parts):
    """Layouts that together list each (query, key) pair at most once; attention over the
    union is the lse-merge of attention over each part (exact)."""

    parts: tuple[BlockLayout, ...]

    def to_dense_mask(self, causal: bool = True) -> jax.Array:
        """bool ``[B|1, N|1, T, S]`` in original order (the union of the parts' masks)."""
        out = None
        for p in self.parts:
            m = p.to_dense_mask(causal)
            out = m if out is None else out | m
        return out


AnyLayout = BlockLayout | LayoutSet


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSplit(_Parts):
    """Layouts whose rows are owned by query modality: row t takes ``parts[i]``'s result
    where ``row_kind[b, t] == kinds[i]`` (rows of no listed kind give 0 / lse -inf).

    parts: one layout per kind (computed over all rows, or over a ``q_block_range``; rows it
    does not own are discarded). row_kind: int32 ``[B, T]``. kinds: static kind ids, one per part.
    """

    parts: tuple[AnyLayout, ...]
    row_kind: jax.Array
    kinds: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def to_dense_mask(self, causal: bool = True) -> jax.Array:
        """bool ``[B, N|1, T, S]`` in original order."""
        out = None
        for kind, part in zip(self.kinds, self.parts):
            m = part.to_dense_mask(causal) & (self.row_kind == kind)[:, None, :, None]
            out = m if out is None else out | m
        return out


Layout = BlockLayout | LayoutSet | RowSplit


def block_parts(layout: Layout) -> tuple[BlockLayout, ...]:
    """Every `BlockLayout` (one kernel launch each) of a layout, in order."""
    if isinstance(layout, RowSplit):
        return tuple(p for part in layout.parts for p in block_parts(part))
    return layout.parts if isinstance(layout, LayoutSet) else (layout,)


def with_parts(layout: AnyLayout, parts) -> AnyLayout:
    """The same kind of layout as ``layout`` (a `BlockLayout` or a `LayoutSet`) over ``parts``."""
    return LayoutSet(tuple(parts)) if isinstance(layout, LayoutSet) else parts[0]


def map_parts(layout: Layout, fn) -> Layout:
    """The same layout (a `BlockLayout`, `LayoutSet` or `RowSplit`, its structure kept) with ``fn`` applied to each of
    its `BlockLayout` parts (``fn``: `BlockLayout` -> `BlockLayout`)."""
    if isinstance(layout, RowSplit):
        return dataclasses.replace(layout, parts=tuple(map_parts(p, fn) for p in layout.parts))
    if not isinstance(layout, (BlockLayout, LayoutSet)):
        raise ValueError(f"layout: expected a BlockLayout, LayoutSet or RowSplit; received {type(layout).__name__}")
    return with_parts(layout, [fn(p) for p in block_parts(layout)])


def summed_density(parts, causal: bool = True) -> jax.Array:
    """Sum of the parts' densities (the tiles all their kernel launches compute), ``[B|1, N|1]``."""
    total = parts[0].density(causal)
    for p in parts[1:]:
        total = total + p.density(causal)
    return total


def attend(q: jax.Array, k: jax.Array, v: jax.Array, layout: Layout,
           options: KernelOptions = KernelOptions()) -> tuple[jax.Array, jax.Array]:
    """Block-sparse attention over any layout: out ``[B, T, N, D]`` (q's dtype), lse ``[B, N, T]``
    float32. A `LayoutSet`'s parts are merged by lse (the parts over all rows in one pass,
    `block_sparse_attention_parts`, or with ``options.merge_in_launch`` each Mosaic GPU launch merging the result so
    far in; parts with a ``q_block_range`` on their rows alone); a `RowSplit`'s rows each take the
    result of their own kind's parts. q ``[B, T, N, D]``, k/v ``[B, S, K, D]``."""
    kw = dict(sm_scale=options.sm_scale, implementation=options.implementation, interpret=options.interpret,
              check_finite=options.check_finite)
    if isinstance(layout, RowSplit):
        return _attend_row_split(q, k, v, layout, kw, options.merge_in_launch)
    parts = block_parts(layout)
    full = [p for p in parts if p.q_block_range is None]
    out, lse = (block_sparse_attention_parts(q, k, v, full, merge_in_launch=options.merge_in_launch, **kw) if full
                else (None, None))
    for part in parts:
        if part.q_block_range is not None:  # work in a few query blocks: computed and merged for those rows only
            rows, o, l = block_sparse_attention_rows(q, k, v, part, **kw)
            out, lse = scatter_rows(rows, o, l, q.shape[1]) if out is None else merge_rows(out, lse, rows, o, l)
    return out, lse


def _attend_row_split(q, k, v, layout: RowSplit, kw: dict, merge_in_launch: bool) -> tuple[jax.Array, jax.Array]:
    """`attend` of a `RowSplit`: each kind's parts over all rows are merged onto the result so far on the rows of
    that kind alone (`block_sparse_attention_parts` with a ``row_mask``: in one pass, `merge.merge_onto`, their lses
    -inf off the kind, so the merge leaves every other row as the result so far has it, and the first kind's merge
    writes the empty result, 0 / lse -inf, on the other rows: what rows of no listed kind keep; or with
    ``merge_in_launch`` in the Mosaic GPU launches' stores); then every kind's parts with a ``q_block_range`` (a kind
    with few rows, `boundary._kind_range`; Grid's horizontal lines) are merged on its rows alone (`merge_rows`, the
    other kinds' rows dropped). Merging into an empty row is exact, so each row gets its own kind's parts merged as
    a `LayoutSet` would merge them."""
    b, t = q.shape[0], q.shape[1]
    out = lse = None
    ranged = []
    for kind, part in zip(layout.kinds, layout.parts):
        parts = block_parts(part)
        ranged += [(kind, p) for p in parts if p.q_block_range is not None]
        full = [p for p in parts if p.q_block_range is None]
        if not full:
            continue
        out, lse = block_sparse_attention_parts(q, k, v, full, prior=None if out is None else (out, lse),
                                                row_mask=layout.row_kind == kind, merge_in_launch=merge_in_launch,
                                                **kw)
    if out is None:
        out, lse = jnp.zeros(q.shape, q.dtype), jnp.full((b, q.shape[2], t), -jnp.inf, jnp.float32)
    for kind, p in ranged:
        rows, o, l = block_sparse_attention_rows(q, k, v, p, **kw)
        rows = jnp.broadcast_to(rows, (b,) + rows.shape[1:])
        kind_of = jnp.take_along_axis(layout.row_kind[:, None], jnp.clip(rows, 0, t - 1), axis=-1)
        out, lse = merge_rows(out, lse, jnp.where((rows < t) & (kind_of == kind), rows, t), o, l)
    return out, lse
