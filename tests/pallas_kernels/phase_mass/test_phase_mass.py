"""`phase_masses`: the reference against its definition, the Triton kernel in interpret mode against the reference,
its lowering for an abstract H100, and argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.phase_mass import phase_masses
from pallas_kernels.phase_mass.triton import phase_masses_triton


def _vertical(b, n, s, seed=0):
    return jnp.asarray(np.random.default_rng(seed).random((b, n, s)) + 0.01, jnp.float32)


def _definition(v, strides):
    v = np.asarray(v, np.float64)
    w = 1 << (max(strides) - 1).bit_length()
    out = np.full(v.shape[:2] + (len(strides), w), -np.inf)
    for c, st in enumerate(strides):
        for p in range(st):
            out[:, :, c, p] = v[..., p::st].sum(-1)
    return out


@pytest.mark.parametrize("b,n,s,strides", [
    (1, 3, 1000, (64, 81, 100, 128, 144, 300, 1000)),  # widths 128 / 256 / 512 / 1024, a stride of S
    (2, 2, 517, (7, 1, 33, 16)),  # unsorted, stride 1, widths 1 / 8 / 16 / 64
])
def test_reference_matches_the_definition(b, n, s, strides):
    v = _vertical(b, n, s)
    np.testing.assert_allclose(np.asarray(phase_masses(v, strides, implementation="reference")),
                               _definition(v, strides), rtol=1e-5)


@pytest.mark.parametrize("b,n,s,strides", [
    (1, 3, 1000, (64, 81, 100, 128, 144, 300, 1000)),
    (2, 2, 517, (7, 1, 33, 16)),  # unsorted strides come back in their order
    (1, 2, 4096, (64, 96, 256, 257, 1024)),  # S a multiple of some strides, many steps
])
def test_kernel_matches_the_reference(b, n, s, strides):
    v = _vertical(b, n, s, seed=s)
    want = phase_masses(v, strides, implementation="reference")
    got = phase_masses(v, strides, implementation="triton", interpret=True)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(np.asarray(want))
    np.testing.assert_allclose(np.asarray(got)[fin], np.asarray(want)[fin], rtol=1e-5)


def test_infinite_scores_stay_infinite():
    """A +inf vertical score (a non-finite logit, `last_q_scores`) makes its phase +inf in both forms."""
    v = _vertical(1, 2, 300).at[0, 1, 130].set(jnp.inf)
    for impl in ("reference", "triton"):
        got = np.asarray(phase_masses(v, (64, 100), implementation=impl, interpret=impl == "triton"))
        assert got[0, 1, 0, 130 % 64] == np.inf and got[0, 1, 1, 30] == np.inf
        assert np.isfinite(got[0, 0, :, :64]).all() and not np.isnan(got).any()


def test_kernel_lowers_for_h100():
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    strides = tuple(range(64, 1025, 16)) + (81, 100, 900)
    f = jax.jit(lambda v: phase_masses_triton(v, strides))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(jax.ShapeDtypeStruct((1, 28, 131072), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 5  # one kernel per width: 128 / 256 / 512 / 1024 and 64


@pytest.mark.parametrize("vertical,strides,kw,match", [
    (jnp.zeros((2, 8)), (4,), {}, "vertical: expected a float32 array"),
    (jnp.zeros((1, 2, 8), jnp.bfloat16), (4,), {}, "vertical: expected a float32 array"),
    (jnp.zeros((1, 2, 8)), (), {}, "strides: expected a non-empty sequence"),
    (jnp.zeros((1, 2, 8)), (0,), {}, r"strides: expected .* ints in \[1, S=8\]"),
    (jnp.zeros((1, 2, 8)), (9,), {}, r"strides: expected .* ints in \[1, S=8\]"),
    (jnp.zeros((1, 2, 8)), (True,), {}, "strides: expected"),
    (jnp.zeros((1, 2, 8)), 4, {}, "strides: expected"),
    (jnp.zeros((1, 2, 8)), (4,), {"implementation": "cuda"}, "implementation: expected one of"),
    (jnp.zeros((1, 1, 9000)), (8193,), {"implementation": "triton", "interpret": True}, "strides: expected at most"),
])
def test_bad_arguments_are_named(vertical, strides, kw, match):
    with pytest.raises(ValueError, match=match):
        phase_masses(vertical, strides, **kw)


def test_default_takes_the_reference_past_the_kernels_widest_stride():
    """implementation=None with the kernel chosen (interpret) runs the reference for a stride past MAX_STRIDE."""
    v = jax.random.uniform(jax.random.PRNGKey(3), (1, 1, 9000), jnp.float32)
    got = phase_masses(v, (8193, 7), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(phase_masses(v, (8193, 7), implementation="reference")))
    assert float(got[0, 0, 0, :8193].sum()) == pytest.approx(float(v.sum()), rel=1e-5)
