"""mmjax.io against qwen-vl-utils (fixtures from tools/make_processor_fixtures.py) and on clips written here."""

import functools
import gzip
import json
import os
import subprocess
import sys
from fractions import Fraction

import av
import numpy as np
import pytest
from PIL import Image

from mmjax import io as mio
from mmjax.progress import progress_bar

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "fixtures", "processor")
MEDIA = os.path.join(FIXTURES, "media")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_json(name):
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return json.load(f)


@functools.cache
def rules():
    with gzip.open(os.path.join(FIXTURES, "video_rules.json.gz"), "rt", encoding="utf-8") as f:
        return json.load(f)


VIDEO_CASES = load_json("video_cases.json")
IMAGE_CASES = load_json("image_cases.json")


# ------------------------------------------------------------------------------------- against qwen-vl-utils
@pytest.mark.parametrize("i", range(len(VIDEO_CASES)))
def test_read_video_matches_qwen_vl_utils(i):
    case = VIDEO_CASES[i]
    frames, meta = mio.read_video(os.path.join(MEDIA, case["clip"]), progress=False, **case["options"])
    assert list(meta.indices) == case["indices"]
    assert meta.sample_fps == case["sample_fps"]
    assert meta.fps == case["video_fps"] and meta.range_frames == case["total_num_frames"]
    assert frames.dtype == np.uint8 and list(frames.shape) == case["shape"]
    assert (meta.height, meta.width) == tuple(case["shape"][1:3])
    assert meta.timestamps == tuple(k / case["video_fps"] for k in case["indices"])
    assert meta.second_per_grid_ts(2) == 2 / case["sample_fps"]
    assert meta.hf_metadata() == {"fps": case["video_fps"], "frames_indices": case["indices"],
                                  "total_num_frames": case["total_num_frames"]}
    with np.load(os.path.join(FIXTURES, "video_cases.npz")) as z:
        ref = np.cumsum(z[f"frames_{i}_d8"], axis=2, dtype=np.uint8)  # the script's delta coding
    diff = np.abs(frames[case["stored_frames"]].astype(np.int16) - ref.astype(np.int16))
    # Pillow vs torchvision antialiased bicubic, PyAV vs decord YUV->RGB: the tolerance stated in mmjax.io
    assert diff.max() <= 3 and diff.mean() < 0.3, (diff.max(), diff.mean())


def test_rules_match_qwen_vl_utils():
    """Frame range, count, torch.linspace indices, sample fps and per-frame pixel budget on 160 combinations."""
    checked = 0
    for r in rules():
        if "linspace" in r:
            assert mio.linspace_indices(*r["linspace"]).tolist() == r["indices"], r["linspace"]
            continue
        if "error" in r:
            with pytest.raises(ValueError):
                mio.plan_frames(r["total_frames"], r["video_fps"], **r["options"])
            continue
        plan = mio.plan_frames(r["total_frames"], r["video_fps"], **r["options"])
        assert (plan.start, plan.end, plan.count) == (r["start"], r["end"], r["count"]), r
        assert list(plan.indices) == r["indices"] and plan.sample_fps == r["sample_fps"], r
        pix = r["pixels"]
        lo, hi = mio.frame_pixel_limits(len(plan.indices), pix.get("min_pixels", mio.VIDEO_MIN_PIXELS),
                                        pix.get("max_pixels"), pix.get("total_pixels", mio.VIDEO_TOTAL_PIXELS))
        if isinstance(r["resized"], str):
            with pytest.raises(ValueError):
                mio.smart_resize(r["height"], r["width"], 28, lo, hi)
        else:
            assert list(mio.smart_resize(r["height"], r["width"], 28, lo, hi)) == r["resized"], r
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("i", range(len(IMAGE_CASES)))
def test_read_image_matches_qwen_vl_utils(i):
    case = IMAGE_CASES[i]
    with np.load(os.path.join(FIXTURES, "image_cases.npz")) as z:
        ref = z[f"image_{i}"]
    path = os.path.join(MEDIA, case["image"])
    np.testing.assert_array_equal(mio.read_image(path, **case["options"]), ref)
    with Image.open(path) as im:
        np.testing.assert_array_equal(mio.read_image(im, **case["options"]), ref)


