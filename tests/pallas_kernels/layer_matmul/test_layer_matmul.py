"""Layer matmul: Triton (interpret) and reference equal NumPy's ``x @ w[layer]`` for few rows, every layer,
K and N off the tiles, bf16; bad arguments name themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.layer_matmul import layer_matmul


@pytest.mark.parametrize("m,k,n,tile_k,tile_n", [
    (1, 64, 48, 32, 16),      # one row, N not a tile multiple
    (3, 200, 300, 64, 128),   # K and N off the tiles
    (17, 96, 64, 32, 32),     # more rows than one 16-row tile
])
def test_layer_matmul_matches_numpy(m, k, n, tile_k, tile_n):
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
    w = jax.random.normal(jax.random.key(k), (3, k, n), jnp.float32)
    for layer in range(3):
        want = np.asarray(x, np.float64) @ np.asarray(w[layer], np.float64)
        for impl in ("triton", "reference"):
            got = layer_matmul(x, w, layer, implementation=impl, interpret=True, tile_k=tile_k, tile_n=tile_n)
            assert got.shape == (m, n) and got.dtype == x.dtype
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4, err_msg=f"{impl} layer {layer}")


def test_layer_matmul_bf16():
    x = jax.random.normal(jax.random.key(1), (2, 128), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (2, 128, 64), jnp.bfloat16)
    got = layer_matmul(x, w, 1, interpret=True, tile_k=64, tile_n=32)
    want = layer_matmul(x, w, 1, implementation="reference")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("args,kw,match", [
    (((2, 8), (3, 9, 4), 0), {}, r"w: expected \[L, K=8, N\]"),
    (((2, 8), (3, 8, 4), 3), {}, r"layer: expected a Python int in \[0, L=3\)"),
    (((8,), (3, 8, 4), 0), {}, r"x: expected a 2-D array"),
    (((2, 8), (3, 8, 4), 0), {"tile_k": 24}, r"tile_k: expected a power of two"),
    (((2, 8), (3, 8, 4), 0), {"implementation": "cuda"}, r"implementation: expected one of"),
])
def test_bad_arguments_name_themselves(args, kw, match):
    xs, ws, layer = args
    with pytest.raises(ValueError, match=match):
        layer_matmul(jnp.ones(xs), jnp.ones(ws), layer, **kw)


def test_traced_layer_is_refused():
    with pytest.raises(ValueError, match="layer: expected a Python int"):
        jax.jit(lambda i: layer_matmul(jnp.ones((1, 8)), jnp.ones((2, 8, 4)), i))(0)


def test_dtype_mismatch_is_refused():
    with pytest.raises(ValueError, match="x / w: expected one dtype"):
        layer_matmul(jnp.ones((1, 8), jnp.bfloat16), jnp.ones((2, 8, 4), jnp.float32), 0)
