"""Orbax save / load of a Qwen3 or Qwen3-MoE ``CausalLM`` (``models.causal_lm.checkpoint`` restricted to the
families)."""

from __future__ import annotations

from models.causal_lm import checkpoint
from models.causal_lm.model import CausalLM

QWEN3_FAMILIES = ("qwen3", "qwen3_moe")


def save(model: CausalLM, ckpt_dir: str, *, overwrite: bool = False) -> None:
    """Write a Qwen3 / Qwen3-MoE checkpoint (see ``models.causal_lm.save``)."""
    if not isinstance(model, CausalLM) or model.config.family not in QWEN3_FAMILIES:
        raise ValueError(f"model: expected a Qwen3 CausalLM, got {type(model).__name__} "
                         f"{getattr(getattr(model, 'config', None), 'family', '')}")
    checkpoint.save(model, ckpt_dir, overwrite=overwrite)


def load(ckpt_dir: str) -> CausalLM:
    """Inverse of ``save``; another family's checkpoint raises a ValueError."""
    return checkpoint.load(ckpt_dir, families=QWEN3_FAMILIES, saved_by="models.qwen3.save")
