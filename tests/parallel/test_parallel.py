"""Runs `tests/parallel/sharded_cases.py` on 4 virtual CPU devices in a subprocess (the device count must
be set before JAX starts, and the rest of the suite keeps one device); checks the mesh helpers that
need only one device here."""

import json
import os
import subprocess
import sys

import jax
import pytest

from mmjax.drivers.cli import main as cli_main
from mmjax.parallel import make_mesh
from tests.parallel import sharded_cases

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_cases(marks: str):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pytest", sharded_cases.__file__, "-q", "-x", "-n", "0", "-m", marks,
                        "-p", "no:cacheprovider"], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout, r.stdout[-3000:]


def test_sharded_cases_on_four_devices():
    _run_cases("not gpu and not slow")


@pytest.mark.slow
def test_slow_sharded_cases_on_four_devices():
    _run_cases("slow")


def test_make_mesh_checks_its_sizes():
    mesh = make_mesh(1, 1)
    assert mesh.axis_names == ("tp", "sp") and mesh.devices.size == 1
    with pytest.raises(ValueError, match="tp: expected an int >= 1"):
        make_mesh(0)
    with pytest.raises(ValueError, match=f"tp \\* sp: expected at most the {jax.device_count()} devices"):
        make_mesh(jax.device_count() + 1)


@pytest.mark.slow
def test_bench_prefill_on_two_devices(tmp_path, capsys):
    """`mmjax bench prefill --devices 2` on the CPU: the row's process gets 2 virtual devices and prefills the
    tiny model in its tensor-parallel layout."""
    rc = cli_main(["bench", "prefill", "--tokens", "256", "--configs", "dense", "--devices", "2", "--layers", "1",
                   "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 0, err
    (path,) = tmp_path.glob("prefill_*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert "error" not in row and row["devices"] == 2 and row["warm_s"] > 0, row
