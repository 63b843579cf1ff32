"""Parity against Hugging Face transformers goldens (tests/models/fixtures, see tools/make_qwen_golden.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.inference import decode_step, prefill
from models.qwen2_5_vl import forward, prepare_inputs
from models.qwen2_5_vl.model import vision_features
from tests.models.conftest import first_row_inputs, get_model, load_case


def test_fixture_metadata_records_transformers_version(case):
    _, d = load_case(case)
    assert str(d["transformers_version"]).count(".") >= 1


def test_rope_index_matches_hf(case):
    inputs, d = load_case(case)
    p = prepare_inputs(get_model(case).config, **inputs)
    mask = inputs["attention_mask"].astype(bool)
    np.testing.assert_array_equal(np.asarray(p.position_ids)[:, mask], d["position_ids"][:, mask])
    np.testing.assert_array_equal(np.asarray(p.rope_deltas), d["rope_deltas"])


@pytest.mark.parametrize("kind", ["image", "video"])
def test_vision_features_fp32(case, kind):
    inputs, d = load_case(case)
    model = get_model(case)
    p = prepare_inputs(model.config, **inputs)
    pixels, grids = ((inputs["pixel_values"], p.image_grids) if kind == "image"
                     else (inputs["pixel_values_videos"], p.video_grids))
    feats = np.asarray(vision_features(model, jnp.asarray(pixels), grids))
    np.testing.assert_allclose(feats, d[f"{kind}_features"], atol=1e-4, rtol=1e-4)


def test_vision_frame_chunking_is_exact():
    inputs, _ = load_case("vl_nested")
    model = get_model("vl_nested")
    grids = ((3, 6, 4),)
    pixels = jnp.asarray(inputs["pixel_values_videos"][:72])
    one = vision_features(model, pixels, grids, frames_per_chunk=1)
    two = vision_features(model, pixels, grids, frames_per_chunk=2)  # pads the third frame
    np.testing.assert_allclose(np.asarray(one), np.asarray(two), atol=1e-5)


def test_logits_fp32(case):
    inputs, d = load_case(case)
    logits = np.asarray(forward(get_model(case), **inputs))
    mask = inputs["attention_mask"].astype(bool)
    np.testing.assert_allclose(logits[mask], d["logits"][mask], atol=2e-4, rtol=1e-4)


def test_logits_bf16(case):
    inputs, d = load_case(case)
    logits = np.asarray(forward(get_model(case, jnp.bfloat16), **inputs))
    mask = inputs["attention_mask"].astype(bool)
    scale = np.abs(d["logits"][mask]).max()
    # HF bf16 is itself ~2-3% (of the largest logit) off its fp32 result; we must be no worse
    hf_err = np.abs(d["logits_bf16"][mask] - d["logits"][mask]).max()
    assert np.abs(logits[mask] - d["logits"][mask]).max() < max(1.25 * hf_err, 0.01 * scale)
    assert np.abs(logits[mask] - d["logits_bf16"][mask]).max() < 0.04 * scale
    agree = (logits[mask].argmax(-1) == d["logits"][mask].argmax(-1)).mean()
    assert agree > 0.95


def test_mlp_chunking_and_hidden_states_consistent():
    inputs, d = load_case("vl_flat_tied")
    model = get_model("vl_flat_tied")
    full = prefill(model, inputs, hidden_layers=(0, 1, 3), mlp_chunk=None)
    chunked = prefill(model, inputs, hidden_layers=(0, 1, 3), mlp_chunk=7)
    np.testing.assert_allclose(np.asarray(full.logits), np.asarray(chunked.logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(full.logits), d["logits"][:, -1], atol=2e-4)
    for i in (0, 1, 3):
        np.testing.assert_allclose(np.asarray(full.hidden_states[i]), np.asarray(chunked.hidden_states[i]), atol=1e-5)
    # index 3 = final normed states: the tied lm head on them reproduces the logits
    emb = np.asarray(model.language_model.embed[...])
    np.testing.assert_allclose(np.asarray(full.hidden_states[3])[0] @ emb.T, d["logits"][0], atol=2e-4)
    assert not np.allclose(np.asarray(full.hidden_states[0]), np.asarray(full.hidden_states[1]))


def test_greedy_decode_matches_hf_generate(case):
    inputs, d = load_case(case)
    model = get_model(case)
    out = prefill(model, first_row_inputs(inputs, d), max_length=64)
    tok, cache, got = jnp.argmax(out.logits, -1), out.cache, []
    for _ in range(len(d["generate_row0_tokens"])):
        got.append(int(tok[0]))
        logits, cache = decode_step(model, cache, tok)
        tok = jnp.argmax(logits, -1)
    assert got == d["generate_row0_tokens"].tolist()


def test_hidden_states_match_hf_output_hidden_states(case):
    """hidden_layers uses HF's numbering: 0 embeddings, i output of layer i-1, L the final normed states."""
    inputs, d = load_case(case)
    model = get_model(case)
    layers = tuple(range(d["hidden_states"].shape[0]))
    out = prefill(model, inputs, hidden_layers=layers)
    mask = inputs["attention_mask"].astype(bool)
    for i in layers:
        np.testing.assert_allclose(np.asarray(out.hidden_states[i])[mask], d["hidden_states"][i][mask], atol=1e-4)
