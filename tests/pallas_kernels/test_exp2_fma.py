"""`mosaic_fa3.exp2_fma`, the exponential on the FMA units that the Mosaic GPU kernels can use for some of P's
columns (``fma_columns``): the same function runs here through XLA on the CPU."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.mosaic_fa3 import exp2_fma


def test_relative_error_over_the_softmax_range():
    """Arguments of a softmax step, P = 2^(s * scale - m) with x <= 0: relative error <= 1.02e-4 wherever 2^x
    is a normal float32 (8e-5 is the cubic's own error; float32 rounding adds little)."""
    x = -np.concatenate([np.logspace(-9, np.log10(125.9), 400_001), np.linspace(0, 1, 10_001)])
    x = x.astype(np.float32)
    got = np.asarray(exp2_fma(jnp.asarray(x)), np.float64)
    ref = np.exp2(x.astype(np.float64))
    err = np.abs(got - ref) / ref
    assert err.max() < 1.02e-4, (err.max(), x[err.argmax()])
    assert err.max() > 5e-5  # the cubic's error, not exp2's: this is the emulation under test


def test_special_arguments():
    """0 gives 1 exactly; -inf (a masked logit) and -127 give +0 exactly; NaN stays NaN; below -126 the result
    is +0 or a subnormal below 2^-126 (never negative, never NaN): weights no softmax row can see next to its
    maximum's 1."""
    x = jnp.asarray([0.0, -jnp.inf, -127.0, -1000.0, jnp.nan, -126.6, -126.2], jnp.float32)
    got = np.asarray(exp2_fma(x))
    assert got[0] == 1.0
    np.testing.assert_array_equal(got[1:4], 0.0)
    assert not np.signbit(got[1:4]).any()
    assert np.isnan(got[4])
    tiny = got[5:]
    assert (tiny > 0).all() and (tiny < 2.0 ** -126).all(), tiny


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-126.0, max_value=0.0, allow_nan=False, width=32))
def test_any_argument_in_range(x):
    got = float(exp2_fma(jnp.float32(x)))
    ref = 2.0 ** float(np.float32(x))
    assert abs(got - ref) <= 1.02e-4 * ref, (x, got, ref)
