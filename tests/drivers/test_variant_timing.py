"""The side-by-side benches' shared runner (tools/variant_timing.py): rows, the failure of one variant, the files."""

import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
from variant_timing import run_bench  # noqa: E402


def _broken(x):
    raise ValueError("no such kernel here")


def test_run_bench_times_checks_and_records_a_failure(tmp_path, capsys):
    variants = {"sum": jax.jit(lambda x: x.sum()), "broken": _broken, "sum twice": jax.jit(lambda x: x.sum() * 2.0)}
    rc = run_bench(["--out", str(tmp_path), "--lens", "64", "128", "--reps", "1", "--batch-s", "0.001"], doc="bench",
                   stem="toy", meta={"what": "toy"}, variants=lambda: variants,
                   inputs=lambda s: (jnp.arange(s, dtype=jnp.float32) + 1.0,),
                   check=lambda got, want: {"ratio": float(got / want)}, columns="ratio",
                   title=lambda m: f"{m['device']}: {m['what']}")
    assert rc == 0
    result = json.loads((tmp_path / "toy.json").read_text())
    assert result["meta"]["what"] == "toy" and (tmp_path / "toy.png").stat().st_size > 0
    rows = {(r["seq_len"], r["variant"]): r for r in result["rows"]}
    assert len(rows) == 6
    for s in (64, 128):
        assert rows[s, "sum"]["ratio"] == 1.0 and rows[s, "sum"]["speedup"] == 1.0
        assert rows[s, "sum twice"]["ratio"] == 2.0 and rows[s, "sum twice"]["ms"] > 0
        assert "no such kernel here" in rows[s, "broken"]["error"] and "ms" not in rows[s, "broken"]
    assert "FAILED" in capsys.readouterr().out
