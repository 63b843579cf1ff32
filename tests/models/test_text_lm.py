"""Text LMs (models.llama, models.qwen3, models.causal_lm): config parsing, llama3 rope bands, the MoE MLP,
conversion (per-expert / fused experts, key errors), orbax checkpoints, inputs, decode and sparse attention."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import mmjax
from mmjax.inference import decode_step, prefill
from mmjax.patterns import AShape, Dense, Momo, VerticalSlash
from mmjax.speculative import TargetDraft
from models import llama, qwen3, safetensors_io
from models.causal_lm import CausalLM, CausalLMConfig, forward
from models.moe import moe_mlp
from models.qwen2_5_vl import Processor as VLProcessor
from models.rope_scaling import RopeConfig
from tests.models.text_lm_cases import case_dir, get_text_model, load_text_case


def _params(model):
    return {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


# ------------------------------------------------------------------------------------------------ config
def test_published_and_transformers5_config_layouts_agree():
    with open(os.path.join(case_dir("llama"), "config.json")) as f:
        hf5 = json.load(f)
    published = {k: v for k, v in hf5.items() if k != "rope_parameters"}
    rope = dict(hf5["rope_parameters"])
    published["rope_theta"] = rope.pop("rope_theta")
    published["rope_scaling"] = rope
    cfg = llama.config_from_hf(hf5)
    assert llama.config_from_hf(published) == cfg
    assert cfg.rope == RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 64) and cfg.text.rope_theta == 500000.0
    assert (cfg.text.head_dim, cfg.text.qkv_bias, cfg.text.o_bias, cfg.text.tie_word_embeddings) == (16, False, False,
                                                                                                    False)
    with open(os.path.join(case_dir("qwen3_moe"), "config.json")) as f:
        moe5 = json.load(f)
    moe_pub = {k: v for k, v in moe5.items() if k != "num_local_experts"}
    moe_pub["num_experts"] = moe5["num_local_experts"]  # the key the published Qwen3-MoE config.json uses
    assert qwen3.config_from_hf(moe5) == qwen3.config_from_hf(moe_pub)
    c = qwen3.config_from_hf(moe5)
    assert c.family == "qwen3_moe" and (c.text.num_experts, c.text.num_experts_per_tok, c.text.norm_topk_prob) == \
        (8, 2, True) and c.text.qk_norm
    tied = llama.config_from_hf(json.load(open(os.path.join(case_dir("llama_tied_bias"), "config.json"))))
    assert tied.text.qkv_bias and tied.text.o_bias and tied.text.tie_word_embeddings
    assert tied.rope.rope_type == "default"


def test_transformers_defaults_when_fields_are_absent():
    d = llama.config_from_hf({})
    assert (d.text.vocab_size, d.text.hidden_size, d.text.num_key_value_heads, d.rope.theta,
            d.max_position_embeddings) == (32000, 4096, 32, 10000.0, 2048)
    m = qwen3.config_from_hf({"model_type": "qwen3_moe"})
    assert (m.text.num_experts, m.text.num_experts_per_tok, m.text.moe_intermediate_size, m.text.norm_topk_prob,
            m.text.num_hidden_layers) == (128, 8, 768, False, 24)
    assert qwen3.config_from_hf({"model_type": "qwen3"}).text.num_experts == 0


@pytest.mark.parametrize("edit,match", [
    ({"mlp_bias": True}, "mlp_bias"),
    ({"use_sliding_window": True}, "sliding"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}}, "rope type.*dynamic"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0}}, "missing.*low_freq_factor"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_hidden_layers": "3"}, "num_hidden_layers"),
])
def test_config_errors_name_the_field(edit, match):
    with open(os.path.join(case_dir("llama"), "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match=match):
        llama.config_from_hf({**hf, **edit})


def test_mixed_dense_and_moe_layers_are_rejected():
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        qwen3.config_from_hf({"model_type": "qwen3_moe", "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match="mlp_only_layers"):
        qwen3.config_from_hf({"model_type": "qwen3_moe", "mlp_only_layers": [0]})


@pytest.mark.parametrize("module,name,params", [(llama, "8b", 8_030_261_248), (qwen3, "8b", 8_190_735_360),
                                                (qwen3, "30b-a3b", 30_532_122_624)])
def test_presets_have_published_parameter_counts(module, name, params):
    model = nnx.eval_shape(lambda: CausalLM(module.preset(name), dtype=jnp.bfloat16))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == params


def test_llama3_rope_covers_all_three_bands():
    """The fixture's llama3 scaling keeps high frequencies, divides low ones by ``factor`` and interpolates
    between (so the parity test checks every branch)."""
    cfg = llama.config_from_hf(json.load(open(os.path.join(case_dir("llama"), "config.json"))))
    base = RopeConfig(theta=cfg.rope.theta).inv_freq(16)
    got = cfg.rope.inv_freq(16)
    kept, divided = np.isclose(got, base, rtol=1e-6), np.isclose(got, base / 8, rtol=1e-6)
    between = ~kept & ~divided
    assert kept.any() and divided.any() and between.any()
    assert np.all((got[between] < base[between]) & (got[between] > base[between] / 8))
    with pytest.raises(ValueError, match="rope_type"):
        RopeConfig(rope_type="linear")


def test_yarn_rope_of_the_qwen3_fixture():
    """YaRN (Qwen3's 128k setting): extrapolated, blended and interpolated frequencies, tables scaled by
    0.1 ln(factor) + 1, and the context grows to factor x original_max_position_embeddings."""
    cfg = qwen3.config_from_hf(json.load(open(os.path.join(case_dir("qwen3"), "config.json"))))
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == ("yarn", 4.0, 64)
    assert cfg.rope.attention_scaling == pytest.approx(0.1 * np.log(4.0) + 1.0)
    base = RopeConfig(theta=cfg.rope.theta).inv_freq(32)
    got = cfg.rope.inv_freq(32)
    kept, divided = np.isclose(got, base, rtol=1e-6), np.isclose(got, base / 4, rtol=1e-6)
    assert kept[0] and divided[-1] and (~kept & ~divided).any()
    published = {"max_position_embeddings": 40960, "rope_theta": 1e6,
                 "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert qwen3.config_from_hf(published).max_position_embeddings == 131072


# ------------------------------------------------------------------------------------------------ MoE
def _moe_reference(h, router, gate_up, down, k, norm):
    """Token by token, expert by expert, in float64."""
    h, router, gate_up, down = (np.asarray(a, np.float64) for a in (h, router, gate_up, down))
    logits = h @ router
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    f = down.shape[1]
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        top = np.argsort(-p[t])[:k]
        w = p[t, top] / (p[t, top].sum() if norm else 1.0)
        for e, we in zip(top, w):
            gu = h[t] @ gate_up[e]
            g, u = gu[:f], gu[f:]
            out[t] += we * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_moe_mlp_matches_a_loop_over_tokens_and_experts(norm):
    m, width, e, f, k = 11, 8, 6, 5, 2
    rng = np.random.default_rng(0)
    h = np.abs(rng.standard_normal((m, width), np.float32))
    router = rng.standard_normal((width, e), np.float32)
    router[:, 3] = -50.0  # h > 0: expert 3 gets no token
    gate_up = rng.standard_normal((e, width, 2 * f), np.float32) / 3
    down = rng.standard_normal((e, f, width), np.float32) / 3
    assert (np.argsort(-(h @ router), axis=-1)[:, :k] != 3).all()
    got = jax.jit(moe_mlp, static_argnames=("top_k", "norm_topk_prob"))(h, router, gate_up, down, top_k=k,
                                                                        norm_topk_prob=norm)
    np.testing.assert_allclose(np.asarray(got), _moe_reference(h, router, gate_up, down, k, norm), atol=1e-5)
    with pytest.raises(ValueError, match="w_down"):
        moe_mlp(h, router, gate_up, down[:, :-1], top_k=k, norm_topk_prob=norm)


def test_moe_mlp_on_a_gpu_is_the_grouped_matmul_kernel(monkeypatch):
    """Lowered for CUDA with the GPU default, the experts run as two Triton grouped-matmul calls, never as
    ``ragged_dot`` (which XLA expands densely over [pairs, experts * hidden])."""
    from pallas_kernels import platform
    monkeypatch.setattr(platform, "default_implementation", lambda interpret=False: "triton")
    m, width, e, f, k = 4096, 256, 32, 128, 4
    args = (jax.ShapeDtypeStruct((m, width), jnp.bfloat16), jax.ShapeDtypeStruct((width, e), jnp.bfloat16),
            jax.ShapeDtypeStruct((e, width, 2 * f), jnp.bfloat16), jax.ShapeDtypeStruct((e, f, width), jnp.bfloat16))
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    f_moe = jax.jit(lambda *a: moe_mlp(*a, top_k=k, norm_topk_prob=True))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f_moe.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2 and "ragged_dot" not in text


# ------------------------------------------------------------------------------------------------ conversion
def _rewrite(tmp_path, case, edit, name="edited"):
    """The fixture as one float32 model.safetensors (no index) after ``edit(tensors)``."""
    tensors = {k: np.asarray(safetensors_io.load(info), np.float32)
               for k, info in safetensors_io.index_checkpoint(case_dir(case)).items()}
    edit(tensors)
    dst = tmp_path / name
    dst.mkdir()
    shutil.copy(os.path.join(case_dir(case), "config.json"), dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_fused_expert_layout_loads_as_per_expert(tmp_path):
    """transformers 5's in-memory names (``mlp.experts.gate_up_proj`` [E, 2F, H]) give the same model."""
    cfg = qwen3.config_from_hf(json.load(open(os.path.join(case_dir("qwen3_moe"), "config.json"))))
    e = cfg.text.num_experts

    def fuse(t):
        for i in range(cfg.text.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts."
            t[p + "gate_up_proj"] = np.stack([np.concatenate([t.pop(p + f"{j}.gate_proj.weight"),
                                                              t.pop(p + f"{j}.up_proj.weight")]) for j in range(e)])
            t[p + "down_proj"] = np.stack([t.pop(p + f"{j}.down_proj.weight") for j in range(e)])

    _same_params(qwen3.from_hf(_rewrite(tmp_path, "qwen3_moe", fuse), dtype=jnp.float32), get_text_model("qwen3_moe"))


def test_missing_unexpected_and_mismatched_keys_are_named(tmp_path):
    def edit(t):
        del t["model.layers.1.mlp.experts.5.up_proj.weight"]
        t["model.layers.0.mlp.shared_expert.weight"] = np.zeros((2,), np.float32)
        t["model.layers.2.self_attn.q_norm.weight"] = np.zeros((5,), np.float32)
    with pytest.raises(ValueError) as err:
        qwen3.from_hf(_rewrite(tmp_path, "qwen3_moe", edit))
    msg = str(err.value)
    assert "model.layers.1.mlp.experts.5.up_proj.weight" in msg and "model.layers.0.mlp.shared_expert.weight" in msg
    assert "model.layers.2.self_attn.q_norm.weight: expected (16,), got (5,)" in msg
    with pytest.raises(ValueError, match="config.json: config mlp_bias"):
        bad = tmp_path / "bad"
        shutil.copytree(case_dir("llama_tied_bias"), bad)
        cfg = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**cfg, "mlp_bias": True}))
        llama.from_hf(str(bad))


