"""Llama 3.x configuration from a Hugging Face ``config.json`` (transformers' ``LlamaConfig`` defaults), presets."""

from __future__ import annotations

from typing import Any, Mapping

from models.causal_lm.config import CausalLMConfig, family_config
from models.rope_scaling import RopeConfig
from models.text_decoder import TextConfig

DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048)


def config_from_hf(hf: Mapping[str, Any]) -> CausalLMConfig:
    """The config of a ``LlamaForCausalLM`` snapshot (GQA, llama3 rope scaling, tied or untied head)."""
    return family_config("llama", hf, DEFAULTS, qk_norm=False, moe=False)


def preset(name: str) -> CausalLMConfig:
    """Published configurations: ``"8b"`` (Llama-3.1-8B / -Instruct)."""
    if name != "8b":
        raise ValueError(f"preset name: expected '8b', got {name!r}")
    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)
    text = TextConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=rope.theta,
                      qkv_bias=False)
    return CausalLMConfig("llama", text, rope, 131072)
