"""prefill / decode_step: cache consistency, padding, attention injection, hidden states; scanned sparse
configs, chunked prefill, fp8 KV cache, working memory independent of depth."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax.inference import PROCESSOR_KEYS, decode_step, prefill
from mmjax.patterns import AShape, Dense, Grid, VerticalSlash
from models.attention import dense_attention, resolve_attention
from models.qwen2_5_vl import Qwen2_5_VL, forward
from models.qwen2_5_vl import model as qwen_vl
from models.qwen2_text import dequantize_kv
from tests.models.helpers import VID, small_config, video_prompt


@pytest.fixture(scope="module")
def setup():
    cfg = small_config()
    model = Qwen2_5_VL(cfg, dtype=jnp.float32, key=jax.random.key(7))
    inputs = video_prompt(cfg, frames=2, rng=np.random.default_rng(0))
    return cfg, model, inputs


def test_prefill_logits_equal_forward_last_position(setup):
    _, model, inputs = setup
    full = np.asarray(forward(model, **inputs))
    out = prefill(model, inputs)
    np.testing.assert_allclose(np.asarray(out.logits), full[:, -1], atol=1e-4)
    assert out.cache.k.shape[2] == inputs["input_ids"].shape[1] + 256
    assert int(out.cache.length) == inputs["input_ids"].shape[1]
    np.testing.assert_array_equal(np.asarray(out.token_types)[0], (inputs["input_ids"][0] == VID) * 2)


def test_decode_steps_equal_forward_on_extended_sequence(setup):
    _, model, inputs = setup
    out = prefill(model, inputs, max_length=inputs["input_ids"].shape[1] + 4)
    cache, ids, new = out.cache, inputs["input_ids"], [9, 17, 33]
    for tok in new:
        logits, cache = decode_step(model, cache, jnp.asarray([tok]))
        ids = np.concatenate([ids, [[tok]]], axis=1)
        ref = np.asarray(forward(model, **{**inputs, "input_ids": ids}))[:, -1]
        np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4)


def test_decode_past_cache_end_gives_nan(setup):
    _, model, inputs = setup
    t = inputs["input_ids"].shape[1]
    out = prefill(model, inputs, max_length=t + 1)
    logits, cache = decode_step(model, out.cache, jnp.asarray([5]))
    assert np.isfinite(np.asarray(logits)).all()
    logits, cache = decode_step(model, cache, jnp.asarray([5]))
    assert np.isnan(np.asarray(logits)).all()


def test_left_padded_batch_matches_single_rows(setup):
    cfg, model, inputs = setup
    text_only = np.asarray([[5, 6, 7, 8]])
    t = inputs["input_ids"].shape[1]
    ids = np.zeros((2, t), np.int64)
    ids[0] = inputs["input_ids"][0]
    ids[1, -4:] = text_only[0]
    mask = np.zeros((2, t), np.int64)
    mask[0] = 1
    mask[1, -4:] = 1
    batch = prefill(model, {**inputs, "input_ids": ids, "attention_mask": mask}, max_length=t + 3)
    single_v = prefill(model, inputs, max_length=t + 3)
    single_t = prefill(model, {"input_ids": text_only}, max_length=8)
    np.testing.assert_allclose(np.asarray(batch.logits[0]), np.asarray(single_v.logits[0]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(batch.logits[1]), np.asarray(single_t.logits[0]), atol=1e-4)
    lb, _ = decode_step(model, batch.cache, jnp.asarray([3, 4]))
    l0, _ = decode_step(model, single_v.cache, jnp.asarray([3]))
    l1, _ = decode_step(model, single_t.cache, jnp.asarray([4]))
    np.testing.assert_allclose(np.asarray(lb[0]), np.asarray(l0[0]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(lb[1]), np.asarray(l1[0]), atol=1e-4)


def test_cudnn_rejects_left_padding(setup):
    _, model, inputs = setup
    mask = np.ones_like(inputs["input_ids"])
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        prefill(model, {**inputs, "attention_mask": mask}, attention="cudnn")


class RecordingHook:
    """A SparseConfig-shaped hook: layer_attention(i) returns the attention of layer i."""

    def __init__(self, scale_layer=None):
        self.calls = []
        self.scale_layer = scale_layer

    def layer_attention(self, layer):
        def attn(q, k, v, *, layer, q_positions, kv_valid, modality):
            self.calls.append((layer, q.shape, k.shape, None if modality is None else modality.shape))
            out = dense_attention(q, k, v, q_positions=q_positions, kv_valid=kv_valid)
            if modality is not None:
                # uses the modality: zero the attention output of video queries in one layer
                if layer == self.scale_layer:
                    out = jnp.where((modality == 2)[:, :, None, None], 0.0, out)
            return out
        return attn


def test_per_layer_hook_receives_layers_and_modality(setup):
    cfg, model, inputs = setup
    hook = RecordingHook()
    out = prefill(model, inputs, attention=hook)
    ref = prefill(model, inputs, attention="dense")
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=1e-5)
    t = inputs["input_ids"].shape[1]
    assert [c[0] for c in hook.calls] == list(range(cfg.text.num_hidden_layers))
    assert all(c[3] == (1, t) for c in hook.calls)
    changed = prefill(model, inputs, attention=RecordingHook(scale_layer=1))
    assert np.abs(np.asarray(changed.logits) - np.asarray(ref.logits)).max() > 1e-3


def test_callable_and_sequence_attention(setup):
    cfg, model, inputs = setup
    seen = []

    def attn(q, k, v, *, layer, **kw):
        seen.append(layer)
        return dense_attention(q, k, v, **kw)

    ref = prefill(model, inputs).logits
    np.testing.assert_allclose(np.asarray(prefill(model, inputs, attention=attn).logits), np.asarray(ref), atol=1e-5)
    assert seen == [0, 1, 2]
    seq = prefill(model, inputs, attention=[attn, dense_attention, attn]).logits
    np.testing.assert_allclose(np.asarray(seq), np.asarray(ref), atol=1e-5)
    with pytest.raises(ValueError, match="per-layer"):
        prefill(model, inputs, attention=[attn])


def test_hidden_states_requested_layers(setup):
    cfg, model, inputs = setup
    L = cfg.text.num_hidden_layers
    out = prefill(model, inputs, hidden_layers=(L // 2, L - 1))
    assert set(out.hidden_states) == {L // 2, L - 1}
    t = inputs["input_ids"].shape[1]
    assert out.hidden_states[L // 2].shape == (1, t, cfg.text.hidden_size)
    # the same states come out of the unrolled (per-layer) path
    unrolled = prefill(model, inputs, attention=RecordingHook(), hidden_layers=(L // 2, L - 1))
    for i in (L // 2, L - 1):
        np.testing.assert_allclose(np.asarray(out.hidden_states[i]), np.asarray(unrolled.hidden_states[i]), atol=1e-5)
    with pytest.raises(ValueError, match="hidden_layers"):
        prefill(model, inputs, hidden_layers=(L + 1,))


def test_bad_inputs_raise(setup):
    cfg, model, inputs = setup
    with pytest.raises(ValueError, match="video pad tokens"):
        prefill(model, {**inputs, "input_ids": inputs["input_ids"][:, :-5]})
    with pytest.raises(ValueError, match="pixel_values_videos"):
        prefill(model, {**inputs, "pixel_values_videos": inputs["pixel_values_videos"][:-1]})
    with pytest.raises(ValueError, match="tokens"):
        decode_step(model, prefill(model, inputs).cache, jnp.asarray([1, 2]))
    with pytest.raises(ValueError, match="model"):
        prefill(object(), inputs)


# ----------------------------------------------------------------- issue 13: scanned / chunked prefill
class PerLayerOnly:
    """A config seen through the per-layer hook only: the layers run unrolled (today's path before
    sparse configs ran under lax.scan), the reference for the scanned path."""

    def __init__(self, config):
        self.config = config

    def layer_attention(self, layer):
        return self.config.layer_attention(layer)


def _mixed_config(cfg):
    """Different patterns per layer and per head (GQA groups with mixed plans), small blocks."""
    c = cfg.text
    kw = dict(block_q=16, block_k=16)
    a = AShape(sink=4, local=16, **kw)
    vs = VerticalSlash(vertical_size=8, slash_size=16, last_q=8, **kw)
    grid = Grid(local=16, last_q=8, stride_space=(8, 12, 16), **kw)
    layers = []
    for i in range(c.num_hidden_layers):
        heads = [(a, Dense(**kw), vs, grid)[(i + h) % 4] for h in range(c.num_attention_heads)]
        layers.append(tuple(heads))
    return mmjax.SparseConfig(tuple(layers), options=mmjax.patterns.KernelOptions(implementation="reference"))


def _long_prompt(cfg, frames=8):
    return video_prompt(cfg, frames=frames, rng=np.random.default_rng(1), grid_hw=(4, 8))


def test_scanned_sparse_prefill_equals_per_layer_path(setup):
    cfg, model, _ = setup
    inputs = _long_prompt(cfg)
    config = _mixed_config(cfg)
    scanned = prefill(model, inputs, attention=config)
    unrolled = prefill(model, inputs, attention=PerLayerOnly(config))
    np.testing.assert_allclose(np.asarray(scanned.logits), np.asarray(unrolled.logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(scanned.cache.k), np.asarray(unrolled.cache.k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(scanned.cache.v), np.asarray(unrolled.cache.v), atol=1e-5)
    dense = prefill(model, inputs)
    assert np.abs(np.asarray(scanned.logits) - np.asarray(dense.logits)).max() > 1e-4  # the patterns act


def test_prefill_gives_grid_heads_the_video_frame_size(setup):
    """The video's tokens per frame (4 x 8 patches merged 2 x 2: 8) reach the patterns: Grid(stride="frame") heads
    run at stride 8 (the result of Grid(stride=8)); a hook without the frame size cannot run them (it says so)."""
    cfg, model, _ = setup
    inputs = _long_prompt(cfg)
    p = qwen_vl.prepare_inputs(cfg, **{k: inputs[k] for k in PROCESSOR_KEYS if k in inputs})
    c, kw = cfg.text, dict(local=16, last_q=8, block_q=16, block_k=16)

    def config(pattern):
        return mmjax.SparseConfig.uniform(pattern, num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                                          options=mmjax.patterns.KernelOptions(implementation="reference"))

    assert qwen_vl.frame_tokens(cfg, p) == 8
    assert qwen_vl.frame_tokens(cfg, dataclasses.replace(p, video_grids=((2, 4, 8), (2, 4, 4)))) is None  # differ
    assert qwen_vl.frame_tokens(cfg, dataclasses.replace(p, video_grids=())) is None
    with pytest.raises(ValueError, match="^frame_tokens: expected None or an int >= 1"):
        config(Grid(**kw)).uniform_attention(frame_tokens=0)
    frame = prefill(model, inputs, attention=config(Grid(stride="frame", **kw)))
    fixed = prefill(model, inputs, attention=config(Grid(stride=8, **kw)))
    np.testing.assert_array_equal(np.asarray(frame.logits), np.asarray(fixed.logits))
    assert np.abs(np.asarray(frame.logits) - np.asarray(prefill(model, inputs).logits)).max() > 1e-4
    with pytest.raises(ValueError, match="needs the tokens per frame"):
        prefill(model, inputs, attention=PerLayerOnly(config(Grid(stride="frame", **kw))))


def _static_config(cfg):
    """Position-rule patterns only (no estimation), so a chunk's mask is the rows of the whole mask."""
    c = cfg.text
    kw = dict(block_q=16, block_k=16)
    heads = tuple((AShape(sink=4, local=16, **kw), Dense(**kw))[h % 2] for h in range(c.num_attention_heads))
    return mmjax.SparseConfig((heads,) * c.num_hidden_layers,
                              options=mmjax.patterns.KernelOptions(implementation="reference"))


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_chunked_prefill_equals_one_shot(setup, attention):
    """Chunked prefill computes the same masks as one shot (patterns that estimate their index
    estimate it from each chunk's own last queries, so only rule-based patterns are compared)."""
    cfg, model, _ = setup
    inputs = _long_prompt(cfg)
    spec = _static_config(cfg) if attention == "sparse" else "dense"
    t = inputs["input_ids"].shape[1]
    L = cfg.text.num_hidden_layers
    one = prefill(model, inputs, attention=spec, hidden_layers=(1, L))
    for chunk in (48, t - 5):
        got = prefill(model, inputs, attention=spec, chunk_tokens=chunk, hidden_layers=(1, L))
        np.testing.assert_allclose(np.asarray(got.logits), np.asarray(one.logits), atol=2e-5)
        np.testing.assert_allclose(np.asarray(got.cache.k), np.asarray(one.cache.k), atol=2e-5)
        np.testing.assert_allclose(np.asarray(got.cache.v), np.asarray(one.cache.v), atol=2e-5)
        for i in (1, L):
            np.testing.assert_allclose(np.asarray(got.hidden_states[i]), np.asarray(one.hidden_states[i]),
                                       atol=2e-5)
        assert int(got.cache.length) == t
        np.testing.assert_array_equal(np.asarray(got.cache.valid), np.asarray(one.cache.valid))
        np.testing.assert_array_equal(np.asarray(got.cache.next_position), np.asarray(one.cache.next_position))


