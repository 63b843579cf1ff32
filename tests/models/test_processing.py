"""The NumPy Qwen2.5-VL processor against transformers' (fixtures from tools/make_processor_fixtures.py)."""

import functools
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from models.qwen2_5_vl import Processor
from models.qwen2_5_vl.pixels import PixelConfig, smart_resize

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "processor")
SNAPSHOT = os.path.join(FIXTURES, "snapshot")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.cache
def cases() -> dict:
    with open(os.path.join(FIXTURES, "processor_cases.json"), encoding="utf-8") as f:
        return json.load(f)


@functools.cache
def arrays() -> dict:
    with np.load(os.path.join(FIXTURES, "processor_cases.npz")) as z:
        return dict(z)


@functools.cache
def chat_cases() -> dict:
    with open(os.path.join(FIXTURES, "chat_cases.json"), encoding="utf-8") as f:
        return json.load(f)


def undelta(d: np.ndarray, axis: int) -> np.ndarray:
    """Inverse of the fixture script's ``delta8``."""
    return np.cumsum(d, axis=axis, dtype=np.uint8)


def variant_snapshot(tmp_path) -> str:
    d = str(tmp_path / "variant")
    shutil.copytree(SNAPSHOT, d)
    shutil.copy(os.path.join(FIXTURES, "variants", "video_preprocessor_config.json"), d)
    return d


@functools.cache
def processor() -> Processor:
    return Processor.from_pretrained(SNAPSHOT)


def load_image(name: str) -> Image.Image:
    with Image.open(os.path.join(FIXTURES, "media", name)) as im:
        im.load()
        return im.copy()


def case_inputs(case: dict) -> dict:
    """The processor arguments the fixture script passed to transformers for ``case``."""
    spec = case["spec"]
    kw = dict(text=case["text"])
    if case["padding"]:
        kw["padding"] = True
    if "padding_side" in spec:
        kw["padding_side"] = spec["padding_side"]
    if "images" in spec:
        kw["images"] = [load_image(n) for n in spec["images"]]
    if "image_arrays" in spec:
        kw["images"] = [np.asarray(load_image(n)) for n in spec["image_arrays"]]
    if "videos" in spec:
        videos = [undelta(arrays()[f"video/{clip}_d8"], 2) for clip in spec["videos"]]
        kw["videos"] = [v[: spec["video_frames"]] for v in videos] if "video_frames" in spec else videos
    if "video_metadata" in spec:
        kw["video_metadata"] = spec["video_metadata"]
    if "fps" in spec:
        kw["fps"] = spec["fps"]
    return kw


def patch_levels(pixel_values: np.ndarray, cfg: PixelConfig, image: bool) -> np.ndarray:
    """float32 patch rows back to uint8 levels (the fixtures' storage); images keep one temporal copy."""
    n = len(pixel_values)
    x = pixel_values.reshape(n, 3, -1).astype(np.float64) * np.asarray(cfg.image_std)[None, :, None]
    x = np.round((x + np.asarray(cfg.image_mean)[None, :, None]) * 255.0)
    if image:
        x = x.reshape(n, 3, cfg.temporal_patch_size, -1)[:, :, 0]
    return x.reshape(n, -1)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Our processor's output for every fixture case."""
    variant = Processor.from_pretrained(variant_snapshot(tmp_path_factory.mktemp("snap")))
    return {c["name"]: (variant if c["variant"] else processor())(**case_inputs(c)) for c in cases()["cases"]}


CASE_NAMES = [c["name"] for c in cases()["cases"]]


def case_by_name(name: str) -> dict:
    return next(c for c in cases()["cases"] if c["name"] == name)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_ids_grids_and_keys_equal_transformers(outputs, name):
    case, out = case_by_name(name), outputs[name]
    assert sorted(out) == case["keys"]
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw", "video_grid_thw"):
        if key in case["keys"]:
            ref = arrays()[f"{name}/{key}"]
            assert out[key].dtype == ref.dtype and out[key].shape == ref.shape, key
            np.testing.assert_array_equal(out[key], ref, err_msg=key)
    if "second_per_grid_ts" in case["keys"] and name != "video_fps_kwarg":
        ref = arrays()[f"{name}/second_per_grid_ts"]
        assert out["second_per_grid_ts"].dtype == ref.dtype
        np.testing.assert_allclose(out["second_per_grid_ts"], ref, rtol=1e-12)


