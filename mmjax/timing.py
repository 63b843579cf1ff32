"""Wall-clock timing of jitted calls (used by the kernel-aware search and by the benchmarks)."""

from __future__ import annotations

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
