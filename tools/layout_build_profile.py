"""Where a pattern's own ``attend`` spends the time outside the kernels: Grid's online estimation and layout build on a
GPU, step by step, on `bench patterns`' video-like input (28 / 4 heads, D = 128, bf16).

    PYTHONPATH=.:tools python3 tools/layout_build_profile.py --seq-len 131072 --out DIR

For Grid with searched strides and Grid(stride=256) (the input's frame size), each step alone under its own jit
(median of ``--reps`` samples of calls queued for ``--batch-s`` seconds, `mmjax.timing.time_fn`): ``last_q_scores``
(the last 64 queries against every key: vertical and slash mass; by default the query heads of one key / value head
scored together while they fit `estimate.STEP_BYTES`, and one head a step as before 2026-12-07), ``estimate`` (that
and the stride / phase choice), ``build_layout`` (estimate included) and ``layout_from_index`` (the layout from a
given stride / phase), and the two stable argsorts it makes (rows per head, keys); and the strides the heads find.
Writes ``layout_build_profile.json`` and a plot of it (``.png``) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jsonl_log import write_atomic  # noqa: E402
from pattern_parts_profile import FRAME_TOKENS, inputs, stride_counts  # noqa: E402

from mmjax.drivers.bench.patterns import frame_grid_patterns, gpu_patterns  # noqa: E402
from mmjax.sparse.estimate import last_q_scores  # noqa: E402
from mmjax.timing import device_name, time_fn  # noqa: E402

matplotlib.use("Agg")


def steps(g, q, k, stride, phase) -> dict:
    """{step: (jitted function, args)} for Grid ``g`` (``stride`` / ``phase``: its estimate on q, k)."""
    s, t = k.shape[1], q.shape[1]
    bounds = g.stride_bounds(s)
    codes = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) % FRAME_TOKENS, (1, q.shape[2], t))
    return {
        "last_q_scores": (jax.jit(lambda q, k: last_q_scores(q, k, last_q=g.last_q)), (q, k)),
        "last_q_scores_one_head_a_step": (jax.jit(lambda q, k: last_q_scores(q, k, last_q=g.last_q, step_heads=1)),
                                          (q, k)),
        "estimate": (jax.jit(g.estimate), (q, k)),
        "build_layout": (jax.jit(g.build_layout), (q, k)),
        "layout_from_index": (jax.jit(lambda st, ph: g.layout_from_index(st, ph, t, s, bounds=bounds)),
                              (stride, phase)),
        "argsort_rows_per_head": (jax.jit(lambda c: jnp.argsort(c, axis=-1, stable=True)), (codes,)),
        "argsort_keys": (jax.jit(lambda c: jnp.argsort(c, axis=-1, stable=True)), (codes[:, :1],)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch-s", type=float, default=0.1)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    q, k, _ = inputs(a.seq_len)
    pats = {"Grid": gpu_patterns()["Grid"], "Grid(frame)": frame_grid_patterns()["Grid(frame)"]}
    result = {"meta": {"device": device_name(), "jax": jax.__version__, "seq_len": a.seq_len}, "patterns": {}}
    for name, g in pats.items():
        stride, phase, _ = jax.jit(g.estimate)(q, k)
        row = {"found_strides": stride_counts(stride)}
        print(f"{device_name()} S={a.seq_len} {name}: strides found {row['found_strides']}", flush=True)
        for step, (fn, args) in steps(g, q, k, stride, phase).items():
            row[step] = time_fn(lambda fn=fn, args=args: fn(*args), reps=a.reps, min_batch_s=a.batch_s)["ms"]
            print(f"{device_name()} S={a.seq_len} {name}: {step} {row[step]:.3f} ms", flush=True)
        result["patterns"][name] = row
        jax.clear_caches()
    path = os.path.join(a.out, "layout_build_profile.json")
    write_atomic(path, lambda f: json.dump(result, f, indent=1))
    fig = figure(result)
    write_atomic(os.path.join(a.out, "layout_build_profile.png"), lambda f: fig.savefig(f, format="png", dpi=120),
                 binary=True)
    print(f"wrote {path} and its plot")
    return 0


def figure(result: dict):
    """Horizontal bars: each step's ms, one bar per pattern."""
    names = list(result["patterns"])
    step_names = [k for k in result["patterns"][names[0]] if k != "found_strides"]
    fig, ax = plt.subplots(figsize=(7.5, 0.5 + 0.45 * len(step_names) * len(names)))
    height = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.barh(np.arange(len(step_names)) + i * height, [result["patterns"][name][st] for st in step_names], height,
                label=name)
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
