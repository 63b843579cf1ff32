"""GPU checks of the grouped-matmul Triton kernel (compiled, not interpreted): `pytest -m gpu`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("m,k,n,g", [(8192, 2048, 1536, 128), (5000, 768, 2048, 16), (700, 80, 48, 3)])
def test_triton_matches_reference_on_gpu(m, k, n, g):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k1, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(k2, (g, k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    cuts = jnp.sort(jax.random.randint(k3, (g - 1,), 0, m - 17))
    sizes = jnp.diff(jnp.concatenate([jnp.zeros(1, jnp.int32), cuts, jnp.full(1, m - 17, jnp.int32)]))
    out = grouped_matmul(lhs, rhs, sizes, implementation="triton")
    with jax.default_matmul_precision("highest"):
        ref = grouped_matmul(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes, implementation="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=3e-2, rtol=2e-2)
    assert np.all(np.asarray(out[m - 17:]) == 0)
