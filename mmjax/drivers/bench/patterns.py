"""Pattern benchmark: fidelity per input family, and each intra-modality pattern vs cuDNN.

Sections (``--sections``; default fidelity + timing on a GPU, fidelity on a CPU):

* fidelity (`fidelity.py`): per input family (needle, video-like, mixed video + text) and
  pattern, recall and density next to the oracle block mask at the same density; JSON plus
  a recall-vs-density PNG beside it; ``--plot DIR`` adds one layout picture per pattern and
  family;
* timing: per sequence length and pattern, time of online estimation, of layout building
  and of the kernel, end-to-end time (one jit), density, speedup over cuDNN measured in the
  same run, and (at ``recall_len``) the recall. Inputs: `synthetic.video_qkv` (frames of
  16 x 16 tokens, M-RoPE, smooth content);
* sweep (``--sweep``): recall vs density of a range of settings at ``recall_len``.
"""

from __future__ import annotations

import dataclasses
import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.drivers.args import ArgumentParser, add_result_args, positive_int
from mmjax.drivers.bench.fidelity import FidelityConfig, run_fidelity, select_patterns
from mmjax.drivers.bench.report import print_table, write_result
from mmjax.sparse.attention import attention_recall
from mmjax.sparse.layouts import attend
from mmjax.sparse.patterns import AShape, Grid, KernelOptions, SFFixed, SFStrided, TriShape, VerticalSlash
from mmjax.sparse.synthetic import video_qkv
from mmjax.timing import device_name, time_fn
from pallas_kernels.block_sparse.layout import causal_pairs


def gpu_patterns() -> dict[str, object]:
    return {
        "AShape": AShape(sink=128, local=4096),
        "TriShape": TriShape(sink=128, local=4096, last=128),
        "SFFixed": SFFixed(local=1024, stride=256, summary=16),
        "SFStrided": SFStrided(local=1024, stride=256),
        "VerticalSlash": VerticalSlash(vertical_size=1000, slash_size=4096, last_q=64),
        # the fastest Vertical-Slash form on the Mosaic GPU kernel (sm90), beside the default for time and recall
        "VerticalSlash(windows)": VerticalSlash(vertical_size=1000, slash_size=4096, last_q=64, block_q=64, block_k=32,
                                                windows=True, window_align=8, window_tail=12, window_tail_cap=4096),
        "Grid": Grid(last_q=64),
    }


def frame_grid_patterns(frame_hw: tuple[int, int] = (16, 16)) -> dict[str, object]:
    """Grid at the input's frame stride (`video_qkv` draws frames of ``frame_hw`` = (h, w) tokens; the bench's
    default 16 x 16), as ``stride="frame"`` gives it from a video's grid: one stride for every head, so one key order
    (``kv_perm`` ``[1, 1, S]``) where `gpu_patterns`' searched strides give one per head."""
    if (len(frame_hw) != 2 or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in frame_hw)):
        raise ValueError(f"frame_hw: expected two ints >= 1; received {frame_hw!r}")
    return {"Grid(frame)": Grid(stride=frame_hw[0] * frame_hw[1], last_q=64)}


def gpu_sweep() -> dict[str, object]:
    """Settings spanning densities, for recall-vs-density curves at ``recall_len``."""
    out = {}
    for local in (1024, 4096, 16384):
        out[f"AShape(local={local})"] = AShape(sink=128, local=local)
    for vs, ss in ((250, 1024), (500, 2048), (1000, 4096), (2000, 8192)):
        out[f"VerticalSlash({vs},{ss})"] = VerticalSlash(vertical_size=vs, slash_size=ss, last_q=64)
    for local in (128, 1024, 4096):
        out[f"Grid(local={local})"] = Grid(local=local, last_q=64)
    out["Grid(local=128,phases=4)"] = Grid(local=128, last_q=64, phases=4)
    for local in (1024, 4096):
        out[f"SFFixed(local={local})"] = SFFixed(local=local, stride=256, summary=16)
    return out


