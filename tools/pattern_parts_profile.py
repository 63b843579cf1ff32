"""Where each pattern's sparse attention spends its time on a GPU (issue 16: "each pattern's real layout at 128k / 1M:
TFLOP/s on computed blocks >= 0.9x cuDNN's dense TFLOP/s").

Run on a GPU: ``python tools/pattern_parts_profile.py --out DIR [--seq-len 131072] [--patterns Grid TriShape ...]``.
On `bench patterns`' video-like input (B = 1, 28 / 4 heads, D = 128, bf16, causal), for each pattern:

* ``attend`` on the built layout (the bench's "kernel ms"), by default implementation and on Triton, and its
  TFLOP/s on the tiles all its launches compute (``density`` x cuDNN's causal FLOPs) over cuDNN's in the same run,
  and XLA's plan of the call's temporaries (``attend_temp_gib_*``: gathers, partial outputs and merges, not the
  inputs);
  where a part names a ``q_block_range``, also without it (the part over all rows, merged over all rows); with
  ``--mask-ab`` also with the position mask on every entry (no `mosaic_gpu.visible_entries` skip); with
  ``--merge-in-launch`` also with ``KernelOptions(merge_in_launch=True)``, the parts in the layout's order and
  reversed (`reversed_parts`), with XLA's copies in each form's plan (``hlo_copies_*``);
* each `BlockLayout` part alone (`block_sparse_attention`, the implementation it picks, with its own gathers):
  density, work items, list lengths, time; and the Mosaic GPU kernel on the persistent grid where it takes the part
  (and on one CTA per work item where the kernel's default is the persistent grid, `auto_persistent`),
  and with each column pass where the part has single columns (``fused``: shared columns in the block pass's own
  launch, also on the persistent grid);
* a `jax.profiler` trace of ``attend`` summed by kernel (`mmjax.drivers.bench.trace_summary`): how much of the time
  is attention kernels and how much gathers, transposes and merges.

And one synthetic pair (``--split``): 128 query rows per head over every earlier key block as one query block (a
list of ``S / 64`` entries: 28 work items), against the same work as ``--split`` query blocks of one chunk each
(the rows repeated, lists cut into chunks) plus the lse merge of the chunks: what splitting a long list across
work items gains.

Timing: the median of ``--reps`` samples, each of the calls queued for up to ``--batch-s`` seconds. At 128k (10-20 ms
a call) three single calls of one function differed by up to 15% within a run (2026-11-28); ``--reps 7 --batch-s
0.15`` gave steady rows there (``tools/issue16_targets.sh patterns``). At 1M single calls (about 1 s) suffice.

``--boundary k|q|2d`` wraps each pattern in `KBoundary` / `QBoundary` / `TwoDBoundary` over a text prefix, video and
``--question`` text tokens after it (`boundary_input`). ``--pattern-attend`` also times each pattern's own ``attend``
(its online estimation included) with the input's frame size known: Grid with searched strides then runs Grid(frame)'s
layout where every head finds the frame stride (`Grid.frame_first`), timed beside ``frame_first=False``.

Writes ``pattern_parts_profile.json`` and a plot of each pattern's ratio per form (``.png``) into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jsonl_log import write_atomic  # noqa: E402

from mmjax.drivers.bench import trace_summary  # noqa: E402
from mmjax.drivers.bench.patterns import frame_grid_patterns, gpu_patterns  # noqa: E402
from mmjax.sparse.layouts import (  # noqa: E402
    KernelOptions,
    LayoutSet,
    RowSplit,
    attend,
    block_parts,
    map_parts,
    with_parts,
)
from mmjax.sparse.modality import Modality  # noqa: E402
from mmjax.sparse.patterns import AShape, Grid, KBoundary, QBoundary, TwoDBoundary  # noqa: E402
from mmjax.sparse.synthetic import video_qkv  # noqa: E402
from mmjax.timing import device_name, time_fn  # noqa: E402
from pallas_kernels import BlockLayout, block_sparse_attention  # noqa: E402
from pallas_kernels.block_sparse import mosaic_gpu  # noqa: E402
from pallas_kernels.block_sparse.layout import causal_pairs  # noqa: E402
from pallas_kernels.block_sparse.merge import merge_chunks  # noqa: E402
from pallas_kernels.block_sparse.mosaic_gpu import block_sparse_attention_mosaic_gpu  # noqa: E402
from pallas_kernels.block_sparse.mosaic_options import (  # noqa: E402
    auto_key_pairs,
    auto_persistent,
    check_supported,
    preferred,
)

HEADS, KV_HEADS, D = 28, 4, 128
FRAME_TOKENS = frame_grid_patterns()["Grid(frame)"].stride  # `video_qkv`'s 16 x 16 frames
matplotlib.use("Agg")


GROUPED_FROM = 1 << 20  # from this length the input is drawn per key / value head group (`inputs`)


def draws(s: int, keep=lambda qkv: qkv):
    """`inputs`' draws in head order, each passed through ``keep`` (a function of (q, k, v)) before the next: one
    draw of every head below `GROUPED_FROM` tokens, else one per key / value head and its query heads (the same
    recipe, another draw): drawn at once, its float32 temporaries ran out of an H100's memory at 1M tokens
    (2026-11-28; on a CPU at 128k the draw at once peaks at 9.7 GB resident)."""
    if s < GROUPED_FROM:
        return [keep(video_qkv(jax.random.PRNGKey(s), s, heads=HEADS, kv_heads=KV_HEADS, head_dim=D))]
    out = []
    for g in range(KV_HEADS):
        out.append(jax.block_until_ready(keep(video_qkv(jax.random.fold_in(jax.random.PRNGKey(s), g), s,
                                                        heads=HEADS // KV_HEADS, kv_heads=1, head_dim=D))))
        gc.collect()
    return out


def join_heads(parts: list[tuple]) -> tuple:
    """`draws`' parts as one tuple of arrays over every head: the one draw as it is (no copy), several concatenated
    over the head axis."""
    if len(parts) == 1:
        return tuple(parts[0])
    return tuple(jnp.concatenate(x, axis=2) for x in zip(*parts, strict=True))


def inputs(s: int):
    """`bench patterns`' video-like q ``[1, S, 28, 128]``, k, v ``[1, S, 4, 128]`` bf16 (`draws`, `join_heads`)."""
    parts = draws(s)
    out = jax.block_until_ready(join_heads(parts))
    del parts
    gc.collect()
    return out


