"""tools/qsa_topk_ablation.py on a CPU: every variant of the fused Mosaic GPU QSA + top-k lowers for CUDA (running
them needs a Hopper GPU), and the patches are undone afterwards."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
import qsa_topk_ablation as ablation  # noqa: E402

from pallas_kernels.qsa_topk import mosaic_gpu, topk  # noqa: E402


@pytest.mark.parametrize("name", list(ablation.variants()))
def test_every_variant_lowers_for_cuda_and_is_undone(name):
    def patched():
        return topk.mosaic_tracing, topk.erfinv, topk._every, mosaic_gpu.scatter_rows, mosaic_gpu.qsa_topk_mosaic_gpu

    before = patched()
    q = jax.ShapeDtypeStruct((1, 2048, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16)

    def lower():
        f = jax.jit(lambda q, k, v: mosaic_gpu.qsa_topk_mosaic_gpu(
            q, k, v, gamma=16, block_kv=64, top_k=32, k_exact=8, sink_blocks=1, local=128, sm_scale=0.1))
        return f.trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()

    assert "mosaic_gpu" in ablation.run_variant(ablation.variants()[name], lower)
    assert patched() == before
