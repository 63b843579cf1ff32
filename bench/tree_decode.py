"""Split-K tree-decode attention kernel vs XLA and cuDNN (GPU): `python bench/tree_decode.py`.

One layer of 7B shape (N=28, K=4, D=128, bf16, B=1): T tree queries at the end of an S-slot
cache (prefix = the first S - 256 slots, block = T slots at S - 256 with a causal tree mask,
as in bench/verify_attention.py). Variants: `pallas_kernels.tree_decode` (Triton split-K, the
default launch and a small sweep of block_k / block_r / num_splits / warps / stages at long
context), the XLA reference `models.attention.tree_attention`, and cuDNN on the prefix only
(no block part: a lower bound for cuDNN). Prints ms per call, speedups and max |diff| vs the
XLA reference; writes JSON to $OUT (default bench/results).

bench/results/tree_decode_NVIDIA-H200_2026-11-22.json was taken with the earlier default of
two programs per SM; its "num_splits" halves are the current default (one per SM; for T=31
16 slices vs the current 17).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mmjax.bench.timing import device_name, print_table, time_fn, write_result  # noqa: E402
from models.attention import tree_attention  # noqa: E402
from pallas_kernels.tiling import cdiv  # noqa: E402
from pallas_kernels.tree_decode import tree_decode_attention  # noqa: E402
from pallas_kernels.tree_decode import triton as td_triton  # noqa: E402
from pallas_kernels.tree_decode.api import _num_cores  # noqa: E402

SWEEP_BUDGET_S = float(os.environ.get("SWEEP_BUDGET_S", "150"))


def _sweep(t, s_len, g=7, kh=4):
    """Launch variants tried at long context (the default first)."""
    rows = g * t
    br = td_triton.default_block_r(rows)
    splits = td_triton.default_num_splits(1, kh, cdiv(rows, br), s_len // 64, _num_cores())
    out = [dict()]
    if s_len < 4096:
        return out + [dict(num_splits=max(1, splits // 2)), dict(block_k=128)]
    out += [dict(block_k=128), dict(num_warps=8), dict(num_stages=4), dict(num_stages=2),
            dict(num_splits=max(1, splits // 2)), dict(num_splits=2 * splits),
            dict(block_k=128, num_warps=8)]
    if br > 64:
        out.append(dict(block_r=64))
    return out


def main():
    t_start = time.time()
    rows = []
    for s_len in [int(x) for x in os.environ.get("TREE_DECODE_S", "1024,26112").split(",")]:
        for t in (1, 31, 49):
            kq, kk, kv = jax.random.split(jax.random.key(0), 3)
            q = jax.random.normal(kq, (1, t, 28, 128), jnp.bfloat16)
            k = jax.random.normal(kk, (1, s_len, 4, 128), jnp.bfloat16)
            v = jax.random.normal(kv, (1, s_len, 4, 128), jnp.bfloat16)
            start = s_len - 256
            tm = jnp.tril(jnp.ones((t, t), bool))[None]
            prefix = jnp.arange(s_len)[None] < start
            st = jnp.asarray(start, jnp.int32)
            f_xla = jax.jit(lambda q, k, v: tree_attention(q, k, v, prefix, st, tm))
            f_cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, key_value_seq_lengths=jnp.asarray([start], jnp.int32), implementation="cudnn"))
            ref = f_xla(q, k, v).astype(jnp.float32)
            row = {"S": s_len, "T": t}
            for name, f in (("xla", f_xla), ("cudnn_prefix_only", f_cudnn)):
                try:
                    row[name + "_ms"] = time_fn(lambda: f(q, k, v), reps=10)["ms"]
                except Exception as e:  # noqa: BLE001
                    row[name + "_error"] = str(e)[:200]
            sweep = []
            for cfg in _sweep(t, s_len):
                if sweep and time.time() - t_start > SWEEP_BUDGET_S:
                    break
                f = jax.jit(lambda q, k, v, cfg=cfg: tree_decode_attention(
                    q, k, v, prefix, st, tm, implementation="triton", **cfg))
                try:
                    diff = float(jnp.max(jnp.abs(f(q, k, v).astype(jnp.float32) - ref)))
                    ms = time_fn(lambda: f(q, k, v), reps=10)["ms"]
                    sweep.append({"config": cfg, "ms": ms, "max_diff": diff})
                except Exception as e:  # noqa: BLE001
                    sweep.append({"config": cfg, "error": str(e)[:300]})
                print(s_len, t, sweep[-1], flush=True)
            ok = [x for x in sweep if "ms" in x]
            if ok:
                row["kernel_ms"], row["max_diff"] = ok[0]["ms"], ok[0]["max_diff"]
                best = min(ok, key=lambda x: x["ms"])
                row["best_ms"], row["best_config"] = best["ms"], str(best["config"])
                row["best_max_diff"] = best["max_diff"]
                for key in ("xla", "cudnn_prefix_only"):
                    if key + "_ms" in row:
                        row["speedup_vs_" + key] = row[key + "_ms"] / row["kernel_ms"]
            try:  # the pallas_call alone (no tail/block part, no merge), default launch
                br = td_triton.default_block_r(7 * t)
                ns = td_triton.default_num_splits(1, 4, cdiv(7 * t, br), s_len // 64, _num_cores())
                f_k = jax.jit(lambda q, k, v: td_triton.partials_triton(
                    q, k, v, prefix, sm_scale=128 ** -0.5, block_k=64, block_r=br, num_splits=ns,
                    interpret=False, num_warps=None, num_stages=None))
                row["kernel_only_ms"] = time_fn(lambda: f_k(q, k, v), reps=10)["ms"]
                row["default_num_splits"], row["default_block_r"] = ns, br
            except Exception as e:  # noqa: BLE001
                row["kernel_only_error"] = str(e)[:200]
            row["sweep"] = sweep
            rows.append(row)
            print({k_: v_ for k_, v_ in row.items() if k_ != "sweep"}, flush=True)
    table = print_table(rows, [
        ("S", "S", "d"), ("T", "T", "d"), ("kernel_ms", "kernel ms", ".4f"),
        ("kernel_only_ms", "pallas_call ms", ".4f"), ("xla_ms", "XLA ms", ".4f"),
        ("cudnn_prefix_only_ms", "cuDNN prefix ms", ".4f"), ("speedup_vs_xla", "x XLA", ".1f"),
        ("speedup_vs_cudnn_prefix_only", "x cuDNN", ".1f"), ("max_diff", "max diff", ".2e"),
        ("best_ms", "best ms", ".4f"), ("best_config", "best config", "s")])
    out = os.environ.get("OUT", "bench/results")
    print("wrote", write_result(out, "tree_decode", {"rows": rows, "table": table, "device": device_name(),
                                                     "num_cores": _num_cores()}))


if __name__ == "__main__":
    main()
