import os

import jax.numpy as jnp
import numpy as np
import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
CASES = ("vl_nested", "vl_flat_tied")
INPUT_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
              "video_grid_thw", "second_per_grid_ts")


def load_case(case):
    d = dict(np.load(os.path.join(FIXTURES, f"{case}.npz")))
    inputs = {k: d[k] for k in INPUT_KEYS}
    inputs["pixel_values"] = inputs["pixel_values"].astype(np.float32)
    inputs["pixel_values_videos"] = inputs["pixel_values_videos"].astype(np.float32)
    return inputs, d


def first_row_inputs(inputs, d):
    """Row 0 alone, unpadded, with its own (first) image and video, as in the golden generate call."""
    n = int(d["generate_row0_prompt_len"])
    n_i = int(np.prod(inputs["image_grid_thw"][0]))
    n_v = int(np.prod(inputs["video_grid_thw"][0]))
    return dict(input_ids=inputs["input_ids"][:1, -n:], pixel_values=inputs["pixel_values"][:n_i],
                image_grid_thw=inputs["image_grid_thw"][:1], pixel_values_videos=inputs["pixel_values_videos"][:n_v],
                video_grid_thw=inputs["video_grid_thw"][:1], second_per_grid_ts=inputs["second_per_grid_ts"][:1])


_MODELS = {}


def get_model(case, dtype=jnp.float32):
    from models.qwen2_5_vl import from_hf
    key = (case, jnp.dtype(dtype).name)
    if key not in _MODELS:
        _MODELS[key] = from_hf(os.path.join(FIXTURES, case), dtype=dtype)
    return _MODELS[key]


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    """fp32 parity needs full-precision matmuls (GPUs default to TF32); scoped to these tests."""
    import jax
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(params=CASES)
def case(request):
    return request.param
