"""XLA's plan for `mmjax.sparse.attend`'s merges, on any machine (CPU included), compiled and not run: each part's
kernel is replaced by an opaque whole result (an optimization barrier over values made from q, k and the part, and
with ``--merge-in-launch`` from the result so far, which the kernel then merges in), so what is left is the merging.
Prints, for QBoundary / TwoDBoundary (Grid(frame) on the video) over a prompt, the video and a question, and for
Grid(frame) and Grid on the video alone, how many fusions write a whole output ``[B, T, N, D]`` (each kernel's
stand-in is one) and XLA's temp bytes. Run it on two trees (e.g. main and a branch), or with and without
``--merge-in-launch``, to compare their merge structure:

    PYTHONPATH=. python3 tools/attend_merge_plan.py --tokens 8192 --heads 8
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np

import mmjax.sparse.layouts as layouts
from mmjax.sparse.modality import Modality
from mmjax.sparse.patterns import AShape, Grid, QBoundary, TwoDBoundary
from pallas_kernels.block_sparse.merge import merge_onto
from pallas_kernels.block_sparse.mosaic_gpu import prior_in_launch


def opaque_part(q, k, v, part, prior=None, row_mask=None, **_):
    """A whole result that XLA cannot fuse into its consumers (what a kernel's output is); with ``prior`` (out, lse)
    and ``row_mask`` made from them too, in the same fusion (a kernel that merges them in before its store)."""
    c = part.kv_block_count.astype(jnp.float32).sum()
    out = q * (1.0 + c) + k[:, :1].mean()
    lse = jnp.einsum("btnd->bnt", q.astype(jnp.float32)) + c
    if row_mask is not None:
        out, lse = out * row_mask[:, :, None, None], jnp.where(row_mask[:, None], lse, -jnp.inf)
    if prior is not None:
        out, lse = out + prior[0], jnp.maximum(lse, prior[1])
    return jax.lax.optimization_barrier((out.astype(q.dtype), lse))


def opaque_parts(q, k, v, parts, prior=None, row_mask=None, merge_in_launch=False, **_):
    """`block_sparse_attention_parts` with each part's kernel `opaque_part`: merged onto the prior in one pass on the
    mask's rows, or with ``merge_in_launch`` the parts that can take it in their launch last, each stand-in made
    from the result so far (and the mask) too (the merge inside the kernel: no pass of its own)."""
    late = [merge_in_launch and prior_in_launch(q, p) for p in parts]
    result = merge_onto(prior, [opaque_part(q, k, v, p) for p, x in zip(parts, late) if not x], row_mask)
    for p, x in zip(parts, late):
        if x:
            result = opaque_part(q, k, v, p, prior=result, row_mask=row_mask)
    return result


def opaque_rows(q, k, v, part, **_):
    rows = part.range_rows()
    r = rows.shape[-1]
    return (rows,) + jax.lax.optimization_barrier((q[:, :r] * 2, jnp.zeros((q.shape[0], q.shape[2], r), jnp.float32)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--text", type=int, default=1000, help="prompt tokens before the video")
    p.add_argument("--question", type=int, default=64, help="text tokens after the video")
    p.add_argument("--merge-in-launch", action="store_true", help="KernelOptions(merge_in_launch=True)")
    a = p.parse_args()
    s, n, d = a.tokens, a.heads, 128
    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, s, n, d)), jnp.bfloat16)
    k = jnp.asarray(np.random.default_rng(1).normal(size=(1, s, max(1, n // 4), d)), jnp.bfloat16)
    kinds = np.ones((1, s), np.int32)
    kinds[0, :a.text], kinds[0, s - a.question:] = 0, 0
    m = Modality.from_token_types(kinds, names=("text", "video"), frame_tokens=256)
    layouts.block_sparse_attention_parts = opaque_parts
    layouts.block_sparse_attention_rows = opaque_rows
    options = layouts.KernelOptions(merge_in_launch=a.merge_in_launch)
    whole = re.compile(rf"= bf16\[1,{s},{n},{d}\][^ ]* fusion\(")
    video = Modality.from_token_types(np.ones((1, s), np.int32), names=("text", "video"), frame_tokens=256)
    for name, w, mod in (
            ("QBoundary", QBoundary({"video": Grid(stride="frame")}, default=AShape(sink=128, local=1024)), m),
            ("TwoDBoundary", TwoDBoundary({("video", "video"): Grid(stride="frame")},
                                          default=AShape(sink=128, local=1024)), m),
            ("Grid(frame) alone", Grid(stride=256, last_q=64), video), ("Grid alone", Grid(last_q=64), video)):
        layout = w.build_layout(q, k, modality=mod)
        compiled = jax.jit(lambda q, k, v, lay: layouts.attend(q, k, v, lay, options)).lower(q, k, k, layout).compile()
        fusions = sum(1 for line in compiled.as_text().splitlines() if whole.search(line))
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        print(f"{name}: {fusions} fusions write a whole output; temp {temp:.1f} MiB (q {q.nbytes / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
