"""The fused last-rows scoring kernel (`pallas_kernels.last_q_scores`, Triton) against its XLA reference on a GPU:
vertical and slash scores of the last 64 queries of 28 query heads (4 key / value heads, D = 128, bf16) over S keys.

    PYTHONPATH=.:tools python3 tools/last_q_scores_bench.py --lens 131072 1048576 --out DIR

Each row is one implementation / tile choice, timed alone under its own jit (median of ``--reps`` samples of calls
queued for ``--batch-s`` seconds, `mmjax.timing.time_fn`), with its largest difference from the reference's scores
relative to the largest score. Prints a table, writes ``last_q_scores_bench.json`` and a plot of it into ``--out``.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run_bench  # noqa: E402

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


def inputs(s: int) -> tuple:
    """q (the last 64 queries) and k over S keys, bf16."""
    kq, kk = jax.random.split(jax.random.PRNGKey(s))
    q = jax.random.normal(kq, (1, LAST_Q, HEADS, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
    return q, jax.random.normal(kk, (1, s, KV_HEADS, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)


def main(argv=None) -> int:
    return run_bench(
        argv, doc=__doc__, stem="last_q_scores_bench",
        meta={"last_q": LAST_Q, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
        variants=variants, inputs=inputs,
        check=lambda got, want: {"max_rel_diff": max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
                                                     for g, w in zip(got, want))},
        columns=f"{'max diff / max':>15}",
        title=lambda m: f"{m['device']}: vertical / slash scores of the last {m['last_q']} queries, {m['heads']} / "
                        f"{m['kv_heads']} heads")


if __name__ == "__main__":
    sys.exit(main())
