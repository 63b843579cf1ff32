"""`mmjax bench slash_windows` on a CPU: both layouts of one index run, match the reference, and the table
and JSON carry the pair ratios."""

import json

from mmjax.drivers.bench import slash_windows


def test_bench_slash_windows_runs_on_cpu(tmp_path, capsys):
    assert slash_windows.main(["--lengths", "384", "--reps", "1", "--slash", "40", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "windows pairs / named" in out
    (path,) = tmp_path.glob("slash-windows_*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["tokens"] == 384 and row["slash"] == 40
    assert 1.0 <= row["windows_pairs_ratio"] <= row["blocks_pairs_ratio"]
    assert row["windows_rel_err"] < 1e-5 and row["blocks_rel_err"] < 1e-5
    assert list(tmp_path.glob("slash-windows_*.png"))
