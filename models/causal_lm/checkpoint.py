"""Orbax save / load of a ``CausalLM`` (parameters + config.json with its family).

A checkpoint directory is built beside its target and swapped in whole (`models.files`):
``params/`` (orbax) first, ``config.json`` last, so a load sees a complete old or new checkpoint,
or a clear error."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jax
import orbax.checkpoint as ocp
from flax import nnx

from models.causal_lm.config import FAMILIES, CausalLMConfig
from models.causal_lm.model import CausalLM
from models.files import atomic_directory, atomic_write, read_json, require_artifact


def save(model: CausalLM, ckpt_dir: str, *, overwrite: bool = False) -> None:
    """Write ``ckpt_dir/params`` (orbax) and ``ckpt_dir/config.json``, atomically (the directory is
    swapped in whole). An existing ``ckpt_dir`` is replaced only with ``overwrite=True``."""
    if not isinstance(model, CausalLM):
        raise ValueError(f"model: expected a models.causal_lm.CausalLM, got {type(model).__name__}")
    with atomic_directory(ckpt_dir, overwrite=overwrite) as tmp:
        state = nnx.state(model, nnx.Param)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, "params"), nnx.to_pure_dict(state))
            ckptr.wait_until_finished()
        atomic_write(os.path.join(tmp, "config.json"), json.dumps(model.config.to_dict(), indent=1))


def load(ckpt_dir: str, families: Sequence[str] = FAMILIES, saved_by: str = "models.causal_lm.save") -> CausalLM:
    """Inverse of ``save``; parameters keep the dtype they were saved with. A checkpoint of a family not in
    ``families``, or a missing or unreadable one, raises an error naming the file (``saved_by``: the
    function the message names as the writer)."""
    ckpt_dir = require_artifact(ckpt_dir, "config.json", saved_by)
    cfg_path = os.path.join(ckpt_dir, "config.json")
    try:
        config = CausalLMConfig.from_dict(read_json(cfg_path))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{cfg_path}: not a config written by {saved_by} ({type(e).__name__}: {e})") from e
    if config.family not in families:
        raise ValueError(f"{cfg_path}: a {config.family!r} checkpoint; expected one of {tuple(families)}")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            meta = ckptr.metadata(os.path.join(ckpt_dir, "params"))
            tree = meta.item_metadata if hasattr(meta, "item_metadata") else meta
            abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
            restored = ckptr.restore(os.path.join(ckpt_dir, "params"), abstract)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{os.path.join(ckpt_dir, 'params')}: cannot restore the orbax parameters ({e})") from e
    dtype = jax.tree.leaves(restored)[0].dtype
    model = nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, key=jax.random.key(0)))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)
    return model
