"""The pattern protocol: a frozen dataclass of hyper-parameters that turns (q, k) into a
`BlockLayout` inside `jax.jit` (online index estimation), and attends with it.

Subclasses implement `build_layout`; patterns whose output is more than one block-sparse
pass (MOMO's delta correction) override `attend` as well.
"""

from __future__ import annotations

import abc
import dataclasses

import jax

from mmjax.layout_ops import AnyLayout, attend_layout


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the block-sparse kernel is run (static)."""

    implementation: str | None = None  # None: triton on GPU, reference on CPU
    interpret: bool = False
    sm_scale: float | None = None


class Pattern(abc.ABC):
    """Base class of every sparse pattern. Subclasses are frozen dataclasses.

    Shapes: q ``[B, T, N, D]`` (the last T of S positions), k/v ``[B, S, K, D]``.
    """

    block_q: int = 128
    block_k: int = 128

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad hyper-parameter."""

    @property
    def name(self) -> str:
        return type(self).__name__

    @abc.abstractmethod
    def build_layout(self, q: jax.Array, k: jax.Array, *, modality=None) -> AnyLayout:
        """Estimate the index online from q/k and return the layout (jit-able): a
        `BlockLayout`, or a `LayoutSet` of disjoint parts."""

    def build_placed(self, q: jax.Array, k: jax.Array, placement) -> AnyLayout:
        """The layout inside a boundary wrapper: rows and keys in the order and grouping of
        ``placement`` (`mmjax.placement.Placement`), rules on original positions. Patterns
        without a position-aware layout cannot run inside a wrapper."""
        raise ValueError(f"pattern: {self.name} has no position-aware layout, so it cannot run inside a "
                         f"boundary wrapper; expected Dense, AShape, TriShape, VerticalSlash or Grid")

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, modality=None,
               options: KernelOptions = KernelOptions()) -> tuple[jax.Array, jax.Array]:
        """out ``[B, T, N, D]``, lse ``[B, N, T]``: block-sparse attention on the built layout."""
        layout = self.build_layout(q, k, modality=modality)
        return attend_layout(q, k, v, layout, sm_scale=options.sm_scale,
                             implementation=options.implementation, interpret=options.interpret)


def check_positive(name: str, value, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value >= 1)
    if not ok:
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{name}: expected an int {bound}; received {value!r}")


def check_block(name: str, value) -> None:
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two >= 16; received {value!r}")
