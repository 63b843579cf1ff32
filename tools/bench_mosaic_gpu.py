"""Hopper check + timing of the Mosaic GPU block-sparse kernel against cuDNN and Triton.

Run on an sm90 GPU: ``python tools/bench_mosaic_gpu.py --out DIR [--lens 32768,131072,524288]``.
Checks the dense causal layout through the Mosaic kernel against cuDNN at 4k and 32k and a
random 10% layout against the Triton kernel at 32k, then times (median of device-synchronised
runs after a warm-up, each of 10 queued calls up to 32k tokens) cuDNN causal, Triton (128x64
tiles) and Mosaic (block_k 64 and 128) on the dense causal layout, Triton on a random 10% layout
and Mosaic on random 10% and 3% layouts with 64- and 128-key blocks (issue 16's rows; with
``--variants`` also permuted and column layouts; the Mosaic rows with the kernel's own grid
choice, `auto_persistent`); B=1, N=28, K=4, D=128, bf16. The density of a random layout counts
its computed tiles plus its columns. Writes ``mosaic_gpu.json`` and ``mosaic_gpu.png`` (each
row's ratio to cuDNN by length: dense time ratios, sparse TFLOP/s ratios) into ``--out`` and
prints a table.
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
from compare import rel_err
from gpu_timing import queued_median_ms
from jsonl_log import write_atomic
from token_axes import finish_token_axes

from pallas_kernels import BlockLayout, block_sparse_attention
from pallas_kernels.block_sparse.mosaic_gpu import block_sparse_attention_mosaic_gpu

N, K, D = 28, 4, 128
matplotlib.use("Agg")


def inputs(s: int, seed: int):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (1, s, N, D), jnp.bfloat16)
    k = jax.random.normal(kk, (1, s, K, D), jnp.bfloat16)
    v = jax.random.normal(kv, (1, s, K, D), jnp.bfloat16)
    return q, k, v


def random_layout(s: int, keep: float, block_k: int, heads: int = N) -> BlockLayout:
    """Issue 16's random causal rows: `BlockLayout.random_causal` with seed 4, 128-row query blocks, over ``s``
    queries and keys (the layout the other Mosaic tools time, so their rows compare)."""
    return BlockLayout.random_causal(jax.random.PRNGKey(4), s, s, keep=keep, block_q=128, block_k=block_k, heads=heads)


def median_time(fn, args, reps: int, calls: int = 1) -> float:
    """Median seconds per call over ``reps`` samples of ``calls`` calls queued before one wait, after one warm-up
    (`gpu_timing.queued_median_ms`: sub-millisecond kernels are not timed with the host's round trip)."""
    return queued_median_ms(lambda: fn(*args), calls=calls, reps=reps, warmup=1) / 1e3


def fixed_lists(key, s: int, n: int, block_k: int, heads: int) -> BlockLayout:
    """Every 128-row query block lists its diagonal key block and ``n - 1`` other causal ones drawn at random (all of
    them where it has fewer), ascending: lists of one length, as in A-shape, top-k and local-window layouts."""
    dense = BlockLayout.dense_causal(s, s, block_q=128, block_k=block_k)
    nq, nk = dense.num_q_blocks, dense.num_kv_blocks
    causal = dense.kv_block_count[0, 0]  # [nq]
    ids = jnp.arange(nk)
    scores = jax.random.uniform(key, (heads, nq, nk))
    scores = jnp.where(ids == causal[:, None] - 1, 2.0, jnp.where(ids < causal[:, None], scores, -1.0))
    _, picked = jax.lax.top_k(scores, n)
    count = jnp.minimum(causal, n).astype(jnp.int32)
    picked = jnp.sort(jnp.where(jnp.arange(n) < count[:, None], picked, nk), axis=-1)
    return dense.replace(kv_blocks=jnp.minimum(picked, nk - 1).astype(jnp.int32)[None],
                         kv_block_count=jnp.broadcast_to(count, (1, heads, nq)))


def figure(result: dict):
    """Each Mosaic / Triton row's ratio to cuDNN by length (dense: cuDNN's time over the row's; random: the row's
    TFLOP/s on computed tiles over cuDNN's dense TFLOP/s), with the issue's 1.0 and 0.9 target lines."""
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in result["timings"]:
        ratio = r.get("tflops_vs_cudnn") or r.get("cudnn_ratio")
        if "ms" in r and r["impl"] != "cudnn" and ratio:
            series.setdefault((r["impl"], r["layout"]), []).append((r["len"], ratio))
    fig, ax = plt.subplots(figsize=(8, 5))
    for (impl, layout), points in sorted(series.items()):
        ax.plot(*zip(*sorted(points)), marker="o", ls="-" if layout.startswith("dense") else "--",
                label=f"{impl}: {layout}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.9, color="gray", lw=0.8, ls=":")
    return finish_token_axes(fig, ax, ylabel="x cuDNN (dense: time; random: TFLOP/s on computed tiles)",
                             title=f"{result['device']}, {result['date']}, B=1 N={N} K={K} D={D} bf16 causal",
                             legend_size=7)


def cudnn_fn():
    return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))


