"""Pure-JAX grouped matmul: ``jax.lax.ragged_dot`` (the definition of correct).

Fine on a CPU and for small inputs; XLA lowers ``ragged_dot`` (jax 0.11.2, CPU and CUDA) to a dense product
over an expanded ``[M, G * K]`` operand, so its memory and FLOPs grow with the number of groups G (a 16k-token
chunk of Qwen3-30B-A3B's experts asked for a 64 GiB buffer on an H200): the Triton kernel is the GPU path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs ``[M, K]``, rhs ``[G, K, N]``, group_sizes int32 ``[G]`` -> ``[M, N]`` in lhs's dtype (float32
    accumulation); rows past ``sum(group_sizes)`` are 0."""
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    rows = jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(rows[:, None], out, 0.0).astype(lhs.dtype)
