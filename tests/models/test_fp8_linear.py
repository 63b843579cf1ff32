"""fp8 matmuls (`models.fp8_linear`, `mmjax.quantize_fp8`): the GEMM equals the product of the dequantized operands,
quantization error stays at fp8's level, prefill-sized calls use the fp8 weights and decode steps the bf16 ones, the
vision tower's padded MLP, and the errors for bad inputs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax.drivers.bench.prefill import text_inputs, tiny_text_config
from mmjax.parallel import make_mesh
from mmjax.parallel.run import check as check_parallel
from models.causal_lm import CausalLM
from models.common import rms_norm
from models.fp8_linear import (
    FP8,
    fp8_matmul,
    fp8_swiglu_mlp,
    is_quantized,
    normed_fp8_matmul,
    padded,
    quantize_normed_rows,
    quantize_rows,
    quantize_swiglu_mlp,
    quantize_weight,
)
from models.qwen2_5_vl import Qwen2_5_VL
from models.qwen2_5_vl import model as qwen_vl
from tests.models.helpers import small_config, video_prompt


def _rand(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("m, k, n", [(48, 64, 32), (7, 96, 80)])
def test_fp8_matmul_is_the_product_of_the_dequantized_operands(m, k, n):
    x, w = _rand(0, (2, m, k)), _rand(1, (1, k, n)) * k ** -0.5
    wq, ws = quantize_weight(w, 1)
    assert wq.dtype == FP8 and wq.shape == (1, n, k) and ws.shape == (1, n)
    y = np.asarray(fp8_matmul(x, wq[0], ws[0]), np.float32)
    assert y.shape == (2, m, n)
    xq, xs = quantize_rows(x)
    deq = lambda q, s: q.astype(jnp.float32) * s
    want = np.asarray(jnp.einsum("bmk,nk->bmn", deq(xq, xs), deq(wq[0], ws[0][:, None]), precision="highest"))
    np.testing.assert_allclose(y, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())  # bf16 result, rescaled
    exact = np.asarray(jnp.einsum("bmk,kn->bmn", x.astype(jnp.float32), w[0].astype(jnp.float32)))
    err = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    assert 0.005 < err < 0.06  # e4m3 rounding of both operands: about 3.7%, never exact


def test_quantize_rows_zero_and_nonfinite_rows():
    x = jnp.stack([jnp.zeros(16), jnp.arange(16.0) - 3, jnp.full(16, jnp.nan), jnp.full(16, jnp.inf)])
    q, s = quantize_rows(x)
    q, s = np.asarray(q, np.float32), np.asarray(s)
    assert s[0, 0] == 1.0 and (q[0] == 0).all()
    assert np.abs(q[1]).max() == 448.0 and np.isclose(s[1, 0], 12 / 448)
    w = quantize_weight(_rand(2, (1, 16, 8)), 1)
    y = np.asarray(fp8_matmul(x, w[0][0], w[1][0]), np.float32)
    assert (y[0] == 0).all() and np.isfinite(y[1]).all() and np.isnan(y[2]).all() and np.isnan(y[3]).all()


def test_normed_fp8_matmul_folds_the_rms_norm():
    x = _rand(6, (3, 40, 64)) * 5
    g = jax.random.uniform(jax.random.key(7), (64,), minval=0.5, maxval=1.5).astype(jnp.bfloat16)
    wq, ws = quantize_weight(_rand(8, (1, 64, 48)) * 0.125, 1)
    got = np.asarray(normed_fp8_matmul(x, g, 1e-6, wq[0], ws[0]), np.float32)
    via_norm = np.asarray(fp8_matmul(rms_norm(x, g, 1e-6), wq[0], ws[0]), np.float32)
    assert got.shape == (3, 40, 48) and _rel(via_norm, got) < 0.03  # the same up to fp8 / bf16 rounding
    exact = np.asarray(rms_norm(x.astype(jnp.float32), g.astype(jnp.float32), 1e-6) @ (
        wq[0].astype(jnp.float32) * ws[0][:, None]).T)
    assert _rel(exact, got) < 0.06
    parts = normed_fp8_matmul(x, g, 1e-6, wq[0], ws[0], splits=(16, 40))
    assert [a.shape for a in parts] == [(3, 40, 16), (3, 40, 24), (3, 40, 8)]
    np.testing.assert_array_equal(np.concatenate([np.asarray(a, np.float32) for a in parts], axis=-1), got)
    bad = x.at[0, 3, 9].set(jnp.nan).at[1, 5, 0].set(jnp.inf).at[2, 7].set(0)
    y = np.asarray(normed_fp8_matmul(bad, g, 1e-6, wq[0], ws[0]), np.float32)
    assert np.isnan(y[0, 3]).all() and np.isnan(y[1, 5]).all() and (y[2, 7] == 0).all()
    assert np.isfinite(np.delete(y.reshape(-1, 48), [3, 40 + 5], axis=0)).all()


def test_fp8_matmul_rejects_mismatched_weights():
    wq, ws = quantize_weight(_rand(3, (1, 32, 16)), 1)
    with pytest.raises(ValueError, match=r"w / w_scale: expected \[N, 24\]"):
        fp8_matmul(_rand(4, (3, 24)), wq[0], ws[0])
    with pytest.raises(ValueError, match="w / w_scale"):
        fp8_matmul(_rand(4, (3, 32)), wq[0], ws[0][:5])


def test_quantize_weight_per_tensor():
    w = _rand(9, (2, 24, 16)) * jnp.linspace(0.1, 2.0, 16)  # columns of very different sizes
    wq, ws = quantize_weight(w, 1, per_tensor=True)
    assert wq.shape == (2, 16, 24) and ws.shape == (2, 16)
    for layer in range(2):
        np.testing.assert_allclose(np.asarray(ws[layer]), np.abs(np.asarray(w[layer], np.float32)).max() / 448)
        assert np.abs(np.asarray(wq[layer], np.float32)).max() == 448.0
    deq = np.asarray(wq, np.float32) * np.asarray(ws)[:, :, None]
    assert _rel(np.swapaxes(np.asarray(w, np.float32), 1, 2), deq) < 0.05


def test_fp8_swiglu_mlp_matches_the_mlp():
    """Gate per tensor, up's per-channel scales folded into down: the same MLP up to fp8 rounding."""
    n_layers, h, f = 2, 64, 48
    p = {"w_gate": _rand(10, (n_layers, h, f)) * h ** -0.5,
         "w_up": _rand(11, (n_layers, h, f)) * h ** -0.5 * jnp.linspace(0.2, 3.0, f),
         "w_down": _rand(12, (n_layers, f, h)) * f ** -0.5}
    copies = quantize_swiglu_mlp(p)
    [(wgu, sg)], [(wd, sd)] = copies["fp8_w_gate_up"], copies["fp8_w_down"]
    assert wgu.shape == (n_layers, 2 * f, h) and sg.shape == (n_layers, 1) and wd.shape == (n_layers, h, f)
    x = _rand(13, (2, 9, h)) * 3
    g = jax.random.uniform(jax.random.key(14), (h,), minval=0.5, maxval=1.5)
    for layer in range(n_layers):
        got = np.asarray(fp8_swiglu_mlp(x, g, 1e-6, wgu[layer], wd[layer], sd[layer], sg[layer]), np.float32)
        hn = rms_norm(x.astype(jnp.float32), g, 1e-6)
        w = {k: v[layer].astype(jnp.float32) for k, v in p.items()}
        want = np.asarray((jax.nn.silu(hn @ w["w_gate"]) * (hn @ w["w_up"])) @ w["w_down"])
        assert got.shape == want.shape and 0.005 < _rel(want, got) < 0.08
    with pytest.raises(ValueError, match="w_gate_up / w_down / w_down_scale / gate_scale / up_scale / bias: expected"):
        fp8_swiglu_mlp(x, g, 1e-6, wgu[0], wd[0][:, :40], sd[0], sg[0])
    with pytest.raises(ValueError, match="w_gate_up / w_down"):
        fp8_swiglu_mlp(x, g, 1e-6, wgu[0], wd[0], sd[0], sg)
    with pytest.raises(ValueError, match="w_gate_up / w_down"):
        fp8_swiglu_mlp(x, g, 1e-6, wgu[0], wd[0], sd[0], sg[0], bias=jnp.zeros(f))


