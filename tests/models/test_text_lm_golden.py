"""Llama / Qwen3 / Qwen3-MoE parity against transformers goldens (tools/make_text_lm_golden.py): logits (fp32 and
bf16), hidden states, chunked prefill of a left-padded batch, greedy generate."""

import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax.inference import prefill
from tests.models.text_lm_cases import FAMILY_OF, TEXT_CASES, get_text_model, load_text_case, row0


@pytest.fixture(params=TEXT_CASES)
def case(request):
    return request.param


def test_fixture_records_versions_and_margin(case):
    _, d = load_text_case(case)
    assert str(d["transformers_version"]).count(".") >= 1
    assert float(d["generate_min_margin"]) >= 0.02  # greedy ids are decided by more than float32 noise


def test_logits_fp32(case):
    inputs, d = load_text_case(case)
    model = get_text_model(case)
    logits = np.asarray(FAMILY_OF[case].forward(model, **inputs))
    mask = inputs["attention_mask"].astype(bool)
    assert mask.sum() < mask.size  # the second row is left padded
    np.testing.assert_allclose(logits[mask], d["logits"][mask], atol=2e-4, rtol=0)


@pytest.mark.parametrize("case", ["llama", "qwen3_moe"])
def test_logits_bf16(case):
    inputs, d = load_text_case(case)
    logits = np.asarray(FAMILY_OF[case].forward(get_text_model(case, jnp.bfloat16), **inputs))
    mask = inputs["attention_mask"].astype(bool)
    scale = np.abs(d["logits"][mask]).max()
    hf_err = np.abs(d["logits_bf16"][mask] - d["logits"][mask]).max()  # transformers' own bf16 error
    assert np.abs(logits[mask] - d["logits"][mask]).max() < max(1.5 * hf_err, 0.01 * scale)
    assert (logits[mask].argmax(-1) == d["logits"][mask].argmax(-1)).mean() > 0.9


def test_hidden_states_match_hf_output_hidden_states():
    inputs, d = load_text_case("llama")
    layers = tuple(range(d["hidden_states"].shape[0]))
    out = prefill(get_text_model("llama"), inputs, hidden_layers=layers)
    mask = inputs["attention_mask"].astype(bool)
    for i in layers:
        np.testing.assert_allclose(np.asarray(out.hidden_states[i])[mask], d["hidden_states"][i][mask], atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.logits), d["logits"][:, -1], atol=2e-4)
    assert out.token_types is None and out.position_ids.shape == inputs["input_ids"].shape


def test_chunked_prefill_of_padded_batch_with_small_mlp_chunks():
    """MoE routing per sequence chunk and prompt chunks against the cache give the full-sequence result."""
    inputs, d = load_text_case("qwen3_moe")
    out = prefill(get_text_model("qwen3_moe"), inputs, chunk_tokens=10, mlp_chunk=6, hidden_layers=(3,))
    np.testing.assert_allclose(np.asarray(out.logits), d["logits"][:, -1], atol=2e-4)
    mask = inputs["attention_mask"].astype(bool)
    np.testing.assert_allclose(np.asarray(out.hidden_states[3])[mask], d["hidden_states"][3][mask], atol=1e-4)


def test_greedy_generate_matches_hf_generate(case):
    _, d = load_text_case(case)
    out = mmjax.generate(get_text_model(case), row0(d), max_new_tokens=len(d["generate_row0_tokens"]))
    assert out.tokens[0].tolist() == d["generate_row0_tokens"].tolist()
