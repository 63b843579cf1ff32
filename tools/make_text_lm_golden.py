"""Build tiny random Hugging Face Llama / Qwen3 / Qwen3-MoE models and write golden fixtures for
tests/models/test_text_lm_golden.py.

Run with a Python that has torch + transformers (NOT project dependencies), e.g.::

    /tmp/hfvenv/bin/python tools/make_text_lm_golden.py tests/models/fixtures/text_lm [PROCESSOR_SNAPSHOT [CASE ...]]

For each case it writes ``<case>/`` (config.json, bf16 safetensors, generation_config.json, and the tokenizer /
chat-template files of tests/models/fixtures/processor/snapshot, so ``mmjax.load`` finds a processor) and
``<case>.npz`` with the inputs (two rows, the second left padded), transformers' logits (fp32 and bf16 compute),
hidden states (``output_hidden_states``), and greedy ``generate`` tokens of row 0 with the smallest top-2 logit
margin over its steps (the first seed whose margin is at least ``MIN_MARGIN`` is kept). The fp32 reference runs
with ``position_ids = cumsum(attention_mask) - 1`` (0 at padding), the rule of transformers' ``generate`` and
mmjax's default. Weights are rounded to bf16 before the fp32 reference runs, so loading the bf16 checkpoint in
fp32 reproduces them exactly.

Cases (each a different checkpoint style):

* ``llama``: GQA, llama3 rope scaling (all three frequency bands), untied head; transformers 5 config.json,
  sharded safetensors with an index.
* ``llama_tied_bias``: tied embeddings, ``attention_bias`` (q/k/v/o biases), default rope; the config.json layout
  the published checkpoints ship (top-level ``rope_theta``, ``rope_scaling``), one ``model.safetensors``.
* ``qwen3``: q/k RMSNorm, ``head_dim`` != hidden / heads, tied, YaRN rope scaling (factor 4, as Qwen3 runs
  128k contexts; extrapolated, blended and interpolated frequencies, attention factor); sharded.
* ``qwen3_moe``: 8 experts, 2 per token, ``norm_topk_prob``; experts one tensor each as the published
  Qwen3-MoE checkpoints ship them (``mlp.experts.{e}.gate_proj.weight``; transformers 5 writes them so); sharded.
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
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

VOCAB = 448  # the tokenizer of tests/models/fixtures/processor/snapshot
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.json")
INIT_RANGE = 0.15
MAX_NEW_TOKENS = 8
MIN_MARGIN = 0.02  # smallest top-2 logit margin over the greedy steps; JAX and torch float32 agree to ~1e-5
LENGTHS = (19, 12)

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, initializer_range=INIT_RANGE, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)


def make_model(case: str):
    if case == "llama":
        cfg = LlamaConfig(**COMMON, rms_norm_eps=1e-5, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})
        cls = LlamaForCausalLM
    elif case == "llama_tied_bias":
        cfg = LlamaConfig(**COMMON, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = LlamaForCausalLM
    elif case == "qwen3":
        cfg = Qwen3Config(**COMMON, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 64})
        cls = Qwen3ForCausalLM
    elif case == "qwen3_moe":
        cfg = Qwen3MoeConfig(**COMMON, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False,
                             moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cfg._experts_implementation = "eager"
        cls = Qwen3MoeForCausalLM
    else:
        raise ValueError(case)
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def build_inputs(rng):
    t = max(LENGTHS)
    ids = np.zeros((len(LENGTHS), t), np.int64)
    mask = np.zeros((len(LENGTHS), t), np.int64)
    for i, n in enumerate(LENGTHS):
        ids[i, t - n:] = rng.integers(3, VOCAB, n)
        mask[i, t - n:] = 1
    return ids, mask


def positions(mask):
    return np.where(mask > 0, np.cumsum(mask, -1) - 1, 0)


def published_config_layout(ckpt):
    """transformers 5's ``rope_parameters`` -> top-level ``rope_theta`` (+ ``rope_scaling`` when not default)."""
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)