def video_modality(s: int) -> Modality:
    """The input's `Modality`: ``s`` video tokens, the frame size (`FRAME_TOKENS`) known, as `mmjax.prefill` gives it
    to the patterns of a video."""
    return Modality.from_token_types(np.ones((1, s), np.int32), names=("text", "video"), frame_tokens=FRAME_TOKENS)


def stride_counts(stride) -> dict[int, int]:
    """Grid's found strides int ``[B, N]`` -> {stride: heads that found it}."""
    return {int(x): int(c) for x, c in zip(*np.unique(np.asarray(stride), return_counts=True))}


def part_stats(p: BlockLayout) -> dict:
    count = np.broadcast_to(np.asarray(p.kv_block_count), (1, HEADS, p.num_q_blocks))
    return {"block_q": p.block_q, "block_k": p.block_k, "density": float(np.mean(np.asarray(p.density()))),
            "items": int(count.size), "items_with_work": int((count > 0).sum()),
            "count_mean": float(count.mean()), "count_max": int(count.max()),
            "q_perm": None if p.q_perm is None else list(p.q_perm.shape),
            "kv_perm": None if p.kv_perm is None else list(p.kv_perm.shape),
            "columns": None if p.kv_columns is None else list(p.kv_columns.shape), "gap": p.gap, "window": p.window}


def traced(fn, log_dir: str) -> dict:
    jax.block_until_ready(fn())
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(3):
            out = fn()
        jax.block_until_ready(out)
    s = trace_summary.summarize_dir(log_dir, top=15)
    print(trace_summary.format_summary(s, top=15), flush=True)
    return s["devices"]


