"""Which strides `bench patterns`' Grid (searched strides, `gpu_patterns()["Grid"]`) finds per head on
`tools/pattern_parts_profile.py`'s video-like input, and whether the query heads of each key / value head agree (then
the Mosaic GPU passes gather k / v once per key / value head: `mosaic_gpu.same_key_orders`). Runs on a CPU: only the
estimation's rows of q (the last ``last_q``) are kept, one key / value head group drawn at a time as `inputs` draws
them (about 20 GB resident at 1M tokens).

    PYTHONPATH=.:tools python3 tools/grid_strides.py --seq-len 1048576
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from pattern_parts_profile import HEADS, KV_HEADS, draws, join_heads

from mmjax.drivers.bench.patterns import gpu_patterns


def estimation_inputs(s: int, last_q: int) -> tuple[jax.Array, jax.Array]:
    """(the last ``last_q`` rows of q ``[1, last_q, N, D]``, k ``[1, S, K, D]``) of `pattern_parts_profile.inputs`
    at length ``s``, without keeping the rest of q or v (`draws`)."""
    return join_heads(draws(s, keep=lambda qkv: (qkv[0][:, -last_q:], qkv[1])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, nargs="+", default=[131072])
    args = ap.parse_args()
    grid = gpu_patterns()["Grid"]
    for s in args.seq_len:
        q, k = estimation_inputs(s, grid.last_q)
        stride = np.asarray(grid.estimate(q, k)[0])[0]  # [N]
        groups = stride.reshape(KV_HEADS, HEADS // KV_HEADS)
        print(f"S={s}: strides per head {stride.tolist()}; each key / value head's query heads agree: "
              f"{[bool((g == g[0]).all()) for g in groups]}", flush=True)


if __name__ == "__main__":
    main()
