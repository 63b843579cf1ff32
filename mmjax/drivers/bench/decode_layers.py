"""Decode-step layer loop variants (GPU): layers under lax.scan vs unrolled.

Qwen2.5-VL-7B shape, random bf16 weights, batch 1, one token against an S-slot cache. Variants:
``scan`` (layers under lax.scan over stacked weights, the default for a uniform attention) and
``unrolled`` (a Python loop over layers with static weight slices: the path a per-layer attention
takes). Prints ms per step and writes JSON to ``--out``.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from mmjax.drivers.args import ArgumentParser, add_result_args, positive_int
from mmjax.drivers.bench.report import print_table, write_result
from mmjax.timing import device_name, time_fn
from models.attention import LayerAttention, dense_attention, resolve_attention
from models.kv_cache import KVCache
from models.qwen2_5_vl import model as qwen_vl
from models.qwen2_5_vl.config import preset


def _unrolled(layer):
    return dense_attention


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="mmjax bench decode_layers", description=__doc__.split("\n\n")[0])
    add_result_args(p, "decode_layers")
    p.add_argument("--seq-lens", type=positive_int, nargs="+", default=[1024, 26112], help="cache slots S")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        p.error("needs a GPU (a 7B-shaped model is timed)")
    cfg = preset("7b")
    model = qwen_vl.Qwen2_5_VL(cfg, dtype=jnp.bfloat16, key=jax.random.key(0))
    c = cfg.text
    variants = {"scan": resolve_attention("dense"), "unrolled": LayerAttention(per_layer=_unrolled)}
    rows = []
    for s_len in args.seq_lens:
        shape = (c.num_hidden_layers, 1, s_len, c.num_key_value_heads, c.head_dim)
        prompt = s_len - 256
        row = {"S": s_len}
        for name, attn in variants.items():
            k = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
            cache = KVCache(k, jnp.copy(k), jnp.arange(s_len)[None] < prompt, jnp.asarray(prompt, jnp.int32),
                            jnp.asarray([prompt], jnp.int32))
            holder = {"c": cache}
            tok = jnp.asarray([5], jnp.int32)

            def step():
                logits, new = qwen_vl.decode_step(model, holder["c"], tok, attn)
                holder["c"] = KVCache(new.k, new.v, new.valid, jnp.asarray(prompt, jnp.int32),
                                      jnp.asarray([prompt], jnp.int32))
                return logits

            row[name + "_ms"] = time_fn(step, reps=10)["ms"]
            del cache, holder, k
        row["unrolled_speedup"] = row["scan_ms"] / row["unrolled_ms"]
        rows.append(row)
        print(row, flush=True)
    table = print_table(rows, [("S", "S", "d"), ("scan_ms", "scan ms", ".3f"), ("unrolled_ms", "unrolled ms", ".3f"),
                               ("unrolled_speedup", "scan / unrolled", ".2f")])
    print("wrote", write_result(args.out, args.name, {"rows": rows, "table": table, "device": device_name(),
                                                       "model_shape": "qwen2.5-vl-7b"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
