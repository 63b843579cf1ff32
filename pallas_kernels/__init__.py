"""Attention kernels (no notion of patterns, models or modalities).

One op per folder: `block_sparse/` (the core block-sparse flash attention).
"""

from pallas_kernels.block_sparse import (
    BlockLayout,
    block_sparse_attention,
    default_implementation,
    merge_attention,
)
from pallas_kernels.qsa_topk import QSATopKResult, qsa_topk

__all__ = ["BlockLayout", "QSATopKResult", "block_sparse_attention", "default_implementation",
           "merge_attention", "qsa_topk"]