@pytest.mark.parametrize("name", [n for n in CASE_NAMES if not n.startswith("text")])
def test_pixel_values_within_resize_tolerance(outputs, name):
    """Within 1 uint8 level of transformers' torchvision processors (bicubic filters' rounding), equal to its PIL
    image processor to float32 rounding."""
    case, out = case_by_name(name), outputs[name]
    p = Processor.from_pretrained(SNAPSHOT)
    for key in ("pixel_values", "pixel_values_videos"):
        if key not in case["keys"]:
            continue
        cfg = p.image_config if key == "pixel_values" else p.video_config
        if case["variant"] and key == "pixel_values_videos":
            cfg = PixelConfig.from_dict(json.load(open(os.path.join(FIXTURES, "variants",
                                                                  "video_preprocessor_config.json"))), {})
        got = out[key]
        assert got.dtype == np.float32 and list(got.shape) == case[f"{key}_shape"]
        stored = case.get(f"{key}_uint8_same_as") or f"{name}/{key}_uint8_d8"
        ref_levels = undelta(arrays()[stored], -1).astype(np.float64)
        diff = np.abs(patch_levels(got, cfg, key == "pixel_values") - ref_levels)
        row = arrays()[f"{name}/{key}_row"]  # one row exactly as transformers returned it
        row_err = np.abs(got[len(got) // 2] - row).max()
        if case["slow"]:
            assert diff.max() == 0 and row_err < 1e-5
        else:
            assert diff.max() <= 1 and diff.mean() < 0.02, (diff.max(), diff.mean())
            assert row_err <= 1.0 / (255 * min(cfg.image_std)) + 1e-5


def test_fps_argument_is_the_sampled_fps(outputs):
    """qwen-vl-utils' meaning of fps (transformers 5.23 ignores it here and uses 24: the documented difference)."""
    case = case_by_name("video_fps_kwarg")
    fps = case["spec"]["fps"]
    assert outputs["video_fps_kwarg"]["second_per_grid_ts"].tolist() == [2 / fps]
    assert arrays()["video_fps_kwarg/second_per_grid_ts"].tolist() == [2 / 24]


def test_video_metadata_objects_and_read_video_frames():
    """``mmjax.io.read_video`` frames and ``VideoMeta`` give transformers' ids, grids and second_per_grid_ts."""
    from mmjax.io import read_video

    with open(os.path.join(FIXTURES, "video_cases.json"), encoding="utf-8") as f:
        options = next(v["options"] for v in json.load(f) if v["clip"] == "ntsc_2997fps_60x80.mp4")
    frames, meta = read_video(os.path.join(FIXTURES, "media", "ntsc_2997fps_60x80.mp4"), progress=False, **options)
    case = case_by_name("video_metadata")
    out = processor()(text=case["text"], videos=[frames], video_metadata=[meta])
    np.testing.assert_array_equal(out["input_ids"], arrays()["video_metadata/input_ids"])
    np.testing.assert_array_equal(out["video_grid_thw"], arrays()["video_metadata/video_grid_thw"])
    np.testing.assert_allclose(out["second_per_grid_ts"], arrays()["video_metadata/second_per_grid_ts"], rtol=1e-12)


@pytest.mark.parametrize("which", ["default", "variant"])
def test_configs_resolved_as_transformers(tmp_path, which):
    ref = cases()[which]
    p = Processor.from_pretrained(SNAPSHOT if which == "default" else variant_snapshot(tmp_path))
    for cfg, prefix, size in ((p.image_config, "image", ref["image_size"]),
                              (p.video_config, "video", ref["video_size"])):
        assert (cfg.min_pixels, cfg.max_pixels) == (size["shortest_edge"], size["longest_edge"])
        np.testing.assert_allclose(cfg.image_mean, ref[f"{prefix}_mean"])
        np.testing.assert_allclose(cfg.image_std, ref[f"{prefix}_std"])
    assert p.video_config.cap_pixels_per_frame == bool(ref["video_cap_pixels_per_frame"])
    assert p.video_config.max_video_tokens == ref["video_max_video_tokens"]
    assert (p.image_token_id, p.video_token_id) == (ref["image_token_id"], ref["video_token_id"])
    assert p.tokenizer.special_tokens_map == ref["special_tokens_map"]
    assert p.tokenizer.padding_side == ref["padding_side"]


def test_smart_resize_is_transformers_variant():
    """transformers' rounding (sides may round to 0 first; qwen-vl-utils starts from ``factor``) on its table."""
    for h, w, lo, hi, want in cases()["smart_resize"]:
        if isinstance(want, str):
            with pytest.raises(ValueError, match="aspect ratio"):
                smart_resize(h, w, 28, lo, hi)
        else:
            assert list(smart_resize(h, w, 28, lo, hi)) == want, (h, w, lo, hi)


# --------------------------------------------------------------------------------------------- chat and decode
def test_chat_template_renders_as_transformers():
    p = processor()
    for c in chat_cases()["chat"]:
        got = p.apply_chat_template(c["messages"], add_generation_prompt=c["add_generation_prompt"], **c["kwargs"])
        assert got == c["rendered"]
    batch = chat_cases()["chat_batch"]
    assert p.apply_chat_template(batch["messages"]) == batch["rendered"]


def test_chat_template_ignores_media_objects_and_none_keys():
    p = processor()
    plain = p.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}])
    rich = p.apply_chat_template([{"role": "user", "name": None,
                                   "content": [{"type": "image", "image": np.zeros((2, 2, 3), np.uint8)},
                                               {"type": "text", "text": "x"}]}])
    assert rich == plain and plain.count("<|image_pad|>") == 1


