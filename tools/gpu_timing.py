"""The timing helper of the kernel scripts in tools/ (they also run with another commit's ``pallas_kernels`` first
on PYTHONPATH, so they import nothing from ``mmjax``)."""

from __future__ import annotations

import time

import jax


def median_ms(fn, reps: int = 5, warmup: int = 2) -> float:
    """Median wall time in ms of ``fn()`` (returning jax arrays) over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]
