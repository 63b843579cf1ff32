"""Grid with searched strides (`gpu_patterns()["Grid"]`) against Grid at the input's frame stride
(`frame_grid_patterns()["Grid(frame)"]`) on `tools/pattern_parts_profile.py`'s video-like input, part by part: the
row / key orders, the listed key blocks of every (head, query block), the static structure (list widths,
`q_row_stride`, `q_block_range`), and whether the searched layout's rows would meet Grid(frame)'s strided-rows
promise (`strided_rows_hold` at its stride). Where every head finds the frame stride the two layouts name the same
work, so what separates their times is the static structure. Runs on a CPU (about a minute at 32k).

    PYTHONPATH=.:tools python3 tools/grid_search_vs_frame.py --seq-len 32768
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from pattern_parts_profile import inputs

from mmjax.drivers.bench.patterns import frame_grid_patterns, gpu_patterns
from mmjax.sparse.layouts import block_parts
from pallas_kernels.block_sparse.layout import strided_rows_hold


def listed(layout) -> list[list[frozenset]]:
    """The set of listed key blocks of each (head, query block) of batch 0."""
    blocks, count = np.asarray(layout.kv_blocks), np.asarray(layout.kv_block_count)
    blocks = np.broadcast_to(blocks, count.shape + (blocks.shape[-1],))
    return [[frozenset(blocks[0, h, j, :count[0, h, j]].tolist()) for j in range(count.shape[2])]
            for h in range(count.shape[1])]


def same(a, b) -> bool | None:
    """None when both are None, else whether the arrays hold the same values (broadcast over heads)."""
    if a is None and b is None:
        return None
    return a is not None and b is not None and bool(np.all(np.asarray(a) == np.asarray(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=32768)
    s = ap.parse_args().seq_len
    q, k, _ = inputs(s)
    searched = block_parts(jax.jit(gpu_patterns()["Grid"].build_layout)(q, k))
    frame = block_parts(jax.jit(frame_grid_patterns()["Grid(frame)"].build_layout)(q, k))
    print(f"S={s}: {len(searched)} / {len(frame)} parts (searched / frame)")
    for i, (a, b) in enumerate(zip(searched, frame, strict=True)):
        print(f"part {i}: q_perm equal {same(a.q_perm, b.q_perm)}, kv_perm equal {same(a.kv_perm, b.kv_perm)} "
              f"(shapes {None if a.kv_perm is None else a.kv_perm.shape} / "
              f"{None if b.kv_perm is None else b.kv_perm.shape}), listed blocks equal {listed(a) == listed(b)} "
              f"({int(np.asarray(a.kv_block_count).sum())} / {int(np.asarray(b.kv_block_count).sum())} entries), "
              f"list width {a.max_blocks} / {b.max_blocks}, q_row_stride {a.q_row_stride} / {b.q_row_stride}, "
              f"q_block_range {a.q_block_range} / {b.q_block_range}", flush=True)
        if a.q_perm is not None and b.q_row_stride:
            holds = np.all(strided_rows_hold(a.replace(q_row_stride=b.q_row_stride), xp=np))
            print(f"  the searched part's rows meet q_row_stride={b.q_row_stride}: {bool(holds)}")


if __name__ == "__main__":
    main()
