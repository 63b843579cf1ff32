"""Candidate mass: Triton (interpret) and reference equal a NumPy computation from dense scores; GQA, ragged
T (queries the last T of S), empty candidates, strides, rows without a reference; bad arguments name
themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.candidate_mass import candidate_mass
from pallas_kernels.candidate_mass.mosaic_gpu import candidate_mass_mosaic_gpu
from pallas_kernels.candidate_mass.triton import candidate_mass_triton
from tests.pallas_kernels.helpers import random_qkv


def numpy_mass(q, k, cand, ref, *, qb, block, stride, gamma):
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    kk = np.repeat(k, n // kh, axis=2)
    sc = np.einsum("btnd,bsnd->bnts", q, kk) / np.sqrt(d)
    pos = np.arange(t) + s - t
    sc = np.where(np.arange(s)[None, :] <= pos[:, None], sc, -np.inf)
    nk = -(-s // block)
    out = np.zeros(cand.shape)
    for bi, h, i, c in np.ndindex(*cand.shape):
        j = cand[bi, h, i, c]
        if not 0 <= j < nk:
            continue
        for r in range(i * qb, min((i + 1) * qb, t)):
            if r % stride or not np.isfinite(ref[bi, h, r // gamma]):
                continue
            x = sc[bi, h, r, j * block:(j + 1) * block]
            if np.isfinite(x).any():
                lse = np.log(np.exp(x - x.max()).sum()) + x.max()
                out[bi, h, i, c] += np.exp(lse - ref[bi, h, r // gamma])
    return out


@pytest.mark.parametrize("b,t,s,n,kh,qb,block,gamma,stride", [
    (1, 64, 64, 2, 1, 32, 16, 4, 1),
    (2, 70, 150, 4, 2, 32, 16, 8, 2),   # ragged: T not a multiple of query_block, queries the last 70 of 150
    (1, 128, 200, 2, 2, 64, 32, 16, 4),
])
def test_candidate_mass_matches_numpy(b, t, s, n, kh, qb, block, gamma, stride):
    rng = np.random.default_rng(t + s)
    q, k, _ = random_qkv(t * s, b, t, s, n, kh, 32)
    nq, nk = -(-t // qb), -(-s // block)
    cand = rng.integers(-1, nk + 1, size=(b, n, nq, 5)).astype(np.int32)  # -1 and nk: empty
    ref = rng.normal(2.0, 1.0, size=(b, n, -(-t // gamma))).astype(np.float32)
    ref[0, 0, 1] = -np.inf  # a row group without reference counts nothing
    want = numpy_mass(q, k, cand, ref, qb=qb, block=block, stride=stride, gamma=gamma)
    assert want.max() > 0
    for impl in ("triton", "reference"):
        got = candidate_mass(q, k, jnp.asarray(cand), jnp.asarray(ref), query_block=qb, block=block, gamma=gamma,
                             stride=stride, implementation=impl, interpret=True)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-6, err_msg=impl)


def test_query_blocks_score_those_lists_only():
    """``query_blocks``: lists of some query blocks per (batch, head), in any order, score as in the whole call;
    bad shapes, values out of range and repeats (concrete arrays) are named."""
    b, t, s, n, kh, qb, block, gamma = 2, 200, 260, 4, 2, 32, 16, 8
    rng = np.random.default_rng(3)
    q, k, _ = random_qkv(5, b, t, s, n, kh, 32)
    nq, nk = -(-t // qb), -(-s // block)
    cand = rng.integers(-1, nk, size=(b, n, nq, 6)).astype(np.int32)
    ref = rng.normal(2.0, 1.0, size=(b, n, -(-t // gamma))).astype(np.float32)
    kw = dict(query_block=qb, block=block, gamma=gamma, stride=2)
    sel = np.stack([np.stack([rng.permutation(nq)[:3] for _ in range(n)]) for _ in range(b)]).astype(np.int32)
    chosen = np.take_along_axis(cand, sel[..., None], axis=2)
    for impl in ("reference", "triton"):
        whole = np.asarray(candidate_mass(q, k, jnp.asarray(cand), jnp.asarray(ref), implementation=impl,
                                          interpret=True, **kw))
        got = candidate_mass(q, k, jnp.asarray(chosen), jnp.asarray(ref), implementation=impl, interpret=True,
                             query_blocks=jnp.asarray(sel), **kw)
        np.testing.assert_allclose(np.asarray(got), np.take_along_axis(whole, sel[..., None], axis=2), rtol=1e-6,
                                   atol=1e-7, err_msg=impl)
        assert np.asarray(got).max() > 0
    with pytest.raises(ValueError, match=r"query_blocks: expected an integer array \[B=2, N=4, M\] with 1 <= M"):
        candidate_mass(q, k, jnp.asarray(chosen), jnp.asarray(ref), query_blocks=jnp.zeros((2, 4, nq + 1), jnp.int32),
                       **kw)
    with pytest.raises(ValueError, match=r"candidates: expected an integer array \[B=2, N=4, M=2, C\]"):
        candidate_mass(q, k, jnp.asarray(chosen), jnp.asarray(ref), query_blocks=jnp.asarray(sel[..., :2]), **kw)
    out_of_range = sel.copy()
    out_of_range[1, 2, 0] = nq
    with pytest.raises(ValueError, match=rf"query_blocks: expected values in \[0, nq={nq}\); received {nq} at index "
                                         r"\[1, 2, 0\]"):
        candidate_mass(q, k, jnp.asarray(chosen), jnp.asarray(ref), query_blocks=jnp.asarray(out_of_range), **kw)
    repeat = sel.copy()
    repeat[0, 3, 2] = repeat[0, 3, 0]
    with pytest.raises(ValueError, match=rf"query_blocks: expected distinct query blocks in each \(batch, head\); "
                                         rf"received {repeat[0, 3, 0]} twice at \(batch 0, head 3\)"):
        candidate_mass(q, k, jnp.asarray(chosen), jnp.asarray(ref), query_blocks=jnp.asarray(repeat), **kw)


@pytest.mark.parametrize("per_step", [1, 2, 4])
def test_triton_candidates_per_step(per_step):
    """Any number of candidate blocks per loop step gives the same masses, also when C is not a multiple of it
    (C = 7) and a step holds only empty slots' neighbours."""
    b, t, s, n, kh, qb, block, gamma = 1, 64, 96, 4, 2, 32, 16, 8
    rng = np.random.default_rng(per_step)
    q, k, _ = random_qkv(per_step, b, t, s, n, kh, 32)
    cand = rng.integers(-1, 6, size=(b, n, 2, 7)).astype(np.int32)
    cand[0, 0, 0] = -1  # a query block with no candidate at all
    ref = rng.normal(2.0, 1.0, size=(b, n, t // gamma)).astype(np.float32)
    want = numpy_mass(q, k, cand, ref, qb=qb, block=block, stride=1, gamma=gamma)
    got = candidate_mass_triton(q, k, jnp.asarray(cand), jnp.asarray(ref), query_block=qb, block=block, stride=1,
                                gamma=gamma, sm_scale=32 ** -0.5, interpret=True, per_step=per_step)
    assert got.shape == cand.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-6)
    assert np.all(np.asarray(got)[0, 0, 0] == 0)


def test_candidate_mass_of_all_blocks_sums_to_each_rows_mass():
    """With every causal block listed and the rows' own lse as reference (gamma 1), each row's terms sum to 1."""
    t = s = 64
    q, k, _ = random_qkv(9, 1, t, s, 2, 1, 16)
    sc = np.einsum("btnd,bsnd->bnts", np.asarray(q), np.repeat(np.asarray(k), 2, axis=2)) / 4.0
    sc = np.where(np.tril(np.ones((t, s), bool)), sc, -np.inf)
    ref = jnp.asarray(np.log(np.exp(sc - sc.max(-1, keepdims=True)).sum(-1)) + sc.max(-1), jnp.float32)
    cand = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (1, 2, 4, 4))
    got = candidate_mass(q, k, cand, ref, query_block=16, block=16, gamma=1, implementation="triton", interpret=True)
    np.testing.assert_allclose(np.asarray(got).sum(-1), 16.0, rtol=1e-5)


