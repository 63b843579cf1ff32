"""GPU checks (``pytest -m gpu``): cuDNN attention inside the model agrees with dense XLA attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.inference import decode_step, prefill
from models.attention import cudnn_attention, dense_attention
from models.decode_attention import SPLIT_K_MIN_SLOTS, split_k_decode_attention
from models import text_decoder
from models.qwen2_5_vl import Qwen2_5_VL
from tests.models.helpers import small_config, video_prompt

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("t", [256, 3000])
def test_cudnn_matches_dense_attention(t):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k1, (1, t, 8, 128), jnp.bfloat16)
    k = jax.random.normal(k2, (1, t, 2, 128), jnp.bfloat16)
    v = jax.random.normal(k3, (1, t, 2, 128), jnp.bfloat16)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    valid = jnp.ones((1, t), bool)
    a = dense_attention(q, k, v, q_positions=pos, kv_valid=valid, direct_max_scores=1 << 20)
    b = cudnn_attention(q, k, v, q_positions=pos, kv_valid=valid)
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2)


@needs_gpu
def test_cudnn_prefill_then_decode_matches_dense():
    cfg = small_config(head_dim=64)
    model = Qwen2_5_VL(cfg, dtype=jnp.bfloat16, key=jax.random.key(3))
    inputs = video_prompt(cfg, frames=4, rng=np.random.default_rng(0))
    dense = prefill(model, inputs, "dense", max_length=512)
    cud = prefill(model, inputs, "cudnn", max_length=512)
    np.testing.assert_allclose(np.asarray(dense.logits), np.asarray(cud.logits), atol=0.15)
    tok = jnp.argmax(dense.logits, -1)
    l1, _ = decode_step(model, dense.cache, tok)
    l2, _ = decode_step(model, cud.cache, tok)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), atol=0.15)


@needs_gpu
@pytest.mark.parametrize("grid", [(3, 8, 8), (2, 6, 4)])  # every window full / partial windows (padded tiles)
def test_vision_tower_cudnn_matches_xla(grid):
    from models.qwen2_5_vl.config import VisionConfig
    from models.qwen2_5_vl.vision import VisionTower, encode_grid
    c = VisionConfig(depth=2, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=48,
                     fullatt_block_indexes=(1,), window_size=56)
    tower = VisionTower(c, dtype=jnp.bfloat16, key=jax.random.key(0), init_std=0.1)
    t, h, w = grid
    pixels = jax.random.normal(jax.random.key(1), (t * h * w, c.patch_dim), jnp.bfloat16)
    xla = encode_grid(tower, pixels, grid, attention="xla")
    for windows in ("auto", "gather"):
        cud = encode_grid(tower, pixels, grid, attention="cudnn", windows=windows)
        np.testing.assert_allclose(np.asarray(cud, np.float32), np.asarray(xla, np.float32), atol=5e-2, rtol=5e-2)


@needs_gpu
def test_siglip_tower_cudnn_matches_xla():
    from mmjax.drivers.bench.prefill import tiny_llava_config
    from models import llava_onevision as lo
    from models.llava_onevision.vision import encode_tiles
    cfg = tiny_llava_config()  # head dim 32, 25 patches a tile
    model = lo.LlavaOnevision(cfg, dtype=jnp.bfloat16, key=jax.random.key(0))
    tiles = jax.random.normal(jax.random.key(1), (3, 3, 70, 70), jnp.bfloat16)
    xla = encode_tiles(model.vision, tiles, attention="xla")
    cud = encode_tiles(model.vision, tiles, attention="cudnn")
    np.testing.assert_allclose(np.asarray(cud, np.float32), np.asarray(xla, np.float32), atol=5e-2, rtol=5e-2)


@needs_gpu
def test_split_k_decode_attention_matches_dense_on_gpu():
    s = SPLIT_K_MIN_SLOTS + 300
    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(k1, (3, 1, 28, 128), jnp.bfloat16)
    k = jax.random.normal(k2, (3, s, 4, 128), jnp.bfloat16)
    v = jax.random.normal(k3, (3, s, 4, 128), jnp.bfloat16)
    pos = jnp.asarray([[s - 1], [9000], [s - 500]], jnp.int32)
    valid = jnp.arange(s)[None] <= jnp.asarray([[s - 1], [s - 1], [12000]])
    ref = dense_attention(q, k, v, q_positions=pos, kv_valid=valid, decode_form="einsum")
    got = split_k_decode_attention(q, k, v, q_positions=pos, kv_valid=valid)
    auto = jax.jit(lambda *a: dense_attention(*a[:3], q_positions=a[3], kv_valid=a[4]))(q, k, v, pos, valid)
    for out in (got, auto):
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)


@needs_gpu
def test_dense_attention_reads_a_stacked_cache_layer_in_place_on_gpu():
    """The stacked form (cache ``[L, B, S, K, D]``, layer a Python int) equals dense attention on the slice."""
    s, layers = SPLIT_K_MIN_SLOTS + 300, 3
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(k1, (2, 1, 28, 128), jnp.bfloat16)
    k = jax.random.normal(k2, (layers, 2, s, 4, 128), jnp.bfloat16)
    v = jax.random.normal(k3, (layers, 2, s, 4, 128), jnp.bfloat16)
    pos = jnp.asarray([[s - 1], [9000]], jnp.int32)
    valid = jnp.arange(s)[None] <= jnp.asarray([[s - 1], [9000]])
    for layer in (0, 2):
        ref = dense_attention(q, k[layer], v[layer], q_positions=pos, kv_valid=valid, decode_form="einsum")
        got = jax.jit(lambda *a, i=layer: dense_attention(
            *a[:3], layer=i, q_positions=a[3], kv_valid=a[4]))(q, k, v, pos, valid)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=2e-2)


@needs_gpu
def test_decode_multiplies_wo_in_place_on_gpu(monkeypatch):
    """On a GPU the unrolled decode step's o-projection runs `layer_matmul` on the stacked weight; its logits
    equal the slice product's (bf16)."""
    cfg = small_config()
    model = Qwen2_5_VL(cfg, dtype=jnp.bfloat16, key=jax.random.key(8))
    inputs = video_prompt(cfg, frames=2, rng=np.random.default_rng(3))
    tok = jnp.argmax(prefill(model, inputs, "dense", max_length=96).logits, -1)
    x = jnp.ones((1, 1, cfg.text.hidden_size), jnp.bfloat16)
    assert text_decoder._wo_in_place(x, jnp.ones((2, 2, 2, cfg.text.hidden_size), jnp.bfloat16))
    got, _ = decode_step(model, prefill(model, inputs, "dense", max_length=96).cache, tok)
    monkeypatch.setattr(text_decoder, "_wo_in_place", lambda x, wo: False)
    jax.clear_caches()
    want, _ = decode_step(model, prefill(model, inputs, "dense", max_length=96).cache, tok)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=5e-2, rtol=5e-2)
