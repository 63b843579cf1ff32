"""bf16 vs fp8 (e4m3) matmuls at the prefill's shapes, as XLA compiles them on this GPU.

For each (M, K, N) it times ``x [M, K] @ w [K, N]``:

* ``bf16``: the model's einsum (bf16 in, bf16 out);
* ``fp8_gemm``: the product of inputs already in float8_e4m3fn (bf16 out), the GEMM alone;
* ``fp8_rowscale``: what a layer would run: x quantized per row (absolute maximum / 448), the fp8 GEMM, then the
  row and the per-column weight scales applied to the bf16 result (weights quantized once, outside the timing);
* ``fp8_rowscale_nt``: the same with the weight stored transposed ``[N, K]`` (cuBLASLt's fp8 GEMM wants both operands
  K-minor).

It records whether the optimized HLO holds an fp8 cuBLAS(Lt) call or a Triton GEMM, and the error of each form against
the float32 product of the bf16 inputs (relative Frobenius norm). One JSON line per shape and form.

  PYTHONPATH=.:tools python3 tools/fp8_matmul_bench.py --out bench/results/fp8-matmul_DEVICE_DATE.jsonl
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp
from gpu_timing import median_ms
from jsonl_log import append_jsonl

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0

# Qwen2.5-VL-7B decoder (H 3584, F 18944, 28 q / 4 kv heads of 128) and vision tower (1280 wide, MLP 3420)
SHAPES = {
    "qkv": (3584, 4608), "wo": (3584, 3584), "gate_up": (3584, 2 * 18944), "down": (18944, 3584),
    "vis_qkv": (1280, 3840), "vis_up": (1280, 3424), "vis_down": (3424, 1280),
}


def quantize_rows(x):
    """x [M, K] -> (float8 [M, K], float32 scale [M, 1]) with x ~ q * scale."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (x.astype(jnp.float32) / scale).astype(FP8), scale


def forms(w_bf16):
    wq, ws = quantize_rows(w_bf16.T)  # per output column: [N, K], [N, 1]
    wq_kn = wq.T
    ws_row = ws[:, 0][None, :]

    def bf16(x):
        return jnp.dot(x, w_bf16)

    def fp8_gemm(xq):
        return jax.lax.dot_general(xq, wq_kn, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)

    def fp8_rowscale(x):
        xq, xs = quantize_rows(x)
        y = jax.lax.dot_general(xq, wq_kn, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return (y * xs * ws_row).astype(jnp.bfloat16)

    def fp8_rowscale_nt(x):
        xq, xs = quantize_rows(x)
        y = jax.lax.dot_general(xq, wq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return (y * xs * ws_row).astype(jnp.bfloat16)

    def fp8_rowscale_bf16out(x):
        xq, xs = quantize_rows(x)
        y = jax.lax.dot_general(xq, wq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
        return (y.astype(jnp.float32) * xs * ws_row).astype(jnp.bfloat16)

    return {"bf16": bf16, "fp8_gemm": fp8_gemm, "fp8_rowscale": fp8_rowscale, "fp8_rowscale_nt": fp8_rowscale_nt,
            "fp8_rowscale_bf16out": fp8_rowscale_bf16out}


def gemm_kind(hlo: str) -> str:
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))
    fusions = "triton_gemm" if "__triton_gemm" in hlo or "kind=kCustom" in hlo and "triton" in hlo else ""
    return ",".join(calls + ([fusions] if fusions else []))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8192,32768", help="M values, comma-separated")
    p.add_argument("--shapes", default=",".join(SHAPES), help="names from SHAPES")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    dev = jax.devices()[0].device_kind
    key = jax.random.key(0)
    for m in (int(r) for r in args.rows.split(",")):
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            kx, kw = jax.random.split(jax.random.fold_in(key, m * 7 + k + n))
            x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
            w = (jax.random.normal(kw, (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
            ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
            xq, _ = quantize_rows(x)
            for form, fn in forms(w).items():
                arg = xq if form == "fp8_gemm" else x
                jf = jax.jit(fn)
                hlo = jf.lower(arg).compile().as_text()
                ms = median_ms(lambda: jf(arg), reps=args.reps)
                y = jf(arg).astype(jnp.float32)
                err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) if form != "fp8_gemm" else None
                row = {"device": dev, "m": m, "k": k, "n": n, "shape": name, "form": form, "ms": ms,
                       "tflops": 2 * m * k * n / ms / 1e9, "rel_err": err, "gemm": gemm_kind(hlo)}
                append_jsonl(args.out, row)
                print(f"{name:8s} M={m:6d} {form:22s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s err={err} "
                      f"[{row['gemm']}]", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
