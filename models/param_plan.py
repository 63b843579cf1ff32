"""A checkpoint's load plan: which Hugging Face tensors fill which parameter of a port, the key check
and the loading loop, shared by the ports whose converters list their keys as tables
(``models.qwen2_5_vl.convert``, ``models.llava_onevision.convert``).

A plan is a list of ``(module attr, param name, [canonical keys], hf shape, transform, stacked)``:
a stacked parameter ``[L, ...]`` reads one key per layer, a single one reads one key.
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import safetensors_io
from models.sharding import check_mesh, param_sharding
from models.snapshot import resolve_snapshot

PlanEntry = tuple[str, str, list[str], tuple, Callable[[np.ndarray], np.ndarray], bool]


def build_plan(stacked: list[tuple[str, dict, int]], single: list[tuple[str, dict]]) -> list[PlanEntry]:
    """stacked: ``(owner, {name: (key template with {i}, shape, fn)}, layers)``; single: ``(owner, {name: (key,
    shape, fn)})`` -> the plan (stacked entries first)."""
    plan = []
    for owner, table, layers in stacked:
        for name, (tmpl, shape, fn) in table.items():
            plan.append((owner, name, [tmpl.format(i=i) for i in range(layers)], shape, fn, True))
    for owner, table in single:
        for name, (key, shape, fn) in table.items():
            plan.append((owner, name, [key], shape, fn, False))
    return plan


def check_keys(plan: list[PlanEntry], tensors: dict[str, safetensors_io.TensorInfo],
               canonical_name: Callable[[str], str], tolerated: Callable[[str], bool]) -> dict[str, str]:
    """Validate a checkpoint's names and shapes against ``plan``; returns canonical name -> original name.
    ``tolerated(canonical key)``: extra keys that are not errors. Raises ValueError listing missing keys,
    unexpected keys and shape mismatches by name, or two keys that map to the same parameter."""
    canon: dict[str, str] = {}
    for k in tensors:
        ck = canonical_name(k)
        if ck in canon:
            raise ValueError(f"checkpoint: {canon[ck]!r} and {k!r} map to the same parameter")
        canon[ck] = k
    expected = {k: shape for _, _, keys, shape, _, _ in plan for k in keys}
    missing = sorted(set(expected) - set(canon))
    unexpected = sorted(k for k in set(canon) - set(expected) if not tolerated(k))
    mismatched = [f"{canon[k]}: expected {expected[k]}, got {tuple(tensors[canon[k]].shape)}"
                  for k in sorted(set(expected) & set(canon)) if tuple(tensors[canon[k]].shape) != tuple(expected[k])]
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {[canon[k] for k in unexpected]}")
    if mismatched:
        problems.append(f"shape mismatches {mismatched}")
    if problems:
        raise ValueError("checkpoint does not match its config: " + "; ".join(problems))
    return canon


def load_into(model: nnx.Module, plan: list[PlanEntry], tensors: dict[str, safetensors_io.TensorInfo],
              canon: dict[str, str], dtype, place: Callable[[str, str], object] | None = None) -> nnx.Module:
    """Fill ``model`` (an ``nnx.eval_shape`` skeleton) parameter by parameter from the checkpoint: stacked
    entries become ``[L, ...]`` arrays. ``dtype``: parameter dtype (None keeps each tensor's stored dtype);
    ``place(owner, name)``: the parameter's sharding (None: the default device). Peak host memory is about
    one stacked parameter beyond the memory-mapped files."""
    for owner, name, keys, _, fn, stacked in plan:
        parts = [fn(safetensors_io.load(tensors[canon[k]])) for k in keys]
        target = np.dtype(dtype) if dtype is not None else parts[0].dtype
        if stacked:
            host = np.empty((len(parts),) + parts[0].shape, target)
            for i, part in enumerate(parts):
                host[i] = part
        else:
            host = np.asarray(parts[0], target)
        setattr(getattr(model, owner), name, nnx.Param(jax.device_put(host, None if place is None else
                                                                      place(owner, name))))
        del host, parts
    return model


def load_snapshot(path, *, load_config: Callable, check_keys: Callable, model_cls: Callable, plan: Callable,
                  dtype, mesh=None) -> nnx.Module:
    """A table-driven port's ``from_hf``: resolve the snapshot (``models.snapshot``), read its config
    (``load_config(config.json path)``), check the checkpoint's keys (``check_keys(config, tensors) ->
    canonical names``; a mismatch raises ValueError naming ``path``) and fill a ``model_cls(config, ...)``
    skeleton from ``plan(config)`` (`load_into`). ``mesh``: each parameter goes straight into its layout
    (`models.sharding`), every device receiving only its own slice."""
    path = resolve_snapshot(path)
    cfg = load_config(os.path.join(path, "config.json"))
    tensors = safetensors_io.index_checkpoint(path)
    try:
        canon = check_keys(cfg, tensors)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    place = None if mesh is None else param_sharding(cfg.text, check_mesh(mesh, cfg.text))
    model = nnx.eval_shape(lambda: model_cls(cfg, dtype=dtype or jnp.float32, key=jax.random.key(0)))
    return load_into(model, plan(cfg), tensors, canon, dtype, place)
