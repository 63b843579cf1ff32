"""GPU checks of the candidate-mass kernels (compiled): `pytest -m gpu`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.candidate_mass import candidate_mass
from pallas_kernels.platform import is_sm90
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


@pytest.mark.skipif(not is_sm90(), reason="needs an sm90 GPU (H100 / H200)")
@pytest.mark.parametrize("dtype,stride,block,d,t,c", [
    (jnp.bfloat16, 2, 64, 128, 1000, 600),   # two query blocks per CTA, odd count (the last CTA's second is empty)
    (jnp.bfloat16, 1, 64, 128, 1100, 100),   # two halves of one query block; C not a multiple of 64
    (jnp.float16, 2, 128, 80, 777, 70),      # 128-key blocks, padded head dim, ragged T
])
def test_candidate_mass_mosaic_matches_reference_on_gpu(dtype, stride, block, d, t, c):
    b, s, n, kh = 2, 4096, 8, 2
    q, k, _ = random_qkv(11, b, t, s, n, kh, d, dtype)
    rng = np.random.default_rng(1)
    nq, nk = -(-t // 128), -(-s // block)
    cand = rng.integers(-1, nk + 2, size=(b, n, nq, c)).astype(np.int32)  # -1, nk, nk + 1: empty
    cand[0, 1, 0] = -1  # a query block without candidates
    cand[1, 0, -1, :8] = nk - 1  # the last query block's diagonal block (causal mask within it)
    ref = rng.normal(3.0, 1.0, size=(b, n, -(-t // 16))).astype(np.float32)
    ref[1, 2, 5] = -np.inf  # a gamma group without reference counts nothing
    kw = dict(query_block=128, block=block, gamma=16, stride=stride)
    got = candidate_mass(q, k, jnp.asarray(cand), jnp.asarray(ref), implementation="mosaic_gpu", **kw)
    want = candidate_mass(q, k, jnp.asarray(cand), jnp.asarray(ref), implementation="reference", **kw)
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == cand.shape and np.isfinite(got).all() and want.max() > 0
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-5)
    assert np.all(got[0, 1, 0] == 0)
    # the default on this GPU is the Mosaic kernel
    default = candidate_mass(q, k, jnp.asarray(cand), jnp.asarray(ref), **kw)
    np.testing.assert_array_equal(np.asarray(default), got)
    # the lists of some query blocks per head only (query_blocks): the same masses as in the whole call
    sel = np.stack([np.stack([rng.permutation(nq)[:max(1, nq // 3)] for _ in range(n)]) for _ in range(b)])
    sel = sel.astype(np.int32)
    some = candidate_mass(q, k, jnp.asarray(np.take_along_axis(cand, sel[..., None], axis=2)), jnp.asarray(ref),
                          implementation="mosaic_gpu", query_blocks=jnp.asarray(sel), **kw)
    np.testing.assert_allclose(np.asarray(some), np.take_along_axis(got, sel[..., None], axis=2), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not is_sm90(), reason="needs an sm90 GPU (H100 / H200)")
@pytest.mark.parametrize("stride,per_step", [(2, 2), (1, 2), (2, 1)])
def test_candidate_mass_mosaic_two_candidates_per_step_on_gpu(stride, per_step):
    """Two 64-key candidates side by side in one stage (one [64, 128] score tile): the same masses, with an id out
    of range and a causal block as one of the pair (and one candidate per step); a query block whose rows have no
    reference counts nothing."""
    from pallas_kernels.candidate_mass.mosaic_gpu import candidate_mass_mosaic_gpu

    b, t, s, n, kh, d = 1, 900, 4096, 4, 2, 128
    q, k, _ = random_qkv(13, b, t, s, n, kh, d, jnp.bfloat16)
    rng = np.random.default_rng(2)
    nq, nk = -(-t // 128), s // 64
    cand = rng.integers(-1, nk + 1, size=(b, n, nq, 130)).astype(np.int32)
    cand[0, 0, -1, :5] = nk - 1
    ref = rng.normal(3.0, 1.0, size=(b, n, -(-t // 16))).astype(np.float32)
    ref[0, 1, :8] = -np.inf  # head 1's first query block: no row counts
    kw = dict(query_block=128, block=64, gamma=16, stride=stride)
    got = candidate_mass_mosaic_gpu(q, k, jnp.asarray(cand), jnp.asarray(ref), sm_scale=d ** -0.5,
                                    per_step=per_step, **kw)
    want = candidate_mass(q, k, jnp.asarray(cand), jnp.asarray(ref), implementation="reference", **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=1e-5)
    assert np.all(np.asarray(got)[0, 1, 0] == 0) and np.asarray(want)[0, 0, 0].max() > 0


@pytest.mark.skipif(not is_sm90(), reason="needs an sm90 GPU (H100 / H200)")
@pytest.mark.parametrize("stride", [2, 1])
def test_candidate_mass_mosaic_fp8_scores_on_gpu(stride):
    """``qk_fp8`` (Momo's re-rank default): the masses from fp8 copies of q and k stay near the reference's (median
    relative error under 1.5%, largest under 8%) and keep empty candidates and rows without a reference at 0."""
    b, t, s, n, kh, d = 1, 1000, 4096, 4, 2, 128
    q, k, _ = random_qkv(17, b, t, s, n, kh, d, jnp.bfloat16)
    rng = np.random.default_rng(3)
    nq, nk = -(-t // 128), s // 64
    cand = rng.integers(0, nk, size=(b, n, nq, 200)).astype(np.int32)
    cand[0, 2, 3, :10] = -1
    ref = rng.normal(3.0, 1.0, size=(b, n, -(-t // 16))).astype(np.float32)
    ref[0, 1, :8] = -np.inf
    kw = dict(query_block=128, block=64, gamma=16, stride=stride)
    got = np.asarray(candidate_mass(q, k, jnp.asarray(cand), jnp.asarray(ref), implementation="mosaic_gpu",
                                    qk_fp8=True, **kw))
    want = np.asarray(candidate_mass(q, k, jnp.asarray(cand), jnp.asarray(ref), implementation="reference", **kw))
    seen = want > 1e-5
    rel = np.abs(got - want)[seen] / want[seen]
    assert seen.mean() > 0.5 and np.median(rel) < 0.015 and rel.max() < 0.08, (np.median(rel), rel.max())
    assert np.all(got[0, 2, 3, :10] == 0) and np.all(got[0, 1, 0] == 0)
