"""Mass of a score vector per phase, for many strides at once (Grid's stride search)."""

from pallas_kernels.phase_mass.api import phase_masses

__all__ = ["phase_masses"]