def test_quantize_weight_and_rows_errors():
    w = _rand(15, (2, 8, 16))
    with pytest.raises(ValueError, match="w: expected a float array"):
        quantize_weight(w.astype(jnp.int32), 1)
    with pytest.raises(ValueError, match=r"in_dims: expected an int in \[1, 1\]"):
        quantize_weight(w, 2)
    with pytest.raises(ValueError, match="pad_in: expected an int >= 0"):
        quantize_weight(w, 1, pad_in=-16)
    with pytest.raises(ValueError, match=r"in_scale: expected \[2, 8\]"):
        quantize_weight(w, 1, in_scale=jnp.ones((2, 16)))
    with pytest.raises(ValueError, match="x: expected a float array"):
        quantize_rows(jnp.arange(8))
    with pytest.raises(ValueError, match=r"norm_weight: expected \[8\]"):
        quantize_normed_rows(_rand(16, (3, 8)), jnp.ones(4), 1e-6)
    with pytest.raises(ValueError, match=r"x: expected a float array \[M, K\]"):
        quantize_normed_rows(_rand(16, (2, 3, 8)), jnp.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"p: expected w_gate / w_up \[L, H, F\]"):
        quantize_swiglu_mlp({"w_gate": w, "w_up": w, "w_down": w})


def test_quantize_weight_pads_with_zeros():
    wq, ws = quantize_weight(_rand(5, (2, 20, 12)), 1, pad_out=4, pad_in=12)
    assert wq.shape == (2, 16, 32) and ws.shape == (2, 16) and padded(20) == 32 and padded(32) == 32
    w = np.asarray(wq, np.float32)
    assert (w[:, 12:] == 0).all() and (w[:, :, 20:] == 0).all() and (np.asarray(ws)[:, 12:] == 1).all()


