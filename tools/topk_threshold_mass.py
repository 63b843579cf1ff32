"""How well does the "estimated" top-k's threshold rule choose, per sampled row? (CPU or GPU, reference top-k.)

Usage: python3 tools/topk_threshold_mass.py OUT.jsonl --lengths 65536 262144 --inputs mixed video needle
       [--k-exact 8] [--quantiles gaussian histogram] [--rows 32]

For each input family of `mmjax bench momo` (2 query / 1 key heads, fp32) at each length: ``--rows`` sampled rows at
random positions of the second half (a multiple of gamma = 16), their block scores S(j) (beta = 64, one sink block,
local 128: the MOMO defaults), each row's candidates offered in the kernel's golden order (the row alone as its
tile), selected by the estimated top-k (k = 128) with each threshold rule, and by the exact top-k. Reports the softmax
mass of the row the selected blocks hold (``sum exp(S(j) - lse)``), averaged over rows and heads, and the overlap
with the exact top-k's blocks. One JSON line per (input, length) is appended to OUT.jsonl (`tools/jsonl_log.py`).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jsonl_log import append_jsonl

from mmjax.drivers.bench import momo as bench_momo
from pallas_kernels.qsa_topk.common import scan_block_ids, scan_table
from pallas_kernels.qsa_topk.reference import block_scores, candidates, select_blocks

K, BLOCK, SINK_BLOCKS, LOCAL, GAMMA = 128, 64, 1, 128, 16
INPUTS = {"mixed": bench_momo.mixed_like, "video": bench_momo.video_like, "needle": bench_momo.needle_like}


def row_orders(pos: np.ndarray, nk: int) -> np.ndarray:
    """int32 ``[R, nk]``: the golden scan order of each row taken as its own tile."""
    out = []
    for p in pos:
        table = scan_table(1, int(p) + 1, gamma=1, block_kv=BLOCK, local=LOCAL, sink_blocks=SINK_BLOCKS, rows=1,
                           order="golden")
        out.append(scan_block_ids(table, sink_blocks=SINK_BLOCKS, n_steps=nk)[0])
    return np.stack(out).astype(np.int32)


def measure(name: str, s: int, rows: int, k_exact: int, quantiles: list[str]) -> dict:
    cfg = bench_momo.MomoBenchConfig(heads=2, kv_heads=1, dtype="float32")
    q, k, _ = INPUTS[name](cfg, s, s + 1)
    s = k.shape[1]
    rng = np.random.default_rng(0)
    pos = np.sort(rng.choice(np.arange(s // 2, s), rows, replace=False)) // GAMMA * GAMMA
    pos_j = jnp.asarray(pos, jnp.int32)
    _, lse, scores = block_scores(q[:, pos_j], pos_j, k, None, block_kv=BLOCK, sm_scale=q.shape[-1] ** -0.5)
    nk = scores.shape[-1]
    scores, lse = scores[0].reshape(-1, nk), lse[0].reshape(-1)  # [heads * rows, nk]
    all_pos = jnp.tile(pos_j, q.shape[2])
    active, remaining = candidates(all_pos, nk, block_kv=BLOCK, sink_blocks=SINK_BLOCKS, local=LOCAL)
    order = jnp.asarray(row_orders(np.asarray(all_pos), nk))
    mass = jnp.where(active, jnp.exp(scores - lse[:, None]), 0.0)

    def kept(ids):
        return float(jnp.mean(jnp.sum(jnp.take_along_axis(mass, jnp.maximum(ids, 0), -1) * (ids >= 0), -1)))

    _, exact_ids = select_blocks(scores, active, remaining, algorithm="exact", top_k=K, k_exact=0)
    exact_sets = [set(r) for r in np.asarray(exact_ids)]
    row = {"input": name, "S": int(s), "rows": rows, "heads": int(q.shape[2]), "k": K, "k_exact": k_exact,
           "candidates_mean": float(jnp.mean(jnp.sum(active, -1))), "exact": kept(exact_ids)}
    for quantile in quantiles:
        t0 = time.perf_counter()
        _, ids = jax.jit(lambda s_, a, r, o, qn=quantile: select_blocks(
            s_, a, r, algorithm="estimated", top_k=K, k_exact=k_exact, order=o, quantile=qn))(
            scores, active, remaining, order)
        row[quantile] = kept(ids)
        row[f"{quantile}_overlap"] = float(np.mean([len(set(r) & e) / K for r, e in zip(np.asarray(ids), exact_sets)]))
        row[f"{quantile}_s"] = time.perf_counter() - t0
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--lengths", type=int, nargs="+", default=[65536, 262144])
    p.add_argument("--inputs", nargs="+", choices=sorted(INPUTS), default=["mixed", "video", "needle"])
    p.add_argument("--k-exact", type=int, default=8)
    p.add_argument("--quantiles", nargs="+", default=["gaussian", "histogram"])
    p.add_argument("--rows", type=int, default=32)
    a = p.parse_args()
    for s in a.lengths:
        for name in a.inputs:
            row = measure(name, s, a.rows, a.k_exact, a.quantiles)
            row["device"] = jax.devices()[0].device_kind
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            append_jsonl(a.out, row)


if __name__ == "__main__":
    main()
