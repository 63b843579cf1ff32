"""The candidate space of the pattern search (MMInference Table 3-like).

Every candidate is an intra-modality pattern; the search tries each one inside every
boundary type it is asked for. Hyper-parameters follow MMInference's search space: A-shape
sink / local sizes, Vertical-Slash vertical / slash sizes, Grid local band and line flags
(the Grid stride and phase are estimated online from ``grid_strides``).
"""

from __future__ import annotations

import dataclasses

from mmjax.sparse.patterns import AShape, Grid, Pattern, VerticalSlash
from mmjax.sparse.patterns.grid import DEFAULT_STRIDES

BOUNDARIES = ("NoBoundary", "KBoundary", "QBoundary", "TwoDBoundary")


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """Candidates: ``ashape`` (sink, local) pairs, ``vertical_slash`` (vertical_size,
    slash_size) pairs, ``grid_local`` band widths x ``grid_flags`` (use_hline, use_vline,
    use_slash); ``boundaries``: the boundary types tried, simplest first (ties go to the
    earlier one). ``last_q`` / blocks apply to every candidate."""

    ashape: tuple[tuple[int, int], ...] = ((128, 1024), (128, 2048), (1024, 4096))
    vertical_slash: tuple[tuple[int, int], ...] = ((1000, 1024), (1000, 4096), (2000, 8192))
    grid_local: tuple[int, ...] = (256, 1024)
    grid_flags: tuple[tuple[bool, bool, bool], ...] = ((True, True, True), (False, True, True))
    grid_strides: tuple[int, ...] = DEFAULT_STRIDES
    boundaries: tuple[str, ...] = BOUNDARIES
    last_q: int = 64
    block_q: int = 128
    block_k: int = 64

    def __post_init__(self) -> None:
        for name in ("ashape", "vertical_slash"):
            pairs = getattr(self, name)
            if not isinstance(pairs, tuple) or not all(
                    isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, int) for x in p) for p in pairs):
                raise ValueError(f"{name}: expected a tuple of (int, int) pairs; received {pairs!r}")
        if not isinstance(self.grid_local, tuple) or not all(isinstance(x, int) for x in self.grid_local):
            raise ValueError(f"grid_local: expected a tuple of ints; received {self.grid_local!r}")
        if not isinstance(self.grid_flags, tuple) or not all(
                isinstance(f, tuple) and len(f) == 3 and all(isinstance(x, bool) for x in f) for f in self.grid_flags):
            raise ValueError(f"grid_flags: expected a tuple of (bool, bool, bool) triples; received "
                             f"{self.grid_flags!r}")
        bad = [b for b in self.boundaries if b not in BOUNDARIES]
        if not self.boundaries or bad:
            raise ValueError(f"boundaries: expected a non-empty subset of {BOUNDARIES}; received "
                             f"{self.boundaries!r}")
        if not self.candidates():
            raise ValueError("space: expected at least one candidate pattern; received none")

    def candidates(self) -> tuple[Pattern, ...]:
        """The intra-modality candidates (each validated by its own constructor)."""
        blocks = dict(block_q=self.block_q, block_k=self.block_k)
        out: list[Pattern] = [AShape(sink=s, local=w, **blocks) for s, w in self.ashape]
        out += [VerticalSlash(vertical_size=v, slash_size=sl, last_q=self.last_q, **blocks)
                for v, sl in self.vertical_slash]
        out += [Grid(stride_space=self.grid_strides, local=w, use_hline=h, use_vline=vl, use_slash=sl,
                     last_q=self.last_q, **blocks)
                for w in self.grid_local for h, vl, sl in self.grid_flags]
        return tuple(out)
