"""Orbax save / load of a ``CausalLM`` (parameters + config.json with its family; `models.checkpoint_io`)."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from models.causal_lm.config import FAMILIES, CausalLMConfig
from models.causal_lm.model import CausalLM
from models.checkpoint_io import read_config, restore_params, save_params


def save(model: CausalLM, ckpt_dir: str, *, overwrite: bool = False) -> None:
    """Write ``ckpt_dir/params`` (orbax) and ``ckpt_dir/config.json``, atomically (the directory is
    swapped in whole). An existing ``ckpt_dir`` is replaced only with ``overwrite=True``."""
    if not isinstance(model, CausalLM):
        raise ValueError(f"model: expected a models.causal_lm.CausalLM, got {type(model).__name__}")
    save_params(model, model.config.to_dict(), ckpt_dir, overwrite=overwrite)


def load(ckpt_dir: str, families: Sequence[str] = FAMILIES, saved_by: str = "models.causal_lm.save") -> CausalLM:
    """Inverse of ``save``; parameters keep the dtype they were saved with. A checkpoint of a family not in
    ``families``, or a missing or unreadable one, raises an error naming the file (``saved_by``: the
    function the message names as the writer)."""
    ckpt_dir, config = read_config(ckpt_dir, CausalLMConfig.from_dict, saved_by)
    if config.family not in families:
        raise ValueError(f"{ckpt_dir}/config.json: a {config.family!r} checkpoint; expected one of {tuple(families)}")
    return restore_params(ckpt_dir, lambda dtype: CausalLM(config, dtype=dtype, key=jax.random.key(0)))
