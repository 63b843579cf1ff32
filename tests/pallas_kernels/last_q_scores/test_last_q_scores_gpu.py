"""GPU checks of the fused last-rows scoring kernel (compiled Triton, with its barriers): `pytest -m gpu`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.last_q_scores import last_q_scores
from pallas_kernels.last_q_scores.triton import last_q_scores_triton
from tests.pallas_kernels.helpers import random_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")]


def _assert_close(got, want, rtol):
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert not np.isnan(g).any()
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w))
        fin = np.isfinite(w)
        np.testing.assert_allclose(g[fin], w[fin], rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("dtype,s,last_q,tiles", [
    (jnp.bfloat16, 8192, 64, {}),  # Qwen2.5-VL 7B's heads, the patterns' 64 rows
    (jnp.float16, 5000, 40, {"lanes": 3, "chunks": 2}),  # ragged S, 40 rows padded to 64, many tiles a program
    (jnp.bfloat16, 3000, 128, {}),  # 128 rows: 128-key tiles
    (jnp.bfloat16, 7000, 64, {"lanes": 4}),  # several tiles a program, 64 rows
])
def test_kernel_matches_the_reference_on_gpu(dtype, s, last_q, tiles):
    b, t, n, kh, d = 1, s, 28, 4, 128
    q, k, _ = random_qkv(s, b, t, s, n, kh, d, dtype)
    valid = jnp.asarray(np.random.default_rng(0).random((b, s)) > 0.1)
    for k_valid in (None, valid):
        want = last_q_scores(q, k, last_q=last_q, k_valid=k_valid, implementation="reference")
        got = last_q_scores_triton(q, k, last_q=last_q, sm_scale=d ** -0.5, k_valid=k_valid, **tiles)
        _assert_close(got, want, 2e-3)


def test_chosen_rows_and_valid_keys_on_gpu():
    """As a boundary wrapper asks: the last 64 video rows before a 64-token question, the text keys invalid; and rows
    spread too far for the kernel, which go through the reference under jit."""
    b, t, n, kh, d = 1, 6000, 28, 4, 128
    q, k, _ = random_qkv(5, b, t, t, n, kh, d, jnp.bfloat16)
    valid = jnp.arange(t)[None] >= 1000
    rng = np.random.default_rng(2)
    for rows in (np.arange(t - 128, t - 64, dtype=np.int32)[None],
                 np.sort(rng.choice(t, 64, replace=False)).astype(np.int32)[None]):
        want = last_q_scores(q, k, last_q=64, rows=rows, k_valid=valid, implementation="reference")
        got = jax.jit(lambda q, k, r: last_q_scores(q, k, last_q=64, rows=r, k_valid=valid,
                                                    implementation="triton"))(q, k, rows)
        _assert_close(got, want, 2e-3)


def test_kernel_keeps_the_non_finite_rules_on_gpu():
    q, k, _ = random_qkv(2, 2, 512, 2048, 8, 2, 64, jnp.bfloat16)
    q = q.at[0, 500, 1, 3].set(jnp.nan)
    k = k.at[0, 1000, 0, 5].set(jnp.inf)
    want = last_q_scores(q, k, last_q=64, implementation="reference")
    got = jax.jit(lambda q, k: last_q_scores(q, k, last_q=64, implementation="triton"))(q, k)
    _assert_close(got, want, 2e-3)
    assert np.isinf(np.asarray(got[0])[0, :4, 1000]).all()
