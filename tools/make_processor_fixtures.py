"""Write the reference fixtures for the NumPy Qwen2.5-VL processor and ``mmjax.io`` (tests/models/test_processing.py,
tests/mmjax/test_io.py).

Run with a Python that has torch + torchvision + transformers + av + qwen-vl-utils + decord (NOT project
dependencies), e.g.::

    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch==2.14.1 torchvision==0.29.1
    /tmp/hfvenv/bin/pip install transformers av pillow numpy jinja2 qwen-vl-utils==0.0.14 decord
    /tmp/hfvenv/bin/python tools/make_processor_fixtures.py tests/models/fixtures/processor

Nothing is downloaded. The script builds:

* ``snapshot/``: a tiny Qwen2.5-VL-style processor snapshot: a byte-level BPE ``tokenizer.json`` trained here on a
  few sentences with the Qwen2 pre-tokenizer, followed by the 22 Qwen2.5-VL added tokens (so every id fits a tiny
  model's vocabulary), ``tokenizer_config.json`` and ``chat_template.json`` laid out as the Qwen2.5-VL-7B-Instruct
  snapshot has them (the template text is the Qwen2-VL / Qwen2.5-VL template as transformers' own test
  ``tests/models/qwen2_vl/test_processing_qwen2_vl.py::prepare_processor_dict`` spells it, identical to the
  ``chat_template.json`` of Qwen/Qwen2.5-VL-7B-Instruct), ``preprocessor_config.json`` with the 7B's keys and
  values except much smaller ``min_pixels`` / ``max_pixels``, and a tiny model ``config.json`` (token ids only
  matter here).
* ``variants/video_preprocessor_config.json``: a separate video processor file (``size`` keys, other mean/std,
  per-frame pixel cap) that the tests copy into a snapshot to check that it is read.
* ``media/``: PNG images (odd sizes, portrait, landscape, tiny, gray, RGBA) and H.264 mp4 clips written with PyAV
  (different fps, lengths, sizes).
* ``processor_cases.npz`` + ``processor_cases.json``: inputs and outputs of transformers' ``AutoProcessor``
  (the image processor it picks by default, the torchvision one, and the PIL one for comparison).
  Pixel values are stored losslessly as the uint8 values they were made from (``(pv * std + mean) * 255``, checked
  here to round-trip to float32 precision; delta-coded along rows, see ``delta8``; an image's second temporal copy
  dropped) plus one raw float32 row.
* ``chat_cases.json``: chat template renderings and decodes by transformers.
* ``image_cases.npz`` + ``image_cases.json``: qwen-vl-utils ``fetch_image`` on the images.
* ``video_cases.npz`` + ``video_cases.json``: qwen-vl-utils ``fetch_video`` (decord backend) on the clips: sampled
  indices, sample fps, resized size and frames; plus ``video_rules.json``: qwen-vl-utils' frame-count, frame-range,
  ``torch.linspace`` index and pixel-budget rules on many (frames, fps, size, options) combinations.
* ``README.md``: the versions used.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import sys
from fractions import Fraction

import av
import numpy as np
import PIL
import tokenizers
import torch
import torchvision
import transformers
from PIL import Image
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

import qwen_vl_utils
from qwen_vl_utils import vision_process as qvu

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# Qwen2 pre-tokenizer regex (Qwen2Tokenizer / Qwen2.5-VL tokenizer.json).
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
# The Qwen2.5-VL added tokens in their snapshot order; the last eight are not special.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
           "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
           "<|image_pad|>", "<|video_pad|>"]
NOT_SPECIAL = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>"]
# Source: transformers tests/models/qwen2_vl/test_processing_qwen2_vl.py (prepare_processor_dict); the same text is the
# "chat_template" of Qwen/Qwen2.5-VL-7B-Instruct's chat_template.json.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")

CORPUS = [
    "Describe this video in detail. What happens after the red square moves to the left?",
    "The quick brown fox jumps over the lazy dog; the dog does not move.",
    "A person walks into the kitchen, opens the fridge and takes out 2 bottles of milk.",
    "What is shown in this image? Answer with one word, then explain your answer.",
    "You are a helpful assistant. Please answer the question about the picture.",
    "In 2024 the team released 3 models: 3B, 7B and 72B parameters, with 128000 tokens of context.",
    "Les élèves regardent la vidéo et répondent aux questions. Über die Brücke gehen wir zusammen.",
    "视频里有一只猫在桌子上睡觉。 请描述图片中的内容。",
    "def main():\n    print('hello world')\n    return 0\n",
    "Time: 00:01:23.5 -> 00:02:10.0, frames 12-48; fps = 29.97 (30000/1001).",
]


def atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_json(path: str, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def write_json_gz(path: str, obj) -> None:
    atomic_write_bytes(path, gzip.compress(json.dumps(obj).encode("utf-8"), mtime=0))


def delta8(a: np.ndarray, axis: int) -> np.ndarray:
    """uint8 differences along ``axis`` (mod 256): smooth images compress about twice as well this way.
    Decode with ``np.cumsum(d, axis=axis, dtype=np.uint8)`` (axis 2 for frames [T, H, W, 3], -1 for patch rows)."""
    assert a.dtype == np.uint8
    d = np.diff(a, axis=axis, prepend=np.take(np.zeros_like(a), [0], axis=axis))
    assert np.array_equal(np.cumsum(d, axis=axis, dtype=np.uint8), a)
    return d


def save_npz(path: str, arrays: dict) -> None:
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------- snapshot files
def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NOT_SPECIAL])
    return tok


def tokenizer_config(tok: Tokenizer) -> dict:
    decoder = {}
    for t in SPECIAL + NOT_SPECIAL:
        decoder[str(tok.token_to_id(t))] = dict(content=t, lstrip=False, normalized=False, rstrip=False,
                                                single_word=False, special=t in SPECIAL)
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": SPECIAL[1:],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def model_config(tok: Tokenizer) -> dict:
    ids = {name: tok.token_to_id(t) for name, t in [("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|im_end|>"),
                                                    ("vision_start_token_id", "<|vision_start|>"),
                                                    ("vision_end_token_id", "<|vision_end|>"),
                                                    ("vision_token_id", "<|vision_pad|>"),
                                                    ("image_token_id", "<|image_pad|>"),
                                                    ("video_token_id", "<|video_pad|>")]}
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=448, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                         max_position_embeddings=4096, bos_token_id=ids["bos_token_id"],
                         eos_token_id=ids["eos_token_id"]),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1], window_size=56, tokens_per_second=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"])
    d = cfg.to_dict()
    d.update(ids)
    d["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    return d


PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 6272,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}
VIDEO_VARIANT = {
    "size": {"shortest_edge": 3136, "longest_edge": 4704},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "cap_pixels_per_frame": True,
    "max_video_tokens": 16,
    "video_processor_type": "Qwen2VLVideoProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}


# ------------------------------------------------------------------------------------------------------------ media
def pattern(h: int, w: int, seed: int, t: int = 0) -> np.ndarray:
    """Smooth colour waves and a moving red square: uint8 [h, w, 3]."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 127 + 100 * np.sin(x / (5 + seed) + t * 0.3)
    g = 127 + 100 * np.cos(y / (4 + seed) - t * 0.2)
    b = 128 + 80 * np.sin((x + y) / (7 + seed) + t * 0.15)
    img = np.stack([r, g, b], -1)
    s = max(2, min(h, w) // 4)
    oy, ox = (3 * t + seed) % max(1, h - s), (5 * t + 2 * seed) % max(1, w - s)
    img[oy:oy + s, ox:ox + s] = [250, 20, 30]
    return np.clip(img, 0, 255).astype(np.uint8)


IMAGES = {  # name: (height, width, mode)
    "portrait_61x37.png": (61, 37, "RGB"),
    "landscape_45x123.png": (45, 123, "RGB"),
    "tiny_13x9.png": (13, 9, "RGB"),
    "gray_70x70.png": (70, 70, "L"),
    "rgba_40x50.png": (40, 50, "RGBA"),
    "large_200x300.png": (200, 300, "RGB"),
}
CLIPS = {  # name: (frames, fps, height, width)
    "short_25fps_48x64.mp4": (10, Fraction(25), 48, 64),
    "long_30fps_54x96.mp4": (150, Fraction(30), 54, 96),
    "ntsc_2997fps_60x80.mp4": (100, Fraction(30000, 1001), 60, 80),
    "slow_7.5fps_38x50.mp4": (23, Fraction(15, 2), 38, 50),
}


def write_image(path: str, h: int, w: int, mode: str, seed: int) -> None:
    arr = pattern(h, w, seed)
    img = Image.fromarray(arr)
    if mode == "L":
        img = img.convert("L")
    elif mode == "RGBA":
        alpha = (np.mgrid[0:h, 0:w][1] * 255 // max(1, w - 1)).astype(np.uint8)
        img = Image.fromarray(np.dstack([arr, alpha]), "RGBA")
    tmp = path + ".tmp.png"
    img.save(tmp)
    os.replace(tmp, path)


def write_clip(path: str, frames: int, fps: Fraction, h: int, w: int, seed: int) -> None:
    tmp = path + ".tmp.mp4"
    with av.open(tmp, "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"crf": "23", "preset": "veryfast", "threads": "1"}  # one thread: reproducible
        for t in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(pattern(h, w, seed, t), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------ qwen-vl-utils
VIDEO_OPTIONS = [  # (clip, options passed to fetch_video besides "video")
    ("short_25fps_48x64.mp4", {"fps": 2.0, "min_pixels": 784, "max_pixels": 3136}),
    ("long_30fps_54x96.mp4", {"fps": 2.0, "min_pixels": 784, "max_pixels": 3136}),
    ("long_30fps_54x96.mp4", {"fps": 4.0, "min_pixels": 1568, "total_pixels": 40000}),
    ("long_30fps_54x96.mp4", {"fps": 2.0, "min_pixels": 784, "max_pixels": 4704, "video_start": 1.1,
                              "video_end": 3.9}),
    ("long_30fps_54x96.mp4", {"fps": 10.0, "max_frames": 12, "min_pixels": 784, "max_pixels": 3136}),
    ("ntsc_2997fps_60x80.mp4", {"fps": 1.5, "min_pixels": 784, "max_pixels": 4704}),
    ("ntsc_2997fps_60x80.mp4", {"nframes": 7, "min_pixels": 784, "max_pixels": 4704}),
    ("slow_7.5fps_38x50.mp4", {"fps": 2.0, "min_frames": 6, "min_pixels": 784, "max_pixels": 3136}),
    ("slow_7.5fps_38x50.mp4", {"fps": 2.0, "min_pixels": 784, "resized_height": 60, "resized_width": 90}),
]


IMAGE_OPTIONS = [  # (image, options passed to fetch_image besides "image")
    ("portrait_61x37.png", {}),
    ("tiny_13x9.png", {"min_pixels": 3136}),
    ("landscape_45x123.png", {"min_pixels": 784, "max_pixels": 2352}),
    ("gray_70x70.png", {"min_pixels": 784, "max_pixels": 6272}),
    ("rgba_40x50.png", {}),
    ("large_200x300.png", {"max_pixels": 6272}),
    ("large_200x300.png", {"resized_height": 100, "resized_width": 150}),
]


def fetch_video_case(path: str, options: dict):
    ele = {"video": path, **options}
    video, sample_fps = qvu.fetch_video(ele, return_video_sample_fps=True, return_video_metadata=True)
    frames, meta = video
    frames = frames.permute(0, 2, 3, 1).numpy()
    assert np.array_equal(frames, np.round(frames)), "qwen-vl-utils frames are not integer valued"
    return frames.astype(np.uint8), meta, float(sample_fps)


def rules_table() -> list[dict]:
    """qwen-vl-utils' planning rules on synthetic (frames, fps, size, options) combinations."""
    rng = np.random.default_rng(0)
    rows = []
    combos = [(10, 25.0), (150, 30.0), (100, 30000 / 1001), (23, 7.5), (3, 30.0), (1000, 24.0), (9000, 59.94),
              (37, 2.0), (200000, 60.0), (7, 1.0), (4, 4.0), (57, 12.5), (123457, 23.976)]
    option_sets = [{}, {"fps": 1.0}, {"fps": 0.5}, {"fps": 4.0, "min_frames": 8}, {"fps": 2.0, "max_frames": 64},
                   {"nframes": 9}, {"nframes": 16}, {"fps": 2.0, "video_start": 0.3, "video_end": 2.9},
                   {"fps": 3.0, "video_start": 1.0}, {"fps": 2.0, "video_end": 1.5}, {"fps": 2.0, "max_frames": 5},
                   {"fps": 30.0}]
    sizes = [(48, 64), (1080, 1920), (720, 1280), (13, 2000), (333, 251), (2160, 3840), (50, 38)]
    pixel_sets = [{}, {"min_pixels": 784, "max_pixels": 3136}, {"total_pixels": 20000 * 28 * 28},
                  {"min_pixels": 256 * 28 * 28, "max_pixels": 512 * 28 * 28, "total_pixels": 2_000_000},
                  {"max_pixels": 10_000_000}]
    for total, fps in combos:
        for opts in option_sets:
            ele = dict(opts)
            try:
                start, end, count = qvu.calculate_video_frame_range(ele, total, fps)
                nframes = qvu.smart_nframes(ele, total_frames=count, video_fps=fps)
            except (ValueError, AssertionError) as e:
                rows.append(dict(total_frames=total, video_fps=fps, options=opts, error=str(e)))
                continue
            idx = torch.linspace(start, end, nframes).round().long().tolist()
            sample_fps = nframes / max(count, 1e-6) * fps
            h, w = sizes[int(rng.integers(len(sizes)))]
            pix = pixel_sets[int(rng.integers(len(pixel_sets)))]
            min_pixels = pix.get("min_pixels", qvu.VIDEO_MIN_TOKEN_NUM * 28 * 28)
            total_pixels = pix.get("total_pixels", qvu.MODEL_SEQ_LEN * 28 * 28 * 0.9)
            max_pixels = max(min(qvu.VIDEO_MAX_TOKEN_NUM * 28 * 28, total_pixels / nframes * qvu.FRAME_FACTOR),
                             int(min_pixels * 1.05))
            max_pixels = min(pix.get("max_pixels", max_pixels), max_pixels)
            try:
                rh, rw = qvu.smart_resize(h, w, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
                resized = [rh, rw]
            except (ValueError, AssertionError) as e:
                resized = f"error: {e}"
            rows.append(dict(total_frames=total, video_fps=fps, options=opts, start=start, end=end, count=count,
                             nframes=nframes, indices=idx, sample_fps=sample_fps, height=h, width=w,
                             pixels=pix, resized=resized))
    # torch.linspace in float32 on large, awkward ranges (rounding of .5 and float32 steps)
    for start, end, n in [(0, 999, 8), (0, 100000, 768), (13, 123456, 500), (0, 6, 4), (5, 5004, 334),
                          (0, 2 ** 24 + 11, 6)]:
        rows.append(dict(linspace=[start, end, n], indices=torch.linspace(start, end, n).round().long().tolist()))
    return rows


# -------------------------------------------------------------------------------------------- transformers cases
def pixels_to_uint8(pv: np.ndarray, mean, std, tp: int, ps: int) -> np.ndarray:
    """Undo rescale + normalize of flattened patches [N, C*tp*ps*ps]; checks the round trip is lossless."""
    c = len(mean)
    x = pv.reshape(pv.shape[0], c, tp * ps * ps).astype(np.float64)
    x = x * np.asarray(std)[None, :, None] + np.asarray(mean)[None, :, None]
    u = np.round(x * 255.0)
    assert np.abs(x * 255.0 - u).max() < 2e-3, np.abs(x * 255.0 - u).max()
    assert u.min() >= 0 and u.max() <= 255
    return u.astype(np.uint8).reshape(pv.shape)


def run_processor(proc, kw: dict) -> dict:
    out = proc(**kw, return_tensors="np")
    return {k: np.asarray(v) for k, v in out.items()}


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    snap = os.path.join(out_dir, "snapshot")
    media = os.path.join(out_dir, "media")
    variants = os.path.join(out_dir, "variants")
    for d in (snap, media, variants):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)

    tok = build_tokenizer()
    atomic_write_bytes(os.path.join(snap, "tokenizer.json"), tok.to_str(pretty=False).encode("utf-8"))
    write_json(os.path.join(snap, "tokenizer_config.json"), tokenizer_config(tok))
    write_json(os.path.join(snap, "chat_template.json"), {"chat_template": CHAT_TEMPLATE})
    write_json(os.path.join(snap, "preprocessor_config.json"), PREPROCESSOR)
    write_json(os.path.join(snap, "config.json"), model_config(tok))
    write_json(os.path.join(variants, "video_preprocessor_config.json"), VIDEO_VARIANT)

    for seed, (name, (h, w, mode)) in enumerate(IMAGES.items()):
        write_image(os.path.join(media, name), h, w, mode, seed)
    for seed, (name, (n, fps, h, w)) in enumerate(CLIPS.items()):
        write_clip(os.path.join(media, name), n, fps, h, w, seed)

    # ---- qwen-vl-utils fetch_video (decord backend) on the clips
    assert qvu.get_video_reader_backend() == "decord"
    video_json, video_npz = [], {}
    clip_frames = {}
    for i, (clip, options) in enumerate(VIDEO_OPTIONS):
        frames, meta, sample_fps = fetch_video_case(os.path.join(media, clip), options)
        kept = [0, len(frames) - 1]  # the first and last sampled frames keep the file small
        video_npz[f"frames_{i}_d8"] = delta8(frames[kept], 2)
        video_json.append(dict(clip=clip, options=options, indices=[int(x) for x in meta["frames_indices"]],
                               video_fps=float(meta["fps"]), total_num_frames=int(meta["total_num_frames"]),
                               sample_fps=sample_fps, shape=list(frames.shape), stored_frames=kept))
        clip_frames.setdefault(clip, (frames, meta, sample_fps))
    write_json(os.path.join(out_dir, "video_cases.json"), video_json)
    save_npz(os.path.join(out_dir, "video_cases.npz"), video_npz)
    write_json_gz(os.path.join(out_dir, "video_rules.json.gz"), rules_table())

    # ---- qwen-vl-utils fetch_image
    image_json, image_npz = [], {}
    for i, (name, options) in enumerate(IMAGE_OPTIONS):
        out = np.asarray(qvu.fetch_image({"image": os.path.join(media, name), **options}))
        image_npz[f"image_{i}"] = out
        image_json.append(dict(image=name, options=options, shape=list(out.shape)))
    write_json(os.path.join(out_dir, "image_cases.json"), image_json)
    save_npz(os.path.join(out_dir, "image_cases.npz"), image_npz)

    # ---- transformers processor
    proc = transformers.AutoProcessor.from_pretrained(snap)
    proc_slow = transformers.AutoProcessor.from_pretrained(snap, use_fast=False)
    vsnap = os.path.join(out_dir, "_variant_snapshot")
    shutil.rmtree(vsnap, ignore_errors=True)
    shutil.copytree(snap, vsnap)
    shutil.copy(os.path.join(variants, "video_preprocessor_config.json"), vsnap)
    proc_variant = transformers.AutoProcessor.from_pretrained(vsnap)
    shutil.rmtree(vsnap)

    def describe(p):
        ip, vp = p.image_processor, p.video_processor
        return dict(image_processor_class=type(ip).__name__, video_processor_class=type(vp).__name__,
                    image_size=dict(ip.size), video_size=dict(vp.size), image_mean=list(ip.image_mean),
                    image_std=list(ip.image_std), video_mean=list(vp.image_mean), video_std=list(vp.image_std),
                    resample=int(ip.resample), video_cap_pixels_per_frame=vp.cap_pixels_per_frame,
                    video_max_video_tokens=vp.max_video_tokens, tokenizer_class=type(p.tokenizer).__name__,
                    padding_side=p.tokenizer.padding_side, image_token_id=p.image_token_id,
                    video_token_id=p.video_token_id, special_tokens_map=dict(p.tokenizer.special_tokens_map))

    def load_image(name):
        with Image.open(os.path.join(media, name)) as im:
            im.load()
            return im.copy()

    def video_input(clip):
        frames, meta, sample_fps = clip_frames[clip]
        md = dict(fps=float(meta["fps"]), frames_indices=[int(x) for x in meta["frames_indices"]],
                  total_num_frames=int(meta["total_num_frames"]))
        return frames, md, sample_fps

    def chat_text(content, system=None):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        return proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    img = lambda: {"type": "image"}  # noqa: E731
    vid = lambda: {"type": "video"}  # noqa: E731
    txt = lambda s: {"type": "text", "text": s}  # noqa: E731

    short_v, short_md, short_fps = video_input("short_25fps_48x64.mp4")
    ntsc_v, ntsc_md, _ = video_input("ntsc_2997fps_60x80.mp4")
    slow_v, slow_md, _ = video_input("slow_7.5fps_38x50.mp4")
    cases = [
        ("text_only", proc, dict(text=[chat_text([txt("Hello, who are you? 你好！")])]), {}),
        ("text_batch_padded", proc, dict(text=["short", chat_text([txt("A longer question about 3 frames.")])],
                                        padding=True), {}),
        ("image_portrait", proc, dict(text=[chat_text([img(), txt("What is shown in this image?")])],
                                      images=[load_image("portrait_61x37.png")]), {"images": ["portrait_61x37.png"]}),
        ("images_batch", proc,
         dict(text=[chat_text([img(), txt("Compare"), img()]), chat_text([txt("Describe"), img(), img(), img()])],
              images=[load_image(n) for n in ["landscape_45x123.png", "tiny_13x9.png", "gray_70x70.png",
                                              "rgba_40x50.png", "large_200x300.png"]], padding=True),
         {"images": ["landscape_45x123.png", "tiny_13x9.png", "gray_70x70.png", "rgba_40x50.png",
                     "large_200x300.png"]}),
        ("images_batch_slow", proc_slow,
         dict(text=[chat_text([img(), txt("Compare"), img()]), chat_text([txt("Describe"), img()])],
              images=[load_image(n) for n in ["tiny_13x9.png", "rgba_40x50.png", "large_200x300.png"]],
              padding=True),
         {"images": ["tiny_13x9.png", "rgba_40x50.png", "large_200x300.png"]}),
        ("image_uint8_array", proc, dict(text=["<|vision_start|><|image_pad|><|vision_end|>describe"],
                                         images=[np.asarray(load_image("portrait_61x37.png"))]),
         {"image_arrays": ["portrait_61x37.png"]}),
        ("video_metadata", proc, dict(text=[chat_text([vid(), txt("What happens?")])], videos=[ntsc_v],
                                      video_metadata=[ntsc_md]), {"videos": ["ntsc_2997fps_60x80.mp4"],
                                                                  "video_metadata": [ntsc_md]}),
        ("video_fps_kwarg", proc, dict(text=[chat_text([vid(), txt("What happens?")])], videos=[short_v],
                                       fps=short_fps), {"videos": ["short_25fps_48x64.mp4"], "fps": short_fps}),
        ("video_no_metadata", proc, dict(text=[chat_text([vid(), txt("What happens?")])], videos=[ntsc_v]),
         {"videos": ["ntsc_2997fps_60x80.mp4"]}),
        ("video_odd_frames", proc, dict(text=[chat_text([vid(), txt("Odd frame count")])], videos=[slow_v[:5]],
                                        video_metadata=[dict(slow_md, frames_indices=slow_md["frames_indices"][:5])]),
         {"videos": ["slow_7.5fps_38x50.mp4"], "video_frames": 5,
          "video_metadata": [dict(slow_md, frames_indices=slow_md["frames_indices"][:5])]}),
        ("mixed_batch", proc,
         dict(text=[chat_text([img(), vid(), txt("image then video")]), chat_text([vid(), txt("second video")])],
              images=[load_image("landscape_45x123.png")], videos=[slow_v, short_v],
              video_metadata=[slow_md, short_md], padding=True, padding_side="left"),
         {"images": ["landscape_45x123.png"], "videos": ["slow_7.5fps_38x50.mp4", "short_25fps_48x64.mp4"],
          "video_metadata": [slow_md, short_md], "padding_side": "left"}),
        ("video_variant_config", proc_variant, dict(text=[chat_text([vid(), txt("Variant")]),
                                                          chat_text([vid(), txt("Variant short")])],
                                                    videos=[slow_v, short_v], video_metadata=[slow_md, short_md],
                                                    padding=True),
         {"videos": ["slow_7.5fps_38x50.mp4", "short_25fps_48x64.mp4"], "video_metadata": [slow_md, short_md],
          "variant": True}),
    ]
    npz, case_json, stored = {}, [], {}
    for name, p, kw, spec in cases:
        out = run_processor(p, kw)
        entry = dict(name=name, text=kw["text"], padding=kw.get("padding", False), keys=sorted(out), spec=spec,
                     slow=p is proc_slow, variant=p is proc_variant)
        for k, v in out.items():
            if k in ("pixel_values", "pixel_values_videos"):
                ip = p.image_processor if k == "pixel_values" else p.video_processor
                u8 = pixels_to_uint8(v, ip.image_mean, ip.image_std, ip.temporal_patch_size, ip.patch_size)
                if k == "pixel_values":  # an image is its own two frames: keep one (checked equal)
                    u8 = u8.reshape(len(v), 3, ip.temporal_patch_size, -1)
                    assert all(np.array_equal(u8[:, :, 0], u8[:, :, t]) for t in range(ip.temporal_patch_size))
                    u8 = u8[:, :, 0].reshape(len(v), -1)
                digest = hashlib.sha256(u8.tobytes() + str(u8.shape).encode()).hexdigest()
                if digest in stored:  # the same images through another mean/std: keep one copy
                    entry[f"{k}_uint8_same_as"] = stored[digest]
                else:
                    stored[digest] = f"{name}/{k}_uint8_d8"
                    npz[f"{name}/{k}_uint8_d8"] = delta8(u8, -1)
                npz[f"{name}/{k}_row"] = v[len(v) // 2].astype(np.float32)  # one raw row, as transformers gave it
                entry[f"{k}_dtype"] = str(v.dtype)
                entry[f"{k}_shape"] = list(v.shape)
            else:
                npz[f"{name}/{k}"] = v
        for key in ("video_metadata",):
            if key in spec:
                entry["spec"][key] = spec[key]
        case_json.append(entry)
    # videos given to the processor, exactly as passed
    for clip in ("short_25fps_48x64.mp4", "ntsc_2997fps_60x80.mp4", "slow_7.5fps_38x50.mp4"):
        npz[f"video/{clip}_d8"] = delta8(clip_frames[clip][0], 2)
    save_npz(os.path.join(out_dir, "processor_cases.npz"), npz)

    # ---- chat templates and decoding
    conversations = [
        [{"role": "user", "content": "Plain string content."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [txt("Hi"), img()]}],
        [{"role": "user", "content": [vid(), txt("What happens next?")]},
         {"role": "assistant", "content": [txt("A cat jumps.")]},
         {"role": "user", "content": [{"type": "image", "image": "file.png"}, {"type": "video", "video": "a.mp4"},
                                      txt("And now?")]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}, txt("url")]}],
    ]
    chat = []
    for conv in conversations:
        for agp in (True, False):
            for vision_id in (False, True):
                kwargs = {"add_vision_id": True} if vision_id else {}
                chat.append(dict(messages=conv, add_generation_prompt=agp, kwargs=kwargs,
                                 rendered=proc.apply_chat_template(conv, add_generation_prompt=agp, tokenize=False,
                                                                   **kwargs)))
    batched = [conversations[0], conversations[1]]
    chat_batch = dict(messages=batched, rendered=proc.apply_chat_template(batched, add_generation_prompt=True,
                                                                          tokenize=False))
    ids_examples = [tok.encode(s).ids for s in CORPUS[:4]]
    ids_examples.append(list(npz["mixed_batch/input_ids"][0]))
    ids_examples.append([tok.token_to_id("<|im_start|>")] + tok.encode("assistant\nA <tool_call> here").ids
                        + [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")])
    decode = [dict(ids=[int(i) for i in ids], skip=s, text=proc.decode(ids, skip_special_tokens=s))
              for ids in ids_examples for s in (True, False)]
    batch_decode = dict(ids=[[int(i) for i in x] for x in ids_examples[:3]],
                        text=proc.batch_decode(ids_examples[:3], skip_special_tokens=True))
    write_json(os.path.join(out_dir, "chat_cases.json"),
               dict(chat=chat, chat_batch=chat_batch, decode=decode, batch_decode=batch_decode))

    versions = dict(python=sys.version.split()[0], transformers=transformers.__version__, torch=torch.__version__,
                    torchvision=torchvision.__version__, tokenizers=tokenizers.__version__, av=av.__version__,
                    pillow=PIL.__version__, numpy=np.__version__,
                    qwen_vl_utils=getattr(qwen_vl_utils, "__version__", None) or _dist_version("qwen-vl-utils"),
                    decord=_dist_version("decord"))
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize
    resize_table = []
    for h, w in [(13, 100), (13, 9), (45, 123), (1080, 1920), (27, 27), (14, 2000), (333, 251), (5, 700), (70, 70)]:
        for lo, hi in [(784, 6272), (3136, 6272), (3136, 12845056), (100352, 602112)]:
            try:
                resize_table.append([h, w, lo, hi, list(hf_smart_resize(h, w, 28, lo, hi))])
            except ValueError as e:
                resize_table.append([h, w, lo, hi, f"error: {e}"])
    write_json(os.path.join(out_dir, "processor_cases.json"),
               dict(versions=versions, default=describe(proc), slow=describe(proc_slow),
                    variant=describe(proc_variant), cases=case_json, smart_resize=resize_table))
    readme = (f"Generated by tools/make_processor_fixtures.py with transformers {versions['transformers']}, torch "
              f"{versions['torch']}, torchvision {versions['torchvision']}, tokenizers {versions['tokenizers']}, "
              f"av {versions['av']}, Pillow {versions['pillow']}, qwen-vl-utils {versions['qwen_vl_utils']} "
              f"(decord {versions['decord']} backend). transformers' default image processor here: "
              f"{describe(proc)['image_processor_class']} (torchvision); the PIL one "
              f"({describe(proc_slow)['image_processor_class']}) is in the *_slow case. Regenerate with the "
              "command in the script's docstring.\n")
    atomic_write_bytes(os.path.join(out_dir, "README.md"), readme.encode("utf-8"))


def _dist_version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} OUT_DIR")
    main(sys.argv[1])
