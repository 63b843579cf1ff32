"""Sparse attention patterns. Each is a frozen dataclass of hyper-parameters whose
`build_layout(q, k)` estimates its index online (inside jit) and returns a layout.

Intra-modality patterns: `Dense`, `AShape`, `TriShape`, `SFFixed`, `SFStrided` (static.py),
`VerticalSlash`, `Grid`, `Momo`. Boundary wrappers (boundary.py): `NoBoundary`, `KBoundary`,
`QBoundary`, `TwoDBoundary`.
"""

from mmjax.sparse.layouts import KernelOptions, RowSplit
from mmjax.sparse.patterns.base import Pattern
from mmjax.sparse.patterns.boundary import KBoundary, NoBoundary, QBoundary, TwoDBoundary
from mmjax.sparse.patterns.grid import Grid
from mmjax.sparse.patterns.momo import Momo
from mmjax.sparse.patterns.static import AShape, Dense, SFFixed, SFStrided, TriShape
from mmjax.sparse.patterns.vertical_slash import VerticalSlash

__all__ = ["AShape", "Dense", "Grid", "KBoundary", "KernelOptions", "Momo", "NoBoundary", "Pattern", "QBoundary",
           "RowSplit", "SFFixed", "SFStrided", "TriShape", "TwoDBoundary", "VerticalSlash"]
