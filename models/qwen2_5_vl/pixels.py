"""Images and videos to Qwen2.5-VL patch rows in NumPy, as transformers' ``Qwen2VLImageProcessor`` /
``Qwen2VLVideoProcessor`` (transformers 5.x) make them.

Per image or video: RGB uint8 -> resize to ``smart_resize`` (transformers' variant, multiples of
``patch_size * merge_size``) with Pillow -> ``(x - mean / rescale) / (std / rescale)`` in float32 -> patches.
A video of ``T`` frames is padded to a multiple of ``temporal_patch_size`` (``tp``) by repeating its last frame; an
image is ``tp`` copies of itself. Rows come in the order ``[grid_t, grid_h / m, grid_w / m, m, m]`` and each row
holds ``[C, tp, p, p]`` values, so ``pixel_values`` is float32 ``[grid_t * grid_h * grid_w, C * tp * p * p]``
(``[N, 1176]`` for 3 channels, tp 2, p 14).

Resizing: transformers' default (torchvision) image and video processors use torchvision's antialiased bicubic, its
PIL image processor uses Pillow's; this module uses Pillow, so pixel values equal the PIL processor's to float32
rounding and differ from the torchvision ones by the two filters' rounding (torchvision computes the same
antialiased bicubic in float and rounds once, Pillow in fixed point): at most 1 uint8 level on the committed
fixtures (tests/models/test_processing.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
             3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}
IMAGE_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}  # transformers' Qwen2VLImageProcessor
VIDEO_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}  # transformers' Qwen2VLVideoProcessor


@dataclasses.dataclass(frozen=True)
class PixelConfig:
    """One image or video processor configuration (``preprocessor_config.json`` /
    ``video_preprocessor_config.json`` keys). ``min_pixels`` / ``max_pixels`` are ``size.shortest_edge`` /
    ``size.longest_edge``; ``cap_pixels_per_frame`` / ``max_video_tokens`` are the video processor's optional
    total-pixel cap (transformers' default: off)."""

    min_pixels: int
    max_pixels: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = 3
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000

    def __post_init__(self):
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                     "max_video_tokens"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError(f"image_mean/image_std: expected 3 values each, got {self.image_mean} / {self.image_std}")
        if self.resample not in _RESAMPLE:
            raise ValueError(f"resample: expected one of {sorted(_RESAMPLE)}, got {self.resample!r}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_dict(cls, d: Mapping, default_size: Mapping[str, int]) -> "PixelConfig":
        """Parse a processor config dict as transformers does: ``size`` (or the class default), then
        ``min_pixels`` / ``max_pixels`` override ``shortest_edge`` / ``longest_edge``."""
        size = dict(default_size if d.get("size") is None else d["size"])
        if d.get("min_pixels") is not None:
            size["shortest_edge"] = d["min_pixels"]
        if d.get("max_pixels") is not None:
            size["longest_edge"] = d["max_pixels"]
        if not size.get("shortest_edge") or not size.get("longest_edge"):
            raise ValueError(f"size: expected 'shortest_edge' and 'longest_edge', got {size}")
        kw = {k: d[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "do_resize",
                                "do_rescale", "do_normalize", "do_convert_rgb", "resample", "max_video_tokens")
              if d.get(k) is not None}
        for k in ("image_mean", "image_std"):
            if d.get(k) is not None:
                v = d[k]
                kw[k] = tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))
        if d.get("cap_pixels_per_frame") is not None:
            kw["cap_pixels_per_frame"] = bool(d["cap_pixels_per_frame"])
        return cls(min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]), **kw)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``smart_resize`` (Qwen2-VL image / video processors): sides rounded to multiples of
    ``factor``, area brought into ``[min_pixels, max_pixels]`` keeping the aspect ratio."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image: aspect ratio must be at most 200, got {height}x{width}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return int(h_bar), int(w_bar)


