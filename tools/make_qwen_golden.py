"""Build tiny random Hugging Face Qwen2.5-VL models and write golden fixtures for tests/models.

Run with a Python that has torch + transformers (NOT a project dependency), e.g.::

    python -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers safetensors
    /tmp/hfvenv/bin/python tools/make_qwen_golden.py tests/models/fixtures

For each case it writes ``<case>/`` (config.json, sharded bf16 safetensors + index) and
``<case>.npz`` with the inputs (HF processor argument names), HF reference logits (fp32 and bf16),
vision features, M-RoPE position ids / deltas and greedy ``generate`` tokens. Weights are rounded to
bf16 before the fp32 reference runs, so loading the bf16 checkpoint in fp32 reproduces them exactly.
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
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

IMG, VID, VS, VE = 250, 251, 252, 253


def make_config(*, tie: bool, vision_depth: int, fullatt: list[int]):
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                         max_position_embeddings=4096, initializer_range=0.15, tie_word_embeddings=tie),
        vision_config=dict(depth=vision_depth, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=fullatt, window_size=56, tokens_per_second=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=0.15),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
        tie_word_embeddings=tie)


def span(token, grid):
    t, h, w = grid
    return [VS] + [token] * (t * h * w // 4) + [VE]


def pixels(rng, grids):
    n = sum(t * h * w for t, h, w in grids)
    return rng.standard_normal((n, 3 * 2 * 14 * 14)).astype(np.float16).astype(np.float32)


def build_inputs(case, rng):
    """Token rows (left padded with 0), grids and pixels. Rows interleave text, images and videos."""
    if case == "vl_nested":
        img_grids = [(1, 4, 6), (1, 4, 4)]
        vid_grids = [(3, 6, 4), (2, 4, 4)]
        spg = [1.5, 0.5]
        row0 = [1, 2, 3] + span(IMG, img_grids[0]) + [4, 5] + span(VID, vid_grids[0]) + [6, 7, 8]
        row1 = [9] + span(VID, vid_grids[1]) + [10, 11] + span(IMG, img_grids[1]) + [12]
    elif case == "vl_flat_tied":
        img_grids = [(1, 4, 4)]
        vid_grids = [(2, 4, 8)]
        spg = [1.0]
        row0 = [5, 6] + span(VID, vid_grids[0]) + [7] + span(IMG, img_grids[0]) + [8, 9, 10]
        row1 = None
    else:
        raise ValueError(case)
    rows = [row0] + ([row1] if row1 is not None else [])
    t = max(len(r) for r in rows)
    ids = np.zeros((len(rows), t), np.int64)
    mask = np.zeros((len(rows), t), np.int64)
    for i, r in enumerate(rows):
        ids[i, t - len(r):] = r
        mask[i, t - len(r):] = 1
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels(rng, img_grids),
                image_grid_thw=np.array(img_grids, np.int64), pixel_values_videos=pixels(rng, vid_grids),
                video_grid_thw=np.array(vid_grids, np.int64), second_per_grid_ts=np.array(spg, np.float32))


def to_torch(inputs):
    out = {k: torch.from_numpy(v) for k, v in inputs.items()}
    ids = out["input_ids"]
    out["mm_token_type_ids"] = torch.where(ids == IMG, 1, torch.where(ids == VID, 2, 0)).int()
    return out


def rename_tensors(ckpt_dir, rename):
    """Rename every tensor of a sharded safetensors checkpoint (shards and index) with ``rename``."""
    from safetensors.torch import load_file, save_file
    index_path = os.path.join(ckpt_dir, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    for shard in sorted(set(index["weight_map"].values())):
        path = os.path.join(ckpt_dir, shard)
        tensors = load_file(path)
        save_file({rename(k): v for k, v in tensors.items()}, path, metadata={"format": "pt"})
    index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
    with open(index_path, "w") as f:
        json.dump(index, f, indent=1)


def to_new_layout(key):
    """``visual.*`` -> ``model.visual.*``; ``model.*`` -> ``model.language_model.*`` (transformers 5 names)."""
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model."):
        return "model.language_model." + key[len("model."):]
    return key


def to_legacy_layout(key):
    return key.replace("model.visual.", "visual.").replace("model.language_model.", "model.")


def flatten_config(ckpt_dir):
    """Rewrite config.json into the transformers-4.x layout: flat text fields, ``rope_scaling`` with
    ``type: mrope``, ``in_chans``."""
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    for k, v in text.items():
        cfg.setdefault(k, v)
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    cfg["vision_config"]["in_chans"] = cfg["vision_config"].pop("in_channels")
    with open(os.path.join(ckpt_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def build_case(case, out_dir, seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tie = case == "vl_flat_tied"
    cfg = make_config(tie=tie, vision_depth=4 if case == "vl_nested" else 2, fullatt=[1, 3] if case == "vl_nested" else [1])
    cfg._attn_implementation = "eager"
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ckpt = os.path.join(out_dir, case)
    shutil.rmtree(ckpt, ignore_errors=True)
    # save a bf16 copy: casting `model` itself would also round its fp32 rotary inv_freq buffers
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(ckpt, max_shard_size="200KB", safe_serialization=True)
    if not os.path.exists(os.path.join(ckpt, "model.safetensors.index.json")):
        raise RuntimeError("expected a sharded checkpoint")
    if case == "vl_flat_tied":
        flatten_config(ckpt)
        rename_tensors(ckpt, to_legacy_layout)
    else:
        rename_tensors(ckpt, to_new_layout)

    inputs = build_inputs(case, rng)
    tin = to_torch(inputs)
    with torch.no_grad():
        ref = model(**tin, output_hidden_states=True)
        logits = ref.logits.float().numpy()
        hidden = np.stack([h.float().numpy() for h in ref.hidden_states])  # [L + 1, B, T, H]
        pos, deltas = model.model.get_rope_index(tin["input_ids"], tin["mm_token_type_ids"],
                                                 image_grid_thw=tin["image_grid_thw"],
                                                 video_grid_thw=tin["video_grid_thw"],
                                                 second_per_grid_ts=tin["second_per_grid_ts"],
                                                 attention_mask=tin["attention_mask"])
        img = torch.cat(model.model.get_image_features(tin["pixel_values"], tin["image_grid_thw"]).pooler_output).numpy()
        vid = torch.cat(model.model.get_video_features(tin["pixel_values_videos"],
                                                       tin["video_grid_thw"]).pooler_output).numpy()
        # greedy generation from the first row alone (its own images / videos)
        row = {k: v[:1] for k, v in tin.items() if k in ("input_ids", "attention_mask", "mm_token_type_ids")}
        n_img0 = 1
        n_vid0 = 1
        row.update(image_grid_thw=tin["image_grid_thw"][:n_img0], video_grid_thw=tin["video_grid_thw"][:n_vid0],
                   second_per_grid_ts=tin["second_per_grid_ts"][:n_vid0])
        npix_i = int(tin["image_grid_thw"][:n_img0].prod(-1).sum())
        npix_v = int(tin["video_grid_thw"][:n_vid0].prod(-1).sum())
        row.update(pixel_values=tin["pixel_values"][:npix_i], pixel_values_videos=tin["pixel_values_videos"][:npix_v])
        keep = row["attention_mask"][0].bool()
        for k in ("input_ids", "attention_mask", "mm_token_type_ids"):
            row[k] = row[k][:, keep]
        gen = model.generate(**row, max_new_tokens=8, do_sample=False, pad_token_id=0)
        gen_tokens = gen[0, row["input_ids"].shape[1]:].numpy()
        step_logits = model(**row).logits[0, -1].float().numpy()
        top2 = np.sort(step_logits)[-2:]
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.bfloat16,
                                                                   attn_implementation="eager").eval()
        logits_bf16 = model(**{k: (v.to(torch.bfloat16) if v.is_floating_point() and k.startswith("pixel") else v)
                               for k, v in tin.items()}).logits.float().numpy()
    np.savez_compressed(
        os.path.join(out_dir, f"{case}.npz"),
        **{k: (v.astype(np.float16) if k.startswith("pixel") else v) for k, v in inputs.items()},
        logits=logits.astype(np.float32), logits_bf16=logits_bf16.astype(np.float32),
        hidden_states=hidden.astype(np.float32), image_features=img.astype(np.float32), video_features=vid.astype(np.float32),
        position_ids=pos.numpy(), rope_deltas=deltas.numpy().reshape(-1),
        generate_row0_tokens=gen_tokens, generate_row0_prompt_len=np.array(row["input_ids"].shape[1]),
        first_step_margin=np.array(top2[1] - top2[0]),
        transformers_version=np.array(transformers.__version__), torch_version=np.array(torch.__version__),
    )
    print(case, "logits", logits.shape, "gen", gen_tokens.tolist(), "margin", float(top2[1] - top2[0]))


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    build_case("vl_nested", out_dir, seed=0)
    build_case("vl_flat_tied", out_dir, seed=1)
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(f"Generated by tools/make_qwen_golden.py with transformers {transformers.__version__}, "
                f"torch {torch.__version__}. Tiny random Qwen2.5-VL models (bf16 sharded safetensors) and "
                f"reference outputs; regenerate with the command in the script's docstring.\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/models/fixtures")
