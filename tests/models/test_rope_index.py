"""Multimodal RoPE ids on hand-checked examples (HF golden ids are compared in test_qwen2_5_vl_golden)."""

import numpy as np
import pytest

from models.qwen2_5_vl.rope_index import get_rope_index

KW = dict(image_token_id=8, video_token_id=9, spatial_merge_size=2, tokens_per_second=2)


def test_video_temporal_ids_scaled_and_text_continues():
    # 2 text, video grid (3, 4, 4) -> 3 x 2 x 2 tokens, 1 text
    ids = np.array([[1, 2] + [9] * 12 + [3]])
    pos, delta = get_rope_index(ids, video_grid_thw=[[3, 4, 4]], second_per_grid_ts=[1.25], **KW)
    # interval = 2 tokens/s * 1.25 s = 2.5 -> temporal ids trunc([0, 2.5, 5]) = [0, 2, 5], offset 2
    t_ids = pos[0, 0, 2:14].reshape(3, 4)[:, 0]
    np.testing.assert_array_equal(t_ids, [2, 4, 7])
    np.testing.assert_array_equal(pos[1, 0, 2:14], np.tile([2, 2, 3, 3], 3))
    np.testing.assert_array_equal(pos[2, 0, 2:14], np.tile([2, 3, 2, 3], 3))
    np.testing.assert_array_equal(pos[:, 0, :2], [[0, 1]] * 3)
    # text after the span starts at start + max(h, w) / merge = 2 + 2
    np.testing.assert_array_equal(pos[:, 0, 14], [4, 4, 4])
    assert delta.tolist() == [7 + 1 - 15]  # the largest id is the last temporal id, 7
    legacy, ldelta = get_rope_index(ids, video_grid_thw=[[3, 4, 4]], second_per_grid_ts=[1.25],
                                    legacy_text_offset=True, **KW)
    np.testing.assert_array_equal(legacy[:, 0, :14], pos[:, 0, :14])
    np.testing.assert_array_equal(legacy[:, 0, 14], [8, 8, 8])  # transformers 4.x: max id + 1
    assert ldelta.tolist() == [8 + 1 - 15]


def test_image_then_text_with_left_padding():
    ids = np.array([[0, 0, 5] + [8] * 6 + [6, 7]])
    mask = np.array([[0, 0] + [1] * 9])
    pos, delta = get_rope_index(ids, image_grid_thw=[[1, 4, 6]], attention_mask=mask, **KW)
    np.testing.assert_array_equal(pos[:, 0, :2], 0)
    np.testing.assert_array_equal(pos[0, 0, 3:9], [1] * 6)
    np.testing.assert_array_equal(pos[1, 0, 3:9], [1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(pos[2, 0, 3:9], [1, 2, 3, 1, 2, 3])
    np.testing.assert_array_equal(pos[:, 0, 9], [4, 4, 4])  # 1 + max(2, 3)
    assert delta.tolist() == [6 - 9]


def test_text_only_is_arange():
    pos, delta = get_rope_index(np.array([[1, 2, 3]]), attention_mask=np.array([[0, 1, 1]]), **KW)
    np.testing.assert_array_equal(pos[:, 0], [[0, 1, 2]] * 3)
    assert delta.tolist() == [1]


def test_grid_mismatch_raises():
    with pytest.raises(ValueError, match="grid"):
        get_rope_index(np.array([[9] * 5]), video_grid_thw=[[1, 4, 4]], **KW)
    with pytest.raises(ValueError, match="video_grid_thw"):
        get_rope_index(np.array([[9] * 4, [9] * 4]), video_grid_thw=[[1, 4, 4]], **KW)
