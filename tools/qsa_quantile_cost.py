"""What the estimated top-k's threshold rule costs inside the fused QSA + top-k Triton kernel: the kernel without any
top-k, and with the estimated top-k (k = 128, golden scan) under each threshold rule and k_exact, same inputs, same
process, one JSON line per case (`tools/jsonl_log.py`).

Usage: python3 tools/qsa_quantile_cost.py --out $OUT/qsa-quantile-cost.jsonl [--lens 131072 1048576]
       [--hist-every 1:1 1:8]  (histogram cases per (HIST_COUNT_EVERY, HIST_REFRESH_EVERY) of `topk.py`; tuning)
Shapes: B=1, N=28, K=4, D=128, bf16, gamma 16, block 64, one sink block, local 128 (MOMO's defaults).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from gpu_timing import median_ms
from jsonl_log import append_jsonl

from pallas_kernels.qsa_topk import topk as topk_lib
from pallas_kernels.qsa_topk.triton import qsa_topk_triton

CASES = (("none", "histogram", 0), ("estimated", "gaussian", 8), ("estimated", "histogram", 8))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--lens", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--hist-every", nargs="+", default=None, metavar="C:R")
    p.add_argument("--warps", type=int, nargs="+", default=[0], help="num_warps of the histogram cases (0: default)")
    args = p.parse_args()
    defaults = (topk_lib.HIST_COUNT_EVERY, topk_lib.HIST_REFRESH_EVERY)
    every = [tuple(int(x) for x in e.split(":")) for e in args.hist_every] if args.hist_every else [defaults]
    on_gpu = jax.default_backend() == "gpu"
    for s in args.lens:
        kq, kk, kv = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(kq, (1, s, 28, 128), jnp.bfloat16)
        k = jax.random.normal(kk, (1, s, 4, 128), jnp.bfloat16)
        v = jax.random.normal(kv, (1, s, 4, 128), jnp.bfloat16)
        cases = [(t, qn, ke, e, w) for t, qn, ke in CASES
                 for e in (every if qn == "histogram" and t != "none" else [defaults])
                 for w in (args.warps if qn == "histogram" and t != "none" else [0])]
        for topk, quantile, k_exact, (count_every, refresh_every), warps in cases:
            topk_lib.HIST_COUNT_EVERY, topk_lib.HIST_REFRESH_EVERY = count_every, refresh_every
            jax.clear_caches()  # the kernel reads the constants when traced
            fn = jax.jit(lambda q, k, v, topk=topk, quantile=quantile, k_exact=k_exact, warps=warps: qsa_topk_triton(
                q, k, v, gamma=16, block_kv=64, top_k=128 if topk != "none" else 1, k_exact=k_exact, topk=topk,
                sink_blocks=1, local=128, sm_scale=128 ** -0.5, scan="golden", quantile=quantile, num_warps=warps or None,
                interpret=not on_gpu))
            reps = 5 if s <= 262144 else 3
            row = dict(kernel="qsa_topk", S=s, topk=topk, quantile=quantile if topk != "none" else None,
                       k_exact=k_exact, num_warps=warps or None, hist_count_every=count_every, hist_refresh_every=refresh_every, ms=median_ms(lambda: fn(q, k, v), reps=reps, warmup=1),
                       device=jax.devices()[0].device_kind)
            print(json.dumps(row), flush=True)
            append_jsonl(args.out, row)


if __name__ == "__main__":
    main()