def test_dtypes_and_tied_head():
    m = llama.from_hf(case_dir("llama_tied_bias"))
    assert m.language_model.wq[...].dtype == jnp.bfloat16 and m.language_model.lm_head is None
    assert m.language_model.bo[...].shape == (3, 64)
    kept = qwen3.from_hf(case_dir("qwen3_moe"), dtype=None)
    assert kept.language_model.e_gate_up[...].dtype == jnp.bfloat16
    assert kept.language_model.e_gate_up[...].shape == (3, 8, 64, 64)


# ------------------------------------------------------------------------------------------------ checkpoints
def test_orbax_round_trip_and_family_check(tmp_path):
    model = get_text_model("qwen3_moe")
    qwen3.save(model, str(tmp_path / "ckpt"))
    back = qwen3.load(str(tmp_path / "ckpt"))
    assert back.config == model.config
    inputs, _ = load_text_case("qwen3_moe")
    np.testing.assert_array_equal(np.asarray(forward(back, **inputs)), np.asarray(forward(model, **inputs)))
    with pytest.raises(ValueError, match="'qwen3_moe' checkpoint; expected one of \\('llama',\\)"):
        llama.load(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="expected a Llama CausalLM"):
        llama.save(model, str(tmp_path / "other"))
    with pytest.raises(FileExistsError):
        qwen3.save(model, str(tmp_path / "ckpt"))
    with pytest.raises(FileNotFoundError, match=r"expected config.json \(written by models.llama.save\)"):
        llama.load(str(tmp_path / "empty"))
    assert CausalLMConfig.from_dict(json.loads((tmp_path / "ckpt" / "config.json").read_text())) == model.config


