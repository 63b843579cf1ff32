"""Reading videos (PyAV) and images (Pillow) the way Qwen2.5-VL's own tooling does, without PyTorch.

The rules are those of qwen-vl-utils ``fetch_video`` / ``fetch_image`` (0.0.14, the decord / torchcodec readers):

* frame range: ``video_start`` / ``video_end`` (seconds) become ``start = ceil(start_s * fps)``,
  ``end = min(floor(end_s * fps), total - 1)``, both clamped to the clip; ``count = end - start + 1``;
* frame count: ``nframes`` rounded to a multiple of ``FRAME_FACTOR`` (2), or from ``fps``:
  ``count / video_fps * fps`` clamped to ``[ceil2(min_frames), floor2(min(max_frames, count))]`` and to
  ``count``, then floored to a multiple of 2; it must end in ``[2, count]``;
* indices: ``torch.linspace(start, end, nframes).round()``, reproduced exactly (float32, the two-sided formula
  torch's CPU kernel uses, half to even);
* sample fps: ``nframes / count * video_fps``, so ``second_per_grid_ts = temporal_patch_size / sample_fps``;
* per-frame pixels: ``max_pixels = max(min(VIDEO_MAX_PIXELS, total_pixels / nframes * 2), int(min_pixels * 1.05))``,
  lowered to the caller's ``max_pixels`` when that is smaller, then ``smart_resize`` to multiples of 28.

Frames are decoded in order with PyAV and only the sampled ones are kept, each resized as it arrives, so memory
holds the output ``[T, H, W, 3]`` plus one decoded frame whatever the clip's length.

Resizing uses Pillow's bicubic filter, which is antialiased; qwen-vl-utils resizes with torchvision's antialiased
bicubic (the same filter in float, rounded once), Pillow works in fixed point. On the committed fixtures
(tests/mmjax/test_io.py) the frames differ from qwen-vl-utils' (decord reader, which also converts YUV to RGB
its own way) by at most 3 uint8 levels, 0.25 level on average.
"""

from __future__ import annotations

import dataclasses
import math
import os
from fractions import Fraction

import av
import numpy as np
from PIL import Image

from mmjax.progress import progress_bar

IMAGE_FACTOR = 28
FRAME_FACTOR = 2
MAX_RATIO = 200
IMAGE_MIN_PIXELS = 4 * 28 * 28
IMAGE_MAX_PIXELS = 16384 * 28 * 28
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = 128000 * 28 * 28 * 0.9  # qwen-vl-utils: MODEL_SEQ_LEN (128000) tokens * 28 * 28 * 0.9
FPS = 2.0
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768


# ------------------------------------------------------------------------------------------------------ the rules
def _round_by(x: float, f: int) -> int:
    return round(x / f) * f


def _ceil_by(x: float, f: int) -> int:
    return math.ceil(x / f) * f


def _floor_by(x: float, f: int) -> int:
    return math.floor(x / f) * f


