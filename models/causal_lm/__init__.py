"""Text-only causal LMs on the shared decoder (the machinery of ``models.llama`` and ``models.qwen3``):
config, HF conversion, orbax checkpoints, forward / prefill / decode."""

from models.causal_lm.checkpoint import load, save
from models.causal_lm.config import FAMILIES, CausalLMConfig
from models.causal_lm.model import CausalLM, decode_step, forward, init_cache, prefill_language_model, prepare_inputs

__all__ = ["FAMILIES", "CausalLM", "CausalLMConfig", "decode_step", "forward", "init_cache", "load",
           "prefill_language_model", "prepare_inputs", "save"]
