"""Orbax save / load of a converted ``Qwen2_5_VL`` (parameters + config.json).

A checkpoint directory is built beside its target and swapped in whole (`models.files`):
``params/`` (orbax) first, ``config.json`` last, so a load sees a complete old or new
checkpoint, or a clear error."""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from models.files import atomic_directory, atomic_write, read_json, require_artifact
from models.qwen2_5_vl.config import Qwen2_5_VLConfig
from models.qwen2_5_vl.model import Qwen2_5_VL


def save(model: Qwen2_5_VL, ckpt_dir: str, *, overwrite: bool = False) -> None:
    """Write ``ckpt_dir/params`` (orbax) and ``ckpt_dir/config.json``, atomically (the directory
    is swapped in whole). An existing ``ckpt_dir`` is replaced only with ``overwrite=True``."""
    with atomic_directory(ckpt_dir, overwrite=overwrite) as tmp:
        state = nnx.state(model, nnx.Param)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, "params"), nnx.to_pure_dict(state))
            ckptr.wait_until_finished()
        atomic_write(os.path.join(tmp, "config.json"), json.dumps(model.config.to_dict(), indent=1))


def load(ckpt_dir: str) -> Qwen2_5_VL:
    """Inverse of ``save``; parameters keep the dtype they were saved with. A missing or
    unreadable checkpoint raises an error naming the file."""
    ckpt_dir = require_artifact(ckpt_dir, "config.json", "models.qwen2_5_vl.save")
    cfg_path = os.path.join(ckpt_dir, "config.json")
    try:
        config = Qwen2_5_VLConfig.from_dict(read_json(cfg_path))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{cfg_path}: not a config written by save ({type(e).__name__}: {e})") from e
    try:
        with ocp.StandardCheckpointer() as ckptr:
            meta = ckptr.metadata(os.path.join(ckpt_dir, "params"))
            tree = meta.item_metadata if hasattr(meta, "item_metadata") else meta
            abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
            restored = ckptr.restore(os.path.join(ckpt_dir, "params"), abstract)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{os.path.join(ckpt_dir, 'params')}: cannot restore the orbax parameters ({e})") from e
    dtype = jax.tree.leaves(restored)[0].dtype
    model = nnx.eval_shape(lambda: Qwen2_5_VL(config, dtype=dtype, key=jax.random.key(0)))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)
    return model
