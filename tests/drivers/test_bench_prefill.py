"""`mmjax bench prefill` rows on the CPU (tiny models): a VLM video row and text-LM rows run through
`mmjax.prefill` and report what the table prints."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax.drivers.bench import prefill as bench
from mmjax.inference import PROCESSOR_KEYS
from mmjax.patterns import Grid
from models.qwen2_5_vl import Qwen2_5_VL
from tests.models.helpers import small_config, video_prompt


def _args(preset: str, profile: str | None = None, matmul: str = "bf16") -> types.SimpleNamespace:
    return types.SimpleNamespace(model=None, preset=preset, layers=None, mlp_chunk=128, frames_per_chunk=None,
                                 chunk_tokens=None, kv_dtype="bf16", warm_budget_s=600.0, repeats=1, devices=1,
                                 sequence_parallel=1, breakdown=True, profile=profile, matmul=matmul)


@pytest.mark.parametrize("preset, tokens, visual, matmul", [("7b", 256, 256, "fp8"), ("qwen3-30b-a3b", 200, 0, "bf16")])
def test_row_runs_and_reports(preset, tokens, visual, matmul, tmp_path):
    profile = None if visual else str(tmp_path)  # --profile: one more call traced (no GPU kernels on a CPU)
    row = bench.run_row(_args(preset, profile, matmul), tokens, "dense")
    assert row["matmul"] == matmul
    assert ("profiled_s" in row) == (profile is not None)
    if profile:
        assert row["profiled_s"] > 0 and row["profile"] == {} and list(tmp_path.glob("*/plugins/profile/*/*.json.gz"))
    assert row["attention"] == "dense" and row["visual_tokens"] == visual
    assert row["tokens"] == (tokens + 18 if visual else tokens)
    assert row["warm_s"] > 0 and row["first_s"] >= row["warm_s"] * 0.5
    assert np.isclose(row["tokens_per_s"], row["tokens"] / row["warm_s"])
    assert row["host_s"] > 0 and (row["vision_s"] > 0) == (visual > 0)
    assert np.isclose(row["decoder_s"], row["warm_s"] - row["host_s"] - row["vision_s"])


def test_video_inputs_without_pixels_are_a_view():
    cfg = bench.tiny_config()
    full, view = bench.video_inputs(cfg, 512), bench.video_inputs(cfg, 512, pixels=False)
    assert view["pixel_values_videos"].shape == full["pixel_values_videos"].shape
    assert view["pixel_values_videos"].strides[0] == 0
    np.testing.assert_array_equal(view["input_ids"], full["input_ids"])


def test_prefill_memory_report_tool(tmp_path):
    """tools/prefill_memory_report.py compiles the 7B shape's prefill program from shapes alone (no weights)
    and writes XLA's memory plan."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dump = tmp_path / "dump"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*prefill.* --xla_dump_hlo_pass_re=^$")
    r = subprocess.run([sys.executable, os.path.join(root, "tools", "prefill_memory_report.py"), "--abstract",
                        "--tokens", "1024", "--dump", str(dump), "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "prefill_memory_1024_1x1.json").read_text())
    assert report["tokens"] == 1042 and report["memory_gib"]["argument_size_in_bytes"] > 14  # the 7B weights
    assert report["largest"] and report["largest"][0]["gib"] >= report["largest"][-1]["gib"]


def test_text_inputs_are_valid_token_ids():
    cfg = bench.tiny_text_config(moe=False)
    ids = bench.text_inputs(cfg, 300)["input_ids"]
    assert ids.shape == (1, 300) and ids.dtype == np.int32
    assert 0 <= ids.min() and ids.max() < cfg.text.vocab_size and len(np.unique(ids)) > 50


def test_child_keeps_partial_rows_and_names_failures(monkeypatch):
    """A row's process prints its row as it goes: a timeout keeps what was measured, a crash its error line."""
    import json as _json
    import subprocess

    args = types.SimpleNamespace(passthrough=[], devices=1)
    partial = _json.dumps({"tokens": 9, "attention": "ashape", "first_s": 3.0, "warm_s": 2.0})

    def timeout(*a, **k):
        raise subprocess.TimeoutExpired(a[0], 5.0, output=partial + "\n")
    monkeypatch.setattr(subprocess, "run", timeout)
    row = bench._child(args, 9, "ashape", 5.0)
    assert row["warm_s"] == 2.0 and row["error"] == "timed out after 5 s"

    crash = _json.dumps({"tokens": 9, "attention": "ashape", "error": "JaxRuntimeError: RESOURCE_EXHAUSTED: oom"})
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=1, stdout=partial + "\n"
                                                                                   + crash + "\n"))
    assert bench._child(args, 9, "ashape", 5.0)["error"].startswith("JaxRuntimeError: RESOURCE_EXHAUSTED")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=-9, stdout=""))
    assert bench._child(args, 9, "ashape", 5.0) == {"tokens": 9, "attention": "ashape", "error": "exit status -9"}


@pytest.mark.parametrize("name, preset, model, want", [
    ("prefill", "7b", None, "prefill"), ("prefill", "llava-ov-7b", None, "prefill-llava-ov-7b"),
    ("prefill", "7b", "/ckpt/Qwen2.5-VL-7B Instruct/", "prefill-Qwen2.5-VL-7B-Instruct"),
    ("mine", "qwen3-30b-a3b", None, "mine")])
def test_result_name_keeps_models_apart(name, preset, model, want):
    assert bench.result_name(name, preset, model) == want


def test_compile_time_compiles_what_prefill_runs_with_the_frame_size():
    """The compile-time column compiles the prefill program with the attention `mmjax.prefill` gives it: Grid heads
    with ``stride="frame"`` get the video's frame size (without it they raise)."""
    cfg = small_config()
    model = Qwen2_5_VL(cfg, dtype=jnp.float32, key=jax.random.key(7))
    inputs = video_prompt(cfg, frames=8, rng=np.random.default_rng(1), grid_hw=(4, 8))
    inputs = {k: inputs[k] for k in PROCESSOR_KEYS if k in inputs}
    config = mmjax.SparseConfig.uniform(Grid(stride="frame", local=16, last_q=8, block_q=16, block_k=16),
                                        num_layers=cfg.text.num_hidden_layers,
                                        num_heads=cfg.text.num_attention_heads,
                                        options=mmjax.patterns.KernelOptions(implementation="reference"))
    assert bench.compile_seconds(model, inputs, config, {}) > 0
