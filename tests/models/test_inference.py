"""prefill / decode_step: cache consistency, padding, attention injection, hidden states."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.inference import decode_step, prefill
from models.attention import dense_attention
from models.qwen2_5_vl import Qwen2_5_VL, forward
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