def split_pair(q_all, k, v, chunks: int) -> list[dict]:
    """The synthetic long-list pair of the module docstring (not causal: every key block is earlier)."""
    s = k.shape[1]
    nk = s // 64
    q = q_all[:, -128:]
    sm = D ** -0.5
    one = BlockLayout(kv_blocks=jnp.arange(nk, dtype=jnp.int32)[None, None, None],
                      kv_block_count=jnp.full((1, 1, 1), nk, jnp.int32), block_q=128, block_k=64, q_len=128, kv_len=s)
    per = nk // chunks
    many = BlockLayout(kv_blocks=jnp.arange(nk, dtype=jnp.int32).reshape(1, 1, chunks, per),
                       kv_block_count=jnp.full((1, 1, chunks), per, jnp.int32), block_q=128, block_k=64,
                       q_len=128 * chunks, kv_len=s)

    @jax.jit
    def run_one(q, k, v):
        return block_sparse_attention_mosaic_gpu(q, k, v, one, sm_scale=sm, causal=False)

    @jax.jit
    def run_many(q, k, v):
        out, lse = block_sparse_attention_mosaic_gpu(jnp.tile(q, (1, chunks, 1, 1)), k, v, many, sm_scale=sm,
                                                     causal=False)
        return merge_chunks(out.reshape(1, chunks, 128, HEADS, D), lse.reshape(1, HEADS, chunks, 128))

    a, b = run_one(q, k, v), run_many(q, k, v)
    err = float(jnp.max(jnp.abs(a[0].astype(jnp.float32) - b[0].astype(jnp.float32))))
    lse_err = float(jnp.max(jnp.abs(a[1] - b[1])))
    t1 = time_fn(lambda: run_one(q, k, v), reps=5)["ms"]
    t2 = time_fn(lambda: run_many(q, k, v), reps=5)["ms"]
    flops = 4.0 * D * HEADS * 128 * s
    rows = [{"case": "one query block, whole list", "ms": t1, "tflops": flops / t1 / 1e9},
            {"case": f"{chunks} chunks + lse merge", "ms": t2, "tflops": flops / t2 / 1e9,
             "max_abs_err_vs_one": err, "max_lse_err_vs_one": lse_err}]
    for r in rows:
        print(f"split: {r}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--patterns", nargs="+", default=["AShape", "TriShape", "SFFixed", "Grid"],
                   help="names of `gpu_patterns` or `frame_grid_patterns`")
    p.add_argument("--split", type=int, default=32, help="chunks of the synthetic long list (0: skip)")
    p.add_argument("--reps", type=int, default=3, help="samples per timing (median)")
    p.add_argument("--batch-s", type=float, default=0.02,
                   help="calls queued back to back per sample, up to this many seconds (`mmjax.timing.time_fn`)")
    p.add_argument("--no-trace", action="store_true")
    p.add_argument("--skip-triton", action="store_true", help="no attend on Triton")
    p.add_argument("--skip-parts", action="store_true", help="no per-part timings")
    p.add_argument("--boundary", choices=("none", "k", "q", "2d"), default="none",
                   help="each pattern inside a boundary wrapper (`boundary_input`) over --text text tokens, then video")
    p.add_argument("--text", type=int, default=1024, help="text tokens before the video with --boundary")
    p.add_argument("--question", type=int, default=0, help="text tokens after the video with --boundary")
    p.add_argument("--pattern-attend", action="store_true",
                   help="also time the pattern's own attend (estimation, layout and attention in one jit) with the "
                        "input's frame size known; for Grid with searched strides also with frame_first=False")
    p.add_argument("--hlo-copy-context", action="store_true",
                   help="print each attend form's HLO copies with the lines that define their operands and use them")
    p.add_argument("--merge-in-launch", action="store_true",
                   help="also time attend with KernelOptions(merge_in_launch=True): a LayoutSet's parts on the Mosaic "
                        "kernel each merging the result so far in before their store, in the layout's order and in "
                        "reverse (`reversed_parts`; traced too unless --no-trace)")
    p.add_argument("--mask-ab", action="store_true",
                   help="also time attend with the position mask on every entry (no `visible_entries` skip)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    s = args.seq_len
    q, k, v = inputs(s)
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    t_cudnn = timed(lambda: cudnn(q, k, v), args)
    flops = 4.0 * D * HEADS * causal_pairs(s, s)
    tf_cudnn = flops / t_cudnn / 1e9
    print(f"{device_name()}: S={s} cuDNN {t_cudnn:.2f} ms ({tf_cudnn:.0f} TFLOP/s)", flush=True)
    result = {"meta": {"device": device_name(), "jax": jax.__version__, "seq_len": s, "heads": HEADS,
                       "kv_heads": KV_HEADS, "head_dim": D, "reps": args.reps, "batch_s": args.batch_s},
              "cudnn_ms": t_cudnn, "cudnn_tflops": tf_cudnn, "patterns": {}}
    pats = dict(gpu_patterns(), **frame_grid_patterns())
    wrap, mod = (lambda p: p), None
    if args.boundary != "none":
        wrap, mod = boundary_input(args.boundary, args.text, s, args.question)
        result["meta"].update(boundary=args.boundary, text_tokens=args.text, question_tokens=args.question)
    for name in args.patterns:
        try:
            result["patterns"][name] = profile_pattern(name, wrap(pats[name]), q, k, v, t_cudnn, args, mod)
        except Exception as e:  # noqa: BLE001  (reported, the next pattern still runs)
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            result["patterns"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        jax.clear_caches()
    if args.split:
        result["split"] = split_pair(q, k, v, args.split)
    path = os.path.join(args.out, "pattern_parts_profile.json")
    write_atomic(path, lambda f: json.dump(result, f, indent=1))
    fig = figure(result)
    write_atomic(os.path.join(args.out, "pattern_parts_profile.png"),
                 lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    print(f"wrote {path} and its plot")
    return 0


FORMS = (("attend_ms_default", "default"), ("attend_ms_triton", "Triton"),
         ("attend_ms_merge_in_launch", "merge_in_launch"),
         ("attend_ms_merge_in_launch_reversed", "merge_in_launch, parts reversed"),
         ("pattern_attend_ms", "pattern attend (frame known)"),
         ("pattern_attend_ms_frame_first_off", "pattern attend, frame_first=False"),
         ("attend_ms_without_q_block_range", "without q_block_range"),
         ("attend_ms_masking_every_entry", "position mask on every entry"))


def figure(result: dict):
    """Bars: each pattern's TFLOP/s on its computed density over cuDNN's, per timed form, and the issue's 0.9."""
    names = [n for n, r in result["patterns"].items() if "density" in r]
    forms = [(key, label) for key, label in FORMS if any(key in result["patterns"][n] for n in names)]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(names)), 4.2))
    width, top = 0.8 / max(len(forms), 1), 1.0
    for i, (key, label) in enumerate(forms):
        vals = [result["patterns"][n]["density"] * result["cudnn_ms"] / result["patterns"][n][key]
                if key in result["patterns"][n] else 0.0 for n in names]
        ax.bar(np.arange(len(names)) + i * width, vals, width, label=label)
        top = max([top, *vals])
    ax.set_ylim(0, top * 1.35)
    ax.axhline(0.9, color="k", linestyle="--", linewidth=1, label="issue 16: 0.9")
    ax.set_xticks(np.arange(len(names)) + width * (len(forms) - 1) / 2, names)
    ax.set_ylabel("TFLOP/s on computed density / cuDNN's")
    meta = result["meta"]
    ax.set_title(f"{meta['device']}, S = {meta['seq_len']:,}, {meta['heads']} / {meta['kv_heads']} heads")
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    return fig


