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

from mmjax.timing import device_name, time_fn  # noqa: E402
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
    print(f"{'S':>9} {'variant':<22} {'ms':>9} {'x reference':>12} {'max diff / max':>15}", flush=True)
    for s in a.lens:
        kq, kk = jax.random.split(jax.random.PRNGKey(s))
        q = jax.random.normal(kq, (1, LAST_Q, HEADS, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(kk, (1, s, KV_HEADS, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
        want = jax.block_until_ready(fns["reference"](q, k))
        base = None
        for name, fn in fns.items():
            try:  # a variant that fails to compile or run is recorded, and the others are still timed
                got = fn(q, k)
                diff = max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) for g, w in zip(got, want))
                ms = time_fn(lambda fn=fn, q=q, k=k: fn(q, k), reps=a.reps, min_batch_s=a.batch_s)["ms"]
            except Exception as err:  # noqa: BLE001
                result["rows"].append({"seq_len": s, "variant": name, "error": repr(err)[:2000]})
                print(f"{s:>9} {name:<22} FAILED {repr(err)[:600]}", flush=True)
                continue
            base = ms if name == "reference" else base
            row = {"seq_len": s, "variant": name, "ms": ms, "speedup": base / ms, "max_rel_diff": diff}
            result["rows"].append(row)
            print(f"{s:>9} {name:<22} {ms:>9.3f} {base / ms:>12.2f} {diff:>15.2e}", flush=True)
            del got
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
