"""Grouped matmul: rows grouped by a (traced) size per group, each group times its own matrix (MoE experts)."""

from pallas_kernels.grouped_matmul.api import grouped_matmul

__all__ = ["grouped_matmul"]
