"""A long video's pixels go to the device(s) in pieces, each piece encoded by the vision tower as soon as it
has arrived, so the host-to-device copy of later pieces overlaps the tower's work on earlier ones
(Qwen2.5-VL videos whose pixels are still on the host).

Why: at 1M video tokens of the 7B shape the pixels are 19.7 GB of float32 (4096 temporal patches of 32 x 32
patches, 1176 values each); sent whole, the tower waits for all of them (2 x H200 profile of 2026-11-23,
``bench/results/profile-1m_NVIDIA-H200-x2_2026-11-23.log``: 2.1 s of host-to-device copies on one GPU, 2.2-2.5
s on each of two receiving their halves at once). The tower never attends across temporal patches, so
encoding a video piece by piece gives the features of encoding it whole; on the device, only one piece's
pixels exist at a time instead of the whole video's.

Pieces: ``K`` equal runs of temporal patches (the largest ``K <= pieces`` that splits the video evenly per
device and, when the tower's frame chunk is known, into whole chunks; 1 = the plain one-call path). On a mesh,
piece ``k`` holds the ``k``-th run of every device's own frames (host views, no host copy), so each device
receives and encodes only its frames, and the pieces' features concatenate on each device without moving:
the result is laid out as `mmjax.parallel.vision.video_features` lays it out (split by frames).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.parallel import vision as parallel_vision
from models.qwen2_5_vl import model as qwen_vl
from models.qwen2_5_vl import vision as qwen_vision

PIECES = 8  # default upper bound on the pieces of one video


def piece_count(t: int, devices: int, frame_chunk: int | None, pieces: int = PIECES) -> int:
    """The number of pieces for ``t`` temporal patches over ``devices``: the largest K <= ``pieces`` with
    ``t % (devices * K) == 0`` and, when ``frame_chunk`` is given, each device's piece a whole number of
    chunks (so no piece pads frames the whole video would not); 1 when no K > 1 qualifies."""
    if pieces < 1:
        raise ValueError(f"pieces: expected an int >= 1, got {pieces}")
    for k in range(min(pieces, t), 1, -1):
        if t % (devices * k) == 0 and (frame_chunk is None or (t // (devices * k)) % frame_chunk == 0):
            return k
    return 1


def default_frame_chunk(model: qwen_vl.Qwen2_5_VL, grid, frames_per_chunk: int | None) -> int:
    """Temporal patches the tower encodes together for ``grid`` (`encode_grid`'s default: about
    `models.qwen2_5_vl.vision.PATCHES_PER_CHUNK` patches)."""
    return frames_per_chunk or max(1, qwen_vision.PATCHES_PER_CHUNK // (int(grid[1]) * int(grid[2])))


@jax.jit
def _concat(feats: list) -> jax.Array:
    return jnp.concatenate(feats, axis=0)


@functools.partial(jax.jit, static_argnames=("mesh",))
def _concat_local(feats: list, mesh: Mesh) -> jax.Array:
    """Per device, its pieces' features in order: [sum of pieces, H] split by frames over every device."""
    spec = P(tuple(mesh.axis_names))
    return jax.shard_map(lambda *fs: jnp.concatenate(fs, axis=0), mesh=mesh, in_specs=(spec,) * len(feats),
                         out_specs=spec, check_vma=False)(*feats)


def video_features(model: qwen_vl.Qwen2_5_VL, pixels: np.ndarray, grid, frames_per_chunk: int | None = None,
                   mesh: Mesh | None = None, pieces: int = PIECES) -> jax.Array:
    """Merged features [t * h * w / m**2, H] of one video (host pixels [t * h * w, patch_dim]; grid (t, h, w)),
    uploaded and encoded piece by piece; equal to `qwen_vl.vision_features` (one device) or
    `mmjax.parallel.vision.video_features` (``mesh``: every device its own frames, result split by frames)."""
    t, h, w = (int(g) for g in grid)
    n = h * w
    pixels = np.asarray(pixels)
    if pixels.ndim != 2 or pixels.shape[0] != t * n:
        raise ValueError(f"pixels: expected shape [{t * n}, patch_dim] for grid {(t, h, w)}, got {pixels.shape}")
    devices = 1 if mesh is None else mesh.devices.size
    k = piece_count(t, devices, default_frame_chunk(model, grid, frames_per_chunk), pieces)
    if mesh is None:
        if k == 1:
            return qwen_vl.vision_features(model, pixels, ((t, h, w),), frames_per_chunk)
        per = t // k * n
        return _concat([qwen_vl.vision_features(model, pixels[i * per:(i + 1) * per], ((t // k, h, w),),
                                                frames_per_chunk) for i in range(k)])
    if t % devices:
        raise ValueError(f"grid: expected the temporal patches ({t}) to split evenly over {devices} devices")
    own = t // devices * n  # rows of pixels per device
    per = own // k  # rows per device per piece
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    feats = []
    for i in range(k):
        def rows(index, i=i):  # the device holding piece rows [d * per, (d + 1) * per) gets its own frames' run i
            d = (index[0].start or 0) // per
            return pixels[d * own + i * per:d * own + (i + 1) * per]
        piece = jax.make_array_from_callback((devices * per, pixels.shape[1]), sharding, rows)
        feats.append(parallel_vision.video_features(model, piece, ((devices * per // n, h, w),), frames_per_chunk,
                                                    mesh))
    return feats[0] if k == 1 else _concat_local(feats, mesh)


def streams(model, p, mesh: Mesh | None = None) -> bool:
    """Whether `visual_inputs` applies: one Qwen2.5-VL video whose pixels are on the host and, on a mesh, whose
    temporal patches split evenly over its devices."""
    pixels = p.pixel_values_videos if isinstance(model, qwen_vl.Qwen2_5_VL) else None
    devices = 1 if mesh is None else mesh.devices.size
    return (pixels is not None and not isinstance(pixels, jax.Array) and len(p.video_grids) == 1
            and int(p.video_grids[0][0]) % devices == 0)


def visual_inputs(model: qwen_vl.Qwen2_5_VL, p, frames_per_chunk: int | None, mesh: Mesh | None = None):
    """(image features or None, video features [n, H]) where `streams` holds: images as the port encodes them,
    the video uploaded and encoded in pieces (`video_features`)."""
    if not streams(model, p, mesh):
        raise ValueError("p: expected one Qwen2.5-VL video with host pixels (see video_upload.streams)")
    img = (qwen_vl.vision_features(model, p.pixel_values, p.image_grids, frames_per_chunk)
           if p.image_grids else None)
    return img, video_features(model, p.pixel_values_videos, p.video_grids[0], frames_per_chunk, mesh)
