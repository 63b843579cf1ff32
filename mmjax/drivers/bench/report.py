"""Benchmark results: a printed table and a JSON file named by device and date.

The JSON is written atomically (a temporary file beside it, renamed into place). Benchmarks
rewrite their file after every section, so a result of the same name, device and date is
replaced (``overwrite=True`` is their explicit choice); the name is checked to be a plain
file-name stem."""

from __future__ import annotations

import datetime
import json
import os
import platform

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt

from mmjax.files import atomic_write, atomic_write_with, check_output_dir, safe_name, slug
from mmjax.timing import device_name


def write_result(out_dir: str, name: str, payload: dict, *, overwrite: bool = True) -> str:
    """Write ``payload`` with device, date and versions to ``out_dir/name_<device>_<date>.json``
    atomically; returns the path. ``name`` must be a plain stem (`mmjax.files.safe_name`)."""
    name = safe_name(name)
    out_dir = check_output_dir(out_dir)
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "device": device_name(),
        "backend": jax.default_backend(),
        "date": now.strftime("%Y-%m-%d"),
        "time_utc": now.strftime("%H:%M:%S"),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }
    path = os.path.join(out_dir, f"{name}_{slug(meta['device'], 'device')}_{meta['date']}.json")
    return atomic_write(path, json.dumps({"meta": meta, **payload}, indent=1), overwrite=overwrite)


def rel_err(a, b) -> float:
    """Relative L2 error ``|a - b| / |b|`` of two arrays (any shape), in float32."""
    a, b = jnp.asarray(a, jnp.float32).ravel(), jnp.asarray(b, jnp.float32).ravel()
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def save_figure_beside(result_path: str, fig) -> str:
    """Write the matplotlib figure ``fig`` as a PNG next to the result JSON ``result_path`` (same stem; atomic)
    and close it. Returns the PNG's path."""
    png = os.path.splitext(result_path)[0] + ".png"
    atomic_write_with(png, lambda fh: fig.savefig(fh, format="png", dpi=110), binary=True, overwrite=True)
    plt.close(fig)
    return png


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """rows of dicts; columns of (key, header, format). Returns and prints the table."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([
            ("-" if r.get(k) is None else format(r[k], fmt)) for k, _, fmt in columns
        ])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    print(text, flush=True)
    return text
