"""``models.decode_attention.reduce_attention`` and ``split_k_decode_attention`` equal the einsum form of
dense attention (with the non-finite rules); ``dense_attention`` takes the reduce form for batched
single-query steps on CUDA only (the program exported for CUDA then holds no matrix product and no
transposed copy of the cache) and the split-K kernel for single-query steps over long caches on CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from mmjax.inference import decode_step, prefill
from models.attention import dense_attention
from models.decode_attention import SPLIT_K_MIN_SLOTS, reduce_attention, split_k_decode_attention
from models import text_decoder
from models.qwen2_5_vl import Qwen2_5_VL
from pallas_kernels.layer_matmul import layer_matmul
from tests.models.helpers import random_decode_qkv, small_config, video_prompt


@pytest.mark.parametrize("t", [1, 3])
def test_reduce_attention_equals_dense_with_its_nonfinite_rules(t):
    q, k, v, valid = random_decode_qkv(t=t)
    pos = jnp.broadcast_to(250 + jnp.arange(t, dtype=jnp.int32), (2, t))
    v = v.at[0, 260].set(jnp.nan).at[1, 10].set(jnp.inf).at[1, 280].set(jnp.nan)  # masked / visible / future
    valid = valid.at[0, 260].set(True).at[1, 10].set(True)
    k = k.at[0, 5].set(jnp.nan)
    valid = valid.at[0, 5].set(False)  # a masked non-finite key contributes nothing
    ref = np.asarray(dense_attention(q, k, v, q_positions=pos, kv_valid=valid,
                                     decode_form="einsum"))
    got = np.asarray(reduce_attention(q, k, v, q_positions=pos, kv_valid=valid))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(got[1]).all() and not np.isnan(got[0]).all()  # row 0: slot 260 is after position 250
    np.testing.assert_allclose(got[~np.isnan(ref)], ref[~np.isnan(ref)], atol=2e-6)
    none = reduce_attention(q, k, v, q_positions=pos, kv_valid=jnp.zeros_like(valid))
    np.testing.assert_array_equal(np.asarray(none), 0.0)  # a query that sees no key gives 0
    with pytest.raises(ValueError, match=r"kv_valid: expected shape \(2, 300\)"):
        reduce_attention(q, k, v, q_positions=pos, kv_valid=valid[:, :10])


@pytest.mark.parametrize("b,t,reduce_form", [(3, 1, True), (1, 1, False), (3, 2, False)])
def test_dense_attention_takes_the_reduce_form_for_batched_decode_on_cuda_only(b, t, reduce_form):
    q, k, v, valid = random_decode_qkv(b=b, t=t, s=64, seed=1)
    pos = jnp.broadcast_to(40 + jnp.arange(t, dtype=jnp.int32), (b, t))

    def attn(q, k, v, pos, valid):
        return dense_attention(q, k, v, q_positions=pos, kv_valid=valid)

    cuda = export.export(jax.jit(attn), platforms=["cuda"])(q, k, v, pos, valid).mlir_module()
    assert ("dot_general" not in cuda and "transpose" not in cuda) == reduce_form
    cpu = export.export(jax.jit(attn), platforms=["cpu"])(q, k, v, pos, valid).mlir_module()
    assert "dot_general" in cpu  # the CPU keeps the einsum form (it updates the cache in place)
    ref = dense_attention(q, k, v, q_positions=pos, kv_valid=valid, decode_form="einsum")
    np.testing.assert_allclose(np.asarray(jax.jit(attn)(q, k, v, pos, valid)), np.asarray(ref), atol=1e-6)
    red = reduce_attention(q, k, v, q_positions=pos, kv_valid=valid)
    np.testing.assert_allclose(np.asarray(red), np.asarray(ref), atol=2e-6)


def test_decode_form_is_checked():
    q, k, v, valid = random_decode_qkv()
    with pytest.raises(ValueError, match="decode_form: expected 'auto' or 'einsum'"):
        dense_attention(q, k, v, q_positions=jnp.zeros((2, 1), jnp.int32), kv_valid=valid, decode_form="fast")


@pytest.mark.parametrize("implementation", ["triton", "reference"])
def test_split_k_decode_attention_equals_dense(implementation):
    """Rows at different slots, GQA, random validity; one row sees its last slot, one row sees nothing; a
    visible NaN value poisons its row, a masked one does not."""
    q, k, v, valid = random_decode_qkv(b=4, t=1, s=300, seed=2)
    pos = jnp.asarray([[299], [150], [40], [299]], jnp.int32)
    valid = valid.at[0, 299].set(True).at[3].set(False)
    v = v.at[1, 100].set(jnp.nan).at[2, 200].set(jnp.nan)  # row 1: visible if valid; row 2: in its future
    valid = valid.at[1, 100].set(True)
    ref = np.asarray(dense_attention(q, k, v, q_positions=pos, kv_valid=valid, decode_form="einsum"))
    got = np.asarray(split_k_decode_attention(q, k, v, q_positions=pos, kv_valid=valid,
                                              implementation=implementation, interpret=True))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(got[1]).all() and not np.isnan(got[2]).any()
    np.testing.assert_array_equal(got[3], 0.0)  # a row that sees no slot gives 0
    ok = ~np.isnan(ref)
    np.testing.assert_allclose(got[ok], ref[ok], atol=2e-5)
    with pytest.raises(ValueError, match=r"one query per row"):
        split_k_decode_attention(q.repeat(2, axis=1), k, v, q_positions=pos.repeat(2, axis=1), kv_valid=valid)


@pytest.mark.parametrize("b,s,split_k", [(1, SPLIT_K_MIN_SLOTS, True), (4, SPLIT_K_MIN_SLOTS, True),
                                         (4, SPLIT_K_MIN_SLOTS // 2, False)])
def test_dense_attention_takes_the_split_k_kernel_for_long_decode_on_cuda(b, s, split_k):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    args = (jax.ShapeDtypeStruct((b, 1, 28, 128), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, 4, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s, 4, 128), jnp.bfloat16), jax.ShapeDtypeStruct((b, 1), jnp.int32),
            jax.ShapeDtypeStruct((b, s), jnp.bool_))
    f = jax.jit(lambda q, k, v, pos, valid: dense_attention(q, k, v, q_positions=pos, kv_valid=valid))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert ("__gpu$xla.gpu.triton" in text) == split_k


def test_dense_attention_gets_the_stacked_cache_and_decodes_like_the_layer_slice():
    cfg = small_config()
    model = Qwen2_5_VL(cfg, key=jax.random.key(5))
    inputs = video_prompt(cfg, frames=2, rng=np.random.default_rng(1))
    seen = []

    def spy(q, k, v, **kw):
        seen.append(k.ndim)
        return dense_attention(q, k, v, **kw)

    spy.reads_stacked_cache = True
    dense = prefill(model, inputs, "dense", max_length=96)
    tok = jnp.argmax(dense.logits, -1)
    want, _ = decode_step(model, dense.cache, tok, attention=lambda q, k, v, **kw: dense_attention(q, k, v, **kw))
    again = prefill(model, inputs, "dense", max_length=96)
    got, _ = decode_step(model, again.cache, tok, attention=spy)
    assert seen and set(seen) == {5}  # every layer was handed [L, B, S, K, D]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    again = prefill(model, inputs, "dense", max_length=96)
    default, _ = decode_step(model, again.cache, tok)  # the default attention reads the stacked cache too
    np.testing.assert_allclose(np.asarray(default), np.asarray(want), atol=2e-5)


def test_dense_attention_on_a_stacked_cache_lowers_to_split_k_in_place_on_cuda():
    """Unrolled decode (layer a Python int) over >= SPLIT_K_MIN_SLOTS slots: one Triton call whose operand
    is the whole stacked cache; a traced layer gets the layer's slice (the split-K kernel on the slice)."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    sds, s = jax.ShapeDtypeStruct, SPLIT_K_MIN_SLOTS
    args = (sds((2, 1, 28, 128), jnp.bfloat16), sds((3, 2, s, 4, 128), jnp.bfloat16),
            sds((3, 2, s, 4, 128), jnp.bfloat16), sds((2, 1), jnp.int32), sds((2, s), jnp.bool_))

    def calls(fn, *extra):
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(fn).trace(*args, *extra).lower(lowering_platforms=("cuda",)).as_text()
        return [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]

    call = calls(lambda q, k, v, p, m: dense_attention(q, k, v, layer=1, q_positions=p, kv_valid=m))
    assert len(call) == 1 and f"tensor<3x2x{s}x4x128xbf16>" in call[0]
    call = calls(lambda q, k, v, p, m, i: dense_attention(q, k, v, layer=i, q_positions=p, kv_valid=m),
                 sds((), jnp.int32))
    assert len(call) == 1 and f"tensor<3x2x{s}x4x128xbf16>" not in call[0] and f"tensor<2x{s}x4x128xbf16>" in call[0]


