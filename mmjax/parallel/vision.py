"""The vision towers split by frames over every device of a mesh (``jax.shard_map``): Qwen2.5-VL's (below)
and LLaVA-OneVision's (SigLIP encodes every video frame alone, `llava_video_features`).

The tower never attends across a temporal patch (full-attention blocks stay inside one, window blocks
inside a window of one), so a video's temporal patches split into equal runs, one per device, encode
independently with the replicated tower weights; the result equals the single-device encoding. The
temporal patches are padded with zero frames to a multiple of the device count (their features are
dropped). Images (one temporal patch each) are encoded whole on every device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models.llava_onevision import model as llava_ov
from models.qwen2_5_vl import model as qwen_vl
from models.qwen2_5_vl.vision import XLA_OPTIONS, encode_grid
from pallas_kernels.tiling import round_up


@functools.partial(jax.jit, static_argnames=("grids", "frames_per_chunk", "mesh"), compiler_options=XLA_OPTIONS)
def video_features(model: qwen_vl.Qwen2_5_VL, pixels: jax.Array, grids: tuple, frames_per_chunk: int | None,
                   mesh: Mesh) -> jax.Array:
    """Merged features [sum(t*h*w) / m**2, H] of packed videos (pixels [sum(t*h*w), patch_dim]; grids: static
    (t, h, w) each), each video's temporal patches split over all devices of ``mesh``."""
    axes = tuple(mesh.axis_names)
    n_dev = mesh.devices.size
    c = model.config.vision
    outs, start = [], 0
    for t, h, w in grids:
        n = h * w
        x = pixels[start:start + t * n].reshape(t, n, c.patch_dim)
        start += t * n
        t_pad = round_up(t, n_dev)
        x = jnp.pad(x, ((0, t_pad - t), (0, 0), (0, 0)))
        local = t_pad // n_dev

        def encode(visual, xs, h=h, w=w, local=local):
            feats = encode_grid(visual, xs.reshape(local * xs.shape[1], c.patch_dim), (local, h, w),
                                frames_per_chunk=frames_per_chunk)
            return feats.reshape(local, -1, feats.shape[-1])

        f = jax.shard_map(encode, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P(axes), check_vma=False)(
            model.visual, x)
        outs.append(f[:t].reshape(-1, f.shape[-1]))
    return jnp.concatenate(outs, axis=0)


@functools.partial(jax.jit, static_argnames=("frames_per_chunk", "mesh"))
def llava_video_features(model: llava_ov.LlavaOnevision, videos: jax.Array, frames_per_chunk: int | None,
                         mesh: Mesh) -> jax.Array:
    """LLaVA-OneVision's `llava_ov.video_features` (videos [n, F, 3, S, S] -> [n * (F * side**2 + 1), H]) with
    all n * F frames split over every device of ``mesh`` (SigLIP encodes each frame alone, so the result
    equals one device's); frames padded with zeros to a multiple of the device count (their features dropped)."""
    axes = tuple(mesh.axis_names)
    n, f = videos.shape[:2]
    frames = videos.reshape((n * f,) + videos.shape[2:])
    frames = jnp.pad(frames, ((0, -(n * f) % mesh.devices.size),) + ((0, 0),) * (frames.ndim - 1))
    grid = model.config.vision.grid

    def encode(vision, xs):
        return llava_ov.pooled_frames(vision, xs, grid, frames_per_chunk)

    x = jax.shard_map(encode, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P(axes), check_vma=False)(
        model.vision, frames)
    return llava_ov.with_newlines(model, x[:n * f].reshape(n, -1, x.shape[-1]))


def visual_inputs(model, p, frames_per_chunk: int | None, mesh: Mesh):
    """(image features or None, video features or None), each [n_tokens, H]: the port's ``visual_inputs``
    (Qwen2.5-VL or LLaVA-OneVision) with the videos split by frames over ``mesh``."""
    if isinstance(model, llava_ov.LlavaOnevision):
        img = (llava_ov.image_features(model, p.pixel_values, p.image_layouts, frames_per_chunk)
               if p.image_layouts else None)
        vid = (llava_video_features(model, p.pixel_values_videos, frames_per_chunk, mesh)
               if p.pixel_values_videos is not None else None)
        return img, vid
    img = (qwen_vl.vision_features(model, p.pixel_values, p.image_grids, frames_per_chunk)
           if p.image_grids else None)
    vid = (video_features(model, p.pixel_values_videos, p.video_grids, frames_per_chunk, mesh)
           if p.video_grids else None)
    return img, vid
