"""Captured mass and cost of cheaper MOMO re-ranks, from one scoring per input (issue 16: `Momo()` >= 10x cuDNN at 1M
with the mixed family's gap <= 1.5 points).

`Momo()` re-ranks ``C = 4 * k_trim = 512`` candidates per query block: union + trim ranks the sampled rows' selected
blocks by their summed mass over those rows (``order="mass"``), keeps the first ``C``, and the candidate-mass kernel
scores them on every 2nd row of the query block; the best ``k_trim = 128`` by that score are kept. The kernel's cost
is linear in the scored candidates. A candidate's score does not depend on the others, so one scoring of every block
of the union (up to ``query_block / gamma * k = 1024``) per input and row stride (every row, every 2nd; bf16, and fp8
with ``--fp8``) gives the kept lists of every cheaper variant ``(order, C, keep)``: the union ranked by ``order``,
its first ``C`` candidates, the first ``keep`` of them kept without a score (``keep`` in ``--keeps``) and the best
``k_trim - keep`` of the others by score (`mmjax.sparse.patterns.momo.rerank_pick`). The union orders:

* ``mass``: summed ``exp(score - lse)`` over the sampled rows that selected the block (`Momo()`'s);
* ``count``: how many sampled rows selected it (ties by ``mass``);
* ``max``: the largest ``exp(score - lse)`` of one sampled row;
* ``mean``: the mean raw score over the rows that selected it (`union_trim`'s "mean" rule);
* ``scored``: the kernel's own score (an oracle of the order: any ``C`` then keeps the best of the whole union).

For each input of `mmjax bench momo`'s mass section (video, needle, mixed; its inputs, seeds and 16 query blocks at
``--mass-rows 2048``, its oracle: ``gap`` is the best shared list's mass minus the layout's, as the bench's ``gap
(block)``), one JSON line per variant: ``gap`` in points, and ``scored`` (candidates per query block the kernel
scores). ``("mass", 512, 0)`` with every 2nd row in bf16 is `Momo()`'s re-rank: its gaps equal the bench's (1.36 /
0.23 / 0.04 points on one H200, 2026-11-28). A line per input with ``union_rank``: where `Momo()`'s kept blocks lie in
its candidates' order (share of the kept blocks per rank bin). With ``--time``: the kernel's ms on the video input
per (row stride, scored count), lists already in id order (the wrapper's sort is about 5 ms at 1M).

With ``--adaptive``: `Momo()`'s re-rank on a share of the lists only (`adaptive`).

Measured (one H200, 2026-11-28, `bench/results/momo-rerank-{keep,orders,adaptive}_NVIDIA-H200_2026-11-28.{jsonl,png}`,
README "Can the re-rank score fewer candidates?"): fewer candidates per list, unscored first candidates or other
union orders do not keep the mixed gap within 1.5 points (384 candidates: 1.502; the whole union scored: 1.34; every
row instead of every 2nd: 0.79 at 512). Fewer lists do: the 5/8 of each head's lists with the largest union tail
give 1.41 / 0.27 / 0.06 points (`Momo.rerank_share`, its default since).

Usage (a lent sm90 GPU): python3 tools/momo_rerank_variants.py --out $OUT/momo-rerank-keep.jsonl [--fp8] [--time]
       python3 tools/momo_rerank_variants.py --out FILE.jsonl --plot-only   (gap per scored candidates: a PNG beside)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from gpu_timing import median_ms
from jax import lax
from jsonl_log import append_jsonl, write_atomic

from mmjax.drivers.bench.momo import GPU_CONFIG, MASS_INPUTS, mass_query_blocks
from mmjax.sparse.layouts import KernelOptions
from mmjax.sparse.metrics import block_mass, captured_mass
from mmjax.sparse.patterns import Momo
from mmjax.sparse.patterns.momo import assemble_layout, rerank_pick, run_values, union_pairs
from pallas_kernels.candidate_mass import candidate_mass
from pallas_kernels.candidate_mass.mosaic_gpu import candidate_mass_mosaic_gpu
from pallas_kernels.tiling import cdiv

RANK_BINS = (0, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
ORDERS = ("mass", "count", "max", "mean", "scored")
matplotlib.use("Agg")


def union_runs(pat: Momo, res, t: int) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Every block of a query block's union (``[B, N, nq, M]`` ids in `union_trim`'s "mass" order, -1 empty) and,
    for the orders of the module docstring but ``scored``, its keys (float, same order; -inf for empty slots)."""
    kw = dict(q_len=t, kv_len=t, gamma=pat.gamma, query_block=pat.query_block, block=pat.block,
              sink_blocks=pat.sink_blocks, local=pat.local)
    big = cdiv(t, pat.block)
    ids, mass = union_pairs(res.block_idx, res.block_score, rule="mass", lse=res.lse_gamma, **kw)
    _, raw = union_pairs(res.block_idx, res.block_score, rule="mean", **kw)
    ids, mass, raw = lax.sort((ids, mass, raw), dimension=3, num_keys=1)
    total, seg_id = run_values(ids, mass, rule="mass", big=big)
    count, _ = run_values(ids, jnp.ones_like(mass), rule="mass", big=big)
    mean, _ = run_values(ids, raw, rule="mean", big=big)
    b, n, nq, m = ids.shape
    first = jnp.concatenate([jnp.ones(ids.shape[:-1] + (1,), bool), ids[..., 1:] != ids[..., :-1]], -1)
    flat = (jnp.arange(b * n * nq).reshape(b, n, nq, 1) * m + jnp.cumsum(first, -1) - 1).ravel()
    top = jax.ops.segment_max(mass.ravel(), flat, num_segments=b * n * nq * m).reshape(ids.shape)
    per = pat.query_block // pat.gamma  # sampled rows per query block: total <= count <= per
    keys = dict(mass=total, count=jnp.where(total > -jnp.inf, count + total / (per + 1.0), -jnp.inf),
                max=jnp.where(total > -jnp.inf, top, -jnp.inf), mean=mean)
    _, order = lax.top_k(total, m)  # `union_trim`'s order: ties to the lower id
    runs = jnp.where(jnp.take_along_axis(total, order, -1) > -jnp.inf, jnp.take_along_axis(seg_id, order, -1), -1)
    return runs, {name: jnp.take_along_axis(v, order, -1) for name, v in keys.items()}


