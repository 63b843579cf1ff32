"""How fast could MOMO's query-sparse attention run on Hopper? The attention of every gamma-th query against all
causal keys (QSA without its block top-k) through the Mosaic GPU block-sparse kernel, against the fused Triton
QSA kernel with no top-k and with MOMO's default top-k, same inputs, same process.

The Mosaic kernel has no QSA mode; it runs here on the gathered sampled rows with their original positions
(``launch`` with position vectors: every tile is masked by position, a cost a dedicated kernel would not pay),
over a dense key list cut at each 128-row tile's last causal key. Its output is checked against the Triton
kernel's ``out_gamma`` / ``lse_gamma``. This bounds from below what a Mosaic QSA + top-k kernel (issue 16) can
gain: MOMO spends most of its time in QSA + top-k at 1M tokens. The fused Mosaic GPU QSA + top-k kernel
(`pallas_kernels.qsa_topk.mosaic_gpu`, row "mosaic fused") is timed beside it; its picked blocks are compared
with the Triton kernel's (64-row scan tiles, so a share below 1 is expected: the golden scan order depends on
the tile).

Usage: python3 tools/qsa_mosaic_ceiling.py --out $OUT/qsa-mosaic-ceiling.jsonl [--lens 131072 1048576] [--plot]
       python3 tools/qsa_mosaic_ceiling.py --out FILE.jsonl --plot-only   (bars of ms per case, a PNG beside FILE)
Shapes: B=1, N=28, K=4, D=128, bf16, gamma 16, random normal inputs; top-k as in `Momo()` (block 64, one sink block,
local 128, k 128, estimated, golden scan).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from bar_panels import add_plot_args, plot_ms_bars
from compare import rel_err
from gpu_timing import queued_median_ms
from jsonl_log import append_jsonl

from pallas_kernels import qsa_topk
from pallas_kernels.block_sparse.mosaic_kernel import launch
from pallas_kernels.block_sparse.mosaic_options import default_stages
from pallas_kernels.qsa_topk.triton import qsa_topk_triton
from pallas_kernels.tiling import cdiv, pad_to

GAMMA, N, K, D = 16, 28, 4, 128
TILE = 128  # sampled rows per Mosaic CTA


def qsa_mosaic(q, k, v, *, block_k: int):
    """Attention of the sampled rows (every GAMMA-th query) over their causal keys with the Mosaic GPU block-sparse
    kernel: (out ``[B, Tg, N, D]``, lse ``[B, N, Tg]``)."""
    b, t, n, d = q.shape
    s = k.shape[1]
    qg = q[:, ::GAMMA]
    tg = qg.shape[1]
    tp = cdiv(tg, TILE) * TILE
    nk = cdiv(s, block_k)
    pos = np.full(tp, -1, np.int64)  # padding rows see nothing
    pos[:tg] = np.arange(tg) * GAMMA + (s - t)
    last = pos.reshape(-1, TILE).max(axis=1)  # each tile's last causal key
    count = (np.where(last >= 0, last // block_k + 1, 0)).astype(np.int32)[None, None]
    blocks = jnp.arange(nk, dtype=jnp.int32)[None, None, None]
    k_pos = jnp.arange(nk * block_k, dtype=jnp.int32)[None, None]
    out, lse = launch(pad_to(qg, 1, tp), pad_to(k, 1, nk * block_k), pad_to(v, 1, nk * block_k), blocks,
                      jnp.asarray(count), jnp.asarray(pos, jnp.int32)[None, None], k_pos, groups=n // k.shape[2],
                      num_kv_blocks=nk, kv_len=s, q_offset=s - t, block_k=block_k, causal=True, gap=0, window=0,
                      sm_scale=d ** -0.5, stages=default_stages(block_k, d))
    return out[:, :tg], lse[:, :, :tg]


def random_qkv(s: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The benchmark's inputs for ``s`` tokens: q ``[1, s, N, D]``, k / v ``[1, s, K, D]``, bf16, standard normal."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kq, (1, s, N, D), jnp.bfloat16), jax.random.normal(kk, (1, s, K, D), jnp.bfloat16),
            jax.random.normal(kv, (1, s, K, D), jnp.bfloat16))


def plot(jsonl: str) -> str:
    """Bars of ms per case, one panel per length, from the JSON-lines file ``jsonl`` (the latest row per device,
    length and case; rows with an error left out), written atomically beside it as a PNG; returns its path."""
    return plot_ms_bars(jsonl, name="case", highlight=lambda case: case.startswith("triton"),
                        title=lambda device, s: f"QSA of every {GAMMA}th query, {s} tokens\n{device}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--lens", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--calls", type=int, default=4)
    add_plot_args(p)
    args = p.parse_args()
    if args.plot_only:
        print(plot(args.out), file=sys.stderr)
        return
    device = jax.devices()[0].device_kind
    for s in args.lens:
        q, k, v = random_qkv(s)
        triton = {topk: jax.jit(lambda q, k, v, topk=topk: qsa_topk_triton(
            q, k, v, gamma=GAMMA, block_kv=64, top_k=128 if topk != "none" else 1, k_exact=8, topk=topk,
            sink_blocks=1, local=128, sm_scale=D ** -0.5, scan="golden")) for topk in ("none", "estimated")}
        mosaic = {bk: jax.jit(lambda q, k, v, bk=bk: qsa_mosaic(q, k, v, block_k=bk)) for bk in (64, 128)}
        fused = jax.jit(lambda q, k, v: qsa_topk(  # the fused Mosaic GPU QSA + top-k kernel
            q, k, v, gamma=GAMMA, block_kv=64, top_k=128, k_exact=8, topk="estimated", sink_blocks=1, local=128,
            scan="golden", rows=128, implementation="mosaic_gpu"))
        cases = [(f"triton topk={t}", f) for t, f in triton.items()]
        cases += [(f"mosaic bk{b}", f) for b, f in mosaic.items()] + [("mosaic fused topk=estimated", fused)]
        done = {}  # results by case: the Triton rows (run first) are the references of the Mosaic ones
        for name, fn in cases:
            row = {"S": s, "case": name, "device": device}
            try:
                res = done[name] = fn(q, k, v)
                ref = done.get("triton topk=none") or triton["none"](q, k, v)
                if name.startswith("mosaic fused"):
                    row["rel_err_out"] = rel_err(res.out_gamma, ref.out_gamma)
                    tri = done.get("triton topk=estimated") or triton["estimated"](q, k, v)
                    row["same_ids_as_triton_64row_tiles"] = float(
                        (np.sort(np.asarray(res.block_idx), -1) == np.sort(np.asarray(tri.block_idx), -1)).mean())
                elif name.startswith("mosaic"):
                    row["rel_err_out"] = rel_err(res[0], ref.out_gamma)
                    row["max_abs_err_lse"] = float(jnp.max(jnp.abs(res[1] - ref.lse_gamma)))
                row["ms"] = queued_median_ms(lambda fn=fn: fn(q, k, v), calls=args.calls, reps=3, warmup=1)
                flops = 4.0 * N * D * sum(min(g * GAMMA + 1, s) for g in range(0, cdiv(s, GAMMA)))
                row["tflops_sampled_rows"] = flops / (row["ms"] / 1e3) / 1e12
            except Exception as e:  # noqa: BLE001 -- report and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            print(json.dumps(row), flush=True)
            append_jsonl(args.out, row)

    if args.plot:
        print(plot(args.out), file=sys.stderr)


if __name__ == "__main__":
    main()
