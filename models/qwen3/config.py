"""Qwen3 dense and Qwen3-MoE configuration from a Hugging Face ``config.json`` (transformers' ``Qwen3Config`` /
``Qwen3MoeConfig`` defaults), presets."""

from __future__ import annotations

from typing import Any, Mapping

from models.causal_lm.config import CausalLMConfig, family_config
from models.rope_scaling import RopeConfig
from models.text_decoder import TextConfig

DENSE_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                      num_attention_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768)
MOE_DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                    num_attention_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False)
DENSE_NAMES = ("Qwen3ForCausalLM",)
MOE_NAMES = ("Qwen3MoeForCausalLM",)


def is_moe(hf: Mapping[str, Any]) -> bool:
    """A Qwen3-MoE config.json (``model_type`` "qwen3_moe" or a ``Qwen3MoeForCausalLM`` architecture)."""
    names = hf.get("architectures") or []
    return hf.get("model_type") == "qwen3_moe" or any(n in MOE_NAMES for n in names)


def config_from_hf(hf: Mapping[str, Any]) -> CausalLMConfig:
    """The config of a ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` snapshot (q/k RMSNorm; top-k experts;
    YaRN rope scaling as Qwen documents it for 128k contexts)."""
    moe = is_moe(hf)
    return family_config("qwen3_moe" if moe else "qwen3", hf, MOE_DEFAULTS if moe else DENSE_DEFAULTS, qk_norm=True,
                         moe=moe)


def preset(name: str) -> CausalLMConfig:
    """Published configurations: ``"8b"`` (Qwen3-8B) and ``"30b-a3b"`` (Qwen3-30B-A3B, 128 experts, 8 per token)."""
    rope = RopeConfig(theta=1000000.0)
    common = dict(vocab_size=151936, num_attention_heads=32, head_dim=128, rms_norm_eps=1e-6, rope_theta=rope.theta,
                  qkv_bias=False, qk_norm=True)
    if name == "8b":
        text = TextConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_key_value_heads=8,
                          **common)
        return CausalLMConfig("qwen3", text, rope, 40960)
    if name == "30b-a3b":
        text = TextConfig(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_key_value_heads=4,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          **common)
        return CausalLMConfig("qwen3_moe", text, rope, 40960)
    raise ValueError(f"preset name: expected '8b' or '30b-a3b', got {name!r}")
