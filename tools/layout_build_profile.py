"""Where a pattern's own ``attend`` spends the time outside the kernels: Grid's online estimation and layout build on a
GPU, step by step, on `bench patterns`' video-like input (28 / 4 heads, D = 128, bf16).

    PYTHONPATH=.:tools python3 tools/layout_build_profile.py --seq-len 131072 --out DIR

For Grid with searched strides and Grid(stride=256) (the input's frame size), each step alone under its own jit
(median of ``--reps`` samples of calls queued for ``--batch-s`` seconds, `mmjax.timing.time_fn`): ``last_q_scores``
(the last 64 queries against every key: vertical and slash mass; the default, the fused Triton kernel on a GPU),
``last_q_scores_reference`` (XLA, one query head a step; ``_heads_per_step``: the heads of one key / value head
together while they fit `reference.STEP_BYTES`; ``_rows_named``: the same rows named, which goes through the
reference's gather for chosen rows), ``estimate`` (the scores and the stride / phase choice, default implementation),
``build_layout`` (estimate included) and ``layout_from_index`` (the layout from a given stride / phase), and the two
stable argsorts it made before `phase_order` (rows per head, keys) and `phase_order`'s orders per head (rows, keys);
and the strides the heads find.
``--trace``: also a `jax.profiler` trace of three calls of each of ``last_q_scores`` (kernel and reference) and
``layout_from_index``, summed by GPU kernel (`mmjax.drivers.bench.trace_summary`): each one's kernels by device time
per call, the 25 longest kept in the JSON (``trace``), ten printed. Writes ``layout_build_profile.json`` and a plot of
it (``.png``) into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jsonl_log import write_json_and_figure  # noqa: E402
from pattern_parts_profile import FRAME_TOKENS, inputs, stride_counts  # noqa: E402

from mmjax.drivers.bench import trace_summary  # noqa: E402
from mmjax.drivers.bench.patterns import frame_grid_patterns, gpu_patterns  # noqa: E402
from mmjax.sparse.patterns.grid import phase_order  # noqa: E402
from mmjax.timing import device_name, time_fn  # noqa: E402
from pallas_kernels.last_q_scores import last_q_scores  # noqa: E402

matplotlib.use("Agg")


def steps(g, q, k, stride, phase) -> dict:
    """{step: (jitted function, args)} for Grid ``g`` (``stride`` / ``phase``: its estimate on q, k)."""
    s, t = k.shape[1], q.shape[1]
    bounds = g.stride_bounds(s)
    codes = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) % FRAME_TOKENS, (1, q.shape[2], t))
    rows = jnp.broadcast_to(jnp.arange(t - g.last_q, t, dtype=jnp.int32), (q.shape[0], g.last_q))
    return {
        "last_q_scores": (jax.jit(lambda q, k: last_q_scores(q, k, last_q=g.last_q)), (q, k)),
        "last_q_scores_reference": (
            jax.jit(lambda q, k: last_q_scores(q, k, last_q=g.last_q, implementation="reference")), (q, k)),
        "last_q_scores_reference_heads_per_step": (jax.jit(lambda q, k: last_q_scores(
            q, k, last_q=g.last_q, step_heads=None, implementation="reference")), (q, k)),
        # the same rows named: the reference, its slash sums through a gather (its form for chosen rows)
        "last_q_scores_rows_named": (jax.jit(lambda q, k: last_q_scores(q, k, last_q=g.last_q, rows=rows)), (q, k)),
        "estimate": (jax.jit(g.estimate), (q, k)),
        "build_layout": (jax.jit(g.build_layout), (q, k)),
        "layout_from_index": (jax.jit(lambda st, ph: g.layout_from_index(st, ph, t, s, bounds=bounds)),
                              (stride, phase)),
        "argsort_rows_per_head": (jax.jit(lambda c: jnp.argsort(c, axis=-1, stable=True)), (codes,)),
        "argsort_keys": (jax.jit(lambda c: jnp.argsort(c, axis=-1, stable=True)), (codes[:, :1],)),
        # the same orders without a sort, as `layout_from_index` makes them for per-head strides
        "phase_order_rows_per_head": (jax.jit(lambda st, ph: phase_order(s - t, t, st, ph, g.sink)), (stride, phase)),
        "phase_order_keys_per_head": (jax.jit(lambda st: phase_order(0, s, st, sink=g.sink)), (stride,)),
    }


TRACED = ("last_q_scores", "last_q_scores_reference", "layout_from_index")


def kernel_times(fn, calls: int = 3, top: int = 25) -> list:
    """[[kernel, ms per call, launches per call], ...] of ``fn``'s GPU kernels, longest first, from a profiler trace
    of ``calls`` calls (after one untraced call)."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            out = [fn() for _ in range(calls)]
            jax.block_until_ready(out)
        devices = trace_summary.summarize_dir(log_dir, top=top)["devices"]
    gpu = [d for proc, d in devices.items() if "GPU" in proc]
    if not gpu:
        raise RuntimeError(f"the trace holds no GPU kernels (processes: {sorted(devices)})")
    return [[name, 1e3 * s / calls, n / calls] for name, s, n in gpu[0]["top"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch-s", type=float, default=0.1)
    p.add_argument("--trace", action="store_true", help="per-kernel device time of three steps (profiler trace)")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    q, k, _ = inputs(a.seq_len)
    pats = {"Grid": gpu_patterns()["Grid"], "Grid(frame)": frame_grid_patterns()["Grid(frame)"]}
    result = {"meta": {"device": device_name(), "jax": jax.__version__, "seq_len": a.seq_len}, "patterns": {}}
    for name, g in pats.items():
        stride, phase, _ = jax.jit(g.estimate)(q, k)
        row = {"found_strides": stride_counts(stride)}
        print(f"{device_name()} S={a.seq_len} {name}: strides found {row['found_strides']}", flush=True)
        plan = steps(g, q, k, stride, phase)  # compiled once: timed, then traced
        for step, (fn, args) in plan.items():
            try:  # a step that fails to compile or run is recorded, and the others are still timed
                row[step] = time_fn(lambda fn=fn, args=args: fn(*args), reps=a.reps, min_batch_s=a.batch_s)["ms"]
            except Exception as err:  # noqa: BLE001
                row[step] = None
                row.setdefault("errors", {})[step] = repr(err)[:2000]
                print(f"{device_name()} S={a.seq_len} {name}: {step} FAILED {repr(err)[:600]}", flush=True)
                continue
            print(f"{device_name()} S={a.seq_len} {name}: {step} {row[step]:.3f} ms", flush=True)
        if a.trace:
            row["trace"] = {}
            for step in (st for st in TRACED if row[st] is not None):
                fn, args = plan[step]
                row["trace"][step] = kernel_times(lambda fn=fn, args=args: fn(*args))
                for kernel, ms, calls in row["trace"][step][:10]:
                    print(f"  {name} {step}: {ms:8.3f} ms {calls:5.1f} x  {kernel[:110]}", flush=True)
        result["patterns"][name] = row
        jax.clear_caches()
    path = write_json_and_figure(a.out, "layout_build_profile", result, figure(result))
    print(f"wrote {path} and its plot")
    return 0


def figure(result: dict):
    """Horizontal bars: each step's ms, one bar per pattern."""
    names = list(result["patterns"])
    step_names = [k for k in result["patterns"][names[0]] if k not in ("found_strides", "trace", "errors")]
    fig, ax = plt.subplots(figsize=(7.5, 0.5 + 0.45 * len(step_names) * len(names)))
    height = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.barh(np.arange(len(step_names)) + i * height,
                [result["patterns"][name][st] or 0.0 for st in step_names], height, label=name)  # failed: 0
    ax.set_yticks(np.arange(len(step_names)) + height * (len(names) - 1) / 2, step_names)
    ax.invert_yaxis()
    ax.set_xlabel("ms (median)")
    meta = result["meta"]
    ax.set_title(f"{meta['device']}, S = {meta['seq_len']:,}\nGrid's estimation and layout build", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
