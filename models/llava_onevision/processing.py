"""LLaVA-OneVision processor in NumPy: text, images and videos to the model's inputs, with no torch or transformers.

``Processor.from_pretrained(snapshot_dir)`` reads the snapshot's own files (``tokenizer.json``, ``processor_config.json``
with nested ``image_processor`` / ``video_processor``, or ``preprocessor_config.json`` + ``video_preprocessor_config.json``,
the chat template); ``processor(text=..., images=..., videos=...)`` returns what transformers'
``LlavaOnevisionProcessor`` (5.x) returns, as NumPy arrays:

* ``input_ids`` / ``attention_mask`` int64 [B, L]: each ``<image>`` expanded to the image's feature count (anyres:
  base tile + unpadded tile grid with one newline per row, shrunk above ``anyres_max_N``; an image of a multi-image
  row: one tile + newline), each ``<video>`` to ``frames * ceil(g / 2)**2 + 1``;
* ``pixel_values`` float32 [n_images, max_tiles, 3, S, S] (zero-padded tiles), ``image_sizes`` int64 [n_images, 2]
  (height, width), ``batch_num_images`` int64 [rows with images];
* ``pixel_values_videos`` float32 [n_videos, F, 3, S, S] (videos of one call must have equal frame counts).

Images (transformers' PIL image processor): a row with one image is tiled: resized with Pillow (bicubic) to fit the
best ``image_grid_pinpoints`` canvas, zero-padded to it (centred), cut into S x S tiles, after a base tile (the whole
image resized to S x S); an image of a multi-image row is padded to a square with the mean colour and resized to
S x S. Videos: every frame resized to S x S. Then ``x / 255``, ``(x - mean) / std``. Pixel values equal the PIL image
processor's to float32 rounding; transformers' video processor resizes with torchvision's antialiased bicubic, which
differs from Pillow's by at most one uint8 level on a few values (see ``models.qwen2_5_vl.pixels``). Frames are taken
as given: LLaVA-OneVision has no time encoding, so ``video_metadata`` / ``fps`` (accepted for a common interface)
change nothing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np
from PIL import Image

from models import chat_template as templates
from models.llava_onevision import anyres
from models.llava_onevision.config import (
    DEFAULT_PINPOINTS,
    ORIGINAL_ARCHITECTURES,
    config_from_hf,
)
from models.qwen2_5_vl.pixels import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    resize_frames,
    to_rgb_array,
)
from models.snapshot import resolve_snapshot
from models.tokenizer import Tokenizer, read_json

IMAGE_TOKEN = "<image>"
VIDEO_TOKEN = "<video>"


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """The image / video processor settings (``processor_config.json`` keys). size: the tile side S."""

    size: int = 384
    pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = 3

    @classmethod
    def from_dict(cls, d: Mapping) -> ImageConfig:
        size = d.get("size") or {"height": 384, "width": 384}
        side = size.get("height", size.get("shortest_edge"))
        if not isinstance(side, int) or side < 1 or size.get("width", side) != side:
            raise ValueError(f"size: expected a square tile {{'height': S, 'width': S}}, got {size}")
        if d.get("do_resize") is False or d.get("do_center_crop"):
            raise ValueError("image processor: do_resize=False / do_center_crop are not supported")
        kw = {k: d[k] for k in ("rescale_factor", "do_rescale", "do_normalize", "do_convert_rgb", "resample")
              if d.get(k) is not None}
        for k in ("image_mean", "image_std"):
            if d.get(k) is not None:
                kw[k] = tuple(float(x) for x in d[k])
        pins = d.get("image_grid_pinpoints")
        if pins is not None:
            kw["pinpoints"] = tuple((int(h), int(w)) for h, w in pins)
        return cls(size=side, **kw)

    def normalize(self, frames: np.ndarray) -> np.ndarray:
        """uint8 [T, H, W, 3] -> float32 [T, 3, H, W]."""
        x = np.ascontiguousarray(frames.transpose(0, 3, 1, 2)).astype(np.float32)
        if self.do_rescale:
            x = x * np.float32(self.rescale_factor)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, np.float32)[:, None, None]
            std = np.asarray(self.image_std, np.float32)[:, None, None]
            x = (x - mean) / std
        return x


def _resize(img: np.ndarray, h: int, w: int, resample: int) -> np.ndarray:
    return resize_frames(img[None], h, w, resample)[0]


def image_tiles(image, cfg: ImageConfig, tiled: bool) -> tuple[np.ndarray, tuple[int, int]]:
    """One image (PIL or uint8 [H, W, 3]) -> (float32 [tiles, 3, S, S], (height, width))."""
    rgb = to_rgb_array(image) if cfg.do_convert_rgb else np.asarray(image)
    h0, w0 = rgb.shape[:2]
    s = cfg.size
    if tiled:
        ch, cw = anyres.select_best_resolution((h0, w0), cfg.pinpoints)
        if cw / w0 < ch / h0:
            nh, nw = min(int(np.ceil(h0 * (cw / w0))), ch), cw
        else:
            nh, nw = ch, min(int(np.ceil(w0 * (ch / h0))), cw)
        canvas = np.zeros((ch, cw, 3), np.uint8)
        top, left = (ch - nh) // 2, (cw - nw) // 2
        canvas[top:top + nh, left:left + nw] = _resize(rgb, nh, nw, cfg.resample)
        tiles = [_resize(rgb, s, s, cfg.resample)]
        tiles += [canvas[i:i + s, j:j + s] for i in range(0, ch, s) for j in range(0, cw, s)]
    else:
        side = max(h0, w0)
        fill = np.asarray([int(m * 255) for m in cfg.image_mean], np.uint8)
        square = np.broadcast_to(fill, (side, side, 3)).copy()
        top, left = ((side - h0) // 2, 0) if w0 > h0 else (0, (side - w0) // 2)
        square[top:top + h0, left:left + w0] = rgb
        tiles = [_resize(square, s, s, cfg.resample)]
    return cfg.normalize(np.stack(tiles)), (h0, w0)


def video_frames(video, cfg: ImageConfig) -> np.ndarray:
    """One video (uint8 [T, H, W, 3], or a list of frames) -> float32 [T, 3, S, S]."""
    if isinstance(video, (list, tuple)):
        video = np.stack([to_rgb_array(f) for f in video])
    frames = np.asarray(video)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
        raise ValueError(f"videos: expected uint8 [T, H, W, 3] arrays with T >= 1, got {frames.dtype} {frames.shape}")
    return cfg.normalize(resize_frames(frames, cfg.size, cfg.size, cfg.resample))


def _configs(d: str, model_config: Mapping | None) -> tuple[dict, dict, dict]:
    """(processor options, image processor dict, video processor dict) of a snapshot. A LLaVA-NeXT snapshot
    (config.json of ``LlavaQwenForCausalLM``) without processor files gets the SigLIP processor the LLaVA-NeXT code
    uses (tile = the tower's image size, mean = std = 0.5, bicubic) with the config's pinpoints and
    ``image_aspect_ratio``."""
    def load(name):
        path = os.path.join(d, name)
        return read_json(path) if os.path.isfile(path) else None

    nested = load("processor_config.json") or {}
    image = load("preprocessor_config.json") or nested.get("image_processor")
    video = load("video_preprocessor_config.json") or nested.get("video_processor") or image
    if image is None and model_config is not None and (
            set(model_config.get("architectures") or []) & set(ORIGINAL_ARCHITECTURES)):
        cfg = config_from_hf(dict(model_config))
        tile = cfg.vision.image_size
        image = video = {"size": {"height": tile, "width": tile}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                         "image_grid_pinpoints": [list(p) for p in cfg.image_grid_pinpoints], "resample": 3}
        nested = {"num_image_tokens": cfg.vision.grid ** 2, "vision_feature_select_strategy": "full",
                  "vision_aspect_ratio": f"anyres_max_{cfg.max_patches}", **nested}
    if image is None:
        raise ValueError(f"snapshot_dir: no preprocessor_config.json (or processor_config.json with an "
                         f"'image_processor') in {d!r}")
    return nested, image, video


def _image_rows(images) -> tuple[list, list[int]]:
    """(flat images, images per row): a list of lists is one list per row (multi-image rows are not tiled)."""
    if images is None:
        return [], []
    if isinstance(images, (Image.Image, np.ndarray)):
        return [images], [1]
    items = list(images)
    if items and isinstance(items[0], (list, tuple)):
        rows = [list(r) for r in items if len(r)]
        return [im for r in rows for im in r], [len(r) for r in rows]
    return items, [1] * len(items)


class Processor:
    """Tokenizer + image / video processors + chat template of one LLaVA-OneVision snapshot (see the module doc)."""

    def __init__(self, tokenizer: Tokenizer, image_config: ImageConfig, video_config: ImageConfig, *,
                 num_image_tokens: int | None = None, select_strategy: str = "full", max_patches: int = 9,
                 chat_template: str | dict[str, str] | None = None, model_config: Mapping | None = None):
        self.tokenizer = tokenizer
        self.image_config = image_config
        self.video_config = video_config
        self.chat_template = chat_template
        self.select_strategy = select_strategy
        self.max_patches = max_patches
        ids = {}
        for key, token, default in (("image_token_index", IMAGE_TOKEN, 151646), ("video_token_index", VIDEO_TOKEN, 151647)):
            got, want = tokenizer.token_to_id(token), (model_config or {}).get(key)
            if got is not None and want is not None and want != got:
                raise ValueError(f"config.json: {key} is {want} but the tokenizer has {got}")
            ids[key] = got if got is not None else (want if want is not None else default)
        self.image_token_id, self.video_token_id = ids["image_token_index"], ids["video_token_index"]
        # a LLaVA-NeXT snapshot's tokenizer has no <image> / <video>: the text around them is tokenized apart
        self.placeholders_in_vocab = (tokenizer.token_to_id(IMAGE_TOKEN) == self.image_token_id
                                      and tokenizer.token_to_id(VIDEO_TOKEN) == self.video_token_id)
        if num_image_tokens is None:
            vision = (model_config or {}).get("vision_config") or {}
            num_image_tokens = (image_config.size // vision.get("patch_size", 14)) ** 2
        grid = math.isqrt(num_image_tokens)
        if grid * grid != num_image_tokens:
            raise ValueError(f"num_image_tokens: expected a square (patches per tile), got {num_image_tokens}")
        self.grid = grid
        self.eos_token_id = tokenizer.special_id("eos_token")
        self.pad_token_id = tokenizer.special_id("pad_token")

    @classmethod
    def from_pretrained(cls, snapshot_dir: str | os.PathLike) -> Processor:
        """Load from a snapshot directory (or a hub-cache model tree, see ``models.snapshot``)."""
        d = resolve_snapshot(snapshot_dir, marker="tokenizer.json")
        config_path = os.path.join(d, "config.json")
        model_config = read_json(config_path) if os.path.isfile(config_path) else None
        opts, image, video = _configs(d, model_config)
        if video.get("do_sample_frames"):
            raise ValueError("video processor: do_sample_frames=true is not supported; sample frames with "
                             "mmjax.io.read_video")
        ratio = re.fullmatch(r"anyres_max_(\d+)", opts.get("vision_aspect_ratio", "anyres_max_9"))
        if ratio is None:
            raise ValueError(f"vision_aspect_ratio: expected 'anyres_max_N', got {opts.get('vision_aspect_ratio')!r}")
        return cls(Tokenizer.from_pretrained(d), ImageConfig.from_dict(image), ImageConfig.from_dict(video),
                   num_image_tokens=opts.get("num_image_tokens"),
                   select_strategy=opts.get("vision_feature_select_strategy") or "full",
                   max_patches=int(ratio.group(1)), chat_template=templates.load_chat_template(d),
                   model_config=model_config)

    def image_tokens(self, size: tuple[int, int], tiled: bool) -> int:
        """Placeholder tokens of an image of ``size`` (height, width), tiled (alone in its row) or not."""
        tile_tokens = self.grid * self.grid - (self.select_strategy == "default")
        return anyres.image_layout(size, tile=self.image_config.size, grid=self.grid,
                                   pinpoints=self.image_config.pinpoints, max_patches=self.max_patches, tiled=tiled,
                                   tile_tokens=tile_tokens).tokens

    def __call__(self, text: str | Sequence[str] | None = None, images=None, videos=None, *, video_metadata=None,
                 fps=None, padding: bool | str = False, padding_side: str | None = None,
                 return_tensors: str | None = None) -> dict[str, np.ndarray]:
        """Model inputs for ``text`` (one string or a batch), ``images`` (PIL images or uint8 [H, W, 3] arrays; flat,
        or one list per row) and ``videos`` (uint8 [T, H, W, 3] arrays); see the module doc for the keys."""
        if return_tensors not in (None, "np"):
            raise ValueError(f"return_tensors: only NumPy outputs (None or 'np'), got {return_tensors!r}")
        texts = [text] if isinstance(text, str) else (None if text is None else list(text))
        if texts is not None and not all(isinstance(t, str) for t in texts):
            raise ValueError("text: expected a string or a list of strings")
        image_list, per_row = _image_rows(images)
        video_list = [] if videos is None else ([videos] if isinstance(videos, np.ndarray) and videos.ndim == 4
                                                else list(videos))
        if texts is not None:
            for token, items, what in ((IMAGE_TOKEN, image_list, "images"), (VIDEO_TOKEN, video_list, "videos")):
                found = sum(t.count(token) for t in texts)
                if found != len(items):
                    raise ValueError(f"{what}: the text has {found} {token} tokens but {len(items)} {what} were "
                                     "passed; expected one per token")
        out: dict[str, np.ndarray] = {}
        tiled = [n == 1 for n in per_row for _ in range(n)]
        tiles, sizes = zip(*(image_tiles(im, self.image_config, t) for im, t in zip(image_list, tiled))) \
            if image_list else ((), ())
        frames = [video_frames(v, self.video_config) for v in video_list]
        if texts is not None:
            counts = {"image": iter([self.image_tokens(s, t) for s, t in zip(sizes, tiled)]),
                      "video": iter([anyres.video_tokens(len(f), self.grid) for f in frames])}
            pattern = re.compile(f"(?P<image>{re.escape(IMAGE_TOKEN)})|(?P<video>{re.escape(VIDEO_TOKEN)})")
            token = {"image": IMAGE_TOKEN, "video": VIDEO_TOKEN}
            if self.placeholders_in_vocab:
                expanded = [pattern.sub(lambda m: token[m.lastgroup] * next(counts[m.lastgroup]), t) for t in texts]
                enc = self.tokenizer.encode(expanded, padding=padding, padding_side=padding_side)
            else:
                enc = self._encode_split(texts, pattern, counts, padding, padding_side)
            out["input_ids"], out["attention_mask"] = enc["input_ids"], enc["attention_mask"]
            ids = out["input_ids"]
            out["mm_token_type_ids"] = np.where(ids == self.image_token_id, 1,
                                                np.where(ids == self.video_token_id, 2, 0)).astype(np.int64)
        if image_list:
            most = max(len(t) for t in tiles)
            out["pixel_values"] = np.stack([np.concatenate([t, np.zeros((most - len(t),) + t.shape[1:], t.dtype)])
                                            for t in tiles])
            out["image_sizes"] = np.asarray(sizes, np.int64)
            out["batch_num_images"] = np.asarray(per_row, np.int64)
        if video_list:
            if len({len(f) for f in frames}) != 1:
                raise ValueError(f"videos: expected equal frame counts in one call, got {[len(f) for f in frames]}")
            out["pixel_values_videos"] = np.stack(frames)
        return out

    def _encode_split(self, texts, pattern, counts, padding, padding_side) -> dict[str, np.ndarray]:
        """Tokenize the text between placeholders and put ``count`` placeholder ids in their place (for tokenizers
        without ``<image>`` / ``<video>``), padded as `Tokenizer.encode` pads."""
        ids = {"image": self.image_token_id, "video": self.video_token_id}
        rows = []
        for t in texts:
            row, last = [], 0
            for m in [*pattern.finditer(t), None]:
                piece = t[last:m.start() if m else len(t)]
                if piece:
                    row += self.tokenizer.encode([piece], add_special_tokens=False)["input_ids"][0].tolist()
                if m:
                    row += [ids[m.lastgroup]] * next(counts[m.lastgroup])
                    last = m.end()
            rows.append(row)
        length = max(len(r) for r in rows)
        if len({len(r) for r in rows}) > 1 and padding in (False, "do_not_pad"):
            raise ValueError(f"text: rows tokenize to different lengths {[len(r) for r in rows]}; pass padding=True")
        side = self.tokenizer.padding_side if padding_side is None else padding_side
        out_ids = np.full((len(rows), length), self.pad_token_id or 0, np.int64)
        mask = np.zeros((len(rows), length), np.int64)
        for i, r in enumerate(rows):
            sl = slice(length - len(r), length) if side == "left" else slice(0, len(r))
            out_ids[i, sl], mask[i, sl] = r, 1
        return {"input_ids": out_ids, "attention_mask": mask}

    # ------------------------------------------------------------------------------------------- text helpers
    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False, *,
                            chat_template: str | None = None, **variables):
        """Render a conversation (or a batch of them) with the snapshot's chat template (``add_generation_prompt``
        defaults to True: mmjax renders prompts to answer them). ``tokenize=True`` returns the ids of text-only
        conversations."""
        return templates.apply_chat_template(
            self.chat_template, chat_template, self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
            tokenize=tokenize, media_tokens=(IMAGE_TOKEN, VIDEO_TOKEN), **variables)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of a 1-D sequence of token ids (special tokens skipped by default)."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        """Texts of a [B, L] array or a list of id sequences (special tokens skipped by default)."""
        return self.tokenizer.batch_decode(sequences, skip_special_tokens=skip_special_tokens)
