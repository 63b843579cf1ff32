"""Orbax save / load of a Llama ``CausalLM`` (``models.causal_lm.checkpoint`` restricted to the family)."""

from __future__ import annotations

from models.causal_lm import checkpoint
from models.causal_lm.model import CausalLM


def save(model: CausalLM, ckpt_dir: str, *, overwrite: bool = False) -> None:
    """Write a Llama checkpoint (see ``models.causal_lm.save``)."""
    if not isinstance(model, CausalLM) or model.config.family != "llama":
        raise ValueError(f"model: expected a Llama CausalLM, got {type(model).__name__} "
                         f"{getattr(getattr(model, 'config', None), 'family', '')}")
    checkpoint.save(model, ckpt_dir, overwrite=overwrite)


def load(ckpt_dir: str) -> CausalLM:
    """Inverse of ``save``; another family's checkpoint raises a ValueError."""
    return checkpoint.load(ckpt_dir, families=("llama",), saved_by="models.llama.save")
