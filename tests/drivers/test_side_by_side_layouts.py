"""tools/minference_side_by_side.py's `layout_by_head`: the Vertical-Slash layouts it times, built a head at a time
with the lists cut to the longest one, name the same pairs as the one-call build."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
from minference_side_by_side import layout_by_head  # noqa: E402

from mmjax.sparse.patterns import VerticalSlash  # noqa: E402
from mmjax.sparse.synthetic import video_qkv  # noqa: E402


@pytest.mark.parametrize("windows,bk", [(True, 32), pytest.param(False, 64, marks=pytest.mark.slow)])
def test_layout_by_head_equals_the_one_call_build(windows, bk):
    s = 4096
    q, k, _ = video_qkv(jax.random.key(3), s, heads=3, kv_heads=3, head_dim=32, dtype=jnp.float32)
    cols, offs, score = VerticalSlash(vertical_size=40, slash_size=120, last_q=64).estimate(q, k)
    pattern = VerticalSlash(vertical_size=40, slash_size=120, last_q=64, max_blocks=2 * (s // bk) + 120,
                            windows=windows, block_q=64, block_k=bk)
    full = pattern.layout_from_index(cols, offs, score, s, s)
    part = layout_by_head(pattern, cols, offs, score, s)
    m = part.kv_blocks.shape[-1]
    assert m < full.kv_blocks.shape[-1]  # cut to the longest list
    np.testing.assert_array_equal(part.kv_block_count, full.kv_block_count)
    listed = np.arange(m) < np.asarray(part.kv_block_count)[..., None]
    np.testing.assert_array_equal(np.where(listed, part.kv_blocks, 0), np.where(listed, full.kv_blocks[..., :m], 0))
    np.testing.assert_array_equal(part.kv_column_count, full.kv_column_count)
    c = part.kv_columns.shape[-1]
    used = np.arange(c) < np.asarray(part.kv_column_count)[..., None]
    np.testing.assert_array_equal(np.where(used, part.kv_columns, 0), np.where(used, full.kv_columns[..., :c], 0))
    np.testing.assert_allclose(np.asarray(part.density()), np.asarray(full.density()))
