"""Block-sparse attention: the kernel every sparse pattern compiles to."""

from pallas_kernels.block_sparse.api import block_sparse_attention
from pallas_kernels.block_sparse.layout import BlockLayout
from pallas_kernels.block_sparse.merge import merge_attention

__all__ = ["BlockLayout", "block_sparse_attention", "merge_attention"]