# -------------------------------------------------------------------------------------- clips written here
def code_frame(i: int, h: int, w: int) -> np.ndarray:
    """A flat frame whose colour encodes ``i`` (three base-16 digits in R, G and B)."""
    digits = [(i // 16 ** k % 16) * 16 + 8 for k in range(3)]
    return np.broadcast_to(np.array(digits, np.uint8), (h, w, 3)).copy()


def decode_code(frame: np.ndarray) -> int:
    return sum(16 ** k * int(round((frame[..., k].mean() - 8) / 16)) for k in range(3))


def write_clip(path, frames: int, fps, h: int, w: int) -> str:
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"preset": "ultrafast", "qp": "4"}
        for i in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(code_frame(i, h, w), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return str(path)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    return {
        "short": (write_clip(d / "short.mp4", 6, 24, 32, 48), 6, 24.0),
        "long": (write_clip(d / "long.mp4", 600, 30, 48, 64), 600, 30.0),
        "ntsc": (write_clip(d / "ntsc.mp4", 125, Fraction(30000, 1001), 40, 40), 125, 30000 / 1001),
        "odd": (write_clip(d / "odd.mkv", 37, Fraction(25, 2), 36, 52), 37, 12.5),
    }


@pytest.mark.parametrize("name", ["short", "long", "ntsc", "odd"])
def test_kept_frames_are_the_sampled_ones(clips, name):
    path, total, fps = clips[name]
    frames, meta = mio.read_video(path, fps=2.0, min_pixels=784, max_pixels=3136, progress=False)
    plan = mio.plan_frames(total, fps, fps=2.0)
    assert meta.total_frames == total and meta.fps == pytest.approx(fps, rel=1e-12)
    assert meta.indices == plan.indices and len(frames) == len(plan.indices)
    assert [decode_code(f) for f in frames] == list(meta.indices)


def test_long_clip_values(clips):
    path, _, _ = clips["long"]
    frames, meta = mio.read_video(path, min_pixels=784, max_pixels=3136, progress=False)  # 20 s at 30 fps
    assert len(frames) == 40 and meta.sample_fps == 2.0 and meta.second_per_grid_ts() == 1.0
    assert meta.indices[:4] == (0, 15, 31, 46) and meta.indices[-1] == 599
    assert (meta.source_height, meta.source_width) == (48, 64) and frames.shape[1:] == (56, 56, 3)
    frames, meta = mio.read_video(path, fps=1.0, video_start=2.0, video_end=6.0, min_pixels=784,
                                  max_pixels=3136, progress=False)
    assert (meta.start_frame, meta.end_frame) == (60, 180) and meta.indices[0] == 60 and meta.indices[-1] == 180
    assert [decode_code(f) for f in frames] == list(meta.indices)


def test_short_clip_takes_its_frames(clips):
    path, _, _ = clips["short"]
    frames, meta = mio.read_video(path, progress=False, min_pixels=784, max_pixels=3136)
    # 0.25 s at 2 fps is 0.5 frames: raised to min_frames 4 (even), within the 6 frames there are
    assert meta.indices == (0, 2, 3, 5) and meta.sample_fps == 4 / 6 * 24
    frames, meta = mio.read_video(path, nframes=5, progress=False, min_pixels=784, max_pixels=3136)
    assert len(frames) == 4  # nframes rounds to an even count (5 -> 4, Python's round half to even)


_PEAK_RSS = """
import sys
import mmjax.io as mio

def status(key):
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # reset the peak resident size (VmHWM) to the current one
base = status('VmRSS')
frames, meta = mio.read_video(sys.argv[1], min_pixels=784, max_pixels=3136, progress=False)
print(status('VmHWM') - base, len(frames))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_streaming_holds_only_sampled_frames(tmp_path):
    """A 300-frame 640x480 clip (276 MB as RGB; decoding it all into arrays peaks ~270 MB higher) is read with a
    peak resident-size increase of a few frames."""
    path = write_clip(tmp_path / "big.mp4", 300, 25, 480, 640)
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", _PEAK_RSS, path], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    peak, n = map(int, res.stdout.split())
    assert n == 24
    assert peak < 64 * 2**20, peak / 2**20


def test_total_pixel_budget_shrinks_frames(clips):
    path, _, _ = clips["long"]
    small, _ = mio.read_video(path, fps=2.0, min_pixels=784, total_pixels=40 * 784, progress=False)
    large, _ = mio.read_video(path, fps=2.0, min_pixels=784, total_pixels=40 * 4 * 784, progress=False)
    assert small.shape[1] * small.shape[2] < large.shape[1] * large.shape[2]
    lo, hi = mio.frame_pixel_limits(40, 784, None, 40 * 784)
    assert hi == max(min(mio.VIDEO_MAX_PIXELS, 40 * 784 / 40 * 2), int(784 * 1.05))


# ---------------------------------------------------------------------------------------------------- errors
def test_bad_files(tmp_path, clips):
    with pytest.raises(ValueError, match="video: cannot open .*: no such file"):
        mio.read_video(tmp_path / "missing.mp4")
    text = tmp_path / "notes.mp4"
    text.write_text("this is not a video\n" * 100)
    with pytest.raises(ValueError, match="video: cannot open .*notes.mp4.*: not a video file"):
        mio.read_video(text)
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a video file"):
        mio.read_video(empty)
    with pytest.raises(ValueError, match="directory"):
        mio.read_video(tmp_path)
    png = os.path.join(MEDIA, "tiny_13x9.png")
    with pytest.raises(ValueError, match="has 1 frame, expected at least 2"):  # an image opens as a one-frame video
        mio.read_video(png)


def test_video_without_frames(tmp_path):
    path = tmp_path / "noframes.mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        out.start_encoding()  # header only, no frame
    with pytest.raises(ValueError, match="video: .*(no frames|not a video file)"):
        mio.read_video(path)


def test_bad_arguments(clips):
    path, _, _ = clips["short"]
    with pytest.raises(ValueError, match="fps: expected a positive number"):
        mio.read_video(path, fps=0)
    with pytest.raises(ValueError, match="fps: expected a positive number"):
        mio.read_video(path, fps=-2.0)
    with pytest.raises(ValueError, match="video_start/video_end"):
        mio.read_video(path, video_start=0.2, video_end=0.1)
    with pytest.raises(ValueError, match="resized_height/resized_width"):
        mio.read_video(path, resized_height=56)
    with pytest.raises(ValueError, match="min_pixels"):
        mio.read_video(path, min_pixels=0)
    with pytest.raises(ValueError, match="max_pixels: expected >= min_pixels"):
        mio.smart_resize(100, 100, 28, 3136, 784)
    with pytest.raises(ValueError, match="image: cannot open .*: no such file"):
        mio.read_image("/nonexistent/x.png")
    with pytest.raises(ValueError, match="image: cannot open .*: not an image file"):
        mio.read_image(path)
    with pytest.raises(ValueError, match="temporal_patch_size"):
        mio.read_video(path, min_pixels=784, max_pixels=3136, progress=False)[1].second_per_grid_ts(0)


# -------------------------------------------------------------------------------------------------- progress
class _Tty:
    def __init__(self):
        self.text = []

    def isatty(self):
        return True

    def write(self, s):
        self.text.append(s)

    def flush(self):
        pass


def test_progress_quiet_unless_terminal(monkeypatch):
    tty = _Tty()
    monkeypatch.setattr("sys.stderr", tty)
    with progress_bar(total=3, desc="frames") as bar:
        bar.update(3)
        assert not bar.disable
    assert "frames" in "".join(tty.text)
    with progress_bar(total=3, desc="frames", enabled=False) as bar:
        assert bar.disable
    monkeypatch.setattr("sys.stderr", open(os.devnull, "w"))
    with progress_bar(total=3, desc="frames") as bar:
        assert bar.disable  # not a TTY
    with pytest.raises(ValueError, match="total"):
        progress_bar(total=-1)