@pytest.fixture(scope="module")
def vlm():
    cfg = small_config()
    cfg = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, intermediate_size=40))  # not a multiple of 16
    model = Qwen2_5_VL(cfg, dtype=jnp.bfloat16, key=jax.random.key(7))
    inputs = video_prompt(cfg, frames=2, rng=np.random.default_rng(0))
    return cfg, model, inputs


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / np.linalg.norm(a)


def test_prefill_with_fp8_matmuls_stays_close_and_decode_keeps_bf16(vlm):
    _, model, inputs = vlm
    fp8 = mmjax.quantize_fp8(model, min_rows=1)
    assert is_quantized(fp8.language_model) and not is_quantized(model.language_model)
    assert fp8.language_model.wq[...] is model.language_model.wq[...]  # shared, not copied
    a, b = mmjax.prefill(model, inputs), mmjax.prefill(fp8, inputs)
    assert 1e-3 < _rel(a.logits, b.logits) < 0.1
    assert 1e-3 < _rel(a.cache.k, b.cache.k) < 0.1
    # a decode step (1 token, below the default min_rows) reads the bf16 weights: the same logits from the same cache
    default = mmjax.quantize_fp8(model)
    la, _ = mmjax.decode_step(model, mmjax.prefill(model, inputs).cache, jnp.asarray([5]))  # the cache is donated
    lb, _ = mmjax.decode_step(default, a.cache, jnp.asarray([5]))
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))


def test_prefill_below_min_rows_uses_the_model_weights_in_the_decoder(vlm):
    _, model, inputs = vlm
    big = mmjax.quantize_fp8(model, min_rows=4096)
    a = mmjax.prefill(model, inputs)
    b = mmjax.prefill(big, inputs)  # the tower still runs fp8, so the logits move slightly ...
    c = mmjax.prefill(mmjax.quantize_fp8(model, min_rows=1), inputs)
    assert _rel(a.logits, b.logits) < _rel(a.logits, c.logits)  # ... less than with the decoder in fp8 as well


