"""Grouped matmul: the Triton kernel (interpret mode) against the reference (``ragged_dot``) on random
inputs with empty groups, partial tiles, rows past the groups, one group holding everything; its tile
table; its argument checks; its lowering for an abstract H100."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.grouped_matmul.triton import tile_table

TILES = dict(tile_m=32, tile_n=16, tile_k=16)


def _inputs(m, k, n, sizes, dtype=jnp.float32, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(k1, (m, k), dtype)
    rhs = jax.random.normal(k2, (len(sizes), k, n), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("m,k,n,sizes", [
    (300, 64, 48, [40, 0, 130, 7, 100]),   # an empty group, partial tiles, 23 rows past the groups
    (96, 32, 16, [96]),                     # one group, whole tiles
    (70, 48, 40, [0, 0, 70, 0]),            # K, N not multiples of the tiles
    (33, 16, 16, [1, 1, 1, 30]),            # one-row groups
])
def test_kernel_matches_reference(m, k, n, sizes):
    lhs, rhs, gs = _inputs(m, k, n, sizes)
    ref = grouped_matmul(lhs, rhs, gs, implementation="reference")
    out = grouped_matmul(lhs, rhs, gs, interpret=True, **TILES)
    assert out.shape == (m, n) and out.dtype == lhs.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-4)
    total = sum(sizes)
    assert np.all(np.asarray(out[total:]) == 0)
    assert np.abs(np.asarray(out[:total])).min(axis=1).max() > 0  # every grouped row computed (random data)


def test_bf16_and_traced_sizes_match_reference():
    lhs, rhs, gs = _inputs(200, 64, 32, [50, 60, 0, 70], jnp.bfloat16, seed=3)
    f = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, interpret=True, **TILES))
    ref = grouped_matmul(lhs, rhs, gs, implementation="reference")
    np.testing.assert_allclose(np.asarray(f(lhs, rhs, gs), np.float32), np.asarray(ref, np.float32),
                               rtol=2e-2, atol=5e-2)


def test_tile_table_covers_each_group_row_once():
    sizes = jnp.asarray([40, 0, 130, 7, 100], jnp.int32)
    group, first, rows, slots = tile_table(sizes, 300, 32)
    assert slots == 10 + 5
    owner = np.full(300, -1)
    for g, f, r in zip(np.asarray(group), np.asarray(first), np.asarray(rows)):
        assert (owner[f:f + r] == -1).all()
        owner[f:f + r] = g
    want = np.concatenate([np.full(s, i) for i, s in enumerate([40, 0, 130, 7, 100])] + [np.full(23, -1)])
    np.testing.assert_array_equal(owner, want)


@pytest.mark.parametrize("bad,match", [
    (dict(lhs=jnp.ones((4, 8, 2))), r"lhs: expected a 2-D array \[M, K\]"),
    (dict(rhs=jnp.ones((3, 9, 5))), r"rhs: expected \[G, K=8, N\]"),
    (dict(rhs=jnp.ones((3, 8, 5), jnp.bfloat16)), r"lhs / rhs: expected one dtype"),
    (dict(sizes=jnp.ones((2,), jnp.int32)), r"group_sizes: expected an integer array \[G=3\]"),
    (dict(sizes=jnp.asarray([5, 6, 0], jnp.int32)), r"summing to at most M=10"),
    (dict(sizes=jnp.asarray([5, -1, 0], jnp.int32)), r"sizes >= 0"),
    (dict(tile_m=24), r"tile_m: expected a power of two"),
    (dict(implementation="cuda"), r"implementation: expected one of"),
])
def test_bad_input_is_named(bad, match):
    args = dict(lhs=jnp.ones((10, 8)), rhs=jnp.ones((3, 8, 5)), sizes=jnp.asarray([2, 3, 4], jnp.int32))
    kw = {k: bad.pop(k) for k in ("tile_m", "implementation") if k in bad}
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        grouped_matmul(args["lhs"], args["rhs"], args["sizes"], **kw)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_h100(dtype):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    f = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, implementation="triton"))
    args = (jax.ShapeDtypeStruct((4096, 2048), dtype), jax.ShapeDtypeStruct((128, 2048, 1536), dtype),
            jax.ShapeDtypeStruct((128,), jnp.int32))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "grouped_matmul" in text and "__gpu$xla.gpu.triton" in text


def test_traced_sizes_past_m_are_clipped_not_read_out_of_bounds():
    """Traced group sizes cannot be checked on the host: a sum past M is clipped (the last groups shrink), and the
    kernel agrees with the reference on the clipped sizes."""
    lhs, rhs, _ = _inputs(100, 32, 16, [0, 0, 0])
    sizes = jnp.asarray([60, 70, 30], jnp.int32)  # 160 > 100
    out = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, interpret=True, **TILES))(lhs, rhs, sizes)
    ref = grouped_matmul(lhs, rhs, jnp.asarray([60, 40, 0], jnp.int32), implementation="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-4)
