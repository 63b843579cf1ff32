"""The candidate space of the pattern search: MMInference's Table 3 by default.

Every candidate is an intra-modality pattern; the search tries each one inside every
boundary type it is asked for. The default space (24 candidates, as we read Table 3 and the
search list of MInference's ``mminference.py``):

* A-shape: sink 128 with a local window of 1k, 2k or 4k tokens (3);
* Vertical-Slash: (vertical, slash) sizes (1000, 1024), (1000, 2048), (2000, 2048),
  (1000, 3096), (2000, 3096), (1000, 4096), (2000, 4096), (3500, 200), (1000, 2500) (9);
* Grid: the stride of the video's frames (``"frame"``, from `Modality.frame_tokens`) or
  searched online up to ``max_stride`` 1024 (``"search"``), times the six non-empty
  combinations of (use_hline, use_vline, use_slash) (12), each with a main diagonal band of
  ``grid_local`` tokens.

"frame" candidates need the calibration's frame size; without it they are left out
(`candidates(frame_tokens=None)`). The search budget defaults to the cost of
``AShape(sink=1024, local=4096)`` (`algorithm.DEFAULT_BUDGET`), as in the paper.
"""

from __future__ import annotations

import dataclasses

from mmjax.sparse.patterns import AShape, Grid, Pattern, VerticalSlash
from mmjax.sparse.patterns.grid import STRIDE_SOURCES

BOUNDARIES = ("NoBoundary", "KBoundary", "QBoundary", "TwoDBoundary")
TABLE3_ASHAPE = ((128, 1024), (128, 2048), (128, 4096))
TABLE3_VERTICAL_SLASH = ((1000, 1024), (1000, 2048), (2000, 2048), (1000, 3096), (2000, 3096), (1000, 4096),
                         (2000, 4096), (3500, 200), (1000, 2500))
# (use_hline, use_vline, use_slash): the six combinations of MInference's search list
# (hline + slash without vline is not among them).
GRID_FLAGS = ((True, False, False), (False, True, False), (False, False, True), (True, True, False),
              (False, True, True), (True, True, True))


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """Candidates: ``ashape`` (sink, local) pairs, ``vertical_slash`` (vertical_size,
    slash_size) pairs, Grid ``grid_strides`` (stride sources "frame" / "search" or ints) x
    ``grid_flags`` (use_hline, use_vline, use_slash) x ``grid_local`` bands, each keeping the
    first ``grid_sink`` keys;
    ``grid_stride_space`` (None: the Grid default) / ``grid_max_stride`` bound the online
    stride search. ``boundaries``: the boundary types tried, simplest first (ties go to the
    earlier one). ``last_q`` / blocks apply to every candidate."""

    ashape: tuple[tuple[int, int], ...] = TABLE3_ASHAPE
    vertical_slash: tuple[tuple[int, int], ...] = TABLE3_VERTICAL_SLASH
    grid_strides: tuple[int | str, ...] = STRIDE_SOURCES
    grid_flags: tuple[tuple[bool, bool, bool], ...] = GRID_FLAGS
    grid_local: tuple[int, ...] = (128,)
    grid_sink: int = 0
    grid_stride_space: tuple[int, ...] | None = None
    grid_max_stride: int = 1024
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
        if not isinstance(self.grid_strides, tuple) or not all(
                x in STRIDE_SOURCES or (isinstance(x, int) and not isinstance(x, bool) and x >= 1)
                for x in self.grid_strides):
            raise ValueError(f"grid_strides: expected a tuple of {STRIDE_SOURCES} or ints >= 1; received "
                             f"{self.grid_strides!r}")
        if not isinstance(self.grid_flags, tuple) or not all(
                isinstance(f, tuple) and len(f) == 3 and all(isinstance(x, bool) for x in f) for f in self.grid_flags):
            raise ValueError(f"grid_flags: expected a tuple of (bool, bool, bool) triples; received "
                             f"{self.grid_flags!r}")
        bad = [b for b in self.boundaries if b not in BOUNDARIES]
        if not self.boundaries or bad:
            raise ValueError(f"boundaries: expected a non-empty subset of {BOUNDARIES}; received "
                             f"{self.boundaries!r}")
        if not self.candidates(frame_tokens=1 << 30):
            raise ValueError("space: expected at least one candidate pattern; received none")

    def candidates(self, frame_tokens: int | None = 1) -> tuple[Pattern, ...]:
        """The intra-modality candidates (each validated by its own constructor); Grid
        candidates with ``stride="frame"`` only when ``frame_tokens`` is known (not None)."""
        blocks = dict(block_q=self.block_q, block_k=self.block_k)
        out: list[Pattern] = [AShape(sink=s, local=w, **blocks) for s, w in self.ashape]
        out += [VerticalSlash(vertical_size=v, slash_size=sl, last_q=self.last_q, **blocks)
                for v, sl in self.vertical_slash]
        out += [Grid(stride=st, use_hline=h, use_vline=vl, use_slash=sl, local=w, sink=self.grid_sink,
                     last_q=self.last_q,
                     stride_space=self.grid_stride_space, max_stride=self.grid_max_stride, **blocks)
                for st in self.grid_strides if st != "frame" or frame_tokens is not None
                for h, vl, sl in self.grid_flags for w in self.grid_local]
        return tuple(out)