def test_vision_tower_fp8_with_padded_mlp(vlm):
    cfg, model, inputs = vlm
    fp8 = mmjax.quantize_fp8(model)
    assert fp8.visual.fp8_w_gate_up[...].shape == (cfg.vision.depth, 2 * 48, cfg.vision.hidden_size)  # 40 -> 48
    assert fp8.visual.fp8_w_down[...].shape == (cfg.vision.depth, cfg.vision.hidden_size, 48)
    assert fp8.visual.fp8_w_gate_up_scale[...].shape == (cfg.vision.depth, 2)  # gate and up: one scale each
    p = qwen_vl.prepare_inputs(cfg, **inputs)
    _, a = qwen_vl.visual_inputs(model, p, None)
    _, b = qwen_vl.visual_inputs(fp8, p, None)
    assert a.shape == b.shape and 1e-4 < _rel(a, b) < 0.1


def test_fp8_program_holds_fp8_dots(vlm):
    cfg, model, inputs = vlm
    fp8 = mmjax.quantize_fp8(model, min_rows=1)
    p = qwen_vl.prepare_inputs(cfg, **inputs)
    img, vid = qwen_vl.visual_inputs(fp8, p, None)
    text = qwen_vl.prefill_language_model.lower(
        fp8, p.input_ids, img, vid, p.position_ids, p.attention_mask, p.token_types, p.rope_deltas,
        attention=mmjax.inference.resolve_attention("dense"), max_length=p.input_ids.shape[1] + 4).as_text()
    assert text.count("xf8E4M3FN>, tensor<") >= 4  # qkv, output, gate-up, down: dots of two fp8 operands


def test_quantize_fp8_errors(vlm):
    _, model, _ = vlm
    with pytest.raises(ValueError, match="model: expected"):
        mmjax.quantize_fp8(object())
    with pytest.raises(ValueError, match="min_rows: expected an int >= 1"):
        mmjax.quantize_fp8(model, min_rows=0)
    with pytest.raises(ValueError, match="fp8 weights"):
        check_parallel(mmjax.quantize_fp8(model), make_mesh(tp=1))


def test_chunked_fp8_prefill_equals_one_shot(vlm):
    """Activations are quantized per token, so a prompt prefilled in chunks meets the same fp8 products."""
    _, model, inputs = vlm
    fp8 = mmjax.quantize_fp8(model, min_rows=1)
    one = mmjax.prefill(fp8, inputs)
    chunked = mmjax.prefill(fp8, inputs, chunk_tokens=10)
    np.testing.assert_allclose(np.asarray(chunked.logits, np.float32), np.asarray(one.logits, np.float32),
                               rtol=0.02, atol=0.02 * np.abs(np.asarray(one.logits, np.float32)).max())


@pytest.mark.parametrize("moe", [False, True])
def test_text_lm_fp8(moe):
    """Qwen3 dense / MoE: the projections get fp8 copies; a MoE's experts keep their weights (no dense-MLP copies)."""
    cfg = tiny_text_config(moe)
    model = CausalLM(cfg, dtype=jnp.bfloat16, key=jax.random.key(3))
    fp8 = mmjax.quantize_fp8(model, min_rows=1)
    dec = fp8.language_model
    assert dec.fp8_wqkv[...].shape == (cfg.text.num_hidden_layers, (4 + 2 * 2) * cfg.text.head_dim,
                                       cfg.text.hidden_size)
    assert (getattr(dec, "fp8_w_gate_up", None) is None) == moe
    inputs = text_inputs(cfg, 40)
    a, b = mmjax.prefill(model, inputs), mmjax.prefill(fp8, inputs)
    assert 1e-3 < _rel(a.logits, b.logits) < 0.1
