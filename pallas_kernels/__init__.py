"""Attention kernels (and the matmuls of MoE layers and decode steps) only: no notion of patterns, models or modalities.

One op per folder, each with ``api.py`` (validation, dispatch by ``implementation=``),
``reference.py`` (pure JAX, the definition of correct) and ``triton.py`` (Pallas Triton):

* ``block_sparse/``: attention over the (query block, key block) pairs of a `BlockLayout`;
  `merge_attention` combines results over disjoint key sets; `block_sparse_attention_rows` computes a layout
  whose work lies in a few query blocks (``q_block_range``) for those rows alone, `merge_rows` merges them in.
* ``qsa_topk/``: MOMO's fused query-sparse attention with an online top-k of key blocks.
* ``tree_decode/``: split-K attention of a few new tokens (a draft tree) over a long cache.
* ``candidate_mass/``: the softmax mass a query block's rows put on listed key blocks (MOMO's re-rank).
* ``last_q_scores/``: vertical (column) and slash (diagonal) sums of the last queries' attention (the index
  estimation of Vertical-Slash and Grid heads).
* ``grouped_matmul/``: rows grouped by a traced size per group, each group times its own matrix
  (the experts of a mixture-of-experts layer; ``jax.lax.ragged_dot``'s contract without its dense lowering).
* ``layer_matmul/``: a few rows times one layer of a stacked weight, read where it lies (decode steps).

Shared by the ops: ``checks.py`` (argument checks), ``platform.py`` (default implementation,
core count), ``tiling.py`` (ceil division, padding, softmax constants), ``nonfinite.py`` (the
NaN / inf contract every implementation follows, ``check_finite``), ``online_softmax.py`` (the
Triton kernels' softmax step).
"""

from pallas_kernels.block_sparse import BlockLayout, block_sparse_attention, merge_attention
from pallas_kernels.candidate_mass import candidate_mass
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.last_q_scores import last_q_scores
from pallas_kernels.layer_matmul import layer_matmul
from pallas_kernels.nonfinite import NonFiniteError
from pallas_kernels.platform import default_implementation
from pallas_kernels.qsa_topk import QSATopKResult, qsa_topk
from pallas_kernels.tree_decode import tree_decode_attention

__all__ = ["BlockLayout", "NonFiniteError", "QSATopKResult", "block_sparse_attention", "candidate_mass",
           "default_implementation",
           "grouped_matmul", "last_q_scores", "layer_matmul", "merge_attention", "qsa_topk", "tree_decode_attention"]
