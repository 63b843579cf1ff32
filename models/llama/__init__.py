"""Llama 3.x in Flax NNX on the shared decoder: HF conversion, orbax checkpoints, forward / prefill / decode
(``models.causal_lm``), a NumPy ``Processor`` (tokenizer + chat template)."""

from models.causal_lm.model import CausalLM, decode_step, forward, init_cache, prefill_language_model, prepare_inputs
from models.llama.checkpoint import load, save
from models.llama.config import config_from_hf, preset
from models.llama.convert import from_hf
from models.text_processing import TextProcessor as Processor

__all__ = ["CausalLM", "Processor", "config_from_hf", "decode_step", "forward", "from_hf", "init_cache", "load",
           "prefill_language_model", "prepare_inputs", "preset", "save"]
