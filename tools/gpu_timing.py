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


def queued_median_ms(fn, *, calls: int, reps: int = 5, warmup: int = 2) -> float:
    """Median ms per call of ``fn()`` when ``calls`` calls are queued before one wait (JAX dispatches
    asynchronously, so launch and synchronisation are spread over them): `median_ms` of the queue, over ``calls``."""
    def queued():
        out = None
        for _ in range(calls):
            out = fn()
        return out

    return median_ms(queued, reps=reps, warmup=warmup) / calls
