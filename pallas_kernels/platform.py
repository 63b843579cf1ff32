"""What the device offers: the default kernel implementation and the number of cores (SMs)."""

from __future__ import annotations

import jax

# SMs of the H100 / H200, the default when the backend does not report its cores.
DEFAULT_CORES = 132


def default_implementation(interpret: bool = False) -> str:
    """triton on a GPU, or on CPU when ``interpret``; reference otherwise."""
    if interpret or jax.default_backend() == "gpu":
        return "triton"
    return "reference"


def is_sm90() -> bool:
    """The first device is a Hopper GPU (compute capability 9.x: H100 / H200)."""
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def num_cores() -> int:
    """Streaming multiprocessors of the first GPU (``DEFAULT_CORES`` when unknown or not on a GPU)."""
    if jax.default_backend() == "gpu":
        return int(getattr(jax.devices()[0], "core_count", None) or DEFAULT_CORES)
    return DEFAULT_CORES
