"""Grid's stride search on a GPU: for every candidate stride the top phases of the vertical scores (their masses and
phases) and the slash scores' mass at the stride's multiples, for 28 heads' scores over S keys and
`grid.DEFAULT_STRIDES`. Forms: the per-stride XLA loop `Grid.estimate` ran before 58ac317; the Triton kernel's vertical
masses (`pallas_kernels.phase_mass`) with one batched top_k and the slash side still per stride (what it runs since,
on a GPU); and one ``phase_masses`` call over vertical and slash stacked on the batch axis (a stride's multiples are
the slash's phase 0 less offset 0), through the reference and through the kernel with 4 and 8 warps.

    PYTHONPATH=.:tools python3 tools/phase_mass_bench.py --lens 131072 1048576 --out DIR

Each row is timed alone under its own jit (median of ``--reps`` samples of calls queued for ``--batch-s`` seconds,
`mmjax.timing.time_fn`), with its largest differences from the per-stride loop's top masses and multiple masses, each
relative to the largest, and whether its top phases equal the loop's. Prints a table, writes
``phase_mass_bench.json`` and a plot of it.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run_bench  # noqa: E402

from mmjax.sparse.patterns.grid import DEFAULT_STRIDES, multiple_mass  # noqa: E402
from pallas_kernels.phase_mass import phase_masses  # noqa: E402
from pallas_kernels.phase_mass.reference import phase_mass  # noqa: E402
from pallas_kernels.phase_mass.triton import phase_masses_triton  # noqa: E402

HEADS, PHASES = 28, 2


def _loop_slash(slash, strides):
    return jnp.stack([multiple_mass(slash, st) for st in strides], -1)


def _stacked(vertical, slash, strides, masses):
    """One ``masses`` call over vertical and slash stacked on the batch axis -> (top masses, top phases, multiples)."""
    both = masses(jnp.concatenate([vertical, slash], 0), strides)  # [2B, N, C, W]
    b = vertical.shape[0]
    top, ph = jax.lax.top_k(both[:b], PHASES)
    return top, ph, both[b:, ..., 0] - slash[..., :1]


def variants(strides: tuple[int, ...]) -> dict:
    """{name: fn(vertical, slash) -> (top masses [B, N, C, PHASES], top phases, multiple masses [B, N, C])}, jitted."""

    def per_stride(v, sl):
        tops = [jax.lax.top_k(phase_mass(v, st), PHASES) for st in strides]
        return jnp.stack([m for m, _ in tops], -2), jnp.stack([p for _, p in tops], -2), _loop_slash(sl, strides)

    def triton_vertical(v, sl):
        top, ph = jax.lax.top_k(phase_masses_triton(v, strides), PHASES)
        return top, ph, _loop_slash(sl, strides)

    ref = functools.partial(phase_masses, implementation="reference")
    return {
        "per stride (XLA loop)": jax.jit(per_stride),
        "triton vertical only": jax.jit(triton_vertical),
        "reference, stacked": jax.jit(lambda v, sl: _stacked(v, sl, strides, ref)),
        "triton, stacked": jax.jit(lambda v, sl: _stacked(v, sl, strides, phase_masses_triton)),
        "triton 8 warps, stacked": jax.jit(lambda v, sl: _stacked(
            v, sl, strides, functools.partial(phase_masses_triton, num_warps=8))),
    }


def main(argv=None) -> int:
    strides = tuple(DEFAULT_STRIDES)

    def rel(got, want):
        return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))

    def check(got, want):
        return {"max_rel_diff": rel(got[0], want[0]), "same_phases": bool(jnp.all(got[1] == want[1])),
                "multiples_rel_diff": rel(got[2], want[2])}

    return run_bench(
        argv, doc=__doc__, stem="phase_mass_bench", meta={"heads": HEADS, "phases": PHASES, "strides": len(strides)},
        variants=lambda: variants(strides),
        inputs=lambda s: tuple(jax.random.uniform(key, (1, HEADS, s), jnp.float32) / s
                               for key in jax.random.split(jax.random.PRNGKey(s))),
        check=check, columns=f"{'max diff / max':>15} {'same phases':>12} {'multiples diff':>15}",
        title=lambda m: f"{m['device']}: phase masses and top {m['phases']} phases of {m['strides']} strides, "
                        f"{m['heads']} heads")


if __name__ == "__main__":
    sys.exit(main())
