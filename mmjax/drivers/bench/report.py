"""Benchmark results: a printed table and a JSON file named by device and date."""

from __future__ import annotations

import datetime
import json
import os
import platform

import jax

from mmjax.timing import device_name


def write_result(out_dir: str, name: str, payload: dict) -> str:
    """Write ``payload`` with device, date and versions to ``out_dir/name_<device>_<date>.json``."""
    os.makedirs(out_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "device": device_name(),
        "backend": jax.default_backend(),
        "date": now.strftime("%Y-%m-%d"),
        "time_utc": now.strftime("%H:%M:%S"),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }
    slug = meta["device"].replace(" ", "-").replace("/", "-")
    path = os.path.join(out_dir, f"{name}_{slug}_{meta['date']}.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, **payload}, f, indent=1)
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    return path


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
