"""Grid's stride search on a GPU: the phase masses of every candidate stride and their top phases, as the per-stride
XLA loop `Grid.estimate` ran until 2026-12-07, as one batched top_k over the reference's masses, and over the Triton
kernel's (`pallas_kernels.phase_mass`), for 28 heads' vertical scores over S keys and `grid.DEFAULT_STRIDES`.

    PYTHONPATH=.:tools python3 tools/phase_mass_bench.py --lens 131072 1048576 --out DIR

Each row is timed alone under its own jit (median of ``--reps`` samples of calls queued for ``--batch-s`` seconds,
`mmjax.timing.time_fn`), with its largest difference from the per-stride loop's top masses relative to the largest,
and whether its top phases equal the loop's. Prints a table, writes ``phase_mass_bench.json`` and a plot of it.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bar_panels import grouped_ms_bars  # noqa: E402
from jsonl_log import write_json_and_figure  # noqa: E402
from variant_timing import time_variants  # noqa: E402

from mmjax.sparse.patterns.grid import DEFAULT_STRIDES  # noqa: E402
from mmjax.timing import device_name  # noqa: E402
from pallas_kernels.phase_mass import phase_masses  # noqa: E402
from pallas_kernels.phase_mass.reference import phase_mass  # noqa: E402
from pallas_kernels.phase_mass.triton import phase_masses_triton  # noqa: E402

HEADS, PHASES = 28, 2


def variants(strides: tuple[int, ...]) -> dict:
    """{name: fn(vertical) -> (top masses, top phases) [B, N, C, PHASES]}, each jitted."""

    def per_stride(v):
        tops = [jax.lax.top_k(phase_mass(v, st), PHASES) for st in strides]
        return jnp.stack([m for m, _ in tops], -2), jnp.stack([p for _, p in tops], -2)

    return {
        "per stride (XLA loop)": jax.jit(per_stride),
        "reference, one top_k": jax.jit(lambda v: jax.lax.top_k(phase_masses(v, strides, implementation="reference"),
                                                                PHASES)),
        "triton": jax.jit(lambda v: jax.lax.top_k(phase_masses_triton(v, strides), PHASES)),
        "triton 8 warps": jax.jit(lambda v: jax.lax.top_k(phase_masses_triton(v, strides, num_warps=8), PHASES)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--lens", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch-s", type=float, default=0.1)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    strides = tuple(DEFAULT_STRIDES)
    result = {"meta": {"device": device_name(), "jax": jax.__version__, "heads": HEADS, "phases": PHASES,
                       "strides": len(strides)}, "rows": []}
    fns = variants(strides)
    print(f"{'S':>9} {'variant':<24} {'ms':>9} {'x loop':>8} {'max diff / max':>15} {'same phases':>12}", flush=True)
    for s in a.lens:
        v = jax.random.uniform(jax.random.PRNGKey(s), (1, HEADS, s), jnp.float32) / s
        want_m, want_p = jax.block_until_ready(fns["per stride (XLA loop)"](v))

        def check(got, want_m=want_m, want_p=want_p):
            return {"max_rel_diff": float(jnp.max(jnp.abs(got[0] - want_m)) / jnp.max(jnp.abs(want_m))),
                    "same_phases": bool(jnp.all(got[1] == want_p))}

        time_variants(fns, (v,), check, seq_len=s, rows=result["rows"], reps=a.reps, batch_s=a.batch_s)
        del v
        jax.clear_caches()
    path = write_json_and_figure(a.out, "phase_mass_bench", result, figure(result))
    print(f"wrote {path} and its plot")
    return 0


def figure(result: dict):
    """Grouped bars: ms of each variant, one group per sequence length (log scale)."""
    meta = result["meta"]
    return grouped_ms_bars(result["rows"], f"{meta['device']}: phase masses and top {meta['phases']} phases of "
                                           f"{meta['strides']} strides, {meta['heads']} heads")


if __name__ == "__main__":
    sys.exit(main())
