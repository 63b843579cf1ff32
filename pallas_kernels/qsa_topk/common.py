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
* Scan order (what the "estimated" top-k sees; the exact algorithms' results do not depend
  on it, so they always scan in id order). A tile of ``rows`` consecutive sampled rows (one
  kernel program) scans one key block per step ``i = 0 .. n_blocks - 1``. "natural": block
  ``j = i``. "golden": the tile's first ``n`` candidate blocks after the sink are offered in
  a golden-ratio order, ``j = sink_blocks + (i - sink_blocks) * a mod n`` for
  ``sink_blocks <= i < sink_blocks + n``, the rest in id order (`scan_table` gives ``n`` and
  ``a``). ``n`` is the first row's candidate count rounded down to 4 significant bits, so
  every row of the tile has all ``n`` as candidates, the tail left in id order is under
  1/8 of them, and the tiles whose first rows round to the same ``n`` share one order (they
  read the same key block at the same step, as all tiles do in id order; at 1M tokens with
  beta 64, 16 blocks per 64-row tile and ``n`` rounded to multiples of 512 or 1024, runs of
  32-64 consecutive tiles). "golden_pairs": the same with pairs of neighbouring blocks as the
  unit (``u = 2``): from ``start = sink_blocks`` rounded up to even, step ``start + 2 w + o``
  (``o`` in {0, 1}) offers block ``start + 2 (w * a mod n) + o``, so each pair of steps reads 128
  contiguous keys at 64-key blocks (the Mosaic GPU kernel's 128-key tiles); ``n`` counts pairs.
  Either way the row offers are exactly its candidates, at steps ``sink_blocks <= i < lo(p)``,
  so the offers still to come at step i are ``lo(p) - i`` in closed form.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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


SCAN_ORDERS = ("natural", "golden", "golden_pairs")
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
SCAN_BITS = 4  # significant bits kept of the permuted span (tail in id order < 1 / 2^(bits-1))


def golden_multiplier(n: int) -> int:
    """The integer nearest ``n * 0.618...`` that is coprime to ``n`` (searching upwards), so
    ``i -> i * a mod n`` is a permutation of ``0 .. n-1`` that visits the range evenly (a
    Fibonacci-lattice / Kronecker order)."""
    a = max(1, round(n * GOLDEN))
    while math.gcd(a, n) != 1:
        a += 1
    return a


def scan_unit(order: str) -> int:
    """Blocks per permuted unit of a scan order (module docstring): 2 for "golden_pairs", 1 for "golden", 0 for
    "natural" (nothing permuted)."""
    return {"golden_pairs": 2, "golden": 1}.get(order, 0)


def scan_start(sink_blocks: int, unit: int) -> int:
    """First step of the permuted range: ``sink_blocks`` rounded up to a multiple of ``unit``."""
    return cdiv(sink_blocks, unit) * unit


def scan_table(q_len: int, kv_len: int, *, gamma: int, block_kv: int, local: int,
               sink_blocks: int, rows: int, order: str) -> np.ndarray:
    """int32 ``[num_tiles, 2]``: (n, a) of each tile of ``rows`` sampled rows (see the
    module docstring; ``n`` in units of `scan_unit` blocks); ``n = 0`` means id order. Static
    (geometry only)."""
    num_tiles = cdiv(cdiv(q_len, gamma), rows)
    table = np.zeros((num_tiles, 2), np.int32)
    if order == "natural":
        return table
    unit = scan_unit(order)
    start = scan_start(sink_blocks, unit)
    for tile in range(num_tiles):
        first = tile * rows * gamma + kv_len - q_len
        n0 = (max(0, first - local) // block_kv - start) // unit
        if n0 < 3:
            continue
        shift = max(0, n0.bit_length() - SCAN_BITS)
        n = (n0 >> shift) << shift
        table[tile] = (n, golden_multiplier(n))
    return table


def scanned_block(i, n, a, *, sink_blocks: int, unit: int):
    """The block offered at step ``i`` (traced int32 scalars, or arrays) of a tile whose `scan_table` row is
    ``(n, a)``; for kernels. ``(w * a) mod n`` is computed directly in int32 (``w * a < n^2``: ``n`` below
    46341 units, 2.9M tokens of 64-key blocks)."""
    start = scan_start(sink_blocks, unit)
    p = jnp.maximum(i - start, 0)
    w = p // unit
    permuted = (i >= start) & (w < n)
    r = lax.rem(w * a, jnp.maximum(n, 1))
    return jnp.where(permuted, start + r * unit + (p - w * unit), i)


def scan_block_ids(table: np.ndarray, *, sink_blocks: int, n_steps: int, unit: int = 1) -> np.ndarray:
    """int32 ``[num_tiles, n_steps]``: the key block each tile scans at each step."""
    ids = np.tile(np.arange(n_steps, dtype=np.int64), (table.shape[0], 1))
    start = scan_start(sink_blocks, unit)
    for tile, (n, a) in enumerate(table):
        if n:
            units = start + ((np.arange(n, dtype=np.int64) * a) % n) * unit
            ids[tile, start: start + n * unit] = (units[:, None] + np.arange(unit)).reshape(-1)
    return ids.astype(np.int32)
