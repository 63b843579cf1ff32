"""Decode-attention variants `mmjax bench decode` compares with XLA's dense attention
(``models.attention.dense_attention``), all with the ``models.attention`` protocol.

* `einsum_attention`: XLA's einsum form of dense attention at every batch size (the decode default
  before ``dense_attention`` took the multiply-reduce form of ``models.decode_attention`` for batched
  single-query steps on CUDA).
* `reduce_attention` (``models.decode_attention``): that multiply-reduce form at every batch size.
* `split_k_attention` (``models.decode_attention.split_k_decode_attention``): the split-K Pallas kernel of
  ``pallas_kernels.tree_decode`` at every cache length (the default takes it from ``SPLIT_K_MIN_SLOTS`` on).
"""

from __future__ import annotations

import functools

from models.attention import dense_attention
from models.decode_attention import split_k_decode_attention

einsum_attention = functools.partial(dense_attention, decode_form="einsum")
split_k_attention = split_k_decode_attention
