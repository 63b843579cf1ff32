"""``models.common.scaled_normal``: the values of ``std * jax.random.normal`` in one program, inputs checked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.common import scaled_normal


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scaled_normal_matches_the_eager_draw(dtype):
    key = jax.random.key(3)
    got = scaled_normal(key, (64, 33), dtype, 0.02)
    want = 0.02 * jax.random.normal(key, (64, 33), dtype)
    assert got.dtype == want.dtype and got.shape == (64, 33)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=1e-7)


@pytest.mark.parametrize("shape, dtype, std, match", [
    ((4, -1), jnp.float32, 0.02, r"shape: expected non-negative integers"),
    ((4, 2.5), jnp.float32, 0.02, r"shape: expected non-negative integers"),
    ((4,), jnp.int32, 0.02, r"dtype: expected a floating dtype"),
    ((4,), jnp.float32, float("nan"), r"std: expected a finite number >= 0"),
    ((4,), jnp.float32, -1.0, r"std: expected a finite number >= 0"),
])
def test_scaled_normal_checks_its_inputs(shape, dtype, std, match):
    with pytest.raises(ValueError, match=match):
        scaled_normal(jax.random.key(0), shape, dtype, std)
