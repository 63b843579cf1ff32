"""Host-side multimodal RoPE position ids (``get_rope_index`` of transformers' Qwen2.5-VL).

Text tokens get the same id on all three axes, counting on from the previous span. An image or
video span of grid (t, h, w) patches gets (temporal, height, width) ids offset by the span start:
height/width are the merged-grid row/column, temporal is ``trunc(i * interval)`` with interval 1 for
images and ``tokens_per_second * second_per_grid_t`` for videos (float32 arithmetic, as in torch).
The text after a span starts at ``start + max(h, w) / spatial_merge_size`` (transformers >= 5
semantics) or, with ``legacy_text_offset=True``, at ``max(ids of the span) + 1`` (transformers 4.x and
the original Qwen code; differs when a video's scaled temporal ids outrun its height/width).
Padding (attention_mask == 0) is skipped and gets id 0.
"""

from __future__ import annotations

import numpy as np

TEXT, IMAGE, VIDEO = 0, 1, 2


def token_types(input_ids: np.ndarray, image_token_id: int, video_token_id: int) -> np.ndarray:
    """int32 [B, T]: 0 text, 1 image pad token, 2 video pad token."""
    ids = np.asarray(input_ids)
    return np.where(ids == image_token_id, IMAGE, np.where(ids == video_token_id, VIDEO, TEXT)).astype(np.int32)


def _spans(types: np.ndarray):
    spans, start = [], 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            spans.append((int(types[start]), start, i))
            start = i
    return spans


def get_rope_index(input_ids, *, image_token_id: int, video_token_id: int, spatial_merge_size: int,
                   tokens_per_second: float, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
                   attention_mask=None, legacy_text_offset: bool = False):
    """Returns (position_ids int64 [3, B, T], rope_deltas int64 [B]).

    ``rope_deltas[b] = max(position) + 1 - n_valid_tokens[b]``: the position of the next decoded
    token is ``n_valid_tokens + rope_delta``. Without any image/video grid the ids are plain
    ``arange(T)`` (as transformers does for text-only inputs) and the delta is ``T - n_valid``.
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids: expected shape [B, T], got {ids.shape}")
    b, t = ids.shape
    mask = np.ones((b, t), bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    if mask.shape != (b, t):
        raise ValueError(f"attention_mask: expected shape {(b, t)}, got {mask.shape}")
    pos = np.zeros((3, b, t), np.int64)
    if image_grid_thw is None and video_grid_thw is None:
        pos[:] = np.arange(t)[None, None]
        return pos, (t - mask.sum(-1)).astype(np.int64)
    grids = {IMAGE: iter(np.asarray(image_grid_thw).reshape(-1, 3)) if image_grid_thw is not None else iter(()),
             VIDEO: iter(np.asarray(video_grid_thw).reshape(-1, 3)) if video_grid_thw is not None else iter(())}
    spg = iter(np.asarray(second_per_grid_ts, np.float32).reshape(-1)) if second_per_grid_ts is not None else None
    types_all = token_types(ids, image_token_id, video_token_id)
    m = spatial_merge_size
    deltas = np.zeros((b,), np.int64)
    for row in range(b):
        types = types_all[row][mask[row]]
        cur, parts = 0, []
        for kind, s, e in _spans(types):
            if kind == TEXT:
                parts.append(np.broadcast_to(np.arange(e - s) + cur, (3, e - s)))
                cur += e - s
                continue
            try:
                gt, gh, gw = (int(v) for v in next(grids[kind]))
            except StopIteration:
                name = "image_grid_thw" if kind == IMAGE else "video_grid_thw"
                raise ValueError(f"{name}: fewer grids than {'image' if kind == IMAGE else 'video'} spans in "
                                 f"input_ids row {row}") from None
            lh, lw = gh // m, gw // m
            if gt * lh * lw != e - s:
                raise ValueError(f"input_ids row {row}: span of {e - s} pad tokens does not match grid "
                                 f"{(gt, gh, gw)} ({gt * lh * lw} tokens); a span must hold one whole grid")
            if kind == VIDEO:
                interval = np.float32(tokens_per_second) * (next(spg) if spg is not None else np.float32(1.0))
            else:
                interval = np.float32(1.0)
            tt = np.trunc(np.arange(gt, dtype=np.float32) * np.float32(interval)).astype(np.int64)
            T_, H_, W_ = np.meshgrid(tt, np.arange(lh), np.arange(lw), indexing="ij")
            parts.append(np.stack([T_.ravel(), H_.ravel(), W_.ravel()]) + cur)
            cur = int(parts[-1].max()) + 1 if legacy_text_offset else cur + max(gh, gw) // m
        flat = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)
        pos[:, row, mask[row]] = flat
        deltas[row] = (flat.max() + 1 if flat.size else 0) - flat.shape[1]
    return pos, deltas