def kernel_fn(impl: str, **kw):
    return jax.jit(lambda q, k, v, lay: block_sparse_attention(q, k, v, lay, implementation=impl, **kw)[0])


def mosaic_fn(**options):
    """The Mosaic GPU kernel called directly with ``options`` off its defaults, e.g. ``persistent=True`` / ``False``
    (one CTA per multiprocessor / per work item; the default chooses, `auto_persistent`) or ``key_pairs=False`` (one
    64-key list entry per step; the default pairs them on 128-row query blocks)."""
    return jax.jit(lambda q, k, v, lay: block_sparse_attention_mosaic_gpu(q, k, v, lay, sm_scale=D ** -0.5,
                                                                          **options)[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lens", default="32768,131072,524288")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--variants", action="store_true",
                    help="also time permuted (shared / per head) and column layouts")
    ap.add_argument("--grids", action="store_true",
                    help="also time the dense and random 10%% / 3%% layouts with 64- and 128-key blocks on the "
                         "persistent grid and with one CTA per work item")
    ap.add_argument("--fixed-lists", default="",
                    help="also time layouts whose query blocks all list N key blocks (`fixed_lists`), for each N of "
                         "this comma list, with 64- and 128-key blocks on the persistent grid and the item grid")
    ap.add_argument("--short-rows", action="store_true",
                    help="also time cuDNN on the same tokens cut into causal sequences of 1k / 2k / 4k (rows as "
                         "short as a random layout's lists at 32k): its TFLOP/s against its own at full length")
    ap.add_argument("--pairs", action="store_true",
                    help="also time the 64-key layouts with one list entry per step (key_pairs=False)")
    ap.add_argument("--overlap", action="store_true",
                    help="also time every Mosaic row with overlap=True (the next step's softmax while P V runs), "
                         "with and without the schedule barrier (pingpong)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lens = [int(x) for x in args.lens.split(",")]
    dev = jax.devices()[0]
    result = {"device": dev.device_kind, "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
              "shape": {"B": 1, "N": N, "K": K, "D": D, "dtype": "bfloat16", "causal": True},
              "checks": {}, "timings": []}

    def dump():
        write_atomic(os.path.join(args.out, "mosaic_gpu.json"), lambda f: json.dump(result, f, indent=1))

    if not args.skip_checks:
        for s in (4096, 32768):
            q, k, v = inputs(s, s)
            ref = cudnn_fn()(q, k, v)
            for bk in (64, 128):
                lay = BlockLayout.dense_causal(s, s, block_q=128, block_k=bk)
                err = rel_err(kernel_fn("mosaic_gpu")(q, k, v, lay), ref)
                result["checks"][f"dense_vs_cudnn_{s}_bk{bk}"] = err
                print(f"check dense {s} bk={bk}: rel err vs cudnn {err:.2e}", flush=True)
        s = 32768
        q, k, v = inputs(s, 1)
        lay = BlockLayout.random_causal(jax.random.PRNGKey(2), s, s, keep=0.1, block_q=128, block_k=64, heads=N)
        err = rel_err(kernel_fn("mosaic_gpu")(q, k, v, lay), kernel_fn("triton")(q, k, v, lay))
        result["checks"]["sparse10_vs_triton_32768"] = err
        print(f"check sparse 10% 32k: rel err vs triton {err:.2e}", flush=True)
        dump()

    for s in lens:
        q, k, v = inputs(s, 3)
        flops = 4.0 * N * D * s * (s + 1) / 2  # causal pairs
        reps = 5 if s <= 131072 else 2
        calls = 10 if s <= 32768 else 1
        rows = [("cudnn", "dense", cudnn_fn(), (q, k, v))]
        for bk in (64, 128):
            lay = BlockLayout.dense_causal(s, s, block_q=128, block_k=bk)
            if bk == 64:
                rows.append(("triton", "dense bk64", kernel_fn("triton"), (q, k, v, lay)))
            rows.append(("mosaic_gpu", f"dense bk{bk}", kernel_fn("mosaic_gpu"), (q, k, v, lay)))
            if bk == 64 and args.pairs:
                rows.append(("mosaic_gpu", "dense bk64 1-entry", mosaic_fn(key_pairs=False), (q, k, v, lay)))
        sparse = random_layout(s, 0.1, 64)
        rows.append(("triton", "random 10% bk64", kernel_fn("triton"), (q, k, v, sparse)))
        rows.append(("mosaic_gpu", "random 10% bk64", kernel_fn("mosaic_gpu"), (q, k, v, sparse)))
        for keep, bk in ((0.1, 128), (0.03, 64), (0.03, 128)):  # issue 16's other sparse target rows
            lay = random_layout(s, keep, bk)
            rows.append(("mosaic_gpu", f"random {keep:.0%} bk{bk}", kernel_fn("mosaic_gpu"), (q, k, v, lay)))
        if args.pairs:
            rows.append(("mosaic_gpu", "random 10% bk64 1-entry", mosaic_fn(key_pairs=False), (q, k, v, sparse)))
        if args.overlap:
            rows += [(impl, f"{what} {name}", mosaic_fn(overlap=True, pingpong=pp), fargs)
                     for impl, what, _, fargs in list(rows) if impl == "mosaic_gpu"
                     for name, pp in (("overlap", True), ("overlap free", False))]
        if args.grids:
            for bk in (64, 128):
                for keep in (None, 0.1, 0.03):
                    lay = (BlockLayout.dense_causal(s, s, block_q=128, block_k=bk) if keep is None else
                           random_layout(s, keep, bk))
                    what = f"dense bk{bk}" if keep is None else f"random {keep:.0%} bk{bk}"
                    rows.append(("mosaic_gpu", f"{what} persistent", mosaic_fn(persistent=True), (q, k, v, lay)))
                    rows.append(("mosaic_gpu", f"{what} item grid", mosaic_fn(persistent=False), (q, k, v, lay)))
        for n_list in [int(x) for x in args.fixed_lists.split(",") if x]:
            for bk in (64, 128):
                lay = fixed_lists(jax.random.PRNGKey(6), s, n_list, bk, N)
                what = f"random {n_list} blocks bk{bk}"
                rows.append(("mosaic_gpu", f"{what} persistent", mosaic_fn(persistent=True), (q, k, v, lay)))
                rows.append(("mosaic_gpu", f"{what} item grid", mosaic_fn(persistent=False), (q, k, v, lay)))
        if args.variants:
            for heads in (1, N):  # one permutation for all heads / one per query head
                perms = jnp.stack([jax.random.permutation(jax.random.PRNGKey(10 + h), s) for h in range(heads)])
                perms = perms.astype(jnp.int32)[None]
                lay = sparse.replace(q_perm=perms, kv_perm=perms)
                for impl in ("triton", "mosaic_gpu"):
                    rows.append((impl, f"random 10% perm{heads}", kernel_fn(impl), (q, k, v, lay)))
            nq = s // 128
            cols = jax.random.randint(jax.random.PRNGKey(5), (1, N, nq, 64), 0, s, jnp.int32)
            lay = sparse.replace(kv_columns=cols, kv_column_count=jnp.full((1, N, nq), 64, jnp.int32))
            for impl in ("triton", "mosaic_gpu"):
                rows.append((impl, "random 10% +64 cols", kernel_fn(impl), (q, k, v, lay)))
        base = None
        for impl, what, fn, fargs in rows:
            try:
                t = median_time(fn, fargs, reps, calls)
            except Exception as e:  # noqa: BLE001 -- report and go on: one failing variant must not hide the others
                print(f"{s:>7} {impl:<10} {what:<16} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                result["timings"].append({"len": s, "impl": impl, "layout": what, "error": str(e)[:2000]})
                dump()
                continue
            dens = float(fargs[3].density().mean()) if what.startswith("random") else 1.0
            work = flops * dens
            base = t if impl == "cudnn" else base
            rec = {"len": s, "impl": impl, "layout": what, "ms": t * 1e3, "tflops": work / t / 1e12,
                   "cudnn_ratio": (base / t) if (base and not what.startswith("random")) else None,
                   "density": dens}
            if base and what.startswith("random"):  # issue 16's measure: TFLOP/s on computed tiles / cuDNN's
                rec["tflops_vs_cudnn"] = rec["tflops"] / (flops / base / 1e12)
            result["timings"].append(rec)
            dump()
            ratio = f"{rec['cudnn_ratio']:.2f}x cudnn" if rec["cudnn_ratio"] else ""
            if "tflops_vs_cudnn" in rec:
                ratio = f"{rec['tflops_vs_cudnn']:.2f}x cudnn's TFLOP/s"
            print(f"{s:>7} {impl:<10} {what:<16} {t * 1e3:9.2f} ms {rec['tflops']:7.1f} TFLOP/s {ratio}", flush=True)
        if args.short_rows and base:
            for seq in (1024, 2048, 4096):
                if s % seq or seq >= s:
                    continue
                cut = [x.reshape(s // seq, seq, *x.shape[2:]) for x in (q, k, v)]
                t = median_time(cudnn_fn(), cut, reps, calls)
                work = 4.0 * N * D * (s // seq) * seq * (seq + 1) / 2
                rec = {"len": s, "impl": "cudnn", "layout": f"dense, {s // seq} x {seq} tokens", "ms": t * 1e3,
                       "tflops": work / t / 1e12, "density": 1.0,
                       "tflops_vs_cudnn": work / t / (flops / base)}
                result["timings"].append(rec)
                dump()
                print(f"{s:>7} cudnn      {rec['layout']:<16} {t * 1e3:9.2f} ms {rec['tflops']:7.1f} TFLOP/s "
                      f"{rec['tflops_vs_cudnn']:.2f}x its own at full length", flush=True)
        del q, k, v
    dump()
    fig = figure(result)
    write_atomic(os.path.join(args.out, "mosaic_gpu.png"), lambda f: fig.savefig(f, format="png", dpi=120),
                 binary=True)


if __name__ == "__main__":
    main()