def timed(fn, args) -> float:
    """Median ms of ``fn()`` over ``--reps`` samples of calls queued for up to ``--batch-s`` seconds each."""
    return time_fn(fn, reps=args.reps, min_batch_s=args.batch_s)["ms"]


def boundary_input(wrap: str, text: int, s: int, question: int = 0):
    """(wrapper of a pattern, `Modality`) for ``--boundary``: ``text`` text tokens, then video frames of 256 tokens
    (`video_qkv`'s 16 x 16), then ``question`` text tokens; "k": `KBoundary`, "q": `QBoundary` with the pattern on
    the video rows and A-shape (sink 128, local 1024) on the text rows, "2d": `TwoDBoundary` with the pattern on
    video rows x video keys and that A-shape on the other pairs."""
    kinds = np.ones((1, s), np.int32)
    kinds[0, :text] = 0
    if question:
        kinds[0, s - question:] = 0
    mod = Modality.from_token_types(kinds, names=("text", "video"), frame_tokens=FRAME_TOKENS)
    other = AShape(sink=128, local=1024)
    wrapper = {"k": KBoundary, "q": lambda p: QBoundary({"video": p}, default=other),
               "2d": lambda p: TwoDBoundary({("video", "video"): p}, default=other)}[wrap]
    return wrapper, mod


