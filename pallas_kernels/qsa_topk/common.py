"""Conventions shared by the reference and the kernel: sampled rows, candidate blocks and
the result type.

* Sampled rows: query indices ``t = g * gamma`` (``t ≡ 0 mod gamma``), ``g = 0 .. Tg - 1``
  with ``Tg = ceil(T / gamma)``. Query ``t`` sits at position ``t + S - T`` (queries are
  the last T of S positions).
* Key blocks: ``j`` holds keys ``[j * block_kv, (j + 1) * block_kv)``.
* Candidates of the row at position ``p``: blocks ``sink_blocks <= j < lo(p)`` with
  ``lo(p) = max(0, p - local) // block_kv``: blocks that end before the local window
  ``[p - local, p]`` and are not sink blocks. Sink blocks, the window and the diagonal block
  are *forced* (the layout adds them); only candidates compete for the k slots, and all of
  them are fully visible to the row, so their scores are finite.
* Block score: ``S(j) = logsumexp_{c in block j} (q . k_c * sm_scale)`` (natural log).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.tiling import cdiv


class QSATopKResult(NamedTuple):
    """Output of `qsa_topk` (a pytree).

    Attributes:
      out_gamma: ``[B, Tg, N, D]`` (q.dtype) dense causal attention of the sampled rows.
      lse_gamma: ``[B, N, Tg]`` float32 log-sum-exp of those rows.
      block_idx: int32 ``[B, N, Tg, k]`` selected candidate blocks, by score descending then
        id ascending; ``-1`` for empty slots (rows with fewer than k candidates).
      block_score: float32 ``[B, N, Tg, k]`` their scores S(j); ``-inf`` for empty slots.
    """

    out_gamma: jax.Array
    lse_gamma: jax.Array
    block_idx: jax.Array
    block_score: jax.Array



def sampled_positions(q_len: int, kv_len: int, gamma: int) -> jax.Array:
    """int32 ``[Tg]`` positions of the sampled rows."""
    return jnp.arange(cdiv(q_len, gamma), dtype=jnp.int32) * gamma + (kv_len - q_len)


def candidate_end(pos: jax.Array, *, block_kv: int, local: int) -> jax.Array:
    """``lo(p)``: candidates of the row at ``pos`` are ``sink_blocks <= j < lo(p)``."""
    return jnp.maximum(pos - local, 0) // block_kv
