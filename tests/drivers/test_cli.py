"""The `mmjax` command: every subcommand and every benchmark reachable, with its own help."""

import subprocess
import sys

import numpy as np
import pytest

from mmjax.drivers import bench
from mmjax.drivers.cli import COMMANDS, main


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
