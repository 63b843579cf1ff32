"""Per-layer, per-head sparse patterns inside a model: the attention hook a `SparseConfig` gives
(``models.attention``: ``attn_fn(q, k, v, *, layer, q_positions, kv_valid, modality)``).

One compiled body serves every layer. A layer's plan is its tuple of per-query-head patterns;
it is split into GQA-group plans (the patterns of the G = N / K query heads that read one key /
value head). The distinct group plans of all layers become the branches of one
``lax.switch``, and a static table ``[L, K]`` says which branch each (layer, key head) runs, so
the layer index may be traced (layers under ``lax.scan``) and compile time grows with the
number of distinct group plans, not with depth.

The key heads run one after the other under ``lax.scan`` and write their heads into one output
buffer, so the extra memory of sparse attention (estimation, permuted copies of the queries,
layout indices, per-part outputs) is that of one GQA group at a time, not of all heads.

Prefill (queries are the last T of S positions: ``q_positions == S - T + arange(T)``, no padding,
checked on device) runs the patterns; anything else (a padded batch, decode) runs exact
`models.attention.dense_attention` with ``q_positions`` and ``kv_valid``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from mmjax.sparse.attention import attend_heads
from mmjax.sparse.layouts import KernelOptions
from mmjax.sparse.modality import as_modality
from mmjax.sparse.patterns.base import Pattern
from models.attention import dense_attention


@functools.lru_cache(maxsize=64)
def group_plans(layers: tuple[tuple[Pattern, ...], ...], kv_heads: int
                ) -> tuple[tuple[tuple[Pattern, ...], ...], tuple[tuple[int, ...], ...]]:
    """(distinct GQA-group plans in order of first use, table [L][K] of indices into them)."""
    n = len(layers[0])
    if n % kv_heads:
        raise ValueError(f"k: expected a number of key heads dividing the config's {n} heads; received {kv_heads}")
    g = n // kv_heads
    plans: dict[tuple[Pattern, ...], int] = {}
    table = []
    for layer in layers:
        row = []
        for h in range(kv_heads):
            plan = tuple(layer[h * g:(h + 1) * g])
            row.append(plans.setdefault(plan, len(plans)))
        table.append(tuple(row))
    return tuple(plans), tuple(table)


@dataclasses.dataclass(frozen=True)
class SparseModelAttention:
    """The model hook of a `SparseConfig`'s ``layers`` (``layers[l][h]``: pattern of query head h
    in layer l). ``layer`` indexes ``layers`` (a Python int or a traced int32); ``only_layer`` pins
    it (the per-layer hook of one layer). ``head_axis``: inside ``jax.shard_map`` over these mesh
    axes, q / k / v hold this device's contiguous slice of whole GQA groups (the
    ``axis_index(head_axis)``-th), which run the patterns of their global heads. ``frame_tokens``: the video's
    tokens per frame (static; `mmjax.prefill` takes it from the video's grid), given to the patterns with the
    token types (`Modality.frame_tokens`: Grid's ``stride="frame"`` and `Grid.frame_first`)."""

    layers: tuple[tuple[Pattern, ...], ...]
    options: KernelOptions = KernelOptions()
    only_layer: int | None = None
    head_axis: str | tuple[str, ...] | None = None
    frame_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.frame_tokens is not None and (not isinstance(self.frame_tokens, int)
                                              or isinstance(self.frame_tokens, bool) or self.frame_tokens < 1):
            raise ValueError(f"frame_tokens: expected None or an int >= 1; received {self.frame_tokens!r}")

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, *, layer=0, q_positions: jax.Array,
                 kv_valid: jax.Array, modality: jax.Array | None = None) -> jax.Array:
        """q [B, T, N, D], k / v [B, S, K, D] -> out [B, T, N, D] in q's dtype."""
        n_cfg = len(self.layers[0])
        shards = 1 if self.head_axis is None else jax.lax.axis_size(self.head_axis)
        if q.ndim != 4 or q.shape[2] * shards != n_cfg:
            raise ValueError(f"q: expected [B, T, N={n_cfg // shards}, D] (the config's heads over {shards} "
                             f"devices); received shape {tuple(q.shape)}")
        layer = layer if self.only_layer is None else self.only_layer
        if isinstance(layer, int) and not 0 <= layer < len(self.layers):
            raise ValueError(f"layer: expected an int in [0, {len(self.layers)}); received {layer}")
        t, s = q.shape[1], k.shape[1]
        plans, table = group_plans(self.layers, int(k.shape[2]) * shards)
        row = jnp.asarray(table, jnp.int32)[layer]  # [K] (all devices' key heads)
        if self.head_axis is not None:
            row = jax.lax.dynamic_slice_in_dim(row, jax.lax.axis_index(self.head_axis) * k.shape[2], k.shape[2])

        def dense(q, k, v):
            return dense_attention(q, k, v, q_positions=q_positions, kv_valid=kv_valid).astype(q.dtype)

        if t > s:
            return dense(q, k, v)
        suffix = jnp.all(kv_valid) & jnp.all(q_positions == (s - t) + jnp.arange(t, dtype=q_positions.dtype)[None])
        if modality is not None and self.frame_tokens is not None:
            modality = dataclasses.replace(as_modality(modality, q, k), frame_tokens=self.frame_tokens)
        return self._by_group(q, k, v, plans, row, modality, suffix, dense)

    def _by_group(self, q, k, v, plans, row, modality, suffix, dense):
        """Each key head's group of query heads in turn (``lax.scan``), its plan picked by ``row``;
        a group runs ``dense`` instead where ``suffix`` is false (so the exact fallback, too, holds
        one group's temporaries at a time: a fallback over all heads at once would set the peak)."""
        kh = k.shape[2]
        g = q.shape[2] // kh
        branches = [functools.partial(self._group, plan, modality=modality) for plan in plans]

        def sparse(h, qg, kg, vg):
            return branches[0](qg, kg, vg) if len(branches) == 1 else jax.lax.switch(row[h], branches, qg, kg, vg)

        def body(buf, h):
            # buf holds the outputs of the groups before h and the queries of the others: group h
            # reads its queries and writes its output over them (no second [B, T, N, D] buffer).
            qg = jax.lax.dynamic_slice_in_dim(buf, h * g, g, axis=2)
            kg = jax.lax.dynamic_slice_in_dim(k, h, 1, axis=2)
            vg = jax.lax.dynamic_slice_in_dim(v, h, 1, axis=2)
            og = jax.lax.cond(suffix, sparse, lambda h, qg, kg, vg: dense(qg, kg, vg), h, qg, kg, vg)
            return jax.lax.dynamic_update_slice_in_dim(buf, og.astype(buf.dtype), h * g, axis=2), None

        out, _ = jax.lax.scan(body, q, jnp.arange(kh, dtype=jnp.int32))
        return out

    def _group(self, plan, q, k, v, *, modality):
        out, _ = attend_heads(q, k, v, plan, modality, options=self.options)
        return out
