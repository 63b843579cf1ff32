"""Is MOMO's gap on the mixed family at long lengths the per-frame sinks? (CPU, reference kernels.)

Usage: python3 tools/momo_sink_gap.py S OUT.json   (S = 262144 takes about 13 minutes on 2 cores)

The bench's mixed input (`mmjax bench momo`: 32 x 32 frames, 4 text segments of S / 32 tokens) at length S with the
GridVideo per-frame sinks on (the bench's default gain 9) and off (gain 0); 2 query / 1 key heads, fp32; the
bench's two query blocks at S. Per variant (default MOMO with the estimated top-k; exact top-k; exact + re-rank
c = 2 and 8, every row) the captured mass against the best shared list per query block at the same density.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.files import atomic_write
from mmjax.sparse.layouts import KernelOptions
from mmjax.sparse.metrics import block_mass, captured_mass
from mmjax.sparse.patterns.momo import Momo
from mmjax.sparse.synthetic import GridVideo, mixed_video_text_qkv


def main() -> None:
    s, out = int(sys.argv[1]), sys.argv[2]
    opts = KernelOptions(implementation="reference")
    side, text = 32, s // 32
    frames = (s - 4 * text) // (side * side)
    res = []
    for sink_gain in (9.0, 0.0):
        spec = GridVideo(frames, (side, side), sink_phase=side // 2, sink_gain=sink_gain)
        q, k, v, _ = mixed_video_text_qkv(jax.random.PRNGKey(s + 1), spec, text_tokens=text, heads=2, kv_heads=1,
                                          head_dim=128, dtype=jnp.float32)
        sk = q.shape[1]
        nq = sk // 128
        rng = np.random.default_rng(s)
        for _ in range(2):  # the bench's draws for video and needle come first
            rng.choice(np.arange((s // 128) // 2, s // 128), 2, replace=False)
        blocks = np.sort(rng.choice(np.arange(nq // 2, nq), 2, replace=False))
        rows = jnp.asarray((blocks[:, None] * 128 + np.arange(128)).ravel(), jnp.int32)
        m = jax.jit(lambda q, k: block_mass(q, k, rows, block=64))(q, k)
        variants = {"estimated (default)": Momo(), "exact": Momo(topk="exact")}  # the bench's GPU budget
        for c in (2, 8):
            variants[f"exact + re-rank {c}x"] = Momo(topk="exact", rerank=c)
        for name, p in variants.items():
            t0 = time.time()
            lay = jax.jit(lambda q, k, p=p: p.plan(q, k, k, options=opts).layout)(q, k)
            c = {n: float(np.mean(np.asarray(x))) for n, x in captured_mass(m, lay, rows).items()}
            row = dict(S=sk, sink_gain=sink_gain, method=name, blocks=blocks.tolist(), captured=c["captured"],
                       oracle_block=c["oracle_block"], gap_block_points=100 * (c["oracle_block"] - c["captured"]),
                       seconds=time.time() - t0)
            print(json.dumps(row), flush=True)
            res.append(row)
    result = dict(config=dict(S=s, heads=[2, 1], frames=frames, text_tokens=text, k_trim=128, gamma=16), rows=res)
    atomic_write(out, json.dumps(result, indent=1), overwrite=True)


if __name__ == "__main__":
    main()
