"""Vision-tower geometry: patch order, window ids and padded window tiles."""

import numpy as np
import pytest

from models.qwen2_5_vl.config import VisionConfig
from models.qwen2_5_vl.vision import frame_geometry, window_layout


@pytest.mark.parametrize("h,w", [(4, 4), (6, 10), (16, 12), (18, 2)])
def test_window_tiles_partition_the_frame(h, w):
    c = VisionConfig(hidden_size=32, num_heads=2, window_size=56)  # windows of 2 x 2 merged units
    hpos, wpos, wid = frame_geometry(c, h, w)
    # processor order: 2 x 2 units row-major, patches row-major inside each unit
    assert (hpos[:4].tolist(), wpos[:4].tolist()) == ([0, 0, 1, 1], [0, 1, 0, 1])
    assert sorted(zip(hpos, wpos)) == [(i, j) for i in range(h) for j in range(w)]
    # a window is a 4 x 4 block of patches
    np.testing.assert_array_equal(wid[:, None] == wid[None, :],
                                  ((hpos // 4)[:, None] == (hpos // 4)[None, :]) &
                                  ((wpos // 4)[:, None] == (wpos // 4)[None, :]))
    gather, valid, scatter = window_layout(wid)
    assert gather.shape[1] == min(16, 4 * min(h, 4) * min(w, 4) // 4)
    np.testing.assert_array_equal(gather.reshape(-1)[scatter], np.arange(h * w))
    assert valid.sum() == h * w
    for g, v in zip(gather, valid):
        assert len(set(wid[g[v]])) == 1


def test_odd_grid_rejected():
    with pytest.raises(ValueError, match="grid_thw"):
        frame_geometry(VisionConfig(hidden_size=32, num_heads=2), 5, 4)
