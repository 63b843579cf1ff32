"""What the non-finite checks cost inside the Triton kernels: each kernel with ``poison=True`` (every tile
checks its scores / input flags), ``poison=False`` (inputs known finite) and ``poison=None`` (the default:
the finite check on the device picks one), same inputs, same process, one JSON line per case, plus cuDNN on the same inputs for the block-sparse cases.

Usage: python3 tools/poison_cost.py --out $OUT/poison-cost.jsonl
Shapes: B=1, N=28, K=4, D=128, bf16, causal. Block-sparse: dense 128x64 layout at 32k and 128k, random 10%
at 128k. QSA + top-k: 128k, gamma 16, block 64, no top-k and the estimated top-k (k=128, k_exact=8, golden).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from gpu_timing import median_ms
from jsonl_log import append_jsonl

from pallas_kernels import BlockLayout
from pallas_kernels.block_sparse.triton import block_sparse_attention_triton
from pallas_kernels.qsa_topk.triton import qsa_topk_triton


def _inputs(s: int):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kq, (1, s, 28, 128), jnp.bfloat16), jax.random.normal(kk, (1, s, 4, 128), jnp.bfloat16),
            jax.random.normal(kv, (1, s, 4, 128), jnp.bfloat16))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--lens", type=int, nargs="+", default=[32768, 131072])
    args = p.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    rows = []

    def emit(**row):
        row["device"] = jax.devices()[0].device_kind
        print(json.dumps(row), flush=True)
        rows.append(row)
        append_jsonl(args.out, row)

    for s in args.lens:
        q, k, v = _inputs(s)
        if on_gpu:
            cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                        implementation="cudnn"))
            emit(kernel="cudnn", S=s, layout="dense", ms=median_ms(lambda: cudnn(q, k, v)))
        layouts = {"dense": BlockLayout.dense_causal(s, s, block_q=128, block_k=64)}
        if s >= 131072:
            layouts["random10"] = BlockLayout.random_causal(jax.random.key(1), s, s, keep=0.1, block_q=128,
                                                            block_k=64, batch=1, heads=28)
        for name, layout in layouts.items():
            for poison in (None, True, False):
                fn = jax.jit(lambda q, k, v, layout, poison=poison: block_sparse_attention_triton(
                    q, k, v, layout, sm_scale=128 ** -0.5, interpret=not on_gpu, poison=poison))
                emit(kernel="block_sparse", S=s, layout=name, poison=poison,
                     ms=median_ms(lambda: fn(q, k, v, layout)))
        if s >= 131072:
            for topk, kw in (("none", dict(top_k=1, k_exact=0)), ("estimated", dict(top_k=128, k_exact=8,
                                                                                     scan="golden"))):
                for poison in (None, True, False):
                    fn = jax.jit(lambda q, k, v, kw=kw, topk=topk, poison=poison: qsa_topk_triton(
                        q, k, v, gamma=16, block_kv=64, topk=topk, sink_blocks=1, local=128, sm_scale=128 ** -0.5,
                        interpret=not on_gpu, poison=poison, **kw))
                    emit(kernel="qsa_topk", S=s, topk=topk, poison=poison, ms=median_ms(lambda: fn(q, k, v)))


if __name__ == "__main__":
    main()
