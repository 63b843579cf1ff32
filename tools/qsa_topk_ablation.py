"""Where does the fused Mosaic GPU QSA + top-k (`pallas_kernels.qsa_topk.mosaic_gpu`) spend its time over the
attention alone? Times the kernel with parts of its "estimated" top-k replaced (monkeypatched into `topk.py` /
`mosaic_gpu.py` while the kernel is traced), same inputs, same process. A profiling tool: the variants select
other blocks (except "ungated histogram count", which keeps the picks; the JSON line
says how many ids each variant shares with the first one).

Variants:
  base                              the kernel as it is
  ungated histogram count           the count at every step (no skip of un-hashed blocks)
  erfinv -> identity                the Gaussian threshold's inverse error function left out
  histogram threshold kept          the histogram threshold never refreshed
  no histogram count                the histogram never counted
  no exact slots                    the exact slots never updated
  no stores                         accepted items not stored: the threshold chain becomes dead code, so this is
                                    about the attention + block scores + exact slots
  erfinv, threshold, count out      the three above together
  branchless refresh, ungated count the threshold refresh as a select instead of a branch, the count every step
  golden_pairs scan                 ``scan="golden_pairs"``: 128-key tiles of two scored 64-key blocks (other picks)
  natural scan                      ``scan="natural"``: id order, also 128-key tiles (other picks)
  stages 3 / stages 5               3 or 5 K/V stages instead of `default_stages` (4 for 64-key tiles); same picks

Usage (a Hopper GPU): python3 tools/qsa_topk_ablation.py --out $OUT/qsa-topk-ablation.jsonl [--lens 131072]
Shapes: those of tools/qsa_mosaic_ceiling.py (B=1, N=28, K=4, D=128, bf16, gamma 16, random normal); top-k as in
`Momo()` (block 64, one sink block, local 128, k 128, k_exact 8, estimated, histogram threshold, golden scan).
Measured (H100, 2026-11-26, `bench/results/qsa-topk-ablation_NVIDIA-H100-80GB-HBM3_2026-11-26.jsonl`), with the top-k
still on the consumer warpgroups: 25.7 ms at 128k for the base; no single part above 2 ms; the stores out 19.6 ms.
With the top-k on the producer warpgroup: 21.0 ms at 128k, 1.20 s at 1M (1.43 s before, same call; the rows of
the previous kernel were timed with its commit's ``pallas_kernels`` first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from gpu_timing import queued_median_ms
from jsonl_log import append_jsonl
from qsa_mosaic_ceiling import GAMMA, D, random_qkv

from pallas_kernels.qsa_topk import mosaic_gpu as M
from pallas_kernels.qsa_topk import topk as T


def _ungated(original):
    def tracing(iota, first_active_step=None):
        del first_active_step
        return original(iota, None)
    return tracing


def _no_count(state, x, stat, n, mean, sigma):
    del x, stat, n, mean, sigma
    return state.hist, state.hist_base, state.hist_width, state.hist_counted


def _no_exact(state, x, j, active):
    return state, (x, jnp.zeros(x.shape, jnp.int32) + j, active)


def _kept_threshold(state, slots_left, remaining):
    del slots_left, remaining
    return state.hist_thr


def _branchless_every(period, step, run, keep):
    if period == 1:
        return run()
    on = (jnp.asarray(step, jnp.int32) & (period - 1)) == 0
    return jax.tree.map(lambda a, b: jnp.where(jnp.zeros(b.shape, jnp.float32) + on.astype(jnp.float32) > 0.5, a, b),
                        run(), keep())


def _kernel_with(**kwargs):
    """The kernel entry point with some of its static arguments fixed."""
    return {(M, "qsa_topk_mosaic_gpu"): functools.partial(M.qsa_topk_mosaic_gpu, **kwargs)}


def variants() -> dict[str, dict[tuple[object, str], object]]:
    """name -> {(module, attribute): replacement}."""
    return {
        "base": {},
        "ungated histogram count": {(T, "mosaic_tracing"): _ungated(T.mosaic_tracing)},
        "erfinv -> identity": {(T, "erfinv"): lambda x: x},
        "histogram threshold kept": {(T, "_histogram_threshold"): _kept_threshold},
        "no histogram count": {(T, "_histogram_count"): _no_count},
        "no exact slots": {(T, "exact_offer"): _no_exact},
        "no stores": {(M, "scatter_rows"): lambda *a: None},
        "erfinv, threshold, count out": {(T, "erfinv"): lambda x: x, (T, "_histogram_threshold"): _kept_threshold,
                                         (T, "_histogram_count"): _no_count},
        "branchless refresh, ungated count": {(T, "_every"): _branchless_every,
                                              (T, "mosaic_tracing"): _ungated(T.mosaic_tracing)},
        "golden_pairs scan": _kernel_with(scan="golden_pairs"),
        "natural scan": _kernel_with(scan="natural"),
        "stages 3": _kernel_with(stages=3),
        "stages 5": _kernel_with(stages=5),
    }


def run_variant(patches, fn):
    """``fn()`` traced and run with ``patches`` in place. The jit caches are cleared before (so the kernel is traced
    anew) and after (so no later call reuses a patched trace)."""
    saved = {key: getattr(*key) for key in patches}
    jax.clear_caches()
    try:
        for (module, name), value in patches.items():
            setattr(module, name, value)
        return fn()
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
        jax.clear_caches()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--lens", type=int, nargs="+", default=[131072])
    p.add_argument("--variants", nargs="+", help="names from the module docstring (default: all)")
    args = p.parse_args()
    table = variants()
    names = args.variants or list(table)
    unknown = sorted(set(names) - set(table))
    if unknown:
        p.error(f"--variants: unknown {unknown}; expected some of {sorted(table)}")
    device = jax.devices()[0].device_kind
    for s in args.lens:
        q, k, v = random_qkv(s)
        first_ids = None
        for name in names:
            def kernel():
                return M.qsa_topk_mosaic_gpu(q, k, v, gamma=GAMMA, block_kv=64, top_k=128, k_exact=8, sink_blocks=1,
                                             local=128, sm_scale=D ** -0.5)

            def measure():
                ids = np.sort(np.asarray(jax.block_until_ready(kernel()).block_idx), -1)
                return ids, queued_median_ms(kernel, calls=2, reps=3, warmup=1)

            row = {"S": s, "variant": name, "device": device}
            try:
                ids, row["ms"] = run_variant(table[name], measure)
                first_ids = ids if first_ids is None else first_ids
                row["same_ids_as_first"] = float((ids == first_ids).mean())
            except Exception as e:  # noqa: BLE001 -- report and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(row), flush=True)
            append_jsonl(args.out, row)


if __name__ == "__main__":
    sys.exit(main())
