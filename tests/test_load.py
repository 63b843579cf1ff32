"""``mmjax.load``: plain single-file, sharded and hub-cache snapshots; the architecture table; errors."""

import json
import os
import shutil
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmjax
from mmjax.load import ARCHITECTURES, architecture, eos_token_ids, supported
from models.causal_lm import CausalLM
from models.qwen2_5_vl import Processor, from_hf
from models.safetensors_io import read_header
from models.snapshot import resolve_snapshot
from tests.snapshots import hub_tree

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATE = os.path.join(HERE, "models", "fixtures", "generate")
SNAPSHOT = os.path.join(GENERATE, "snapshot")
VL_NESTED = os.path.join(HERE, "models", "fixtures", "vl_nested")
TEXT_LM = os.path.join(HERE, "models", "fixtures", "text_lm")


def _params(model) -> dict:
    return {"/".join(map(str, k)): np.asarray(v.astype(jnp.float32))
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def _write_safetensors(path, tensors):
    """tensors: name -> (dtype string, shape, raw bytes), written in the safetensors layout."""
    header, offset = {}, 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, _, raw in tensors.values():
            f.write(raw)


def _sharded_copy(src, dst, shards=3):
    """``src`` (one model.safetensors) rewritten as ``shards`` files + model.safetensors.index.json."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    infos = read_header(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        data = f.read()
    names = sorted(infos)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        _write_safetensors(os.path.join(dst, fname), {n: (infos[n].dtype, infos[n].shape,
                                                          data[infos[n].start:infos[n].end]) for n in part})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.fixture(scope="module")
def reference():
    return mmjax.load(SNAPSHOT, dtype=jnp.float32)


def test_plain_single_file_snapshot(reference):
    model, processor = reference
    assert isinstance(processor, Processor)
    assert model.config.text.vocab_size == 448 and model.config.max_position_embeddings == 4096
    assert model.language_model.embed[...].dtype == jnp.float32
    bf16, _ = mmjax.load(SNAPSHOT)
    assert bf16.language_model.embed[...].dtype == jnp.bfloat16
    # the checkpoint is bf16, so loading it in float32 is exact
    np.testing.assert_array_equal(np.asarray(bf16.language_model.embed[...].astype(jnp.float32)),
                                  np.asarray(model.language_model.embed[...]))
    assert eos_token_ids(SNAPSHOT, processor) == (402, 400)  # generation_config.json's list


def test_sharded_snapshot_with_index(reference, tmp_path):
    _sharded_copy(SNAPSHOT, tmp_path / "sharded")
    assert not os.path.exists(tmp_path / "sharded" / "model.safetensors")
    model, _ = mmjax.load(tmp_path / "sharded", dtype=jnp.float32)
    _assert_same_params(model, reference[0])


def test_hub_cache_tree(reference, tmp_path):
    root = tmp_path / "models--tiny--qwen2_5_vl"
    snap = hub_tree(SNAPSHOT, root)
    assert os.path.islink(os.path.join(snap, "model.safetensors"))
    assert resolve_snapshot(root) == snap
    model, processor = mmjax.load(root, dtype=jnp.float32)
    _assert_same_params(model, reference[0])
    text = processor.apply_chat_template([{"role": "user", "content": "hi"}])
    np.testing.assert_array_equal(processor(text=[text])["input_ids"], reference[1](text=[text])["input_ids"])
    model2, _ = mmjax.load(snap, dtype=jnp.float32)  # the snapshots/<hash> directory itself
    _assert_same_params(model2, reference[0])
    # no refs/main: the only snapshot is taken; with two, the error asks for one
    os.remove(root / "refs" / "main")
    assert resolve_snapshot(root) == snap
    shutil.copytree(snap, root / "snapshots" / "other", symlinks=True)
    with pytest.raises(ValueError, match="no refs/main and 2 snapshots"):
        mmjax.load(root)
    # a symlink whose blob is missing
    os.remove(os.path.join(root, "blobs", os.path.basename(os.readlink(os.path.join(snap, "config.json")))))
    with pytest.raises(ValueError, match="broken symlink"):
        mmjax.load(snap)


def test_hub_cache_tree_of_a_sharded_checkpoint(tmp_path):
    """from_hf on the sharded vl_nested fixture (transformers 5 names) through a hub tree."""
    root = tmp_path / "models--tiny--vl_nested"
    hub_tree(VL_NESTED, root)
    _assert_same_params(from_hf(str(root), dtype=jnp.float32), from_hf(VL_NESTED, dtype=jnp.float32))


@pytest.mark.parametrize("case,family", [("llama", "llama"), ("llama_tied_bias", "llama"), ("qwen3", "qwen3"),
                                         ("qwen3_moe", "qwen3_moe")])
def test_text_lm_snapshots(case, family):
    d = os.path.join(TEXT_LM, case)
    model, processor = mmjax.load(d)
    assert isinstance(model, CausalLM) and model.config.family == family
    assert model.language_model.embed[...].dtype == jnp.bfloat16
    assert processor(processor.apply_chat_template([{"role": "user", "content": "hi"}]))["input_ids"].shape[0] == 1
    assert eos_token_ids(d, processor) == (2,)


def test_text_lm_single_file_sharded_and_hub_tree_load_identically(tmp_path):
    single = os.path.join(TEXT_LM, "llama_tied_bias")  # one model.safetensors
    reference, _ = mmjax.load(single, dtype=jnp.float32)
    _sharded_copy(single, tmp_path / "sharded")
    _assert_same_params(mmjax.load(tmp_path / "sharded", dtype=jnp.float32)[0], reference)
    hub_tree(str(tmp_path / "sharded"), tmp_path / "models--tiny--llama")
    _assert_same_params(mmjax.load(tmp_path / "models--tiny--llama", dtype=jnp.float32)[0], reference)
    moe = os.path.join(TEXT_LM, "qwen3_moe")  # sharded, one tensor per expert
    hub_tree(moe, tmp_path / "models--tiny--qwen3_moe")
    _assert_same_params(mmjax.load(tmp_path / "models--tiny--qwen3_moe", dtype=jnp.float32)[0],
                        mmjax.load(moe, dtype=jnp.float32)[0])


def test_architecture_table():
    assert architecture({"architectures": ["Qwen2_5_VLForConditionalGeneration"]}) is ARCHITECTURES[0]
    assert architecture({"model_type": "qwen2_5_vl"}) is ARCHITECTURES[0]
    for names, model_type in ((["LlamaForCausalLM"], "llama"), (["Qwen3ForCausalLM"], "qwen3"),
                              (["Qwen3MoeForCausalLM"], "qwen3_moe")):
        assert architecture({"architectures": names}).model_type == model_type
        assert architecture({"model_type": model_type}).model_type == model_type
    assert supported() == ["Qwen2_5_VLForConditionalGeneration (qwen2_5_vl)", "LlamaForCausalLM (llama)",
                           "Qwen3ForCausalLM (qwen3)", "Qwen3MoeForCausalLM (qwen3_moe)",
                           "LlavaOnevisionForConditionalGeneration (llava_onevision)",
                           "LlavaQwenForCausalLM (llava_onevision)"]
    with pytest.raises(ValueError, match=r"unsupported architecture \(architectures \['LlavaForConditionalGenera"
                                         r"tion'\], model_type 'llava'\); supported: Qwen2_5_VLForConditionalGen"):
        architecture({"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"})


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        mmjax.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json in"):
        mmjax.load(tmp_path / "empty")
    d = tmp_path / "mistral"
    shutil.copytree(SNAPSHOT, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*MistralForCausalLM"):
        mmjax.load(d)
    os.remove(d / "model.safetensors")
    cfg.update(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="expected model.safetensors.index.json or model.safetensors"):
        mmjax.load(d)
