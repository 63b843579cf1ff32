"""`mmjax.patterns`: the public name of the sparse patterns (defined in `mmjax.sparse.patterns`)."""

from mmjax.sparse.patterns import (
                                   AShape,
                                   Dense,
                                   Grid,
                                   KBoundary,
                                   KernelOptions,
                                   Momo,
                                   NoBoundary,
                                   Pattern,
                                   QBoundary,
                                   RowSplit,
                                   SFFixed,
                                   SFStrided,
                                   TriShape,
                                   TwoDBoundary,
                                   VerticalSlash,
)

__all__ = ["AShape", "Dense", "Grid", "KBoundary", "KernelOptions", "Momo", "NoBoundary", "Pattern", "QBoundary",
           "RowSplit", "SFFixed", "SFStrided", "TriShape", "TwoDBoundary", "VerticalSlash"]
