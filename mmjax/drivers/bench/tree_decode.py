"""Tree-verification attention at long context (GPU): the split-K kernel against XLA and cuDNN.

One layer of 7B shape (N=28, K=4, D=128, bf16, B=1): T tree queries at the end of an S-slot
cache (prefix = the first S - 256 slots, block = T slots at S - 256 with a causal tree mask).
Variants: `pallas_kernels.tree_decode` (Triton split-K: the default launch and a small sweep of
block_k / block_r / num_splits / warps / stages at long context), its pure-JAX reference (one
softmax over the prefix with a [B, S] mask and the tree block with a [B, T, W] mask),
``models.attention.dense_attention`` with a per-query mask [B, T, S], and cuDNN on the prefix
only (no block part: a lower bound for cuDNN). Prints ms per call, speedups and max |diff| vs
the reference; writes JSON to ``--out``.

bench/results/tree_decode_NVIDIA-H200_2026-11-22.json was taken with the earlier default of two
programs per SM; its "num_splits" halves are the current default (one per SM). The per-query
mask variant was measured as `verify_attention_NVIDIA-H200_2026-11-21.json` before this
benchmark absorbed it.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from mmjax.drivers.args import ArgumentParser, add_result_args, positive_float, positive_int
from mmjax.drivers.bench.report import print_table, write_result
from mmjax.timing import device_name, time_fn
from models.attention import dense_attention
from pallas_kernels.platform import num_cores
from pallas_kernels.tiling import cdiv
from pallas_kernels.tree_decode import tree_decode_attention
from pallas_kernels.tree_decode import triton as td_triton


def _sweep(t, s_len, g=7, kh=4):
    """Launch variants tried at long context (the default first)."""
    rows = g * t
    br = td_triton.default_block_r(rows)
    splits = td_triton.default_num_splits(1, kh, cdiv(rows, br), s_len // 64, num_cores())
    out = [dict()]
    if s_len < 4096:
        return out + [dict(num_splits=max(1, splits // 2)), dict(block_k=128)]
    out += [dict(block_k=128), dict(num_warps=8), dict(num_stages=4), dict(num_stages=2),
            dict(num_splits=max(1, splits // 2)), dict(num_splits=2 * splits),
            dict(block_k=128, num_warps=8)]
    if br > 64:
        out.append(dict(block_r=64))
    return out


def _variants(prefix, start, tm, s_len, t):
    """name -> jitted f(q, k, v) for the non-kernel variants."""
    st = jnp.asarray(start, jnp.int32)
    full = jnp.zeros((1, t, s_len), bool).at[:, :, :start].set(True)
    full = jax.lax.dynamic_update_slice_in_dim(full, tm, start, axis=2)
    qpos = start + jnp.arange(t, dtype=jnp.int32)[None]
    return {
        "xla": jax.jit(lambda q, k, v: tree_decode_attention(q, k, v, prefix, st, tm, implementation="reference")),
        "dense_mask": jax.jit(lambda q, k, v: dense_attention(q, k, v, q_positions=qpos, kv_valid=full)),
        "cudnn_prefix_only": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=jnp.asarray([start], jnp.int32), implementation="cudnn")),
    }


def run(seq_lens, tree_sizes, sweep_budget_s: float) -> list[dict]:
    t_start = time.time()
    rows = []
    for s_len in seq_lens:
        for t in tree_sizes:
            kq, kk, kv = jax.random.split(jax.random.key(0), 3)
            q = jax.random.normal(kq, (1, t, 28, 128), jnp.bfloat16)
            k = jax.random.normal(kk, (1, s_len, 4, 128), jnp.bfloat16)
            v = jax.random.normal(kv, (1, s_len, 4, 128), jnp.bfloat16)
            start = s_len - 256
            tm = jnp.tril(jnp.ones((t, t), bool))[None]
            prefix = jnp.arange(s_len)[None] < start
            st = jnp.asarray(start, jnp.int32)
            variants = _variants(prefix, start, tm, s_len, t)
            ref = variants["xla"](q, k, v).astype(jnp.float32)
            row = {"S": s_len, "T": t}
            for name, f in variants.items():
                try:
                    row[name + "_ms"] = time_fn(lambda: f(q, k, v), reps=10)["ms"]
                    if name == "dense_mask":
                        row["dense_mask_max_diff"] = float(jnp.max(jnp.abs(f(q, k, v).astype(jnp.float32) - ref)))
                except Exception as e:  # noqa: BLE001 - report (e.g. cuDNN unsupported) and go on
                    row[name + "_error"] = str(e)[:200]
            sweep = []
            for cfg in _sweep(t, s_len):
                if sweep and time.time() - t_start > sweep_budget_s:
                    break
                f = jax.jit(lambda q, k, v, cfg=cfg: tree_decode_attention(
                    q, k, v, prefix, st, tm, implementation="triton", **cfg))
                try:
                    diff = float(jnp.max(jnp.abs(f(q, k, v).astype(jnp.float32) - ref)))
                    ms = time_fn(lambda: f(q, k, v), reps=10)["ms"]
                    sweep.append({"config": cfg, "ms": ms, "max_diff": diff})
                except Exception as e:  # noqa: BLE001 - a launch variant may not fit; keep sweeping
                    sweep.append({"config": cfg, "error": str(e)[:300]})
                print(s_len, t, sweep[-1], file=sys.stderr, flush=True)
            ok = [x for x in sweep if "ms" in x]
            if ok:
                row["kernel_ms"], row["max_diff"] = ok[0]["ms"], ok[0]["max_diff"]
                best = min(ok, key=lambda x: x["ms"])
                row["best_ms"], row["best_config"], row["best_max_diff"] = best["ms"], str(best["config"]), best["max_diff"]
                for key in ("xla", "dense_mask", "cudnn_prefix_only"):
                    if key + "_ms" in row:
                        row["speedup_vs_" + key] = row[key + "_ms"] / row["kernel_ms"]
            row["sweep"] = sweep
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="mmjax bench tree_decode", description=__doc__.split("\n\n")[0])
    add_result_args(p, "tree_decode")
    p.add_argument("--seq-lens", type=positive_int, nargs="+", default=[1024, 26112], help="cache slots S")
    p.add_argument("--tree-sizes", type=positive_int, nargs="+", default=[1, 31, 49], help="tree queries T")
    p.add_argument("--sweep-budget-s", type=positive_float, default=150.0, help="wall time for the launch sweeps")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        p.error("needs a GPU (the split-K kernel and cuDNN are timed)")
    rows = run(args.seq_lens, args.tree_sizes, args.sweep_budget_s)
    table = print_table(rows, [
        ("S", "S", "d"), ("T", "T", "d"), ("kernel_ms", "kernel ms", ".4f"), ("xla_ms", "XLA ms", ".4f"),
        ("dense_mask_ms", "per-query mask ms", ".4f"), ("cudnn_prefix_only_ms", "cuDNN prefix ms", ".4f"),
        ("speedup_vs_xla", "x XLA", ".1f"), ("speedup_vs_cudnn_prefix_only", "x cuDNN", ".1f"),
        ("max_diff", "max diff", ".2e"), ("best_ms", "best ms", ".4f"), ("best_config", "best config", "s")])
    print("wrote", write_result(args.out, args.name, {"rows": rows, "table": table, "device": device_name(),
                                                          "num_cores": num_cores()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
