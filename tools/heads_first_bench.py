"""The Mosaic GPU block-sparse kernel's work-item order: query blocks fastest against query heads fastest
(``heads_first``), on MOMO's key-sparse layout and on issue 16's kernel rows (a lent sm90 GPU).

Why: with query blocks fastest the CTAs that run together are neighbouring query blocks of one head, whose MOMO lists
share few blocks (about 5% at 1M, `bench momo`'s ``union_saving``), so MOMO's key-sparse pass at 1M reads most of
its K / V tiles from HBM (about 1 TB in 258 ms on an H200). The 7 query heads of one key / value head share about
half of theirs; with the heads fastest they run together and read those from L2.

Rows (B=1, 28 / 4 heads, D=128, bf16, causal): ``momo``: `Momo()`'s layout (the plan of `mmjax bench momo`'s
video-like input, 128-row query blocks over 64-key blocks, 1.6% at 1M) at ``--momo-lens``; ``dense`` (128-key
blocks), ``random10`` (64-key) and ``random3`` (128-key; per-head random lists, `BlockLayout.random_causal`) at
``--lens``. Each row: ms per call for both orders (median of ``--reps`` samples of queued calls), whether both give
the same output bit for bit, and cuDNN's ms at that length where ``--cudnn`` (TFLOP/s on computed tiles over cuDNN's
dense TFLOP/s). One JSON line per (row, length) into ``--out``.

Usage: python3 tools/heads_first_bench.py --out $OUT/heads-first.jsonl [--momo-lens 131072 1048576]
       [--lens 32768 131072] [--cudnn]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from gpu_timing import queued_median_ms
from jsonl_log import append_jsonl

from mmjax.drivers.bench.momo import GPU_CONFIG, video_like
from mmjax.sparse.layouts import KernelOptions
from mmjax.sparse.patterns import Momo
from pallas_kernels import BlockLayout
from pallas_kernels.block_sparse.mosaic_gpu import block_sparse_attention_mosaic_gpu

N, K, D = 28, 4, 128


def layouts(s: int, q, k, momo: bool) -> dict[str, BlockLayout]:
    """The rows' layouts at length s (module docstring)."""
    if momo:
        lay = jax.jit(lambda q, k: Momo().plan(q, k, k, options=KernelOptions(implementation="mosaic_gpu")).layout)
        return {"momo": lay(q, k)}
    key = jax.random.PRNGKey(4)
    return {"dense": BlockLayout.dense_causal(s, s, block_q=128, block_k=128),
            "random10": BlockLayout.random_causal(key, s, s, keep=0.1, block_q=128, block_k=64, heads=N),
            "random3": BlockLayout.random_causal(key, s, s, keep=0.03, block_q=128, block_k=128, heads=N)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--momo-lens", nargs="*", type=int, default=[131072, 1048576])
    p.add_argument("--lens", nargs="*", type=int, default=[32768, 131072])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cudnn", action="store_true")
    args = p.parse_args()
    device = jax.devices()[0].device_kind
    runs = [(s, True) for s in args.momo_lens] + [(s, False) for s in args.lens]
    for s, momo in runs:
        if momo:
            q, k, v = video_like(GPU_CONFIG, s, seed=s)
        else:
            kq, kk, kv = jax.random.split(jax.random.PRNGKey(s), 3)
            q = jax.random.normal(kq, (1, s, N, D), jnp.bfloat16)
            k, v = (jax.random.normal(x, (1, s, K, D), jnp.bfloat16) for x in (kk, kv))
        calls = max(1, min(10, 65536 // s * 2))
        reps = args.reps if s <= 131072 else 3
        cudnn_ms = None
        if args.cudnn and s <= 131072:
            f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
            cudnn_ms = queued_median_ms(lambda f=f, a=(q, k, v): f(*a), calls=calls, reps=reps, warmup=1)
        for name, lay in layouts(s, q, k, momo).items():
            row = dict(row=name, S=s, device=device, cudnn_ms=cudnn_ms)
            outs = {}
            for first in (False, True):
                f = jax.jit(lambda q, k, v, lay, hf=first: block_sparse_attention_mosaic_gpu(
                    q, k, v, lay, sm_scale=D ** -0.5, heads_first=hf))
                outs[first] = f(q, k, v, lay)
                row[f"ms_heads_first_{first}"] = queued_median_ms(lambda f=f, a=(q, k, v, lay): f(*a), calls=calls,
                                                                  reps=reps, warmup=1)
            row["same_output"] = bool(all(np.array_equal(np.asarray(a), np.asarray(b))
                                          for a, b in zip(outs[False], outs[True])))
            row["density"] = float(jnp.mean(lay.density()))  # computed tiles / causal pairs (dense: 1)
            if cudnn_ms:  # TFLOP/s on computed tiles over cuDNN's dense TFLOP/s (dense: cuDNN's time over ours)
                for first in (False, True):
                    row[f"of_cudnn_{first}"] = row["density"] * cudnn_ms / row[f"ms_heads_first_{first}"]
            append_jsonl(args.out, row)
            gain = row["ms_heads_first_False"] / row["ms_heads_first_True"]
            print(f"{name:9s} S={s:8d}: query blocks fastest {row['ms_heads_first_False']:9.3f} ms, heads fastest "
                  f"{row['ms_heads_first_True']:9.3f} ms ({gain:.3f}x), same output {row['same_output']}, cuDNN "
                  f"{cudnn_ms}, density {row['density']:.4f}", file=sys.stderr)
            del outs
        del q, k, v


if __name__ == "__main__":
    main()
