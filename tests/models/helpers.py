"""Small random Qwen2.5-VL configs and prompts shared by the model tests."""

import jax
import numpy as np

from models.qwen2_5_vl import Qwen2_5_VLConfig, VisionConfig
from models.qwen2_text import TextConfig

IMG, VID, VS, VE = 60, 61, 62, 63


def small_config(head_dim=16, layers=3):
    heads = 4
    text = TextConfig(vocab_size=64, hidden_size=heads * head_dim, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=2, rms_norm_eps=1e-6,
                      mrope_section=(head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16))
    vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=heads * head_dim,
                          fullatt_block_indexes=(1,), window_size=56, tokens_per_second=2)
    return Qwen2_5_VLConfig(text=text, vision=vision, image_token_id=IMG, video_token_id=VID,
                            vision_start_token_id=VS, vision_end_token_id=VE)


def video_prompt(cfg, frames, rng, grid_hw=(4, 8)):
    h, w = grid_hw
    grid = (frames, h, w)
    ids = [1, 2, VS] + [VID] * (frames * h * w // 4) + [VE, 3, 4]
    pixels = rng.standard_normal((frames * h * w, cfg.vision.patch_dim)).astype(np.float32)
    return dict(input_ids=np.asarray([ids]), pixel_values_videos=pixels, video_grid_thw=np.asarray([grid]),
                second_per_grid_ts=np.asarray([2.0], np.float32))


def random_decode_qkv(b=2, t=1, n=8, kh=2, d=16, s=300, seed=0):
    """Random float32 q [b, t, n, d], k / v [b, s, kh, d] and a random key-validity mask [b, s] (about 70% valid)
    for decode-shaped attention tests."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, n, d))
    k = jax.random.normal(ks[1], (b, s, kh, d))
    v = jax.random.normal(ks[2], (b, s, kh, d))
    valid = jax.random.uniform(ks[3], (b, s)) < 0.7
    return q, k, v, valid
