"""Write the end-to-end fixture of ``mmjax generate`` (tests/drivers/test_generate.py, tests/test_load.py).

Run with the Python of tools/make_processor_fixtures.py (torch + torchvision + transformers + av + qwen-vl-utils +
decord; NOT project dependencies), after that script has written the processor snapshot::

    /tmp/hfvenv/bin/python tools/make_generate_fixture.py tests/models/fixtures/processor tests/models/fixtures/generate

Nothing is downloaded. From PROCESSOR_DIR/snapshot (tokenizer.json, tokenizer_config.json, chat_template.json,
preprocessor_config.json, config.json of a tiny Qwen2.5-VL) it builds OUT_DIR:

* ``snapshot/``: the processor files, a tiny random Qwen2.5-VL in bf16 (one ``model.safetensors``, transformers 5
  tensor names), its ``config.json`` and a ``generation_config.json`` whose ``eos_token_id`` lists
  ``<|im_end|>`` and ``<|endoftext|>`` as Qwen2.5-VL-Instruct's does;
* ``clip.mp4``: a short H.264 clip written with PyAV (smooth colour waves and a moving square);
* ``expected.json``: the prompt and the frame options, the ids transformers' processor gives
  (qwen-vl-utils ``fetch_video``, decord backend, then ``AutoProcessor``), the ids greedy ``generate`` gives
  on them (float32 compute), the top-2 logit margin at every greedy step, and the versions used;
  ``expected_pixels.npz``: transformers' ``pixel_values_videos`` as the uint8 values they were made from.

The weights are random (initializer range ``INIT_RANGE``, so the model does not repeat one token) and rounded to
bf16 before the float32 reference runs, so the bf16 checkpoint loaded in float32 reproduces them exactly. The seed
is the first whose greedy steps all keep a top-2 margin of at least ``MIN_MARGIN`` and at least ``MIN_RATIO`` times
the largest logit shift that one uint8 level of noise on every pixel causes (the NumPy processor differs from
transformers' torchvision one by at most one level on a few values). The comparison is meaningful in float32 only:
a random network this size amplifies bf16 rounding to logit shifts larger than its top-2 margins.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
from fractions import Fraction

import av
import numpy as np
import tokenizers
import torch
import torchvision
import transformers

import make_processor_fixtures as mpf
from qwen_vl_utils import vision_process as qvu

PROMPT = "What happens in this video?"
FRAME_OPTIONS = {"fps": 2.0, "min_pixels": 3136, "max_pixels": 6272}  # qwen-vl-utils / `mmjax generate` flags
CLIP = dict(frames=10, fps=Fraction(5), height=56, width=84, seed=3)
MAX_NEW_TOKENS = 8
MIN_MARGIN = 0.02  # logits (float32); JAX and torch float32 agree to ~1e-5 here
MIN_RATIO = 1.5  # margin over the logit shift that one uint8 level of noise on every pixel causes
INIT_RANGE = 0.15
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.json", "preprocessor_config.json")


def build_model(config_path: str, seed: int):
    cfg = transformers.Qwen2_5_VLConfig.from_pretrained(os.path.dirname(config_path))
    cfg.text_config.initializer_range = INIT_RANGE
    cfg.vision_config.initializer_range = INIT_RANGE
    cfg.initializer_range = INIT_RANGE
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def save_snapshot(model, processor_snapshot: str, snap: str, eos: list[int], pad: int) -> None:
    """config.json + one bf16 model.safetensors + generation_config.json + the processor files."""
    tmp = snap + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    # a bf16 copy: casting `model` itself would also round its fp32 rotary inv_freq buffers
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    if not os.path.isfile(os.path.join(tmp, "model.safetensors")):
        raise RuntimeError(f"expected one model.safetensors in {tmp}, got {sorted(os.listdir(tmp))}")
    gen = {"bos_token_id": model.config.text_config.bos_token_id, "eos_token_id": eos, "pad_token_id": pad,
           "do_sample": False, "transformers_version": transformers.__version__}
    mpf.write_json(os.path.join(tmp, "generation_config.json"), gen)
    for name in PROCESSOR_FILES:
        shutil.copy(os.path.join(processor_snapshot, name), os.path.join(tmp, name))
    shutil.rmtree(snap, ignore_errors=True)
    os.replace(tmp, snap)


def pyav_frames(path: str, indices: list[int]) -> np.ndarray:
    """The sampled frames decoded with PyAV (rgb24), as mmjax.io.read_video decodes them (no resize here)."""
    out = {}
    with av.open(path) as c:
        for i, frame in enumerate(c.decode(c.streams.video[0])):
            if i in indices:
                out[i] = frame.to_ndarray(format="rgb24")
    return np.stack([out[i] for i in indices])


def greedy(model, inputs: dict, n: int):
    """Greedy ids and the top-2 margin of the logits each id was picked from."""
    with torch.no_grad():
        gen = model.generate(**inputs, max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    ids = gen.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    margins = []
    for step in gen.logits:
        top2 = torch.topk(step[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return ids, margins


def logits_along(model, inputs: dict, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids), V]: the logits that picked each of ``ids`` (one teacher-forced pass)."""
    x = dict(inputs)
    tail = torch.tensor([ids[:-1]], dtype=inputs["input_ids"].dtype)
    x["input_ids"] = torch.cat([inputs["input_ids"], tail], 1)
    x["attention_mask"] = torch.ones_like(x["input_ids"])
    x["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(tail)], 1)
    with torch.no_grad():
        return model(**x).logits[0, -len(ids):].float()


def main(processor_dir: str, out_dir: str) -> None:
    processor_snapshot = os.path.join(processor_dir, "snapshot")
    os.makedirs(out_dir, exist_ok=True)
    clip = os.path.join(out_dir, "clip.mp4")
    mpf.write_clip(clip, CLIP["frames"], CLIP["fps"], CLIP["height"], CLIP["width"], CLIP["seed"])

    frames, meta = qvu.fetch_video({"video": clip, **FRAME_OPTIONS}, return_video_sample_fps=False,
                                   return_video_metadata=True)
    frames = frames.permute(0, 2, 3, 1).numpy()
    assert np.array_equal(frames, np.round(frames))
    frames = frames.astype(np.uint8)
    md = dict(fps=float(meta["fps"]), frames_indices=[int(x) for x in meta["frames_indices"]],
              total_num_frames=int(meta["total_num_frames"]))
    other = pyav_frames(clip, md["frames_indices"])
    assert other.shape == frames.shape, (other.shape, frames.shape)
    reader_diff = int(np.abs(other.astype(int) - frames.astype(int)).max())
    # worst case for the pixel noise: every value one uint8 level off (the NumPy processor differs from the
    # torchvision one by at most one level on a few values)
    noisy = np.clip(frames.astype(int) + np.random.default_rng(0).integers(-1, 2, frames.shape), 0, 255)

    proc = transformers.AutoProcessor.from_pretrained(processor_snapshot)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def inputs_of(video):
        return dict(proc(text=[text], videos=[video], video_metadata=[md], return_tensors="pt"))

    inputs, inputs_noisy = inputs_of(frames), inputs_of(noisy.astype(np.uint8))
    tok = proc.tokenizer
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    pad = tok.convert_tokens_to_ids("<|endoftext|>")

    for seed in range(200):
        model = build_model(os.path.join(processor_snapshot, "config.json"), seed)
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = pad
        ids, margins = greedy(model, inputs, MAX_NEW_TOKENS)
        if len(ids) < MAX_NEW_TOKENS or len(set(ids)) < 4 or min(margins) < MIN_MARGIN:
            continue
        noise = (logits_along(model, inputs_noisy, ids) - logits_along(model, inputs, ids)).abs().amax(-1)
        ratio = np.asarray(margins) / np.maximum(noise.numpy(), 1e-9)
        if ratio.min() >= MIN_RATIO:
            break
    else:
        raise SystemExit("no seed in 0..199 gives comfortable margins")
    snap = os.path.join(out_dir, "snapshot")
    save_snapshot(model, processor_snapshot, snap, eos, pad)

    # the saved snapshot, loaded back by transformers, gives the same ids
    reloaded = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        snap, dtype=torch.float32, attn_implementation="eager").eval()
    assert greedy(reloaded, inputs, MAX_NEW_TOKENS)[0] == ids

    ip = proc.video_processor
    pixels = mpf.pixels_to_uint8(inputs["pixel_values_videos"].numpy(), ip.image_mean, ip.image_std,
                                 ip.temporal_patch_size, ip.patch_size)
    mpf.save_npz(os.path.join(out_dir, "expected_pixels.npz"), {"pixel_values_videos_uint8_d8": mpf.delta8(pixels, -1)})
    versions = dict(python=sys.version.split()[0], transformers=transformers.__version__, torch=torch.__version__,
                    torchvision=torchvision.__version__, tokenizers=tokenizers.__version__, av=av.__version__,
                    qwen_vl_utils=mpf._dist_version("qwen-vl-utils"), decord=mpf._dist_version("decord"))
    expected = dict(
        prompt=PROMPT, frame_options=FRAME_OPTIONS, max_new_tokens=MAX_NEW_TOKENS, seed=seed,
        initializer_range=INIT_RANGE, dtype="float32", video_metadata=md, frames_shape=list(frames.shape),
        reader_max_abs_diff_pyav_vs_decord=reader_diff, rendered_prompt=text,
        input_ids=inputs["input_ids"][0].tolist(), video_grid_thw=inputs["video_grid_thw"].tolist(),
        second_per_grid_ts=inputs["second_per_grid_ts"].tolist(),
        video_processor=dict(image_mean=list(ip.image_mean), image_std=list(ip.image_std)),
        generated_ids=ids, generated_text=proc.decode(ids, skip_special_tokens=True), greedy_top2_margins=margins,
        min_margin=min(margins), logit_shift_one_level_pixel_noise=noise.tolist(),
        min_margin_over_pixel_noise=float(ratio.min()), eos_token_id=eos, versions=versions)
    mpf.write_json(os.path.join(out_dir, "expected.json"), expected)
    mpf.atomic_write_bytes(os.path.join(out_dir, "README.md"), (
        f"Generated by tools/make_generate_fixture.py with transformers {versions['transformers']}, torch "
        f"{versions['torch']}, qwen-vl-utils {versions['qwen_vl_utils']} (decord {versions['decord']}), av "
        f"{versions['av']}: a tiny random Qwen2.5-VL snapshot with weights, a clip, and transformers' greedy ids "
        "(expected.json; pixel values in expected_pixels.npz). Regenerate with the command in the script's "
        "docstring.\n").encode("utf-8"))
    print("seed", seed, "ids", ids, "min margin", min(margins), "margin / noise", float(ratio.min()),
          "reader diff", reader_diff, "prompt tokens", inputs["input_ids"].shape[1])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} PROCESSOR_DIR OUT_DIR")
    main(sys.argv[1], sys.argv[2])
