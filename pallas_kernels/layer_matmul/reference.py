"""Pure-JAX layer matmul: the definition of correct (XLA slices the layer, then one matmul)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("layer",))
def layer_matmul_reference(x: jax.Array, w: jax.Array, *, layer: int) -> jax.Array:
    """x ``[M, K]``, w ``[L, K, N]`` -> ``x @ w[layer]`` ``[M, N]`` in x's dtype, float32 accumulation."""
    return jnp.dot(x, w[layer], preferred_element_type=jnp.float32).astype(x.dtype)
