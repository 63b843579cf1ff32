"""Acceptance of a verified draft tree: greedy and lossless speculative sampling.

Both return, per row, the accepted path as tree indices (root first; ``path[b, :count[b]]`` are
meaningful) and the bonus token drawn from the target at the last accepted node. ``count - 1`` draft
tokens were accepted; the step emits them plus the bonus, so the accepted length tau = count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mmjax.speculative.sampling import Sampling, target_log_probs
from mmjax.speculative.tree import Tree


def accept_greedy(tree: Tree, logits: jax.Array):
    """logits: float [B, n, V] target logits at every tree node -> (path int32 [B, depth+1],
    count int32 [B], bonus int32 [B]). A node is accepted when every node on its path is the target's
    argmax after its parent."""
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, n]
    match = tree.tokens == jnp.take_along_axis(best, tree.parent, 1)
    # a node is accepted iff all its ancestors (except the root) match: ancestors is [B, n, n]
    ok = jnp.all(~tree.ancestors | match[:, None, :] | (jnp.arange(match.shape[1]) == 0)[None, None, :], axis=-1)
    deepest = jnp.argmax(jnp.where(ok, tree.depth, -1), axis=1)  # ties impossible: sibling tokens differ
    path = jnp.take_along_axis(tree.path, deepest[:, None, None], 1)[:, 0]
    count = jnp.take_along_axis(tree.depth, deepest[:, None], 1)[:, 0] + 1
    bonus = jnp.take_along_axis(best, deepest[:, None], 1)[:, 0]
    return path, count.astype(jnp.int32), bonus


def _accept_row(key, logp, tokens, children, depth: int):
    """One row. logp: [n, V] target log-probs; tokens: [n]; children: [n, kc]."""
    kc = children.shape[1]

    def level(carry, key_level):
        node, alive, path_len, bonus_p, path = carry
        p = jnp.exp(logp[node])  # target distribution at the current node

        def try_child(c, st):
            p, found, child_key = st
            child = children[node, c]
            x = tokens[jnp.maximum(child, 0)]
            u = jax.random.uniform(jax.random.fold_in(key_level, c))
            total = jnp.sum(p)
            live = alive & (~found) & (child >= 0)
            take = live & (u * total < p[x])
            p = jnp.where(live & ~take, p.at[x].set(0.0), p)  # rejected: zero it and renormalise implicitly
            return p, found | take, jnp.where(take, child, child_key)

        p, found, child = jax.lax.fori_loop(0, kc, try_child, (p, jnp.zeros((), bool), jnp.zeros((), jnp.int32)))
        # the residual (after rejections) is where the bonus comes from if the walk stops here
        bonus_p = jnp.where(alive & ~found, p, bonus_p)
        path = path.at[path_len].set(jnp.where(alive & found, child, path[path_len]))
        node = jnp.where(alive & found, child, node)
        path_len = path_len + (alive & found)
        return (node, alive & found, path_len, bonus_p, path), None

    n, v = logp.shape
    keys = jax.random.split(key, depth + 1)
    init = (jnp.zeros((), jnp.int32), jnp.ones((), bool), jnp.ones((), jnp.int32), jnp.zeros((v,), jnp.float32),
            jnp.zeros((depth + 1,), jnp.int32))
    (node, alive, path_len, bonus_p, path), _ = jax.lax.scan(level, init, keys[:depth])
    bonus_p = jnp.where(alive, jnp.exp(logp[node]), bonus_p)  # every level accepted: sample from the leaf
    bonus = jax.random.categorical(keys[depth], jnp.log(bonus_p)).astype(jnp.int32)
    path = jnp.where(jnp.arange(depth + 1) < path_len, path, node)
    return path, path_len, bonus


def accept_sampling(key: jax.Array, tree: Tree, logits: jax.Array, sampling: Sampling):
    """Lossless speculative sampling over a deterministic tree (recursive rejection with point-mass
    proposals): at each node the children are tried in draft order; child x is accepted with
    probability p(x) / sum(p); on rejection p(x) is set to 0 (the residual max(p - q, 0) for a point
    mass q) and the next sibling is tried; if none is accepted the bonus is drawn from the residual,
    else after the deepest accepted node from the target distribution there. The emitted tokens
    are distributed exactly as tokens sampled one by one from the target (``target_log_probs``).

    logits: float [B, n, V]. Returns (path int32 [B, depth+1], count int32 [B], bonus int32 [B]).
    """
    depth = tree.path.shape[-1] - 1
    logp = target_log_probs(logits, sampling)
    keys = jax.random.split(key, logits.shape[0])
    return jax.vmap(lambda k, lp, t, c: _accept_row(k, lp, t, c, depth))(keys, logp, tree.tokens, tree.children)
