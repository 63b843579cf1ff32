"""Vision-tower geometry (patch order, window ids, padded window tiles, window order) and its forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.qwen2_5_vl.config import VisionConfig
from models.qwen2_5_vl.vision import VisionTower, encode_grid, frame_geometry, window_layout, window_order
from models.vision_attention import attention_form


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


def _tower(dtype=jnp.float32, head_dim=16):
    c = VisionConfig(depth=2, hidden_size=2 * head_dim, intermediate_size=48, num_heads=2, out_hidden_size=24,
                     fullatt_block_indexes=(1,), window_size=56)
    return VisionTower(c, dtype=dtype, key=jax.random.key(0), init_std=0.2)


@pytest.mark.parametrize("h,w", [(4, 8), (8, 8)])
def test_window_order_once_equals_per_block_gathers(h, w):
    """Every window full: tokens put in window order once give what per-block gathers give, merged and
    pre-merge, in the processor's order."""
    tower = _tower()
    c = tower.config
    order = window_order(frame_geometry(c, h, w)[2], c.merge_unit)
    assert order is not None and sorted(order.tolist()) == list(range(h * w))
    assert not np.array_equal(order, np.arange(h * w))  # a real permutation, not the identity
    pixels = jax.random.normal(jax.random.key(1), (3 * h * w, c.patch_dim))
    for pre in (False, True):
        once = encode_grid(tower, pixels, (3, h, w), frames_per_chunk=2, return_pre_merge=pre, attention="xla")
        gathered = encode_grid(tower, pixels, (3, h, w), frames_per_chunk=2, return_pre_merge=pre,
                               attention="xla", windows="gather")
        np.testing.assert_allclose(np.asarray(once), np.asarray(gathered), rtol=1e-5, atol=1e-5)


def test_partial_windows_keep_processor_order():
    c = _tower().config
    assert window_order(frame_geometry(c, 6, 4)[2], c.merge_unit) is None  # 3 x 2 units: a 1-unit-high window


def test_attention_choice_is_checked():
    tower = _tower()
    pixels = jnp.ones((16, tower.config.patch_dim))
    assert attention_form("auto", jnp.float32, 16) == "xla"
    assert attention_form("auto", jnp.bfloat16, 20) == "xla"  # head dim not a multiple of 8
    with pytest.raises(ValueError, match="attention: expected one of"):
        encode_grid(tower, pixels, (1, 4, 4), attention="flash")
    with pytest.raises(ValueError, match="attention: 'cudnn' needs bfloat16"):
        encode_grid(tower, pixels, (1, 4, 4), attention="cudnn")
    with pytest.raises(ValueError, match="windows: expected one of"):
        encode_grid(tower, pixels, (1, 4, 4), windows="sorted")


def test_siglip_tower_attention_choice_is_checked():
    from mmjax.drivers.bench.prefill import tiny_llava_config
    from models import llava_onevision as lo
    from models.llava_onevision.vision import encode_tiles
    model = lo.LlavaOnevision(tiny_llava_config(), dtype=jnp.float32, key=jax.random.key(0))
    tiles = jnp.ones((1, 3, 70, 70))
    auto = encode_tiles(model.vision, tiles)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(encode_tiles(model.vision, tiles, attention="xla")))
    with pytest.raises(ValueError, match="attention: 'cudnn' needs bfloat16"):
        encode_tiles(model.vision, tiles, attention="cudnn")
    with pytest.raises(ValueError, match="attention: expected one of"):
        encode_tiles(model.vision, tiles, attention="sdpa")
