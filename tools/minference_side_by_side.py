"""Our block-sparse kernels against Microsoft MInference's Triton kernels on the same index (issue 16).

Run on a GPU with torch + triton and a checkout of https://github.com/microsoft/MInference:
``python tools/minference_side_by_side.py --minference PATH --out DIR [--lens 32768,131072,524288]``.
Only MInference's two kernel launchers are loaded from PATH (``_triton_block_sparse_attention`` and
``_triton_mixed_sparse_attention``; its package ``__init__`` and CUDA extension are not imported): the
indexes they take are built here in JAX (`minference_index.py`), once per length, and given to both sides.

Inputs: a video-like input (`mmjax.sparse.synthetic.video_qkv`), B=1, 8 query and 8 key-value heads,
D=128, bf16, causal, as in the issue. Two indexes per length:

* **block**: MInference's pooled top-100 key blocks per 64-row query block. Ours runs the identical
  64 x 64 mask (Triton, and the Mosaic GPU kernel's 64-row mode) and, in the Mosaic GPU kernel's 128-row
  mode, the union of each pair of 64-row lists (more pairs; the column says how many).
* **vertical-slash**: 1000 verticals / 6096 slashes per head estimated from the last 64 queries
  (`VerticalSlash.estimate`). MInference computes 64-key windows along the slashes plus gathered
  columns; ours computes `VerticalSlash.layout_from_index` with no block cap (aligned 64-key blocks per
  128- or 64-row query block, or 64- or 32-key windows with ``windows=True``, with and without the short run
  tails as single columns, ``window_tail``, and windows from multiples of 8, ``window_align``), on Triton and
  Mosaic GPU (``mosaic_gpu+triton``: the Mosaic kernel with the single columns in a Triton pass; ``+pairs``:
  two 64-key entries per 128-key step; 32-key lists always run two entries per 64-key step; ``+overlap``: a
  step's softmax while the previous step's ``P V`` runs, ``overlap=True``; ``+free``: no schedule barrier between
  the consumers, ``pingpong=False``; ``+persistent`` / ``+items``: one CTA per multiprocessor / per work item,
  ``persistent=True`` / ``False``; the plain name: the kernel's choice, `auto_persistent`).

``--select "A;B"``: only our variants whose "impl: layout" name contains A or B (';'-separated: layout names hold
commas), e.g. ``--select "mosaic_gpu: 64 rows, 32-key windows"``; MInference's kernel runs at every length.

Columns: ms (median of ``--reps`` samples, each ``--calls`` queued calls: CUDA events for torch, one
``block_until_ready`` for JAX), computed pairs / named pairs (named: the pairs the index names: causal
pairs of the listed blocks; for Vertical-Slash `index_pairs` at 64-row granularity), TFLOP/s on the
computed pairs, and MInference's time over ours. At the first length MInference's block output is checked
against ours on the identical mask. JSON (``minference.json``) and a plot into ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import rel_err  # noqa: E402
from gpu_timing import queued_median_ms  # noqa: E402
from jsonl_log import write_atomic  # noqa: E402
from minference_index import (  # noqa: E402
    block_index_counts,
    block_index_pairs,
    merge_row_pairs,
    pooled_block_index,
    vertical_slash_index,
    vertical_slash_pairs,
)

from mmjax.sparse.patterns import VerticalSlash  # noqa: E402
from mmjax.sparse.patterns.vertical_slash import index_pairs  # noqa: E402
from mmjax.sparse.synthetic import video_qkv  # noqa: E402
from pallas_kernels import BlockLayout, block_sparse_attention  # noqa: E402
from pallas_kernels.block_sparse.layout import causal_pairs  # noqa: E402
from pallas_kernels.block_sparse.mosaic_gpu import block_sparse_attention_mosaic_gpu  # noqa: E402

HEADS, D, BLOCK = 8, 128, 64
matplotlib.use("Agg")


def load_minference(root: str):
    """MInference's two kernel modules from a checkout, without its package ``__init__`` (which patches
    transformers) or its CUDA extension (whose index conversion `minference_index` replaces)."""
    pkg = types.ModuleType("minference")
    pkg.__path__ = [os.path.join(root, "minference")]
    ops = types.ModuleType("minference.ops")
    ops.__path__ = [os.path.join(root, "minference", "ops")]
    cuda = types.ModuleType("minference.cuda")

    def no_extension(*args, **kwargs):
        raise RuntimeError("MInference's CUDA index conversion is replaced by minference_index.vertical_slash_index")

    cuda.convert_vertical_slash_indexes = no_extension
    sys.modules.update({"minference": pkg, "minference.ops": ops, "minference.cuda": cuda})
    mods = {}
    for name in ("block_sparse_flash_attention", "pit_sparse_flash_attention_v2"):
        spec = importlib.util.spec_from_file_location(f"minference.ops.{name}",
                                                      os.path.join(root, "minference", "ops", f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return (mods["block_sparse_flash_attention"]._triton_block_sparse_attention,
            mods["pit_sparse_flash_attention_v2"]._triton_mixed_sparse_attention)


def torch_ms(torch, fn, *, calls: int, reps: int) -> float:
    """Median over ``reps`` samples of the time per call of ``calls`` queued calls (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(stop) / calls)
    return sorted(samples)[len(samples) // 2]


def block_named_pairs(idx: jax.Array, count: jax.Array) -> float:
    """Causal pairs of the listed 64 x 64 blocks (the diagonal block holds 64 * 65 / 2)."""
    m = jnp.arange(idx.shape[-2])[:, None]
    listed = jnp.arange(idx.shape[-1]) < count[..., None]
    per = jnp.where(idx == m, BLOCK * (BLOCK + 1) / 2, BLOCK * BLOCK)
    return float(jnp.sum(jnp.where(listed, per, 0.0)))


def run(args, torch, mi_block, mi_vs) -> list[dict]:
    rows = []
    for i, s in enumerate(args.lens):
        q, k, v = video_qkv(jax.random.key(s), s, heads=HEADS, kv_heads=HEADS, head_dim=D, dtype=jnp.bfloat16)
        to_torch = lambda x: torch.from_dlpack(jnp.einsum("bsnd->bnsd", x))  # noqa: E731
        qt, kt, vt = to_torch(q), to_torch(k), to_torch(v)
        seqlens = torch.tensor([s], dtype=torch.int32, device="cuda")
        scale = D ** -0.5
        flops = lambda pairs, ms: 4 * D * pairs / (ms / 1e3) / 1e12  # noqa: E731
        timing = dict(calls=args.calls, reps=args.reps)

        if "block" in args.indexes:  # pooled top-k blocks
            rows.append(block_row(args, torch, q, k, v, qt, kt, vt, seqlens, mi_block, scale, timing, flops, i))
        if "vs" in args.indexes:  # vertical-slash
            rows.append(vs_row(args, torch, q, k, v, qt, kt, vt, seqlens, mi_vs, scale, timing, flops))
    return rows


def block_row(args, torch, q, k, v, qt, kt, vt, seqlens, mi_block, scale, timing, flops, i) -> dict:
    """MInference's pooled top-k block index: its kernel and ours on the same mask."""
    s = q.shape[1]
    idx = jax.jit(pooled_block_index, static_argnums=2)(q, k, args.top_k)
    count = block_index_counts(idx)
    named = block_named_pairs(idx, count)
    idx_t = torch.from_dlpack(idx)
    mi_fn = lambda: mi_block(qt, kt, vt, seqlens, idx_t, scale, BLOCK, BLOCK)  # noqa: E731
    mi_out = mi_fn()
    mi = torch_ms(torch, mi_fn, **timing)
    mi_pairs = float(jnp.sum(block_index_pairs(count)))
    row = {"tokens": s, "index": f"block top-{args.top_k}", "named_pairs": named,
           "named_density": named / (HEADS * causal_pairs(s, s)),
           "minference_ms": mi, "minference_pairs_ratio": mi_pairs / named,
           "minference_tflops": flops(mi_pairs, mi), "ours": []}
    lay64 = BlockLayout(kv_blocks=idx, kv_block_count=count, block_q=BLOCK, block_k=BLOCK, q_len=s, kv_len=s)
    ids128, count128 = merge_row_pairs(idx, count)
    lay128 = BlockLayout(kv_blocks=ids128, kv_block_count=count128, block_q=128, block_k=BLOCK, q_len=s,
                         kv_len=s)
    for impl, lay, what in (("triton", lay64, "same 64x64 mask"), ("mosaic_gpu", lay64, "same 64x64 mask"),
                            ("mosaic_gpu+pairs", lay64, "same 64x64 mask"),
                            ("mosaic_gpu+overlap", lay64, "same 64x64 mask"),
                            ("mosaic_gpu+overlap+free", lay64, "same 64x64 mask"),
                            ("mosaic_gpu+persistent", lay64, "same 64x64 mask"),
                            ("mosaic_gpu+items", lay64, "same 64x64 mask"),
                            ("mosaic_gpu+persistent", lay128, "128-row union of the 64-row lists"),
                            ("mosaic_gpu+pairs+overlap", lay64, "same 64x64 mask"),
                            ("mosaic_gpu+overlap", lay128, "128-row union of the 64-row lists"),
                            ("mosaic_gpu", lay128, "128-row union of the 64-row lists"),
                            ("mosaic_gpu+single", lay128, "128-row union of the 64-row lists")):
        if selected(args, impl, what):
            row["ours"].append(time_ours(q, k, v, lay, impl, what, named, mi, timing, flops))
    if i == 0:
        ours = block_sparse_attention(q, k, v, lay64, implementation="triton")[0]
        row["rel_err_minference_vs_ours_same_mask"] = rel_err(
            jnp.einsum("bnsd->bsnd", jnp.from_dlpack(mi_out)).astype(jnp.float32), ours.astype(jnp.float32))
    return report(row)


class VsForm(NamedTuple):
    """One Vertical-Slash layout form timed by `vs_row` (`VerticalSlash` fields) and the implementations run on it."""
    block_q: int
    block_k: int
    windows: bool
    impls: tuple[str, ...]
    window_tail: int = 0
    window_align: int = 1
    window_tail_cap: int = VerticalSlash.window_tail_cap


def vs_row(args, torch, q, k, v, qt, kt, vt, seqlens, mi_vs, scale, timing, flops) -> dict:
    """MInference's Vertical-Slash index: its kernel and our layouts of the same index."""
    s = q.shape[1]
    base = VerticalSlash(vertical_size=args.vertical, slash_size=args.slash, last_q=64)
    cols, offs, score = jax.jit(base.estimate)(q, k)
    named = float(jnp.sum(index_pairs(cols, offs, s, s, BLOCK)))
    bc, bo, cc, ci = jax.jit(vertical_slash_index, static_argnums=2)(cols, offs, s)
    mi_args = [torch.from_dlpack(x) for x in (bc, bo, cc, ci)]
    mi_fn = lambda: mi_vs(qt, kt, vt, seqlens, *mi_args, scale, BLOCK, BLOCK)  # noqa: E731
    mi_fn()
    mi = torch_ms(torch, mi_fn, **timing)
    mi_pairs = float(jnp.sum(vertical_slash_pairs(bc, cc)))
    row = {"tokens": s, "index": f"vertical {args.vertical} / slash {args.slash}", "named_pairs": named,
           "named_density": named / (HEADS * causal_pairs(s, s)),
           "minference_ms": mi, "minference_pairs_ratio": mi_pairs / named,
           "minference_tflops": flops(mi_pairs, mi), "ours": []}
    dt = VerticalSlash.window_tail  # the default: run tails as single columns
    mosaic = ("mosaic_gpu", "mosaic_gpu+triton", "mosaic_gpu+pairs+triton")  # columns by Mosaic / by Triton
    rows128 = ("triton", "mosaic_gpu", "mosaic_gpu+single")  # the Mosaic default pairs entries at 128 rows
    rows64 = ("triton", "mosaic_gpu", "mosaic_gpu+pairs")
    mosaic128 = ("mosaic_gpu+triton", "mosaic_gpu+single+triton")
    for form in (VsForm(128, BLOCK, False, rows128), VsForm(128, BLOCK, True, ("triton",), dt),
                 VsForm(128, BLOCK, True, mosaic128, dt, 8), VsForm(64, BLOCK, False, rows64),
                 VsForm(64, BLOCK, True, ("triton",)), VsForm(64, BLOCK, True, ("triton",), dt),
                 VsForm(64, BLOCK, True, ("triton",) + mosaic, dt, 8), VsForm(64, 32, True, ("triton",)),
                 VsForm(64, 32, True, ("triton",), dt), VsForm(64, 32, True, ("triton",), dt, window_tail_cap=256),
                 # 32-key entries on Mosaic: two per 64-key step (key_pairs, always on for 32-key lists)
                 VsForm(64, 32, False, ("triton", "mosaic_gpu")),
                 VsForm(64, 32, True, ("mosaic_gpu", "mosaic_gpu+overlap+triton", "mosaic_gpu+overlap+free+triton"),
                        dt, 8),
                 VsForm(128, 32, True, ("triton", "mosaic_gpu", "mosaic_gpu+overlap+triton"), dt, 8),
                 # longer run tails as columns (fewer computed pairs; more columns, so a higher cap)
                 VsForm(64, 32, True, ("mosaic_gpu",), 8, 8, 4096), VsForm(64, 32, True, ("mosaic_gpu",), 12, 8, 4096)):
        bq, bk, windows, impls, tail, align, cap = form
        pattern = VerticalSlash(vertical_size=args.vertical, slash_size=args.slash, last_q=64,
                                max_blocks=2 * (s // bk) + args.slash, windows=windows, block_q=bq, block_k=bk,
                                window_tail=tail, window_tail_cap=cap, window_align=align)
        what = f"{bq} rows, " + (f"{bk}-key windows" if windows else f"aligned {bk}-key blocks")
        what += f" from multiples of {align}" if align > 1 else ""
        what += f", tails <= {tail} as columns" if windows and tail else ""
        what += f" (at most {cap} a head)" if windows and tail and cap != VerticalSlash.window_tail_cap else ""
        impls = [impl for impl in impls if selected(args, impl, what)]
        if not impls:
            continue
        lay = layout_by_head(pattern, cols, offs, score, s)
        for impl in impls:
            row["ours"].append(time_ours(q, k, v, lay, impl, what, named, mi, timing, flops))
    return report(row)


def layout_by_head(pattern: VerticalSlash, cols, offs, score, s: int) -> BlockLayout:
    """``pattern.layout_from_index`` built one head at a time, each head's lists cut to the longest list of any head
    (without a block cap the lists are sized for the worst case: at 512k with 32-key windows the 8 heads' build
    asked for 45 GiB at once on an H100), then joined along the head axis."""
    build = jax.jit(lambda c, o, sc: pattern.layout_from_index(c, o, sc, s, s))
    parts = [build(cols[:, h:h + 1], offs[:, h:h + 1], score[:, h:h + 1]) for h in range(cols.shape[1])]
    nb = max(1, max(int(p.kv_block_count.max()) for p in parts))
    nc = max(1, max(int(p.kv_column_count.max()) for p in parts)) if parts[0].kv_columns is not None else 0
    join = lambda xs: jnp.concatenate(xs, axis=1)  # noqa: E731
    return parts[0].replace(kv_blocks=join([p.kv_blocks[..., :nb] for p in parts]),
                            kv_block_count=join([p.kv_block_count for p in parts]),
                            **({} if not nc else dict(kv_columns=join([p.kv_columns[..., :nc] for p in parts]),
                                                      kv_column_count=join([p.kv_column_count for p in parts]))))


def selected(args, impl: str, what: str) -> bool:
    """The variant matches one of ``--select`` (substrings of "impl: layout"), or there is no selection."""
    return not args.select or any(x in f"{impl}: {what}" for x in args.select)


def time_ours(q, k, v, lay, impl, what, named, mi_ms, timing, flops) -> dict:
    """``impl``: an implementation of `block_sparse_attention` (plain "mosaic_gpu": the kernel's defaults, single
    columns in a Triton pass), or the Mosaic GPU kernel called with options: the columns in a Triton pass where the
    name ends in "+triton" and else in its Mosaic pass (``column_pass``), "+pairs" / "+single" (two 64-key entries
    per 128-key step or one, ``key_pairs``; neither: `auto_key_pairs`), "+overlap" (``overlap=True``), "+free"
    (``pingpong=False``), "+persistent" / "+items" (``persistent=True`` / ``False``; neither: `auto_persistent`)."""
    if impl.startswith("mosaic_gpu+"):
        pairs = True if "+pairs" in impl else False if "+single" in impl else None
        opts = dict(column_pass="triton" if impl.endswith("+triton") else "mosaic", key_pairs=pairs,
                    overlap="+overlap" in impl, pingpong="+free" not in impl,
                    persistent=True if "+persistent" in impl else False if "+items" in impl else None)
        fn = jax.jit(lambda q, k, v, lay: block_sparse_attention_mosaic_gpu(q, k, v, lay, sm_scale=D ** -0.5,
                                                                             **opts)[0])
    else:
        fn = jax.jit(lambda q, k, v, lay: block_sparse_attention(q, k, v, lay, implementation=impl)[0])
    try:
        ms = queued_median_ms(lambda: fn(q, k, v, lay), **timing)
    except Exception as e:  # noqa: BLE001 -- one failing variant must not hide the others
        return {"impl": impl, "layout": what, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    pairs = float(jnp.sum(lay.density())) * causal_pairs(q.shape[1], k.shape[1])
    return {"impl": impl, "layout": what, "ms": ms, "pairs_ratio": pairs / named, "tflops": flops(pairs, ms),
            "speedup_vs_minference": mi_ms / ms}


def report(row: dict) -> dict:
    print(f"{row['tokens']:>7} {row['index']:<28} MInference {row['minference_ms']:9.2f} ms "
          f"(pairs/named {row['minference_pairs_ratio']:.3f}, {row['minference_tflops']:.0f} TFLOP/s)", flush=True)
    for o in row["ours"]:
        if "error" in o:
            print(f"{'':>36} {o['impl']:<10} {o['layout']:<34} FAILED {o['error'][:200]}", flush=True)
            continue
        print(f"{'':>36} {o['impl']:<10} {o['layout']:<34} {o['ms']:9.2f} ms (pairs/named {o['pairs_ratio']:.3f}, "
              f"{o['tflops']:.0f} TFLOP/s)  {o['speedup_vs_minference']:.2f}x MInference", flush=True)
    return row


def figure(rows: list[dict], title: str):
    kinds = sorted({r["index"] for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        sel = [r for r in rows if r["index"] == kind]
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in sel:
            for o in r["ours"]:
                if "ms" in o:
                    series.setdefault((o["impl"], o["layout"]), []).append((r["tokens"], o["speedup_vs_minference"]))
        for (impl, layout), points in sorted(series.items()):
            ax.plot(*zip(*points), marker="o", label=f"{impl}: {layout}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(1.2, color="gray", lw=0.8, ls="--", label="target 1.2x")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("MInference ms / ours")
        ax.set_title(kind)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minference", required=True, help="root of a MInference checkout (holds minference/ops)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--lens", type=lambda x: [int(v) for v in x.split(",")], default=[32768, 131072, 524288])
    ap.add_argument("--top-k", type=int, default=100)
    ap.add_argument("--vertical", type=int, default=1000)
    ap.add_argument("--slash", type=int, default=6096)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--indexes", type=lambda x: x.split(","), default=["block", "vs"],
                    help="which indexes to run: block (pooled top-k), vs (vertical-slash)")
    ap.add_argument("--select", type=lambda x: x.split(";"), default=[],
                    help="only our variants whose 'impl: layout' contains one of these ';'-separated substrings "
                         "(layout names hold commas)")
    args = ap.parse_args(argv)
    import torch

    mi_block, mi_vs = load_minference(args.minference)
    os.makedirs(args.out, exist_ok=True)
    device = jax.devices()[0].device_kind
    rows = run(args, torch, mi_block, mi_vs)
    result = {"device": device, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "jax": jax.__version__,
              "torch": torch.__version__, "triton": __import__("triton").__version__,
              "shape": {"B": 1, "N": HEADS, "K": HEADS, "D": D, "dtype": "bfloat16", "causal": True,
                        "input": "video_qkv"}, "rows": rows}
    write_atomic(os.path.join(args.out, "minference.json"), lambda f: json.dump(result, f, indent=1))
    fig = figure(rows, f"ours vs MInference's Triton kernels, same index ({device})")
    write_atomic(os.path.join(args.out, "minference.png"), lambda f: fig.savefig(f, format="png", dpi=120),
                 binary=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
