"""Time the QSA + top-k kernel of several commits on one GPU in one process each (regression bisect).

Usage (on the device, after ``git archive <commit> pallas_kernels | tar -x -C DIR``):
    PYTHONPATH=DIR python3 tools/qsa_bisect.py --label COMMIT --out $OUT/qsa-bisect.jsonl

Times the Triton ``qsa_topk_triton`` (interpret mode off a GPU) (B=1, N=28, K=4, D=128, bf16, gamma 16, block 64, MOMO's sink / local) at each length with
``topk="none"`` (attention + block scores only) and the estimated top-k (k=128, k_exact=8; with the natural scan
where the commit has a ``scan`` argument, so every commit scans in the same order), median of 5 after 2 warm-ups,
and appends one JSON line per (length, variant).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json

import jax
import jax.numpy as jnp
from gpu_timing import median_ms
from jsonl_log import append_jsonl

import pallas_kernels
from pallas_kernels.qsa_topk.triton import qsa_topk_triton


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[131072])
    p.add_argument("--rows", type=int, nargs="+", default=[64], help="sampled rows per program (tile)")
    args = p.parse_args()

    has_scan = "scan" in inspect.signature(qsa_topk_triton).parameters
    interpret = jax.default_backend() != "gpu"
    for s in args.seq_lens:
        kq, kk, kv = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(kq, (1, s, 28, 128), jnp.bfloat16)
        k = jax.random.normal(kk, (1, s, 4, 128), jnp.bfloat16)
        v = jax.random.normal(kv, (1, s, 4, 128), jnp.bfloat16)
        for rows, (name, kw) in itertools.product(args.rows, (("none", dict(top_k=1, k_exact=0, topk="none")),
                                                             ("estimated", dict(top_k=128, k_exact=8,
                                                                                topk="estimated")))):
            if has_scan and name == "estimated":
                kw = dict(kw, scan="natural")
            fn = jax.jit(lambda q, k, v, kw=kw, rows=rows: qsa_topk_triton(
                q, k, v, gamma=16, block_kv=64, sink_blocks=1, local=128, sm_scale=128 ** -0.5, interpret=interpret,
                rows=rows, **kw))
            ms = median_ms(lambda: fn(q, k, v), reps=5 if s <= 262144 else 3)
            row = dict(label=args.label, module=pallas_kernels.__file__, S=s, rows=rows, variant=name, ms=ms,
                       device=jax.devices()[0].device_kind)
            print(json.dumps(row), flush=True)
            append_jsonl(args.out, row)


if __name__ == "__main__":
    main()
