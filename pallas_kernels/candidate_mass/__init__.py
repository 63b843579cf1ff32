"""Candidate mass: for each query block, the softmax mass its rows put on each of a few listed key blocks
(MOMO's re-rank of its candidate blocks with more rows than the sampled ones)."""

from pallas_kernels.candidate_mass.api import candidate_mass

__all__ = ["candidate_mass"]
