"""Tensor- and sequence-parallel layouts of the ports' parameters and of the KV cache (``jax.sharding``).

Mesh axes: ``TP`` ("tp") splits attention heads, whole GQA groups per device: q / k / v projections (and
their biases) by head, the output projection by its input heads, the MLP's gate / up by their output and
down by its input features, so a layer needs one all-reduce after the output and one after the down
projection (XLA inserts them); the LM head's vocabulary is split when the tp size divides it. The
embedding table stays whole on every device: a lookup in a vocabulary-split table is a masked gather
plus an all-reduce of the whole prompt's embeddings (28 GiB in float32 at 2M tokens of the 7B shape, in XLA's plan). ``SP`` ("sp") splits the sequence: the KV cache by slot, the residual stream by token (see
``mmjax.parallel``). A mixture of experts is split by expert over tp (each device a run of E / tp experts;
routing is global, one all-reduce adds the devices' shares: `models.text_decoder`, which needs the mesh in
context, ``jax.set_mesh``, as `mmjax.parallel` runs its programs). Norms, the MoE router and the vision tower
are replicated (the vision tower is split by frames instead). A mesh may have either axis or both; a size-1 or missing axis means
no split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.kv_cache import KVCache
from models.text_decoder import TextConfig

TP = "tp"
SP = "sp"


def axis_size(mesh: Mesh, axis: str) -> int:
    """Size of mesh axis ``axis`` (1 when the mesh has no such axis)."""
    return int(mesh.shape[axis]) if axis in mesh.axis_names else 1


def check_mesh(mesh: Any, config: TextConfig) -> Mesh:
    """``mesh`` (its axes made ``AxisType.Auto``: XLA propagates the shardings) if it is a
    ``jax.sharding.Mesh`` whose axes are among ("tp", "sp") and whose tp size divides the decoder's
    key-value heads (whole GQA groups per device) and MLP width (its number of experts for a MoE); ValueError otherwise."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")  # noqa: TRY004 - house rule
    extra = [a for a in mesh.axis_names if a not in (TP, SP)]
    if extra:
        raise ValueError(f"mesh: expected axes named {TP!r} (heads) and/or {SP!r} (sequence); got axes "
                         f"{tuple(mesh.axis_names)}")
    tp = axis_size(mesh, TP)
    widths = {"num_key_value_heads": config.num_key_value_heads}
    if config.is_moe:
        widths["num_experts"] = config.num_experts
    else:
        widths["intermediate_size"] = config.intermediate_size
    for name, width in widths.items():
        if width % tp:
            raise ValueError(f"mesh: the {TP!r} axis size {tp} must divide the decoder's {name}={width}")
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _vocab(config: TextConfig, tp_size: int):
    return TP if tp_size > 1 and config.vocab_size % tp_size == 0 else None


def decoder_specs(config: TextConfig, tp_size: int) -> dict[str, P]:
    """PartitionSpec of every `models.text_decoder.TextDecoder` parameter under a tp axis of ``tp_size``
    devices (stacked weights keep their leading layer axis unsplit)."""
    t = TP if tp_size > 1 else None
    head_w = P(None, None, t, None)  # [L, H, N|K, D]
    head_b = P(None, t, None)  # [L, N|K, D]
    specs = {"embed": P(), "lm_head": P(_vocab(config, tp_size), None),
             "final_norm": P(), "input_norm": P(), "post_norm": P(), "q_norm": P(), "k_norm": P(),
             "wq": head_w, "wk": head_w, "wv": head_w, "bq": head_b, "bk": head_b, "bv": head_b,
             "wo": P(None, t, None, None), "bo": P(),
             "w_gate": P(None, None, t), "w_up": P(None, None, t), "w_down": P(None, t, None),
             "router": P(), "e_gate_up": P(None, t, None, None), "e_down": P(None, t, None, None)}
    return specs


def param_sharding(config: TextConfig, mesh: Mesh) -> Callable[[str, str], NamedSharding]:
    """``(owner, name) -> NamedSharding`` of a port's parameter: ``owner`` "language_model" (the decoder,
    `decoder_specs`) or any other sub-module (replicated, e.g. the vision tower)."""
    specs = decoder_specs(config, axis_size(mesh, TP))

    def sharding(owner: str, name: str) -> NamedSharding:
        return NamedSharding(mesh, specs[name] if owner == "language_model" else P())
    return sharding


def _owner_and_name(path) -> tuple[str, str]:
    keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    return keys[0], keys[1]  # (sub-module, parameter, 'value')


def model_shardings(model: nnx.Module, mesh: Mesh):
    """The NamedSharding of each array of ``nnx.state(model)`` (same tree)."""
    place = param_sharding(model.language_model.config, mesh)
    return jax.tree_util.tree_map_with_path(lambda path, _: place(*_owner_and_name(path)), nnx.state(model))


def is_laid_out(model: nnx.Module, mesh: Mesh) -> bool:
    """True when every parameter of ``model`` already has its sharding on ``mesh``."""
    state = nnx.state(model)
    want = model_shardings(model, mesh)
    leaves = jax.tree.leaves(state)
    return all(isinstance(a, jax.Array) and a.sharding.is_equivalent_to(s, a.ndim)
               for a, s in zip(leaves, jax.tree.leaves(want)))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move ``model``'s parameters into their layout on ``mesh`` (in place; returns ``model``). A port
    loaded with ``sharding=`` (``from_hf``) is already there and nothing moves."""
    mesh = check_mesh(mesh, model.language_model.config)
    if not is_laid_out(model, mesh):
        nnx.update(model, jax.device_put(nnx.state(model), model_shardings(model, mesh)))
    return model


def kv_sharding(mesh: Mesh, ndim: int = 5) -> NamedSharding:
    """The layout of a cache's k / v [L, B, S, K, D] (``ndim`` 5) or fp8 scales [L, B, S, K] (``ndim`` 4):
    slots split over "sp", key heads over "tp"."""
    tp = TP if axis_size(mesh, TP) > 1 else None
    sp = SP if axis_size(mesh, SP) > 1 else None
    return NamedSharding(mesh, P(None, None, sp, tp, *([None] * (ndim - 4))))


def cache_sharding(cache: KVCache, mesh: Mesh) -> KVCache:
    """The NamedSharding of each field of ``cache`` (a KVCache of shardings): k / v [L, B, S, K, D] split by
    slot over "sp" and by key head over "tp", their fp8 scales alike, the rest replicated."""
    kv, scale = kv_sharding(mesh), kv_sharding(mesh, 4)
    rep = NamedSharding(mesh, P())
    none = lambda x, s: None if x is None else s
    return KVCache(kv, kv, rep, rep, rep, none(cache.k_scale, scale), none(cache.v_scale, scale))
