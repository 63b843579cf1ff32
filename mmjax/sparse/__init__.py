"""Modality-aware sparse prefill (MMInference, MOMO): patterns, layouts, estimation, modality,
pattern search, per-layer / per-head `SparseConfig`, recall and mass metrics.

Every pattern ends as a layout (`layouts.py`) that one block-sparse kernel computes.
"""

from mmjax.sparse import patterns
from mmjax.sparse.attention import attend_heads, attention_recall, build_layout, head_groups, sparse_attention
from mmjax.sparse.config import SparseConfig
from mmjax.sparse.layouts import KernelOptions, LayoutSet, RowSplit, attend
from mmjax.sparse.modality import Modality
from mmjax.sparse.pattern_search import Calibration, CalibrationRecorder, SearchSpace, search
from mmjax.sparse.plot import plot_layout

__all__ = ["Calibration", "CalibrationRecorder", "KernelOptions", "LayoutSet", "Modality", "RowSplit", "SearchSpace",
           "SparseConfig", "attend", "attend_heads", "attention_recall", "build_layout", "head_groups", "patterns",
           "plot_layout", "search", "sparse_attention"]
