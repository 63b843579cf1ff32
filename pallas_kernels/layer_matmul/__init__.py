"""Layer matmul: a few rows times one layer of a stacked weight ``[L, K, N]``, read where it lies (decode)."""

from pallas_kernels.layer_matmul.api import layer_matmul

__all__ = ["layer_matmul"]