ADAPTIVE_SHARES = (0.25, 0.375, 0.5, 0.625, 0.6875, 0.75, 0.875)


def adaptive(runs, tail, score, pat: Momo, emit, **info) -> None:
    """`Momo()`'s re-rank (the union's first ``4 * k_trim``, scored) on a share of the lists only, the others keeping
    the union's first ``k_trim`` (``Momo(rerank=0)``), the share chosen over all (head, query block) lists by:

    * ``tail``: the share of the union's summed mass past its first ``k_trim`` blocks (``tail``, `Momo()`'s own
      `UnionCandidates.tail`);
    * ``tail_head``: the same, the share taken in each (batch, head) alone;
    * ``distinct``: how many distinct blocks the union holds;
    * ``random``: at random (a control).

    One `emit` per (criterion, share) with ``scored`` the mean scored candidates per list (a list not re-ranked scores
    none)."""
    k_trim, c = pat.trim, pat.rerank_factor * pat.trim
    base = runs[..., :k_trim]
    full = rerank_pick(runs[..., :c], score[..., :c], k_trim=k_trim)
    criteria = {"tail": tail,
                "distinct": (runs >= 0).sum(-1).astype(jnp.float32),
                "random": jax.random.uniform(jax.random.key(0), runs.shape[:-1])}
    criteria["tail_head"] = criteria["tail"]
    for name, crit in criteria.items():
        for share in ADAPTIVE_SHARES:
            axis = -1 if name == "tail_head" else None
            chosen = crit >= jnp.quantile(crit, 1.0 - share, axis=axis, keepdims=True)
            frac = float(jnp.mean(chosen))
            emit(jnp.where(chosen[..., None], full, base), order="mass", C=c, keep=0, scored=frac * c, adaptive=name,
                 share=frac, **info)


