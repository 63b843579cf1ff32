"""Hugging Face LLaVA-OneVision / LLaVA-Video snapshot -> ``LlavaOnevision`` (NNX) conversion.

Three tensor layouts are read (each name is mapped to one canonical name first):

* the published llava-hf checkpoints (transformers 4.x): ``language_model.model.*``, ``language_model.lm_head.*``,
  ``vision_tower.vision_model.*``, ``multi_modal_projector.linear_{1,2}.*``, ``image_newline``;
* transformers 5 module names: ``model.language_model.*``, ``model.vision_tower.*`` (with or without
  ``vision_model.``), ``model.multi_modal_projector.*``, ``model.image_newline``, ``lm_head.*``;
* the original LLaVA-NeXT names (lmms-lab LLaVA-OneVision, LLaVA-Video-7B-Qwen2): ``model.*`` (decoder),
  ``model.vision_tower.vision_tower.vision_model.*``, ``model.mm_projector.{0,2}.*``, ``model.image_newline``,
  ``lm_head.*``.

The tower's post-layernorm and pooling head, unused by the model, are skipped. Tensors are streamed: each stacked
parameter is assembled from the memory-mapped shards, moved to the device and released before the next one.
"""

from __future__ import annotations


import jax.numpy as jnp

from models import param_plan, safetensors_io
from models.llava_onevision.config import LlavaOnevisionConfig, load_hf_config
from models.llava_onevision.model import LlavaOnevision

# (prefix, canonical prefix), first match wins; canonical names: lm.*, lm_head.*, vis.*, proj.*, image_newline
_PREFIXES = (
    ("model.vision_tower.vision_tower.vision_model.", "vis."), ("model.vision_tower.vision_model.", "vis."),
    ("model.vision_tower.", "vis."), ("vision_tower.vision_model.", "vis."), ("vision_tower.", "vis."),
    ("model.multi_modal_projector.linear_1.", "proj.1."), ("model.multi_modal_projector.linear_2.", "proj.2."),
    ("multi_modal_projector.linear_1.", "proj.1."), ("multi_modal_projector.linear_2.", "proj.2."),
    ("model.mm_projector.0.", "proj.1."), ("model.mm_projector.2.", "proj.2."),
    ("model.image_newline", "image_newline"), ("image_newline", "image_newline"),
    ("model.language_model.", "lm."), ("language_model.model.", "lm."), ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."), ("model.", "lm."),
)
_SKIPPED = ("vis.post_layernorm.", "vis.head.")


def canonical_name(key: str) -> str:
    """Map every supported layout's tensor name to ``lm.*``, ``lm_head.*``, ``vis.*``, ``proj.{1,2}.*`` or
    ``image_newline``."""
    for old, new in _PREFIXES:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def _ident(w):
    return w


def _text_table(cfg: LlavaOnevisionConfig):
    c = cfg.text
    H, N, K, D, F = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    lin = lambda *shape: (lambda w: w.T.reshape(shape))
    p = "lm.layers.{i}."
    return {
        "input_norm": (p + "input_layernorm.weight", (H,), _ident),
        "wq": (p + "self_attn.q_proj.weight", (N * D, H), lin(H, N, D)),
        "bq": (p + "self_attn.q_proj.bias", (N * D,), lambda b: b.reshape(N, D)),
        "wk": (p + "self_attn.k_proj.weight", (K * D, H), lin(H, K, D)),
        "bk": (p + "self_attn.k_proj.bias", (K * D,), lambda b: b.reshape(K, D)),
        "wv": (p + "self_attn.v_proj.weight", (K * D, H), lin(H, K, D)),
        "bv": (p + "self_attn.v_proj.bias", (K * D,), lambda b: b.reshape(K, D)),
        "wo": (p + "self_attn.o_proj.weight", (H, N * D), lin(N, D, H)),
        "post_norm": (p + "post_attention_layernorm.weight", (H,), _ident),
        "w_gate": (p + "mlp.gate_proj.weight", (F, H), lin(H, F)),
        "w_up": (p + "mlp.up_proj.weight", (F, H), lin(H, F)),
        "w_down": (p + "mlp.down_proj.weight", (H, F), lin(F, H)),
    }


def _text_single(cfg: LlavaOnevisionConfig):
    c = cfg.text
    out = {"embed": ("lm.embed_tokens.weight", (c.vocab_size, c.hidden_size), _ident),
           "final_norm": ("lm.norm.weight", (c.hidden_size,), _ident)}
    if not c.tie_word_embeddings:
        out["lm_head"] = ("lm_head.weight", (c.vocab_size, c.hidden_size), _ident)
    return out


