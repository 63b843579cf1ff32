"""Top-k mixture-of-experts MLP (Qwen3-MoE) as grouped matmuls (``jax.lax.ragged_dot``).

The (token, expert) pairs are sorted by expert, so each expert's rows are contiguous, and two
grouped matmuls (fused gate+up, then down) run every expert at once: no Python loop over experts, and the
work is that of the chosen experts only (on a GPU, ``ragged_dot`` lowers to a grouped GEMM). Callers
bound memory by passing sequence chunks (``models.common.map_chunks``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(h: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Router of transformers' ``Qwen3MoeTopKRouter``: softmax (float32) over the experts' logits,
    the ``top_k`` largest, renormalised to sum 1 when ``norm_topk_prob``.

    h: [M, H], router: [H, E] -> (weights [M, top_k] in h's dtype, expert ids int32 [M, top_k]).
    """
    logits = jnp.einsum("mh,he->me", h, router)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(h.dtype), experts.astype(jnp.int32)


def moe_mlp(h: jax.Array, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, top_k: int,
            norm_topk_prob: bool) -> jax.Array:
    """sum over the chosen experts e of weight_e * down_e(silu(gate_e(h)) * up_e(h)).

    h: [M, H] normed tokens; router: [H, E]; w_gate_up: [E, H, 2F] (gate columns first, then up);
    w_down: [E, F, H]. Returns [M, H] in h's dtype (the top_k expert outputs summed in float32).
    """
    m, width = h.shape
    e = router.shape[-1]
    if router.shape != (width, e) or w_gate_up.shape[:2] != (e, width) or w_down.shape != (e, w_gate_up.shape[2] // 2,
                                                                                             width):
        raise ValueError(f"router / w_gate_up / w_down: expected [H={width}, E], [E, H, 2F], [E, F, H]; got "
                         f"{router.shape}, {w_gate_up.shape}, {w_down.shape}")
    weights, experts = route(h, router, top_k, norm_topk_prob)
    flat = experts.reshape(-1)  # [M * k], pair i = (token i // k, its (i % k)-th expert)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = jnp.take(h, order // top_k, axis=0)  # [M * k, H], grouped by expert
    gu = jax.lax.ragged_dot(xs, w_gate_up, sizes)
    f = gu.shape[-1] // 2
    y = jax.lax.ragged_dot(jax.nn.silu(gu[:, :f]) * gu[:, f:], w_down, sizes)  # [M * k, H]
    y = jnp.zeros_like(y).at[order].set(y)  # back to (token, k) order
    y = y.reshape(m, top_k, width).astype(jnp.float32) * weights[..., None].astype(jnp.float32)
    return jnp.sum(y, axis=1).astype(h.dtype)