# ------------------------------------------------------------------------------------------------ inference
def test_inputs_are_checked():
    model = get_text_model("llama")
    with pytest.raises(ValueError, match="pixel_values: a text-only llama model takes no images"):
        prefill(model, {"input_ids": np.ones((1, 4), np.int64), "pixel_values": np.zeros((4, 8), np.float32)})
    with pytest.raises(ValueError, match="input_ids: expected ids in"):
        forward(model, input_ids=np.full((1, 3), 448))
    with pytest.raises(ValueError, match="position_ids"):
        forward(model, input_ids=np.ones((1, 3), np.int64), position_ids=np.zeros((1, 4), np.int64))
    with pytest.raises(ValueError, match="draft: speculative decoding runs on a Qwen2.5-VL or LLaVA-OneVision target; "
                                         "got a CausalLM"):
        mmjax.generate(model, {"input_ids": np.ones((1, 4), np.int64)}, 2, draft=TargetDraft())


def test_decode_steps_equal_forward_on_the_extended_padded_batch():
    inputs, _ = load_text_case("llama_tied_bias")
    model = get_text_model("llama_tied_bias")
    t = inputs["input_ids"].shape[1]
    out = prefill(model, inputs, max_length=t + 3)
    cache, ids, mask = out.cache, inputs["input_ids"], inputs["attention_mask"]
    for tok in ([9, 17], [33, 5]):
        logits, cache = decode_step(model, cache, jnp.asarray(tok))
        ids = np.concatenate([ids, np.asarray(tok)[:, None]], axis=1)
        mask = np.concatenate([mask, np.ones((2, 1), mask.dtype)], axis=1)
    ref = np.asarray(forward(model, input_ids=ids, attention_mask=mask))[:, -1]
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4)
    assert np.asarray(cache.next_position).tolist() == [t + 2, int(inputs["attention_mask"][1].sum()) + 2]
    # the left-padded row decodes as the unpadded row alone
    n = int(inputs["attention_mask"][1].sum())
    alone = np.asarray(forward(model, input_ids=ids[1:, -(n + 2):]))[:, -1]
    np.testing.assert_allclose(np.asarray(logits[1:]), alone, atol=1e-4)


