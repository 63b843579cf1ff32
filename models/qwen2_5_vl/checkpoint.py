"""Orbax save / load of a converted ``Qwen2_5_VL`` (parameters + config.json)."""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from models.qwen2_5_vl.config import Qwen2_5_VLConfig
from models.qwen2_5_vl.model import Qwen2_5_VL


def save(model: Qwen2_5_VL, ckpt_dir: str) -> None:
    """Write ``ckpt_dir/config.json`` and ``ckpt_dir/params`` (orbax). ``ckpt_dir`` must not hold params yet."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    os.makedirs(ckpt_dir, exist_ok=True)
    with open(os.path.join(ckpt_dir, "config.json"), "w") as f:
        json.dump(model.config.to_dict(), f, indent=1)
    state = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(ckpt_dir, "params"), nnx.to_pure_dict(state))


def load(ckpt_dir: str) -> Qwen2_5_VL:
    """Inverse of ``save``; parameters keep the dtype they were saved with."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    cfg_path = os.path.join(ckpt_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"ckpt_dir: expected {cfg_path} (written by save)")
    with open(cfg_path) as f:
        config = Qwen2_5_VLConfig.from_dict(json.load(f))
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(os.path.join(ckpt_dir, "params"))
        tree = meta.item_metadata if hasattr(meta, "item_metadata") else meta
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
        restored = ckptr.restore(os.path.join(ckpt_dir, "params"), abstract)
    dtype = jax.tree.leaves(restored)[0].dtype
    model = nnx.eval_shape(lambda: Qwen2_5_VL(config, dtype=dtype, key=jax.random.key(0)))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)
    return model