def cpu_sweep() -> dict[str, object]:
    small = dict(block_q=32, block_k=16)
    return {"AShape(local=64)": AShape(sink=32, local=64, **small),
            "AShape(local=256)": AShape(sink=32, local=256, **small),
            "Grid(local=32)": Grid(local=32, last_q=32, stride_space=(32, 64, 128), **small),
            "Grid(local=128)": Grid(local=128, last_q=32, stride_space=(32, 64, 128), **small),
            "VerticalSlash(32,32)": VerticalSlash(vertical_size=32, slash_size=32, last_q=32, **small)}


def run_sweep(cfg: PatternBenchConfig, patterns: dict, out_dir: str | None, log=print,
              result_name: str = "patterns-sweep") -> dict:
    """Density, recall and end-to-end time of each setting at ``cfg.recall_len``."""
    s = cfg.recall_len
    opts = KernelOptions(interpret=cfg.interpret, implementation="triton" if cfg.interpret else None)
    q, k, v = video_qkv(jax.random.PRNGKey(s), s, heads=cfg.heads, kv_heads=cfg.kv_heads,
                        head_dim=cfg.head_dim, frame_hw=cfg.frame_hw, dtype=jnp.dtype(cfg.dtype))
    anchor = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                  implementation=cfg.anchor))
    t_anchor = time_fn(lambda: anchor(q, k, v), reps=_reps(s))["ms"]
    rows = []
    for name, pattern in patterns.items():
        try:
            layout = jax.jit(pattern.build_layout)(q, k)
            recall = np.asarray(jax.jit(lambda q, k, v, lay: attention_recall(q, k, v, lay, options=opts))(
                q, k, v, layout))
            total = jax.jit(lambda q, k, v, p=pattern: p.attend(q, k, v, options=opts)[0])
            t = time_fn(lambda: total(q, k, v), reps=_reps(s))["ms"]
            rows.append({"S": s, "setting": name, "density": float(np.mean(np.asarray(layout.density()))),
                         "recall": float(recall.mean()), "recall_min_head": float(recall.min()),
                         "recall_max_head": float(recall.max()), "total_ms": t, "speedup": t_anchor / t})
        except Exception as e:  # reported, not fatal
            rows.append({"S": s, "setting": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        log(f"  {rows[-1]}")
    rows.sort(key=lambda r: (r["setting"].split("(")[0], r.get("density", 0.0)))
    print_table(rows, [("setting", "setting", "s"), ("density", "density", ".4f"), ("recall", "recall", ".3f"),
                       ("recall_min_head", "min head", ".3f"), ("recall_max_head", "max head", ".3f"),
                       ("total_ms", "total ms", ".2f"), ("speedup", f"x {cfg.anchor}", ".2f")])
    result = {"config": dataclasses.asdict(cfg), "anchor_ms": t_anchor, "rows": rows}
    if out_dir:
        log(f"wrote {write_result(out_dir, result_name, result)}")
    return result


def cpu_patterns() -> dict[str, object]:
    small = dict(block_q=32, block_k=16)
    return {
        "AShape": AShape(sink=32, local=128, **small),
        "TriShape": TriShape(sink=32, local=128, last=32, **small),
        "SFFixed": SFFixed(local=64, stride=64, summary=8, **small),
        "SFStrided": SFStrided(local=64, stride=64, **small),
        "VerticalSlash": VerticalSlash(vertical_size=64, slash_size=64, last_q=32, **small),
        "Grid": Grid(local=64, last_q=32, stride_space=(32, 64, 128), **small),
    }


@dataclasses.dataclass(frozen=True)
class PatternBenchConfig:
    seq_lens: tuple[int, ...] = (131072, 524288, 1048576)
    baselines_max_len: int = 131072  # SF patterns (nearly dense at block granularity) only up to here
    recall_len: int = 131072
    heads: int = 28
    kv_heads: int = 4
    head_dim: int = 128
    frame_hw: tuple[int, int] = (16, 16)
    interpret: bool = False
    anchor: str = "cudnn"
    dtype: str = "bfloat16"


GPU_CONFIG = PatternBenchConfig()
CPU_CONFIG = PatternBenchConfig(seq_lens=(512, 1024), baselines_max_len=1024, recall_len=512, heads=4,
                                kv_heads=2, head_dim=64, frame_hw=(4, 8), interpret=True, anchor="xla",
                                dtype="float32")


GPU_FIDELITY = FidelityConfig(max_len=65536, needle_len=65536)
CPU_FIDELITY = FidelityConfig(max_len=9216, needle_len=8192, implementation="reference")


def _reps(s: int) -> int:
    return 3 if s <= 131072 else 2


def run_benchmark(cfg: PatternBenchConfig, patterns: dict, out_dir: str | None, log=print,
                  result_name: str = "patterns") -> dict:
    log(f"device: {device_name()} ({jax.default_backend()}), jax {jax.__version__}")
    opts = KernelOptions(interpret=cfg.interpret,
                         implementation="triton" if cfg.interpret else None)
    rows = []
    for s in cfg.seq_lens:
        q, k, v = video_qkv(jax.random.PRNGKey(s), s, heads=cfg.heads, kv_heads=cfg.kv_heads,
                            head_dim=cfg.head_dim, frame_hw=cfg.frame_hw, dtype=jnp.dtype(cfg.dtype))
        jax.block_until_ready((q, k, v))
        flops = 4.0 * cfg.head_dim * cfg.heads * causal_pairs(s, s)
        anchor = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=cfg.anchor))
        t_anchor = time_fn(lambda: anchor(q, k, v), reps=_reps(s))["ms"]
        rows.append({"S": s, "pattern": cfg.anchor, "total_ms": t_anchor, "kernel_ms": t_anchor,
                     "density": 1.0, "speedup": 1.0, "tflops": flops / t_anchor / 1e9})
        log(f"S={s} {cfg.anchor}: {t_anchor:.2f} ms")
        for name, pattern in patterns.items():
            if name.startswith("SF") and s > cfg.baselines_max_len:
                continue
            try:
                row = _one(cfg, name, pattern, q, k, v, s, opts, t_anchor)
            except Exception as e:  # reported in the table, not fatal
                row = {"S": s, "pattern": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            log(f"S={s} {name}: " + ", ".join(f"{k_}={v_:.4g}" if isinstance(v_, float) else f"{k_}={v_}"
                                               for k_, v_ in row.items() if k_ not in ("S", "pattern")))
            gc.collect()
        del q, k, v
        gc.collect()
    log("")
    print_table(rows, [
        ("S", "S", "d"), ("pattern", "pattern", "s"), ("density", "density", ".4f"),
        ("recall", "recall", ".4f"), ("estimate_ms", "estimate ms", ".2f"), ("build_ms", "build ms", ".2f"),
        ("kernel_ms", "kernel ms", ".2f"), ("total_ms", "total ms", ".2f"),
        ("speedup", f"x {cfg.anchor}", ".2f"),
    ])
    targets = []
    if not cfg.interpret:
        by = {(r["S"], r["pattern"]): r for r in rows if "total_ms" in r}
        top = max(cfg.seq_lens)
        for name, need in (("Grid", 10.0), ("VerticalSlash", 5.0)):
            r = by.get((top, name))
            if r:
                targets.append({"S": top, "pattern": name, "target_speedup": need,
                                "speedup": r["speedup"], "met": r["speedup"] >= need})
                log(f"target {name} >= {need}x {cfg.anchor} at S={top} incl. estimation: "
                    f"{r['speedup']:.2f}x -> {'met' if r['speedup'] >= need else 'NOT met'}")
    result = {"config": dataclasses.asdict(cfg), "patterns": {k_: repr(v_) for k_, v_ in patterns.items()},
              "rows": rows, "targets": targets}
    if out_dir:
        log(f"wrote {write_result(out_dir, result_name, result)}")
    return result


def _one(cfg, name, pattern, q, k, v, s, opts, t_anchor) -> dict:
    build = jax.jit(pattern.build_layout)
    run = jax.jit(lambda q, k, v, lay: attend(q, k, v, lay, opts))
    total = jax.jit(lambda q, k, v: pattern.attend(q, k, v, options=opts)[0])
    layout = build(q, k)
    t_build = time_fn(lambda: build(q, k), reps=_reps(s))["ms"]
    t_est = 0.0
    if hasattr(pattern, "estimate"):
        est = jax.jit(pattern.estimate)
        t_est = time_fn(lambda: est(q, k), reps=_reps(s))["ms"]
    t_kernel = time_fn(lambda: run(q, k, v, layout), reps=_reps(s))["ms"]
    t_total = time_fn(lambda: total(q, k, v), reps=_reps(s))["ms"]
    row = {"S": s, "pattern": name, "density": float(np.mean(np.asarray(layout.density()))),
           "estimate_ms": t_est, "build_ms": max(t_build - t_est, 0.0), "kernel_ms": t_kernel,
           "total_ms": t_total, "speedup": t_anchor / t_total}
    if s == cfg.recall_len:
        row["recall"] = float(np.mean(np.asarray(jax.jit(
            lambda q, k, v, lay: attention_recall(q, k, v, lay, options=opts))(q, k, v, layout))))
    return row


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="mmjax bench patterns", description=__doc__.split("\n\n")[0])
    add_result_args(p, "patterns")
    p.add_argument("--cpu", action="store_true", help="small interpret-mode run even on a GPU")
    p.add_argument("--seq-lens", type=positive_int, nargs="+")
    p.add_argument("--patterns", nargs="+", help="subset of pattern names")
    p.add_argument("--sweep", action="store_true",
                   help="recall-vs-density sweep of settings at the recall length instead of the table")
    p.add_argument("--sections", nargs="+", choices=("fidelity", "timing"),
                   help="what to run (default: fidelity and timing on a GPU, fidelity on a CPU)")
    p.add_argument("--plot", metavar="DIR", help="fidelity: one layout picture per pattern and input family")
    p.add_argument("--max-len", type=positive_int, help="fidelity: video families up to this many tokens")
    p.add_argument("--min-len", type=positive_int, help="fidelity: video families from this many tokens")
    p.add_argument("--families", nargs="+", choices=("needle", "video", "mixed"),
                   help="fidelity: input kinds to run (default all)")
    p.add_argument("--fidelity-patterns", nargs="+", metavar="NAME",
                   help="fidelity: subset of its pattern names (e.g. 'Grid(frame,hvs)'; 'Grid(frame,hvs,local=N)' "
                        "for any band width N)")
    p.add_argument("--heads", type=positive_int, nargs=2, metavar=("N", "K"),
                   help="fidelity: query and key heads of the synthetic inputs (default 4 2)")
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu" and not args.cpu
    cfg = GPU_CONFIG if on_gpu else CPU_CONFIG
    pats = gpu_patterns() if on_gpu else cpu_patterns()
    if args.seq_lens:
        cfg = dataclasses.replace(cfg, seq_lens=tuple(args.seq_lens))
    if args.patterns:
        unknown = set(args.patterns) - set(pats)
        if unknown:
            p.error(f"--patterns: unknown {sorted(unknown)}; expected some of {sorted(pats)}")
        pats = {n: pats[n] for n in args.patterns}
    if not on_gpu:
        print("no GPU: small interpret-mode run (timings are not kernel speed)")
    if args.sweep:
        run_sweep(cfg, gpu_sweep() if on_gpu else cpu_sweep(), args.out, result_name=args.name + "-sweep")
        return 0
    sections = args.sections or (("fidelity", "timing") if on_gpu else ("fidelity",))
    if "fidelity" in sections:
        fcfg = GPU_FIDELITY if on_gpu else CPU_FIDELITY
        if args.max_len:
            fcfg = dataclasses.replace(fcfg, max_len=args.max_len, needle_len=min(fcfg.needle_len, args.max_len))
        if args.min_len:
            fcfg = dataclasses.replace(fcfg, min_len=args.min_len)
        if args.families:
            fcfg = dataclasses.replace(fcfg, kinds=tuple(args.families))
        if args.heads:
            if args.heads[0] % args.heads[1]:
                p.error(f"--heads: expected N a multiple of K; received {args.heads}")
            fcfg = dataclasses.replace(fcfg, heads=args.heads[0], kv_heads=args.heads[1])
        try:
            fpats = select_patterns(args.fidelity_patterns)
        except ValueError as e:
            p.error(f"--fidelity-patterns: {e}")
        run_fidelity(fcfg, fpats, args.out, plot_dir=args.plot, result_name=args.name + "-fidelity")
    if "timing" in sections:
        run_benchmark(cfg, pats, args.out, result_name=args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