def smart_resize(height: int, width: int, factor: int = IMAGE_FACTOR, min_pixels: float = IMAGE_MIN_PIXELS,
                 max_pixels: float = IMAGE_MAX_PIXELS) -> tuple[int, int]:
    """qwen-vl-utils' ``smart_resize``: (height, width) as multiples of ``factor`` with the area in
    ``[min_pixels, max_pixels]`` and the aspect ratio kept as well as possible.

    Note: transformers' image processor has its own variant (no ``max(factor, ...)`` on the rounded sides); the
    processor in ``models.qwen2_5_vl.processing`` uses that one.
    """
    for name, v in (("height", height), ("width", width)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if max_pixels < min_pixels:
        raise ValueError(f"max_pixels: expected >= min_pixels ({min_pixels}), got {max_pixels}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"height/width: aspect ratio must be at most {MAX_RATIO}, got {height}x{width}")
    h_bar = max(factor, _round_by(height, factor))
    w_bar = max(factor, _round_by(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = _floor_by(height / beta, factor)
        w_bar = _floor_by(width / beta, factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = _ceil_by(height * beta, factor)
        w_bar = _ceil_by(width * beta, factor)
    return int(h_bar), int(w_bar)


def linspace_indices(start: int, end: int, n: int) -> np.ndarray:
    """``torch.linspace(start, end, n).round().long()`` exactly: int64 [n].

    torch fills float32 values as ``start + step * i`` for the first half and ``end - step * (n - 1 - i)`` for the
    second, each rounded once (fused multiply-add), with ``step = (end - start) / (n - 1)`` in float32; rounding
    is half to even.
    """
    if n < 1:
        raise ValueError(f"n: expected >= 1, got {n}")
    if n == 1:
        return np.array([start], np.int64)
    s, e = np.float32(start), np.float32(end)
    step = np.float32((e - s) / np.float32(n - 1))
    i = np.arange(n, dtype=np.float64)
    vals = np.where(i < n // 2, np.float64(s) + np.float64(step) * i, np.float64(e) - np.float64(step) * (n - 1 - i))
    return np.rint(vals.astype(np.float32)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class FramePlan:
    """Which source frames to keep: ``indices`` int64 [nframes] in ``[start, end]`` (``count`` frames)."""

    start: int
    end: int
    count: int
    indices: tuple[int, ...]
    sample_fps: float


def plan_frames(total_frames: int, video_fps: float, *, fps: float = FPS, nframes: int | None = None,
                min_frames: int = FPS_MIN_FRAMES, max_frames: int = FPS_MAX_FRAMES, video_start: float | None = None,
                video_end: float | None = None) -> FramePlan:
    """The frames qwen-vl-utils samples from a clip of ``total_frames`` at ``video_fps`` (see the module doc).

    ``nframes``, when given, replaces the ``fps`` rule (qwen-vl-utils takes one or the other).
    """
    if not isinstance(total_frames, (int, np.integer)) or total_frames <= 0:
        raise ValueError(f"total_frames: expected a positive int, got {total_frames!r}")
    if not video_fps > 0:
        raise ValueError(f"video_fps: expected a positive number, got {video_fps!r}")
    if nframes is None and not (isinstance(fps, (int, float)) and fps > 0):
        raise ValueError(f"fps: expected a positive number, got {fps!r}")
    if nframes is not None and (not isinstance(nframes, (int, np.integer)) or nframes <= 0):
        raise ValueError(f"nframes: expected a positive int or None, got {nframes!r}")
    for name, v in (("min_frames", min_frames), ("max_frames", max_frames)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")

    if video_start is None and video_end is None:
        start, end, count = 0, total_frames - 1, total_frames
    else:
        duration = total_frames / video_fps
        start = math.ceil(max(0.0, min(video_start, duration)) * video_fps) if video_start is not None else 0
        if video_end is not None:
            end = min(math.floor(max(0.0, min(video_end, duration)) * video_fps), total_frames - 1)
        else:
            end = total_frames - 1
        if start >= end:
            raise ValueError(f"video_start/video_end: the range {video_start}..{video_end} s gives frames "
                             f"{start}..{end} of a {duration:.3f} s clip ({total_frames} frames at {video_fps:g} fps); "
                             "expected start < end")
        count = end - start + 1

    if nframes is not None:
        n = _round_by(nframes, FRAME_FACTOR)
    else:
        lo = _ceil_by(min_frames, FRAME_FACTOR)
        hi = _floor_by(min(max_frames, count), FRAME_FACTOR)
        n = _floor_by(min(max(count / video_fps * fps, lo), hi, count), FRAME_FACTOR)
    if not FRAME_FACTOR <= n <= count:
        raise ValueError(f"nframes: the clip range has {count} frames, which gives {n} sampled frames; expected "
                         f"between {FRAME_FACTOR} and {count}")
    idx = linspace_indices(start, end, n)
    return FramePlan(start=start, end=end, count=count, indices=tuple(int(i) for i in idx),
                     sample_fps=n / max(count, 1e-6) * video_fps)


def frame_pixel_limits(nframes: int, min_pixels: float = VIDEO_MIN_PIXELS, max_pixels: float | None = None,
                       total_pixels: float = VIDEO_TOTAL_PIXELS) -> tuple[float, float]:
    """(min_pixels, max_pixels) per frame for ``nframes`` frames under the clip's ``total_pixels`` budget."""
    if not nframes > 0:
        raise ValueError(f"nframes: expected a positive int, got {nframes!r}")
    for name, v in (("min_pixels", min_pixels), ("total_pixels", total_pixels)):
        if not v > 0:
            raise ValueError(f"{name}: expected a positive number, got {v!r}")
    if max_pixels is not None and not max_pixels > 0:
        raise ValueError(f"max_pixels: expected a positive number or None, got {max_pixels!r}")
    limit = max(min(VIDEO_MAX_PIXELS, total_pixels / nframes * FRAME_FACTOR), int(min_pixels * 1.05))
    return min_pixels, limit if max_pixels is None else min(max_pixels, limit)


# ------------------------------------------------------------------------------------------------------- reading
@dataclasses.dataclass(frozen=True)
class VideoMeta:
    """What :func:`read_video` sampled.

    ``fps`` / ``total_frames``: the source stream's average frame rate and frame count; ``start_frame`` ..
    ``end_frame``: the range sampled from (``range_frames`` frames); ``indices``: the source frame of each
    returned frame; ``timestamps``: ``indices / fps`` in seconds; ``sample_fps``: ``len(indices) / range_frames *
    fps``; ``height`` / ``width``: the returned (resized) frame size; ``source_height`` / ``source_width``: the
    decoded size.
    """

    path: str
    fps: float
    total_frames: int
    start_frame: int
    end_frame: int
    indices: tuple[int, ...]
    timestamps: tuple[float, ...]
    sample_fps: float
    height: int
    width: int
    source_height: int
    source_width: int

    @property
    def range_frames(self) -> int:
        return self.end_frame - self.start_frame + 1

    def second_per_grid_ts(self, temporal_patch_size: int = 2) -> float:
        """Seconds covered by one temporal patch of ``temporal_patch_size`` sampled frames."""
        if not isinstance(temporal_patch_size, int) or temporal_patch_size <= 0:
            raise ValueError(f"temporal_patch_size: expected a positive int, got {temporal_patch_size!r}")
        return temporal_patch_size / self.sample_fps

    def hf_metadata(self) -> dict:
        """The ``video_metadata`` dict transformers' processors take (``sampled_fps`` = ``sample_fps``)."""
        return {"fps": self.fps, "frames_indices": list(self.indices), "total_num_frames": self.range_frames}


def _open(path: str):
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"video: expected a file path, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"video: cannot open {path!r}: no such file")
    if os.path.isdir(path):
        raise ValueError(f"video: cannot open {path!r}: it is a directory")
    if not os.access(path, os.R_OK):
        raise ValueError(f"video: cannot open {path!r}: permission denied")
    try:
        container = av.open(path)
    except (av.error.FFmpegError, UnicodeDecodeError) as e:
        raise ValueError(f"video: cannot open {path!r}: not a video file ({e})") from None
    if not container.streams.video:
        container.close()
        raise ValueError(f"video: cannot open {path!r}: not a video file (no video stream)")
    return container


def _stream_rate(stream) -> float:
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate:
            return float(Fraction(rate))
    return 0.0


def _count_frames(path: str) -> int:
    """Frames of the first video stream, from its packets (no decoding), for containers without a count."""
    with _open(path) as container:
        stream = container.streams.video[0]
        return sum(1 for packet in container.demux(stream) if packet.size)


def _resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    if rgb.shape[:2] == (height, width):
        return rgb
    return np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling.BICUBIC))


def _decode(path: str, plan: FramePlan, size_of, show_progress: bool):
    """Decode in order, keep the planned frames (resized by ``size_of(h, w)``): uint8 [n, H, W, 3], source
    (h, w) and the number of frames decoded (all of them when the plan asks for frames past the end)."""
    slots: dict[int, list[int]] = {}
    for slot, index in enumerate(plan.indices):
        slots.setdefault(index, []).append(slot)
    last = max(plan.indices)
    out, source, decoded = None, None, 0
    with _open(path) as container, progress_bar(total=last + 1, desc="frames", enabled=show_progress) as bar:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        try:
            for frame in container.decode(stream):
                if decoded in slots:
                    rgb = frame.to_ndarray(format="rgb24")
                    if out is None:
                        source = rgb.shape[:2]
                        h, w = size_of(*source)
                        out = np.empty((len(plan.indices), h, w, 3), np.uint8)
                    elif rgb.shape[:2] != source:
                        raise ValueError(f"video: {path!r} changes frame size mid-stream ({source} -> {rgb.shape[:2]})")
                    small = _resize(rgb, out.shape[1], out.shape[2])
                    for slot in slots[decoded]:
                        out[slot] = small
                decoded += 1
                bar.update(1)
                if decoded > last:
                    break
        except av.error.FFmpegError as e:
            raise ValueError(f"video: cannot decode {path!r} ({e})") from None
    return out, source, decoded


def read_video(path: str | os.PathLike, fps: float = FPS, *, nframes: int | None = None,
               min_frames: int = FPS_MIN_FRAMES, max_frames: int = FPS_MAX_FRAMES,
               min_pixels: float = VIDEO_MIN_PIXELS, max_pixels: float | None = None,
               total_pixels: float = VIDEO_TOTAL_PIXELS, video_start: float | None = None,
               video_end: float | None = None, resized_height: int | None = None, resized_width: int | None = None,
               image_factor: int = IMAGE_FACTOR, progress: bool = True) -> tuple[np.ndarray, VideoMeta]:
    """Sample and resize a video file as qwen-vl-utils ``fetch_video`` does: (frames uint8 [T, H, W, 3], meta).

    ``fps``: frames per second to sample (or ``nframes`` frames in all); ``min_frames`` / ``max_frames`` bound
    the count; ``min_pixels`` / ``max_pixels`` / ``total_pixels`` bound each frame's area (see the module doc);
    ``video_start`` / ``video_end`` (seconds) restrict the range; ``resized_height`` / ``resized_width`` force a
    size (rounded by ``smart_resize`` with the image defaults, as qwen-vl-utils does). ``T`` is even, ``H`` and
    ``W`` are multiples of ``image_factor`` (28). ``progress`` shows a bar on stderr when it is a terminal.
    Raises ``ValueError`` for a missing file, a file that is not a video, a clip without frames or too few frames,
    and bad arguments.
    """
    if (resized_height is None) != (resized_width is None):
        raise ValueError(f"resized_height/resized_width: give both or neither, got {resized_height!r} and "
                         f"{resized_width!r}")
    if not isinstance(image_factor, int) or image_factor <= 0:
        raise ValueError(f"image_factor: expected a positive int, got {image_factor!r}")
    frame_pixel_limits(1, min_pixels, max_pixels, total_pixels)  # argument checks before any decoding
    with _open(path) as container:
        stream = container.streams.video[0]
        video_fps, total = _stream_rate(stream), int(stream.frames or 0)
    path = os.fspath(path)
    if video_fps <= 0:
        raise ValueError(f"video: {path!r} has no usable frame rate (got {video_fps})")
    if total <= 0:
        total = _count_frames(path)
    if total <= 0:
        raise ValueError(f"video: {path!r} has no frames")
    if total < FRAME_FACTOR:
        raise ValueError(f"video: {path!r} has {total} frame, expected at least {FRAME_FACTOR} (a still image? read "
                         "it as an image)")

    def size_of(h: int, w: int) -> tuple[int, int]:
        if resized_height is not None:
            return smart_resize(resized_height, resized_width, factor=image_factor)
        lo, hi = frame_pixel_limits(len(plan.indices), min_pixels, max_pixels, total_pixels)
        return smart_resize(h, w, factor=image_factor, min_pixels=lo, max_pixels=hi)

    kw = dict(fps=fps, nframes=nframes, min_frames=min_frames, max_frames=max_frames, video_start=video_start,
              video_end=video_end)
    plan = plan_frames(total, video_fps, **kw)
    frames, source, decoded = _decode(path, plan, size_of, progress)
    if frames is None or decoded <= max(plan.indices):
        # the header promised more frames than the stream holds: plan again on the frames that decode
        if decoded <= 0:
            raise ValueError(f"video: {path!r} has no decodable frames")
        total = decoded
        plan = plan_frames(total, video_fps, **kw)
        frames, source, decoded = _decode(path, plan, size_of, progress)
        if frames is None or decoded <= max(plan.indices):
            raise ValueError(f"video: {path!r} decodes differently on a second pass ({decoded} frames)")
    meta = VideoMeta(path=path, fps=video_fps, total_frames=total, start_frame=plan.start, end_frame=plan.end,
                     indices=plan.indices, timestamps=tuple(i / video_fps for i in plan.indices),
                     sample_fps=plan.sample_fps, height=frames.shape[1], width=frames.shape[2],
                     source_height=int(source[0]), source_width=int(source[1]))
    return frames, meta


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as qwen-vl-utils makes it: RGBA pasted on white through its alpha, any other mode converted."""
    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.split()[3])
        return background
    return image.convert("RGB")


def read_image(image: str | os.PathLike | Image.Image, min_pixels: float = IMAGE_MIN_PIXELS,
               max_pixels: float = IMAGE_MAX_PIXELS, *, resized_height: int | None = None,
               resized_width: int | None = None, image_factor: int = IMAGE_FACTOR) -> np.ndarray:
    """An image file or PIL image as qwen-vl-utils ``fetch_image`` prepares it: uint8 [H, W, 3], RGB, ``H`` and
    ``W`` multiples of ``image_factor`` with ``H * W`` in ``[min_pixels, max_pixels]`` (Pillow bicubic)."""
    if (resized_height is None) != (resized_width is None):
        raise ValueError(f"resized_height/resized_width: give both or neither, got {resized_height!r} and "
                         f"{resized_width!r}")
    if isinstance(image, Image.Image):
        img = image
    elif isinstance(image, (str, os.PathLike)):
        p = os.fspath(image)
        if not os.path.isfile(p):
            raise ValueError(f"image: cannot open {p!r}: no such file")
        try:
            with Image.open(p) as f:
                f.load()
                img = f.copy()
        except (OSError, Image.UnidentifiedImageError) as e:
            raise ValueError(f"image: cannot open {p!r}: not an image file ({e})") from None
    else:
        raise ValueError(f"image: expected a file path or a PIL image, got {type(image).__name__}")
    img = to_rgb(img)
    w, h = img.size
    if resized_height is not None:
        rh, rw = smart_resize(resized_height, resized_width, factor=image_factor)
    else:
        rh, rw = smart_resize(h, w, factor=image_factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return np.asarray(img.resize((rw, rh), Image.Resampling.BICUBIC))
