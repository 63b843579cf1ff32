"""Frozen configuration of Qwen2.5-VL, parsed from a Hugging Face ``config.json``.

Defaults are the ones transformers fills in (``Qwen2_5_VLVisionConfig`` / ``Qwen2_5_VLTextConfig``),
and both the nested (``text_config`` / ``vision_config``) and the older flat layout are accepted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.files import read_json
from models.text_decoder import TextConfig


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Vision tower hyper-parameters (``hidden_size`` is the ViT width, ``out_hidden_size`` the LLM width)."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    tokens_per_second: int = 4
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision hidden_size must be divisible by num_heads, got {self.hidden_size} and {self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim must be a multiple of 4 for 2D rotary, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"vision hidden_act: expected 'silu', got {self.hidden_act!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one flattened patch: channels * temporal_patch * patch * patch (1176 for 3*2*14*14)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def window_units(self) -> int:
        """Window side in merged units (``window_size // spatial_merge_size // patch_size``)."""
        return self.window_size // self.spatial_merge_size // self.patch_size


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VLConfig:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    # M-RoPE text offset after a vision span: False = transformers >= 5, True = transformers 4.x / original Qwen
    rope_index_legacy: bool = False
    # the context the model was trained for (prompt + generated tokens), text config's max_position_embeddings
    max_position_embeddings: int = 128000

    def __post_init__(self):
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(
                f"vision out_hidden_size ({self.vision.out_hidden_size}) must equal text hidden_size "
                f"({self.text.hidden_size})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen2_5_VLConfig":
        text = dict(d["text"])
        text["mrope_section"] = tuple(text["mrope_section"])
        vision = dict(d["vision"])
        vision["fullatt_block_indexes"] = tuple(vision["fullatt_block_indexes"])
        rest = {k: v for k, v in d.items() if k not in ("text", "vision")}
        return cls(text=TextConfig(**text), vision=VisionConfig(**vision), **rest)


_TEXT_KEYS = {f.name for f in dataclasses.fields(TextConfig)}


def _rope_fields(src: dict[str, Any]) -> dict[str, Any]:
    rope = src.get("rope_parameters") or src.get("rope_scaling") or {}
    out = {}
    theta = rope.get("rope_theta", src.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = float(theta)
    if "mrope_section" in rope:
        out["mrope_section"] = tuple(int(s) for s in rope["mrope_section"])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(f"config rope type: expected 'default' or 'mrope', got {kind!r}")
    return out


def config_from_hf(hf: dict[str, Any]) -> Qwen2_5_VLConfig:
    """Build the config from a parsed HF ``config.json`` (nested or flat text fields)."""
    text_src = hf.get("text_config")
    if not isinstance(text_src, dict) or not text_src:
        text_src = hf  # flat (transformers 4.x snapshots)
    text_kw = {}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "hidden_act"):
        if text_src.get(key) is not None:
            text_kw[key] = text_src[key]
    if "num_key_value_heads" not in text_kw and "num_attention_heads" in text_kw:
        text_kw["num_key_value_heads"] = text_kw["num_attention_heads"]
    text_kw.update(_rope_fields(text_src))
    if not text_kw.get("mrope_section") and text_src is not hf:
        text_kw.update({k: v for k, v in _rope_fields(hf).items() if k == "mrope_section"})
    tie = bool(hf.get("tie_word_embeddings", False) or text_src.get("tie_word_embeddings", False))
    text_kw["tie_word_embeddings"] = tie
    text = TextConfig(**{k: v for k, v in text_kw.items() if k in _TEXT_KEYS})

    vsrc = dict(hf.get("vision_config") or {})
    if "in_chans" in vsrc and "in_channels" not in vsrc:
        vsrc["in_channels"] = vsrc["in_chans"]
    if "num_attention_heads" in vsrc and "num_heads" not in vsrc:
        vsrc["num_heads"] = vsrc["num_attention_heads"]
    if "num_hidden_layers" in vsrc and "depth" not in vsrc:
        vsrc["depth"] = vsrc["num_hidden_layers"]
    vkw = {}
    for f in dataclasses.fields(VisionConfig):
        if f.name in vsrc and vsrc[f.name] is not None:
            vkw[f.name] = vsrc[f.name]
    vrope = vsrc.get("rope_parameters") or {}
    if "rope_theta" in vrope:
        vkw["rope_theta"] = float(vrope["rope_theta"])
    for k in ("patch_size", "temporal_patch_size"):
        if isinstance(vkw.get(k), (list, tuple)):
            if len(set(vkw[k])) != 1:
                raise ValueError(f"vision {k}: expected a single size, got {vkw[k]}")
            vkw[k] = int(vkw[k][0])
    if "fullatt_block_indexes" in vkw:
        vkw["fullatt_block_indexes"] = tuple(int(i) for i in vkw["fullatt_block_indexes"])
    vision = VisionConfig(**vkw)

    top = {}
    context = text_src.get("max_position_embeddings", hf.get("max_position_embeddings"))
    if context is not None:
        if not isinstance(context, int) or isinstance(context, bool) or context < 1:
            raise ValueError(f"config max_position_embeddings: expected a positive int, got {context!r}")
        top["max_position_embeddings"] = context
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        if hf.get(key) is not None:
            top[key] = int(hf[key])
    return Qwen2_5_VLConfig(text=text, vision=vision, **top)


def load_hf_config(path: str) -> Qwen2_5_VLConfig:
    """`config_from_hf` of a ``config.json``; a missing, non-UTF-8, non-JSON or inconsistent
    file raises an error naming it."""
    hf = read_json(path)
    try:
        return config_from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e


def _vision_7b() -> VisionConfig:
    return VisionConfig(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                        fullatt_block_indexes=(7, 15, 23, 31), window_size=112, tokens_per_second=2)


def preset(name: str) -> Qwen2_5_VLConfig:
    """Published configurations: ``"3b"`` (Qwen2.5-VL-3B-Instruct) and ``"7b"`` (Qwen2.5-VL-7B-Instruct)."""
    if name == "7b":
        text = TextConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                          num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1e6,
                          mrope_section=(16, 24, 24), tie_word_embeddings=False)
        return Qwen2_5_VLConfig(text=text, vision=_vision_7b())
    if name == "3b":
        text = TextConfig(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                          num_attention_heads=16, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
                          mrope_section=(16, 24, 24), tie_word_embeddings=True)
        vision = dataclasses.replace(_vision_7b(), out_hidden_size=2048)
        return Qwen2_5_VLConfig(text=text, vision=vision)
    raise ValueError(f"preset name: expected '3b' or '7b', got {name!r}")
