"""The `mmjax` command: every subcommand and every benchmark reachable, with its own help."""

import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from mmjax.drivers import bench
from mmjax.drivers import search as search_cli
from mmjax.drivers.bench.report import write_result
from mmjax.drivers.cli import COMMANDS, main
from tests.fault_injection import interrupt_every_step


def test_top_level_help_lists_each_command_with_its_purpose(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, purpose) in COMMANDS.items():
        assert name in out and purpose[:40] in out


def test_bench_help_lists_every_benchmark(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, purpose) in bench.BENCHMARKS.items():
        assert name in out and purpose[:40] in out


@pytest.mark.parametrize("name", sorted(bench.BENCHMARKS))
def test_each_benchmark_has_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"mmjax bench {name}" in out and "--out" in out


def test_search_has_its_own_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["search", "--help"])
    assert e.value.code == 0
    assert "--calibration" in capsys.readouterr().out


def test_unknown_command_and_benchmark_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["nope"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["bench", "nope"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_bad_input_is_one_line_with_status_2(tmp_path):
    bad = tmp_path / "cal.npz"
    np.savez(bad, nothing=np.zeros(3))
    r = subprocess.run([sys.executable, "-m", "mmjax.drivers.cli", "search", "--calibration", str(bad), "--out",
                        str(tmp_path / "c.json"), "--quiet"], capture_output=True, text=True)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mmjax search: error:"), r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------- nothing silent, nothing long
BAD_VALUES = [
    (["bench", "kernels", "--seq-lens", "0"], r"--seq-lens: expected an integer in \[1, "),
    (["bench", "kernels", "--seq-lens", "-5"], r"--seq-lens: expected an integer in \[1, "),
    (["bench", "kernels", "--tile", "48", "64", "4", "3"], r"--tile: expected BQ, BK powers of two >= 16"),
    (["bench", "kernels", "--name", "../../x"], r"--name: expected a plain name"),
    (["bench", "momo", "--budget-s", "nan"], r"--budget-s: expected a finite number > 0"),
    (["bench", "momo", "--tile", "24", "4"], r"--tile: expected ROWS 0 or a power of two >= 16"),
    (["bench", "mixed", "--calib-len", "x"], r"--calib-len: expected an integer; received 'x'"),
    (["bench", "patterns", "--seq-lens", "0"], r"--seq-lens: expected an integer in \[1, "),
    (["bench", "patterns", "--sections", "fidelity", "--fidelity-patterns", "Grid(frame,hvs,local=0)"],
     r"--fidelity-patterns: unknown \['Grid\(frame,hvs,local=0\)'\]"),
    (["bench", "prefill", "--tokens", "16384", "0"], r"--tokens: expected an integer in \[1, "),
    (["bench", "prefill", "--configs", "flash"], r"--configs: expected one of cudnn, dense"),
    (["bench", "speculative", "--trees", "30-0-8"], r"--trees: TreeConfig.depth: expected a positive int"),
    (["bench", "tree_decode", "--tree-sizes", "0"], r"--tree-sizes: expected an integer in \[1, "),
    (["bench", "decode_layers", "--seq-lens", "1e9"], r"--seq-lens: expected an integer; received '1e9'"),
    (["search", "--calibration", "c.npz", "--out", "/nonexistent-dir/c.json"], r"/nonexistent-dir does not exist"),
]


@pytest.mark.parametrize("argv,match", BAD_VALUES, ids=[" ".join(a[:3]) for a, _ in BAD_VALUES])
def test_bad_values_are_one_line_errors_before_any_work(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and re.search(match, err[0]), err


def test_bench_out_must_be_a_writable_directory(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["bench", "kernels", "--out", str(blocker / "results")])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err


def _calibration(tmp_path, value=0.0):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 32, 2, 16), (1, 32, 1, 16), (1, 32, 1, 16)))
    q[0, 3, 1, 2] = value
    path = tmp_path / "cal.npz"
    np.savez(path, q_0=q, k_0=k, v_0=v, modality=np.zeros((1, 32), np.int32))
    return str(path)


def test_search_checks_out_before_searching(tmp_path, monkeypatch, capsys):
    def no_search(*a, **k):
        raise AssertionError("the search ran although --out could not be written")

    monkeypatch.setattr(search_cli, "search", no_search)
    out = tmp_path / "config.json"
    out.write_text("{}")
    assert main(["search", "--calibration", _calibration(tmp_path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists; pass overwrite=True" in err[0]
    assert out.read_text() == "{}"  # untouched
    with pytest.raises(SystemExit):
        main(["search", "--calibration", _calibration(tmp_path), "--out", str(tmp_path), "--quiet"])
    assert "is a directory" in capsys.readouterr().err


def test_nan_in_the_calibration_is_named(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["search", "--calibration", _calibration(tmp_path, np.nan), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"calibration q_0: expected finite values .* index \[0, 3, 1, 2\]", err[0])
    assert not out.exists()


def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    def boom(*a, **k):
        raise RuntimeError("kernel failed\non two lines")

    monkeypatch.setattr(search_cli, "search", boom)
    argv = ["search", "--calibration", _calibration(tmp_path), "--out", str(tmp_path / "c.json"), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mmjax search: error: RuntimeError: kernel failed on two lines (run `mmjax --debug ...` for the "
                   "traceback)"]
    with pytest.raises(RuntimeError, match="kernel failed"):
        main(["--debug"] + argv)


def test_result_names_cannot_leave_their_directory(tmp_path):
    with pytest.raises(ValueError, match="name: expected a plain name"):
        write_result(str(tmp_path), "../escape", {})
    path = write_result(str(tmp_path), "ok", {"x": 1})
    assert pathlib.Path(path).parent == tmp_path and json.loads(pathlib.Path(path).read_text())["x"] == 1


def test_benchmark_json_interrupted_at_every_step(tmp_path, monkeypatch):
    first = write_result(str(tmp_path), "run", {"rows": [1]})

    def check(n):
        assert [p.name for p in tmp_path.iterdir()] == [pathlib.Path(first).name]
        rows = json.loads(pathlib.Path(first).read_text())["rows"]
        return {1: "old", 2: "new"}[len(rows)]

    _, found = interrupt_every_step(monkeypatch, lambda: write_result(str(tmp_path), "run", {"rows": [1, 2]}), check,
                                    reset=lambda: write_result(str(tmp_path), "run", {"rows": [1]}))
    assert found[0] == "old" and "new" in found
