"""Pictures of what a pattern keeps: `plot_layout` draws a layout's computed pairs (blocks,
lines, single columns) for one head, over the true attention map when given, in original or
permuted order (matplotlib, a dependency of the project).

Large maps are pooled to at most ``max_cells`` cells per side: a cell shows the fraction of
its pairs the layout computes (and the mean attention of its pairs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from mmjax.sparse.layouts import Layout, LayoutSet, RowSplit, block_parts
from pallas_kernels import BlockLayout

ORDERS = ("original", "permuted")


def _head_slice(x, batch: int, head: int):
    """A layout array ``[B|1, N|1, ...]`` reduced to ``[1, 1, ...]`` at (batch, head)."""
    if x is None:
        return None
    b = batch if x.shape[0] > 1 else 0
    h = head if x.shape[1] > 1 else 0
    return x[b:b + 1, h:h + 1]


def one_head(layout: Layout, batch: int = 0, head: int = 0) -> Layout:
    """The layout of one (batch, head), every array ``[1, 1, ...]``."""
    if isinstance(layout, RowSplit):
        return RowSplit(tuple(one_head(p, batch, head) for p in layout.parts), layout.row_kind[batch:batch + 1],
                        layout.kinds)
    if isinstance(layout, LayoutSet):
        return LayoutSet(tuple(one_head(p, batch, head) for p in layout.parts))
    fields = ("kv_blocks", "kv_block_count", "kv_columns", "kv_column_count", "q_perm", "kv_perm")
    return layout.replace(**{f: _head_slice(getattr(layout, f), batch, head) for f in fields})


def attention_probs(q: jax.Array, k: jax.Array, *, batch: int = 0, head: int = 0) -> np.ndarray:
    """Causal softmax of one head, float32 ``[T, S]`` (q ``[B,T,N,D]``, k ``[B,S,K,D]``;
    T x S memory: for pictures of inputs up to ~10k tokens)."""
    t, n, d = q.shape[1], q.shape[2], q.shape[3]
    s, kh = k.shape[1], k.shape[2]
    qh = q[batch, :, head].astype(jnp.float32)
    kk = k[batch, :, head // (n // kh)].astype(jnp.float32)
    sc = (qh @ kk.T) * d ** -0.5
    causal = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t)
    return np.asarray(jax.nn.softmax(jnp.where(causal, sc, -jnp.inf), axis=-1))


def _pool(x: np.ndarray, cells: int) -> np.ndarray:
    """Mean-pool a 2-D array to at most ``cells`` x ``cells`` (edge cells average what they hold)."""
    rows, cols = x.shape
    fr, fc = max(1, -(-rows // cells)), max(1, -(-cols // cells))
    pr, pc = (-rows) % fr, (-cols) % fc
    xp = np.pad(x.astype(np.float32), ((0, pr), (0, pc)))
    cnt = np.pad(np.ones_like(x, np.float32), ((0, pr), (0, pc)))
    shape = (xp.shape[0] // fr, fr, xp.shape[1] // fc, fc)
    return xp.reshape(shape).sum((1, 3)) / np.maximum(cnt.reshape(shape).sum((1, 3)), 1.0)


def _perms(layout: Layout) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(q_perm, kv_perm) of the first part that permutes (one head), or (None, None)."""
    for part in block_parts(layout):
        if part.q_perm is not None or part.kv_perm is not None:
            qp = None if part.q_perm is None else np.asarray(part.q_perm)[0, 0]
            kp = None if part.kv_perm is None else np.asarray(part.kv_perm)[0, 0]
            return qp, kp
    return None, None


def plot_layout(layout: Layout, head: int = 0, attention=None, order: str = "original", *, batch: int = 0,
                max_cells: int = 512, title: str | None = None, ax=None) -> matplotlib.figure.Figure:
    """Figure of the pairs ``layout`` computes for one (batch, head).

    layout: a `BlockLayout`, `LayoutSet` or `RowSplit` (T x S mask of one head is formed).
    attention: None, or the head's attention ``[T, S]`` (e.g. `attention_probs`) drawn
      underneath on a log scale. order: "original" (token positions) or "permuted" (the
      order of the layout's first permuted part: Grid phase groups, modality packing).
    Returns the matplotlib figure (of ``ax`` when given).
    """
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}; received {order!r}")
    if not isinstance(layout, (BlockLayout, LayoutSet, RowSplit)):
        raise ValueError(f"layout: expected a BlockLayout, LayoutSet or RowSplit; received {type(layout).__name__}")
    lead = block_parts(layout)[0].kv_block_count.shape[:2]
    if not (0 <= batch < max(lead[0], 1) or lead[0] == 1) or not (0 <= head < lead[1] or lead[1] == 1):
        raise ValueError(f"head / batch: expected indices within the layout's [B, N] = {list(lead)}; received "
                         f"batch={batch}, head={head}")
    lay = one_head(layout, batch, head)
    mask = np.asarray(lay.to_dense_mask())[0, 0]  # [T, S] original order
    att = None
    if attention is not None:
        att = np.asarray(attention, np.float32)
        if att.ndim == 4:
            att = att[batch, head]
        if att.shape != mask.shape:
            raise ValueError(f"attention: expected shape {list(mask.shape)} ([T, S] of the layout) or [B, N, T, S]; "
                             f"received {list(np.shape(attention))}")
    if order == "permuted":
        qp, kp = _perms(lay)
        if qp is not None:
            mask, att = mask[qp], None if att is None else att[qp]
        if kp is not None:
            mask, att = mask[:, kp], None if att is None else att[:, kp]
    fig = plt.figure(figsize=(6, 6)) if ax is None else ax.figure
    ax = fig.add_subplot(1, 1, 1) if ax is None else ax
    kept = _pool(mask, max_cells)
    if att is not None:
        a = _pool(att, max_cells)
        ax.imshow(np.log10(np.maximum(a, 1e-7)), cmap="Greys", vmin=-7, vmax=0, interpolation="nearest")
        recall = float((att * mask).sum() / max(att.sum(), 1e-30))
    overlay = np.zeros(kept.shape + (4,), np.float32)
    overlay[..., 0], overlay[..., 2] = 0.1, 0.9
    overlay[..., 3] = 0.55 * kept
    ax.imshow(overlay, interpolation="nearest")
    t, s = mask.shape
    causal = t * (s - t) + t * (t + 1) / 2
    density = float(mask.sum()) / causal
    label = f"head {head}, {order} order: kept {density:.1%} of causal pairs"
    if att is not None:
        label += f", {recall:.1%} of the attention"
    ax.set_title(title + "\n" + label if title else label, fontsize=9)
    ax.set_xlabel(f"keys ({s})" + (" permuted" if order == "permuted" else ""))
    ax.set_ylabel(f"queries ({t})" + (" permuted" if order == "permuted" else ""))
    ax.set_xticks([])
    ax.set_yticks([])
    return fig
