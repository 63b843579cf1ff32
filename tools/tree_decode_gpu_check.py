"""Why `tests/speculative/test_speculative_gpu.py::test_verification_kernel_matches_xla` fails on a GPU (one H200,
2026-11-28: the tree-verification logits with the Triton `tree_decode_attention` and with its reference differ by
up to 4.27 on a logit scale of about 3, where the same comparison on the CPU, the Triton kernel in interpret mode,
agrees to 3e-6).

The test's model is tiny and its weights scaled by 6 (so greedy continuations do not collapse), which makes its
attention scores large (up to about 140 after the softmax scale) and its softmax nearly one-hot: on the CPU, rounding
only the tree attention's q / k / v to TF32 (bf16) moves the logits by 0.04 (0.07). This script separates a kernel
error from that sensitivity, in one run on a GPU:

1. the kernel against its reference on the same q / k / v, layer by layer, inside the test's own forward (each
   layer's max |difference| and the output scale; the forward goes on with the reference's output);
2. the test's comparison as written, then under ``jax.default_matmul_precision("highest")`` (no TF32 anywhere);
3. the kernel on random inputs of the test's shapes (B = 1, T = 9, N = 4 / K = 2, D = 16, S = 102, W = 9, block at
   38) in float32 and bfloat16.

Run: ``python tools/tree_decode_gpu_check.py --out DIR`` (writes ``tree_decode_gpu_check.json``); on a CPU the kernel
runs in interpret mode (a check of the script itself).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jsonl_log import write_atomic  # noqa: E402

from pallas_kernels.tree_decode import tree_decode_attention  # noqa: E402
from tests.speculative.test_speculative_gpu import (  # noqa: E402
    model_and_prompt,
    verification_case,
    verification_logits,
)

REFERENCE = functools.partial(tree_decode_attention, implementation="reference")


def kernel(*args):
    """The kernel as the test calls it on this backend (Triton; interpret mode off a GPU)."""
    return tree_decode_attention(*args, implementation="triton",
                                 interpret=None if jax.default_backend() == "gpu" else True)


def the_case():
    """The model and the verification case of the GPU test."""
    model, inputs = model_and_prompt()
    return model, verification_case(model, inputs)


def per_layer(model, case) -> list[dict]:
    """Each layer's kernel output against the reference on the same inputs (the forward keeps the reference's)."""
    rows = []

    def record(diff, scale, score_max):
        rows.append({"layer": len(rows), "max_abs_diff": float(diff), "out_abs_max": float(scale),
                     "score_abs_max": float(score_max)})

    def both(q, k, v, prefix_valid, block_start, block_mask):
        ref = REFERENCE(q, k, v, prefix_valid, block_start, block_mask)
        got = kernel(q, k, v, prefix_valid, block_start, block_mask)
        kk = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
        s = jnp.einsum("btnd,bsnd->bnts", q, kk, precision="highest") * q.shape[-1] ** -0.5
        jax.debug.callback(record, jnp.max(jnp.abs(got - ref)), jnp.max(jnp.abs(ref)), jnp.max(jnp.abs(s)),
                           ordered=True)
        return ref

    verification_logits(model, case, both)
    return rows


def random_case(dtype) -> dict:
    """The kernel against its reference on random inputs of the test's shapes."""
    ks = jax.random.split(jax.random.key(0), 4)
    b, t, n, kh, d, s, w, start = 1, 9, 4, 2, 16, 102, 9, 38
    q = jax.random.normal(ks[0], (b, t, n, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, kh, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, kh, d), jnp.float32).astype(dtype)
    valid = jnp.arange(s)[None] < start
    mask = jnp.asarray(np.tril(np.random.default_rng(1).random((1, t, w)) < 0.5) | np.eye(t, w, dtype=bool)[None])
    args = (q, k, v, valid, jnp.asarray(start, jnp.int32), mask)
    ref, got = REFERENCE(*args), kernel(*args)
    row = {"dtype": jnp.dtype(dtype).name,
           "max_abs_diff": float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32)))),
           "out_abs_max": float(jnp.max(jnp.abs(ref.astype(jnp.float32))))}
    print(f"random inputs, {row['dtype']}: max |diff| {row['max_abs_diff']:.3g} (output up to "
          f"{row['out_abs_max']:.3g})", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__}
    model, case = the_case()
    result["per_layer"] = per_layer(model, case)
    for row in result["per_layer"]:
        print(f"layer {row['layer']}: kernel vs reference max |diff| {row['max_abs_diff']:.3g} (output up to "
              f"{row['out_abs_max']:.3g}, scores up to {row['score_abs_max']:.3g})", flush=True)
    as_written = verification_logits(model, case, kernel) - verification_logits(model, case, REFERENCE)
    result["test_as_written_max_abs_diff"] = float(np.abs(as_written).max())
    with jax.default_matmul_precision("highest"):
        model, case = the_case()
        highest = verification_logits(model, case, kernel) - verification_logits(model, case, REFERENCE)
    result["test_highest_precision_max_abs_diff"] = float(np.abs(highest).max())
    print(f"the test's logits, kernel vs reference: max |diff| {result['test_as_written_max_abs_diff']:.3g} as "
          f"written, {result['test_highest_precision_max_abs_diff']:.3g} with matmul precision 'highest' "
          "(the test allows 2e-3)", flush=True)
    result["random"] = [random_case(dt) for dt in (jnp.float32, jnp.bfloat16)]
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "tree_decode_gpu_check.json"), lambda f: json.dump(result, f, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
