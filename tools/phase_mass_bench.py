"""Grid's stride search on a GPU: the phase masses of every candidate stride and their top phases, as the per-stride
XLA loop `Grid.estimate` runs today, as one batched top_k over the reference's masses, and over the Triton
kernel's (`pallas_kernels.phase_mass`), for 28 heads' vertical scores over S keys and `grid.DEFAULT_STRIDES`.

    PYTHONPATH=.:tools python3 tools/phase_mass_bench.py --lens 131072 1048576 --out DIR

Each row is timed alone under its own jit (median of ``--reps`` samples of calls queued for ``--batch-s`` seconds,
`mmjax.timing.time_fn`), with its largest difference from the per-stride loop's top masses relative to the largest,
and whether its top phases equal the loop's. Prints a table, writes ``phase_mass_bench.json`` and a plot of it.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run_bench  # noqa: E402

from mmjax.sparse.patterns.grid import DEFAULT_STRIDES  # noqa: E402
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
    strides = tuple(DEFAULT_STRIDES)

    def check(got, want):
        return {"max_rel_diff": float(jnp.max(jnp.abs(got[0] - want[0])) / jnp.max(jnp.abs(want[0]))),
                "same_phases": bool(jnp.all(got[1] == want[1]))}

    return run_bench(
        argv, doc=__doc__, stem="phase_mass_bench", meta={"heads": HEADS, "phases": PHASES, "strides": len(strides)},
        variants=lambda: variants(strides),
        inputs=lambda s: (jax.random.uniform(jax.random.PRNGKey(s), (1, HEADS, s), jnp.float32) / s,),
        check=check, columns=f"{'max diff / max':>15} {'same phases':>12}",
        title=lambda m: f"{m['device']}: phase masses and top {m['phases']} phases of {m['strides']} strides, "
                        f"{m['heads']} heads")


if __name__ == "__main__":
    sys.exit(main())
