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


def devices_mesh(devices: int, sequence: int = 1) -> Mesh | None:
    """The mesh of ``--devices N [--sequence-parallel S]``: None for one device, else tp = N / S by
    sp = S. ValueError (naming the flags) when S does not divide N or fewer devices exist; on a CPU the
    message says how to get virtual devices."""
    if devices == 1 and sequence == 1:
        return None
    if devices % sequence:
        raise ValueError(f"--sequence-parallel: expected a divisor of --devices {devices}, got {sequence}")
    if devices > jax.device_count():
        hint = (f"; on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count={devices} before starting"
                if jax.default_backend() == "cpu" else "")
        raise ValueError(f"--devices: expected at most the {jax.device_count()} {jax.default_backend()} devices "
                         f"available, got {devices}{hint}")
    return make_mesh(devices // sequence, sequence)