def test_dense_attention_stacked_cache_errors_name_the_argument():
    q = jnp.ones((1, 1, 2, 8))
    kv = jnp.ones((2, 1, 16, 1, 8))
    pos, valid = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 16), bool)
    with pytest.raises(ValueError, match="layer: expected the layer index"):
        dense_attention(q, kv, kv, q_positions=pos, kv_valid=valid)
    with pytest.raises(ValueError, match="k/v: expected the stacked cache"):
        dense_attention(q, kv, kv[..., :4], layer=0, q_positions=pos, kv_valid=valid)


def test_decode_with_wo_in_place_equals_the_slice_product(monkeypatch):
    """The unrolled decode step's o-projection through `layer_matmul` on the stacked weight (forced here; on
    a CPU it is off and layer_matmul runs its reference) gives the einsum path's logits."""
    cfg = small_config()
    model = Qwen2_5_VL(cfg, key=jax.random.key(6))
    inputs = video_prompt(cfg, frames=2, rng=np.random.default_rng(2))
    dense = prefill(model, inputs, "dense", max_length=96)
    tok = jnp.argmax(dense.logits, -1)
    assert not text_decoder._wo_in_place(jnp.ones((1, 1, 8)), jnp.ones((2, 2, 2, 8)))  # CPU: off
    want, _ = decode_step(model, dense.cache, tok)
    calls = []

    def spy(x, w, layer, **kw):
        calls.append((x.shape, w.shape, layer))
        return layer_matmul(x, w, layer, **kw)

    monkeypatch.setattr(text_decoder, "_wo_in_place", lambda x, wo: True)
    monkeypatch.setattr(text_decoder, "layer_matmul", spy)
    jax.clear_caches()  # decode_step's compiled step would skip the patched trace
    again = prefill(model, inputs, "dense", max_length=96)
    got, _ = decode_step(model, again.cache, tok)
    c = cfg.text
    head_dim = c.hidden_size // c.num_attention_heads
    assert [layer for _, _, layer in calls] == list(range(c.num_hidden_layers))
    assert calls[0][1] == (c.num_hidden_layers, c.num_attention_heads * head_dim, c.hidden_size)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_wo_in_place_only_for_few_tokens_on_one_cuda_device(monkeypatch):
    wo = jnp.ones((2, 2, 4, 8), jnp.bfloat16)
    x16, x17 = jnp.ones((4, 4, 8), jnp.bfloat16), jnp.ones((1, 17, 8), jnp.bfloat16)
    assert not text_decoder._wo_in_place(x16, wo)  # a CPU backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert text_decoder._wo_in_place(x16, wo)  # B * T = 16 tokens
    assert not text_decoder._wo_in_place(x17, wo)  # 17 tokens: XLA's GEMM
    assert not text_decoder._wo_in_place(x16.astype(jnp.float32), wo)  # weights in another dtype
    mesh = jax.sharding.AbstractMesh((2,), ("tp",))
    with jax.sharding.use_abstract_mesh(mesh):
        assert not text_decoder._wo_in_place(x16, wo)  # a layout over several devices
