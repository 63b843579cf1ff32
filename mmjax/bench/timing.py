"""Timing and result-file helpers shared by the benchmarks."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def time_fn(fn: Callable[[], Any], *, warmup: int = 1, reps: int = 5, min_batch_s: float = 0.02) -> dict:
    """Median wall time (ms) of ``fn()`` (which must return jax arrays) after warm-up.

    Short calls are run back to back in batches lasting about ``min_batch_s`` so that host
    dispatch overlaps device work; the per-call time of each batch is one sample.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn())
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    single = time.perf_counter() - t0
    batch = max(1, min(50, int(min_batch_s / max(single, 1e-6))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(batch):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / batch * 1e3)
    return {"ms": statistics.median(samples), "min_ms": min(samples), "samples_ms": samples,
            "calls_per_sample": batch}


def device_name() -> str:
    dev = jax.devices()[0]
    return getattr(dev, "device_kind", dev.platform)


def write_result(out_dir: str, name: str, payload: dict) -> str:
    """Write ``payload`` with device, date and versions to ``out_dir/name_<device>_<date>.json``."""
    os.makedirs(out_dir, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc)
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
    with open(path, "w") as f:
        json.dump({"meta": meta, **payload}, f, indent=1)
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
