"""What the estimated top-k's threshold rule costs inside the fused QSA + top-k Triton kernel: the kernel without any
top-k, and with the estimated top-k (k = 128, golden scan) under each threshold rule and k_exact, same inputs, same
process, one JSON line per case (`tools/jsonl_log.py`).

Usage: python3 tools/qsa_quantile_cost.py --out $OUT/qsa-quantile-cost.jsonl [--lens 131072 1048576]
Shapes: B=1, N=28, K=4, D=128, bf16, gamma 16, block 64, one sink block, local 128 (MOMO's defaults).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from gpu_timing import median_ms
from jsonl_log import append_jsonl

from pallas_kernels.qsa_topk.triton import qsa_topk_triton

CASES = (("none", "histogram", 0), ("estimated", "gaussian", 8), ("estimated", "histogram", 8),
         ("estimated", "gaussian", 16), ("estimated", "histogram", 16))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--lens", type=int, nargs="+", default=[131072, 1048576])
    args = p.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    for s in args.lens:
        kq, kk, kv = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(kq, (1, s, 28, 128), jnp.bfloat16)
        k = jax.random.normal(kk, (1, s, 4, 128), jnp.bfloat16)
        v = jax.random.normal(kv, (1, s, 4, 128), jnp.bfloat16)
        for topk, quantile, k_exact in CASES:
            fn = jax.jit(lambda q, k, v, topk=topk, quantile=quantile, k_exact=k_exact: qsa_topk_triton(
                q, k, v, gamma=16, block_kv=64, top_k=128 if topk != "none" else 1, k_exact=k_exact, topk=topk,
                sink_blocks=1, local=128, sm_scale=128 ** -0.5, scan="golden", quantile=quantile,
                interpret=not on_gpu))
            reps = 5 if s <= 262144 else 3
            row = dict(kernel="qsa_topk", S=s, topk=topk, quantile=quantile if topk != "none" else None,
                       k_exact=k_exact, ms=median_ms(lambda: fn(q, k, v), reps=reps, warmup=1),
                       device=jax.devices()[0].device_kind)
            print(json.dumps(row), flush=True)
            append_jsonl(args.out, row)


if __name__ == "__main__":
    main()