def plot(jsonl: str) -> str:
    """Gap (points) against scored candidates per query block, one panel per input: a solid line per (order, rows,
    dtype) over C with keep = 0; where the file has keep > 0, a dashed line per C of `Momo()`'s order over its keeps;
    the ``scored`` order (the whole union scored, one gap for every C) as a dotted level. From the JSON-lines file,
    written atomically beside it as a PNG; returns its path."""
    rows = [r for r in map(json.loads, open(jsonl)) if "gap" in r]
    inputs = sorted({r["input"] for r in rows})
    fig, axes = plt.subplots(1, len(inputs), figsize=(5 * len(inputs), 4), squeeze=False)
    for ax, kind in zip(axes[0], inputs):
        solid: dict[tuple, list] = {}
        dashed: dict[tuple, list] = {}
        mine = [r for r in rows if r["input"] == kind]
        kept_cs = {r["C"] for r in mine if r["keep"] > 0}
        for r in mine:
            name = f"rows/{r['rows']}{' fp8' if r['fp8'] else ''}"
            order = r.get("order", "mass")
            if "adaptive" in r:  # a share of the lists re-ranked: x = the mean scored candidates per list
                dashed.setdefault((f"{name}, re-ranked by {r['adaptive']}", None), []).append((r["scored"], r["gap"]))
                continue
            if r["keep"] == 0:
                solid.setdefault((order, name), []).append((r["C"], r["gap"]))
            if order == "mass" and r["C"] in kept_cs:
                dashed.setdefault((name, r["C"]), []).append((r["scored"], r["gap"]))
        for (order, name), pts in sorted(solid.items()):
            pts.sort()
            if order == "scored":
                ax.axhline(pts[0][1], ls=":", color="black", lw=0.8)
                ax.annotate(f"whole union scored, {name}", (ax.get_xlim()[0], pts[0][1]), fontsize=6, va="bottom")
                continue
            ax.plot(*zip(*pts), "-", marker=".", label=f"{order}, {name}")
        for (name, c), pts in sorted(dashed.items()):
            pts.sort()
            label = name if c is None else f"mass, {name}, C={c}, keep {pts[-1][0] - pts[0][0]}..0"
            ax.plot(*zip(*pts), "--", marker="x", lw=0.8, label=label)
        ax.axhline(1.5, color="gray", lw=0.8)
        ax.set(title=f"{kind}, S={rows[0]['S']}", xlabel="scored candidates per query block", ylabel="gap (points)")
        ax.legend(fontsize=5)
    fig.suptitle(f"MOMO re-rank variants, {rows[0]['device']}")
    fig.tight_layout()
    path = os.path.splitext(jsonl)[0] + ".png"
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, default=1048576)
    p.add_argument("--mass-rows", type=int, default=2048)
    p.add_argument("--fp8", action="store_true", help="also score in fp8 (every 2nd row)")
    p.add_argument("--time", action="store_true", help="time the kernel per (row stride, scored count)")
    p.add_argument("--inputs", nargs="+", default=[k for k, _ in MASS_INPUTS])
    p.add_argument("--orders", nargs="+", default=list(ORDERS), choices=ORDERS)
    p.add_argument("--keeps", nargs="+", type=int, default=[0], help="keep counts (with the mass order only)")
    p.add_argument("--implementation", default="mosaic_gpu", help="kernels (None: the defaults, e.g. on a CPU)")
    p.add_argument("--strides", nargs="+", type=int, default=[1, 2], help="row strides to score with (bf16)")
    p.add_argument("--adaptive", action="store_true",
                   help="re-rank only a share of the lists, chosen by a criterion (module docstring)")
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args()
    if args.plot_only:
        print(plot(args.out), file=sys.stderr)
        return

    s = args.seq_len
    cfg = dataclasses.replace(GPU_CONFIG, mass_rows=args.mass_rows)
    pat = Momo()
    impl = None if args.implementation == "None" else args.implementation
    opts = KernelOptions(implementation=impl)
    k_trim = pat.trim
    device = jax.devices()[0].device_kind
    rng = np.random.default_rng(s)
    scorings = [(st, False) for st in args.strides] + ([(2, True)] if args.fp8 else [])

    for kind, make in MASS_INPUTS:
        q, k, v = make(cfg, s, seed=s + 1)
        t = q.shape[1]
        blocks = mass_query_blocks(rng, t // cfg.query_block, cfg)
        if kind not in args.inputs:
            continue
        rows = jnp.asarray((blocks[:, None] * cfg.query_block + np.arange(cfg.query_block)).ravel(), jnp.int32)
        oracle = jax.jit(lambda q, k: block_mass(q, k, rows, block=cfg.block))(q, k)
        res = jax.jit(lambda q, k, v: pat.qsa(q, k, v, options=opts))(q, k, v)
        runs, keys = jax.jit(lambda r: union_runs(pat, r, t))(res)  # [B, N, nq, M], `union_trim`'s order
        m_max = int(jnp.max(jnp.sum(runs >= 0, -1)))
        sizes = [c for c in range(k_trim, runs.shape[-1] + 1, k_trim)]
        geometry = dict(q_len=t, kv_len=t, query_block=pat.query_block, block=pat.block, sink_blocks=pat.sink_blocks,
                        local=pat.local)

        @jax.jit
        def gap(ids, oracle, rows):
            c = captured_mass(oracle, assemble_layout(ids, **geometry), rows)
            return jnp.mean(c["oracle_block"] - c["captured"]), jnp.mean(c["captured"])

        def emit(ids, mass_rows=(oracle, rows), **info):
            g, cap = (float(x) for x in gap(ids, *mass_rows))
            append_jsonl(args.out, dict(S=t, input=kind, gap=100 * g, captured=cap, union_max=m_max, device=device,
                                        **info))
            print(f"{kind:6s} " + " ".join(f"{a}={b}" for a, b in info.items()) + f" gap {100 * g:.2f} points",
                  file=sys.stderr)

        for stride, fp8 in scorings:
            score = jax.jit(lambda q, k, c, lse, st=stride, f=fp8: candidate_mass(
                q, k, c, lse, query_block=pat.query_block, block=pat.block, gamma=pat.gamma, stride=st,
                implementation=impl, qk_fp8=f))(q, k, runs, res.lse_gamma)
            for order in args.orders:
                key = jnp.where(runs >= 0, score, -jnp.inf) if order == "scored" else keys[order]
                _, pos = lax.top_k(key, runs.shape[-1])  # this order; ties to the earlier run
                cands, sc = jnp.take_along_axis(runs, pos, -1), jnp.take_along_axis(score, pos, -1)
                for c in sizes:
                    for m in ([0] if order != "mass" else [x for x in args.keeps if x == 0 or c > k_trim > x]):
                        ids = rerank_pick(cands[..., m:c], sc[..., m:c], k_trim=k_trim - m)
                        ids = jnp.concatenate([cands[..., :m], ids], -1) if m else ids
                        emit(ids, rows=stride, fp8=fp8, order=order, C=c, keep=m, scored=c - m)
                        if (stride, fp8, order, c, m) == (pat.rerank_rows, False, "mass", 4 * k_trim, 0):
                            rank = jnp.argsort(-jnp.where(cands[..., :c] >= 0, sc[..., :c], -jnp.inf), -1)
                            hist = np.histogram(np.asarray(rank[..., :k_trim]).ravel(), bins=RANK_BINS)[0]
                            share = (hist / hist.sum()).round(4).tolist()
                            append_jsonl(args.out, dict(S=t, input=kind, union_rank=dict(bins=list(RANK_BINS),
                                                                                         share=share), device=device))
                            print(f"{kind:6s} kept blocks' union ranks {list(RANK_BINS)}: {share}", file=sys.stderr)
            if args.adaptive and (stride, fp8) == (pat.rerank_rows, False):
                tail = jax.jit(lambda r: pat.union_candidates(r, t, t).tail)(res)
                adaptive(runs, tail, score, pat, emit, rows=stride, fp8=fp8)
            del score
        if args.time and kind == "video":
            for stride, scored in [(2, n) for n in (512, 448, 384, 320, 256)] + [(1, n) for n in (256, 192)]:
                f = jax.jit(lambda q, k, c, lse, st=stride: candidate_mass_mosaic_gpu(
                    q, k, c, lse, query_block=pat.query_block, block=pat.block, stride=st, gamma=pat.gamma,
                    sm_scale=q.shape[-1] ** -0.5, sort=False))
                top = jnp.iinfo(jnp.int32).max
                sub = jnp.sort(jnp.where(runs[..., :scored] >= 0, runs[..., :scored], top), -1)
                sub = jnp.where(sub == top, -1, sub)  # the union's first ones, in id order
                ms = median_ms(lambda f=f, a=(q, k, sub, res.lse_gamma): f(*a), reps=3, warmup=1)
                append_jsonl(args.out, dict(S=t, input=kind, timed="kernel", rows=stride, scored=scored, ms=ms,
                                            device=device))
                print(f"kernel rows/{stride} scored {scored}: {ms:.1f} ms", file=sys.stderr)
        del q, k, v, oracle, res, runs, keys
        gc.collect()
    if os.path.exists(args.out):
        print(plot(args.out), file=sys.stderr)


if __name__ == "__main__":
    main()
