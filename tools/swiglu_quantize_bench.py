"""The fp8 MLP's SwiGLU + per-row quantization: XLA's fusions against the one-pass Pallas Triton kernel
(`pallas_kernels.swiglu_quantize`), at the 7B decoder's and its vision tower's MLP shapes.

For y ``[M, 2F]`` (the unscaled bf16 result of the fused gate / up fp8 GEMM) it times:

* ``xla_colscale``: what `models.fp8_linear` ran before the kernel: gate and up scaled per row and per column as
  separate bf16 parts, ``silu(g) * u`` in bf16, then the row maximum and the float8 conversion;
* ``xla``: the same with per-row scales only (what the kernel computes), as XLA fuses it;
* ``floor``: ``(y[:, :F] * y[:, F:])`` converted to float8: reads y once and writes ``[M, F]`` float8, the traffic
  the fused operation cannot go below;
* ``triton rows=R warps=W [exact]``: the kernel with each tiling (``exact``: the sigmoid as an exponential and a
  division instead of ``tanh.approx``);
* ``triton default bias``: with a per-column bias (bfloat16), as the vision tower's MLP runs it.

(Rows labelled ``... cols`` in bench/results/swiglu-quantize_NVIDIA-H200_2026-11-26.jsonl measured a kernel variant,
since removed, that also took a per-column scale: float32 in the earlier rows, bfloat16 in the last one.)

Each timed sample queues ``--calls`` calls before waiting for the last (JAX dispatches asynchronously), so the
launch and synchronisation cost is spread over them; the time per call is the median sample over ``--calls``. Each row records
it, the GB/s of the ideal traffic (y read once, q and scales written once) and the largest difference of the
dequantized result from the float32 reference relative to the row maximum. One JSON line per (shape, form).

  PYTHONPATH=.:tools python3 tools/swiglu_quantize_bench.py --out bench/results/swiglu-quantize_DEVICE_DATE.jsonl

``--plot`` draws the file's rows (the latest per device, shape and form) as bars of ms per form (log scale; XLA
forms grey), one panel per shape, into a PNG beside it; ``--plot-only`` draws without measuring (no GPU needed).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from gpu_timing import queued_median_ms
from jsonl_log import append_jsonl, latest_timed_rows, write_atomic

from pallas_kernels.swiglu_quantize import swiglu_quantize, swiglu_quantize_reference

FP8 = jnp.float8_e4m3fn
SHAPES = {"decoder": (16384, 18944), "tower": (16384, 3424)}
TILINGS = {"decoder": ((1, 8), (1, 16), (2, 16), (2, 32)),
           "tower": ((1, 4), (2, 4), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8))}


def xla_colscale(y, gs, us, cs):
    """The pre-kernel form (models.fp8_linear._scaled with splits, then quantize_rows)."""
    f = y.shape[1] // 2
    g = (y[:, :f].astype(jnp.float32) * gs * cs[None, :f]).astype(y.dtype)
    u = (y[:, f:].astype(jnp.float32) * us * cs[None, f:]).astype(y.dtype)
    return _quantize(jax.nn.silu(g) * u)


def xla_rowscale(y, gs, us, cs):
    f = y.shape[1] // 2
    g = (y[:, :f].astype(jnp.float32) * gs).astype(y.dtype)
    u = (y[:, f:].astype(jnp.float32) * us).astype(y.dtype)
    return _quantize(jax.nn.silu(g) * u)


def _quantize(h):
    amax = jnp.max(jnp.abs(h), axis=-1, keepdims=True).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    return (h.astype(jnp.float32) / scale).astype(FP8), scale


def floor_form(y, gs, us, cs):
    f = y.shape[1] // 2
    return (y[:, :f] * y[:, f:]).astype(FP8), gs


def plot(jsonl: str) -> str:
    """Bars of ms per form, one panel per shape, from the JSON-lines file ``jsonl`` (the latest row per device,
    shape and form; rows with an error are left out), written atomically beside it as a PNG; returns its path."""
    import matplotlib  # here, not at the top: the GPU image that runs the measurement has no matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    latest = latest_timed_rows(jsonl, ("device", "shape", "form"))
    shapes = sorted({(d, s) for d, s, _ in latest})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 0.28 * len(latest) / max(1, len(shapes)) + 2),
                             squeeze=False)
    for ax, (device, shape) in zip(axes[0], shapes):
        rows = [r for (d, s, _), r in latest.items() if (d, s) == (device, shape)]
        rows.sort(key=lambda r: r["ms"])
        colors = ["tab:gray" if r["form"].startswith(("xla", "floor")) else "tab:blue" for r in rows]
        ax.barh([r["form"] for r in rows], [r["ms"] for r in rows], color=colors)
        ax.invert_yaxis()
        ax.set_xscale("log")  # some variants are 10x slower than the rest
        ax.set_xlabel("ms per call (log scale)")
        ax.set_title(f"{shape}: M={rows[0]['m']}, F={rows[0]['f']} ({device})", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    png = os.path.splitext(jsonl)[0] + ".png"
    write_atomic(png, lambda fh: fig.savefig(fh, format="png", dpi=110), binary=True)
    plt.close(fig)
    return png


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON-lines file to append to")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="calls queued per timed sample")
    p.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=tuple(SHAPES))
    p.add_argument("--plot", action="store_true", help="draw the --out file's rows into a PNG beside it")
    p.add_argument("--plot-only", action="store_true", help="only draw (no measurement)")
    args = p.parse_args(argv)
    if args.plot_only:
        print(plot(args.out), file=sys.stderr)
        return 0
    dev = jax.devices()[0].device_kind
    for name in args.shapes:
        m, f = SHAPES[name]
        k = jax.random.split(jax.random.key(0), 4)
        y = (jax.random.normal(k[0], (m, 2 * f), jnp.float32) * 40).astype(jnp.bfloat16)
        gs = jax.random.uniform(k[1], (m, 1), jnp.float32, 0.01, 0.05)
        us = jax.random.uniform(k[2], (m, 1), jnp.float32, 0.01, 0.05)
        cs = jax.random.uniform(k[3], (2 * f,), jnp.float32, 0.5, 1.5)
        ideal_bytes = m * 2 * f * 2 + m * f + m * 4
        refs = {}
        for cols in (False, True):
            ref_q, ref_s = jax.jit(swiglu_quantize_reference)(y, gs, us, *((cs,) if cols else ()))
            ref = ref_q.astype(jnp.float32) * ref_s
            refs[cols] = ref, jnp.max(jnp.abs(ref), axis=1, keepdims=True)
        forms = {"xla_colscale": xla_colscale, "xla": xla_rowscale, "floor": floor_form}
        for rows, warps in TILINGS[name]:
            for approx in (True, False):
                forms[f"triton rows={rows} warps={warps}{'' if approx else ' exact'}"] = (
                    lambda y, g, u, c, rows=rows, warps=warps, approx=approx: swiglu_quantize(
                        y, g, u, rows=rows, num_warps=warps, approx=approx))
        forms["triton default"] = lambda y, g, u, c: swiglu_quantize(y, g, u)
        forms["triton default bias"] = lambda y, g, u, c: swiglu_quantize(y, g, u, c)
        for form, fn in forms.items():
            try:
                one = jax.jit(fn)
                ms = queued_median_ms(lambda one=one: one(y, gs, us, cs), calls=args.calls, reps=args.reps)
                q, s = one(y, gs, us, cs)
                ref, denom = refs[form.endswith(" bias")]
                err = None if form.startswith(("floor", "xla")) else float(
                    jnp.max(jnp.abs(q.astype(jnp.float32) * s - ref) / denom))
                row = {"device": dev, "shape": name, "m": m, "f": f, "form": form, "ms": round(ms, 4),
                       "gb_per_s": round(ideal_bytes / ms / 1e6, 1), "max_rel_err": err}
            except Exception as e:  # a tiling that does not compile is a result too
                row = {"device": dev, "shape": name, "m": m, "f": f, "form": form, "error": repr(e)[:300]}
            print(row, file=sys.stderr, flush=True)
            append_jsonl(args.out, row)
    if args.plot:
        print(plot(args.out), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