@pytest.mark.parametrize("layout", ["jinja", "tokenizer_config", "named_dir"])
def test_chat_template_file_lookup(tmp_path, layout):
    d = tmp_path / "snap"
    shutil.copytree(SNAPSHOT, d)
    template = json.load(open(d / "chat_template.json"))["chat_template"]
    os.remove(d / "chat_template.json")
    if layout == "jinja":
        (d / "chat_template.jinja").write_text(template, encoding="utf-8")
    elif layout == "named_dir":
        os.makedirs(d / "chat_templates")
        (d / "chat_templates" / "default.jinja").write_text(template, encoding="utf-8")
        (d / "chat_templates" / "short.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    p = Processor.from_pretrained(d)
    c = chat_cases()["chat"][0]
    assert p.apply_chat_template(c["messages"], add_generation_prompt=c["add_generation_prompt"]) == c["rendered"]
    if layout == "named_dir":
        assert p.apply_chat_template(c["messages"], chat_template="short") == c["messages"][0]["content"]
        os.remove(d / "chat_templates" / "default.jinja")
        with pytest.raises(ValueError, match="none is named 'default'"):
            Processor.from_pretrained(d).apply_chat_template(c["messages"])


def test_chat_template_json_with_template_dir_is_rejected(tmp_path):
    d = tmp_path / "snap"
    shutil.copytree(SNAPSHOT, d)
    os.makedirs(d / "chat_templates")
    (d / "chat_templates" / "other.jinja").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match="chat_template.json and chat_templates"):
        Processor.from_pretrained(d)


def test_chat_template_errors_and_tokenize():
    p = processor()
    with pytest.raises(ValueError, match="boom"):
        p.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ raise_exception('boom') }}")
    with pytest.raises(ValueError, match="does not parse"):
        p.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% if %}")
    msgs = [{"role": "user", "content": "Hello there"}]
    ids = p.apply_chat_template(msgs, tokenize=True)
    assert ids.dtype == np.int64 and ids.ndim == 1
    assert p.decode(ids, skip_special_tokens=False) == p.apply_chat_template(msgs)
    with pytest.raises(ValueError, match="images or videos"):
        p.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=True)


