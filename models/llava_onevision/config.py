"""Frozen configuration of LLaVA-OneVision / LLaVA-Video (SigLIP tower, 2-layer MLP projector, Qwen2 decoder).

Two config.json layouts are read:

* transformers' ``LlavaOnevisionConfig`` (``model_type`` "llava_onevision": ``text_config`` / ``vision_config``,
  ``image_token_index``, ``vision_feature_layer``, ``image_grid_pinpoints``, ``vision_aspect_ratio``);
* the original LLaVA-NeXT layout that LLaVA-OneVision / LLaVA-Video-7B-Qwen2 ship in (``LlavaQwenForCausalLM``:
  flat Qwen2 fields, ``mm_vision_tower``, ``image_aspect_ratio``, ``image_grid_pinpoints``, ...). The tower is not
  described there: ``mm_vision_tower`` names it (``KNOWN_TOWERS``, SigLIP so400m with its last layer dropped, as the
  LLaVA-NeXT code runs it), or a ``vision_config`` entry gives it. Placeholder ids default to the ones
  transformers' conversion adds (151646 ``<image>``, 151647 ``<video>``).

The decoder is Qwen2 with 1-D RoPE; it runs on the shared decoder (``models.text_decoder``) with M-RoPE
tables whose three position rows are equal (``mrope_section = (head_dim / 2, 0, 0)``), which is 1-D RoPE.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from models.files import read_json
from models.text_decoder import TextConfig

ORIGINAL_ARCHITECTURES = ("LlavaQwenForCausalLM",)
DEFAULT_PINPOINTS = tuple((h, w) for h in range(384, 2305, 384) for w in range(384, 2305, 384))


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """SigLIP vision tower (``SiglipVisionConfig``): ``image_size`` is the tile side in pixels, ``num_hidden_layers``
    the encoder layers the checkpoint holds."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 26
    num_attention_heads: int = 16
    image_size: int = 384
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vision hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.image_size < self.patch_size:
            raise ValueError(f"vision image_size ({self.image_size}) must be at least patch_size ({self.patch_size})")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision hidden_act: expected 'gelu_pytorch_tanh' or 'gelu', got {self.hidden_act!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid(self) -> int:
        """Patches per tile side (27 for 384 / 14: the convolution drops the last 6 pixels)."""
        return self.image_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size * self.patch_size


KNOWN_TOWERS = {"google/siglip-so400m-patch14-384": VisionConfig()}


@dataclasses.dataclass(frozen=True)
class LlavaOnevisionConfig:
    """text: the Qwen2 decoder; vision: the SigLIP tower; vision_feature_layers: indices into the tower's
    hidden states (0 = embeddings, i = output of layer i; negative counted from the end as in transformers),
    concatenated; select_strategy "full" (every patch) or "default" (drops the first); image_grid_pinpoints:
    (height, width) anyres canvases; max_patches: the N of ``anyres_max_N``; projector_act: "gelu"."""

    text: TextConfig
    vision: VisionConfig
    image_token_id: int = 151646
    video_token_id: int = 151647
    vision_feature_layers: tuple[int, ...] = (-1,)
    select_strategy: str = "full"
    image_grid_pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS
    max_patches: int = 9
    projector_act: str = "gelu"
    projector_bias: bool = True
    max_position_embeddings: int = 32768

    def __post_init__(self):
        L = self.vision.num_hidden_layers
        for i in self.vision_feature_layers:
            if not -(L + 1) <= i <= L:
                raise ValueError(f"vision_feature_layer: expected indices in [{-(L + 1)}, {L}] for {L} layers, "
                                 f"got {self.vision_feature_layers}")
        if not self.vision_feature_layers:
            raise ValueError("vision_feature_layer: expected at least one index")
        if self.select_strategy not in ("full", "default"):
            raise ValueError(f"vision_feature_select_strategy: expected 'full' or 'default', got "
                             f"{self.select_strategy!r}")
        if self.projector_act not in ("gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"projector_hidden_act: expected 'gelu', got {self.projector_act!r}")
        if not self.image_grid_pinpoints or any(len(p) != 2 or min(p) < 1 for p in self.image_grid_pinpoints):
            raise ValueError(f"image_grid_pinpoints: expected (height, width) pairs, got {self.image_grid_pinpoints}")
        if self.max_patches < 1:
            raise ValueError(f"vision_aspect_ratio: expected anyres_max_N with N >= 1, got {self.max_patches}")
        for name in ("image_token_id", "video_token_id"):
            v = getattr(self, name)
            if not 0 <= v < self.text.vocab_size:
                raise ValueError(f"{name}: expected an id in [0, {self.text.vocab_size}), got {v}")
        if sum(self.text.mrope_section) != self.text.head_dim // 2 or any(self.text.mrope_section[1:]):
            raise ValueError(f"text mrope_section: expected ({self.text.head_dim // 2}, 0, 0) (1-D RoPE), got "
                             f"{self.text.mrope_section}")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """``vision_feature_layers`` as non-negative hidden-state indices."""
        n = self.vision.num_hidden_layers + 1
        return tuple(i % n for i in self.vision_feature_layers)

    @property
    def tile_tokens(self) -> int:
        """Features per tile after the select strategy (729 for 27 x 27 patches, "full")."""
        return self.vision.grid ** 2 - (self.select_strategy == "default")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlavaOnevisionConfig:
        text = dict(d["text"])
        text["mrope_section"] = tuple(text["mrope_section"])
        rest = {k: v for k, v in d.items() if k not in ("text", "vision")}
        rest["vision_feature_layers"] = tuple(rest["vision_feature_layers"])
        rest["image_grid_pinpoints"] = tuple(tuple(p) for p in rest["image_grid_pinpoints"])
        return cls(text=TextConfig(**text), vision=VisionConfig(**d["vision"]), **rest)


def qwen2_text_config(src: dict[str, Any], tie: bool) -> TextConfig:
    """The Qwen2 decoder of a config dict (transformers' ``Qwen2Config`` fields; ``rope_parameters`` or
    ``rope_theta``; only the default rope type)."""
    kw = {}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "hidden_act"):
        if src.get(key) is not None:
            kw[key] = src[key]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in kw:
            raise ValueError(f"config text {key}: missing")
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    kw.setdefault("rms_norm_eps", 1e-6)
    rope = src.get("rope_parameters") or src.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"config text rope type: expected 'default', got {kind!r}")
    kw["rope_theta"] = float(rope.get("rope_theta", src.get("rope_theta", 1e6)))
    if src.get("use_sliding_window"):
        raise ValueError("config text use_sliding_window: sliding-window attention is not supported")
    head_dim = kw["hidden_size"] // kw["num_attention_heads"]
    return TextConfig(**kw, qkv_bias=True, mrope_section=(head_dim // 2, 0, 0), tie_word_embeddings=tie)


def _pinpoints(value, tile: int) -> tuple[tuple[int, int], ...]:
    """A list of (height, width) pairs, or LLaVA-NeXT's range string ``"(1x1),...,(6x6)"`` in tiles."""
    if value is None:
        return DEFAULT_PINPOINTS
    if isinstance(value, str):
        found = [tuple(int(v) for v in m) for m in re.findall(r"\((\d+)x(\d+)\)", value)]
        if len(found) != 2:
            raise ValueError(f"config image_grid_pinpoints: expected a list or '(AxB),...,(CxD)', got {value!r}")
        (a0, b0), (a1, b1) = found
        return tuple((i * tile, j * tile) for i in range(a0, a1 + 1) for j in range(b0, b1 + 1))
    return tuple((int(p[0]), int(p[1])) for p in value)


def _max_patches(value: str | None) -> int:
    value = value or "anyres_max_9"
    m = re.fullmatch(r"anyres_max_(\d+)", value)
    if not m:
        raise ValueError(f"config vision_aspect_ratio: expected 'anyres_max_N', got {value!r}")
    return int(m.group(1))


def _vision(src: dict[str, Any]) -> VisionConfig:
    return VisionConfig(**{f.name: src[f.name] for f in dataclasses.fields(VisionConfig) if src.get(f.name) is not None})


def _layers(value) -> tuple[int, ...]:
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise TypeError(f"config vision_feature_layer: expected an int or a list of ints, got {value!r}")
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def config_from_hf(hf: dict[str, Any]) -> LlavaOnevisionConfig:
    """Build the config from a parsed config.json (transformers' or the original LLaVA-NeXT layout)."""
    names = hf.get("architectures") or []
    original = any(n in ORIGINAL_ARCHITECTURES for n in names) or hf.get("model_type") in ("llava", "llava_qwen")
    context = None
    if original:
        tie = bool(hf.get("tie_word_embeddings", False))
        text = qwen2_text_config(hf, tie)
        tower = hf.get("mm_vision_tower")
        if isinstance(hf.get("vision_config"), dict):
            vision = _vision(hf["vision_config"])
        elif tower in KNOWN_TOWERS:
            vision = KNOWN_TOWERS[tower]
        else:
            raise ValueError(f"config mm_vision_tower: unknown tower {tower!r} and no vision_config; known: "
                             f"{sorted(KNOWN_TOWERS)}")
        if hf.get("mm_projector_type", "mlp2x_gelu") != "mlp2x_gelu":
            raise ValueError(f"config mm_projector_type: expected 'mlp2x_gelu', got {hf.get('mm_projector_type')!r}")
        if hf.get("mm_patch_merge_type", "spatial_unpad") not in ("spatial_unpad",):
            raise ValueError(f"config mm_patch_merge_type: expected 'spatial_unpad', got {hf['mm_patch_merge_type']!r}")
        top = {"vision_feature_layers": (-1,), "select_strategy": "full",
                "image_grid_pinpoints": _pinpoints(hf.get("image_grid_pinpoints"), vision.image_size),
                "max_patches": _max_patches(hf.get("image_aspect_ratio"))}
        context = hf.get("max_position_embeddings")
    else:
        text_src = hf.get("text_config")
        if not isinstance(text_src, dict):
            raise ValueError("config text_config: expected the Qwen2 decoder's fields")
        if text_src.get("model_type", "qwen2") != "qwen2":
            raise ValueError(f"config text_config model_type: expected 'qwen2', got {text_src.get('model_type')!r}")
        tie = bool(hf.get("tie_word_embeddings", False) or text_src.get("tie_word_embeddings", False))
        text = qwen2_text_config(text_src, tie)
        vsrc = hf.get("vision_config") or {}
        if vsrc.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise ValueError(f"config vision_config model_type: expected 'siglip_vision_model', got "
                             f"{vsrc.get('model_type')!r}")
        vision = _vision(vsrc) if vsrc else VisionConfig()
        top = {"vision_feature_layers": _layers(hf.get("vision_feature_layer", -1)),
                "select_strategy": hf.get("vision_feature_select_strategy", "full"),
                "image_grid_pinpoints": _pinpoints(hf.get("image_grid_pinpoints"), vision.image_size),
                "max_patches": _max_patches(hf.get("vision_aspect_ratio")),
                "projector_act": hf.get("projector_hidden_act", "gelu"),
                "projector_bias": bool(hf.get("multimodal_projector_bias", True))}
        context = text_src.get("max_position_embeddings", hf.get("max_position_embeddings"))
    for key, name in (("image_token_index", "image_token_id"), ("image_token_id", "image_token_id"),
                      ("video_token_index", "video_token_id"), ("video_token_id", "video_token_id")):
        if isinstance(hf.get(key), int) and not isinstance(hf.get(key), bool):
            top[name] = hf[key]
    if context is not None:
        if not isinstance(context, int) or isinstance(context, bool) or context < 1:
            raise ValueError(f"config max_position_embeddings: expected a positive int, got {context!r}")
        top["max_position_embeddings"] = context
    return LlavaOnevisionConfig(text=text, vision=vision, **top)


def load_hf_config(path: str) -> LlavaOnevisionConfig:
    """`config_from_hf` of a ``config.json``; a missing or inconsistent file raises an error naming it."""
    hf = read_json(path)
    try:
        return config_from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e


def preset(name: str) -> LlavaOnevisionConfig:
    """The shapes of llava-hf's ``llava-onevision-qwen2-7b-ov-hf`` (``"7b"``; LLaVA-Video-7B-Qwen2 has the same layers)
    and ``llava-onevision-qwen2-0.5b-ov-hf`` (``"0.5b"``): SigLIP so400m without its last layer, Qwen2-7B / 0.5B with
    the vocabulary grown by ``<image>`` / ``<video>`` and padded to a multiple of 64 (transformers' conversion)."""
    if name == "7b":
        text = TextConfig(vocab_size=152128, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                          num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1e6,
                          mrope_section=(64, 0, 0), tie_word_embeddings=False)
        return LlavaOnevisionConfig(text=text, vision=VisionConfig())
    if name == "0.5b":
        text = TextConfig(vocab_size=152000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
                          mrope_section=(32, 0, 0), tie_word_embeddings=True)
        return LlavaOnevisionConfig(text=text, vision=VisionConfig())
    raise ValueError(f"preset name: expected '0.5b' or '7b', got {name!r}")
