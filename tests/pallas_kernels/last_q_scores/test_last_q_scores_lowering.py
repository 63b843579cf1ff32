"""The last-rows scoring kernel lowers to Triton for an abstract H100 on a CPU machine (catches GPU lowering errors
in CI, e.g. a block or slice shape Triton refuses; the Triton-to-PTX compile itself needs a GPU)."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.last_q_scores.triton import last_q_scores_triton


def _lower(s, last_q, dtype, *, rows=False, valid=False, **kw):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    b, n, kh, d = 1, 28, 4, 128

    def f(q, k, r, m):
        return last_q_scores_triton(q, k, last_q=last_q, sm_scale=d ** -0.5, rows=r if rows else None,
                                    k_valid=m if valid else None, **kw)

    args = (jax.ShapeDtypeStruct((b, s, n, d), dtype), jax.ShapeDtypeStruct((b, s, kh, d), dtype),
            jax.ShapeDtypeStruct((b, last_q), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.bool_))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "last_q_scores_stats" in text and "__gpu$xla.gpu.triton" in text
    return text


@pytest.mark.parametrize("s,last_q,dtype,kw", [
    (131072, 64, jnp.bfloat16, {}),  # the patterns' rows at 128k
    (5000, 40, jnp.float16, {"lanes": 3}),  # ragged S
    (3000, 128, jnp.bfloat16, {}),  # 128 rows: 128-key tiles
    (7000, 64, jnp.bfloat16, {"block_k": 128, "num_warps": 8}),  # 128-key tiles for 64 rows, 8 warps
])
def test_kernel_lowers_for_h100(s, last_q, dtype, kw):
    _lower(s, last_q, dtype, **kw)


def test_kernel_lowers_with_chosen_rows_and_valid_keys():
    _lower(6000, 64, jnp.bfloat16, rows=True, valid=True)