def test_decode_as_transformers():
    p = processor()
    for c in chat_cases()["decode"]:
        assert p.decode(c["ids"], skip_special_tokens=c["skip"]) == c["text"]
        assert p.decode(np.asarray(c["ids"]), skip_special_tokens=c["skip"]) == c["text"]
    b = chat_cases()["batch_decode"]
    assert p.batch_decode(b["ids"]) == b["text"]


# ------------------------------------------------------------------------------------------------- bad input
def test_placeholder_counts_must_match():
    p = processor()
    img = load_image("portrait_61x37.png")
    with pytest.raises(ValueError, match="images: the text has 0"):
        p(text=["no placeholder"], images=[img])
    with pytest.raises(ValueError, match="images: the text has 2"):
        p(text=["<|image_pad|> <|image_pad|>"], images=[img])
    with pytest.raises(ValueError, match="videos: the text has 1"):
        p(text=["<|video_pad|>"])


def test_bad_arguments():
    p = processor()
    video = np.zeros((4, 56, 56, 3), np.uint8)
    with pytest.raises(ValueError, match="image: expected a PIL image or a uint8"):
        p(text=["<|image_pad|>"], images=[np.zeros((30, 30, 3), np.float32)])
    with pytest.raises(ValueError, match="videos: expected uint8"):
        p(text=["<|video_pad|>"], videos=[video[..., 0]])
    with pytest.raises(ValueError, match="video_metadata/fps"):
        p(text=["<|video_pad|>"], videos=[video], fps=2.0, video_metadata=[{"fps": 2.0}])
    with pytest.raises(ValueError, match="video_metadata: expected one entry per video"):
        p(text=["<|video_pad|>"], videos=[video], video_metadata=[{"fps": 2.0}, {"fps": 2.0}])
    with pytest.raises(ValueError, match="fps: expected a positive number"):
        p(text=["<|video_pad|>"], videos=[video], fps=[0.0])
    with pytest.raises(ValueError, match="pass padding=True"):
        p(text=["a", "a much longer text"])
    with pytest.raises(ValueError, match="at least one input"):
        p()
    with pytest.raises(ValueError, match="return_tensors"):
        p(text=["x"], return_tensors="pt")


def test_snapshot_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        Processor.from_pretrained(tmp_path / "missing")
    d = tmp_path / "snap"
    shutil.copytree(SNAPSHOT, d)
    config = json.load(open(d / "config.json"))
    config["image_token_id"] += 1
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json: image_token_id"):
        Processor.from_pretrained(d)
    os.remove(d / "config.json")
    os.remove(d / "preprocessor_config.json")
    with pytest.raises(ValueError, match="no preprocessor_config.json"):
        Processor.from_pretrained(d)
    os.remove(d / "tokenizer.json")
    (d / "preprocessor_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Processor.from_pretrained(d)


# ------------------------------------------------------------------------------------------------- layering
def test_no_torch_or_transformers_import(tmp_path):
    """Importing the reader and the processor (and using them) loads neither torch nor transformers, even where
    both are importable (stand-in packages on the path record any import)."""
    for name in ("torch", "transformers"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "__init__.py").write_text("")
    code = (
        "import sys\n"
        "import mmjax.io, models.qwen2_5_vl.processing\n"
        "from models.qwen2_5_vl import Processor\n"
        f"p = Processor.from_pretrained({SNAPSHOT!r})\n"
        f"frames, meta = mmjax.io.read_video({os.path.join(FIXTURES, 'media', 'short_25fps_48x64.mp4')!r}, "
        "min_pixels=784, max_pixels=3136, progress=False)\n"
        "p(text=['<|video_pad|>'], videos=[frames], video_metadata=[meta])\n"
        "seen = lambda: sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print(seen())\n"
        "import torch, transformers  # the stand-ins: the same check sees them once imported\n"
        "print(seen())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]), JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-2:] == ["[]", "['torch', 'transformers']"]


def test_models_do_not_import_mmjax():
    code = "import sys, models.qwen2_5_vl.processing; print('mmjax' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                         env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"
