"""Block-sparse attention: the kernel every sparse pattern compiles to."""

from pallas_kernels.block_sparse.api import (
    block_sparse_attention,
    block_sparse_attention_parts,
    block_sparse_attention_rows,
)
from pallas_kernels.block_sparse.layout import BlockLayout
from pallas_kernels.block_sparse.merge import merge_attention, merge_attention_all, merge_rows, scatter_rows

__all__ = ["BlockLayout", "block_sparse_attention", "block_sparse_attention_parts", "block_sparse_attention_rows",
           "merge_attention",
           "merge_attention_all", "merge_rows", "scatter_rows"]
