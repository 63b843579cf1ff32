"""`mmjax bench prefill` rows on the CPU (tiny models): a VLM video row and text-LM rows run through
`mmjax.prefill` and report what the table prints."""

import types

import numpy as np
import pytest

from mmjax.drivers.bench import prefill as bench


def _args(preset: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(model=None, preset=preset, layers=None, mlp_chunk=128, frames_per_chunk=None,
                                 chunk_tokens=None, kv_dtype="bf16", warm_budget_s=600.0, repeats=1, devices=1,
                                 sequence_parallel=1)


@pytest.mark.parametrize("preset, tokens, visual", [("7b", 256, 256), ("qwen3-30b-a3b", 200, 0)])
def test_row_runs_and_reports(preset, tokens, visual):
    row = bench.run_row(_args(preset), tokens, "dense")
    assert row["attention"] == "dense" and row["visual_tokens"] == visual
    assert row["tokens"] == (tokens + 18 if visual else tokens)
    assert row["warm_s"] > 0 and row["first_s"] >= row["warm_s"] * 0.5
    assert np.isclose(row["tokens_per_s"], row["tokens"] / row["warm_s"])


def test_text_inputs_are_valid_token_ids():
    cfg = bench.tiny_text_config(moe=False)
    ids = bench.text_inputs(cfg, 300)["input_ids"]
    assert ids.shape == (1, 300) and ids.dtype == np.int32
    assert 0 <= ids.min() and ids.max() < cfg.text.vocab_size and len(np.unique(ids)) > 50
