"""XLA's plan for `mmjax.sparse.attend`'s merges, on any machine (CPU included), compiled and not run: each part's
kernel is replaced by an opaque whole result (an optimization barrier over values made from q, k and the part), so
what is left is the merging. Prints, for QBoundary / TwoDBoundary (Grid(frame) on the video) over a prompt, the video
and a question, how many fusions write a whole output ``[B, T, N, D]`` and XLA's temp bytes. Run it on two trees
(e.g. main and a branch) to compare their merge structure:

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


def opaque_part(q, k, v, part, **_):
    """A whole result that XLA cannot fuse into its consumers (what a kernel's output is)."""
    c = part.kv_block_count.astype(jnp.float32).sum()
    out = (q * (1.0 + c) + k[:, :1].mean()).astype(q.dtype)
    return jax.lax.optimization_barrier((out, jnp.einsum("btnd->bnt", q.astype(jnp.float32)) + c))


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
    a = p.parse_args()
    s, n, d = a.tokens, a.heads, 128
    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, s, n, d)), jnp.bfloat16)
    k = jnp.asarray(np.random.default_rng(1).normal(size=(1, s, max(1, n // 4), d)), jnp.bfloat16)
    kinds = np.ones((1, s), np.int32)
    kinds[0, :a.text], kinds[0, s - a.question:] = 0, 0
    m = Modality.from_token_types(kinds, names=("text", "video"), frame_tokens=256)
    layouts.block_sparse_attention = opaque_part
    layouts.block_sparse_attention_rows = opaque_rows
    whole = re.compile(rf"= bf16\[1,{s},{n},{d}\][^ ]* fusion\(")
    for name, w in (("QBoundary", QBoundary({"video": Grid(stride="frame")}, default=AShape(sink=128, local=1024))),
                    ("TwoDBoundary", TwoDBoundary({("video", "video"): Grid(stride="frame")},
                                                  default=AShape(sink=128, local=1024)))):
        layout = w.build_layout(q, k, modality=m)
        compiled = jax.jit(layouts.attend).lower(q, k, k, layout).compile()
        fusions = sum(1 for line in compiled.as_text().splitlines() if whole.search(line))
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        print(f"{name}: {fusions} fusions write a whole output; temp {temp:.1f} MiB (q {q.nbytes / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
