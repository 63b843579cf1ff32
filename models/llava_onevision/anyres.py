"""Anyres geometry of LLaVA-OneVision, on the host: the canvas an image is tiled on, the feature grid left after
removing the padding, the ``anyres_max_N`` shrink, token counts, and bilinear resize matrices.

Shared by the processor (how many placeholder tokens an image takes) and the model (how its tile features are
packed), so both agree by construction. Formulas follow transformers' ``select_best_resolution``,
``get_anyres_image_grid_shape``, ``unpad_image``, ``LlavaOnevisionModel.pack_image_features`` / ``apply_pooling``
and ``LlavaOnevisionProcessor._get_number_of_features``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np


def select_best_resolution(size: tuple[int, int], pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The (height, width) canvas of ``pinpoints`` that keeps the most of an image of ``size`` (height, width)
    after fitting it inside, then wastes the least area."""
    h0, w0 = int(size[0]), int(size[1])
    if h0 < 1 or w0 < 1:
        raise ValueError(f"image_sizes: expected positive (height, width), got {size}")
    best, best_eff, best_waste = None, 0, math.inf
    for h, w in pinpoints:
        scale = min(w / w0, h / h0)
        eff = min(int(w0 * scale) * int(h0 * scale), w0 * h0)
        waste = w * h - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (int(h), int(w)), eff, waste
    return best


@dataclasses.dataclass(frozen=True)
class ImageLayout:
    """How one image's tile features are packed. tiles: tiles it has (1 without anyres, else 1 base + rows * cols);
    rows, cols: the anyres tile grid (0 without anyres); crop: (top, bottom, left, right) feature rows / columns
    kept of the ``rows * g`` x ``cols * g`` grid; resized: (height, width) after the ``anyres_max_N`` shrink, or
    None; tokens: features it contributes (newlines included)."""

    tiles: int
    rows: int
    cols: int
    crop: tuple[int, int, int, int]
    resized: tuple[int, int] | None
    tokens: int


def unpadded_grid(size: tuple[int, int], grid_h: int, grid_w: int) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the features of an image of ``size`` (height, width) inside a
    ``grid_h`` x ``grid_w`` feature grid of its padded canvas (transformers' ``unpad_image``)."""
    h0, w0 = size
    if w0 / h0 > grid_w / grid_h:
        new_h = int(round(h0 * (grid_w / w0), 7))
        pad = (grid_h - new_h) // 2
        return pad, grid_h - pad, 0, grid_w
    new_w = int(round(w0 * (grid_h / h0), 7))
    pad = (grid_w - new_w) // 2
    return 0, grid_h, pad, grid_w - pad


def image_layout(size: tuple[int, int], *, tile: int, grid: int, pinpoints: Sequence[tuple[int, int]],
                 max_patches: int, tiled: bool = True, tile_tokens: int | None = None) -> ImageLayout:
    """The `ImageLayout` of an image of ``size`` (height, width): anyres tiles on the best canvas when ``tiled``
    (a row with one image), else the base tile only (multi-image rows). ``tile``: tile side in pixels; ``grid``:
    patches per tile side; ``tile_tokens``: features per tile (default grid**2)."""
    tile_tokens = grid * grid if tile_tokens is None else tile_tokens
    if not tiled:
        return ImageLayout(1, 0, 0, (0, 0, 0, 0), None, tile_tokens + 1)
    ch, cw = select_best_resolution(size, pinpoints)
    rows, cols = ch // tile, cw // tile
    top, bottom, left, right = unpadded_grid(size, rows * grid, cols * grid)
    h, w = bottom - top, right - left
    ratio = math.sqrt(h * w / (max_patches * grid * grid))
    resized = None
    if ratio > 1.1:
        resized = (int(h // ratio), int(w // ratio))
        h, w = resized
    return ImageLayout(1 + rows * cols, rows, cols, (top, bottom, left, right), resized, tile_tokens + h * (w + 1))


def pooled_side(grid: int) -> int:
    """Video features per frame side after the 2x2 bilinear pooling (ceil(grid / 2): 14 for 27)."""
    return math.ceil(grid / 2)


def video_tokens(frames: int, grid: int) -> int:
    """Features of a video of ``frames`` frames: pooled frames + one newline."""
    return frames * pooled_side(grid) ** 2 + 1


def bilinear_matrix(n_in: int, n_out: int) -> np.ndarray:
    """float32 [n_out, n_in]: PyTorch's ``interpolate(mode="bilinear", align_corners=False)`` along one axis
    (no antialiasing; sources clamped at 0 and n_in - 1)."""
    scale = n_in / n_out
    src = np.maximum((np.arange(n_out, dtype=np.float64) + 0.5) * scale - 0.5, 0.0).astype(np.float32)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    lam = (src - i0).astype(np.float32)
    m = np.zeros((n_out, n_in), np.float32)
    np.add.at(m, (np.arange(n_out), i0), 1.0 - lam)
    np.add.at(m, (np.arange(n_out), i1), lam)
    return m