def save_snapshot(model, case, ckpt, processor_snapshot):
    shutil.rmtree(ckpt, ignore_errors=True)
    sharded = case != "llama_tied_bias"
    # a bf16 copy: casting `model` itself would also round its fp32 rotary inv_freq buffers
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(ckpt, max_shard_size="100KB" if sharded else "50GB",
                                                            safe_serialization=True)
    has_index = os.path.exists(os.path.join(ckpt, "model.safetensors.index.json"))
    if has_index != sharded:
        raise RuntimeError(f"{case}: expected {'a sharded' if sharded else 'one-file'} checkpoint")
    if case == "qwen3_moe":
        with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
            names = json.load(f)["weight_map"]
        if "model.layers.0.mlp.experts.0.gate_proj.weight" not in names:
            raise RuntimeError("expected save_pretrained to write one tensor per expert (the published layout)")
    if case == "llama_tied_bias":
        published_config_layout(ckpt)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(processor_snapshot, name), os.path.join(ckpt, name))
    for name in os.listdir(ckpt):
        os.chmod(os.path.join(ckpt, name), 0o644)


def build_case(case, out_dir, processor_snapshot, first_seed):
    """The first seed from ``first_seed`` whose greedy steps all keep a top-2 margin of ``MIN_MARGIN``."""
    for seed in range(first_seed, first_seed + 50):
        if try_seed(case, out_dir, processor_snapshot, seed) >= MIN_MARGIN:
            return
    raise RuntimeError(f"{case}: no seed with a greedy margin of {MIN_MARGIN}")


def try_seed(case, out_dir, processor_snapshot, seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = make_model(case)
    ckpt = os.path.join(out_dir, case)
    save_snapshot(model, case, ckpt, processor_snapshot)
    ids, mask = build_inputs(rng)
    pos = positions(mask)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                    position_ids=torch.from_numpy(pos), output_hidden_states=True)
        logits = ref.logits.float().numpy()
        hidden = np.stack([h.float().numpy() for h in ref.hidden_states])  # [L + 1, B, T, H]
        row = torch.from_numpy(ids[:1, -LENGTHS[0]:])
        gen = model.generate(input_ids=row, attention_mask=torch.ones_like(row), max_new_tokens=MAX_NEW_TOKENS,
                             do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                             eos_token_id=None)
        tokens = gen.sequences[0, row.shape[1]:].numpy()
        top2 = [np.sort(s[0].float().numpy())[-2:] for s in gen.scores]
        margin = min(float(b - a) for a, b in top2)
        bf16 = type(model).from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="eager").eval()
        if case == "qwen3_moe":
            bf16.config._experts_implementation = "eager"
        logits_bf16 = bf16(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                           position_ids=torch.from_numpy(pos)).logits.float().numpy()
    np.savez_compressed(os.path.join(out_dir, f"{case}.npz"), input_ids=ids, attention_mask=mask,
                        logits=logits.astype(np.float32), logits_bf16=logits_bf16.astype(np.float32),
                        hidden_states=hidden.astype(np.float32), generate_row0_tokens=tokens,
                        generate_row0_prompt_len=np.array(LENGTHS[0]), generate_min_margin=np.array(margin),
                        transformers_version=np.array(transformers.__version__),
                        torch_version=np.array(torch.__version__))
    print(case, "seed", seed, "logits", logits.shape, "gen", tokens.tolist(), "min margin", round(margin, 4))
    return margin


CASES = ("llama", "llama_tied_bias", "qwen3", "qwen3_moe")


def main(out_dir, processor_snapshot, cases=CASES):
    os.makedirs(out_dir, exist_ok=True)
    for case in cases:
        build_case(case, out_dir, processor_snapshot, 100 * CASES.index(case))
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(f"Generated by tools/make_text_lm_golden.py with transformers {transformers.__version__}, "
                f"torch {torch.__version__}. Tiny random Llama / Qwen3 / Qwen3-MoE models (bf16 safetensors; the "
                f"tokenizer files are the tiny Qwen tokenizer of ../processor/snapshot) and reference outputs; "
                f"regenerate with the command in the script's docstring.\n")


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/models/fixtures/text_lm",
         sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "..", "tests", "models", "fixtures", "processor",
                                                            "snapshot"),
         tuple(sys.argv[3:]) or CASES)
