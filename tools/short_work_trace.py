"""Where a short block-sparse call spends its time on a GPU (issue 16's random 10% / 3% rows at 32k, where the
Mosaic GPU kernel reaches 0.60-0.86 of cuDNN's TFLOP/s): a `jax.profiler` trace of the API call summed by kernel
(`mmjax.drivers.bench.trace_summary`), next to the call's queued time and the time of its pieces alone: the
non-finite key poisoning (`pallas_kernels.nonfinite.poison_keys`) and the persistent grid's item order; and the
call with the poisoning only when some value is not finite (``poison=None``, a device-side ``lax.cond``) and,
where the persistent grid runs, with its items placed by XLA's sort (`item_order(method="sort")`, the form before
`stable_descending_order`), in two static orders instead of sorted (heads fastest; index order) and with the key /
value heads slowest (`kv_major_order`);
the call with the consumers free of the schedule barrier (``pingpong=False``); the compile time of both poison
forms; and the item orders on MInference's top-100 mask (`top100_orders`). With
``--order-traces``, a profiler trace of each item-order form alone (its device time, not its dispatch).

Run on a GPU: ``python tools/short_work_trace.py --out DIR [--len 32768]``; B = 1, 28 / 4 heads, D = 128, bf16,
the inputs and layouts of ``tools/bench_mosaic_gpu.py`` (`BlockLayout.random_causal`, seed 4). Writes
``short_work_trace.json`` and a plot of each row's forms (``short_work_trace.png``) into ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mosaic_gpu import cudnn_fn, inputs, random_layout  # noqa: E402
from bench_mosaic_gpu import mosaic_fn as mosaic  # noqa: E402
from gpu_timing import queued_median_ms  # noqa: E402
from jsonl_log import write_atomic  # noqa: E402
from minference_index import block_index_counts, pooled_block_index  # noqa: E402

from mmjax.drivers.bench import trace_summary  # noqa: E402
from mmjax.sparse.synthetic import video_qkv  # noqa: E402
from mmjax.timing import device_name  # noqa: E402
from pallas_kernels import BlockLayout, block_sparse_attention  # noqa: E402
from pallas_kernels.block_sparse import mosaic_kernel, mosaic_lists, mosaic_options  # noqa: E402
from pallas_kernels.nonfinite import poison_keys  # noqa: E402

N, KV_HEADS, D = 28, 4, 128
matplotlib.use("Agg")


def ms(fn, calls: int = 10) -> float:
    return queued_median_ms(fn, calls=calls, reps=7, warmup=1)


CALLS = 10  # calls in a trace


def compile_s(fn, *args) -> float:
    t0 = time.perf_counter()
    fn.lower(*args).compile()
    return time.perf_counter() - t0


def identity_order(count, *, block_q, ctas, batch, heads, pair, heads_first=False):
    """`mosaic_lists.item_order` without the sort: the items in index order (query blocks fastest, the last rows
    first; the sorted order's tie order)."""
    del count, block_q, pair, heads_first
    return jnp.arange(batch * heads * ctas, dtype=jnp.int32)


def static_order(count, *, block_q, ctas, batch, heads, pair, heads_first=False):
    """`mosaic_lists.item_order` without the sort: the last 128-row blocks first, the heads fastest (for causal lists
    about longest first), as item indices."""
    del count, block_q, pair, heads_first
    p = jnp.arange(batch * heads * ctas, dtype=jnp.int32)
    h, b, r = p % heads, (p // heads) % batch, p // (heads * batch)
    return (b * heads + h) * ctas + r


def kv_major_order(kv_heads: int):
    """`mosaic_lists.item_order` with the key / value heads slowest (``groups``): each key / value head's items (its
    query heads' 128-row blocks) longest first, before the next key / value head's, so the items running at once
    read one key / value head's tiles (a quarter of k / v at 28 / 4 heads: 16 MiB at 32k) where the default's
    longest-first order over all heads reads all of them."""
    def order(count, *, heads, **kw):
        return mosaic_lists.item_order(count, heads=heads, groups=heads // kv_heads, **kw)
    return order


# `mosaic_lists.item_order` as it was before 2026-11-28 (evening): the same order from XLA's sort
sort_order = functools.partial(mosaic_lists.item_order, method="sort")


def trace(fn, log_dir: str) -> dict:
    """Device time per call of each kernel over `CALLS` queued calls: {device: {"busy_ms", "span_ms", "kernels":
    [[name, ms per call, launches per call], ...]}}."""
    jax.block_until_ready(fn())
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        out = None
        for _ in range(CALLS):
            out = fn()
        jax.block_until_ready(out)
    s = trace_summary.summarize_dir(log_dir, top=12)
    per_call = {}
    for dev, d in s["devices"].items():
        per_call[dev] = {"busy_ms": d["busy_s"] * 1e3 / CALLS, "span_ms": d["span_s"] * 1e3 / CALLS,
                         "kernels": [[name, sec * 1e3 / CALLS, n / CALLS] for name, sec, n in d["top"]]}
        print(f"  {dev}: busy {per_call[dev]['busy_ms']:.3f} ms a call, span {per_call[dev]['span_ms']:.3f} ms",
              flush=True)
        for name, t, n in per_call[dev]["kernels"][:8]:
            print(f"    {t:8.3f} ms {n:5.1f} x  {name[:90]}", flush=True)
    return per_call


def with_order(order, fn):
    """``fn()`` with the kernel's `mosaic_lists.item_order` (what `mosaic_kernel.launch` calls) replaced by ``order``
    (None: as it is), caches cleared around it."""
    default_order = mosaic_kernel.item_order
    mosaic_kernel.item_order = order or default_order
    jax.clear_caches()
    try:
        return fn()
    finally:
        mosaic_kernel.item_order = default_order
        jax.clear_caches()


def top100_orders(s: int) -> dict:
    """MInference's pooled top-100 mask (64 x 64 blocks, 8 / 8 heads, `tools/top100_locality.py`'s input) on the
    persistent grid, with the items longest first (the default, placed by counting; and by XLA's sort) and in the
    two static orders: ms each."""
    q, k, v = video_qkv(jax.random.key(s), s, heads=8, kv_heads=8, head_dim=D, dtype=jnp.bfloat16)
    idx = jax.jit(pooled_block_index, static_argnums=2)(q, k, 100)
    lay = BlockLayout(kv_blocks=idx, kv_block_count=block_index_counts(idx), block_q=64, block_k=64, q_len=s,
                      kv_len=s)
    out = {"persistent": bool(mosaic_options.auto_persistent(q, lay, mosaic_options.auto_key_pairs(lay, None)))}
    for key, order in (("ms", None), ("ms_sort_order", sort_order), ("ms_static_order", static_order),
                       ("ms_identity_order", identity_order), ("ms_kv_major_order", kv_major_order(8)),
                       ("ms_again", None)):
        out[key] = with_order(order, lambda: ms(lambda f=mosaic(persistent=True): f(q, k, v, lay)))
    out["ms_no_pingpong"] = ms(lambda f=mosaic(persistent=True, pingpong=False): f(q, k, v, lay))
    print(f"top-100 mask at {s}: {out}", flush=True)
    return out


FORMS = (("ms", "default (items placed by counting)"), ("ms_poison_auto", "poison=None"),
         ("ms_sort_order", "items placed by XLA's sort"),
         ("ms_static_order", "heads fastest"), ("ms_identity_order", "index order"),
         ("ms_kv_major_order", "key / value heads slowest, each longest first"), ("ms_again", "default again"),
         ("ms_no_pingpong", "pingpong=False"))


def figure(result: dict):
    """ms per call of each row (the random layouts, then the top-100 mask) in each form timed."""
    rows = [(f"random {r['keep']:.0%}\nbk{r['block_k']}", r) for r in result["rows"]]
    if "top100" in result:
        rows.append(("top-100\n(persistent)", result["top100"]))
    forms = [(key, label) for key, label in FORMS if any(key in r for _, r in rows)]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(forms)
    for i, (key, label) in enumerate(forms):
        ax.bar(np.arange(len(rows)) + i * width, [r.get(key, 0.0) for _, r in rows], width, label=label)
    ax.set_xticks(np.arange(len(rows)) + width * (len(forms) - 1) / 2, [name for name, _ in rows])
    ax.set_ylabel("ms per call")
    ax.set_title(f"{result['device']}, S = {result['len']:,}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--len", type=int, default=32768)
    ap.add_argument("--orders-only", action="store_true",
                    help="only the item orders (no traces, no poison form, no compile times)")
    ap.add_argument("--order-traces", action="store_true",
                    help="also a profiler trace of the item order alone, placed by counting and by XLA's sort")
    args = ap.parse_args()
    s = args.len
    q, k, v = inputs(s, 3)
    cudnn, poison = cudnn_fn(), jax.jit(poison_keys)
    t_cudnn = ms(lambda: cudnn(q, k, v))
    tf_cudnn = 4.0 * N * D * s * (s + 1) / 2 / t_cudnn / 1e9
    result = {"device": device_name(), "jax": jax.__version__, "len": s, "cudnn_ms": t_cudnn,
              "cudnn_tflops": tf_cudnn, "poison_keys_ms": ms(lambda: poison(k, v)), "rows": []}
    print(f"{result['device']}: S={s} cuDNN {t_cudnn:.3f} ms; poison_keys {result['poison_keys_ms']:.3f} ms",
          flush=True)
    for keep, bk in ((0.1, 64), (0.1, 128), (0.03, 64), (0.03, 128)):
        lay = random_layout(s, keep, bk)
        density = float(jnp.mean(lay.density()))
        call = jax.jit(lambda q, k, v, lay: block_sparse_attention(q, k, v, lay, implementation="mosaic_gpu")[0])
        if not result["rows"] and not args.orders_only:  # compile time: the default (poison=True), poison=None
            result["compile_s"] = {"default": compile_s(call, q, k, v, lay),
                                   "poison_auto": compile_s(mosaic(poison=None), q, k, v, lay)}
            print(f"compile s: {result['compile_s']}", flush=True)
        t = ms(lambda: call(q, k, v, lay))
        pair = mosaic_options.auto_key_pairs(lay, None)
        orders = {m: jax.jit(lambda c, m=m: mosaic_lists.item_order(c, block_q=128, ctas=s // 128, batch=1, heads=N,
                                                                  pair=pair, method=m)) for m in ("rank", "sort")}
        row = {"keep": keep, "block_k": bk, "density": density, "ms": t,
               "of_cudnn_tflops": density * t_cudnn / t,
               "persistent": bool(mosaic_options.auto_persistent(q, lay, pair)),
               "item_order_ms": ms(lambda: orders["rank"](lay.kv_block_count)),
               "item_order_sort_ms": ms(lambda: orders["sort"](lay.kv_block_count))}
        if not args.orders_only:
            auto = mosaic(poison=None)
            row["ms_poison_auto"] = ms(lambda: auto(q, k, v, lay))
        free = mosaic(pingpong=False)  # the consumers without the schedule barrier (item ends not in lockstep)
        row["ms_no_pingpong"] = ms(lambda: free(q, k, v, lay))
        if row["persistent"]:  # the persistent grid with items in a static order instead of sorted
            for name, order in (("sort", sort_order), ("static", static_order), ("identity", identity_order),
                                ("kv_major", kv_major_order(KV_HEADS))):
                row[f"ms_{name}_order"] = with_order(order, lambda: ms(lambda f=mosaic(): f(q, k, v, lay)))
            row["ms_again"] = ms(lambda: call(q, k, v, lay))  # the default once more, after the other orders
        if args.order_traces:  # device time of the item order alone, each form
            for name, fn in orders.items():
                with tempfile.TemporaryDirectory() as d:
                    row[f"item_order_{name}_trace"] = trace(lambda fn=fn: fn(lay.kv_block_count), d)
        if not args.orders_only:
            with tempfile.TemporaryDirectory() as d:
                row["trace"] = trace(lambda: call(q, k, v, lay), d)
        nan = float("nan")
        print(f"random {keep:.0%} bk{bk}: {t:.3f} ms = {row['of_cudnn_tflops']:.2f} of cuDNN's TFLOP/s, item order "
              f"{row['item_order_ms']:.3f} ms (XLA's sort {row['item_order_sort_ms']:.3f}; the call with it "
              f"{row.get('ms_sort_order', nan):.3f} ms), poison only if not finite "
              f"{row.get('ms_poison_auto', nan):.3f} ms, "
              f"static / identity order {row.get('ms_static_order', nan):.3f} / "
              f"{row.get('ms_identity_order', nan):.3f} ms, key / value heads slowest "
              f"{row.get('ms_kv_major_order', nan):.3f} ms, pingpong=False {row['ms_no_pingpong']:.3f} ms; "
              f"the default again {row.get('ms_again', nan):.3f} ms",
              flush=True)
        result["rows"].append(row)
    result["top100"] = top100_orders(s)
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "short_work_trace.json"), lambda f: json.dump(result, f, indent=1))
    fig = figure(result)
    write_atomic(os.path.join(args.out, "short_work_trace.png"), lambda f: fig.savefig(f, format="png", dpi=120),
                 binary=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
