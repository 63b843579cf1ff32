"""The pattern protocol: a frozen dataclass of hyper-parameters that turns (q, k) into a
`BlockLayout` inside `jax.jit` (online index estimation), and attends with it.

Subclasses implement `build_layout`; patterns whose output is more than one block-sparse
pass (MOMO's delta correction) override `attend` as well.
"""

from __future__ import annotations

import abc

import jax

from mmjax.sparse.layouts import AnyLayout, KernelOptions, Layout, attend
from pallas_kernels.checks import check_pow2


class Pattern(abc.ABC):
    """Base class of every sparse pattern. Subclasses are frozen dataclasses.

    Shapes: q ``[B, T, N, D]`` (the last T of S positions), k/v ``[B, S, K, D]``.
    """

    block_q: int = 128
    block_k: int = 128

    def __post_init__(self) -> None:
        self.validate()
        check_pow2("block_q", self.block_q)
        check_pow2("block_k", self.block_k)

    def validate(self) -> None:
        """Raise ValueError naming the bad hyper-parameter (block sizes are checked after)."""

    @property
    def name(self) -> str:
        return type(self).__name__

    @abc.abstractmethod
    def build_layout(self, q: jax.Array, k: jax.Array, *, modality=None) -> Layout:
        """Estimate the index online from q/k and return the layout (jit-able): a
        `BlockLayout`, a `LayoutSet` of disjoint parts, or a `RowSplit` (boundary wrappers)."""

    def build_placed(self, q: jax.Array, k: jax.Array, placement) -> AnyLayout:
        """The layout inside a boundary wrapper: rows and keys in the order and grouping of
        ``placement`` (`mmjax.sparse.placement.Placement`), rules on original positions. Patterns
        without a position-aware layout cannot run inside a wrapper."""
        raise ValueError(f"pattern: {self.name} has no position-aware layout, so it cannot run inside a "
                         f"boundary wrapper; expected Dense, AShape, TriShape, VerticalSlash or Grid")

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, modality=None,
               options: KernelOptions = KernelOptions()) -> tuple[jax.Array, jax.Array]:
        """out ``[B, T, N, D]``, lse ``[B, N, T]``: block-sparse attention on the built layout."""
        return attend(q, k, v, self.build_layout(q, k, modality=modality), options)
