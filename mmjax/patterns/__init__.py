"""Sparse attention patterns. Each is a frozen dataclass of hyper-parameters whose
`build_layout(q, k)` estimates its index online (inside jit) and returns a layout."""

from mmjax.patterns.base import KernelOptions, Pattern
from mmjax.patterns.grid import Grid
from mmjax.patterns.momo import Momo
from mmjax.patterns.static import AShape, Dense, SFFixed, SFStrided, TriShape
from mmjax.patterns.vertical_slash import VerticalSlash

__all__ = ["AShape", "Dense", "Grid", "KernelOptions", "Momo", "Pattern", "SFFixed", "SFStrided", "TriShape",
           "VerticalSlash"]
from mmjax.patterns.boundary import KBoundary, NoBoundary, QBoundary, RowSplit, TwoDBoundary  # noqa: E402
__all__ += ["KBoundary", "NoBoundary", "QBoundary", "RowSplit", "TwoDBoundary"]
