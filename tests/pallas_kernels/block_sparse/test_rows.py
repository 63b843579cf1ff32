"""Layouts whose work lies in a few query blocks (`BlockLayout.q_block_range`): their checks, the rows API on the
reference, the row merges, and the Mosaic GPU rows pass (chunked lists, gathered rows) with its kernel emulated on
the CPU (the kernel itself runs in test_mosaic_gpu_gpu.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from pallas_kernels import BlockLayout, block_sparse_attention
from pallas_kernels.block_sparse import (
    block_sparse_attention_rows,
    merge_attention,
    merge_attention_all,
    merge_rows,
    mosaic_gpu,
    mosaic_lists,
    scatter_rows,
)
from pallas_kernels.block_sparse.merge import merge_chunks
from pallas_kernels.block_sparse.validation import check_layout_values
from tests.pallas_kernels.helpers import masked_dense_attention, random_layout, random_qkv, rel_err


def range_layout(rng, b, n, t, s, bq, bk, lo, hi, **kw) -> BlockLayout:
    """A random layout with lists only in the query blocks ``[lo, hi)`` (none empty), naming that range."""
    lay = random_layout(rng, b, n, t, s, bq, bk, empty_rows=False, **kw)
    nq = lay.num_q_blocks
    inside = (np.arange(nq) >= lo) & (np.arange(nq) < hi)
    count = jnp.where(inside, lay.kv_block_count, 0)
    ccount = None if lay.kv_column_count is None else jnp.where(inside, lay.kv_column_count, 0)
    return lay.replace(kv_block_count=count, kv_column_count=ccount, q_block_range=(lo, hi))


def test_q_block_range_checks():
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(1, 1, 300, 300, 2, 1, 64)
    lay = range_layout(rng, 1, 2, 300, 300, 128, 64, 1, 3)
    for bad in ((2, 2), (0, 4), (-1, 1), [0, 1], (0.0, 1)):
        with pytest.raises(ValueError, match="q_block_range"):
            block_sparse_attention(q, k, v, lay.replace(q_block_range=bad), implementation="reference")
    with pytest.raises(ValueError, match=r"kv_block_count: expected 0 for the query blocks outside .* block 1"):
        block_sparse_attention(q, k, v, lay.replace(q_block_range=(2, 3)), implementation="reference")
    err, _ = checkify.checkify(lambda x: x.check())(lay.replace(q_block_range=(2, 3)))
    with pytest.raises(checkify.JaxRuntimeError, match="outside q_block_range"):
        err.throw()
    err, _ = checkify.checkify(lambda x: x.check())(lay)
    err.throw()
    with pytest.raises(ValueError, match="q_block_range: expected"):
        block_sparse_attention_rows(q, k, v, lay.replace(q_block_range=None), implementation="reference")


@pytest.mark.parametrize("b,t,s,n,kh,bq,lo,hi,perm", [
    (1, 300, 300, 4, 2, 128, 2, 3, False),  # the last (ragged) block
    (2, 200, 450, 2, 2, 64, 0, 2, True),  # the first blocks, permuted rows, suffix queries
])
def test_rows_on_the_reference_are_the_full_result_rows(b, t, s, n, kh, bq, lo, hi, perm):
    rng = np.random.default_rng(t + s)
    q, k, v = random_qkv(3, b, t, s, n, kh, 64)
    lay = range_layout(rng, b, n, t, s, bq, 64, lo, hi, perm=perm)
    rows, o, l = block_sparse_attention_rows(q, k, v, lay, implementation="reference")
    out, lse = block_sparse_attention(q, k, v, lay, implementation="reference")
    r = np.broadcast_to(np.asarray(rows), (b, n, (hi - lo) * bq))
    want = np.arange(lo * bq, hi * bq)
    if perm:
        perm_rows = np.broadcast_to(np.asarray(lay.q_perm), (b, n, t))
        want = np.take_along_axis(perm_rows, np.broadcast_to(np.minimum(want, t - 1), (b, n, want.size)), -1)
    want = np.where(np.arange(lo * bq, hi * bq) < t, want, t)
    np.testing.assert_array_equal(r, np.broadcast_to(want, r.shape))
    valid = r < t
    for bi, ni in np.ndindex(b, n):
        sel = r[bi, ni][valid[bi, ni]]
        np.testing.assert_array_equal(np.asarray(o)[bi, valid[bi, ni], ni], np.asarray(out)[bi, sel, ni])
        np.testing.assert_array_equal(np.asarray(l)[bi, ni, valid[bi, ni]], np.asarray(lse)[bi, ni, sel])


def _partial(rng, b, t, n, d):
    """A random attention result with row 1 empty (out 0, lse -inf, as the kernels give)."""
    out = jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32)
    lse = jnp.asarray(rng.normal(size=(b, n, t)), jnp.float32)
    return out.at[:, 1].set(0.0), lse.at[:, :, 1].set(-jnp.inf)


def test_row_merges_match_merge_attention_on_whole_results():
    rng = np.random.default_rng(1)
    b, t, n, d, r = 2, 20, 3, 8, 6
    out, lse = _partial(rng, b, t, n, d)
    o_r, l_r = _partial(rng, b, r, n, d)
    rows = jnp.asarray(np.stack([np.stack([rng.permutation(t + 3)[:r] for _ in range(n)]) for _ in range(b)]),
                       jnp.int32)  # per (batch, head), some >= t (dropped)
    full_o, full_l = scatter_rows(rows, o_r, l_r, t)
    for bi, ni, ri in np.ndindex(b, n, r):
        if rows[bi, ni, ri] < t:
            assert full_l[bi, ni, rows[bi, ni, ri]] == l_r[bi, ni, ri]
    assert int((full_l > -jnp.inf).sum()) == int(((rows < t) & (l_r > -jnp.inf)).sum())
    with pytest.raises(ValueError, match=r"rows: expected an int array \[2\|1, 3\|1, 6\]"):
        merge_rows(out, lse, rows[..., :4], o_r, l_r)
    with pytest.raises(ValueError, match="lse_rows: expected shape"):
        scatter_rows(rows, o_r, l_r[:, :2], t)
    want = merge_attention(out, lse, full_o, full_l)
    got = merge_rows(out, lse, rows, o_r, l_r)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_merge_rows_merges_before_its_scatters():
    """The rows are gathered and merged before an optimization barrier and scattered after it, so no scatter's
    fusion reads out elsewhere (XLA on the GPU then scatters in place, not into a copy of out)."""
    rng = np.random.default_rng(3)
    out, lse = _partial(rng, 1, 16, 2, 8)
    o_r, l_r = _partial(rng, 1, 4, 2, 8)
    rows = jnp.asarray(np.stack([rng.permutation(16)[:4] for _ in range(2)])[None], jnp.int32)
    text = jax.jit(merge_rows).lower(out, lse, rows, o_r, l_r).as_text()
    ops = re.findall(r"(?<!#)stablehlo\.(gather|scatter|optimization_barrier)\b", text)
    assert ops.count("optimization_barrier") == 1, ops
    cut = ops.index("optimization_barrier")
    assert ops[:cut] == ["gather", "gather"] and ops[cut + 1:] == ["scatter", "scatter"], ops


def test_merge_chunks_is_merge_attention_in_turn():
    rng = np.random.default_rng(2)
    parts = [_partial(rng, 2, 5, 3, 4) for _ in range(3)]
    o, l = parts[0]
    for o2, l2 in parts[1:]:
        o, l = merge_attention(o, l, o2, l2)
    got = merge_chunks(jnp.stack([p[0] for p in parts], 1), jnp.stack([p[1] for p in parts], 2))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(o), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(l), rtol=1e-6)
    with pytest.raises(ValueError, match=r"\[B, C, T, N, D\]"):
        merge_chunks(parts[0][0], parts[0][1])


def test_merge_attention_all_is_merge_attention_in_turn():
    """k parts in one pass equal k - 1 pairwise merges (empty rows stay empty, a NaN lse gives a NaN row), one part
    comes back as it is, and bad inputs are named."""
    rng = np.random.default_rng(3)
    parts = [_partial(rng, 2, 5, 3, 4) for _ in range(3)]
    parts[2] = (parts[2][0], parts[2][1].at[1, 0, 3].set(jnp.nan))
    o, l = parts[0]
    for o2, l2 in parts[1:]:
        o, l = merge_attention(o, l, o2, l2)
    got = merge_attention_all([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(o), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(l), rtol=1e-6)
    assert np.isneginf(np.asarray(got[1][:, :, 1])).all() and np.isnan(np.asarray(got[0][1, 3, 0])).all()
    one = merge_attention_all([parts[0][0]], [parts[0][1]])
    assert one[0] is parts[0][0] and np.array_equal(np.asarray(one[1]), np.asarray(parts[0][1]))
    with pytest.raises(ValueError, match=r"outs, lses: expected two sequences of one length >= 1; received 2 and 1"):
        merge_attention_all([p[0] for p in parts[:2]], [parts[0][1]])
    with pytest.raises(ValueError, match=r"outs\[1\]: expected shape \(2, 5, 3, 4\)"):
        merge_attention_all([parts[0][0], parts[1][0][:, :4]], [parts[0][1], parts[1][1]])
    with pytest.raises(ValueError, match=r"lses\[1\]: expected shape \(2, 3, 5\)"):
        merge_attention_all([parts[0][0], parts[1][0]], [parts[0][1], parts[1][1][:, :2]])


def emulated_launch(q_in, k_in, v_in, blocks, count, q_pos, k_pos, *, prior=None, row_mask=None, **kw):
    """What `mosaic_kernel.launch` computes with original positions, as masked dense attention: row r of q_in (query
    block r // block_q) sees key c of k_in when c's block is among its block's first ``count`` ids (with
    ``ranges``: c lies in ``[lo, hi)`` of one of its first ``count`` entries) and the positions allow it (without
    positions: row r at ``r + q_offset``, key c at c). With ``row_stride``, q_in is the original rows viewed as
    ``[B, T / stride, stride, N, D]``, query block i's rows are ``q_box[i] + j * stride`` and out comes back in that
    view (lse in the blocks' row order). With ``prior`` (out like q_in, lse in the blocks' row order) the result is
    `merge_attention` of the prior with that; with ``row_mask`` (int32 ``[B, N, Tp]``, the blocks' row order) the
    rows off the mask get the prior (or the empty result) whatever the blocks list there."""
    out, lse = _emulated(q_in, k_in, v_in, blocks, count, q_pos, k_pos, **kw)
    if prior is None and row_mask is None:
        return out, lse
    o = _in_block_order(out, kw)  # merged in the blocks' row order, as the kernel does
    if row_mask is not None:  # the kernel drops its own result off the mask (out 0, lse -inf)
        lse = jnp.where(row_mask != 0, lse, -jnp.inf)
        o = jnp.where(jnp.transpose(row_mask == 0, (0, 2, 1))[..., None], 0, o)
    if prior is not None:
        o, lse = merge_attention(_in_block_order(prior[0], kw), prior[1], o, lse)
    return _from_block_order(o, out, kw), lse


def _box_rows(q_in, q_box, block_q: int) -> jax.Array:
    """int ``[B, N, Tp]``: the original row of each row of the blocks, q_in in `strided_rows`' view."""
    b, _, st, n, _ = q_in.shape
    rows = (q_box[..., None] + st * jnp.arange(block_q)).reshape(q_box.shape[:2] + (-1,))
    return jnp.broadcast_to(rows, (b, n, rows.shape[-1]))


def _in_block_order(x, kw: dict) -> jax.Array:
    """x shaped like the launch's q_in (with ``row_stride``, the original rows viewed) -> ``[B, Tp, N, D]`` in the
    blocks' row order."""
    if not kw.get("row_stride"):
        return x
    rows = _box_rows(x, kw["q_box"], kw["block_q"])
    flat = x.reshape(x.shape[0], -1, *x.shape[-2:])
    return jnp.take_along_axis(flat, jnp.transpose(rows, (0, 2, 1))[..., None], axis=1)


def _from_block_order(y, like, kw: dict) -> jax.Array:
    """`_in_block_order` undone: y ``[B, Tp, N, D]`` in the blocks' row order -> shaped like ``like``."""
    if not kw.get("row_stride"):
        return y
    rows = _box_rows(like, kw["q_box"], kw["block_q"])
    b, n = rows.shape[:2]
    flat = jnp.zeros((b, rows.shape[-1], n, y.shape[-1]), y.dtype)
    placed = flat.at[jnp.arange(b)[:, None, None], rows, jnp.arange(n)[None, :, None]].set(
        jnp.transpose(y, (0, 2, 1, 3)))
    return placed.reshape(like.shape)


def _emulated(q_in, k_in, v_in, blocks, count, q_pos, k_pos, *, groups, block_k, block_q, kv_len, causal,
              gap, window, sm_scale, q_offset, ranges=None, q_box=None, row_stride=0, **_):
    """`emulated_launch` without a prior."""
    if row_stride:
        boxes = {"row_stride": row_stride, "q_box": q_box, "block_q": block_q}
        out, lse = emulated_launch(_in_block_order(q_in, boxes), k_in, v_in, blocks, count, q_pos, k_pos,
                                   groups=groups, block_k=block_k, block_q=block_q, kv_len=kv_len, causal=causal,
                                   gap=gap, window=window, sm_scale=sm_scale, q_offset=q_offset, ranges=ranges)
        return _from_block_order(out, q_in, boxes), lse
    b, tp, n, dp = q_in.shape
    sp = k_in.shape[1]
    nqb = count.shape[2]
    lead = (b, n)
    blk = jnp.broadcast_to(blocks, lead + (nqb, blocks.shape[-1]))
    cnt = jnp.broadcast_to(count, lead + (nqb,))
    used = jnp.arange(blk.shape[-1]) < cnt[..., None]
    rows_blk = jnp.minimum(jnp.arange(tp) // block_q, nqb - 1)
    if ranges is None:
        listed = jnp.zeros(lead + (nqb, sp // block_k + 1), bool)
        listed = jax.vmap(jax.vmap(jax.vmap(lambda z, i, u: z.at[jnp.where(u, i, z.shape[0] - 1)].set(True))))(
            listed, blk, used)[..., :-1]
        keys = jnp.repeat(listed, block_k, axis=-1)
    else:
        lo, hi = (jnp.broadcast_to(x, blk.shape) for x in ranges)
        c = jnp.arange(sp)
        keys = (used[..., None] & (c >= lo[..., None]) & (c < hi[..., None])).any(-2)  # [B, N, nqb, Sp]
    mask = keys[:, :, rows_blk]  # [B, N, Tp, Sp]
    mask &= (jnp.arange(tp) // block_q < nqb)[:, None]
    if q_pos is None:
        q_pos, k_pos = jnp.arange(tp) + q_offset, jnp.arange(sp)
    qp = jnp.broadcast_to(q_pos, lead + (tp,))[..., :, None]
    kp = jnp.broadcast_to(k_pos, lead + (sp,))[..., None, :]
    mask &= kp < kv_len
    if causal:
        mask &= kp + gap <= qp
        if window:
            mask &= kp + window > qp
    out, lse = masked_dense_attention(q_in, k_in, v_in, mask, sm_scale=sm_scale)
    return out.astype(q_in.dtype), lse


def _assert_matches_mask(out, lse, q, k, v, layout):
    """out / lse (float32 inputs, the kernel emulated) against masked dense attention over the layout's mask."""
    ref_o, ref_l = masked_dense_attention(q, k, v, layout.to_dense_mask())
    assert rel_err(np.asarray(out), np.asarray(ref_o)) < 1e-5
    fin = np.isfinite(np.asarray(ref_l))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_l)[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,s,n,kh,bq,lo,hi,perm,gap,chunk", [
    (300, 2000, 4, 2, 128, 2, 3, False, 0, 6),  # the last (ragged) block, lists in 6-entry chunks
    (256, 1200, 2, 1, 64, 0, 3, True, 64, 4),  # permuted rows and keys, a causal gap, 64-row blocks
    (128, 700, 2, 2, 128, 0, 1, True, 0, 128),  # one chunk
])
def test_rows_pass_with_the_kernel_emulated(monkeypatch, t, s, n, kh, bq, lo, hi, perm, gap, chunk):
    monkeypatch.setattr(mosaic_gpu, "launch", emulated_launch)
    monkeypatch.setattr(mosaic_gpu, "ROW_CHUNK", chunk)
    rng = np.random.default_rng(t + s + gap)
    q, k, v = random_qkv(4, 1, t, s, n, kh, 64, jnp.float32)
    lay = range_layout(rng, 1, n, t, s, bq, 64, lo, hi, perm=perm, density=0.5).replace(gap=gap)
    if chunk < lay.max_blocks:
        assert -(-lay.max_blocks // chunk) > 1
    rows, o, l = mosaic_gpu.block_sparse_attention_rows_mosaic_gpu.__wrapped__(q, k, v, lay, sm_scale=64 ** -0.5,
                                                                               key_pairs=False)
    _assert_matches_mask(*scatter_rows(rows, o, l, t), q, k, v, lay)


def test_chunked_lists_keep_every_entry_once():
    rng = np.random.default_rng(5)
    lay = range_layout(rng, 1, 2, 600, 5000, 128, 64, 1, 4, density=0.6)
    blocks, counts = mosaic_lists.chunk_lists(lay, 8)
    nb, m = 3, lay.max_blocks
    c = counts.shape[2] // nb
    assert c == -(-m // 8) and blocks.shape[-1] % 2 == 0 and blocks.shape[-1] <= 8
    for h, i in np.ndindex(2, nb):
        got = np.concatenate([np.asarray(blocks)[0, h, j * nb + i, :int(counts[0, h, j * nb + i])] for j in range(c)])
        want = np.asarray(lay.kv_blocks)[0, h, 1 + i, :int(lay.kv_block_count[0, h, 1 + i])]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("t,s,n,kh,perm,column_pass", [(300, 900, 4, 2, False, None), (200, 700, 2, 1, True, None),
                                                        (300, 900, 4, 2, False, "mosaic"),
                                                        (200, 700, 2, 1, True, "mosaic")])
def test_shared_columns_pass_with_the_kernel_emulated(monkeypatch, t, s, n, kh, perm, column_pass):
    """Columns shared by every query block and head (SF-fixed's summary columns): gathered once per key / value
    head, each query block reading a prefix of them, appended to the keys in the blocks' own launch (default,
    ``"fused"``) or as a second launch merged with the blocks' (``"mosaic"``, `mosaic_gpu._shared_column_pass`)."""
    monkeypatch.setattr(mosaic_gpu, "launch", emulated_launch)
    rng = np.random.default_rng(t + s)
    q, k, v = random_qkv(6, 1, t, s, n, kh, 64, jnp.float32)
    nq, nk, bk = -(-t // 128), -(-s // 64), 64
    half = nk // 2
    mask = rng.random((1, n, nq, nk)) < 0.5
    mask[..., half:] = False  # blocks in the first half, columns in the second
    cols = np.sort(rng.choice(np.arange(half * bk, s), size=150, replace=False)).astype(np.int32)
    ccount = rng.integers(0, 151, size=(1, n, nq)).astype(np.int32)
    kv_perm = jnp.asarray(rng.permutation(s).astype(np.int32))[None, None] if perm else None
    layout = BlockLayout.from_block_mask(jnp.asarray(mask), q_len=t, kv_len=s, block_q=128, block_k=bk,
                                         kv_columns=jnp.asarray(cols)[None, None, None],
                                         kv_column_count=jnp.asarray(ccount), kv_perm=kv_perm)
    assert mosaic_gpu.shared_columns(layout) and mosaic_gpu.fused_columns(layout)
    launches = []
    monkeypatch.setattr(mosaic_gpu, "launch", lambda *a, **kw: launches.append(a[1].shape) or emulated_launch(*a, **kw))
    out, lse = mosaic_gpu.block_sparse_attention_mosaic_gpu.__wrapped__(q, k, v, layout, sm_scale=64 ** -0.5,
                                                                        column_pass=column_pass)
    assert len(launches) == (2 if column_pass == "mosaic" else 1)
    _assert_matches_mask(out, lse, q, k, v, layout)


def test_windowed_band_with_columns_from_a_run_start(monkeypatch):
    """A boundary wrapper's band with the keys in place (`Placement.keys_in_place`): keys in the original order (no
    ``kv_perm``), a causal window, the key blocks from the run's start on and the straddling block's keys from the
    start as one shared column list read where a query block listed that block: one launch of the fused pass, exact
    against the layout's mask."""
    launches = []
    monkeypatch.setattr(mosaic_gpu, "launch", lambda *a, **kw: launches.append(a[1].shape) or emulated_launch(*a, **kw))
    t = s = 640
    bq, bk, window, start = 128, 64, 100, 150
    q, k, v = random_qkv(10, 1, t, s, 4, 2, 64, jnp.float32)
    nq, nk = t // bq, s // bk
    rows_lo, rows_hi = np.arange(nq) * bq, np.arange(nq) * bq + bq - 1
    ids = np.arange(nk)
    band = (ids[None] >= (rows_lo[:, None] - window + 1) // bk) & (ids[None] <= rows_hi[:, None] // bk)
    straddle = band[:, start // bk]
    mask = band & (ids[None] * bk >= start)
    cols = (start + np.arange(bk)).astype(np.int32)[None, None, None]
    ccount = np.where(straddle, bk - start % bk, 0).astype(np.int32)[None, None]
    layout = BlockLayout.from_block_mask(jnp.asarray(mask)[None, None], q_len=t, kv_len=s, block_q=bq, block_k=bk,
                                         kv_columns=jnp.asarray(cols), kv_column_count=jnp.asarray(ccount)
                                         ).replace(window=window)
    assert straddle.any() and mosaic_gpu.fused_columns(layout)
    out, lse = mosaic_gpu.block_sparse_attention_mosaic_gpu.__wrapped__(q, k, v, layout, sm_scale=64 ** -0.5)
    assert len(launches) == 1
    _assert_matches_mask(out, lse, q, k, v, layout)
    pos = np.arange(s)
    assert not (np.asarray(layout.to_dense_mask()) & (pos < start)).any()  # nothing before the run


@pytest.mark.parametrize("t,s,n,kh,lo,hi,perm,chunk", [
    (300, 1500, 4, 2, 1, 3, False, 4),  # lists (blocks, then column tiles) in 4-entry chunks
    (260, 900, 2, 1, 0, 1, True, 128),  # permuted rows and keys, one chunk
])
def test_rows_pass_with_shared_columns(monkeypatch, t, s, n, kh, lo, hi, perm, chunk):
    """A row range whose part also has `shared_columns` (the straddling keys a boundary wrapper's part lists) runs
    as the rows pass (`row_range_pass`), its column tiles going on each list before it is cut into chunks: one
    launch, exact against the layout's mask."""
    monkeypatch.setattr(mosaic_gpu, "ROW_CHUNK", chunk)
    launches = []
    monkeypatch.setattr(mosaic_gpu, "launch", lambda *a, **kw: launches.append(a[1].shape) or emulated_launch(*a, **kw))
    rng = np.random.default_rng(t + s + lo)
    q, k, v = random_qkv(8, 1, t, s, n, kh, 64, jnp.float32)
    nq, nk, bk = -(-t // 128), -(-s // 64), 64
    half = nk // 2
    mask = rng.random((1, n, nq, nk)) < 0.6
    mask[..., half:] = False  # blocks in the first half, columns in the second
    mask[:, :, :lo] = mask[:, :, hi:] = False
    cols = np.sort(rng.choice(np.arange(half * bk, s), size=100, replace=False)).astype(np.int32)
    inside = (np.arange(nq) >= lo) & (np.arange(nq) < hi)
    ccount = np.where(inside, rng.integers(0, 101, size=(1, n, nq)), 0).astype(np.int32)
    ccount[0, 0, lo] = 100  # every column tile somewhere, and none elsewhere
    ccount[0, -1, hi - 1] = 0
    kv_perm = jnp.asarray(rng.permutation(s).astype(np.int32))[None, None] if perm else None
    q_perm = jnp.asarray(rng.permutation(t).astype(np.int32))[None, None] if perm else None
    layout = BlockLayout.from_block_mask(jnp.asarray(mask), q_len=t, kv_len=s, block_q=128, block_k=bk,
                                         kv_columns=jnp.asarray(cols)[None, None, None],
                                         kv_column_count=jnp.asarray(ccount), kv_perm=kv_perm, q_perm=q_perm
                                         ).replace(q_block_range=(lo, hi))
    assert mosaic_gpu.row_range_pass(layout) and not mosaic_gpu.row_range_pass(layout, "mosaic")
    out, lse = mosaic_gpu.block_sparse_attention_mosaic_gpu.__wrapped__(q, k, v, layout, sm_scale=64 ** -0.5,
                                                                        key_pairs=False)
    assert len(launches) == 1 and launches[0][1] > s  # the keys with the column tiles appended
    _assert_matches_mask(out, lse, q, k, v, layout)


def test_chunked_entries_keep_every_window_once():
    """`chunk_entries` cuts several arrays of one list alike (fused lists: starts, lo, hi) and counts each chunk."""
    rng = np.random.default_rng(9)
    m, nb = 11, 3
    starts = jnp.asarray(rng.integers(0, 1000, (1, 2, nb, m)), jnp.int32)
    his = starts + 7
    count = jnp.asarray([[[11, 0, 5], [3, 9, 14]]], jnp.int32)  # 14: clipped to 11
    (s_c, h_c), counts = mosaic_lists.chunk_entries((starts, his), count, 4)
    c = counts.shape[2] // nb
    assert c == 3 and s_c.shape[-1] == 4 and h_c.shape == s_c.shape
    for h, i in np.ndindex(2, nb):
        n_i = min(int(count[0, h, i]), m)
        assert sum(int(counts[0, h, j * nb + i]) for j in range(c)) == n_i
        got = np.concatenate([np.asarray(s_c)[0, h, j * nb + i, :int(counts[0, h, j * nb + i])] for j in range(c)])
        np.testing.assert_array_equal(got, np.asarray(starts)[0, h, i, :n_i])
        got_h = np.concatenate([np.asarray(h_c)[0, h, j * nb + i, :int(counts[0, h, j * nb + i])] for j in range(c)])
        np.testing.assert_array_equal(got_h, got + 7)


@pytest.mark.parametrize("windows,causal,gap,window", [(False, True, 0, 0), (False, True, 40, 0),
                                                       (False, True, 0, 300), (True, True, 16, 0),
                                                       (False, False, 0, 0)])
def test_visible_entries_are_the_entries_every_row_sees_whole(windows, causal, gap, window):
    """`mosaic_lists.visible_entries` (entries whose position mask the kernel skips) against a walk over every
    (row, key) pair of each entry."""
    rng = np.random.default_rng(7 + gap + window + windows)
    bq, bk, tp, sp, kv_len, m = 64, 32, 256, 640, 600, 9
    q_pos = jnp.asarray(np.stack([np.sort(rng.choice(700, tp, replace=False)) for _ in range(2)])[None], jnp.int32)
    # keys shuffled within each 32-key block of one head, across the whole range in the other
    k_pos = jnp.asarray(np.stack([rng.permuted(np.arange(sp).reshape(-1, bk), axis=1).reshape(-1),
                                  rng.permutation(sp)])[None], jnp.int32)
    nq = tp // bq
    if windows:
        starts = rng.integers(0, (sp - bk) // 8, (1, 2, nq, m)) * 8
        lo = starts + rng.integers(0, 2, starts.shape) * 8
        hi = np.minimum(starts + bk, lo + bk)
        blocks, ranges = jnp.asarray(starts, jnp.int32), (jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32))
    else:
        blocks = jnp.asarray(rng.integers(-1, sp // bk + 1, (1, 2, nq, m)), jnp.int32)
        ranges = None
    got = np.asarray(mosaic_lists.visible_entries(blocks, nq, q_pos, k_pos, ranges, block_q=bq, block_k=bk,
                                                kv_len=kv_len, causal=causal, gap=gap, window=window))
    qp, kp, bl = np.asarray(q_pos)[0], np.asarray(k_pos)[0], np.asarray(blocks)[0]
    for h, i, j in np.ndindex(2, nq, m):
        b = bl[h, i, j]
        start = b if windows else b * bk
        if not (0 <= start and start + bk <= sp) or (windows and not (ranges[0][0, h, i, j] == b
                                                                      and ranges[1][0, h, i, j] == b + bk)):
            assert got[0, h, i, j] == 0
            continue
        keys = kp[h, start:start + bk][None, :]
        rows = qp[h, i * bq:(i + 1) * bq][:, None]
        ok = (keys < kv_len) & ((keys + gap <= rows) if causal else True)
        if causal and window:
            ok = ok & (keys + window > rows)
        assert got[0, h, i, j] == int(np.all(ok)), (h, i, j)
    assert got.any() and not got.all()
    big = jnp.zeros((1, 1, 1, 4), jnp.int32)
    assert mosaic_lists.visible_entries(big, mosaic_lists.VISIBLE_MAX_ENTRIES, q_pos, k_pos, None, block_q=bq,
                                      block_k=bk, kv_len=kv_len, causal=True, gap=0, window=0) is None


def test_row_chunks_grow_where_the_row_copies_would_be_large():
    """`mosaic_lists.row_chunk_entries`: 128-entry chunks while the repeated rows stay within ROW_COPY_BYTES, longer
    ones past it (Grid's horizontal lines at 1M: 16,384 rows x 28 heads x 128 dims in bf16, 16,384-entry lists)."""
    cap = mosaic_lists.ROW_COPY_BYTES
    assert mosaic_lists.row_chunk_entries(2048, 2048 * 28 * 128 * 2) == 128  # 128k: 16 copies of 14.7 MB
    assert mosaic_lists.row_chunk_entries(16384, 128 * 28 * 128 * 2) == 128  # Tri-shape at 1M: 128 copies of 0.9 MB
    e = mosaic_lists.row_chunk_entries(16384, 16384 * 28 * 128 * 2)
    assert -(-16384 // e) * 16384 * 28 * 128 * 2 <= cap and e > 128
    assert mosaic_lists.row_chunk_entries(100, cap * 2) == 128  # one chunk


def test_fused_lists_are_the_blocks_then_the_column_tiles():
    """`mosaic_lists.fused_lists`: each query block's key blocks whole (an id out of range computes nothing), then
    ceil(columns / block_k) column tiles after the key blocks, the last one up to the column count."""
    bk, nk, tiles = 64, 10, 4
    blocks = jnp.asarray([[[[3, 11, 5], [0, 1, 2]]]], jnp.int32)  # [1, 1, 2, 3]; id 11 is out of range
    count = jnp.asarray([[[3, 1]]], jnp.int32)
    ccount = jnp.asarray([[[130, 0]]], jnp.int32)
    starts, lo, hi, total = mosaic_lists.fused_lists(blocks, count, ccount, block_k=bk, num_kv_blocks=nk, tiles=tiles)
    np.testing.assert_array_equal(np.asarray(total), [[[6, 1]]])
    np.testing.assert_array_equal(np.asarray(starts)[0, 0, 0, :6], [192, 0, 320, 640, 704, 768])
    np.testing.assert_array_equal(np.asarray(hi)[0, 0, 0, :6], [256, 0, 384, 704, 768, 770])
    np.testing.assert_array_equal(np.asarray(lo), np.asarray(starts))
    assert int(starts[0, 0, 1, 0]) == 0 and int(hi[0, 0, 1, 0]) == 64
    with pytest.raises(ValueError, match=r"blocks, count, column_count: expected int arrays"):
        mosaic_lists.fused_lists(blocks[0], count, ccount, block_k=bk, num_kv_blocks=nk, tiles=tiles)
    with pytest.raises(ValueError, match=r"block_k, num_kv_blocks, tiles"):
        mosaic_lists.fused_lists(blocks, count, ccount, block_k=bk, num_kv_blocks=nk, tiles=0)
    windows = BlockLayout(kv_blocks=blocks, kv_block_count=count, block_q=128, block_k=bk, q_len=200, kv_len=640,
                          kv_columns=jnp.arange(600, 640, dtype=jnp.int32)[None, None, None],
                          kv_column_count=jnp.full((1, 1, 2), 40, jnp.int32), kv_windows=True, window_align=8)
    assert mosaic_gpu.shared_columns(windows) and not mosaic_gpu.fused_columns(windows)
    q, k, v = random_qkv(7, 1, 200, 640, 1, 1, 64)
    with pytest.raises(ValueError, match="column_pass: 'fused' needs"):
        mosaic_gpu.block_sparse_attention_mosaic_gpu(q, k, v, windows, sm_scale=0.1, column_pass="fused")


@pytest.mark.parametrize("poison", [None, True, False])
def test_non_finite_values_with_the_kernel_emulated(monkeypatch, poison):
    """A NaN value row reaches only the rows that see its key when the keys are poisoned: always (default,
    ``poison=True``) or whenever some value is not finite, decided on the device (``None``); ``poison=False`` (the
    caller's promise that every value is finite) leaves the ``0 * NaN`` of masked keys to the whole tile, as the
    kernel would."""
    monkeypatch.setattr(mosaic_gpu, "launch", emulated_launch)
    q, k, v = random_qkv(8, 1, 300, 300, 2, 1, 64, jnp.float32)
    v = v.at[0, 200, 0, 3].set(jnp.nan)
    lay = BlockLayout.dense_causal(300, 300, block_q=128, block_k=64)
    out, lse = mosaic_gpu.block_sparse_attention_mosaic_gpu.__wrapped__(q, k, v, lay, sm_scale=0.125, poison=poison)
    o, l = np.asarray(out), np.asarray(lse)
    if poison is False:  # the NaN of value dim 3 in every row, the rows that mask key 200 too
        assert np.isnan(o[0, :, :, 3]).all() and np.isfinite(np.delete(o, 3, axis=-1)).all()
    else:
        assert np.isnan(o[0, 200:]).all()
        assert np.isfinite(o[0, :200]).all() and np.isfinite(l[0, :, :200]).all()
        ref, _ = masked_dense_attention(q, k, v.at[0, 200].set(0.0), lay.to_dense_mask())
        assert rel_err(o[0, :200], np.asarray(ref)[0, :200]) < 1e-5
    with pytest.raises(ValueError, match="poison: expected None, True or False"):
        mosaic_gpu.block_sparse_attention_mosaic_gpu(q, k, v, lay, sm_scale=0.125, poison=1)


def test_range_list_helpers_name_bad_inputs():
    """`chunk_entries` / `in_range` refuse what they cannot cut, naming the argument."""
    lay = range_layout(np.random.default_rng(10), 1, 2, 300, 900, 128, 64, 1, 3)
    with pytest.raises(ValueError, match=r"entries, count: expected int arrays"):
        mosaic_lists.chunk_entries((lay.kv_blocks[..., 0],), lay.kv_block_count, 4)
    with pytest.raises(ValueError, match=r"chunk: expected an int >= 2"):
        mosaic_lists.chunk_entries((lay.kv_blocks,), lay.kv_block_count, 1)
    with pytest.raises(ValueError, match=r"layout.q_block_range: expected \(lo, hi\)"):
        mosaic_lists.in_range(lay.kv_block_count, lay.replace(q_block_range=None))
    with pytest.raises(ValueError, match=r"x: expected \[B\|1, N\|1, nq\|1, ...\] with nq = 3"):
        mosaic_lists.in_range(lay.kv_block_count[:, :, :2], lay)
    k = jnp.ones((1, 900, 1, 64), jnp.float32)
    per_block = lay.replace(kv_columns=jnp.zeros((1, 2, 3, 4), jnp.int32),
                            kv_column_count=jnp.ones((1, 2, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"layout: expected shared columns .* received \(1, 2, 3, 4\) / None"):
        mosaic_gpu._keys_with_columns(k, k, per_block, 64)


def strided_layout(rng, t: int, n: int, stride: int, block_q: int, density: float, columns: int = 0) -> BlockLayout:
    """A random layout over ``t`` queries / keys whose rows go phase by phase (each head its own phase order), so
    every query block is one strided box (`BlockLayout.q_row_stride`); with ``columns``, that many shared columns in
    the second half of the keys (each query block a random prefix), blocks in the first half."""
    q_perm = np.stack([np.concatenate([np.arange(p, t, stride) for p in rng.permutation(stride)]) for _ in range(n)])
    nq, nk = t // block_q, t // 64
    mask = rng.random((1, n, nq, nk)) < density
    extra = {}
    if columns:
        mask[..., nk // 2:] = False
        cols = np.sort(rng.choice(np.arange(nk // 2 * 64, t), size=columns, replace=False)).astype(np.int32)
        extra = dict(kv_columns=jnp.asarray(cols)[None, None, None],
                     kv_column_count=jnp.asarray(rng.integers(0, columns + 1, size=(1, n, nq)), jnp.int32))
    return BlockLayout.from_block_mask(jnp.asarray(mask), q_len=t, kv_len=t, block_q=block_q, block_k=64,
                                       q_perm=jnp.asarray(q_perm[None], jnp.int32), **extra
                                       ).replace(q_row_stride=stride)


@pytest.mark.parametrize("column_pass", [None, "fused"])
def test_strided_rows_read_and_write_in_place(monkeypatch, column_pass):
    """A layout whose query blocks are strided boxes of the original rows (`BlockLayout.q_row_stride`, Grid's
    phase-major rows): the Mosaic passes take q in its ``[B, T / stride, stride, N, D]`` view and each block's first
    row (no gather of q, out written in the original order); exact against the layout's mask, with a per-head row
    order, with and without shared columns in the launch."""
    launches = []
    monkeypatch.setattr(mosaic_gpu, "launch", lambda *a, **kw: launches.append(kw.get("row_stride", 0))
                        or emulated_launch(*a, **kw))
    t, n = 1024, 4
    q, k, v = random_qkv(12, 1, t, t, n, 2, 64, jnp.float32)
    layout = strided_layout(np.random.default_rng(3), t, n, 8, 128, 0.3, columns=70 if column_pass else 0)
    check_layout_values(layout)
    assert mosaic_gpu.strided_rows(layout, q, column_pass or "fused")
    out, lse = mosaic_gpu.block_sparse_attention_mosaic_gpu.__wrapped__(q, k, v, layout, sm_scale=64 ** -0.5,
                                                                        column_pass=column_pass and "fused")
    assert launches == [8]
    _assert_matches_mask(out, lse, q, k, v, layout)
    broken = layout.replace(q_perm=jnp.roll(layout.q_perm, 1, axis=-1))
    with pytest.raises(ValueError, match="q_row_stride=8"):
        check_layout_values(broken)


def test_a_closed_over_layout_is_checked_and_not_folded_under_jit():
    """A concrete layout closed over under jit: its value checks run on the host (the strided-rows check once raised
    a TracerArrayConversionError there), a broken promise is still refused, and its arrays reach the passes behind an
    optimization barrier (XLA would otherwise evaluate their preparation at compile time); the result is the eager
    one."""
    t, n = 256, 2
    q, k, v = random_qkv(15, 1, t, t, n, 1, 64, jnp.float32)
    layout = strided_layout(np.random.default_rng(4), t, n, 8, 32, 0.4)
    run = jax.jit(lambda q, k, v: block_sparse_attention(q, k, v, layout, implementation="reference"))
    assert "optimization_barrier" in run.lower(q, k, v).as_text()
    out, lse = run(q, k, v)
    ref_o, ref_l = block_sparse_attention(q, k, v, layout, implementation="reference")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_o))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_l))
    broken = layout.replace(q_perm=jnp.roll(layout.q_perm, 1, axis=-1))
    with pytest.raises(ValueError, match="q_row_stride=8"):
        jax.jit(lambda q, k, v: block_sparse_attention(q, k, v, broken, implementation="reference"))(q, k, v)


@pytest.mark.parametrize("shared,rows", [(True, False), (False, False), (True, True)])
def test_per_head_key_orders_copy_keys_per_group_where_the_heads_agree(monkeypatch, shared, rows):
    """A key order per query head over grouped heads (Grid with searched strides): where each group's heads agree
    (`same_key_orders`, decided on the device) the block pass (or the rows pass of a ``q_block_range``) reads one
    copy of k / v per key / value head, else one per query head; exact against the layout's mask either way (the
    launch that ran records its key heads)."""
    ran = []

    def recording(q_in, k_in, *a, **kw):
        heads = k_in.shape[2]
        jax.debug.callback(lambda: ran.append(heads))
        return emulated_launch(q_in, k_in, *a, **kw)

    monkeypatch.setattr(mosaic_gpu, "launch", recording)
    t, s, n, kh = 300, 500, 6, 2
    rng = np.random.default_rng(21 + shared)
    q, k, v = random_qkv(16, 2, t, s, n, kh, 64, jnp.float32)
    if rows:
        lay = range_layout(rng, 2, n, t, s, 64, 64, 1, 4, density=0.4, perm=True)
    else:
        lay = random_layout(rng, 2, n, t, s, 64, 64, density=0.4, perm=True)
    if shared:  # each group's heads take its first head's order; the groups differ
        lay = lay.replace(kv_perm=jnp.repeat(lay.kv_perm[:, ::n // kh], n // kh, axis=1))
    assert mosaic_gpu.per_head_key_orders(lay, n, kh) and not mosaic_gpu.per_head_key_orders(lay, n, n)
    assert bool(mosaic_gpu.same_key_orders(lay, kh)) == shared
    if rows:
        r, o, l = jax.jit(lambda q, k, v, lay: mosaic_gpu.block_sparse_attention_rows_mosaic_gpu.__wrapped__(
            q, k, v, lay, sm_scale=64 ** -0.5, key_pairs=False))(q, k, v, lay)
        out, lse = scatter_rows(r, o, l, t)
    else:
        out, lse = jax.jit(lambda q, k, v, lay: mosaic_gpu.block_sparse_attention_mosaic_gpu.__wrapped__(
            q, k, v, lay, sm_scale=64 ** -0.5, key_pairs=False, persistent=False))(q, k, v, lay)
    jax.effects_barrier()
    assert ran == [kh if shared else n]
    _assert_matches_mask(out, lse, q, k, v, lay)


def test_key_order_helpers_name_bad_inputs():
    """`per_head_key_orders` / `same_key_orders` refuse head counts that do not group and a layout without a key order
    per head, naming the argument."""
    lay = random_layout(np.random.default_rng(22), 1, 6, 200, 300, 64, 64, density=0.4, perm=True)
    with pytest.raises(ValueError, match=r"kv_heads: expected a divisor of q_heads=6; received 4"):
        mosaic_gpu.per_head_key_orders(lay, 6, 4)
    with pytest.raises(ValueError, match=r"kv_heads: expected an int >= 1; received 0"):
        mosaic_gpu.same_key_orders(lay, 0)
    with pytest.raises(ValueError, match=r"layout.kv_perm: expected int32 \[B\|1, N, S\]; received None"):
        mosaic_gpu.same_key_orders(lay.replace(kv_perm=None), 2)
