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


def chosen_implementation(implementation: str | None, interpret: bool, choices: tuple[str, ...],
                          gpu_default: str = "triton") -> str:
    """``implementation`` checked against ``choices``; None: `default_implementation`, with ``gpu_default`` in place
    of Triton on a GPU (outside interpret mode), for an op whose kernel is not (yet) the faster choice there."""
    if implementation is None:
        implementation = default_implementation(bool(interpret))
        if implementation == "triton" and not interpret:
            implementation = gpu_default
    if implementation not in choices:
        raise ValueError(f"implementation: expected one of {choices} or None; received {implementation!r}")
    return implementation


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
