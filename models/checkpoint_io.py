"""Orbax save / restore of an NNX model's parameters with its config.json, shared by the ports.

A checkpoint directory is built beside its target and swapped in whole (`models.files`):
``params/`` (orbax) first, ``config.json`` last, so a load sees a complete old or new checkpoint,
or a clear error naming the file."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from flax import nnx

from models.files import atomic_directory, atomic_write, read_json, require_artifact


def save_params(model: nnx.Module, config_dict: dict, ckpt_dir: str, *, overwrite: bool = False) -> None:
    """Write ``ckpt_dir/params`` (orbax) and ``ckpt_dir/config.json`` (``config_dict``), atomically.
    An existing ``ckpt_dir`` is replaced only with ``overwrite=True``."""
    with atomic_directory(ckpt_dir, overwrite=overwrite) as tmp:
        state = nnx.state(model, nnx.Param)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, "params"), nnx.to_pure_dict(state))
            ckptr.wait_until_finished()
        atomic_write(os.path.join(tmp, "config.json"), json.dumps(config_dict, indent=1))


def read_config(ckpt_dir: str, parse: Callable[[dict], Any], saved_by: str) -> tuple[str, Any]:
    """(checked checkpoint directory, its config parsed by ``parse``); errors name the file and
    ``saved_by`` (the function that writes such checkpoints)."""
    ckpt_dir = require_artifact(ckpt_dir, "config.json", saved_by)
    cfg_path = os.path.join(ckpt_dir, "config.json")
    try:
        return ckpt_dir, parse(read_json(cfg_path))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{cfg_path}: not a config written by {saved_by} ({type(e).__name__}: {e})") from e


def restore_params(ckpt_dir: str, make_model: Callable[[Any], nnx.Module]) -> nnx.Module:
    """The model ``make_model(dtype)`` builds (abstractly), its parameters restored from
    ``ckpt_dir/params`` in the dtype they were saved with."""
    params = os.path.join(ckpt_dir, "params")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            meta = ckptr.metadata(params)
            tree = meta.item_metadata if hasattr(meta, "item_metadata") else meta
            abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
            restored = ckptr.restore(params, abstract)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{params}: cannot restore the orbax parameters ({e})") from e
    dtype = jax.tree.leaves(restored)[0].dtype
    model = nnx.eval_shape(lambda: make_model(dtype))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)
    return model
