"""Vertical and slash scores of the last queries (the online index estimation of Vertical-Slash and Grid heads)."""

from pallas_kernels.last_q_scores.api import last_q_scores

__all__ = ["last_q_scores"]
