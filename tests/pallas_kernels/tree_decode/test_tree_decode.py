"""Tree-decode attention (split-K over the cache): the Pallas kernel in interpret mode against
the pure-JAX reference and dense attention on the explicit [B,N,T,S] mask, edge cases (nothing visible, empty block masks, short caches), argument validation,
and lowering for an abstract H100. `-m gpu` runs the compiled kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_decode import tree_decode_attention
from tests.pallas_kernels.helpers import masked_dense_attention, random_qkv


def _masks(rng, b, t, s, w, start, density=0.7):
    """Random prefix mask (slots before ``start`` only) and a random causal tree mask with
    the diagonal set (every query sees itself)."""
    pv = (rng.random((b, s)) < density) & (np.arange(s)[None] < start)
    tree = (rng.random((b, t, w)) < 0.5) & (np.arange(w)[None, None, :] <= np.arange(t)[None, :, None])
    tree |= np.eye(t, w, dtype=bool)[None]
    return jnp.asarray(pv), jnp.asarray(tree)


def _dense_mask(pv, start, bm, n):
    """[B,S] prefix + [B,T,W] block at ``start`` -> the [B,N,T,S] mask the two stand for."""
    b, t, w = bm.shape
    s = pv.shape[1]
    full = np.broadcast_to(np.asarray(pv)[:, None, :], (b, t, s)).copy()
    full[:, :, start:start + w] |= np.asarray(bm)
    return jnp.asarray(np.broadcast_to(full[:, None], (b, n, t, s)))


def _run(q, k, v, pv, start, bm, **kw):
    out = tree_decode_attention(q, k, v, pv, start, bm, implementation="triton", interpret=True, **kw)
    ref = tree_decode_attention(q, k, v, pv, start, bm, implementation="reference")
    return np.asarray(out, np.float32), np.asarray(ref, np.float32)


@pytest.mark.parametrize("t,n,kh,dtype,atol", [
    (1, 4, 4, jnp.float32, 2e-5),   # G=1
    (5, 8, 2, jnp.float32, 2e-5),   # G=4
    (31, 7, 1, jnp.float32, 2e-5),  # G=7, 217 rows: two row tiles of 128
    (5, 7, 1, jnp.bfloat16, 2e-2),
    (31, 8, 2, jnp.bfloat16, 2e-2),
])
def test_kernel_matches_reference(t, n, kh, dtype, atol):
    """...and, in float32, the reference matches dense attention on the explicit mask."""
    b, s, d, w = 2, 203, 32, t + 3  # S = 203: 6 whole tiles of 32 and an 11-key tail
    rng = np.random.default_rng(t * 100 + n)
    q, k, v = random_qkv(int(rng.integers(1 << 30)), b, t, s, n, kh, d, dtype)
    start = s - w - 1
    pv, bm = _masks(rng, b, t, s, w, start)
    out, ref = _run(q, k, v, pv, start, bm, block_k=32, num_splits=3)
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(out, ref, atol=atol, rtol=0)
    if dtype == jnp.float32:
        dense, _ = masked_dense_attention(q, k, v, _dense_mask(pv, start, bm, n))
        np.testing.assert_allclose(ref, np.asarray(dense), atol=2e-5, rtol=0)


def test_no_prefix_keys_and_queries_that_see_nothing():
    """Batch 0 sees no prefix key (block only; its query 2 sees nothing either -> 0);
    batch 1 has a prefix only in the middle of the cache (leading tiles skipped)."""
    b, t, s, n, kh, d, w = 2, 5, 290, 8, 2, 32, 6
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(7, b, t, s, n, kh, d)
    start = 270
    pv, bm = _masks(rng, b, t, s, w, start)
    pv = pv.at[0].set(False).at[1, :100].set(False).at[1, 200:].set(False)
    bm = bm.at[0, 2].set(False)
    out, ref = _run(q, k, v, pv, start, bm, block_k=16, num_splits=4)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    assert (out[0, 2] == 0).all() and (np.abs(out[0, 3]) > 0).any()
    dense, _ = masked_dense_attention(q, k, v, _dense_mask(pv, start, bm, n))
    np.testing.assert_allclose(out, np.asarray(dense), atol=2e-5, rtol=0)


def test_empty_block_mask_and_empty_prefix_give_zero():
    b, t, s, n, kh, d, w = 1, 3, 100, 4, 2, 16, 3
    q, k, v = random_qkv(3, b, t, s, n, kh, d)
    pv = jnp.arange(s)[None] < 90
    bm = jnp.zeros((b, t, w), bool)
    out, ref = _run(q, k, v, pv, 90, bm, block_k=16)  # prefix only
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    dense, _ = masked_dense_attention(q, k, v, _dense_mask(pv, 90, bm, n))
    np.testing.assert_allclose(out, np.asarray(dense), atol=2e-5, rtol=0)
    out0, ref0 = _run(q, k, v, jnp.zeros((b, s), bool), 90, bm, block_k=16)
    assert (out0 == 0).all() and (ref0 == 0).all()


@pytest.mark.parametrize("s,block_k,num_splits", [
    (40, 64, None),   # S < block_k: the kernel is skipped, all in plain JAX
    (256, 16, 40),    # more slices than tiles: idle programs write empty partials
    (128, 32, None),  # S a multiple of block_k: no tail
])
def test_short_caches_and_many_splits(s, block_k, num_splits):
    b, t, n, kh, d, w = 2, 4, 4, 1, 16, 4
    rng = np.random.default_rng(s)
    q, k, v = random_qkv(s, b, t, s, n, kh, d)
    pv, bm = _masks(rng, b, t, s, w, s - w)
    out, ref = _run(q, k, v, pv, s - w, bm, block_k=block_k, num_splits=num_splits)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)


def test_odd_head_dim_scale_and_traced_block_start():
    b, t, s, n, kh, d, w = 1, 3, 100, 6, 3, 24, 5
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(11, b, t, s, n, kh, d)
    pv, bm = _masks(rng, b, t, s, w, 60)
    f = jax.jit(lambda st, impl: tree_decode_attention(q, k, v, pv, st, bm, sm_scale=0.3,
                                                       implementation=impl, interpret=True,
                                                       block_k=16), static_argnums=1)
    out, ref = f(jnp.int32(60), "triton"), f(jnp.int32(60), "reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=0)
    dense, _ = masked_dense_attention(q, k, v, _dense_mask(pv, 60, bm, n), sm_scale=0.3)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=2e-5, rtol=0)


def _valid_args():
    q, k, v = random_qkv(0, 1, 3, 64, 4, 2, 16)
    return dict(q=q, k=k, v=v, prefix_valid=jnp.ones((1, 64), bool), block_start=60,
                block_mask=jnp.ones((1, 3, 3), bool))


@pytest.mark.parametrize("change,match", [
    (dict(k=jnp.zeros((1, 64, 3, 16)), v=jnp.zeros((1, 64, 3, 16))), "k: expected a number of key heads"),
    (dict(v=jnp.zeros((1, 64, 2, 16), jnp.bfloat16)), "q, k, v: expected one dtype"),
    (dict(prefix_valid=jnp.ones((1, 63), bool)), r"prefix_valid: expected shape \[1, 64\]"),
    (dict(prefix_valid=jnp.ones((1, 64), jnp.int32)), "prefix_valid: expected dtype bool"),
    (dict(block_mask=jnp.ones((1, 2, 3), bool)), r"block_mask: expected shape \[1, 3, W\]"),
    (dict(block_mask=jnp.ones((1, 3, 3), jnp.float32)), "block_mask: expected dtype bool"),
    (dict(block_mask=jnp.ones((1, 3, 65), bool)), "block_mask: expected 1 <= W <= S=64"),
    (dict(block_start=62), r"block_start: expected 0 <= block_start <= S - W = 61"),
    (dict(block_start=jnp.zeros((1,), jnp.int32)), "block_start: expected an int32 scalar"),
    (dict(block_start=1.5), "block_start: expected an int32 scalar"),
    (dict(implementation="cuda"), "implementation: expected one of"),
    (dict(block_k=48), "block_k: expected a power of two >= 16"),
    (dict(block_r=8), "block_r: expected a power of two >= 16"),
    (dict(num_splits=0), "num_splits: expected an int >= 1"),
    (dict(num_warps=3), "num_warps: expected a power of two >= 1"),
])
def test_validation_errors(change, match):
    args = {**_valid_args(), **change}
    with pytest.raises(ValueError, match=match):
        tree_decode_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("prefix_valid"),
                              args.pop("block_start"), args.pop("block_mask"), interpret=True, **args)


def _lower(t, s, n, kh, d, dtype, **kw):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    f = jax.jit(lambda q, k, v, pv, st, bm: tree_decode_attention(
        q, k, v, pv, st, bm, implementation="triton", interpret=False, **kw))
    sds = jax.ShapeDtypeStruct
    args = (sds((1, t, n, d), dtype), sds((1, s, kh, d), dtype), sds((1, s, kh, d), dtype),
            sds((1, s), jnp.bool_), sds((), jnp.int32), sds((1, t, t), jnp.bool_))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "tree_decode_attention" in text and "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("t,dtype", [(1, jnp.bfloat16), (49, jnp.bfloat16), (31, jnp.float32)])
def test_lowers_for_h100(t, dtype):
    _lower(t, 26112, 28, 4, 128, dtype)


def test_lowers_for_h100_odd_head_dim_and_launch():
    _lower(5, 1000, 8, 8, 80, jnp.float16, block_k=128, block_r=16, num_splits=7, num_warps=8,
           num_stages=2)


needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("t,s,dtype,atol", [(1, 26112, jnp.bfloat16, 2e-2), (31, 26112, jnp.bfloat16, 2e-2),
                                            (49, 5000, jnp.bfloat16, 2e-2), (31, 4099, jnp.float32, 5e-3)])
def test_compiled_kernel_matches_reference_on_gpu(t, s, dtype, atol):
    b, n, kh, d = 2, 28, 4, 128
    rng = np.random.default_rng(t + s)
    q, k, v = random_qkv(t, b, t, s, n, kh, d, dtype)
    start = s - 2 * t - 5
    pv, bm = _masks(rng, b, t, s, t, start, density=0.9)
    pv = pv.at[1, : s // 3].set(False)
    out = tree_decode_attention(q, k, v, pv, start, bm, implementation="triton")
    ref = tree_decode_attention(q, k, v, pv, start, bm, implementation="reference")
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, atol=atol, rtol=0)


@pytest.mark.parametrize("d", [64, 80])  # 80: the head dim is padded, so the layer is sliced first
def test_stacked_cache_layer_equals_the_sliced_layer(d):
    rng = np.random.default_rng(7)
    b, t, s, n, kh, w, layers = 2, 3, 300, 8, 2, 3, 4
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (b, t, n, d))
    k = jax.random.normal(ks[1], (layers, b, s, kh, d))
    v = jax.random.normal(ks[2], (layers, b, s, kh, d))
    pv, bm = _masks(rng, b, t, s, w, 250)
    for impl in ("triton", "reference"):
        got = tree_decode_attention(q, k, v, pv, 250, bm, implementation=impl, interpret=True, layer=2, block_k=64)
        want = tree_decode_attention(q, k[2], v[2], pv, 250, bm, implementation=impl, interpret=True, block_k=64)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"stacked cache \[L, B, S, K, D\] with L > layer=4"):
        tree_decode_attention(q, k, v, pv, 250, bm, layer=4)
    with pytest.raises(ValueError, match=r"layer: expected an int >= 0"):
        tree_decode_attention(q, k, v, pv, 250, bm, layer=-1)


def test_stacked_cache_is_a_kernel_operand_for_h100():
    """With ``layer`` the Triton call takes the stacked cache itself (no per-layer slice for XLA to copy)."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    f = jax.jit(lambda q, k, v, pv, bm: tree_decode_attention(
        q, k, v, pv, 26111, bm, implementation="triton", interpret=False, layer=5))
    sds = jax.ShapeDtypeStruct
    args = (sds((2, 1, 28, 128), jnp.bfloat16), sds((28, 2, 26112, 4, 128), jnp.bfloat16),
            sds((28, 2, 26112, 4, 128), jnp.bfloat16), sds((2, 26112), jnp.bool_), sds((2, 1, 1), jnp.bool_))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    call = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(call) == 1 and "tensor<28x2x26112x4x128xbf16>" in call[0]
