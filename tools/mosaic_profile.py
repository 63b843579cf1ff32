"""Where the Mosaic GPU block-sparse kernel spends its cycles: Mosaic GPU's on-device profiler over one call.

Run on an sm90 GPU: ``python tools/mosaic_profile.py --out DIR [--len 32768] [--heads 2] [--top-k 100]``, or with
``--random KEEP [--block-k 128]`` on the random causal layouts of ``tools/bench_mosaic_gpu.py`` (its inputs, seed 4,
128-row query blocks) instead, 7 query heads of one key / value head (``--heads`` of them), the kernel's defaults
(the persistent grid where `auto_persistent` takes it).

Input: MInference's pooled top-k mask of 64 x 64 blocks (`minference_index.pooled_block_index`) on a video-like
input (`mmjax.sparse.synthetic.video_qkv`, 8 query / 8 key-value heads cut to ``--heads``, D 128, bf16, causal),
run as the kernel's 64-row mode (one list and ring per consumer) and as its 128-row mode over the union of each
row pair's lists (two 64-key entries per step). For each: the time of the plain call (queued median), the wall
time of the profiled call (compile and trace dump included), and from the trace, per warpgroup role (consumer,
producer) and per named region of the kernel (``qk`` with its ``sched`` handshake, ``softmax`` with its parts,
``wait_v``, ``pv`` with ``next_k``; the producer's ``k_free`` / ``v_free`` waits): ranges, mean and median SM
cycles, and the region's share of the role's cycles (from each warpgroup's first to its last event); "outside" is
the share of no top-level region (loop and branch overhead, the barrier arrivals between regions). Since
2026-12-08 the kernel also names ``item`` (an item's order entry and list lengths, scalar global loads), ``plan``
(each step's list entries and mask decision) and ``finish`` (the row sums, and the prior / row mask merged in),
which the profile below counted as outside: about three more ranges an item and one a step, so a trace with many
items a CTA reaches ``--ranges`` sooner (fewer ``--heads`` keep it whole).

Random 3% at 32k, 7 / 1 heads, the persistent grid (one H200, 2026-11-28, `mosaic-profile-random3-32k-*-items_*`):
of each consumer's cycles, softmax 37.7% (1,655 cycles a 128-key step: its parts 1,314), ``qk`` 26.5% (22.1% of it
waiting on the other consumer), ``pv`` 13.3%; per item ``resync`` 2.9% (759 cycles), ``write`` 2.8% (728),
``wait_q`` 1.7%, ``wait_first_k`` 1.5%, ``offset`` 0.6%; outside the named regions 9.5% (64-key blocks in pairs:
the same within 0.5 points). An item of about four steps thus spends about 2,400 cycles at its start and end. JSON
``mosaic-profile.json`` in ``--out``; the raw traces stay in a temporary directory (the rows of
``bench/results/mosaic-profile-*`` came from the calls before and after the softmax's parts were named).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mosaic_gpu import inputs as bench_inputs  # noqa: E402
from bench_mosaic_gpu import random_layout  # noqa: E402
from gpu_timing import queued_median_ms  # noqa: E402
from jsonl_log import write_atomic  # noqa: E402
from minference_index import block_index_counts, merge_row_pairs, pooled_block_index  # noqa: E402

from mmjax.sparse.synthetic import video_qkv  # noqa: E402
from pallas_kernels import BlockLayout  # noqa: E402
from pallas_kernels.block_sparse.mosaic_gpu import block_sparse_attention_mosaic_gpu  # noqa: E402

ROLES = ("consumer", "consumer", "producer")  # warpgroups 0, 1, 2 of every CTA


def summarise(trace: dict) -> dict:
    """Chrome trace of Mosaic GPU's profiler (one tid per warpgroup and CTA, ``tid - 1`` = 3 * CTA + warpgroup;
    timestamps in cycles / 1000) -> {role: {"cycles": total, "regions": {path: stats}}}."""
    per_tid = defaultdict(list)
    for e in trace["traceEvents"]:
        per_tid[e["tid"]].append(e)
    spans = defaultdict(float)
    durations = defaultdict(lambda: defaultdict(list))
    for tid, events in per_tid.items():
        role = ROLES[(tid - 1) % 3]
        spans[role] += (events[-1]["ts"] - events[0]["ts"]) * 1e3
        stack = []
        for e in events:
            if e["ph"] == "B":
                stack.append(e)
            elif stack:
                begin = stack.pop()
                path = "/".join([x["name"] for x in stack] + [begin["name"]])
                durations[role][path].append((e["ts"] - begin["ts"]) * 1e3)
    out = {}
    for role, regions in durations.items():
        stats = {}
        for path, d in sorted(regions.items()):
            d = np.asarray(d)
            stats[path] = {"ranges": int(d.size), "mean_cycles": float(d.mean()), "median_cycles": float(np.median(d)),
                           "share": float(d.sum() / spans[role])}
        outside = 1.0 - sum(st["share"] for path, st in stats.items() if "/" not in path)
        out[role] = {"cycles": spans[role], "outside": outside,
                     "warpgroups": sum(1 for t in per_tid if ROLES[(t - 1) % 3] == role), "regions": stats}
    return out


def top_k_layouts(args):
    """MInference's pooled top-k mask on the video-like input, in the kernel's 64-row and 128-row modes."""
    s = args.len
    q, k, v = video_qkv(jax.random.key(s), s, heads=8, kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
    q, k, v = (x[:, :, :args.heads] for x in (q, k, v))
    idx = jax.jit(pooled_block_index, static_argnums=2)(q, k, args.top_k)
    count = block_index_counts(idx)
    ids128, count128 = merge_row_pairs(idx, count)
    layouts = {"64-row mode, same mask": BlockLayout(kv_blocks=idx, kv_block_count=count, block_q=64, block_k=64,
                                                     q_len=s, kv_len=s),
               "128-row mode, union of row pairs": BlockLayout(kv_blocks=ids128, kv_block_count=count128, block_q=128,
                                                               block_k=64, q_len=s, kv_len=s)}
    return layouts, (q, k, v)


def random_layouts(args):
    """`tools/bench_mosaic_gpu.py`'s random causal layout (seed 4) on its inputs, cut to the first ``--heads`` query
    heads (7 per key / value head)."""
    s = args.len
    q, k, v = bench_inputs(s, 0)
    groups = q.shape[2] // k.shape[2]
    q = q[:, :, :args.heads]
    k, v = (x[:, :, :-(-args.heads // groups)] for x in (k, v))
    lay = random_layout(s, args.random, args.block_k, heads=args.heads)
    return {f"random {args.random:.0%} bk{args.block_k}": lay}, (q, k, v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--len", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=100)
    ap.add_argument("--random", type=float, default=None, metavar="KEEP",
                    help="profile a random causal layout keeping this share of the blocks (bench_mosaic_gpu's)")
    ap.add_argument("--block-k", type=int, default=128, help="with --random: key block size")
    ap.add_argument("--ranges", type=int, default=640,
                    help="profiler ranges per warpgroup and CTA (4 x 4 bytes of shared memory each, for 3 warpgroups); "
                         "a trace with more is cut short (bounds-checked), so fewer ranges are counted")
    args = ap.parse_args(argv)
    s = args.len
    if args.random is not None:
        layouts, (q, k, v) = random_layouts(args)
    else:
        layouts, (q, k, v) = top_k_layouts(args)
    result = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "jax": jax.__version__, "len": s, "heads": args.heads, "top_k": args.top_k, "random": args.random,
              "block_k": args.block_k if args.random is not None else 64, "rows": []}
    for name, lay in layouts.items():
        plain = jax.jit(lambda q, k, v, lay: block_sparse_attention_mosaic_gpu(q, k, v, lay, sm_scale=128 ** -0.5)[0])
        with tempfile.TemporaryDirectory() as tmp:
            prof = jax.jit(lambda q, k, v, lay, tmp=tmp: block_sparse_attention_mosaic_gpu(
                q, k, v, lay, sm_scale=128 ** -0.5, profile=(args.ranges, tmp))[0])
            row = {"layout": name, "ms": queued_median_ms(lambda: plain(q, k, v, lay), calls=10)}
            for f in glob.glob(os.path.join(tmp, "*")):
                os.remove(f)
            t0 = time.perf_counter()
            jax.block_until_ready(prof(q, k, v, lay))
            jax.effects_barrier()  # the trace is written by a host callback
            row["profiled_ms_with_dump"] = (time.perf_counter() - t0) * 1e3
            traces = sorted(glob.glob(os.path.join(tmp, "*-trace.json")))
            with open(traces[-1]) as f:
                row["roles"] = summarise(json.load(f))
        result["rows"].append(row)
        print(f"{name}: {row['ms']:.3f} ms", flush=True)
        for role, r in row["roles"].items():
            print(f"  {role} ({r['warpgroups']} warpgroups, {r['cycles'] / r['warpgroups']:.0f} cycles each, "
                  f"{100 * r['outside']:.1f}% outside the named regions)")
            for path, st in r["regions"].items():
                print(f"    {path:<18} {st['ranges']:>8} ranges  mean {st['mean_cycles']:8.1f}  median "
                      f"{st['median_cycles']:8.1f} cycles  {100 * st['share']:5.1f}%", flush=True)
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "mosaic-profile.json"), lambda f: json.dump(result, f, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