def _vision_table(cfg: LlavaOnevisionConfig):
    v = cfg.vision
    C, N, D, F = v.hidden_size, v.num_attention_heads, v.head_dim, v.intermediate_size
    p = "vis.encoder.layers.{i}."
    heads_in = lambda w: w.T.reshape(C, N, D)
    return {
        "ln1_w": (p + "layer_norm1.weight", (C,), _ident), "ln1_b": (p + "layer_norm1.bias", (C,), _ident),
        "wq": (p + "self_attn.q_proj.weight", (C, C), heads_in),
        "bq": (p + "self_attn.q_proj.bias", (C,), lambda b: b.reshape(N, D)),
        "wk": (p + "self_attn.k_proj.weight", (C, C), heads_in),
        "bk": (p + "self_attn.k_proj.bias", (C,), lambda b: b.reshape(N, D)),
        "wv": (p + "self_attn.v_proj.weight", (C, C), heads_in),
        "bv": (p + "self_attn.v_proj.bias", (C,), lambda b: b.reshape(N, D)),
        "wo": (p + "self_attn.out_proj.weight", (C, C), lambda w: w.T.reshape(N, D, C)),
        "bo": (p + "self_attn.out_proj.bias", (C,), _ident),
        "ln2_w": (p + "layer_norm2.weight", (C,), _ident), "ln2_b": (p + "layer_norm2.bias", (C,), _ident),
        "fc1_w": (p + "mlp.fc1.weight", (F, C), lambda w: w.T), "fc1_b": (p + "mlp.fc1.bias", (F,), _ident),
        "fc2_w": (p + "mlp.fc2.weight", (C, F), lambda w: w.T), "fc2_b": (p + "mlp.fc2.bias", (C,), _ident),
    }


def _vision_single(cfg: LlavaOnevisionConfig):
    v, H = cfg.vision, cfg.text.hidden_size
    C, k = v.hidden_size, len(cfg.vision_feature_layers)
    out = {
        "patch_w": ("vis.embeddings.patch_embedding.weight", (C, v.num_channels, v.patch_size, v.patch_size),
                    lambda w: w.reshape(C, -1).T),
        "patch_b": ("vis.embeddings.patch_embedding.bias", (C,), _ident),
        "pos_embed": ("vis.embeddings.position_embedding.weight", (v.grid ** 2, C), _ident),
        "proj1_w": ("proj.1.weight", (H, C * k), lambda w: w.T), "proj2_w": ("proj.2.weight", (H, H), lambda w: w.T),
        "image_newline": ("image_newline", (H,), _ident),
    }
    if cfg.projector_bias:
        out.update(proj1_b=("proj.1.bias", (H,), _ident), proj2_b=("proj.2.bias", (H,), _ident))
    return out


def _plan(cfg: LlavaOnevisionConfig) -> list[param_plan.PlanEntry]:
    """[(module attr, param name, [canonical keys], hf shape, transform, stacked)]"""
    return param_plan.build_plan([("language_model", _text_table(cfg), cfg.text.num_hidden_layers),
                                  ("vision", _vision_table(cfg), cfg.vision.num_hidden_layers)],
                                 [("language_model", _text_single(cfg)), ("vision", _vision_single(cfg))])


def check_keys(cfg: LlavaOnevisionConfig, tensors: dict[str, safetensors_io.TensorInfo]) -> dict[str, str]:
    """Validate names and shapes; returns canonical name -> original name. Raises ValueError listing missing
    keys, unexpected keys and shape mismatches by name (a tied ``lm_head.weight`` of the embedding's shape, the
    tower's post-layernorm / head and rotary ``inv_freq`` buffers are tolerated)."""
    return param_plan.check_keys(
        _plan(cfg), tensors, canonical_name,
        lambda k: (k.startswith(_SKIPPED) or k.endswith(".inv_freq")
                   or (cfg.text.tie_word_embeddings and k == "lm_head.weight")))


def from_hf(path: str, dtype=jnp.bfloat16, mesh=None) -> LlavaOnevision:
    """Load a local snapshot (config.json + safetensors, one file or shards with an index; transformers' or the
    original LLaVA-NeXT layout) into a ``LlavaOnevision``; ``path`` is a snapshot directory or a hub-cache model
    tree (``models.snapshot``). ``dtype``: parameter dtype (None keeps each tensor's stored dtype). ``mesh``: a
    ``jax.sharding.Mesh`` (axes "tp" / "sp"): each parameter goes straight into its layout (`models.sharding`)."""
    return param_plan.load_snapshot(path, load_config=load_hf_config, check_keys=check_keys,
                                    model_cls=LlavaOnevision, plan=_plan, dtype=dtype, mesh=mesh)
