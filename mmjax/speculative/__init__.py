"""Sparrow speculative decoding: HSR + VATA draft, dynamic draft trees, lossless verification."""

from mmjax.speculative.draft import DraftConfig, SparrowDraft
from mmjax.speculative.oracle import TargetDraft
from mmjax.speculative.sampling import Sampling
from mmjax.speculative.tree import TreeConfig

__all__ = ["DraftConfig", "Sampling", "SparrowDraft", "TargetDraft", "TreeConfig"]