def without_ranges(layout):
    """The layout with every part over all its rows (no ``q_block_range``), its structure kept (`map_parts`: a
    `RowSplit`'s parts stay one layout per row kind; until 2026-11-29 this took the first part of a `RowSplit`
    alone)."""
    return map_parts(layout, lambda part: part.replace(q_block_range=None))


def pattern_attend_rows(name, pat, q, k, v, t_cudnn, args, modality, row) -> None:
    """``--pattern-attend``: ``pat.attend`` (estimation + layout + attention, one jit) with a modality that knows the
    input's frame size (`FRAME_TOKENS`; ``modality`` itself under ``--boundary``) as ``pattern_attend_ms``; for Grid
    with searched strides also with ``frame_first=False`` (the searched layout always) as
    ``pattern_attend_ms_frame_first_off``. Ratios on the layout's density, as the other rows. Also the time of
    ``build_layout`` (``build_layout_ms``, estimation included) and for Grid of ``estimate`` alone (``estimate_ms``),
    the strides the heads find (``found_strides``: stride -> heads) and whether `Grid.attend` takes the frame's
    branch (``frame_branch``)."""
    modality = video_modality(k.shape[1]) if modality is None else modality
    est = jax.jit(lambda q, k: pat.estimate(q, k, modality=modality)) if isinstance(pat, Grid) else None
    if est is not None:  # the strides the heads find, and the estimation's own time
        found = est(q, k)[0]
        row["found_strides"] = stride_counts(found)
        row["frame_branch"] = (pat.frame_guess(k.shape[1], modality) is not None
                               and set(row["found_strides"]) == {FRAME_TOKENS})
        row["estimate_ms"] = timed(lambda: est(q, k), args)
    build = jax.jit(lambda q, k: pat.build_layout(q, k, modality=modality))
    row["build_layout_ms"] = timed(lambda: build(q, k), args)
    print(f"{name}: strides found {row.get('found_strides')}, frame branch {row.get('frame_branch')}, estimate "
          f"{row.get('estimate_ms', float('nan')):.2f} ms, build_layout (estimate included) "
          f"{row['build_layout_ms']:.2f} ms", flush=True)
    forms = [("", pat)]
    if isinstance(pat, Grid) and pat.stride == "search":
        forms.append(("_frame_first_off", dataclasses.replace(pat, frame_first=False)))
    for suffix, p in forms:
        run = jax.jit(lambda q, k, v, p=p: p.attend(q, k, v, modality=modality)).lower(q, k, v).compile()
        t = timed(lambda run=run: run(q, k, v), args)
        row[f"pattern_attend_ms{suffix}"] = t
        row[f"pattern_attend_temp_gib{suffix}"] = run.memory_analysis().temp_size_in_bytes / 2**30
        row[f"of_cudnn_tflops_pattern_attend{suffix}"] = row["density"] * t_cudnn / t
        print(f"{name}: pattern attend{suffix.replace('_', ' ')} {t:.2f} ms = {row['density'] * t_cudnn / t:.2f} of "
              f"cuDNN's TFLOP/s, temporaries {row[f'pattern_attend_temp_gib{suffix}']:.2f} GiB", flush=True)
        del run
        jax.clear_caches()


COPY_OP = re.compile(r"^\s*(?:ROOT )?(\S+) = (\S+) (copy|copy-start)\(")


