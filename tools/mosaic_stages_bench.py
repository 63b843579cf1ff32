"""Mosaic GPU block-sparse kernel: time per K/V stage count on two layout families (a tuning aid).

Run on an sm90 GPU: ``python tools/mosaic_stages_bench.py --out DIR [--lens 32768,131072,524288]
[--layouts top100,dense]``. Layouts:

* ``top100``: MInference's pooled top-100 key blocks per 64-row query block on a video-like input (B=1, 8 heads,
  D=128, bf16), run with 64-row query blocks (one query block and one ring of K/V stages per consumer warpgroup);
* ``dense``: the dense causal layout with 128-row query blocks and 128-key tiles (B=1, 28 query / 4 key-value
  heads, D=128, bf16), next to cuDNN's causal attention on the same inputs (``cudnn_ms`` in each row).

Each ``--stages`` count runs (a count that does not fit is reported with the kernel's error); outputs are checked
against the first count's. Appends JSON lines to ``DIR/mosaic-stages.jsonl``.
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


def _layout(name: str, s: int):
    """(q, k, v, layout, extra row fields) of one layout family at ``s`` tokens."""
    if name == "top100":
        q, k, v = video_qkv(jax.random.key(s), s, heads=8, kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
        idx = pooled_block_index(q, k, 100)
        lay = BlockLayout(kv_blocks=idx, kv_block_count=block_index_counts(idx), block_q=64, block_k=64, q_len=s,
                          kv_len=s)
        return q, k, v, lay, {"layout": "pooled top-100, 64x64"}
    if name == "dense":
        kq, kk, kv = jax.random.split(jax.random.key(s), 3)
        q = jax.random.normal(kq, (1, s, 28, 128), jnp.bfloat16)
        k = jax.random.normal(kk, (1, s, 4, 128), jnp.bfloat16)
        v = jax.random.normal(kv, (1, s, 4, 128), jnp.bfloat16)
        cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
        return q, k, v, BlockLayout.dense_causal(s, s, block_q=128, block_k=128), {
            "layout": "dense causal, 128x128, 28/4 heads",
            "cudnn_ms": queued_median_ms(lambda: cudnn(q, k, v), calls=3)}
    raise ValueError(f"--layouts: expected top100 or dense; received {name!r}")


def run_layout(name: str, s: int, args, device: str) -> None:
    q, k, v, lay, extra = _layout(name, s)
    base = None
    for st in args.stages:
        f = jax.jit(lambda q, k, v, lay, st=st: block_sparse_attention_mosaic_gpu(
            q, k, v, lay, sm_scale=128 ** -0.5, num_stages=st)[0])
        row = {"device": device, "tokens": s, "stages": st, **extra}
        try:
            out = f(q, k, v, lay)
            row["ms"] = queued_median_ms(lambda f=f: f(q, k, v, lay), calls=args.calls if name == "top100" else 3)
            if base is None:
                base = out
            else:
                row["rel_err_vs_first"] = rel_err(out, base)
        except Exception as e:  # noqa: BLE001 -- a count that does not fit is a result too
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(row, flush=True)
        append_jsonl(os.path.join(args.out, "mosaic-stages.jsonl"), row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lens", type=lambda x: [int(v) for v in x.split(",")], default=[32768, 131072, 524288])
    ap.add_argument("--stages", type=lambda x: [int(v) for v in x.split(",")], default=[2, 3])
    ap.add_argument("--layouts", type=lambda x: x.split(","), default=["top100", "dense"])
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = jax.devices()[0].device_kind
    for name in args.layouts:
        for s in args.lens:
            run_layout(name, s, args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
