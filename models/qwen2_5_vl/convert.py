"""Hugging Face Qwen2.5-VL snapshot -> ``Qwen2_5_VL`` (NNX) conversion.

Accepts both tensor layouts: ``visual.*`` / ``model.*`` (transformers 4.x) and ``model.visual.*`` /
``model.language_model.*`` (transformers 5). Tensors are streamed: each stacked parameter is
assembled from memory-mapped shards, moved to the device and released before the next one.
"""

from __future__ import annotations


import jax.numpy as jnp

from models import param_plan, safetensors_io
from models.qwen2_5_vl.config import Qwen2_5_VLConfig, load_hf_config
from models.qwen2_5_vl.model import Qwen2_5_VL


def canonical_name(key: str) -> str:
    """Map both HF layouts to ``visual.*``, ``lm.*`` and ``lm_head.*``."""
    for old, new in (("model.visual.", "visual."), ("model.language_model.", "lm."), ("visual.", "visual."),
                     ("model.", "lm.")):
        if key.startswith(old):
            return new + key[len(old):]
    return key


# target name -> (HF name template with {i} for the layer, HF shape, transform to the target per-layer shape)
def _text_table(cfg: Qwen2_5_VLConfig):
    c = cfg.text
    H, N, K, D, F = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    lin = lambda *shape: (lambda w: w.T.reshape(shape))
    ident = lambda w: w
    return {
        "input_norm": ("lm.layers.{i}.input_layernorm.weight", (H,), ident),
        "wq": ("lm.layers.{i}.self_attn.q_proj.weight", (N * D, H), lin(H, N, D)),
        "bq": ("lm.layers.{i}.self_attn.q_proj.bias", (N * D,), lambda b: b.reshape(N, D)),
        "wk": ("lm.layers.{i}.self_attn.k_proj.weight", (K * D, H), lin(H, K, D)),
        "bk": ("lm.layers.{i}.self_attn.k_proj.bias", (K * D,), lambda b: b.reshape(K, D)),
        "wv": ("lm.layers.{i}.self_attn.v_proj.weight", (K * D, H), lin(H, K, D)),
        "bv": ("lm.layers.{i}.self_attn.v_proj.bias", (K * D,), lambda b: b.reshape(K, D)),
        "wo": ("lm.layers.{i}.self_attn.o_proj.weight", (H, N * D), lin(N, D, H)),
        "post_norm": ("lm.layers.{i}.post_attention_layernorm.weight", (H,), ident),
        "w_gate": ("lm.layers.{i}.mlp.gate_proj.weight", (F, H), lin(H, F)),
        "w_up": ("lm.layers.{i}.mlp.up_proj.weight", (F, H), lin(H, F)),
        "w_down": ("lm.layers.{i}.mlp.down_proj.weight", (H, F), lin(F, H)),
    }


def _text_single(cfg: Qwen2_5_VLConfig):
    c = cfg.text
    out = {"embed": ("lm.embed_tokens.weight", (c.vocab_size, c.hidden_size), lambda w: w),
           "final_norm": ("lm.norm.weight", (c.hidden_size,), lambda w: w)}
    if not c.tie_word_embeddings:
        out["lm_head"] = ("lm_head.weight", (c.vocab_size, c.hidden_size), lambda w: w)
    return out


def _vision_table(cfg: Qwen2_5_VLConfig):
    v = cfg.vision
    C, N, D, F = v.hidden_size, v.num_heads, v.head_dim, v.intermediate_size
    ident = lambda w: w
    p = "visual.blocks.{i}."
    return {
        "norm1": (p + "norm1.weight", (C,), ident), "norm2": (p + "norm2.weight", (C,), ident),
        "wqkv": (p + "attn.qkv.weight", (3 * C, C), lambda w: w.T.reshape(C, 3, N, D)),
        "bqkv": (p + "attn.qkv.bias", (3 * C,), lambda b: b.reshape(3, N, D)),
        "wproj": (p + "attn.proj.weight", (C, C), lambda w: w.T.reshape(N, D, C)),
        "bproj": (p + "attn.proj.bias", (C,), ident),
        "w_gate": (p + "mlp.gate_proj.weight", (F, C), lambda w: w.T), "b_gate": (p + "mlp.gate_proj.bias", (F,), ident),
        "w_up": (p + "mlp.up_proj.weight", (F, C), lambda w: w.T), "b_up": (p + "mlp.up_proj.bias", (F,), ident),
        "w_down": (p + "mlp.down_proj.weight", (C, F), lambda w: w.T), "b_down": (p + "mlp.down_proj.bias", (C,), ident),
    }


def _vision_single(cfg: Qwen2_5_VLConfig):
    v = cfg.vision
    C, M = v.hidden_size, v.merge_unit * v.hidden_size
    conv = (C, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    return {
        "patch_embed": ("visual.patch_embed.proj.weight", conv, lambda w: w.reshape(C, -1).T),
        "merger_norm": ("visual.merger.ln_q.weight", (C,), lambda w: w),
        "merger_w1": ("visual.merger.mlp.0.weight", (M, M), lambda w: w.T),
        "merger_b1": ("visual.merger.mlp.0.bias", (M,), lambda w: w),
        "merger_w2": ("visual.merger.mlp.2.weight", (v.out_hidden_size, M), lambda w: w.T),
        "merger_b2": ("visual.merger.mlp.2.bias", (v.out_hidden_size,), lambda w: w),
    }


def _plan(cfg: Qwen2_5_VLConfig) -> list[param_plan.PlanEntry]:
    """[(module attr, param name, [hf keys], hf shape, transform, stacked)]"""
    return param_plan.build_plan([("language_model", _text_table(cfg), cfg.text.num_hidden_layers),
                                  ("visual", _vision_table(cfg), cfg.vision.depth)],
                                 [("language_model", _text_single(cfg)), ("visual", _vision_single(cfg))])


def check_keys(cfg: Qwen2_5_VLConfig, tensors: dict[str, safetensors_io.TensorInfo]) -> dict[str, str]:
    """Validate names and shapes; returns canonical name -> original name.

    Raises ValueError listing missing keys, unexpected keys and shape mismatches by name. With tied
    embeddings an ``lm_head.weight`` equal in shape to the embedding is tolerated (some exports keep it).
    """
    return param_plan.check_keys(_plan(cfg), tensors, canonical_name,
                                 lambda k: cfg.text.tie_word_embeddings and k == "lm_head.weight")


def from_hf(path: str, dtype=jnp.bfloat16, mesh=None) -> Qwen2_5_VL:
    """Load a local HF snapshot (config.json + safetensors, one file or shards with an index) into a
    ``Qwen2_5_VL``; ``path`` is a snapshot directory or a hub-cache model tree (``models.snapshot``).

    ``dtype``: parameter dtype (bf16 keeps the checkpoint's precision); None keeps each tensor's
    stored dtype. Peak host memory is about one stacked parameter beyond the memory-mapped files.
    ``mesh``: a ``jax.sharding.Mesh`` (axes "tp" / "sp"): each parameter goes straight into its layout
    (`models.sharding`), every device receiving only its own slice.
    """
    return param_plan.load_snapshot(path, load_config=load_hf_config, check_keys=check_keys, model_cls=Qwen2_5_VL,
                                    plan=_plan, dtype=dtype, mesh=mesh)
