"""The target model used as its own draft (an oracle for tests and for upper bounds).

Implements the draft protocol of ``mmjax.speculative.draft`` with a private copy of the target's KV
cache: ``extend`` runs the target on the accepted tokens, ``expand`` runs it on the tree frontier
with tree attention. With greedy decoding every level of its tree holds the target's own argmax,
so each speculative step accepts ``depth`` tokens (tau = depth + 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.kv_cache import compact_cache
from models.qwen2_5_vl.model import cached_forward
from pallas_kernels.tree_decode import tree_decode_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetDraft:
    """Stateless: the target passed to each call does the drafting."""

    feature_layer = None  # needs no target features

    def begin(self, target, prefill, first_tokens, n_keep: int, extra_slots: int, tree):
        del n_keep, extra_slots
        cache = jax.tree.map(jnp.copy, prefill.cache)
        if cache.max_length - int(prefill.input_ids.shape[1]) < max(tree.expanded_slots, 1):
            raise ValueError("prefill: the cache needs room for the draft tree after the prompt")
        b = first_tokens.shape[0]
        return self.extend(target, cache, first_tokens.reshape(b, 1), None, cache.next_position.reshape(b, 1),
                           jnp.ones((b,), jnp.int32))

    def extend(self, target, state, tokens, features, positions, count):
        del features
        b, c = tokens.shape
        prefix = state.valid & (jnp.arange(state.max_length)[None, :] < state.length)
        i = jnp.arange(c)
        own = (i[None, None, :] <= i[None, :, None]) & (i[None, None, :] < count[:, None, None])
        logits, _, cache = cached_forward(target, state, tokens, positions, state.length, prefix, state.length, own,
                                          tree_attn=tree_decode_attention)
        cache = compact_cache(cache, state.length, jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c)), count)
        idx = jnp.clip(count - 1, 0, c - 1)[:, None, None]
        h = target.config.text.hidden_size
        return cache, jnp.zeros((b, 1, h), jnp.float32), jnp.take_along_axis(logits, idx, 1)

    def expand(self, target, state, level: int, tokens, parent_z, positions, ancestors):
        del parent_z
        b, kk = tokens.shape
        prefix = state.valid & (jnp.arange(state.max_length)[None, :] < state.length)
        logits, _, cache = cached_forward(target, state, tokens, positions, state.length + (level - 1) * kk, prefix,
                                          state.length, ancestors, tree_attn=tree_decode_attention)
        return cache, jnp.zeros((b, kk, target.config.text.hidden_size), jnp.float32), logits
