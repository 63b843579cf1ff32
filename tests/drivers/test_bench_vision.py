"""`mmjax bench vision` on a CPU: the XLA variants of the tiny tower run, agree, and are written as JSON + PNG;
the matmul FLOP count is the tower's."""

import json
import os

import pytest

from mmjax.drivers.bench import vision as bench_vision
from mmjax.drivers.cli import main
from models.qwen2_5_vl.config import preset


def test_bench_vision_writes_rows_json_and_plot(tmp_path, capsys):
    assert main(["bench", "vision", "--out", str(tmp_path), "--name", "vis", "--reps", "2",
                 "--variants", "xla_gather,xla,cudnn"]) == 0
    files = sorted(os.listdir(tmp_path))
    assert [f.rsplit(".", 1)[1] for f in files] == ["json", "png"] and files[0].startswith("vis_")
    rows = json.load(open(tmp_path / files[0]))["rows"]
    assert [r["variant"] for r in rows] == ["xla_gather", "xla"]  # cuDNN is left out on a CPU
    for r in rows:
        assert r["ms"] > 0 and r["matmul_tflops"] > 0 and r["max_diff"] < 1e-5
    assert "patches/s" in capsys.readouterr().out


def test_matmul_flops_of_the_7b_tower():
    c = preset("7b").vision
    per_patch = bench_vision.matmul_flops(c, 1)
    # 32 blocks of 2 * (1280 * 3840 + 1280 * 1280 + 3 * 1280 * 3420) plus embedding and merger: ~1.27 GFLOP
    assert 1.25e9 < per_patch < 1.30e9


def test_bad_variant_is_named():
    with pytest.raises(SystemExit):
        main(["bench", "vision", "--variants", "xla,flash", "--out", ""])
