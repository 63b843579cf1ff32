"""Compile seconds of the decoder's prefill program (Qwen2.5-VL-7B shape, random bf16 weights) with bf16 and with fp8
matmuls (`mmjax.quantize_fp8`), under several XLA options: where a slow first call comes from.

  PYTHONPATH=.:tools python3 tools/fp8_compile_time.py --tokens 262144 --out bench/results/fp8-compile_DEVICE_DATE.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jsonl_log import append_jsonl

import mmjax
from mmjax.drivers.bench.prefill import attention_spec, tiny_config, video_inputs
from models.attention import resolve_attention
from models.qwen2_5_vl import Qwen2_5_VL
from models.qwen2_5_vl import model as qwen_vl
from models.qwen2_5_vl.config import preset

OPTIONS = {"default": {}, "no_triton_gemm": {"xla_gpu_enable_triton_gemm": False},
           "autotune_0": {"xla_gpu_autotune_level": 0}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=262144)
    p.add_argument("--attention", default="ashape")
    p.add_argument("--matmuls", default="bf16,fp8")
    p.add_argument("--options", default=",".join(OPTIONS))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    cfg = preset("7b") if jax.default_backend() == "gpu" else tiny_config()  # CPU: a smoke run
    base = Qwen2_5_VL(cfg, dtype=jnp.bfloat16, key=jax.random.key(0))
    inputs = video_inputs(cfg, args.tokens, pixels=False)
    pr = qwen_vl.prepare_inputs(cfg, **inputs)
    n_feats = int((np.asarray(pr.token_types) == 2).sum())
    feats = jax.ShapeDtypeStruct((n_feats, cfg.text.hidden_size), jnp.bfloat16)
    attention = resolve_attention(attention_spec(args.attention, cfg))
    for matmul in args.matmuls.split(","):
        model = mmjax.quantize_fp8(base) if matmul == "fp8" else base
        for opt in args.options.split(","):
            t0 = time.perf_counter()
            lowered = qwen_vl.prefill_language_model.lower(
                model, pr.input_ids, None, feats, pr.position_ids, pr.attention_mask, pr.token_types, pr.rope_deltas,
                attention=attention, max_length=pr.input_ids.shape[1] + 256, mlp_chunk=16384)
            t1 = time.perf_counter()
            compiled = lowered.compile(OPTIONS[opt])
            t2 = time.perf_counter()
            hlo = compiled.as_text()
            row = {"device": jax.devices()[0].device_kind, "tokens": args.tokens, "attention": args.attention,
                   "matmul": matmul, "options": opt, "lower_s": t1 - t0, "compile_s": t2 - t1,
                   "f8_cublas_calls": hlo.count("__cublas$lt$matmul$f8"), "triton_gemm_fusions": hlo.count("__triton_gemm")}
            append_jsonl(args.out, row)
            print(row, file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
