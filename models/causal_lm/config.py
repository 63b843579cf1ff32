"""Frozen configuration of a text-only causal LM on the shared decoder (Llama, Qwen3, Qwen3-MoE), and
the parsing of the ``config.json`` fields these families share.

Both config.json layouts are read: transformers 5 (``rope_parameters``, ``num_local_experts``) and the
layout the published checkpoints ship (``rope_theta`` + ``rope_scaling``, ``num_experts``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from models.rope_scaling import ROPE_TYPES, RopeConfig
from models.text_decoder import TextConfig

FAMILIES = ("llama", "qwen3", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class CausalLMConfig:
    """family: "llama", "qwen3" or "qwen3_moe" (which ``save`` / ``load`` and ``mmjax.load`` check);
    text: the decoder; rope: its 1-D rotary embedding; max_position_embeddings: the context the
    model was trained for (prompt + generated tokens)."""

    family: str
    text: TextConfig
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 131072

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family: expected one of {FAMILIES}, got {self.family!r}")
        if not isinstance(self.max_position_embeddings, int) or self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings: expected a positive int, got {self.max_position_embeddings!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CausalLMConfig":
        """Inverse of ``to_dict`` (lists back to tuples)."""
        text = dict(d["text"])
        text["mrope_section"] = tuple(text["mrope_section"])
        return cls(family=d["family"], text=TextConfig(**text), rope=RopeConfig(**d["rope"]),
                   max_position_embeddings=d["max_position_embeddings"])


def _int(hf: Mapping[str, Any], key: str, default: Any) -> Any:
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"config {key}: expected an int, got {value!r}")
    return value


def rope_from_hf(hf: Mapping[str, Any], default_theta: float, context: int) -> RopeConfig:
    """The 1-D rotary settings of a config.json: ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (published checkpoints); types "default", "llama3" and "yarn". ``context``: the config's
    ``max_position_embeddings`` (transformers' default of ``original_max_position_embeddings``)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"config rope_parameters: expected an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", default_theta)))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind not in ROPE_TYPES:
        raise ValueError(f"config rope type: expected one of {ROPE_TYPES}, got {kind!r}")
    original = int(hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                   or context)
    if kind == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
        if missing:
            raise ValueError(f"config llama3 rope: missing {missing}")
        return RopeConfig(theta=theta, rope_type="llama3", factor=float(rope["factor"]),
                          low_freq_factor=float(rope["low_freq_factor"]),
                          high_freq_factor=float(rope["high_freq_factor"]), original_max_position_embeddings=original)
    factor = rope.get("factor")
    optional = {k: (None if rope.get(k) is None else float(rope[k]))
                for k in ("attention_factor", "mscale", "mscale_all_dim")}
    return RopeConfig(theta=theta, rope_type="yarn", factor=float(context / original if factor is None else factor),
                      original_max_position_embeddings=original, beta_fast=float(rope.get("beta_fast") or 32),
                      beta_slow=float(rope.get("beta_slow") or 1), truncate=bool(rope.get("truncate", True)),
                      **optional)


def text_config_from_hf(hf: Mapping[str, Any], defaults: Mapping[str, Any], *, rope: RopeConfig, qk_norm: bool,
                        moe: bool) -> TextConfig:
    """The decoder of a Llama / Qwen3 / Qwen3-MoE config.json; absent fields take ``defaults`` (the family's
    transformers defaults: vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    rms_norm_eps, and for MoE num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob).
    ``attention_bias`` gives biases on q, k, v and o; ``mlp_bias``, sliding-window layers and mixed dense / MoE
    layers are rejected with a ValueError naming the field. The decoder's ``rope_theta`` is ``rope.theta``."""
    if hf.get("mlp_bias"):
        raise ValueError("config mlp_bias: expected false (no published Llama uses MLP biases)")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ()):
        raise ValueError("config use_sliding_window / layer_types: sliding-window layers are not supported")
    act = hf.get("hidden_act", "silu")
    heads = _int(hf, "num_attention_heads", defaults["num_attention_heads"])
    kw = dict(vocab_size=_int(hf, "vocab_size", defaults["vocab_size"]),
              hidden_size=_int(hf, "hidden_size", defaults["hidden_size"]),
              intermediate_size=_int(hf, "intermediate_size", defaults["intermediate_size"]),
              num_hidden_layers=_int(hf, "num_hidden_layers", defaults["num_hidden_layers"]),
              num_attention_heads=heads, num_key_value_heads=_int(hf, "num_key_value_heads", heads),
              rms_norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])), hidden_act=act,
              head_dim=_int(hf, "head_dim", None), tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
              qkv_bias=bool(hf.get("attention_bias", False)), o_bias=bool(hf.get("attention_bias", False)),
              qk_norm=qk_norm, rope_theta=rope.theta)
    if moe:
        experts = _int(hf, "num_experts", _int(hf, "num_local_experts", defaults["num_experts"]))
        if experts and (_int(hf, "decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
            raise ValueError("config decoder_sparse_step / mlp_only_layers: expected every layer a mixture of experts "
                             f"(decoder_sparse_step 1, no mlp_only_layers), got {hf.get('decoder_sparse_step')} / "
                             f"{hf.get('mlp_only_layers')}")
        kw.update(num_experts=experts,
                  num_experts_per_tok=_int(hf, "num_experts_per_tok", defaults["num_experts_per_tok"]),
                  moe_intermediate_size=_int(hf, "moe_intermediate_size", defaults["moe_intermediate_size"]),
                  norm_topk_prob=bool(hf.get("norm_topk_prob", defaults["norm_topk_prob"])))
    return TextConfig(**kw)


def context_from_hf(hf: Mapping[str, Any], default: int) -> int:
    """``max_position_embeddings`` of a config.json (a positive int)."""
    value = _int(hf, "max_position_embeddings", default)
    if value < 1:
        raise ValueError(f"config max_position_embeddings: expected a positive int, got {value}")
    return value


def family_config(family: str, hf: Mapping[str, Any], defaults: Mapping[str, Any], *, qk_norm: bool,
                  moe: bool) -> CausalLMConfig:
    """The ``CausalLMConfig`` of a config.json of ``family`` (its transformers ``defaults``). With YaRN the
    context is ``factor * original_max_position_embeddings`` when that exceeds ``max_position_embeddings``
    (Qwen3's 32k models run 128k so)."""
    context = context_from_hf(hf, defaults["max_position_embeddings"])
    rope = rope_from_hf(hf, defaults["rope_theta"], context)
    text = text_config_from_hf(hf, defaults, rope=rope, qk_norm=qk_norm, moe=moe)
    if rope.rope_type == "yarn":
        context = max(context, int(rope.factor * rope.original_max_position_embeddings))
    return CausalLMConfig(family, text, rope, context)
