"""Qwen2.5-VL processor in NumPy: text, images and videos to the model's inputs, with no torch or transformers.

``Processor.from_pretrained(snapshot_dir)`` reads the snapshot's own files; ``processor(text=..., images=...,
videos=..., video_metadata=...)`` returns what transformers' ``Qwen2_5_VLProcessor`` (5.x) returns for that
snapshot, as NumPy arrays:

* ``input_ids`` / ``attention_mask`` int64 [B, L] (each ``<|image_pad|>`` / ``<|video_pad|>`` expanded to
  ``grid_t * grid_h * grid_w / merge_size**2`` copies; rows padded with ``padding=True``),
  ``mm_token_type_ids`` int64 [B, L] (1 image token, 2 video token, 0 otherwise);
* ``pixel_values`` float32 [sum of grid products over images, 1176], ``image_grid_thw`` int64 [n_images, 3];
* ``pixel_values_videos`` float32 [..., 1176], ``video_grid_thw`` int64 [n_videos, 3], ``second_per_grid_ts``
  float64 [n_videos] = ``temporal_patch_size / sampled_fps``.

Token ids and grids are exact. Pixel values (see ``models.qwen2_5_vl.pixels``) equal transformers' PIL image
processor's to float32 rounding; against its default torchvision image / video processors they differ by the
resize filters' rounding: at most 1 uint8 level per value (1 / (255 * std), 0.0150 with the CLIP std), mean
absolute difference below 0.02 level, on the committed fixtures (tests/models/test_processing.py checks both).

``sampled_fps`` per video comes from ``video_metadata`` (``fps``, ``frames_indices``, ``total_num_frames`` as
transformers' ``VideoMetadata``; ``mmjax.io.VideoMeta`` works through its ``hf_metadata()``), exactly as
transformers computes it, falling back to transformers' 24 when a video has no metadata. ``fps=`` (one number, or
one per video) is taken as the videos' sampled fps, the meaning qwen-vl-utils gives it; transformers 5.23 ignores
``fps`` for frames it did not sample itself (it then uses 24), so this is the one deliberate difference.
Frames must be sampled before (``mmjax.io.read_video``): ``do_sample_frames`` is not supported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

import numpy as np
from PIL import Image

from models import chat_template as templates
from models.qwen2_5_vl.pixels import IMAGE_SIZE, VIDEO_SIZE, PixelConfig, image_patches, video_patches
from models.snapshot import resolve_snapshot
from models.tokenizer import Tokenizer, read_json

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
_CONFIG_TOKENS = (("image_token_id", IMAGE_TOKEN), ("video_token_id", VIDEO_TOKEN),
                  ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))


def _processor_configs(snapshot_dir: str) -> tuple[dict, dict]:
    """(image config dict, video config dict) from ``preprocessor_config.json``,
    ``video_preprocessor_config.json`` or ``processor_config.json`` (nested ``image_processor`` /
    ``video_processor``); the video processor falls back to the image processor's file, as transformers' does."""
    def load(name):
        path = os.path.join(snapshot_dir, name)
        return read_json(path) if os.path.isfile(path) else None

    def first(*candidates):
        return next((c for c in candidates if c is not None), None)

    nested = first(load("processor_config.json"), {})
    image = first(load("preprocessor_config.json"), nested.get("image_processor"))
    video = first(load("video_preprocessor_config.json"), nested.get("video_processor"), image)
    if image is None:
        raise ValueError(f"snapshot_dir: no preprocessor_config.json (or processor_config.json with an "
                         f"'image_processor') in {snapshot_dir!r}")
    return image, video


def _flat_images(images) -> list:
    if images is None:
        return []
    if isinstance(images, (Image.Image, np.ndarray)):
        return [images]
    out = []
    for item in images:
        out.extend(_flat_images(item) if isinstance(item, (list, tuple)) else [item])
    return out


def _video_list(videos) -> list:
    if videos is None:
        return []
    if isinstance(videos, np.ndarray):
        if videos.ndim == 5:
            return list(videos)
        return [videos]
    return list(videos)


def _sampled_fps(meta) -> float:
    """transformers' ``VideoMetadata.sampled_fps`` for a dict / object with fps, frames_indices, total_num_frames."""
    if hasattr(meta, "hf_metadata"):
        meta = meta.hf_metadata()
    get = meta.get if isinstance(meta, Mapping) else (lambda k: getattr(meta, k, None))
    fps, indices, total = get("fps"), get("frames_indices"), get("total_num_frames")
    if indices is None or total is None or fps is None:
        return fps or 24
    if not total > 0 or not fps > 0:
        raise ValueError(f"video_metadata: expected positive fps and total_num_frames, got {fps} and {total}")
    return len(indices) / total * fps


