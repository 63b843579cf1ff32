"""Device meshes for tensor- ("tp", attention heads) and sequence- ("sp", tokens) parallel inference."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from models.sharding import SP, TP


def make_mesh(tp: int = 1, sp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of ``tp * sp`` devices (the first ones of ``devices``, default ``jax.devices()``) with axes
    ("tp", "sp"); ValueError when there are fewer devices."""
    for name, n in (("tp", tp), ("sp", sp)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {n!r}")
    devices = list(jax.devices() if devices is None else devices)
    if tp * sp > len(devices):
        raise ValueError(f"tp * sp: expected at most the {len(devices)} devices available, got {tp} * {sp}")
    return jax.make_mesh((tp, sp), (TP, SP), axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[:tp * sp])
