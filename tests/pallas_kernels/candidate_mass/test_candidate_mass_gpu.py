"""GPU check of the candidate-mass Triton kernel (compiled): `pytest -m gpu`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.candidate_mass import candidate_mass
from tests.pallas_kernels.helpers import random_qkv

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,stride", [(jnp.bfloat16, 1), (jnp.float16, 4), (jnp.float32, 2)])
def test_candidate_mass_triton_matches_reference_on_gpu(dtype, stride):
    b, t, s, n, kh, d = 1, 1000, 4096, 28, 4, 128
    q, k, _ = random_qkv(7, b, t, s, n, kh, d, dtype)
    rng = np.random.default_rng(0)
    nq, nk = -(-t // 128), s // 64
    cand = jnp.asarray(rng.integers(-1, nk, size=(b, n, nq, 256)), jnp.int32)
    ref = jnp.asarray(rng.normal(3.0, 1.0, size=(b, n, -(-t // 16))), jnp.float32)
    kw = dict(query_block=128, block=64, gamma=16, stride=stride)
    got = candidate_mass(q, k, cand, ref, implementation="triton", **kw)
    want = candidate_mass(q, k, cand, ref, implementation="reference", **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=1e-5)
