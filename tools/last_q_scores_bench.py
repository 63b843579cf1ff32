"""The fused last-rows scoring kernel (`pallas_kernels.last_q_scores`, Triton) against its XLA reference on a GPU:
vertical and slash scores of the last 64 queries of 28 query heads (4 key / value heads, D = 128, bf16) over S keys.

    PYTHONPATH=.:tools python3 tools/last_q_scores_bench.py --lens 131072 1048576 --out DIR

Each row is one implementation / tile choice, timed alone under its own jit (median of ``--reps`` samples of calls
queued for ``--batch-s`` seconds, `mmjax.timing.time_fn`), with its largest difference from the reference's scores
relative to the largest score. Prints a table, writes ``last_q_scores_bench.json`` and a plot of it into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bar_panels import grouped_ms_bars  # noqa: E402
from jsonl_log import write_json_and_figure  # noqa: E402
from variant_timing import time_variants  # noqa: E402

from mmjax.timing import device_name  # noqa: E402
from pallas_kernels.last_q_scores import last_q_scores  # noqa: E402
from pallas_kernels.last_q_scores.triton import last_q_scores_triton  # noqa: E402

LAST_Q, HEADS, KV_HEADS, HEAD_DIM = 64, 28, 4, 128


def variants() -> dict:
    """{name: fn(q, k) -> (vertical, slash)}, each jitted."""
    scale = HEAD_DIM ** -0.5
    kernel = lambda **kw: jax.jit(lambda q, k: last_q_scores_triton(q, k, last_q=LAST_Q, sm_scale=scale, **kw))  # noqa: E731
    return {
        "reference": jax.jit(lambda q, k: last_q_scores(q, k, last_q=LAST_Q, implementation="reference")),
        "triton": kernel(),
        "triton 4 / core": kernel(lanes=19, chunks=19),
        "triton 8 warps": kernel(num_warps=8),
        "triton 128-key tiles": kernel(block_k=128, num_warps=8),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--lens", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch-s", type=float, default=0.1)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    result = {"meta": {"device": device_name(), "jax": jax.__version__, "last_q": LAST_Q, "heads": HEADS,
                       "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}, "rows": []}
    fns = variants()
    print(f"{'S':>9} {'variant':<24} {'ms':>9} {'x ref.':>8} {'max diff / max':>15}", flush=True)
    for s in a.lens:
        kq, kk = jax.random.split(jax.random.PRNGKey(s))
        q = jax.random.normal(kq, (1, LAST_Q, HEADS, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(kk, (1, s, KV_HEADS, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
        want = jax.block_until_ready(fns["reference"](q, k))

        def check(got, want=want):
            return {"max_rel_diff": max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
                                        for g, w in zip(got, want))}

        time_variants(fns, (q, k), check, seq_len=s, rows=result["rows"], reps=a.reps, batch_s=a.batch_s)
        del q, k, want
        jax.clear_caches()
    path = write_json_and_figure(a.out, "last_q_scores_bench", result, figure(result))
    print(f"wrote {path} and its plot")
    return 0


def figure(result: dict):
    """Grouped bars: ms of each variant, one group per sequence length (log scale)."""
    meta = result["meta"]
    return grouped_ms_bars(result["rows"], f"{meta['device']}: vertical / slash scores of the last "
                                           f"{meta['last_q']} queries, {meta['heads']} / {meta['kv_heads']} heads")


if __name__ == "__main__":
    sys.exit(main())
