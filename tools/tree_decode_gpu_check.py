"""Why `tests/speculative/test_speculative_gpu.py::test_verification_kernel_matches_xla` failed on a GPU, and the check
that it no longer does (one H200, 2026-11-28).

The failure: the tree-verification logits with the Triton `tree_decode_attention` and with its reference were up to
4.27 apart on a logit scale of about 3, where on the CPU (the kernel in interpret mode) they agree to 3e-6. The
cause was not the tree kernel: the decode-step ``W_o`` kernel (`pallas_kernels.layer_matmul`, used for at most 16
tokens on one GPU) stored whole 128-column tiles into a partial with fewer columns (the test model's hidden size),
so each edge tile wrote into the next row, racing with that row's own program: a different wrong answer on each run
(the same program twice: 3.3-4.3 apart), on either side of the comparison. With its stores (and edge loads) masked,
kernel vs reference is 1.3e-4 (3.5e-5 at matmul precision "highest") and every run repeats bit for bit.

What the script reports, in one run:

1. the kernel against its reference on the same q / k / v, layer by layer, inside the test's own forward (each
   layer's max |difference| and the output scale), once with the forward going on with the reference's output and
   once with the kernel's (and how far the two paths' layer inputs are apart);
2. the test's comparison as written, then under ``jax.default_matmul_precision("highest")`` (no TF32 anywhere);
3. the comparison with the ``W_o`` kernel on and off, each side run twice (run-to-run differences), and the
   reference side with and without it;
4. the kernel on random inputs of the test's shapes (B = 1, T = 9, N = 4 / K = 2, D = 16, S = 102, W = 9, block at
   38) in float32 and bfloat16.

Results: ``bench/results/tree-decode-gpu-check-before-fix_NVIDIA-H200_2026-11-28.json`` and
``tree-decode-gpu-check-layer-matmul-fixed_NVIDIA-H200_2026-11-28.json``.

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

from models import text_decoder  # noqa: E402
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


def per_layer(model, case, keep: str = "reference") -> list[dict]:
    """Each layer's kernel output against the reference on the same inputs; the forward goes on with the output of
    ``keep`` ("reference" or "kernel"). Each row also holds that layer's q (a host copy, under "q") so the two paths'
    layer inputs can be compared."""
    rows = []

    def record(diff, scale, score_max, q):
        rows.append({"layer": len(rows), "max_abs_diff": float(diff), "out_abs_max": float(scale),
                     "score_abs_max": float(score_max), "q": np.asarray(q)})

    def both(q, k, v, prefix_valid, block_start, block_mask):
        ref = REFERENCE(q, k, v, prefix_valid, block_start, block_mask)
        got = kernel(q, k, v, prefix_valid, block_start, block_mask)
        kk = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
        s = jnp.einsum("btnd,bsnd->bnts", q, kk, precision="highest") * q.shape[-1] ** -0.5
        jax.debug.callback(record, jnp.max(jnp.abs(got - ref)), jnp.max(jnp.abs(ref)), jnp.max(jnp.abs(s)), q,
                           ordered=True)
        return ref if keep == "reference" else got

    verification_logits(model, case, both)
    return rows


def paths(model, case) -> dict:
    """The forward on the reference's outputs and on the kernel's: per layer, kernel vs reference on each path's
    inputs, and how far the two paths' layer inputs (q) are apart."""
    ref_path, kernel_path = per_layer(model, case, "reference"), per_layer(model, case, "kernel")
    out = {"reference_path": [], "kernel_path": []}
    for r, k in zip(ref_path, kernel_path):
        k["q_vs_reference_path"] = float(np.abs(k["q"] - r["q"]).max())
        k["q_abs_max"] = float(np.abs(r["q"]).max())
    for name, rows in (("reference_path", ref_path), ("kernel_path", kernel_path)):
        out[name] = [{key: val for key, val in row.items() if key != "q"} for row in rows]
    return out


def variants(model, case) -> dict:
    """The test's logits, kernel vs reference, with the decode-step ``W_o`` kernel (`pallas_kernels.layer_matmul`,
    used for at most `LAYER_MATMUL_MAX_ROWS` tokens on one GPU) on and off, and each path run twice (determinism);
    plus the reference path with ``W_o`` in place against without it."""
    out = {}
    runs = {}
    for wo in ("in_place", "xla"):
        keep = text_decoder.LAYER_MATMUL_MAX_ROWS
        text_decoder.LAYER_MATMUL_MAX_ROWS = keep if wo == "in_place" else 0
        try:
            # fresh partials so that the forward traces again under the changed constant
            kern = [verification_logits(model, case, functools.partial(kernel)) for _ in range(2)]
            refs = [verification_logits(model, case, functools.partial(REFERENCE)) for _ in range(2)]
        finally:
            text_decoder.LAYER_MATMUL_MAX_ROWS = keep
        runs[wo] = refs[0]
        out[wo] = {"kernel_vs_reference": float(np.abs(kern[0] - refs[0]).max()),
                   "kernel_run_to_run": float(np.abs(kern[0] - kern[1]).max()),
                   "reference_run_to_run": float(np.abs(refs[0] - refs[1]).max()),
                   "logit_abs_max": float(np.abs(refs[0]).max())}
        print(f"W_o {wo}: kernel vs reference {out[wo]['kernel_vs_reference']:.3g}; run to run: kernel "
              f"{out[wo]['kernel_run_to_run']:.3g}, reference {out[wo]['reference_run_to_run']:.3g}", flush=True)
    out["reference_in_place_vs_xla"] = float(np.abs(runs["in_place"] - runs["xla"]).max())
    print(f"reference path, W_o in place vs XLA: {out['reference_in_place_vs_xla']:.3g}", flush=True)
    return out


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
    result.update(paths(model, case))
    for name in ("reference_path", "kernel_path"):
        for row in result[name]:
            extra = (f"; q {row['q_vs_reference_path']:.3g} from the reference path's (up to {row['q_abs_max']:.3g})"
                     if "q_vs_reference_path" in row else "")
            print(f"{name}, layer {row['layer']}: kernel vs reference max |diff| {row['max_abs_diff']:.3g} (output up "
                  f"to {row['out_abs_max']:.3g}, scores up to {row['score_abs_max']:.3g}){extra}", flush=True)
    as_written = verification_logits(model, case, kernel) - verification_logits(model, case, REFERENCE)
    result["test_as_written_max_abs_diff"] = float(np.abs(as_written).max())
    with jax.default_matmul_precision("highest"):
        model, case = the_case()
        highest = verification_logits(model, case, kernel) - verification_logits(model, case, REFERENCE)
    result["test_highest_precision_max_abs_diff"] = float(np.abs(highest).max())
    print(f"the test's logits, kernel vs reference: max |diff| {result['test_as_written_max_abs_diff']:.3g} as "
          f"written, {result['test_highest_precision_max_abs_diff']:.3g} with matmul precision 'highest' "
          "(the test allows 2e-3)", flush=True)
    with jax.default_matmul_precision("highest"):
        result["variants_highest"] = variants(*the_case())
    result["variants"] = variants(*the_case())
    result["random"] = [random_case(dt) for dt in (jnp.float32, jnp.bfloat16)]
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "tree_decode_gpu_check.json"), lambda f: json.dump(result, f, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
