"""The Qwen2.5-VL vision tower alone: ms per call of `encode_grid` for each attention / window form.

Random bf16 weights of the 7B model's tower (32 blocks, width 1280, 16 heads of 80, MLP 3420, windows of
8 x 8 patches, full attention in blocks 7 / 15 / 23 / 31) on ``--frames`` temporal patches of ``--size`` x
``--size`` pixels (448: 1,024 patches and 256 merged tokens each). Variants (attention, windows):
``xla_gather`` (the tower before 2026-11-25: XLA attention with float32 scores, per-block window gathers, XLA's
Triton GEMM fusions), ``xla`` (window order once), ``cudnn_gather``, ``cudnn_triton_gemm`` (cuDNN attention,
window order once, Triton GEMM fusions), ``cudnn`` (the GPU default: also cuBLAS matmuls, the model's
``vision.XLA_OPTIONS``) and ``cudnn_fp8`` (the same with fp8 GEMMs, `models.fp8_linear.quantize_tower`). Columns: ms per call, patches
per second, TFLOP/s of the matmuls alone (attention FLOPs not counted, so the column is the same yardstick
for every form), speedup over the first variant, max |diff| against its output. ``--profile DIR`` traces one
more call per variant and puts its GPU time by kernel kind into the row. JSON to ``--out`` with a bar chart
beside it. On a CPU a tiny float32 tower runs the XLA variants (only that everything runs).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt

from mmjax.drivers.args import ArgumentParser, add_result_args, name_list, positive_int
from mmjax.drivers.bench import trace_summary
from mmjax.drivers.bench.report import print_table, save_figure_beside, write_result
from mmjax.timing import device_name, time_fn
from models.fp8_linear import quantize_tower
from models.qwen2_5_vl.config import VisionConfig, preset
from models.qwen2_5_vl.vision import XLA_OPTIONS, VisionTower, encode_grid

matplotlib.use("Agg")

# variant -> (attention, windows) of `encode_grid`, XLA options of its program
VARIANTS = {"xla_gather": ("xla", "gather", {}), "xla": ("xla", "auto", {}), "cudnn_gather": ("cudnn", "gather", {}),
            "cudnn_triton_gemm": ("cudnn", "auto", {}), "cudnn": ("cudnn", "auto", XLA_OPTIONS),
            "cudnn_fp8": ("cudnn", "auto", XLA_OPTIONS)}
FP8_VARIANTS = ("cudnn_fp8",)  # the tower quantized by `models.fp8_linear.quantize_tower`


def matmul_flops(c: VisionConfig, patches: int) -> float:
    """FLOPs of the tower's matmuls on ``patches`` patches: patch embedding, per block the q/k/v and output
    projections and the gated MLP, and the merger (per merged unit)."""
    inner = c.num_heads * c.head_dim
    block = 2 * (c.hidden_size * 3 * inner + inner * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    unit = c.merge_unit * c.hidden_size
    merger = 2 * (unit * unit + unit * c.out_hidden_size) / c.merge_unit
    return float(patches) * (2 * c.patch_dim * c.hidden_size + c.depth * block + merger)


def tiny_tower_config() -> VisionConfig:
    return VisionConfig(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=64,
                        fullatt_block_indexes=(1, 3))


def run(tower: VisionTower, grid: tuple[int, int, int], variants: tuple[str, ...], reps: int,
        profile: str | None) -> list[dict]:
    """One row per variant (``error`` instead of timings when it cannot run here)."""
    c = tower.config
    t, h, w = grid
    patches = t * h * w
    pixels = jax.random.normal(jax.random.key(1), (patches, c.patch_dim), tower.patch_embed[...].dtype)
    flops = matmul_flops(c, patches)
    rows, first = [], None
    for name in variants:
        attention, windows, options = VARIANTS[name]
        row = {"variant": name, "attention": attention, "windows": windows, "xla_options": options, "frames": t,
               "patches": patches, "merged_tokens": patches // c.merge_unit}
        f = jax.jit(lambda tw, px, a=attention, wf=windows: encode_grid(tw, px, grid, attention=a, windows=wf),
                    compiler_options=options or None)
        tw = quantize_tower(tower) if name in FP8_VARIANTS else tower
        try:
            t0 = time.perf_counter()
            out = jax.block_until_ready(f(tw, pixels))
            row["first_s"] = time.perf_counter() - t0
            timing = time_fn(lambda: f(tw, pixels), reps=reps)
        except Exception as e:  # noqa: BLE001 - e.g. cuDNN on a CPU: report and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
            continue
        row["ms"] = timing["ms"]
        row["patches_per_s"] = patches / (timing["ms"] / 1e3)
        row["matmul_tflops"] = flops / (timing["ms"] / 1e3) / 1e12
        if first is None:
            first = (row["ms"], out)
        row["speedup"] = first[0] / row["ms"]
        row["max_diff"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - first[1].astype(jnp.float32))))
        if profile:
            log_dir = os.path.join(profile, f"vision_{name}_{t}x{h}x{w}")
            with jax.profiler.trace(log_dir, create_perfetto_trace=True):
                jax.block_until_ready(f(tw, pixels))
            summary = trace_summary.summarize_dir(log_dir)
            row["profile"] = summary["devices"]
            print(trace_summary.format_summary(summary), file=sys.stderr, flush=True)
        rows.append(row)
        print({k: v for k, v in row.items() if k != "profile"}, file=sys.stderr, flush=True)
    return rows


def figure(rows: list[dict], title: str) -> matplotlib.figure.Figure:
    """ms per call of each variant that ran, with its matmul TFLOP/s on the bar."""
    ok = [r for r in rows if "ms" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar([r["variant"] for r in ok], [r["ms"] for r in ok], color=[f"C{i}" for i in range(len(ok))])
    for bar, r in zip(bars, ok):
        ax.annotate(f"{r['matmul_tflops']:.0f} TFLOP/s", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per call")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="mmjax bench vision", description=__doc__.split("\n\n")[0])
    add_result_args(p, "vision")
    p.add_argument("--frames", type=positive_int, default=64, help="temporal patches (2 video frames each)")
    p.add_argument("--size", type=positive_int, default=448,
                   help="frame side in pixels, a multiple of 28 (patch 14 x merge 2)")
    p.add_argument("--variants", type=name_list(VARIANTS), default=tuple(VARIANTS),
                   help="comma-separated: " + ", ".join(VARIANTS))
    p.add_argument("--reps", type=positive_int, default=5, help="timed samples per variant (median)")
    p.add_argument("--profile", metavar="DIR", help="trace one more call per variant into DIR")
    args = p.parse_args(argv)
    if args.size % 28:
        p.error(f"--size: expected a multiple of 28 pixels; received {args.size}")
    on_gpu = jax.default_backend() == "gpu"
    c = preset("7b").vision if on_gpu else tiny_tower_config()
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    side = args.size // c.patch_size if on_gpu else 8
    grid = (args.frames if on_gpu else 2, side, side)
    variants = args.variants if on_gpu else tuple(v for v in args.variants if VARIANTS[v][0] == "xla") or ("xla",)
    tower = VisionTower(c, dtype=dtype, key=jax.random.key(0))
    shape = "qwen2.5-vl-7b vision tower" if on_gpu else "tiny vision tower"
    print(f"{shape}, grid {grid}, {jnp.dtype(dtype).name}, {device_name()}", file=sys.stderr, flush=True)
    rows = run(tower, grid, variants, args.reps, args.profile)
    cols = [("variant", "variant", "s"), ("patches", "patches", "d"), ("first_s", "first s", ".2f"),
            ("ms", "ms", ".2f"), ("patches_per_s", "patches/s", ".0f"), ("matmul_tflops", "matmul TFLOP/s", ".0f"),
            ("speedup", "speedup", ".2f"), ("max_diff", "max |diff|", ".3g")]
    table = print_table(rows, cols)
    for r in rows:
        if r.get("error"):
            print(f"{r['variant']}: {r['error']}")
    if args.out:
        path = write_result(args.out, args.name, {"model": shape, "grid": grid, "config": dataclasses.asdict(c),
                                                  "rows": rows, "table": table})
        png = save_figure_beside(path, figure(rows, f"{shape} {grid} on {device_name()}"))
        print("wrote", path, "and", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
