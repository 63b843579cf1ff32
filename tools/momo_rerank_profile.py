"""Time, piece by piece, what `Momo()`'s re-rank adds to MOMO at one length on a GPU (the bench's video-like
input and budget, `mmjax bench momo`), so its cost can be split between the kernel and the XLA work around it.

One JSON line per piece (median ms of ``--reps`` calls, each piece jitted on its own):

* ``attend_default`` / ``attend_rerank0``: `Momo().attend` and `Momo(rerank=0).attend` end to end;
* ``union``: union + trim to ``rerank_factor * k_trim`` candidates (`Momo.union_candidates`);
* ``rerank``: `Momo.rerank_candidates` (candidate mass through the api, then the top ``k_trim``);
* ``mass_api``: `candidate_mass` alone (its default implementation);
* ``mass_kernel_sorted``: the Mosaic GPU kernel on lists already in id order (``sort=False``), and
  ``mass_kernel_rows_last``: the same with the grid's query blocks fastest (``heads_first=False``);
* ``argsort`` / ``sort``: the wrapper's id sort of the lists (pairs) and a key-only sort;
* ``q_rows``: the wrapper's gather of every ``rerank_rows``-th query row;
* ``topk_take``: the top ``k_trim`` of the masses and their ids;
* ``assemble``: `assemble_layout` of the kept ids;
* ``union_sort`` / ``union_segments`` / ``union_topk``: the union's three stages on their own (the sort of the
  query block's ``[gamma rows x k]`` (id, value) pairs by id; the runs' totals, counts and ids by segment sums; the
  top ``rerank_factor * k_trim`` runs).

Usage (a lent sm90 GPU): python3 tools/momo_rerank_profile.py --out $OUT/momo-rerank-profile.jsonl [--plot]
       python3 tools/momo_rerank_profile.py --out FILE.jsonl --plot-only   (bars of ms per piece, a PNG beside FILE)
The patterns are `Momo()` and `Momo(rerank=0)` with their defaults, which are the bench's budget (`GPU_CONFIG`).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from bar_panels import add_plot_args, plot_ms_bars
from gpu_timing import median_ms
from jax import lax
from jsonl_log import append_jsonl

from mmjax.drivers.bench.momo import GPU_CONFIG, video_like
from mmjax.sparse.layouts import KernelOptions
from mmjax.sparse.patterns import Momo
from mmjax.sparse.patterns.momo import assemble_layout, run_values, union_pairs
from pallas_kernels.candidate_mass import candidate_mass
from pallas_kernels.candidate_mass.mosaic_gpu import candidate_mass_mosaic_gpu


def plot(jsonl: str) -> str:
    """Bars of ms per piece (the latest row per device, length and piece), one panel per device and length, from the
    JSON-lines file ``jsonl``, written atomically beside it as a PNG; returns its path."""
    return plot_ms_bars(jsonl, name="piece", highlight=lambda piece: piece.startswith("attend"), log=True, height=4,
                        title=lambda device, s: f"MOMO's re-rank by piece, {s} tokens\n{device}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="tree")
    p.add_argument("--seq-len", type=int, default=1048576)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-attend", action="store_true", help="leave out the two end-to-end rows")
    p.add_argument("--pieces", nargs="*", help="only these pieces (default: all)")
    add_plot_args(p)
    args = p.parse_args()
    if args.plot_only:
        print(plot(args.out), file=sys.stderr)
        return

    s = args.seq_len
    q, k, v = video_like(GPU_CONFIG, s, seed=s)
    base, pat = Momo(rerank=0), Momo()
    opts = KernelOptions(implementation="mosaic_gpu")
    c, stride = pat.rerank_factor, pat.rerank_rows
    device = jax.devices()[0].device_kind

    def emit(piece, fn, **extra):
        if args.pieces and piece not in args.pieces:
            return
        row = dict(label=args.label, piece=piece, S=s, rerank=c, rerank_stride=stride, device=device, **extra)
        try:
            row["ms"] = median_ms(fn, reps=args.reps, warmup=1)
        except Exception as e:  # reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(row, flush=True)
        append_jsonl(args.out, row)

    if not args.skip_attend:
        for name, pt in (("attend_default", pat), ("attend_rerank0", base)):
            f = jax.jit(lambda q, k, v, pt=pt: pt.attend(q, k, v, options=opts))
            emit(name, lambda f=f: f(q, k, v))
    res = jax.jit(lambda q, k, v: pat.plan(q, k, v, options=opts).qsa)(q, k, v)
    union = jax.jit(pat.union_candidates, static_argnums=(1, 2))
    cands = union(res, s, s)
    ids = cands.ids
    emit("union", lambda: union(res, s, s), candidates=int(ids.shape[-1]))
    rerank = jax.jit(lambda q, k, cands, lse: pat.rerank_candidates(q, k, cands, lse, opts))
    emit("rerank", lambda: rerank(q, k, cands, res.lse_gamma), rerank_share=pat.rerank_fraction)
    kw = dict(query_block=pat.query_block, block=pat.block, gamma=pat.gamma, stride=stride)
    mass_api = jax.jit(lambda q, k, ids, lse: candidate_mass(q, k, ids, lse, **kw))
    emit("mass_api", lambda: mass_api(q, k, ids, res.lse_gamma))
    nk = -(-s // pat.block)
    ids_sorted = jnp.sort(jnp.where(ids >= 0, ids, nk), axis=-1)
    ids_sorted = jnp.where(ids_sorted < nk, ids_sorted, -1)
    for name, heads_first in (("mass_kernel_sorted", True), ("mass_kernel_rows_last", False)):
        f = jax.jit(lambda q, k, ids, lse, hf=heads_first: candidate_mass_mosaic_gpu(
            q, k, ids, lse, sm_scale=q.shape[-1] ** -0.5, sort=False, heads_first=hf, **kw))
        emit(name, lambda f=f: f(q, k, ids_sorted, res.lse_gamma))
    argsort = jax.jit(lambda x: jnp.argsort(jnp.where(x >= 0, x, nk), axis=-1))
    emit("argsort", lambda: argsort(ids))
    sort = jax.jit(lambda x: jnp.sort(jnp.where(x >= 0, x, nk), axis=-1))
    emit("sort", lambda: sort(ids))
    rows = jax.jit(lambda q: q[:, jnp.arange(0, q.shape[1], stride)])
    emit("q_rows", lambda: rows(q))
    mass = mass_api(q, k, ids, res.lse_gamma)

    def topk_take(ids, mass):
        top, pick = lax.top_k(jnp.where(ids >= 0, mass, -jnp.inf), pat.trim)
        return jnp.where(top > -jnp.inf, jnp.take_along_axis(ids, pick, -1), -1)

    tt = jax.jit(topk_take)
    emit("topk_take", lambda: tt(ids, mass))
    kept = tt(ids, mass)
    asm = jax.jit(lambda x: assemble_layout(x, q_len=s, kv_len=s, query_block=pat.query_block, block=pat.block,
                                            sink_blocks=pat.sink_blocks, local=pat.local))
    emit("assemble", lambda: asm(kept))

    # the union's stages, as `union_trim` runs them
    geo_u = dict(q_len=s, kv_len=s, gamma=pat.gamma, query_block=pat.query_block, block=pat.block,
                 sink_blocks=pat.sink_blocks, local=pat.local, rule=pat.rule)
    ids_u, sc_u = jax.jit(lambda i, v, lse: union_pairs(i, v, lse=lse, **geo_u))(
        res.block_idx, res.block_score, res.lse_gamma)
    srt = jax.jit(lambda i, v: lax.sort((i, v), dimension=3, num_keys=1))
    emit("union_sort", lambda: srt(ids_u, sc_u), entries=int(ids_u.shape[-1]))
    ids_s, sc_s = srt(ids_u, sc_u)
    seg = jax.jit(lambda i, v: run_values(i, v, rule=pat.rule, big=nk))
    emit("union_segments", lambda: seg(ids_s, sc_s))
    mean, seg_id = seg(ids_s, sc_s)
    top = jax.jit(lambda mean, seg_id: jnp.take_along_axis(seg_id, lax.top_k(mean, c * pat.trim)[1], axis=-1))
    emit("union_topk", lambda: top(mean, seg_id))
    want = top(mean, seg_id)

    # a candidate for a faster union: run totals by a segmented scan at each run's last entry instead of three
    # segment sums
    def scan_runs(ids, sc):
        first = jnp.concatenate([jnp.ones(ids.shape[:-1] + (1,), bool), ids[..., 1:] != ids[..., :-1]], -1)
        last = jnp.concatenate([ids[..., 1:] != ids[..., :-1], jnp.ones(ids.shape[:-1] + (1,), bool)], -1)

        def comb(a, b):
            return a[0] | b[0], jnp.where(b[0], b[1], a[1] + b[1])

        total = lax.associative_scan(comb, (first, sc), axis=3)[1]
        return jnp.where(last & (ids < nk), total, -jnp.inf), ids

    scan = jax.jit(scan_runs)
    emit("union_scan_runs", lambda: scan(ids_s, sc_s))
    same = (jnp.sort(top(*scan(ids_s, sc_s)), -1) == jnp.sort(want, -1)).mean()
    row = dict(label=args.label, piece="union_scan_same_ids", S=s, share=float(same), device=device)
    print(row, flush=True)
    append_jsonl(args.out, row)
    if args.plot:
        print(plot(args.out), file=sys.stderr)


if __name__ == "__main__":
    main()
