"""HF snapshot conversion: key layouts, error reporting, config defaults, presets, orbax round trip."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from models import safetensors_io
from models.qwen2_5_vl import Qwen2_5_VL, config_from_hf, forward, from_hf, load, preset, save
from models.qwen2_5_vl.convert import canonical_name
from tests.models.conftest import FIXTURES, get_model, load_case


def _rewrite(tmp_path, case, edit):
    """Copy a fixture checkpoint into one float32 model.safetensors (no index) after ``edit(dict)``."""
    src = os.path.join(FIXTURES, case)
    tensors = {k: np.asarray(safetensors_io.load(info), np.float32)
               for k, info in safetensors_io.index_checkpoint(src).items()}
    edit(tensors)
    dst = tmp_path / case
    dst.mkdir()
    shutil.copy(os.path.join(src, "config.json"), dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_both_layouts_and_single_file_load_identically(tmp_path):
    assert canonical_name("model.language_model.layers.0.mlp.up_proj.weight") == "lm.layers.0.mlp.up_proj.weight"
    assert canonical_name("model.layers.0.mlp.up_proj.weight") == "lm.layers.0.mlp.up_proj.weight"
    assert canonical_name("model.visual.merger.ln_q.weight") == canonical_name("visual.merger.ln_q.weight")
    # vl_nested uses the transformers-5 names; rewrite it into the 4.x names in one unsharded file
    legacy = _rewrite(tmp_path, "vl_nested", lambda t: t.update(
        {k.replace("model.visual.", "visual.").replace("model.language_model.", "model."): t.pop(k)
         for k in list(t)}))
    a, b = get_model("vl_nested"), from_hf(legacy, dtype=jnp.float32)
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_missing_unexpected_and_mismatched_keys_are_named(tmp_path):
    def edit(t):
        del t["model.language_model.layers.1.self_attn.k_proj.bias"]
        t["model.visual.blocks.0.extra.weight"] = np.zeros((2,), np.float32)
        t["model.visual.blocks.1.norm2.weight"] = np.zeros((5,), np.float32)
    path = _rewrite(tmp_path, "vl_nested", edit)
    with pytest.raises(ValueError) as err:
        from_hf(path)
    msg = str(err.value)
    assert "lm.layers.1.self_attn.k_proj.bias" in msg
    assert "model.visual.blocks.0.extra.weight" in msg
    assert "model.visual.blocks.1.norm2.weight: expected (32,), got (5,)" in msg


def test_missing_shard_and_missing_dir_raise(tmp_path):
    dst = tmp_path / "broken"
    shutil.copytree(os.path.join(FIXTURES, "vl_nested"), dst)
    shards = sorted(p for p in os.listdir(dst) if p.endswith(".safetensors"))
    os.remove(dst / shards[0])
    with pytest.raises(ValueError, match=shards[0]):
        from_hf(str(dst))
    with pytest.raises(ValueError, match="path"):
        from_hf(str(tmp_path / "nope"))


def test_dtypes():
    m = from_hf(os.path.join(FIXTURES, "vl_flat_tied"))
    assert m.language_model.wq[...].dtype == jnp.bfloat16 and m.visual.patch_embed[...].dtype == jnp.bfloat16
    kept = from_hf(os.path.join(FIXTURES, "vl_flat_tied"), dtype=None)
    assert kept.language_model.embed[...].dtype == jnp.bfloat16
    assert m.language_model.lm_head is None  # tied


def test_config_nested_and_flat_agree_and_defaults():
    with open(os.path.join(FIXTURES, "vl_flat_tied", "config.json")) as f:
        flat = json.load(f)
    cfg = config_from_hf(flat)
    assert cfg.text.mrope_section == (2, 3, 3) and cfg.text.rope_theta == 1e6 and cfg.text.tie_word_embeddings
    assert cfg.vision.in_channels == 3 and cfg.vision.fullatt_block_indexes == (1,)
    nested = {"text_config": {k: flat[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                   "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                                   "rms_norm_eps", "max_position_embeddings")},
              "vision_config": flat["vision_config"], "tie_word_embeddings": True,
              "image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253}
    nested["text_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    assert config_from_hf(nested) == cfg
    # transformers' defaults when fields are absent
    d = config_from_hf({"vision_config": {"out_hidden_size": 8192}})
    assert (d.text.hidden_size, d.text.num_hidden_layers, d.text.num_key_value_heads, d.text.rms_norm_eps) == \
        (8192, 80, 8, 1e-5)
    assert d.text.mrope_section == (16, 24, 24) and d.vision.depth == 32 and d.vision.window_size == 112
    assert d.image_token_id == 151655 and d.vision.rope_theta == 10000.0 and d.max_position_embeddings == 128000
    assert cfg.max_position_embeddings == 4096


@pytest.mark.parametrize("name,params", [("7b", 8_292_166_656), ("3b", 3_754_622_976)])
def test_presets_have_published_parameter_counts(name, params):
    model = nnx.eval_shape(lambda: Qwen2_5_VL(preset(name), dtype=jnp.bfloat16, key=jax.random.key(0)))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == params


def test_orbax_save_load_round_trip(tmp_path):
    model = from_hf(os.path.join(FIXTURES, "vl_flat_tied"), dtype=jnp.float32)
    save(model, str(tmp_path / "ckpt"))
    back = load(str(tmp_path / "ckpt"))
    assert back.config == model.config
    inputs, d = load_case("vl_flat_tied")
    np.testing.assert_array_equal(np.asarray(forward(back, **inputs)), np.asarray(forward(model, **inputs)))
    with pytest.raises(FileNotFoundError, match=r"empty: expected config.json \(written by models.qwen2_5_vl.save\)"):
        load(str(tmp_path / "empty"))