def test_chunked_prefill_of_a_right_padded_batch(setup):
    cfg, model, inputs = setup
    t = inputs["input_ids"].shape[1]
    ids = np.zeros((2, t), np.int64)
    ids[0] = inputs["input_ids"][0]
    ids[1, :4] = [5, 6, 7, 8]
    mask = np.zeros((2, t), np.int64)
    mask[0], mask[1, :4] = 1, 1
    batch = {**inputs, "input_ids": ids, "attention_mask": mask}
    one = prefill(model, batch)
    got = prefill(model, batch, chunk_tokens=7)
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(one.logits), atol=2e-5)
    with pytest.raises(ValueError, match="chunk_tokens"):
        prefill(model, batch, chunk_tokens=0)


def test_fp8_kv_cache(setup):
    _, model, inputs = setup
    ref = prefill(model, inputs)
    fp8 = prefill(model, inputs, kv_dtype=jnp.float8_e4m3fn)
    np.testing.assert_allclose(np.asarray(fp8.logits), np.asarray(ref.logits), atol=1e-6)  # prefill attends fresh k/v
    assert fp8.cache.k.dtype == jnp.float8_e4m3fn and fp8.cache.k_scale.shape == fp8.cache.k.shape[:-1]
    t = inputs["input_ids"].shape[1]
    deq = np.asarray(dequantize_kv(fp8.cache.k, fp8.cache.k_scale, jnp.float32))[:, :, :t]
    want = np.asarray(ref.cache.k)[:, :, :t]
    rel = np.abs(deq - want).max(-1) / np.abs(want).max(-1)
    assert rel.max() < 2 ** -4  # e4m3 keeps 3 mantissa bits of each vector, scaled to its maximum
    l_ref, _ = decode_step(model, ref.cache, jnp.asarray([9]))
    l_fp8, c8 = decode_step(model, fp8.cache, jnp.asarray([9]))
    assert c8.k.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(np.asarray(l_fp8), np.asarray(l_ref), atol=0.05 * np.abs(np.asarray(l_ref)).max())
    with pytest.raises(ValueError, match="kv_dtype"):
        prefill(model, inputs, kv_dtype=jnp.int8)


