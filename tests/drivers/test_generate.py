"""`mmjax generate` end to end on a tiny random Qwen2.5-VL snapshot against transformers' greedy ids.

The fixture (tests/models/fixtures/generate, tools/make_generate_fixture.py) holds the snapshot with weights, a
clip, and the ids transformers' processor + greedy ``generate`` give on it in float32, with the top-2 logit
margin of every step (expected.json): the smallest margin is over twice the logit shift that one uint8 level of
noise on every pixel causes, so the processors' one-level rounding differences cannot flip a step.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax.drivers.cli import main
from mmjax.sparse import SparseConfig
from mmjax.sparse.patterns import Dense
from mmjax.speculative import SparrowDraft
from models.qwen2_text import TextConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(REPO, "tests", "models", "fixtures", "generate")
SNAPSHOT = os.path.join(FIXTURE, "snapshot")
CLIP = os.path.join(FIXTURE, "clip.mp4")
with open(os.path.join(FIXTURE, "expected.json"), encoding="utf-8") as _f:
    EXPECTED = json.load(_f)
OPTS = EXPECTED["frame_options"]
FLAGS = ["--model", SNAPSHOT, "--video", CLIP, "--prompt", EXPECTED["prompt"], "--fps", str(OPTS["fps"]),
         "--min-pixels", str(OPTS["min_pixels"]), "--max-pixels", str(OPTS["max_pixels"]),
         "--max-new-tokens", str(EXPECTED["max_new_tokens"]), "--dtype", EXPECTED["dtype"]]
JSON_KEYS = {"tokens", "text", "ttft_s", "tokens_per_s", "mean_tau"}


def _run(argv, capsys):
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_json_object(out: str) -> dict:
    assert out.endswith("\n") and out.count("\n") == 1, out
    result = json.loads(out)
    assert set(result) == JSON_KEYS
    return result


@pytest.fixture(scope="module")
def loaded():
    return mmjax.load(SNAPSHOT, dtype=jnp.float32)


def _inputs(processor):
    frames, meta = mmjax.io.read_video(CLIP, fps=OPTS["fps"], min_pixels=OPTS["min_pixels"],
                                       max_pixels=OPTS["max_pixels"], progress=False)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "video"},
                                                                       {"type": "text", "text": EXPECTED["prompt"]}]}])
    return processor(text=[text], videos=[frames], video_metadata=[meta]), text


def test_inputs_match_transformers(loaded):
    inputs, text = _inputs(loaded[1])
    assert text == EXPECTED["rendered_prompt"]
    assert inputs["input_ids"][0].tolist() == EXPECTED["input_ids"]
    assert inputs["video_grid_thw"].tolist() == EXPECTED["video_grid_thw"]
    np.testing.assert_allclose(inputs["second_per_grid_ts"], EXPECTED["second_per_grid_ts"])
    d8 = np.load(os.path.join(FIXTURE, "expected_pixels.npz"))["pixel_values_videos_uint8_d8"]
    theirs = np.cumsum(d8, axis=-1, dtype=np.uint8).astype(np.int64)
    mean, std = (np.asarray(EXPECTED["video_processor"][k])[None, :, None] for k in ("image_mean", "image_std"))
    pv = inputs["pixel_values_videos"]
    ours = np.round((pv.reshape(len(pv), 3, -1) * std + mean) * 255).reshape(pv.shape).astype(np.int64)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1


def test_json_gives_transformers_greedy_ids(capsys):
    rc, out, err = _run(FLAGS + ["--json"], capsys)
    assert rc == 0, err
    result = _one_json_object(out)
    assert result["tokens"] == EXPECTED["generated_ids"]
    assert result["text"] == EXPECTED["generated_text"]
    assert result["ttft_s"] > 0 and result["mean_tau"] == 1.0
    assert result["tokens_per_s"] is None or result["tokens_per_s"] > 0
    assert "time to first token" in err and "12 visual" in err and "4 frames of 10" in err


def test_draft_gives_the_same_ids(loaded, capsys, tmp_path):
    """Greedy speculative decoding is lossless: an untrained draft changes the speed, never the ids."""
    SparrowDraft.init(loaded[0], jax.random.key(0)).save(str(tmp_path / "draft"))
    rc, out, err = _run(FLAGS + ["--json", "--draft", str(tmp_path / "draft"), "--tree", "6-3-2"], capsys)
    assert rc == 0, err
    result = _one_json_object(out)
    assert result["tokens"] == EXPECTED["generated_ids"]
    assert result["mean_tau"] >= 1.0
    assert "mean accepted length" in err


def test_sparse_config_attention(capsys, tmp_path):
    """--attention CONFIG.json prefills through a SparseConfig; with Dense patterns the ids are unchanged."""
    SparseConfig.uniform(Dense(), num_layers=2, num_heads=4).save(tmp_path / "dense.json")
    rc, out, err = _run(FLAGS + ["--json", "--attention", str(tmp_path / "dense.json")], capsys)
    assert rc == 0, err
    assert _one_json_object(out)["tokens"] == EXPECTED["generated_ids"]


def test_fp8_matmuls_run(capsys):
    """--matmul fp8: the vision tower runs fp8 GEMMs (the 63-token prompt is below the decoder's fp8 threshold)."""
    rc, out, err = _run(FLAGS + ["--json", "--matmul", "fp8"], capsys)
    assert rc == 0, err
    result = _one_json_object(out)
    assert len(result["tokens"]) == len(EXPECTED["generated_ids"]) and result["ttft_s"] > 0


def test_streamed_answer(capsys):
    rc, out, err = _run(FLAGS, capsys)
    assert rc == 0, err
    assert out == EXPECTED["generated_text"] + "\n"


def test_images_and_a_video_together(loaded, capsys):
    """The image path: two images after the video in one prompt (ids checked against a direct generate)."""
    model, processor = loaded
    images = [os.path.join(REPO, "tests", "models", "fixtures", "processor", "media", n)
              for n in ("portrait_61x37.png", "rgba_40x50.png")]
    rc, out, err = _run(FLAGS + ["--json", "--image", images[0], "--image", images[1], "--max-pixels", "6272"], capsys)
    assert rc == 0, err
    frames, meta = mmjax.io.read_video(CLIP, fps=OPTS["fps"], min_pixels=OPTS["min_pixels"],
                                       max_pixels=OPTS["max_pixels"], progress=False)
    pics = [mmjax.io.read_image(p, min_pixels=OPTS["min_pixels"], max_pixels=6272) for p in images]
    content = [{"type": "video"}, {"type": "image"}, {"type": "image"}, {"type": "text", "text": EXPECTED["prompt"]}]
    text = processor.apply_chat_template([{"role": "user", "content": content}])
    inputs = processor(text=[text], images=pics, videos=[frames], video_metadata=[meta])
    assert inputs["image_grid_thw"].shape == (2, 3)
    want = mmjax.generate(model, inputs, EXPECTED["max_new_tokens"], eos_token_id=EXPECTED["eos_token_id"])
    assert _one_json_object(out)["tokens"] == want.tokens[0, :int(want.num_tokens[0])].tolist()


def test_on_tokens_streams_each_step_and_eos_lists_stop(loaded):
    model, processor = loaded
    inputs, _ = _inputs(processor)
    want = EXPECTED["generated_ids"]
    calls = []
    out = mmjax.generate(model, inputs, len(want), on_tokens=lambda new: calls.append([x.tolist() for x in new]))
    assert out.tokens[0].tolist() == want
    assert calls[0] == [[want[0]]] and all(len(c) == 1 for c in calls)
    assert sum((c[0] for c in calls), []) == want
    stop = [want[3], 100000]
    out = mmjax.generate(model, inputs, len(want), eos_token_id=stop)
    assert out.tokens[0].tolist() == want[:4] + [-1] * (len(want) - 4) and out.num_tokens.tolist() == [4]
    with pytest.raises(ValueError, match="on_tokens: expected None or a callable"):
        mmjax.generate(model, inputs, 2, on_tokens=3)
    with pytest.raises(ValueError, match="eos_token_id: expected None, an int or a sequence of ints"):
        mmjax.generate(model, inputs, 2, eos_token_id="x")


# ---------------------------------------------------------------------------------------------- bad input
def _snapshot_copy(tmp_path, **config_changes):
    """The fixture snapshot with config.json changed (other files symlinked)."""
    d = tmp_path / "snap"
    d.mkdir()
    for name in os.listdir(SNAPSHOT):
        if name != "config.json":
            os.symlink(os.path.join(SNAPSHOT, name), d / name)
    with open(os.path.join(SNAPSHOT, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    for key, value in config_changes.items():
        if key == "text_config":
            config["text_config"].update(value)
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _other_draft(tmp_path):
    text = TextConfig(vocab_size=448, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, mrope_section=(1, 1, 2))
    SparrowDraft(text).save(str(tmp_path / "other_draft"))
    return str(tmp_path / "other_draft")


def _clip_bytes() -> bytes:
    with open(CLIP, "rb") as f:
        return f.read()


def _file(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _replace(flags, flag, value):
    out = list(flags)
    out[out.index(flag) + 1] = value
    return out


BAD = {
    "missing video": (lambda t: _replace(FLAGS, "--video", str(t / "nope.mp4")), "no such file"),
    "video is a directory": (lambda t: _replace(FLAGS, "--video", str(t)), "it is a directory"),
    "truncated video": (lambda t: _replace(FLAGS, "--video", _file(t / "cut.mp4", _clip_bytes()[:1500])),
                        "not a video file"),
    "text file as video": (lambda t: _replace(FLAGS, "--video", _file(t / "notes.mp4", b"hello\n")),
                           "not a video file"),
    "image as video": (lambda t: _replace(FLAGS, "--video", os.path.join(REPO, "tests", "models", "fixtures",
                                                                         "processor", "media", "tiny_13x9.png")),
                       "has 1 frame, expected at least 2"),
    "missing image": (lambda t: FLAGS + ["--image", str(t / "nope.png")], "--image: image: cannot open"),
    "model without config.json": (lambda t: _replace(FLAGS, "--model", str(t)),
                                  "--model: snapshot_dir: no config.json"),
    "unknown architecture": (lambda t: _replace(FLAGS, "--model", _snapshot_copy(
        t, architectures=["MistralForCausalLM"], model_type="mistral")),
        "unsupported architecture (architectures ['MistralForCausalLM'], model_type 'mistral'); supported: "
        "Qwen2_5_VLForConditionalGeneration (qwen2_5_vl), LlamaForCausalLM (llama)"),
    "prompt longer than the context": (lambda t: _replace(FLAGS, "--model", _snapshot_copy(
        t, text_config={"max_position_embeddings": 40})),
        "prompt: 63 tokens (12 visual) + --max-new-tokens 8 exceed the model's context of 40 tokens"),
    "draft of another model": (lambda t: FLAGS + ["--draft", _other_draft(t)],
                               "the draft belongs to another model: hidden_size 32 (draft) vs 64 (model)"),
    "missing draft": (lambda t: FLAGS + ["--draft", str(t / "none")], "--draft"),
    "bad attention": (lambda t: FLAGS + ["--attention", "sparse"], "--attention: expected dense, cudnn or a "
                                                                   "SparseConfig JSON file, got 'sparse'"),
    "sparse config of another shape": (lambda t: FLAGS + ["--attention", _file(
        t / "c.json", SparseConfig.uniform(Dense(), num_layers=3, num_heads=4).to_json().encode())],
        "c.json: the config has 3 layers x 4 heads, the model 2 x 4"),
    "bad tree": (lambda t: FLAGS + ["--tree", "30-4"], "tree: expected 'total_tokens-depth-top_k'"),
    "max pixels below min pixels": (lambda t: _replace(FLAGS, "--max-pixels", "100"),
                                    "--max-pixels: expected >= --min-pixels (3136), got 100"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_with_status_2(case, tmp_path, capsys):
    make_argv, message = BAD[case]
    rc, out, err = _run(make_argv(tmp_path), capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith("mmjax generate: error: "), err
    assert message in lines[0]


def test_bad_input_in_a_subprocess_has_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mmjax.drivers.cli", "generate", *_replace(FLAGS, "--video", str(
        tmp_path / "nope.mp4"))], capture_output=True, text=True, cwd=REPO, timeout=300,
        env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"mmjax generate: error: --video: video: cannot open "
                                             f"{str(tmp_path / 'nope.mp4')!r}: no such file"]


# ---------------------------------------------------------------------------------- a real process, no torch
def test_subprocess_json_without_torch(tmp_path):
    """`import mmjax, models` and a whole `mmjax generate --json` run load neither torch nor transformers, even
    where both are importable (stand-in packages on the path), and stdout is exactly the JSON object."""
    for name in ("torch", "transformers"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "__init__.py").write_text("")
    code = (
        "import json, sys\n"
        "import mmjax, models\n"
        "from mmjax.drivers.cli import main\n"
        f"rc = main(['generate', *{FLAGS!r}, '--json'])\n"
        "seen = lambda: sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print(json.dumps(seen()), file=sys.stderr)\n"
        "import torch, transformers  # the stand-ins: the same check sees them once imported\n"
        "print(json.dumps(seen()), file=sys.stderr)\n"
        "sys.exit(rc)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr
    assert _one_json_object(r.stdout)["tokens"] == EXPECTED["generated_ids"]
    assert [json.loads(x) for x in r.stderr.strip().splitlines()[-2:]] == [[], ["torch", "transformers"]]


def test_fixture_records_comfortable_margins():
    """The fixture's own claim, checked: every greedy step's margin beats the one-level pixel-noise shift."""
    margins = np.asarray(EXPECTED["greedy_top2_margins"])
    shift = np.asarray(EXPECTED["logit_shift_one_level_pixel_noise"])
    assert len(margins) == len(EXPECTED["generated_ids"]) == EXPECTED["max_new_tokens"]
    assert (margins > 1.5 * shift).all() and margins.min() == pytest.approx(EXPECTED["min_margin"])
