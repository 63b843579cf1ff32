"""How the kernel scripts in tools/ compare two outputs (imports nothing from ``mmjax``, as `gpu_timing`)."""

from __future__ import annotations

import numpy as np


def rel_err(a, b) -> float:
    """``|a - b| / |b|`` (Frobenius norms, float64) of two arrays of any float dtype (bf16 included) and equal shape."""
    a = np.asarray(a, np.float32).astype(np.float64)
    b = np.asarray(b, np.float32).astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