def to_rgb_array(image) -> np.ndarray:
    """uint8 [H, W, 3] from a PIL image (transparency composited on white, as transformers' ``convert_to_rgb``)
    or a uint8 [H, W, 3] array."""
    if isinstance(image, Image.Image):
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        return np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[-1] != 3:
        raise ValueError(f"image: expected a PIL image or a uint8 [H, W, 3] array, got {arr.dtype} {arr.shape}")
    return arr


def resize_frames(frames: np.ndarray, height: int, width: int, resample: int = 3) -> np.ndarray:
    """uint8 [T, H, W, 3] -> uint8 [T, height, width, 3] with Pillow (bicubic by default, antialiased)."""
    if frames.shape[1:3] == (height, width):
        return frames
    out = np.empty((len(frames), height, width, 3), np.uint8)
    for i, frame in enumerate(frames):
        out[i] = np.asarray(Image.fromarray(frame).resize((width, height), _RESAMPLE[resample]))
    return out


def normalize(frames: np.ndarray, cfg: PixelConfig) -> np.ndarray:
    """uint8 [T, H, W, 3] -> float32 [T, 3, H, W], rescaled and normalized as transformers' fused kernel does."""
    x = np.ascontiguousarray(frames.transpose(0, 3, 1, 2)).astype(np.float32)
    if cfg.do_normalize:
        scale = 1.0 / cfg.rescale_factor if cfg.do_rescale else 1.0
        mean = np.asarray([m * scale for m in cfg.image_mean], np.float32)[:, None, None]
        std = np.asarray([s * scale for s in cfg.image_std], np.float32)[:, None, None]
        return (x - mean) / std
    if cfg.do_rescale:
        return x * np.float32(cfg.rescale_factor)
    return x


def patchify(x: np.ndarray, cfg: PixelConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """float32 [T, C, H, W] -> rows float32 [grid_t * grid_h * grid_w, C * tp * p * p] and (grid_t, grid_h, grid_w)."""
    t, c, h, w = x.shape
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if h % (p * m) or w % (p * m):
        raise ValueError(f"frames: height and width must be multiples of {p * m}, got {h}x{w}")
    if pad := -t % tp:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
        t += pad
    gt, gh, gw = t // tp, h // p, w // p
    x = x.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, tp, p, p]
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)


def image_patches(image, cfg: PixelConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image (PIL or uint8 [H, W, 3]) -> (float32 [grid_h * grid_w, patch_dim], (1, grid_h, grid_w))."""
    rgb = to_rgb_array(image) if cfg.do_convert_rgb else np.asarray(image)
    frames = rgb[None]
    if cfg.do_resize:
        h, w = smart_resize(rgb.shape[0], rgb.shape[1], cfg.factor, cfg.min_pixels, cfg.max_pixels)
        frames = resize_frames(frames, h, w, cfg.resample)
    frames = np.repeat(frames, cfg.temporal_patch_size, axis=0)
    return patchify(normalize(frames, cfg), cfg)


def video_patches(video, cfg: PixelConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One video (uint8 [T, H, W, 3], or a list of frames) -> (float32 [grid_t * grid_h * grid_w, patch_dim],
    (grid_t, grid_h, grid_w))."""
    if isinstance(video, (list, tuple)):
        video = np.stack([to_rgb_array(f) for f in video])
    frames = np.asarray(video)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
        raise ValueError(f"videos: expected uint8 [T, H, W, 3] arrays with T >= 1, got {frames.dtype} {frames.shape}")
    if cfg.do_resize:
        max_pixels = cfg.max_pixels
        if cfg.cap_pixels_per_frame:
            total = int(cfg.max_video_tokens * cfg.factor * cfg.factor * 0.9)
            max_pixels = max(min(max_pixels, total * cfg.temporal_patch_size // len(frames)),
                             int(cfg.min_pixels * 1.05))
        h, w = smart_resize(frames.shape[1], frames.shape[2], cfg.factor, cfg.min_pixels, max_pixels)
        frames = resize_frames(frames, h, w, cfg.resample)
    return patchify(normalize(frames, cfg), cfg)
