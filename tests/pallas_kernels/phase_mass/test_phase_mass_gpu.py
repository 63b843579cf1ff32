"""GPU checks of the phase-mass kernel (compiled Triton): `pytest -m gpu`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.sparse.patterns.grid import DEFAULT_STRIDES
from pallas_kernels.phase_mass import phase_masses

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")]


@pytest.mark.parametrize("s", [131072, 50000])
def test_kernel_matches_the_reference_on_gpu(s):
    v = jnp.asarray(np.random.default_rng(s).random((1, 28, s)), jnp.float32).at[0, 3, 777].set(jnp.inf)
    want = np.asarray(phase_masses(v, DEFAULT_STRIDES, implementation="reference"))
    got = np.asarray(phase_masses(v, DEFAULT_STRIDES, implementation="triton"))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5)
