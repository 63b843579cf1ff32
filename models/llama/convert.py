"""Hugging Face ``LlamaForCausalLM`` snapshot -> ``CausalLM`` (key table in ``models.causal_lm.convert``)."""

from __future__ import annotations

import os

import jax.numpy as jnp

from models.causal_lm import convert
from models.causal_lm.model import CausalLM
from models.llama.config import config_from_hf


def from_hf(path: str | os.PathLike, dtype=jnp.bfloat16, mesh=None) -> CausalLM:
    """Load a local Llama snapshot (plain or hub-cache tree, one file or shards); ``dtype`` None keeps the
    stored dtype; ``mesh``: load straight into the tensor- / sequence-parallel layout."""
    return convert.from_hf(path, config_from_hf, dtype, mesh)
