"""The NaN / inf contract in the compiled Triton kernels on a GPU (`pytest -m gpu`): GPU max /
min may drop NaN where the CPU propagates it, so the contract is checked on the device too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import block_sparse_attention, qsa_topk, tree_decode_attention
from tests.pallas_kernels.helpers import expect_nonfinite_contract, plant_nonfinite, random_layout, random_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_block_sparse_compiled(seed, dtype):
    rng = np.random.default_rng(seed)
    b, t, s, n, kh, d = 1, 300, 520, 8, 2, 64
    q, k, v = plant_nonfinite(rng, *random_qkv(seed, b, t, s, n, kh, d, dtype), 3)
    layout = random_layout(rng, b, n, t, s, 64, 64, density=0.4, perm=seed % 2 == 1, columns=17 * (seed % 2))
    out, lse = block_sparse_attention(q, k, v, layout, implementation="triton")
    ref = block_sparse_attention(q, k, v, layout, implementation="reference")
    expect_nonfinite_contract(out, lse, q, k, v, layout.to_dense_mask(), 3e-2 if dtype == jnp.bfloat16 else 2e-3)
    np.testing.assert_array_equal(np.isnan(np.asarray(out, np.float32)), np.isnan(np.asarray(ref[0], np.float32)))


@pytest.mark.parametrize("seed", range(4))
def test_tree_decode_compiled(seed):
    rng = np.random.default_rng(seed)
    b, t, s, n, kh, start = 1, 5, 700, 8, 2, 650
    q, k, v = plant_nonfinite(rng, *random_qkv(seed, b, t, s, n, kh, 64), 4)
    slot = np.arange(s)
    prefix = (rng.random((b, s)) < 0.7) & ((slot < start) | (slot >= start + t))[None]
    block = np.tril(np.ones((b, t, t), bool))
    mask = np.broadcast_to(prefix[:, None, :], (b, t, s)).copy()
    mask[:, :, start:start + t] |= block
    out = tree_decode_attention(q, k, v, jnp.asarray(prefix), start, jnp.asarray(block), implementation="triton",
                                interpret=False)
    expect_nonfinite_contract(out, None, q, k, v, np.broadcast_to(mask[:, None], (b, n, t, s)), 2e-3)


@pytest.mark.parametrize("topk", ["exact", "tournament", "estimated"])
def test_qsa_topk_compiled(topk):
    rng = np.random.default_rng(1)
    b, t, s, n, kh, gamma = 1, 1024, 1024, 4, 1, 16
    q, k, v = plant_nonfinite(rng, *random_qkv(1, b, t, s, n, kh, 64), 3)
    kw = dict(gamma=gamma, block_kv=64, top_k=4, k_exact=2, topk=topk, local=128)
    ker = qsa_topk(q, k, v, implementation="triton", **kw)
    ref = qsa_topk(q, k, v, implementation="reference", **kw)
    pos = np.arange(0, t, gamma) + s - t
    mask = np.broadcast_to((np.arange(s)[None] <= pos[:, None])[None, None], (b, n, len(pos), s))
    expect_nonfinite_contract(ker.out_gamma, ker.lse_gamma, q[:, ::gamma], k, v, mask, 2e-3)
    np.testing.assert_array_equal(np.isnan(np.asarray(ker.block_score)), np.isnan(np.asarray(ref.block_score)))
