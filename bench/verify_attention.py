"""Attention variants for tree verification at long context (GPU): `python bench/verify_attention.py`.

One layer of 7B shape (N=28, K=4, D=128, bf16, B=1): T tree queries at the end of an S-slot cache.
Variants: dense_attention with a per-query mask [B,T,S] (causal on slots); the split form (prefix
with a [B,S] mask + tree block with a [T,T] mask, merged by log-sum-exp); cuDNN on the prefix only
(no merge, a lower bound). Prints ms per call and max |diff| vs the first variant.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mmjax.bench.timing import device_name, print_table, time_fn, write_result  # noqa: E402
from models.attention import dense_attention, tree_attention  # noqa: E402


def main():
    rows = []
    for s_len in (1024, 25600 + 512):
        for t in (1, 31, 49):
            key = jax.random.key(0)
            kq, kk, kv = jax.random.split(key, 3)
            q = jax.random.normal(kq, (1, t, 28, 128), jnp.bfloat16)
            k = jax.random.normal(kk, (1, s_len, 4, 128), jnp.bfloat16)
            v = jax.random.normal(kv, (1, s_len, 4, 128), jnp.bfloat16)
            start = s_len - 256
            tm = jnp.tril(jnp.ones((t, t), bool))[None]
            full = jnp.zeros((1, t, s_len), bool).at[:, :, :start].set(True)
            full = jax.lax.dynamic_update_slice_in_dim(full, tm, start, axis=2)
            qpos = start + jnp.arange(t, dtype=jnp.int32)[None]
            prefix = jnp.arange(s_len)[None] < start
            f_dense = jax.jit(lambda q, k, v: dense_attention(q, k, v, q_positions=qpos, kv_valid=full))
            f_split = jax.jit(lambda q, k, v: tree_attention(q, k, v, prefix, jnp.asarray(start, jnp.int32), tm))
            f_cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, key_value_seq_lengths=jnp.asarray([start], jnp.int32), implementation="cudnn"))
            ref = f_dense(q, k, v)
            row = {"S": s_len, "T": t}
            for name, f in (("dense_mask", f_dense), ("split", f_split), ("cudnn_prefix_only", f_cudnn)):
                try:
                    row[name + "_ms"] = time_fn(lambda: f(q, k, v), reps=10)["ms"]
                    if name == "split":
                        row["split_max_diff"] = float(jnp.max(jnp.abs(f(q, k, v).astype(jnp.float32) - ref.astype(jnp.float32))))
                except Exception as e:  # noqa: BLE001
                    row[name + "_error"] = str(e)[:200]
            rows.append(row)
            print(row, flush=True)
    table = print_table(rows, [("S", "S", "d"), ("T", "T", "d"), ("dense_mask_ms", "per-query mask ms", ".3f"),
                               ("split_ms", "split ms", ".3f"), ("cudnn_prefix_only_ms", "cudnn prefix ms", ".3f"),
                               ("split_max_diff", "split diff", ".2e")])
    out = os.environ.get("OUT", "bench/results")
    print("wrote", write_result(out, "verify_attention", {"rows": rows, "table": table, "device": device_name()}))


if __name__ == "__main__":
    main()
