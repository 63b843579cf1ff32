"""Vertical-Slash with key windows vs aligned key blocks: pairs computed and kernel time, same index.

For each length: a video-like input (`mmjax.sparse.synthetic.video_qkv`, B=1, ``--heads`` query and
key-value heads, D=128, bf16), one Vertical-Slash index estimated from its last 64 queries
(``--vertical`` columns, ``--slash`` diagonals per head), and two layouts of that index: slashes as key
windows at any start (``windows=True``) and as the aligned ``block_k`` key blocks around them
(``windows=False``, the default). Columns: the pairs the index names (`index_pairs`: per query block
of 128 rows, its slash ranges and verticals), each layout's computed pairs over that (whole tiles, as
`BlockLayout.density` counts them), ms of `block_sparse_attention` (Triton) per layout, TFLOP/s on the
computed pairs, and cuDNN's dense causal ms for scale. At the first length each layout's output is checked
against the pure-JAX reference on the same layout. JSON to ``--out`` with a plot beside it.

On a CPU the same table runs at small sizes in interpret mode (timings only show that everything runs).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt

from mmjax.drivers.args import ArgumentParser, add_result_args, int_list, positive_int
from mmjax.drivers.bench.report import print_table, rel_err, save_figure_beside, write_result
from mmjax.sparse.patterns import VerticalSlash
from mmjax.sparse.patterns.vertical_slash import index_pairs
from mmjax.sparse.synthetic import video_qkv
from mmjax.timing import device_name, time_fn
from pallas_kernels import block_sparse_attention
from pallas_kernels.block_sparse.layout import causal_pairs

matplotlib.use("Agg")


def run(lengths, *, heads: int, vertical: int, slash: int, reps: int, on_gpu: bool, log=print) -> list[dict]:
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    impl = dict(implementation="triton", interpret=not on_gpu)
    rows = []
    for i, s in enumerate(lengths):
        q, k, v = video_qkv(jax.random.key(s), s, heads=heads, kv_heads=heads, head_dim=128 if on_gpu else 32,
                            dtype=dtype)
        d = q.shape[-1]
        base = VerticalSlash(vertical_size=min(vertical, s), slash_size=min(slash, s), last_q=min(64, s))
        cols, offs, score = jax.jit(base.estimate)(q, k)
        named = float(jnp.sum(index_pairs(cols, offs, s, s, base.block_q)))
        row = {"tokens": s, "heads": heads, "vertical": base.vertical_size, "slash": base.slash_size,
               "named_pairs": named, "named_density": named / (heads * causal_pairs(s, s))}
        outs = {}
        for windows in (True, False):
            tag = "windows" if windows else "blocks"
            pattern = VerticalSlash(vertical_size=base.vertical_size, slash_size=base.slash_size, last_q=base.last_q,
                                    windows=windows)
            layout = jax.jit(lambda c, o, sc, p=pattern: p.layout_from_index(c, o, sc, s, s))(cols, offs, score)
            pairs = float(jnp.sum(layout.density())) * causal_pairs(s, s)
            f = jax.jit(lambda q, k, v, lay: block_sparse_attention(q, k, v, lay, **impl)[0])
            outs[tag] = (layout, f(q, k, v, layout))
            ms = time_fn(lambda: f(q, k, v, layout), reps=reps)["ms"]
            row |= {f"{tag}_pairs_ratio": pairs / named, f"{tag}_ms": ms,
                    f"{tag}_tflops": 4 * d * pairs / (ms / 1e3) / 1e12}
        row["blocks_over_windows"] = row["blocks_ms"] / row["windows_ms"]
        if on_gpu:
            dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
            row["cudnn_ms"] = time_fn(lambda: dense(q, k, v), reps=reps)["ms"]
            row["windows_speedup_vs_cudnn"] = row["cudnn_ms"] / row["windows_ms"]
        if i == 0:
            for tag, (layout, out) in outs.items():
                ref, _ = jax.jit(lambda q, k, v, lay: block_sparse_attention(q, k, v, lay, implementation="reference"))(
                    q, k, v, layout)
                row[f"{tag}_rel_err"] = rel_err(out, ref)
        rows.append(row)
        log({k: (round(x, 4) if isinstance(x, float) else x) for k, x in row.items()})
    return rows


def figure(rows: list[dict], title: str) -> matplotlib.figure.Figure:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    x = [r["tokens"] for r in rows]
    for key, label in (("windows_ms", "VS key windows"), ("blocks_ms", "VS aligned blocks"), ("cudnn_ms", "cuDNN dense")):
        if all(key in r for r in rows):
            a.plot(x, [r[key] for r in rows], "o-", label=label)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("tokens")
    a.set_ylabel("ms")
    a.legend(fontsize=8)
    for key, label in (("windows_pairs_ratio", "windows"), ("blocks_pairs_ratio", "aligned blocks")):
        b.plot(x, [r[key] for r in rows], "o-", label=label)
    b.axhline(1.1, color="gray", ls="--", lw=0.8)
    b.set_xscale("log", base=2)
    b.set_xlabel("tokens")
    b.set_ylabel("computed / named pairs")
    b.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="mmjax bench slash_windows", description=__doc__.split("\n\n")[0])
    add_result_args(p, "slash-windows")
    on_gpu = jax.default_backend() == "gpu"
    p.add_argument("--lengths", type=int_list, default=(32768, 131072, 524288) if on_gpu else (512, 1024),
                   help="comma-separated token counts")
    p.add_argument("--heads", type=positive_int, default=8 if on_gpu else 2, help="query (= key-value) heads")
    p.add_argument("--vertical", type=positive_int, default=1000 if on_gpu else 24, help="vertical columns per head")
    p.add_argument("--slash", type=positive_int, default=6096 if on_gpu else 64, help="slash diagonals per head")
    p.add_argument("--reps", type=positive_int, default=5, help="timed samples (median)")
    args = p.parse_args(argv)
    print(f"Vertical-Slash windows vs blocks on {device_name()}", file=sys.stderr, flush=True)
    rows = run(args.lengths, heads=args.heads, vertical=args.vertical, slash=args.slash, reps=args.reps,
               on_gpu=on_gpu, log=lambda r: print(r, file=sys.stderr, flush=True))
    cols = [("tokens", "tokens", "d"), ("named_density", "named density", ".4f"),
            ("windows_pairs_ratio", "windows pairs / named", ".3f"), ("blocks_pairs_ratio", "blocks pairs / named", ".3f"),
            ("windows_ms", "windows ms", ".2f"), ("blocks_ms", "blocks ms", ".2f"),
            ("blocks_over_windows", "blocks / windows", ".2f"), ("windows_tflops", "windows TFLOP/s", ".0f"),
            ("blocks_tflops", "blocks TFLOP/s", ".0f"), ("cudnn_ms", "cuDNN ms", ".2f"),
            ("windows_rel_err", "windows rel err", ".1e"), ("blocks_rel_err", "blocks rel err", ".1e")]
    table = print_table(rows, cols)
    if args.out:
        path = write_result(args.out, args.name, {"rows": rows, "table": table, "args": vars(args)})
        png = save_figure_beside(path, figure(rows, f"Vertical-Slash ({args.vertical}, {args.slash}), "
                                                    f"{args.heads} heads, on {device_name()}"))
        print("wrote", path, "and", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
