"""GPU checks of the phase-mass kernel (compiled Triton): `pytest -m gpu`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.sparse.patterns.grid import DEFAULT_STRIDES, Grid
from pallas_kernels.phase_mass import api, phase_masses

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")]


@pytest.mark.parametrize("s", [131072, 50000])
def test_kernel_matches_the_reference_on_gpu(s):
    v = jnp.asarray(np.random.default_rng(s).random((1, 28, s)), jnp.float32).at[0, 3, 777].set(jnp.inf)
    want = np.asarray(phase_masses(v, DEFAULT_STRIDES, implementation="reference"))
    got = np.asarray(phase_masses(v, DEFAULT_STRIDES, implementation="triton"))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5)


def test_grid_search_through_the_kernel_picks_the_references_strides(monkeypatch):
    """Grid.estimate with the kernel (the GPU default) against the same search through the reference."""
    t, kq, kk = 16384, *jax.random.split(jax.random.PRNGKey(5))
    u = jnp.where(jnp.arange(128) % 3 == 0, 1.0, -1.0)  # a direction every query leans along
    q = (jax.random.normal(kq, (1, t, 8, 128)) + 0.5 * u).astype(jnp.bfloat16)
    lines = 1.0 * (jnp.arange(t) % 256 == 7)  # phase 7 of a 256 stride (its multiples tie; the search walks down)
    k = (jax.random.normal(kk, (1, t, 2, 128)) + lines[None, :, None, None] * u).astype(jnp.bfloat16)
    grid = Grid()
    got = grid.estimate(q, k)
    monkeypatch.setattr(api, "DEFAULT_GPU_IMPLEMENTATION", "reference")
    want = grid.estimate(q, k)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got[0]) == 256) and np.all(np.asarray(got[1]) == 7), got  # the planted lines