def hlo_copies(text: str) -> list[list[str]]:
    """The copies in an optimized HLO module's text (what a trace shows as memcpy kernels): [[name, shape], ...]."""
    return [[m.group(1), m.group(2)] for m in map(COPY_OP.match, text.splitlines()) if m]


def hlo_copy_context(text: str, width: int = 400) -> list[str]:
    """Each copy's line in an optimized HLO module's text with the line that defines its operand and the lines
    that use it (each cut to ``width`` characters): why XLA inserted it."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = COPY_OP.match(line)
        if not m:
            continue
        operand = re.search(r"(?:copy|copy-start)\(\S+ (%?[\w.\-]+)\)", line)
        src = operand.group(1) if operand else None
        out.append("COPY " + line.strip()[:width])
        out += ["  FROM " + x.strip()[:width] for x in lines
                if src and re.match(rf"^\s*(?:ROOT )?{re.escape(src)} = ", x)]
        out += ["  USED " + x.strip()[:width] for j, x in enumerate(lines)
                if j != i and re.search(rf"[ (,]{re.escape(m.group(1))}[,)]", x)]
    return out


def reversed_parts(layout):
    """``layout`` with each `LayoutSet`'s parts in the reverse order (inside a `RowSplit`, each kind's), or
    ``layout`` itself where no set has two parts. The parts' key sets are disjoint, so attention is the same; with
    merge_in_launch the launches run in the other order, so the other part merges the result so far in (Grid's
    band, on the persistent grid at 128k, instead of its lines, one CTA per item there)."""
    if isinstance(layout, LayoutSet) and len(layout.parts) > 1:
        return with_parts(layout, layout.parts[::-1])
    if isinstance(layout, RowSplit):
        parts = tuple(reversed_parts(p) for p in layout.parts)
        if any(a is not b for a, b in zip(parts, layout.parts)):
            return dataclasses.replace(layout, parts=parts)
    return layout


def profile_pattern(name, pat, q, k, v, t_cudnn, args, modality=None) -> dict:
    """One pattern's row of the result (module docstring)."""
    layout = jax.jit(lambda q, k: pat.build_layout(q, k, modality=modality))(q, k)
    density = float(np.mean(np.asarray(layout.density())))
    row = {"pattern": repr(pat), "density": density}
    forms = {"default": KernelOptions()}
    if not args.skip_triton:
        forms["triton"] = KernelOptions(implementation="triton")
    if args.merge_in_launch:  # each Mosaic part merging the result so far in before its store
        forms["merge_in_launch"] = KernelOptions(merge_in_launch=True)
    reverse = reversed_parts(layout)
    if args.merge_in_launch and reverse is not layout:
        forms["merge_in_launch_reversed"] = KernelOptions(merge_in_launch=True)
    for key, opts in forms.items():
        lay = reverse if key == "merge_in_launch_reversed" else layout
        run = jax.jit(lambda q, k, v, lay, opts=opts: attend(q, k, v, lay, opts)).lower(q, k, v, lay).compile()
        t = timed(lambda: run(q, k, v, lay), args)
        row[f"attend_ms_{key}"] = t
        row[f"attend_temp_gib_{key}"] = run.memory_analysis().temp_size_in_bytes / 2**30  # the call's own temporaries
        hlo = run.as_text()
        row[f"hlo_copies_{key}"] = hlo_copies(hlo)
        if args.hlo_copy_context:
            row[f"hlo_copy_context_{key}"] = hlo_copy_context(hlo)
            print("\n".join(row[f"hlo_copy_context_{key}"]), flush=True)
        row[f"of_cudnn_tflops_{key}"] = density * t_cudnn / t
        print(f"{name}: density {density:.4f} attend ({key}) {t:.2f} ms = {density * t_cudnn / t:.2f} of "
              f"cuDNN's TFLOP/s, temporaries {row[f'attend_temp_gib_{key}']:.2f} GiB, HLO copies "
              f"{row[f'hlo_copies_{key}']}", flush=True)
        if key.startswith("merge_in_launch") and not args.no_trace:  # (the default form is traced at the end)
            with tempfile.TemporaryDirectory() as d:
                row[f"trace_{key}"] = traced(lambda: run(q, k, v, lay), d)
        del run
    if args.pattern_attend:
        pattern_attend_rows(name, pat, q, k, v, t_cudnn, args, modality, row)
    if args.mask_ab:  # the position mask on every entry (before `mosaic_gpu.visible_entries`)
        plain_launch = mosaic_gpu.launch
        mosaic_gpu.launch = functools.partial(plain_launch, skip_visible_masks=False)
        jax.clear_caches()
        try:
            run = jax.jit(lambda q, k, v, lay: attend(q, k, v, lay))
            t = timed(lambda: run(q, k, v, layout), args)
        finally:
            mosaic_gpu.launch = plain_launch
            jax.clear_caches()
        row["attend_ms_masking_every_entry"] = t
        print(f"{name}: position masks on every entry {t:.2f} ms = {density * t_cudnn / t:.2f} of cuDNN's "
              f"TFLOP/s", flush=True)
    if any(part.q_block_range is not None for part in block_parts(layout)):  # the same without the ranges
        plain = without_ranges(layout)
        run = jax.jit(lambda q, k, v, lay: attend(q, k, v, lay))
        t = timed(lambda: run(q, k, v, plain), args)
        row["attend_ms_without_q_block_range"] = t
        print(f"{name}: without q_block_range {t:.2f} ms = {density * t_cudnn / t:.2f} of cuDNN's TFLOP/s",
              flush=True)
    parts = []
    for i, part in enumerate([] if args.skip_parts else block_parts(layout)):
        st = part_stats(part)
        st["mosaic_preferred"] = bool(preferred(q, part, KV_HEADS))
        one = jax.jit(lambda q, k, v, lay: block_sparse_attention(q, k, v, lay)[0])
        t = timed(lambda: one(q, k, v, part), args)
        st["ms"] = t
        st["of_cudnn_tflops"] = st["density"] * t_cudnn / t
        if part.kv_columns is not None and st["mosaic_preferred"]:
            for cp in ("triton", "mosaic") + (("fused",) if mosaic_gpu.fused_columns(part) else ()):
                f = jax.jit(lambda q, k, v, lay, cp=cp: block_sparse_attention_mosaic_gpu(
                    q, k, v, lay, sm_scale=D ** -0.5, column_pass=cp)[0])
                st[f"ms_column_pass_{cp}"] = timed(lambda: f(q, k, v, part), args)
        try:
            check_supported(q, part, None, persistent=True)
            pers = jax.jit(lambda q, k, v, lay: block_sparse_attention_mosaic_gpu(
                q, k, v, lay, sm_scale=D ** -0.5, persistent=True)[0])
            st["ms_persistent"] = timed(lambda: pers(q, k, v, part), args)
            if part.kv_columns is not None and mosaic_gpu.fused_columns(part):
                pf = jax.jit(lambda q, k, v, lay: block_sparse_attention_mosaic_gpu(
                    q, k, v, lay, sm_scale=D ** -0.5, persistent=True, column_pass="fused")[0])
                st["ms_persistent_fused"] = timed(lambda: pf(q, k, v, part), args)
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            st["persistent_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if (st["mosaic_preferred"] and part.kv_columns is None and part.q_block_range is None
                and auto_persistent(q, part, auto_key_pairs(part, None))):  # "ms" is the persistent grid's
            items = jax.jit(lambda q, k, v, lay: block_sparse_attention_mosaic_gpu(
                q, k, v, lay, sm_scale=D ** -0.5, persistent=False)[0])
            st["ms_item_grid"] = timed(lambda: items(q, k, v, part), args)
        print(f"  part {i}: {st}", flush=True)
        parts.append(st)
    row["parts"] = parts
    if not args.no_trace:
        run = jax.jit(lambda q, k, v, lay: attend(q, k, v, lay))
        with tempfile.TemporaryDirectory() as d:
            row["trace"] = traced(lambda: run(q, k, v, layout), d)
    return row


if __name__ == "__main__":
    sys.exit(main())