def _temp_bytes(model, inputs, attention):
    p = qwen_vl.prepare_inputs(model.config, **inputs)
    img, vid = qwen_vl.visual_inputs(model, p)
    t = p.input_ids.shape[1]
    lowered = qwen_vl.prefill_language_model.lower(
        model, p.input_ids, img, vid, p.position_ids, p.attention_mask, p.token_types, p.rope_deltas,
        attention=resolve_attention(attention), max_length=t, mlp_chunk=32)
    return lowered.compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("sparse", [False, True])
def test_prefill_working_memory_does_not_grow_with_depth(sparse):
    """XLA's own plan for the prefill program: the temporaries are one layer's working set."""
    temps = {}
    for layers in (2, 6):
        cfg = small_config(layers=layers)
        model = Qwen2_5_VL(cfg, dtype=jnp.float32, key=jax.random.key(0))
        attention = (mmjax.SparseConfig.uniform(AShape(sink=8, local=32, block_q=16, block_k=16), num_layers=layers,
                                                num_heads=cfg.text.num_attention_heads,
                                                options=mmjax.patterns.KernelOptions(implementation="reference"))
                     if sparse else "dense")
        temps[layers] = _temp_bytes(model, _long_prompt(cfg), attention)
    assert temps[6] <= temps[2] * 1.05 + 4096, temps


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_scanned_sparse_config_through_the_triton_kernel():
    cfg = small_config(head_dim=32, layers=3)
    model = Qwen2_5_VL(cfg, dtype=jnp.bfloat16, key=jax.random.key(3))
    inputs = _long_prompt(cfg)
    c = cfg.text
    kw = dict(block_q=32, block_k=32)
    config = mmjax.SparseConfig(tuple(tuple((AShape(sink=8, local=64, **kw), Dense(**kw))[(i + h) % 2]
                                            for h in range(c.num_attention_heads)) for i in range(c.num_hidden_layers)))
    scanned = prefill(model, inputs, attention=config)
    unrolled = prefill(model, inputs, attention=PerLayerOnly(config))
    np.testing.assert_allclose(np.asarray(scanned.logits), np.asarray(unrolled.logits), atol=2e-2)
    dense_cfg = mmjax.SparseConfig.uniform(Dense(**kw), num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads)
    got = prefill(model, inputs, attention=dense_cfg)
    want = prefill(model, inputs, attention="cudnn")
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=5e-2)
    chunked = prefill(model, inputs, attention="cudnn", chunk_tokens=100)
    np.testing.assert_allclose(np.asarray(chunked.logits), np.asarray(want.logits), atol=5e-2)