class Processor:
    """Tokenizer + image / video processors + chat template of one Qwen2.5-VL snapshot (see the module doc)."""

    def __init__(self, tokenizer: Tokenizer, image_config: PixelConfig, video_config: PixelConfig,
                 chat_template: str | dict[str, str] | None = None, model_config: Mapping | None = None):
        self.tokenizer = tokenizer
        self.image_config = image_config
        self.video_config = video_config
        self.chat_template = chat_template
        ids = {}
        for key, token in _CONFIG_TOKENS:
            ids[key] = tokenizer.token_to_id(token)
        for key in ("image_token_id", "video_token_id"):
            if ids[key] is None:
                raise ValueError(f"tokenizer.json: no {dict(_CONFIG_TOKENS)[key]} token")
        for key, _ in _CONFIG_TOKENS:
            want = (model_config or {}).get(key)
            if want is not None and ids[key] is not None and want != ids[key]:
                raise ValueError(f"config.json: {key} is {want} but the tokenizer has {ids[key]}")
        self.image_token_id = ids["image_token_id"]
        self.video_token_id = ids["video_token_id"]
        self.vision_start_token_id = ids["vision_start_token_id"]
        self.vision_end_token_id = ids["vision_end_token_id"]
        self.eos_token_id = tokenizer.special_id("eos_token")
        self.pad_token_id = tokenizer.special_id("pad_token")

    @classmethod
    def from_pretrained(cls, snapshot_dir: str | os.PathLike) -> "Processor":
        """Load from a snapshot directory (or a hub-cache model tree, see ``models.snapshot``): ``tokenizer.json``, ``tokenizer_config.json``,
        ``preprocessor_config.json`` (+ ``video_preprocessor_config.json`` when present), the chat template
        (``chat_template.json`` / ``chat_template.jinja`` / tokenizer config) and ``config.json``'s token ids
        (checked against the tokenizer)."""
        d = resolve_snapshot(snapshot_dir, marker="tokenizer.json")
        image, video = _processor_configs(d)
        if video.get("do_sample_frames"):
            raise ValueError("video_preprocessor_config.json: do_sample_frames=true is not supported; sample frames "
                             "with mmjax.io.read_video and pass video_metadata")
        config_path = os.path.join(d, "config.json")
        model_config = read_json(config_path) if os.path.isfile(config_path) else None
        return cls(Tokenizer.from_pretrained(d), PixelConfig.from_dict(image, IMAGE_SIZE),
                   PixelConfig.from_dict(video, VIDEO_SIZE), templates.load_chat_template(d), model_config)

    # ---------------------------------------------------------------------------------------------- processing
    def __call__(self, text: str | Sequence[str] | None = None, images=None, videos=None, *, video_metadata=None,
                 fps: float | Sequence[float] | None = None, padding: bool | str = False,
                 padding_side: str | None = None, return_tensors: str | None = None) -> dict[str, np.ndarray]:
        """Model inputs for ``text`` (one string or a batch), ``images`` (PIL images or uint8 [H, W, 3] arrays,
        flat or one list per text) and ``videos`` (uint8 [T, H, W, 3] arrays); see the module doc for the keys.
        ``return_tensors`` may be None or "np" (the output is always NumPy)."""
        if return_tensors not in (None, "np"):
            raise ValueError(f"return_tensors: only NumPy outputs (None or 'np'), got {return_tensors!r}")
        if text is None and images is None and videos is None:
            raise ValueError("text/images/videos: expected at least one input")
        texts = [text] if isinstance(text, str) else (None if text is None else list(text))
        if texts is not None and not all(isinstance(t, str) for t in texts):
            raise ValueError("text: expected a string or a list of strings")
        image_list, video_list = _flat_images(images), _video_list(videos)
        metas = self._video_fps(video_list, video_metadata, fps)
        if texts is not None:
            for token, items, what in ((IMAGE_TOKEN, image_list, "images"), (VIDEO_TOKEN, video_list, "videos")):
                found = sum(t.count(token) for t in texts)
                if found != len(items) and (items or found):
                    raise ValueError(f"{what}: the text has {found} {token} tokens but {len(items)} {what} were "
                                     "passed; expected one per token")

        out: dict[str, np.ndarray] = {}
        image_grids, video_grids = [], []
        image_rows, video_rows = [], []
        for image in image_list:
            rows, grid = image_patches(image, self.image_config)
            image_rows.append(rows)
            image_grids.append(grid)
        for video in video_list:
            rows, grid = video_patches(video, self.video_config)
            video_rows.append(rows)
            video_grids.append(grid)

        if texts is not None:
            expanded = self._expand(texts, image_grids, video_grids)
            enc = self.tokenizer.encode(expanded, padding=padding, padding_side=padding_side)
            out["input_ids"], out["attention_mask"] = enc["input_ids"], enc["attention_mask"]
            types = np.zeros_like(enc["input_ids"])
            types[enc["input_ids"] == self.image_token_id] = 1
            types[enc["input_ids"] == self.video_token_id] = 2
            out["mm_token_type_ids"] = types
        if image_list:
            out["pixel_values"] = np.concatenate(image_rows)
            out["image_grid_thw"] = np.asarray(image_grids, np.int64)
        if video_list:
            out["pixel_values_videos"] = np.concatenate(video_rows)
            out["video_grid_thw"] = np.asarray(video_grids, np.int64)
            out["second_per_grid_ts"] = np.asarray([self.video_config.temporal_patch_size / f for f in metas],
                                                   np.float64)
        return out

    @staticmethod
    def _video_fps(videos: list, video_metadata, fps) -> list[float]:
        """Sampled fps of each video from ``video_metadata`` or ``fps`` (see the module doc)."""
        n = len(videos)
        if video_metadata is not None and fps is not None:
            raise ValueError("video_metadata/fps: pass one of them, not both")
        if fps is not None:
            values = [fps] * n if isinstance(fps, (int, float)) else list(fps)
            if len(values) != n or not all(isinstance(v, (int, float)) and v > 0 for v in values):
                raise ValueError(f"fps: expected a positive number or one per video ({n}), got {fps!r}")
            return [float(v) for v in values]
        if video_metadata is None:
            return [24.0] * n
        metas = [video_metadata] if (isinstance(video_metadata, Mapping) or hasattr(video_metadata, "hf_metadata")) \
            else list(video_metadata)
        if len(metas) != n:
            raise ValueError(f"video_metadata: expected one entry per video ({n}), got {len(metas)}")
        return [float(_sampled_fps(m)) for m in metas]

    def _expand(self, texts: list[str], image_grids: list, video_grids: list) -> list[str]:
        """Replace the i-th image / video placeholder (in order over the batch) by its grid's token count."""
        merge_i = self.image_config.merge_size ** 2
        merge_v = self.video_config.merge_size ** 2
        parts = []
        if image_grids:
            parts.append(f"(?P<image>{re.escape(IMAGE_TOKEN)})")
        if video_grids:
            parts.append(f"(?P<video>{re.escape(VIDEO_TOKEN)})")
        if not parts:
            return texts
        pattern = re.compile("|".join(parts))
        counters = {"image": iter(image_grids), "video": iter(video_grids)}

        def repl(m: re.Match) -> str:
            kind = m.lastgroup
            t, h, w = next(counters[kind])
            if kind == "image":
                return IMAGE_TOKEN * (t * h * w // merge_i)
            return VIDEO_TOKEN * (t * h * w // merge_v)

        return [pattern.sub(repl, t) for t in texts]

    # ------------------------------------------------------------------------------------------- text helpers
    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False, *,
                            chat_template: str | None = None, tools=None, documents=None, **variables):
        """Render a conversation (list of ``{"role", "content"}`` dicts) or a batch of them with the snapshot's
        chat template, as transformers' ``processor.apply_chat_template(..., tokenize=False)`` does (the template
        also sees the tokenizer's special tokens, e.g. ``eos_token``, and extra ``variables`` such as
        ``add_vision_id=True``). ``add_generation_prompt`` defaults to True here (transformers: False): mmjax renders
        prompts to answer them. ``tokenize=True`` returns the token ids of text-only conversations (int64 [L], or
        [B, L] for a batch, padded); with images or videos call the processor on the rendered text instead."""
        return templates.apply_chat_template(
            self.chat_template, chat_template, self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
            tokenize=tokenize, media_tokens=(IMAGE_TOKEN, VIDEO_TOKEN), tools=tools, documents=documents, **variables)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of a 1-D sequence of token ids; special tokens are skipped by default (transformers' processor
        ``decode`` keeps them unless asked, its ``post_process_image_text_to_text`` skips them)."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        """Texts of a [B, L] array or a list of id sequences (special tokens skipped by default)."""
        return self.tokenizer.batch_decode(sequences, skip_special_tokens=skip_special_tokens)
