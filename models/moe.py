"""Top-k mixture-of-experts MLP (Qwen3-MoE) as grouped matmuls (``pallas_kernels.grouped_matmul``).

The (token, expert) pairs are sorted by expert, so each expert's rows are contiguous, and two
grouped matmuls (fused gate+up, then down; ``pallas_kernels.grouped_matmul``) run every expert at once: no
Python loop over experts, and the work is that of the chosen experts only. On a GPU that is the Triton grouped
matmul kernel: XLA lowers ``jax.lax.ragged_dot`` densely over an ``[pairs, experts * hidden]`` operand (jax
0.11.2), which asked for 64 GiB per 16k-token chunk of Qwen3-30B-A3B; elsewhere it is ``ragged_dot``. Callers
bound memory by passing sequence chunks (``models.common.map_chunks``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import grouped_matmul


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
    _check(h, router, w_gate_up, w_down, router.shape[-1])
    return _experts(h, router, w_gate_up, w_down, top_k, norm_topk_prob, None).astype(h.dtype)


def local_experts_mlp(h: jax.Array, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, top_k: int,
                      norm_topk_prob: bool, first_expert: jax.Array | int) -> jax.Array:
    """The share of `moe_mlp` that experts ``first_expert .. first_expert + E_local - 1`` compute (expert
    parallelism: each device holds a run of the experts; the shares of disjoint runs add up to `moe_mlp`).

    h: [M, H]; router: [H, E] (all experts: routing is global); w_gate_up: [E_local, H, 2F]; w_down:
    [E_local, F, H]; first_expert: int or traced int32 scalar. Returns float32 [M, H]: each token's weighted
    outputs of its chosen experts that lie in the run (0 for a token whose experts all lie elsewhere).
    """
    _check(h, router, w_gate_up, w_down, w_gate_up.shape[0])
    return _experts(h, router, w_gate_up, w_down, top_k, norm_topk_prob, first_expert)


def _check(h, router, w_gate_up, w_down, e_local: int) -> None:
    m, width = h.shape
    if (router.ndim != 2 or router.shape[0] != width or w_gate_up.shape[:2] != (e_local, width)
            or w_down.shape != (e_local, w_gate_up.shape[2] // 2, width) or router.shape[1] % e_local):
        raise ValueError(f"router / w_gate_up / w_down: expected [H={width}, E], [E_local, H, 2F], [E_local, F, H] "
                         f"with E_local dividing E; got {router.shape}, {w_gate_up.shape}, {w_down.shape}")


def _experts(h, router, w_gate_up, w_down, top_k: int, norm_topk_prob: bool, first_expert):
    """float32 [M, H]: the weighted outputs of the chosen experts among w_gate_up's (all of them when
    ``first_expert`` is None, else the run starting there)."""
    m, width = h.shape
    e = w_gate_up.shape[0]
    weights, experts = route(h, router, top_k, norm_topk_prob)
    flat = experts.reshape(-1)  # [M * k], pair i = (token i // k, its (i % k)-th expert)
    if first_expert is not None:  # pairs of other devices' experts sort last (group e) and count nothing
        local = flat - first_expert
        mine = (local >= 0) & (local < e)
        flat = jnp.where(mine, local, e)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = jnp.take(h, order // top_k, axis=0)  # [M * k, H], grouped by expert
    gu = grouped_matmul(xs, w_gate_up, sizes)
    f = gu.shape[-1] // 2
    y = grouped_matmul(jax.nn.silu(gu[:, :f]) * gu[:, f:], w_down, sizes)  # [M * k, H]
    y = jnp.zeros_like(y).at[order].set(y)  # back to (token, k) order
    y = y.reshape(m, top_k, width).astype(jnp.float32) * weights[..., None].astype(jnp.float32)
    if first_expert is not None:  # rows past the groups (other devices' experts) are 0: drop them anyway
        y = jnp.where(mine.reshape(m, top_k, 1), y, 0.0)
    return jnp.sum(y, axis=1)
