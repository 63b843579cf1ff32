"""`mmjax.video_upload` on one device: piece counts, pieces encoded one by one equal the whole video, and
`mmjax.prefill` gives the same logits whether the video streams in pieces or not (mesh cases:
tests/parallel/sharded_cases.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax import video_upload
from models.qwen2_5_vl import Qwen2_5_VL
from models.qwen2_5_vl import model as qwen_vl
from tests.models.helpers import small_config, video_prompt


@pytest.fixture(scope="module")
def model():
    return Qwen2_5_VL(small_config(layers=2), key=jax.random.key(3))


@pytest.mark.parametrize("t, devices, chunk, pieces, want", [
    (4096, 1, 16, 8, 8), (4096, 2, 16, 8, 8), (4096, 2, 512, 8, 4), (10, 2, 512, 8, 1), (12, 1, None, 8, 6),
    (7, 1, None, 8, 7), (5, 4, None, 8, 1), (12, 2, 2, 8, 3), (12, 1, None, 1, 1)])
def test_piece_count(t, devices, chunk, pieces, want):
    assert video_upload.piece_count(t, devices, chunk, pieces) == want


def test_piece_count_rejects_no_pieces():
    with pytest.raises(ValueError, match="pieces: expected an int >= 1"):
        video_upload.piece_count(8, 1, None, 0)


@pytest.mark.parametrize("pieces", [2, 3, 8])
def test_pieces_equal_the_whole_video(model, pieces):
    grid = (6, 4, 8)
    pixels = np.random.default_rng(0).standard_normal((6 * 32, model.config.vision.patch_dim)).astype(np.float32)
    whole = qwen_vl.vision_features(model, jnp.asarray(pixels), (grid,), 1)
    out = video_upload.video_features(model, pixels, grid, frames_per_chunk=1, pieces=pieces)
    assert out.shape == whole.shape
    np.testing.assert_allclose(np.asarray(out), np.asarray(whole), atol=2e-6)


def test_bad_pixels_are_named(model):
    with pytest.raises(ValueError, match=r"pixels: expected shape \[192, patch_dim\]"):
        video_upload.video_features(model, np.zeros((10, model.config.vision.patch_dim), np.float32), (6, 4, 8))


def test_prefill_streams_the_video_with_the_same_logits(model):
    inputs = video_prompt(model.config, frames=6, rng=np.random.default_rng(1))
    from mmjax.inference import runner
    p = runner(model).prepare_inputs(model.config, **{k: inputs[k] for k in mmjax.inference.PROCESSOR_KEYS
                                                      if k in inputs})
    assert video_upload.streams(model, p)
    streamed = mmjax.prefill(model, inputs, frames_per_chunk=1)  # 6 pieces of one temporal patch
    on_device = dict(inputs, pixel_values_videos=jnp.asarray(inputs["pixel_values_videos"]))  # not streamed
    p_dev = runner(model).prepare_inputs(model.config, **{k: on_device[k] for k in mmjax.inference.PROCESSOR_KEYS
                                                          if k in on_device})
    assert not video_upload.streams(model, p_dev)
    plain = mmjax.prefill(model, on_device, frames_per_chunk=1)
    np.testing.assert_allclose(np.asarray(streamed.logits), np.asarray(plain.logits), atol=2e-5)
