"""One speculative decoding step as a single jit-compiled function.

draft tree (``tree.depth - 1`` draft expansions) -> one target pass over the tree against the KV
cache -> greedy or lossless acceptance -> compaction of the accepted path into the target cache ->
the draft commits the accepted path with the target's hidden states (and proposes the next tree's
first level).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mmjax.inference import runner
from mmjax.speculative.sampling import Sampling
from mmjax.speculative.tree import Tree, TreeConfig, add_level, empty_pool, level_offset, select_tree
from mmjax.speculative.verify import accept_greedy, accept_sampling
from models.kv_cache import KVCache, compact_cache
from pallas_kernels.tree_decode import tree_decode_attention


def draft_tree(model, draft, dstate, root, z_last, logits_last, base_pos, tree: TreeConfig):
    """Grow the candidate pool and select the tree. root int [B] (last emitted token, position
    ``base_pos`` int [B]); z_last [B, 1, H] / logits_last [B, 1, V]: the draft's output at the root.
    Returns (draft state, Tree)."""
    b = root.shape[0]
    k = tree.top_k
    n_slots = tree.expanded_slots
    logp = jax.nn.log_softmax(logits_last[:, 0].astype(jnp.float32), axis=-1)
    score, tok = jax.lax.top_k(logp, k)
    pool = add_level(empty_pool(b, tree), 0, tok, score, jnp.full((b, k), -1, jnp.int32), 1)
    f_idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
    f_tok, f_score = tok, score
    f_z = jnp.broadcast_to(z_last, (b, k, z_last.shape[-1]))
    f_anc = jnp.zeros((b, k, max(n_slots, 1)), bool)
    for level in range(1, tree.depth):
        own = jax.nn.one_hot((level - 1) * k + jnp.arange(k), max(n_slots, 1), dtype=bool)
        anc = f_anc | own[None]
        dstate, z, lg = draft.expand(model, dstate, level, f_tok, f_z, base_pos[:, None] + level, anc[..., :n_slots])
        c_score, c_tok = jax.lax.top_k(jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1), k)  # [B, k, k]
        c_score = (f_score[:, :, None] + c_score).reshape(b, k * k)
        c_tok = c_tok.reshape(b, k * k)
        off = level_offset(level + 1, tree)
        pool = add_level(pool, off, c_tok, c_score, jnp.repeat(f_idx, k, axis=1), level + 1)
        f_score, sel = jax.lax.top_k(c_score, k)
        par = sel // k
        f_idx = (off + sel).astype(jnp.int32)
        f_tok = jnp.take_along_axis(c_tok, sel, 1)
        f_z = jnp.take_along_axis(z, par[:, :, None], 1)
        f_anc = jnp.take_along_axis(anc, par[:, :, None], 1)
    return dstate, select_tree(pool, root, tree)


def verify_tree(model, cache: KVCache, t: Tree, hidden_layers: tuple = (), tree_attn=tree_decode_attention):
    """One target pass over the tree ``t`` (root first) written at slot ``cache.length``: positions
    ``cache.next_position + depth`` on all three M-RoPE axes, every node sees the valid prefix and its
    ancestors. Returns (logits float32 [B, n, V], hidden [len(hidden_layers), B, n, H], cache with the
    tree's keys written but not committed; commit with ``compact_cache(cache, length, path, count)``)."""
    prefix = cache.valid & (jnp.arange(cache.max_length)[None, :] < cache.length)
    return runner(model).cached_forward(model, cache, t.tokens, cache.next_position[:, None] + t.depth, cache.length,
                                         prefix, cache.length, t.ancestors, hidden_layers=hidden_layers,
                                         tree_attn=tree_attn)


@functools.partial(jax.jit, static_argnames=("tree", "sampling"), donate_argnames=("cache", "dstate"))
def speculative_step(model, draft, cache: KVCache, dstate, root, z_last, logits_last, key, *, tree: TreeConfig,
                     sampling: Sampling):
    """root int32 [B]: last emitted token (not yet in the cache). Returns (cache, dstate, bonus int32 [B]
    (the next root), z_last, logits_last, key, emitted int32 [B, depth + 1] (first ``count`` valid),
    count int32 [B] (= tau))."""
    b = root.shape[0]
    base_pos = cache.next_position
    dstate, t = draft_tree(model, draft, dstate, root, z_last, logits_last, base_pos, tree)
    hl = () if draft.feature_layer is None else (draft.feature_layer,)
    write = cache.length
    logits, hidden, cache = verify_tree(model, cache, t, hl)
    key, sub = jax.random.split(key)
    if sampling.greedy:
        path, count, bonus = accept_greedy(t, logits)
    else:
        path, count, bonus = accept_sampling(sub, t, logits, sampling)
    cache = compact_cache(cache, write, path, count)
    path_tok = jnp.take_along_axis(t.tokens, path, 1)  # [B, depth+1]
    d1 = path.shape[1]
    nxt = jnp.concatenate([path_tok[:, 1:], path_tok[:, -1:]], axis=1)
    nxt = jnp.where(jnp.arange(d1)[None, :] == (count - 1)[:, None], bonus[:, None], nxt)
    if hl:
        feats = jnp.take_along_axis(hidden[0], path[:, :, None], 1)
    else:
        feats = jnp.zeros((b, d1, model.config.text.hidden_size), jnp.float32)
    dpos = base_pos[:, None] + 1 + jnp.arange(d1, dtype=jnp.int32)[None, :]
    dstate, z_last, logits_last = draft.extend(model, dstate, nxt, feats, dpos, count)
    return cache, dstate, bonus, z_last, logits_last, key, nxt, count
