"""swiglu_quantize: the Pallas Triton kernel in interpret mode equals the pure-JAX reference; the reference is what
it says; bad arguments are named; the kernel lowers for an H100."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.swiglu_quantize import swiglu_quantize, swiglu_quantize_reference
from pallas_kernels.swiglu_quantize.api import default_tiling
from pallas_kernels.swiglu_quantize.triton import pieces


def _inputs(m, f, dtype=jnp.bfloat16, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    y = (jax.random.normal(k[0], (m, 2 * f), jnp.float32) * 4).astype(dtype)
    gs = jax.random.uniform(k[1], (m, 1), jnp.float32, 0.2, 2.0)
    us = jax.random.uniform(k[2], (m, 1), jnp.float32, 0.2, 2.0)
    return y, gs, us


def _f32(x):
    return np.asarray(x.astype(jnp.float32))


def _assert_fp8_equal(q, qr, ties=0.002):
    """q equals qr, except where the float32 value sat on a rounding tie between two float8 values: the kernel and
    the reference evaluate silu in different orders, so their float32 values may differ in the last bits. Those
    elements must be one float8 step apart (adjacent bit patterns of one sign), at most ``ties`` of them."""
    a, b = np.asarray(q).view(np.uint8).astype(int), np.asarray(qr).view(np.uint8).astype(int)
    off = a != b
    assert off.mean() <= ties, f"{off.sum()} of {off.size} float8 values differ"
    np.testing.assert_array_less(np.abs(a - b)[off], 2, err_msg="a float8 value more than one step off")
    assert ((a & 0x80) == (b & 0x80))[off].all(), "a float8 value of the other sign"


def test_pieces_are_the_binary_form():
    assert pieces(18944) == ((0, 16384), (16384, 2048), (18432, 512))
    assert pieces(3424) == ((0, 2048), (2048, 1024), (3072, 256), (3328, 64), (3392, 32))
    assert pieces(16) == ((0, 16),)


def test_reference_dequantizes_to_silu_gate_times_up():
    y, gs, us = _inputs(6, 40)
    q, s = swiglu_quantize_reference(y, gs, us)
    yf = np.asarray(y, np.float32)
    g, u = yf[:, :40] * np.asarray(gs), yf[:, 40:] * np.asarray(us)
    h = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(np.abs(_f32(q)).max(axis=1), 448.0)  # each row uses the whole fp8 range
    err = np.abs(_f32(q) * np.asarray(s) - h) / np.abs(h).max(axis=1, keepdims=True)
    assert err.max() <= 1 / 28  # half a float8 step at the top of the range, relative to the row's maximum
    assert err.max() > 0  # the values were rounded


@pytest.mark.parametrize("m,f,rows,warps", [(8, 48, 1, 4), (8, 48, 2, 4), (5, 112, 1, 4), (4, 16, 4, 1),
                                            (2, 1008, 2, 8)])
def test_interpret_equals_reference(m, f, rows, warps):
    y, gs, us = _inputs(m, f, seed=m + f)
    q, s = swiglu_quantize(y, gs, us, interpret=True, rows=rows, num_warps=warps)
    qr, sr = swiglu_quantize_reference(y, gs, us)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (m, f) and s.shape == (m, 1) and s.dtype == jnp.float32
    _assert_fp8_equal(q, qr)
    np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=1e-6)


@pytest.mark.parametrize("m,f,rows", [(6, 48, 1), (8, 80, 4)])
def test_interpret_with_bias_equals_reference(m, f, rows):
    y, gs, us = _inputs(m, f, seed=3)
    bias = jax.random.normal(jax.random.key(4), (2 * f,), jnp.float32) * 2  # rounded to y's dtype by both
    q, s = swiglu_quantize(y, gs, us, bias, interpret=True, rows=rows, num_warps=4)
    qr, sr = swiglu_quantize_reference(y, gs, us, bias)
    _assert_fp8_equal(q, qr)
    np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=1e-6)
    q0, _ = swiglu_quantize_reference(y, gs, us)
    assert (_f32(q0) != _f32(qr)).mean() > 0.5  # the bias is applied


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_interpret_other_dtypes(dtype):
    y, gs, us = _inputs(4, 32, dtype)
    q, s = swiglu_quantize(y, gs, us, interpret=True)
    qr, sr = swiglu_quantize_reference(y, gs, us)
    _assert_fp8_equal(q, qr)
    np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=1e-6)


def test_zero_rows_and_non_finite_rows():
    y, gs, us = _inputs(6, 32)
    y = y.at[1].set(0).at[2, 3].set(jnp.inf).at[3, 40].set(jnp.nan).at[4, :32].set(0)  # row 4: gate 0 -> h 0
    for q, s in (swiglu_quantize(y, gs, us, interpret=True), swiglu_quantize_reference(y, gs, us)):
        s = np.asarray(s)[:, 0]
        assert s[1] == 1.0 and s[4] == 1.0 and not _f32(q)[[1, 4]].any()  # all-zero h: scale 1, q 0
        assert np.isnan(s[2]) and np.isnan(s[3])  # inf / NaN in a row: NaN scale, so q * scale is NaN
        assert np.isfinite(s[[0, 5]]).all() and np.isfinite(_f32(q)[[0, 5]]).all()


def test_default_tiling():
    assert default_tiling(16384, 18944) == (1, 16)
    assert default_tiling(16384, 3424) == (1, 4)
    assert default_tiling(7, 16) == (1, 4)


def test_errors_name_the_argument():
    y, gs, us = _inputs(4, 32)
    with pytest.raises(ValueError, match=r"y: expected a 2-D array \[M, 2F\]"):
        swiglu_quantize(y[:, :63], gs, us)
    with pytest.raises(ValueError, match="y: expected dtype"):
        swiglu_quantize(y.astype(jnp.int32), gs, us)
    with pytest.raises(ValueError, match=r"gate_scale: expected float \[4, 1\]"):
        swiglu_quantize(y, gs[:, 0], us)
    with pytest.raises(ValueError, match=r"up_scale: expected float \[4, 1\]"):
        swiglu_quantize(y, gs, us.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"col_bias: expected None or float \[64\]"):
        swiglu_quantize(y, gs, us, jnp.zeros(32))
    with pytest.raises(ValueError, match="implementation: expected one of"):
        swiglu_quantize(y, gs, us, implementation="cuda")
    with pytest.raises(ValueError, match="multiple of 16"):
        swiglu_quantize(y[:, :40], gs, us, interpret=True)
    with pytest.raises(ValueError, match="rows: expected a power of two dividing M=4"):
        swiglu_quantize(y, gs, us, interpret=True, rows=3)
    with pytest.raises(ValueError, match="num_warps: expected a power of two"):
        swiglu_quantize(y, gs, us, interpret=True, num_warps=6)


def test_f_not_a_multiple_of_16_runs_the_reference():
    y, gs, us = _inputs(3, 20)
    q, s = swiglu_quantize(y, gs, us, implementation="reference")
    assert q.shape == (3, 20) and np.isfinite(np.asarray(s)).all()


@pytest.mark.parametrize("m,f", [(16384, 18944), (16384, 3424), (10, 16)])
def test_lowers_for_h100(m, f):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    fn = jax.jit(lambda y, g, u: swiglu_quantize(y, g, u, implementation="triton"))
    args = (jax.ShapeDtypeStruct((m, 2 * f), jnp.bfloat16), jax.ShapeDtypeStruct((m, 1), jnp.float32),
            jax.ShapeDtypeStruct((m, 1), jnp.float32))
    with jax.sharding.use_abstract_mesh(mesh):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "swiglu_quantize" in text and "__gpu$xla.gpu.triton" in text
