"""MOMO end to end on a GPU (kernels compiled): `pytest -m gpu`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.sparse.layouts import KernelOptions
from mmjax.sparse.patterns.momo import Momo, delta_correct
from pallas_kernels import block_sparse_attention
from tests.pallas_kernels.helpers import random_qkv, rel_err

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("topk", ["exact", "estimated"])
@pytest.mark.parametrize("options", [KernelOptions(implementation="triton"), KernelOptions()],
                         ids=["triton", "default"])
def test_momo_sampled_rows_equal_cudnn_and_match_reference(topk, options):
    """Triton kernels, and the default (on Hopper: the fused Mosaic GPU QSA for the estimated top-k and the Mosaic
    block-sparse kernel)."""
    q, k, v = random_qkv(7, 1, 8192, 8192, 28, 4, 128, jnp.bfloat16)
    pattern = Momo(k=16, k_trim=16, topk=topk)
    out, _ = jax.jit(lambda q, k, v: pattern.attend(q, k, v, options=options))(q, k, v)
    dense = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    assert rel_err(out[:, ::16], dense[:, ::16]) < 2e-2
    plan = pattern.plan(q, k, v, options=options)
    assert float(np.asarray(plan.layout.density()).mean()) < 0.5
    ref_out, ref_lse = block_sparse_attention(q, k, v, plan.layout, implementation="reference")
    ref, _ = delta_correct(ref_out, ref_lse, plan.qsa.out_gamma, plan.qsa.lse_gamma, 16)
    assert rel_err(out, ref) < 2e-2
    assert not np.isnan(np.asarray(out, np.float32)).any()
