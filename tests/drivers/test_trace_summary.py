"""`mmjax.drivers.bench.trace_summary` on a hand-made Perfetto trace and on a real CPU trace."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from mmjax.drivers.bench import trace_summary as ts


def _trace():
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
            {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Modules"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "tid": 1, "name": "thread_name", "args": {"name": "python"}}]
    x = [("nccl_AllReduce_RING_LL", 7, 2000.0), ("sm90_xmma_gemm_bf16bf16", 7, 5000.0),
         ("sm90_xmma_gemm_bf16bf16", 7, 3000.0), ("block_sparse_attention_fwd", 7, 4000.0),
         ("loop_add_fusion", 7, 500.0), ("dot.12", 8, 99000.0)]
    ev = [{"ph": "X", "pid": 1, "tid": tid, "name": n, "ts": i * 1e4, "dur": d} for i, (n, tid, d) in enumerate(x)]
    ev.append({"ph": "X", "pid": 2, "tid": 1, "name": "python_call", "ts": 0.0, "dur": 1e6})
    ev.append({"ph": "X", "pid": 1, "tid": 9, "name": "jit_prefill_program", "ts": 0.0, "dur": 60000.0})
    return {"traceEvents": meta + ev}


def test_summarize_counts_stream_lines_once_by_kind():
    s = ts.summarize(_trace())
    assert list(s["devices"]) == ["/device:GPU:0"]  # the host process is not a device
    d = s["devices"]["/device:GPU:0"]
    assert d["busy_s"] == pytest.approx(0.0145)  # the derived "XLA Ops" line is not added again
    assert d["span_s"] == pytest.approx(0.0405)  # kernels at 0, 10, ..., 40 ms; the last one 0.5 ms long
    assert d["modules"] == {"jit_prefill_program": [pytest.approx(0.06), 1]}
    assert d["kinds"] == pytest.approx({"matmul": 0.008, "attention": 0.004, "collective": 0.002, "other": 0.0005})
    assert d["top"][0] == ["sm90_xmma_gemm_bf16bf16", pytest.approx(0.008), 2]
    assert s["lines"]["/device:GPU:0"]["XLA Ops"] == pytest.approx(0.099)
    assert "busy 0.01 s of a 0.04 s span" in ts.format_summary(s)


def test_kind_of_names():
    assert ts.kind_of("anonymous_mosaic_gpu_kernel") == "attention"
    assert ts.kind_of("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "collective"
    assert ts.kind_of("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT") == "matmul"
    assert ts.kind_of("gemm_fusion_dot_28") == "matmul"
    assert ts.kind_of("MemcpyH2D") == "copy"
    assert ts.kind_of("loop_multiply_fusion") == "other"


def test_summarize_without_stream_lines_takes_non_derived_gpu_lines():
    t = _trace()
    for e in t["traceEvents"]:
        if e.get("name") == "thread_name" and e["args"]["name"].startswith("Stream"):
            e["args"]["name"] = "Kernels"
    assert ts.summarize(t)["devices"]["/device:GPU:0"]["busy_s"] == pytest.approx(0.0145)


def test_summarize_dir_reads_a_jax_profiler_trace(tmp_path):
    f = jax.jit(lambda x: (x @ x).sum())
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        f(x).block_until_ready()
    path = ts.find_trace(str(tmp_path))
    with gzip.open(path, "rt") as fh:
        assert json.load(fh)
    s = ts.summarize_dir(str(tmp_path))
    assert any(v > 0 for lines in s["lines"].values() for v in lines.values())
    with pytest.raises(FileNotFoundError, match="log_dir"):
        ts.find_trace(str(tmp_path / "none"))
