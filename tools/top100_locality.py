"""How much of the Mosaic GPU kernel's time on MInference's top-100 mask is the memory side (issue 16).

Run on an sm90 GPU: ``python tools/top100_locality.py --out DIR [--lens 32768,131072,524288]``.
Builds MInference's pooled top-100 key blocks per 64-row query block (`minference_index.pooled_block_index`) on the
video-like input of `minference_side_by_side.py` (B=1, 8 / 8 heads, D=128, bf16, causal) and times the Mosaic GPU
kernel's default on that mask and on masks with the same list lengths whose tiles differ only in where they lie
(the work per query block is the same; the causal diagonal tile, masked, appears only where the mask lists it):

* **as given**: the mask (each list ascending).
* **descending** / **shuffled**: the same lists, each read last entry first / in a random order.
* **popular first**: the same lists, each read from the blocks most lists of its head name to the least named
  (ties ascending), so co-running query blocks start on the tiles they share.
* **shared**: every list names the blocks ``0 .. count - 1`` (all of a head's query blocks read the same tiles:
  about 3 MiB a head, resident in L2): the kernel's time with next to no HBM traffic.
* **random**: ``count`` distinct causal blocks drawn at random per list (almost no reuse between query blocks).

The gap between "as given" and "shared" bounds what a better L2 order could gain on this mask. Columns: ms (median
of ``--reps`` samples of ``--calls`` queued calls), TFLOP/s on computed pairs, ms over "shared". Writes
``top100_locality.json`` and a plot into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import queued_median_ms  # noqa: E402
from jsonl_log import write_atomic  # noqa: E402
from minference_index import block_index_counts, causal_top_k, pooled_block_index  # noqa: E402
from token_axes import finish_token_axes  # noqa: E402

from mmjax.sparse.synthetic import video_qkv  # noqa: E402
from pallas_kernels import BlockLayout  # noqa: E402
from pallas_kernels.block_sparse.layout import causal_pairs  # noqa: E402
from pallas_kernels.block_sparse.mosaic_gpu import block_sparse_attention_mosaic_gpu  # noqa: E402

HEADS, D, BLOCK = 8, 128, 64
matplotlib.use("Agg")


def reorder(idx: jax.Array, count: jax.Array, keys: jax.Array) -> jax.Array:
    """Each list's first ``count`` entries of ``idx [B, N, nq, K]`` sorted by ``keys`` (same shape), the rest kept."""
    k = idx.shape[-1]
    live = jnp.arange(k) < count[..., None]
    order = jnp.argsort(jnp.where(live, keys, jnp.inf), axis=-1)  # live entries first, in key order
    return jnp.take_along_axis(idx, order, axis=-1)


def variants(idx: jax.Array, count: jax.Array, seed: int) -> dict[str, jax.Array]:
    """{name: block ids [B, N, nq, K]} of the masks in the module docstring, all with ``count``'s list lengths."""
    b, n, nq, k = idx.shape
    pos = jnp.broadcast_to(jnp.arange(k, dtype=jnp.float32), idx.shape)
    k1, k2 = jax.random.split(jax.random.key(seed))
    shared = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), idx.shape)  # j < count <= m + 1: causal
    drawn = causal_top_k(jax.random.uniform(k2, (b, n, nq, nq)), k)
    live = (jnp.arange(k) < count[..., None]).astype(jnp.float32)
    heads = (jnp.arange(b)[:, None, None, None], jnp.arange(n)[None, :, None, None])
    named = jnp.zeros((b, n, nq)).at[(*heads, idx)].add(live)  # how many lists of the head name each key block
    popular = reorder(idx, count, -jnp.take_along_axis(named[:, :, None, :], idx, axis=-1) + pos / k)
    return {"as given": idx, "descending": reorder(idx, count, -pos),
            "shuffled": reorder(idx, count, jax.random.uniform(k1, idx.shape)), "popular first": popular,
            "shared": shared, "random": drawn}


def figure(rows: list[dict], device: str):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["mask"] for r in rows):
        pts = sorted((r["tokens"], r["tflops"]) for r in rows if r["mask"] == name and "ms" in r)
        ax.plot(*zip(*pts), marker="o", label=name)
    return finish_token_axes(fig, ax, ylabel="TFLOP/s on computed pairs",
                             title=f"Mosaic GPU kernel, top-100 list lengths, 8 heads, {device}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lens", type=lambda x: [int(v) for v in x.split(",")], default=[32768, 131072, 524288])
    ap.add_argument("--top-k", type=int, default=100)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0].device_kind
    result = {"device": dev, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "jax": jax.__version__,
              "shape": {"B": 1, "N": HEADS, "K": HEADS, "D": D, "block": BLOCK, "top_k": args.top_k}, "rows": []}
    fn = jax.jit(lambda q, k, v, lay: block_sparse_attention_mosaic_gpu(q, k, v, lay, sm_scale=D ** -0.5)[0])
    for s in args.lens:
        q, k, v = video_qkv(jax.random.key(s), s, heads=HEADS, kv_heads=HEADS, head_dim=D, dtype=jnp.bfloat16)
        idx = jax.jit(pooled_block_index, static_argnums=2)(q, k, args.top_k)
        count = block_index_counts(idx)
        rows = []  # this length's
        for name, ids in variants(idx, count, s).items():
            lay = BlockLayout(kv_blocks=ids, kv_block_count=count, block_q=BLOCK, block_k=BLOCK, q_len=s, kv_len=s)
            pairs = float(jnp.sum(lay.density())) * causal_pairs(s, s)
            try:
                ms = queued_median_ms(lambda: fn(q, k, v, lay), calls=args.calls, reps=args.reps)
            except Exception as e:  # noqa: BLE001 -- one failing mask must not hide the others
                rows.append({"tokens": s, "mask": name, "error": f"{type(e).__name__}: {str(e)[:500]}"})
                print(f"{s:>7} {name:<11} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            rows.append({"tokens": s, "mask": name, "ms": ms, "pairs": pairs,
                         "tflops": 4 * D * pairs / (ms / 1e3) / 1e12})
        shared_ms = next((r["ms"] for r in rows if r["mask"] == "shared" and "ms" in r), None)
        for r in rows:
            if "ms" in r:
                r["over_shared"] = r["ms"] / shared_ms if shared_ms else None
                ratio = f"{r['over_shared']:.3f}x shared" if shared_ms else ""
                print(f"{s:>7} {r['mask']:<11} {r['ms']:9.3f} ms {r['tflops']:6.1f} TFLOP/s {ratio}", flush=True)
        result["rows"] += rows
        write_atomic(os.path.join(args.out, "top100_locality.json"), lambda f: json.dump(result, f, indent=1))
    fig = figure(result["rows"], dev)
    write_atomic(os.path.join(args.out, "top100_locality.png"), lambda f: fig.savefig(f, format="png", dpi=120),
                 binary=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
