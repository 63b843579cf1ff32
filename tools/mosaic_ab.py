"""A/B of the Mosaic GPU block-sparse kernel against an earlier copy of its module, in one process on one GPU: the
same inputs and layouts as ``tools/bench_mosaic_gpu.py`` (B = 1, 28 / 4 heads, D = 128, bf16, causal,
`BlockLayout.random_causal` seed 4 with 128-row query blocks), the default options (so the persistent grid where
`auto_persistent` takes it), the two forms called alternately for ``--rounds`` rounds (each a queued median), with
cuDNN's dense time in the same run. Also the largest |difference| of the two forms' outputs.

Run on a GPU: ``python tools/mosaic_ab.py --baseline FILE --out DIR [--lens 32768]`` where FILE is an earlier
``mosaic_kernel.py`` (e.g. ``git show REV:pallas_kernels/block_sparse/mosaic_kernel.py > FILE``): both forms run
this tree's `block_sparse_attention_mosaic_gpu`, the baseline traced with its passes calling FILE's `launch`.
Writes ``ab.json`` into ``--out``. (Before the module was split, 2026-11-28, FILE was the whole ``mosaic_gpu.py``.)

First use (one H200, 2026-11-28, `bench/results/mosaic-ab-items-ahead_*`): the persistent grid loading each item's
order entry and list lengths one item ahead (a second operand of lengths in item order, so that an item no longer
starts with two dependent global loads) against main, at 32k, four rounds: baseline / new 1.013 / 1.015 / 1.022 /
1.004 for random 10% / 3% with 64- / 128-key blocks, the outputs bit for bit equal, and the new form's first sample
of each row its fastest (it ran first in each round). Within the run's noise, so the change was not kept: an item's
start does not wait on those loads (its remaining cost at 32k is the pipeline's start and end around each short
list). Second use (same H200 and day, `mosaic-ab-sync-once_*`): the two consumers keeping their half-step lag across
items (handshakes once before the first item and once after the last): 0.983 / 1.007 / 0.947 / 0.965, not kept.
After the split, the kernel against a copy of itself (same H200 and day, `mosaic-ab-split-identity_*`, two rounds):
1.016 / 1.026 / 1.000 / 1.019, outputs bit for bit equal: differences below about 3% are this harness's noise.
Third use (one H200, 2026-11-29, `mosaic-ab-mask-plan_*`): each step's list entries read before its ``S = Q K^T``
(`mask_plan`), against f73c2e5, four rounds: 1.040 / 1.023 / 1.045 / 1.022 at 32k and 1.020 / 1.004 / 1.001 / 0.969
at 128k, kept (its profile: a 128-key step's softmax 1,655 -> 1,601 cycles). Fourth (`mosaic-ab-row-max-tree_*`,
the baseline a kernel file importing an earlier ``mosaic_fa3`` copy through ``PYTHONPATH``): the row max as a tree
of column halves, 0.998 / 0.996 / 0.978 / 0.996, not kept.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mosaic_gpu import D, cudnn_fn, inputs, random_layout  # noqa: E402
from gpu_timing import queued_median_ms  # noqa: E402
from jsonl_log import write_atomic  # noqa: E402

from mmjax.timing import device_name  # noqa: E402
from pallas_kernels.block_sparse import mosaic_gpu, mosaic_options  # noqa: E402


def load_module(path: str, name: str = "mosaic_gpu_baseline"):
    """The module in the file ``path``, imported as ``name`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def kernel(launch):
    """The block-sparse Mosaic attention's output (q, k, v, layout -> out) with its passes calling ``launch``
    (swapped in while the call traces; the jitted call keeps what it traced)."""
    jitted = jax.jit(lambda q, k, v, lay: mosaic_gpu.block_sparse_attention_mosaic_gpu.__wrapped__(
        q, k, v, lay, sm_scale=D ** -0.5)[0])

    def call(q, k, v, lay):
        saved, mosaic_gpu.launch = mosaic_gpu.launch, launch
        try:
            return jitted(q, k, v, lay)
        finally:
            mosaic_gpu.launch = saved

    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lens", default="32768")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    forms = {"new": kernel(mosaic_gpu.launch), "baseline": kernel(load_module(args.baseline).launch)}
    result = {"device": device_name(), "jax": jax.__version__, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    for s in map(int, args.lens.split(",")):
        q, k, v = inputs(s, 0)
        dense = cudnn_fn()
        base = queued_median_ms(lambda: dense(q, k, v), calls=args.calls, reps=5, warmup=1)
        for keep in (0.1, 0.03):
            for bk in (64, 128):
                lay = random_layout(s, keep, bk)
                dens = float(lay.density().mean())
                outs = {name: np.asarray(fn(q, k, v, lay), np.float32) for name, fn in forms.items()}
                row = {"len": s, "layout": f"random {keep:.0%} bk{bk}", "density": dens, "cudnn_ms": base,
                       "persistent": bool(mosaic_options.auto_persistent(
                           q, lay, pair=mosaic_options.auto_key_pairs(lay, None))),
                       "max_abs_diff": float(np.abs(outs["new"] - outs["baseline"]).max()), "ms": {}}
                for _ in range(args.rounds):
                    for name, fn in forms.items():
                        row["ms"].setdefault(name, []).append(
                            queued_median_ms(lambda: fn(q, k, v, lay), calls=args.calls, reps=5, warmup=1))
                for name in forms:
                    row[f"{name}_of_cudnn_tflops"] = [dens * base / t for t in row["ms"][name]]  # on computed tiles
                row["baseline_over_new"] = float(np.median(row["ms"]["baseline"]) / np.median(row["ms"]["new"]))
                result["rows"].append(row)
                print(f"{s:>7} {row['layout']:<16} persistent={row['persistent']} diff {row['max_abs_diff']:.3g}  "
                      f"new {' '.join(f'{x:.3f}' for x in row['ms']['new'])} ms  baseline "
                      f"{' '.join(f'{x:.3f}' for x in row['ms']['baseline'])} ms  of cuDNN's TFLOP/s new "
                      f"{np.median(row['new_of_cudnn_tflops']):.2f} baseline "
                      f"{np.median(row['baseline_of_cudnn_tflops']):.2f}  baseline/new "
                      f"{row['baseline_over_new']:.3f}", flush=True)
                write_atomic(os.path.join(args.out, "ab.json"), lambda f: json.dump(result, f, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
