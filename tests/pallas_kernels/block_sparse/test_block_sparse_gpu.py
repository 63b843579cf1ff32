"""GPU checks of the Triton kernel (compiled, not interpreted): `pytest -m gpu`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BlockLayout, block_sparse_attention
from tests.pallas_kernels.block_sparse.test_windows import random_window_layout
from tests.pallas_kernels.helpers import masked_dense_attention, random_layout, random_qkv, rel_err

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


def _check_triton_against_dense(q, k, v, layout, tol):
    """The compiled Triton kernel equals masked dense attention on the layout's mask (out and lse)."""
    out, lse = block_sparse_attention(q, k, v, layout, implementation="triton")
    ref_out, ref_lse = masked_dense_attention(q, k, v, layout.to_dense_mask())
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert rel_err(out, ref_out) < tol
    fin = np.isfinite(np.asarray(ref_lse))
    assert (np.isfinite(np.asarray(lse)) == fin).all()
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], atol=5e-2)


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 2e-2), (jnp.float16, 5e-3), (jnp.float32, 5e-3)])
@pytest.mark.parametrize("b,t,s,n,kh,d,bq,bk", [
    (1, 1000, 1000, 28, 4, 128, 128, 64),
    (2, 300, 777, 8, 2, 64, 64, 64),
    (1, 513, 1024, 4, 4, 80, 128, 128),
])
@pytest.mark.parametrize("perm,columns", [(False, 0), (True, 24)])
def test_triton_matches_dense_on_gpu(dtype, tol, b, t, s, n, kh, d, bq, bk, perm, columns):
    rng = np.random.default_rng(t + s + d)
    q, k, v = random_qkv(int(rng.integers(1 << 30)), b, t, s, n, kh, d, dtype)
    layout = random_layout(rng, b, n, t, s, bq, bk, density=0.3, perm=perm, columns=columns)
    _check_triton_against_dense(q, k, v, layout, tol)


@needs_gpu
def test_dense_layout_matches_cudnn():
    q, k, v = random_qkv(3, 1, 4096, 4096, 28, 4, 128, jnp.bfloat16)
    layout = BlockLayout.dense_causal(4096, 4096, block_q=128, block_k=64)
    out, _ = block_sparse_attention(q, k, v, layout, implementation="triton")
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    assert rel_err(out, ref) < 2e-2


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 2e-2), (jnp.float16, 5e-3)])
@pytest.mark.parametrize("b,t,s,n,kh,d,bq,bk,columns", [
    (1, 1000, 1000, 28, 4, 128, 128, 64, 24),
    (2, 300, 777, 8, 2, 64, 64, 64, 0),
])
def test_triton_key_windows_match_dense_on_gpu(dtype, tol, b, t, s, n, kh, d, bq, bk, columns):
    rng = np.random.default_rng(t + s + d + 1)
    q, k, v = random_qkv(int(rng.integers(1 << 30)), b, t, s, n, kh, d, dtype)
    layout = random_window_layout(rng, b, n, t, s, bq, bk, columns=columns, max_windows=8)
    _check_triton_against_dense(q, k, v, layout, tol)
