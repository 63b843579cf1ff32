"""Qwen2.5-VL in Flax NNX: HF conversion, orbax checkpoints, forward / prefill / decode; NumPy ``Processor``."""

from models.qwen2_5_vl.checkpoint import load, save
from models.qwen2_5_vl.config import Qwen2_5_VLConfig, VisionConfig, config_from_hf, preset
from models.qwen2_5_vl.convert import from_hf
from models.qwen2_5_vl.model import Qwen2_5_VL, decode_step, forward, init_cache, prefill_language_model, prepare_inputs
from models.qwen2_5_vl.processing import Processor
from models.qwen2_5_vl.rope_index import get_rope_index

__all__ = ["Qwen2_5_VL", "Qwen2_5_VLConfig", "VisionConfig", "config_from_hf", "preset", "from_hf", "save", "load",
           "forward", "prepare_inputs", "prefill_language_model", "decode_step", "init_cache", "get_rope_index",
           "Processor"]