def test_mosaic_candidate_mass_fp8_scores_lower_for_cuda():
    """``qk_fp8``: the kernel lowers with fp8 Q / K tiles (head dim 128, and 80 padded to it); a head dim that pads
    to 64 is refused by name."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")

    def lower(d):
        t, s = 1000, 2048
        args = (jax.ShapeDtypeStruct((1, t, 4, d), jnp.bfloat16), jax.ShapeDtypeStruct((1, s, 2, d), jnp.bfloat16),
                jax.ShapeDtypeStruct((1, 4, -(-t // 128), 64), jnp.int32),
                jax.ShapeDtypeStruct((1, 4, -(-t // 16)), jnp.float32))
        f = jax.jit(lambda *a: candidate_mass_mosaic_gpu(*a, query_block=128, block=64, stride=2, gamma=16,
                                                         sm_scale=0.1, qk_fp8=True))
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
            return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    assert "f8E4M3FN" in lower(128) and "f8E4M3FN" in lower(80)
    with pytest.raises(ValueError, match=r"qk_fp8: expected head dim 128 \(128-byte fp8 rows\); received 64"):
        lower(64)


@pytest.mark.parametrize("kw,match", [
    (dict(stride=16), r"stride: expected query_block / stride >= 16"),
    (dict(stride=3), r"stride: expected a power of two"),
    (dict(gamma=5), r"gamma: expected a divisor of query_block"),
    (dict(block=24), r"block: expected a power of two"),
])
def test_bad_arguments_name_themselves(kw, match):
    q, k, _ = random_qkv(1, 1, 64, 64, 2, 1, 16)
    args = dict(query_block=32, block=16, gamma=4) | kw
    cand = jnp.zeros((1, 2, 2, 3), jnp.int32)
    with pytest.raises(ValueError, match=match):
        candidate_mass(q, k, cand, jnp.zeros((1, 2, 16)), **args)


def test_shape_errors_name_the_argument():
    q, k, _ = random_qkv(1, 1, 64, 64, 2, 1, 16)
    with pytest.raises(ValueError, match=r"candidates: expected an integer array \[B=1, N=2, nq=2, C\]"):
        candidate_mass(q, k, jnp.zeros((1, 2, 3, 3), jnp.int32), jnp.zeros((1, 2, 16)), query_block=32, block=16,
                       gamma=4)
    with pytest.raises(ValueError, match=r"ref_lse: expected \[B=1, N=2, ceil\(T / gamma\)=16\]"):
        candidate_mass(q, k, jnp.zeros((1, 2, 2, 3), jnp.int32), jnp.zeros((1, 2, 8)), query_block=32, block=16,
                       gamma=4)


@pytest.mark.parametrize("stride,block,d,lists", [(2, 64, 128, None), (1, 64, 80, None), (2, 128, 64, None),
                                                  (2, 64, 128, 9), (1, 64, 128, 4)])
def test_mosaic_candidate_mass_lowers_for_cuda(stride, block, d, lists):
    """The Mosaic GPU kernel (it runs on an sm90 GPU only: test_candidate_mass_gpu.py) lowers to a Mosaic GPU module
    for CUDA: two query blocks per CTA (stride 2) and two halves of one (stride 1), both key block sizes, and the
    lists of some query blocks only (``query_blocks``)."""
    import jax

    t, s = 3000, 5000
    q = jax.ShapeDtypeStruct((1, t, 8, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, s, 2, d), jnp.bfloat16)
    cand = jax.ShapeDtypeStruct((1, 8, lists or -(-t // 128), 100), jnp.int32)
    ref = jax.ShapeDtypeStruct((1, 8, -(-t // 16)), jnp.float32)
    qbs = jax.ShapeDtypeStruct((1, 8, lists), jnp.int32) if lists else None
    f = jax.jit(lambda q, k, c, r, qbs: candidate_mass(q, k, c, r, query_block=128, block=block, gamma=16,
                                                       stride=stride, implementation="mosaic_gpu", query_blocks=qbs))
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
        text = f.trace(q, k, cand, ref, qbs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("kw,match", [
    (dict(stride=4), r"stride: expected query_block / stride in \(64, 128\)"),
    (dict(block=32), r"block: expected one of \(64, 128\)"),
    (dict(dtype=jnp.float32), r"q: expected dtype bfloat16 or float16"),
    (dict(d=192), r"q: expected head dim D <= 128"),
    (dict(interpret=True), r"interpret: expected False"),
])
def test_mosaic_candidate_mass_rejects_unsupported_input(kw, match):
    kw = dict(kw)
    q, k, _ = random_qkv(1, 1, 256, 256, 2, 1, kw.pop("d", 64), kw.pop("dtype", jnp.bfloat16))
    args = dict(query_block=128, block=64, gamma=16, stride=2) | kw
    cand = jnp.zeros((1, 2, 2, 3), jnp.int32)
    with pytest.raises(ValueError, match=match):
        candidate_mass(q, k, cand, jnp.zeros((1, 2, 16)), implementation="mosaic_gpu", **args)
