"""Build tiny random Hugging Face LLaVA-OneVision models and write golden fixtures for tests/models.

Run with a Python that has torch + torchvision + transformers (NOT project dependencies), e.g.::

    /tmp/hfvenv/bin/python tools/make_llava_onevision_golden.py tests/models/fixtures/llava_onevision

Nothing is downloaded. The tokenizer is the tiny one of ``tests/models/fixtures/generate/snapshot`` with ``<image>``
and ``<video>`` added (ids 422 / 423). For each case it writes ``<case>/`` (a snapshot: config.json, bf16
safetensors, tokenizer and processor files) and ``<case>.npz``: the processor's outputs on random images and videos
(HF argument names; pixels rounded to float16, which the reference then uses), the raw media (uint8), the fp32
reference logits, the projected image / video features, a text-only prompt's logits and transformers' greedy
``generate`` ids (8 new tokens) for the first row alone and for the text prompt. Weights are rounded to bf16 before
the fp32 reference runs, so the bf16 checkpoint loaded in fp32 reproduces them exactly.

Cases:

* ``ov``: untied Qwen2 decoder, ``vision_feature_layer`` -1, ``anyres_max_9`` (no feature interpolation), ten
  bf16 shards with transformers 5 module names (``model.language_model.*``, ``model.vision_tower.*``); row 0 = image (anyres tiles) + video, row 1 = another image (left padded).
* ``ov_pool``: tied embeddings, ``vision_feature_layer`` [-3, -1] (concatenated), ``anyres_max_1`` (the anyres
  features are bilinearly shrunk), one ``model.safetensors`` with the published llava-hf names (``language_model.model.*``,
  ``vision_tower.vision_model.*``); row 0 holds two images
  (multi-image: no tiling, padded to square) and a video; ``single_*``: one tiled image alone (the shrink path).
* ``ov_original``: the ``ov`` weights under the original LLaVA-NeXT key names (``model.vision_tower.vision_tower.vision_model.*``,
  ``model.mm_projector.{0,2}``, ``model.image_newline``) with a LLaVA-NeXT style config.json (flat Qwen2 fields,
  ``mm_*`` keys, ``LlavaQwenForCausalLM``), no processor files and the base tokenizer (without ``<image>`` /
  ``<video>``), as LLaVA-Video-7B-Qwen2 ships; its reference is ``ov.npz``.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    AutoTokenizer,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
)
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)

TOKENIZER_DIR = os.path.join(os.path.dirname(__file__), "..", "tests", "models", "fixtures", "generate", "snapshot")
TILE = 70  # SigLIP image size: 5x5 patches of 14
PINPOINTS = [[70, 70], [70, 140], [140, 70], [140, 140], [70, 210], [210, 70], [140, 210], [210, 140]]
INIT_RANGE = 0.15
MAX_NEW = 8
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif c['type'] == 'video' %}{{ '<video>\\n' }}{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_processor(aspect_ratio="anyres_max_9"):
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tok.add_tokens(["<image>", "<video>"], special_tokens=True)
    image = LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS)
    video = LlavaOnevisionVideoProcessor(size={"height": TILE, "width": TILE})
    return LlavaOnevisionProcessor(image_processor=image, tokenizer=tok, video_processor=video,
                                   num_image_tokens=(TILE // 14) ** 2, vision_feature_select_strategy="full",
                                   chat_template=CHAT_TEMPLATE, vision_aspect_ratio=aspect_ratio)


def make_config(case, tok):
    tie = case == "ov_pool"
    return LlavaOnevisionConfig(
        text_config={"model_type": "qwen2", "vocab_size": 448, "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
                         "rope_theta": 1e6, "max_position_embeddings": 4096, "initializer_range": INIT_RANGE,
                         "tie_word_embeddings": tie, "bos_token_id": 400, "eos_token_id": 402},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 48,
                           "num_hidden_layers": 3, "num_attention_heads": 2, "image_size": TILE, "patch_size": 14,
                           "vision_use_head": False, "initializer_range": INIT_RANGE},
        image_token_index=tok.convert_tokens_to_ids("<image>"), video_token_index=tok.convert_tokens_to_ids("<video>"),
        vision_feature_layer=[-3, -1] if case == "ov_pool" else -1, vision_feature_select_strategy="full",
        image_grid_pinpoints=PINPOINTS, vision_aspect_ratio="anyres_max_1" if case == "ov_pool" else "anyres_max_9",
        tie_word_embeddings=tie, initializer_range=INIT_RANGE)


def smooth_image(rng, h, w):
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    chans = [np.sin(6 * (a * yy + b * xx) + c) for a, b, c in rng.uniform(-1, 1, (3, 3))]
    img = 127.5 * (1 + np.stack(chans, -1)) + rng.normal(0, 8, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def media(case, rng):
    if case == "ov":
        images = [smooth_image(rng, 100, 150), smooth_image(rng, 90, 60)]
        videos = [np.stack([smooth_image(rng, 50, 80) for _ in range(3)])]
        texts = ["<|im_start|>user\n<image>\nlook<video>\nwhat?<|im_end|>\n<|im_start|>assistant\n",
                 "<|im_start|>user\n<image>\nhi<|im_end|>\n<|im_start|>assistant\n"]
        image_arg = images
    else:
        images = [smooth_image(rng, 80, 50), smooth_image(rng, 64, 64)]
        videos = [np.stack([smooth_image(rng, 70, 70) for _ in range(2)])]
        texts = ["<|im_start|>user\n<image><image>\nsame?<video>\nok<|im_end|>\n<|im_start|>assistant\n"]
        image_arg = [images]  # one row with two images: multi-image mode (no tiling)
    return texts, image_arg, images, videos


def to_v5_names(key):
    """Saved names (transformers 5.23 writes the 4.x layout) -> transformers 5 module names
    (``model.language_model.*``, ``model.vision_tower.*`` without ``vision_model``, ``lm_head.weight``)."""
    if key.startswith("language_model.model."):
        return "model.language_model." + key[len("language_model.model."):]
    if key == "language_model.lm_head.weight":
        return "lm_head.weight"
    return "model." + key


def to_published_names(key):
    """Saved names -> the names of the published llava-hf checkpoints (``vision_tower.vision_model.*``)."""
    if key.startswith("vision_tower."):
        return "vision_tower.vision_model." + key[len("vision_tower."):]
    return key


def to_original_names(key):
    """Saved names -> the original LLaVA-NeXT names."""
    for old, new in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower.vision_tower.vision_model."),
                     ("multi_modal_projector.linear_1.", "model.mm_projector.0."),
                     ("multi_modal_projector.linear_2.", "model.mm_projector.2."), ("image_newline", "model.image_newline")):
        if key.startswith(old):
            return new + key[len(old):]
    raise KeyError(key)


def rename_checkpoint(ckpt, rename):
    index_path = os.path.join(ckpt, "model.safetensors.index.json")
    files = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    for name in files:
        path = os.path.join(ckpt, name)
        save_file({rename(k): v for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
        with open(index_path, "w") as f:
            json.dump(index, f, indent=1)


def original_config(hf_cfg: dict) -> dict:
    """A LLaVA-NeXT (LLaVA-Video-7B-Qwen2 style) config.json for the same model."""
    text = hf_cfg["text_config"]
    out = {k: text[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                                "bos_token_id", "eos_token_id", "tie_word_embeddings")}
    out.update(architectures=["LlavaQwenForCausalLM"], model_type="llava", rope_theta=1e6,
               mm_vision_tower="tiny-siglip", mm_projector_type="mlp2x_gelu", mm_vision_select_layer=-2,
               mm_vision_select_feature="patch", image_aspect_ratio=hf_cfg["vision_aspect_ratio"],
               image_grid_pinpoints=hf_cfg["image_grid_pinpoints"], mm_patch_merge_type="spatial_unpad",
               mm_spatial_pool_mode="bilinear", mm_spatial_pool_stride=2, mm_hidden_size=hf_cfg["vision_config"]["hidden_size"],
               image_token_index=hf_cfg["image_token_index"], video_token_index=hf_cfg["video_token_index"],
               vision_config={k: hf_cfg["vision_config"][k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                                     "num_attention_heads", "image_size", "patch_size",
                                                                     "layer_norm_eps")})
    return out


def greedy(model, inputs, prompt_len):
    gen = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=400)
    return gen[0, prompt_len:].numpy()


def build_case(case, out_dir, processor, seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    cfg = make_config(case, processor.tokenizer)
    cfg._attn_implementation = "eager"
    model = LlavaOnevisionForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ckpt = os.path.join(out_dir, case)
    shutil.rmtree(ckpt, ignore_errors=True)
    shard = "40KB" if case == "ov" else "100MB"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(ckpt, max_shard_size=shard, safe_serialization=True)
    processor.save_pretrained(ckpt)

    texts, image_arg, images, videos = media(case, rng)
    proc = processor(text=texts, images=image_arg, videos=videos, padding=True, padding_side="left",
                     return_tensors="pt")
    inputs = {k: v for k, v in proc.items()}
    for k in ("pixel_values", "pixel_values_videos"):
        inputs[k] = inputs[k].to(torch.float16).float()
    text_prompt = processor(text=["<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"],
                            return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
        logits = out.logits.float().numpy()
        img = out.image_hidden_states.float().numpy()
        vid = out.video_hidden_states.float().numpy()
        text_logits = model(**text_prompt).logits.float().numpy()
        gen_text = greedy(model, dict(text_prompt), text_prompt["input_ids"].shape[1])
        # row 0 alone, with its own media
        keep = inputs["attention_mask"][0].bool()
        row = {"input_ids": inputs["input_ids"][:1, keep], "attention_mask": inputs["attention_mask"][:1, keep]}
        n_img0 = int((row["input_ids"] == cfg.image_token_index).any())
        if case == "ov":
            row.update(pixel_values=inputs["pixel_values"][:1], image_sizes=inputs["image_sizes"][:1],
                       batch_num_images=inputs["batch_num_images"][:1])
        else:
            row.update(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"],
                       batch_num_images=inputs["batch_num_images"])
        row.update(pixel_values_videos=inputs["pixel_values_videos"][:1])
        gen_row0 = greedy(model, row, row["input_ids"].shape[1])
        step = model(**row).logits[0, -1].float().numpy()
        top2 = np.sort(step)[-2:]
    if case == "ov_pool":  # one tiled image in its row: the anyres_max_1 shrink of the tile grid
        single = processor(text=["<|im_start|>user\n<image>\nhow?<|im_end|>\n<|im_start|>assistant\n"],
                           images=[images[0]], return_tensors="pt")
        single = dict(single)
        single["pixel_values"] = single["pixel_values"].to(torch.float16).float()
        with torch.no_grad():
            s_out = model(**single)
        extra = {f"single_{k}": v.numpy() for k, v in single.items()}
        extra["single_pixel_values"] = extra["single_pixel_values"].astype(np.float16)
        extra.update(single_logits=s_out.logits.float().numpy(), single_image_features=s_out.image_hidden_states.numpy())
    else:
        extra = {}
    arrays = {k: v.numpy() for k, v in inputs.items()}
    for k in ("pixel_values", "pixel_values_videos"):
        arrays[k] = arrays[k].astype(np.float16)
    raw = {f"image_{i}": im for i, im in enumerate(images)}
    raw.update({f"video_{i}": v for i, v in enumerate(videos)})
    np.savez_compressed(
        os.path.join(out_dir, f"{case}.npz"), **arrays, **raw, **extra, texts=np.array(texts),
        multi_image=np.array(case == "ov_pool"), logits=logits.astype(np.float32), image_features=img,
        video_features=vid, text_input_ids=text_prompt["input_ids"].numpy(),
        text_logits=text_logits.astype(np.float32), generate_text_tokens=gen_text, generate_row0_tokens=gen_row0,
        generate_row0_images=np.array(n_img0), first_step_margin=np.array(top2[1] - top2[0]),
        transformers_version=np.array(transformers.__version__), torch_version=np.array(torch.__version__))
    print(case, "logits", logits.shape, "image feats", img.shape, "video feats", vid.shape, "gen", gen_row0.tolist(),
          gen_text.tolist(), "margin", float(top2[1] - top2[0]))
    if case == "ov_pool":
        rename_checkpoint(ckpt, to_published_names)
    if case == "ov":
        orig = os.path.join(out_dir, "ov_original")
        shutil.rmtree(orig, ignore_errors=True)
        shutil.copytree(ckpt, orig)
        rename_checkpoint(orig, to_original_names)
        rename_checkpoint(ckpt, to_v5_names)
        with open(os.path.join(ckpt, "config.json")) as f:
            hf_cfg = json.load(f)
        with open(os.path.join(orig, "config.json"), "w") as f:
            json.dump(original_config(hf_cfg), f, indent=1)
        for name in ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                     "chat_template.jinja", "chat_template.json"):
            if os.path.exists(os.path.join(orig, name)):
                os.remove(os.path.join(orig, name))
        for name in ("tokenizer.json", "tokenizer_config.json"):  # the base tokenizer: no <image> / <video>
            shutil.copy(os.path.join(TOKENIZER_DIR, name), os.path.join(orig, name))


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for i, case in enumerate(("ov", "ov_pool")):
        build_case(case, out_dir, make_processor("anyres_max_1" if case == "ov_pool" else "anyres_max_9"), seed=i)
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(f"Generated by tools/make_llava_onevision_golden.py with transformers {transformers.__version__}, "
                f"torch {torch.__version__}. Tiny random LLaVA-OneVision snapshots (bf16 safetensors, processor files) "
                "and reference outputs; regenerate with the command in the script's docstring.\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/models/fixtures/llava_onevision")