class Recording:
    """A SparseConfig seen through ``uniform_attention``, recording the modality the decoder hands it."""

    def __init__(self, config):
        self.config = config
        self.modalities = []

    def uniform_attention(self):
        fn = self.config.uniform_attention()

        def attn(q, k, v, *, modality, **kw):
            self.modalities.append(modality)
            return fn(q, k, v, modality=modality, **kw)
        return attn


def test_sparse_config_per_layer_and_head_on_a_text_model():
    """A SparseConfig with per-layer / per-head patterns (Vertical-Slash, MOMO, A-shape, dense) runs on the text
    decoder (layers scanned) with modality None, and the patterns act."""
    model = get_text_model("qwen3_moe")
    c = model.config.text
    ids = np.random.default_rng(0).integers(3, c.vocab_size, (1, 64))
    kw = dict(block_q=16, block_k=16)
    plans = (VerticalSlash(vertical_size=8, slash_size=16, last_q=8, **kw), Momo(gamma=4, block=16, k=2, k_exact=1,
             query_block=16, sink=16, local=16), AShape(sink=4, local=16, **kw), Dense(**kw))
    layers = tuple(tuple(plans[(i + h) % 4] for h in range(c.num_attention_heads)) for i in range(c.num_hidden_layers))
    config = mmjax.SparseConfig(layers, options=mmjax.patterns.KernelOptions(implementation="reference"))
    rec = Recording(config)
    sparse = np.asarray(prefill(model, {"input_ids": ids}, attention=rec).logits)
    dense = np.asarray(prefill(model, {"input_ids": ids}).logits)
    assert rec.modalities == [None]  # one scanned layer body, traced once
    assert np.isfinite(sparse).all() and np.abs(sparse - dense).max() > 1e-3


# ------------------------------------------------------------------------------------------------ processor
def test_text_processor_matches_the_vl_processor_on_text():
    proc = qwen3.Processor.from_pretrained(case_dir("qwen3"))
    vl = VLProcessor.from_pretrained(os.path.join(os.path.dirname(__file__), "fixtures", "processor", "snapshot"))
    chat = [{"role": "user", "content": "What is in the box?"}]
    text = proc.apply_chat_template(chat)
    assert text == vl.apply_chat_template(chat) and text.endswith("assistant\n")
    np.testing.assert_array_equal(proc(text)["input_ids"], vl(text=[text])["input_ids"])
    np.testing.assert_array_equal(proc.apply_chat_template(chat, tokenize=True), proc(text)["input_ids"][0])
    batch = proc(["a b c", "a"], padding=True, padding_side="left")
    assert batch["attention_mask"].tolist()[1][0] == 0 and batch["input_ids"].shape[0] == 2
    assert proc.decode(proc("hello world")["input_ids"][0]) == "hello world"
    with pytest.raises(ValueError, match="text"):
        proc([])
