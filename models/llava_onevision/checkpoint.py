"""Orbax save / load of a converted ``LlavaOnevision`` (parameters + config.json; `models.checkpoint_io`)."""

from __future__ import annotations

import jax

from models.checkpoint_io import read_config, restore_params, save_params
from models.llava_onevision.config import LlavaOnevisionConfig
from models.llava_onevision.model import LlavaOnevision


def save(model: LlavaOnevision, ckpt_dir: str, *, overwrite: bool = False) -> None:
    """Write ``ckpt_dir/params`` (orbax) and ``ckpt_dir/config.json``, atomically (the directory is swapped in
    whole). An existing ``ckpt_dir`` is replaced only with ``overwrite=True``."""
    save_params(model, model.config.to_dict(), ckpt_dir, overwrite=overwrite)


def load(ckpt_dir: str) -> LlavaOnevision:
    """Inverse of ``save``; parameters keep the dtype they were saved with. A missing or unreadable checkpoint
    raises an error naming the file."""
    ckpt_dir, config = read_config(ckpt_dir, LlavaOnevisionConfig.from_dict, "models.llava_onevision.save")
    return restore_params(ckpt_dir, lambda dtype: LlavaOnevision(config, dtype=dtype, key=jax.random.key(0)))
