"""Time `candidate_mass_triton` variants on one GPU (tile sweep), and the Mosaic GPU kernel on an sm90 GPU (its K
stages, candidates per step, ``qk_fp8``); one JSON line per variant, the Mosaic rows with
their largest and median difference to the Triton default's masses and the share of its top 128 per list they keep.

Usage: python3 tools/candidate_mass_tune.py --out $OUT/candidate-mass.jsonl [--label L] [--candidates C]
With an older ``pallas_kernels`` first on PYTHONPATH (no ``per_step`` argument) only its default is timed.

Shape of MOMO's re-rank at 128k with c = 2: B=1, T=S=131072, N=28, K=4, D=128, bf16, query block 128,
block 64, 256 candidates per query block (random distinct-ish ids at or before the block), gamma 16
(``--candidates 512 --strides 2``: the re-rank of ``Momo(rerank=4, rerank_stride=2)``).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json

import jax
import jax.numpy as jnp
from gpu_timing import median_ms
from jax import lax
from jsonl_log import append_jsonl

import pallas_kernels
from pallas_kernels.candidate_mass.mosaic_gpu import ROWS, candidate_mass_mosaic_gpu
from pallas_kernels.candidate_mass.triton import candidate_mass_triton
from pallas_kernels.platform import is_sm90


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="tree")
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--strides", type=int, nargs="+", default=[1, 4])
    p.add_argument("--per-steps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--shared-in-group", action="store_true",
                   help="give the query heads of a key head the same candidate lists (random ones differ)")
    p.add_argument("--mosaic-stages", type=int, nargs="*", default=[2, 3, 4],
                   help="K stages of the Mosaic GPU kernel to time (sm90 only; none: skip it)")
    p.add_argument("--mosaic-per-steps", type=int, nargs="+", default=[1, 2],
                   help="candidates per step of the Mosaic GPU kernel to time")
    p.add_argument("--fp8s", type=int, nargs="+", default=[0], choices=(0, 1),
                   help="the Mosaic GPU kernel's scores from bf16 (0) or fp8 (1) copies of q and k")
    p.add_argument("--skip-triton-sweep", action="store_true", help="time only the Triton kernel's default tile")
    args = p.parse_args()

    s, n, kh, d, qb, block, c, gamma = args.seq_len, 28, 4, 128, 128, 64, args.candidates, 16
    kq, kk, kc, kr = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (1, s, n, d), jnp.bfloat16)
    k = jax.random.normal(kk, (1, s, kh, d), jnp.bfloat16)
    nq = s // qb
    first = jnp.arange(nq)[:, None] * (qb // block)  # the query block's first key block
    cand = (jax.random.uniform(kc, (1, n, nq, c)) * (first[None, None] + 1)).astype(jnp.int32)
    if args.shared_in_group:  # the query heads of a key head list the same blocks (the first of each group's)
        cand = jnp.repeat(cand[:, :: n // kh], n // kh, axis=1)
    ref = 4.0 + jax.random.normal(kr, (1, n, s // gamma), jnp.float32)
    tunable = "per_step" in inspect.signature(candidate_mass_triton).parameters
    grid = list(itertools.product(args.per_steps, [4, 8], [2, 3])) if tunable else [(None, None, None)]
    if args.skip_triton_sweep:
        grid = []
    for stride in args.strides:
        for per_step, warps, stages in grid:
            kw = dict(query_block=qb, block=block, stride=stride, gamma=gamma, sm_scale=d ** -0.5,
                      interpret=jax.default_backend() != "gpu")
            if tunable:
                kw.update(per_step=per_step, num_warps=warps, num_stages=stages)
            row = dict(label=args.label, module=pallas_kernels.__file__, S=s, stride=stride, per_step=per_step,
                       num_warps=warps, num_stages=stages, device=jax.devices()[0].device_kind)
            try:
                fn = jax.jit(lambda q, k, cand, ref, kw=kw: candidate_mass_triton(q, k, cand, ref, **kw))
                row["ms"] = median_ms(lambda: fn(q, k, cand, ref))
            except Exception as e:  # a tile the compiler refuses (e.g. out of shared memory) is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(row), flush=True)
            append_jsonl(args.out, row)
        if is_sm90() and qb // stride in ROWS:
            base = dict(query_block=qb, block=block, stride=stride, gamma=gamma, sm_scale=d ** -0.5)
            want = candidate_mass_triton(q, k, cand, ref, **base)
            for stages, per_step, fp8 in itertools.product(args.mosaic_stages, args.mosaic_per_steps, args.fp8s):
                row = dict(label=args.label, module=pallas_kernels.__file__, S=s, stride=stride, candidates=c,
                           implementation="mosaic_gpu", stages=stages, per_step=per_step, qk_fp8=bool(fp8),
                           device=jax.devices()[0].device_kind)
                extra = dict(qk_fp8=True) if fp8 else {}  # older kernels have no qk_fp8 argument
                try:
                    fn = jax.jit(lambda q, k, cand, ref, st=stages, ps=per_step, ex=extra: candidate_mass_mosaic_gpu(
                        q, k, cand, ref, stages=st, per_step=ps, **ex, **base))
                    got = fn(q, k, cand, ref)
                    row["max_rel_diff_vs_triton"] = float(jnp.max(jnp.abs(got - want) / (jnp.abs(want) + 1e-6)))
                    row["median_rel_diff_vs_triton"] = float(jnp.median(jnp.abs(got - want) / (jnp.abs(want) + 1e-6)))
                    keep = min(128, c)  # the share of the Triton masses' top candidates per list this run keeps
                    top_w, top_g = lax.top_k(want, keep)[1], lax.top_k(got, keep)[1]
                    row["top_kept_vs_triton"] = float((top_g[..., :, None] == top_w[..., None, :]).any(-1).mean())
                    row["ms"] = median_ms(lambda: fn(q, k, cand, ref))
                except Exception as e:  # reported, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps(row), flush=True)
                append_jsonl(args.out, row)


if __name__ == "__main__":
    main()
