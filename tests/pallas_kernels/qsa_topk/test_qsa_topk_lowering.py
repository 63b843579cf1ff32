"""The fused QSA + top-k kernel lowers for an abstract H100 on a CPU machine (catches GPU
lowering errors in CI; the Triton-to-PTX compile itself needs a GPU)."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import qsa_topk


def _lower(q_shape, k_shape, dtype, **kw):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    f = jax.jit(lambda q, k, v: qsa_topk(q, k, v, implementation="triton", **kw))
    args = (jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(k_shape, dtype),
            jax.ShapeDtypeStruct(k_shape, dtype))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "qsa_topk" in text and "__gpu$xla.gpu.triton" in text
    return text


@pytest.mark.parametrize("topk,top_k,k_exact", [("exact", 128, 8), ("tournament", 100, 8),
                                                ("estimated", 128, 8), ("estimated", 16, 0)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_qsa_topk_lowers_for_h100(topk, top_k, k_exact, dtype):
    _lower((1, 5000, 28, 128), (1, 9000, 4, 128), dtype, gamma=16, block_kv=64, top_k=top_k,
           k_exact=k_exact, topk=topk, sink_blocks=1, local=256)


def test_qsa_topk_lowers_with_the_golden_scan():
    text = _lower((1, 5000, 28, 128), (1, 9000, 4, 128), jnp.bfloat16, gamma=16, block_kv=64, top_k=128,
                  k_exact=8, topk="estimated", sink_blocks=1, local=128, scan="golden")
    natural = _lower((1, 5000, 28, 128), (1, 9000, 4, 128), jnp.bfloat16, gamma=16, block_kv=64, top_k=128,
                     k_exact=8, topk="estimated", sink_blocks=1, local=128, scan="natural")
    assert text != natural  # the table input and the permuted loop index reach the kernel


def test_qsa_topk_lowers_with_odd_head_dim_and_small_tile():
    _lower((2, 700, 8, 80), (2, 900, 2, 80), jnp.float16, gamma=8, block_kv=32, top_k=5,
           k_exact=2, topk="estimated", rows=16, num_warps=8, num_stages=3)
