"""Compile time of a boundary wrapper's layout under jit, with the `Modality` closed over as a constant (how a pure
function experiment writes it) or passed as a jit argument (how the model's prefill program gets its token types).

Any machine (compile only, shapes from `jax.ShapeDtypeStruct`; no arrays of S tokens are allocated):

    PYTHONPATH=.:tools python tools/boundary_compile_time.py --seq-len 1048576 --boundary 2d

`Grid(frame)` inside the wrapper over `pattern_parts_profile.boundary_input`'s input (``--text`` text tokens, the video,
``--question`` text tokens; 28 / 4 heads, D = 128). Prints one line per form: seconds to lower and to compile.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
from pattern_parts_profile import HEADS, KV_HEADS, D, boundary_input

from mmjax.patterns import Grid


def compile_seconds(fn, *args) -> tuple[float, float]:
    """(lower s, compile s) of ``jax.jit(fn)`` on ``args``."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--boundary", choices=("k", "q", "2d"), default="2d")
    p.add_argument("--text", type=int, default=1000)
    p.add_argument("--question", type=int, default=64)
    p.add_argument("--forms", nargs="+", choices=("closed-over", "argument"), default=["closed-over", "argument"])
    a = p.parse_args(argv)
    s = a.seq_len
    wrap, mod = boundary_input(a.boundary, a.text, s, a.question)
    pat = wrap(Grid(stride="frame"))
    q = jax.ShapeDtypeStruct((1, s, HEADS, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, s, KV_HEADS, D), jnp.bfloat16)
    forms = {"closed-over": (lambda q, k: pat.build_layout(q, k, modality=mod), (q, k)),
             "argument": (lambda q, k, m: pat.build_layout(q, k, modality=m), (q, k, mod))}
    for name in a.forms:
        fn, args = forms[name]
        lo, co = compile_seconds(fn, *args)
        print(f"{jax.devices()[0].platform} S={s} {type(pat).__name__}(Grid(frame)), modality {name}: "
              f"lower {lo:.1f} s, compile {co:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
