"""Compile time of `mmjax.sparse.attend` on the Mosaic GPU path with the layout closed over as a constant (a layout
built once, then ``jax.jit(lambda q, k, v: attend(q, k, v, layout))``) and with the layout as a jit argument.

On any machine the kernel launches are stood in by an opaque result (an optimization barrier over values made from
every operand the kernel would read), so what compiles is the passes' preparation: gathers, inverse permutations,
item orders, list sorts. On an sm90 GPU ``--kernels real`` compiles the kernels too.

    PYTHONPATH=.:tools python3 tools/attend_compile_time.py --seq-len 131072 --patterns "Grid(frame)" Grid

`bench patterns`' video-like input (28 / 4 heads, D = 128, bf16). Prints one line per pattern and form: seconds to
lower and to compile. ``--pattern-attend`` adds the pattern's own ``attend`` with the input's frame size known
(`pattern_parts_profile.video_modality`): for Grid with searched strides both branches of `Grid.frame_first`'s
``lax.cond`` compile, timed beside ``frame_first=False``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
from boundary_compile_time import compile_seconds
from pattern_parts_profile import video_modality

from mmjax.drivers.bench.patterns import frame_grid_patterns, gpu_patterns
from mmjax.sparse import KernelOptions
from mmjax.sparse.layouts import attend
from mmjax.sparse.patterns import Grid
from mmjax.sparse.synthetic import video_qkv
from pallas_kernels.block_sparse import mosaic_gpu


def opaque_launch(q_in, k_in, v_in, blocks, count, q_pos, k_pos, *, block_q, **_):
    """A stand-in for `mosaic_kernel.launch`: out shaped as ``q_in``, lse ``[B, N, blocks * block_q]``, both depending
    on every operand the kernel reads, behind an optimization barrier (what a kernel's output is to XLA)."""
    c = blocks.sum().astype(jnp.float32) + count.sum().astype(jnp.float32)
    for pos in (q_pos, k_pos):
        if pos is not None:
            c = c + pos.sum().astype(jnp.float32)
    out = (q_in * (1.0 + c) + k_in[:, :1].mean() + v_in[:, :1].mean()).astype(q_in.dtype)
    lse = jnp.zeros((q_in.shape[0], q_in.shape[-2], count.shape[2] * block_q), jnp.float32) + c
    return jax.lax.optimization_barrier((out, lse))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--patterns", nargs="+", default=["Grid(frame)", "Grid"])
    p.add_argument("--kernels", choices=("stand-in", "real"), default="stand-in")
    p.add_argument("--pattern-attend", action="store_true",
                   help="also the pattern's own attend (estimation, layout, attention) with the frame size known")
    a = p.parse_args(argv)
    if a.kernels == "stand-in":
        mosaic_gpu.launch = opaque_launch
    s = a.seq_len
    q, k, v = video_qkv(jax.random.PRNGKey(s), s, heads=28, kv_heads=4, head_dim=128)
    pats = dict(gpu_patterns(), **frame_grid_patterns())
    opts = KernelOptions(implementation="mosaic_gpu")
    frame_mod = video_modality(s)
    for name in a.patterns:
        layout = jax.jit(lambda q, k, pat=pats[name]: pat.build_layout(q, k))(q, k)
        forms = (("layout closed-over", lambda q, k, v, lay=layout: attend(q, k, v, lay, opts), (q, k, v)),
                 ("layout argument", lambda q, k, v, lay: attend(q, k, v, lay, opts), (q, k, v, layout)))
        if a.pattern_attend:  # the pattern's own attend, the input's frame size known (Grid: `frame_first` on, off)
            pat = pats[name]
            forms += tuple((f"pattern attend, frame_first={ff}",
                            lambda q, k, v, p=dataclasses.replace(pat, frame_first=ff): p.attend(
                                q, k, v, modality=frame_mod, options=opts), (q, k, v))
                           for ff in ((True, False) if isinstance(pat, Grid) and pat.stride == "search" else (True,)))
        for form, fn, args in forms:
            lo, co = compile_seconds(fn, *args)
            print(f"{jax.devices()[0].platform} S={s} {name}, kernels {a.kernels}, {form}: lower "
                  f"{lo:.1f} s, compile {co:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
