"""GPU check of the layer-matmul Triton kernel (compiled): `pytest -m gpu`. At the 7B decoder's o-projection
shape it equals the reference, and the compiled program reads the stacked weight in place (no copy of a
layer)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.layer_matmul import layer_matmul

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 4, 16])
def test_layer_matmul_on_gpu_matches_reference_without_a_copy(m):
    x = jax.random.normal(jax.random.key(0), (m, 3584), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (28, 3584, 3584), jnp.bfloat16) * 0.02
    fn = jax.jit(lambda x, w: layer_matmul(x, w, 5, implementation="triton"))
    got = fn(x, w)
    want = layer_matmul(x, w, 5, implementation="reference")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    hlo = fn.lower(x, w).compile().as_text()
    assert "bf16[3584,3584]" not in hlo, "a layer of the stacked weight is materialised"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,k,n", [(9, 64, 48), (3, 200, 300), (16, 320, 640)])
def test_layer_matmul_on_gpu_off_the_tiles(m, k, n):
    """K and N off the default 256 x 128 tile (a tiny model's o-projection): the edge tiles must not write past
    their columns (unmasked, they raced with the next row: a different wrong answer each run)."""
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    w = jax.random.normal(jax.random.key(k), (3, k, n), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(w[2], np.float64)
    fn = jax.jit(lambda x, w: layer_matmul(x, w, 2, implementation="triton"))
    for _ in range(5):
        got = np.asarray(fn(x, w))
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.sqrt(k))
