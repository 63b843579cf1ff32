"""Mosaic GPU block-sparse kernel: time per K/V stage count on one layout family (a tuning aid).

Run on an sm90 GPU: ``python tools/mosaic_stages_bench.py --out DIR [--lens 32768,131072,524288]``. The layout is
MInference's pooled top-100 key blocks per 64-row query block on a video-like input (B=1, 8 heads, D=128, bf16),
run with 64-row query blocks (one query block and one ring of K/V stages per consumer warpgroup) at each
``--stages`` count, including counts above the kernel's default that only fit when the shared-memory budget is
raised; a count that fails to compile is reported. Outputs are checked against the default's. Appends JSON lines
to ``DIR/mosaic-stages.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import rel_err  # noqa: E402
from gpu_timing import queued_median_ms  # noqa: E402
from jsonl_log import append_jsonl  # noqa: E402
from minference_index import block_index_counts, pooled_block_index  # noqa: E402

from mmjax.sparse.synthetic import video_qkv  # noqa: E402
from pallas_kernels import BlockLayout  # noqa: E402
from pallas_kernels.block_sparse.mosaic_gpu import block_sparse_attention_mosaic_gpu  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lens", type=lambda x: [int(v) for v in x.split(",")], default=[32768, 131072, 524288])
    ap.add_argument("--stages", type=lambda x: [int(v) for v in x.split(",")], default=[2, 3])
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = jax.devices()[0].device_kind
    for s in args.lens:
        q, k, v = video_qkv(jax.random.key(s), s, heads=8, kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
        idx = pooled_block_index(q, k, 100)
        lay = BlockLayout(kv_blocks=idx, kv_block_count=block_index_counts(idx), block_q=64, block_k=64, q_len=s,
                          kv_len=s)
        base = None
        for st in args.stages:
            f = jax.jit(lambda q, k, v, lay, st=st: block_sparse_attention_mosaic_gpu(
                q, k, v, lay, sm_scale=128 ** -0.5, num_stages=st)[0])
            row = {"device": device, "tokens": s, "stages": st, "layout": "pooled top-100, 64x64"}
            try:
                out = f(q, k, v, lay)
                row["ms"] = queued_median_ms(lambda f=f: f(q, k, v, lay), calls=args.calls)
                if base is None:
                    base = out
                else:
                    row["rel_err_vs_first"] = rel_err(out, base)
            except Exception as e:  # noqa: BLE001 -- a count that does not fit is a result too
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            print(row, flush=True)
            append_jsonl(os.path.join(args.out, "mosaic-stages.jsonl"), row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
