"""The Mosaic GPU QSA + top-k kernel on a CPU machine: its argument checks and its lowering to a Mosaic GPU module
for CUDA (running it needs an sm90 GPU: test_qsa_topk_gpu.py)."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import qsa_topk
from tests.pallas_kernels.helpers import random_qkv


@pytest.mark.parametrize("quantile,scan,block_kv,d", [("histogram", "golden", 64, 128),
                                                       ("histogram", "golden_pairs", 64, 128),
                                                       ("gaussian", "natural", 128, 80)])
def test_mosaic_qsa_topk_lowers_for_cuda(quantile, scan, block_kv, d):
    t, s = 3000, 5000
    q = jax.ShapeDtypeStruct((1, t, 8, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, s, 2, d), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: qsa_topk(q, k, v, gamma=16, block_kv=block_kv, top_k=32, k_exact=8, topk="estimated",
                                         sink_blocks=1, local=128, scan=scan, quantile=quantile, rows=128,
                                         implementation="mosaic_gpu"))
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):  # the Triton kernel (inputs holding a NaN / inf) lowers too
        text = f.trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("kw,match", [
    ({"topk": "exact"}, r"topk: expected 'estimated'"),
    ({"k_exact": 4}, r"k_exact: expected a positive multiple of 8"),
    ({"block_kv": 32}, r"block_kv: expected one of \(64, 128\)"),
    ({"rows": 64}, r"rows: expected 128"),
    ({"scan": "golden_pairs", "block_kv": 128, "top_k": 8}, r"scan: 'golden_pairs' takes block_kv=64"),
    ({"interpret": True}, r"interpret: expected False"),
    ({"dtype": jnp.float32}, r"q: expected dtype bfloat16 or float16"),
])
def test_mosaic_qsa_topk_rejects_unsupported_input(kw, match):
    kw = dict(kw)
    q, k, v = random_qkv(0, 1, 1024, 1024, 2, 1, 64, kw.pop("dtype", jnp.bfloat16))
    args = dict(gamma=16, block_kv=64, top_k=16, k_exact=8, topk="estimated", rows=128) | kw
    with pytest.raises(ValueError, match=match):
        qsa_topk(q, k, v, implementation="mosaic_gpu", **args)
