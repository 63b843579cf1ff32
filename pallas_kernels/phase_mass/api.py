"""`phase_masses`: validation and dispatch to an implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.checks import fmt_shape
from pallas_kernels.phase_mass.reference import phase_masses_reference
from pallas_kernels.phase_mass.triton import MAX_STRIDE, phase_masses_triton
from pallas_kernels.platform import chosen_implementation

IMPLEMENTATIONS = ("reference", "triton")
# What ``implementation=None`` runs on a GPU: the kernel, with one top_k after it 2.0-2.5x faster than a reshape, sum
# and top_k per stride (one H100, 2026-12-07, `tools/phase_mass_bench.py`, 69 strides, 28 heads: 0.42 against 1.04 ms
# at 128k, 2.10 against 4.23 at 1M, the slash side's strided sums included in both).
DEFAULT_GPU_IMPLEMENTATION = "triton"


def phase_masses(vertical: jax.Array, strides, *, implementation: str | None = None,
                 interpret: bool = False) -> jax.Array:
    """The mass of ``vertical`` per phase for each of several strides (Grid's stride search).

    Args:
      vertical: float32 ``[B, N, S]``, scores per key position (e.g. `last_q_scores`' vertical scores).
      strides: a non-empty sequence of ints in ``[1, S]``.
      implementation: "reference" (XLA), "triton" (one kernel per power-of-two width; strides up to
        `triton.MAX_STRIDE`) or None: the reference, or Triton when ``interpret`` (`DEFAULT_GPU_IMPLEMENTATION` on a
        GPU); None runs the reference for strides past `triton.MAX_STRIDE`.

    Returns float32 ``[B, N, C, W]`` (C strides, W the largest stride rounded up to a power of two): entry
    ``[b, n, c, p]`` is the sum of ``vertical[b, n, j]`` over the positions j with ``j % strides[c] == p`` for p below
    ``strides[c]``, and -inf from there on (so one ``top_k`` over the last axis ranks every stride's phases).
    """
    if getattr(vertical, "ndim", None) != 3 or vertical.dtype != jnp.float32:
        raise ValueError(f"vertical: expected a float32 array [B, N, S]; received {getattr(vertical, 'dtype', None)} "
                         f"{fmt_shape(getattr(vertical, 'shape', ()))}")
    s = vertical.shape[-1]
    try:
        strides = tuple(strides)
    except TypeError:
        strides = ()
    if not strides or any(not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= s for x in strides):
        raise ValueError(f"strides: expected a non-empty sequence of ints in [1, S={s}]; received {strides!r}")
    chosen = chosen_implementation(implementation, interpret, IMPLEMENTATIONS, DEFAULT_GPU_IMPLEMENTATION)
    if chosen == "reference" or (implementation is None and max(strides) > MAX_STRIDE):
        return phase_masses_reference(vertical, strides)
    if max(strides) > MAX_STRIDE:
        raise ValueError(f"strides: expected at most {MAX_STRIDE} for implementation='triton' (a program's "
                         f"accumulator is [1, W]); received {max(strides)}; use implementation='reference'")
    return phase_masses_triton(vertical, strides, interpret=bool(interpret))
