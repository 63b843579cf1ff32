"""LLaVA-OneVision / LLaVA-Video in Flax NNX: HF and LLaVA-NeXT conversion, orbax checkpoints, forward / prefill /
decode; NumPy ``Processor``."""

from models.llava_onevision.checkpoint import load, save
from models.llava_onevision.config import (
    LlavaOnevisionConfig,
    VisionConfig,
    config_from_hf,
    preset,
)
from models.llava_onevision.convert import from_hf
from models.llava_onevision.model import (
    LlavaOnevision,
    decode_step,
    forward,
    init_cache,
    prepare_inputs,
)
from models.llava_onevision.processing import Processor

__all__ = ["LlavaOnevision", "LlavaOnevisionConfig", "Processor", "VisionConfig", "config_from_hf", "decode_step",
           "forward", "from_hf", "init_cache", "load", "prepare_inputs", "preset", "save"]
