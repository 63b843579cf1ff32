"""GPU checks of the Mosaic GPU (Hopper) kernel against the masked dense reference: `pytest -m gpu`.

Mosaic GPU's interpret mode cannot run this kernel on a CPU (see `mosaic_gpu.py`), so every
kernel-vs-reference check lives here and needs an sm90 GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BlockLayout, block_sparse_attention
from pallas_kernels.block_sparse import block_sparse_attention_rows
from pallas_kernels.block_sparse.merge import merge_onto
from pallas_kernels.block_sparse.mosaic_gpu import block_sparse_attention_mosaic_gpu
from pallas_kernels.platform import is_sm90
from tests.pallas_kernels.block_sparse.test_rows import range_layout, strided_layout
from tests.pallas_kernels.block_sparse.test_windows import random_window_layout
from tests.pallas_kernels.helpers import (
    masked_dense_attention,
    random_layout,
    random_qkv,
    rel_err,
)

pytestmark = pytest.mark.gpu


needs_hopper = pytest.mark.skipif(not is_sm90(), reason="needs an sm90 (Hopper) GPU")
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3}


def _check(out, lse, q, k, v, layout, dtype):
    ref_out, ref_lse = masked_dense_attention(q, k, v, layout.to_dense_mask())
    out32 = np.asarray(out, np.float32)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == ref_lse.shape
    assert not np.isnan(out32).any(), "NaN in output"
    assert rel_err(out32, ref_out) < TOL[dtype], rel_err(out32, ref_out)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    np.testing.assert_array_equal(lse[~fin], -np.inf)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=3e-2)
    np.testing.assert_array_equal(np.einsum("btnd->bntd", out32)[~fin], 0.0)  # empty rows are 0


@needs_hopper
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("b,t,s,n,kh,d,bk", [
    (1, 1000, 1000, 28, 4, 128, 64),   # ragged T = S, GQA 7
    (2, 300, 777, 8, 2, 64, 128),      # suffix queries, ragged
    (1, 513, 1024, 4, 4, 80, 64),      # D padded to 128
])
@pytest.mark.parametrize("perm,columns", [(False, 0), (True, 0), (False, 24), (True, 24)])
def test_mosaic_matches_dense(dtype, b, t, s, n, kh, d, bk, perm, columns):
    rng = np.random.default_rng(t + s + d + 7 * columns + perm)
    q, k, v = random_qkv(int(rng.integers(1 << 30)), b, t, s, n, kh, d, dtype)
    layout = random_layout(rng, b, n, t, s, 128, bk, density=0.3, perm=perm, columns=columns)
    out, lse = block_sparse_attention(q, k, v, layout, implementation="mosaic_gpu")
    _check(out, lse, q, k, v, layout, dtype)


@needs_hopper
@pytest.mark.parametrize("b,t,s,n,kh,d,bk,density", [
    (1, 1000, 1000, 28, 4, 128, 64, 0.3),  # ragged, odd number of 64-row query blocks (16)
    (2, 300, 777, 8, 2, 64, 128, 0.5),     # suffix queries; 5 query blocks: the last CTA has one
    (1, 700, 700, 4, 4, 128, 64, 0.05),    # lists of very different lengths (idle steps), empty rows
])
@pytest.mark.parametrize("perm,columns", [(False, 0), (True, 24)])
def test_mosaic_64_row_query_blocks_match_dense(b, t, s, n, kh, d, bk, density, perm, columns):
    """block_q 64: each consumer warpgroup has its own query block, list and ring of stages."""
    rng = np.random.default_rng(t + s + d + 7 * columns + perm + 64)
    q, k, v = random_qkv(int(rng.integers(1 << 30)), b, t, s, n, kh, d, jnp.bfloat16)
    layout = random_layout(rng, b, n, t, s, 64, bk, density=density, perm=perm, columns=columns)
    out, lse = block_sparse_attention(q, k, v, layout, implementation="mosaic_gpu")
    _check(out, lse, q, k, v, layout, jnp.bfloat16)


@needs_hopper
@pytest.mark.parametrize("gap,window,perm", [(192, 0, False), (0, 192, False), (0, 100, True), (64, 0, True)])
def test_mosaic_causal_gap_and_window(gap, window, perm):
    b, t, s, n, kh, d = 1, 700, 900, 4, 2, 64
    rng = np.random.default_rng(gap + window + perm)
    q, k, v = random_qkv(int(rng.integers(1 << 30)), b, t, s, n, kh, d, jnp.bfloat16)
    layout = random_layout(rng, b, n, t, s, 128, 64, density=0.6, perm=perm).replace(gap=gap, window=window)
    out, lse = block_sparse_attention(q, k, v, layout, implementation="mosaic_gpu")
    _check(out, lse, q, k, v, layout, jnp.bfloat16)


@needs_hopper
@pytest.mark.parametrize("perm", [False, True])
def test_mosaic_non_causal(perm):
    b, t, s, n, kh, d = 2, 256, 640, 4, 1, 128
    rng = np.random.default_rng(11 + perm)
    q, k, v = random_qkv(int(rng.integers(1 << 30)), b, t, s, n, kh, d, jnp.float16)
    layout = random_layout(rng, b, n, t, s, 128, 128, density=0.5, perm=perm, lead_b=1)
    out, lse = block_sparse_attention(q, k, v, layout, causal=False, implementation="mosaic_gpu")
    ref_out, ref_lse = masked_dense_attention(q, k, v, layout.to_dense_mask(causal=False))
    assert rel_err(out, ref_out) < TOL[jnp.float16]
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], atol=3e-2)


@needs_hopper
def test_default_on_sm90_is_mosaic_where_supported():
    q, k, v = random_qkv(4, 1, 512, 512, 4, 2, 128, jnp.bfloat16)
    layout = BlockLayout.dense_causal(512, 512, block_q=128, block_k=64)
    out, lse = block_sparse_attention(q, k, v, layout)
    out_m, lse_m = block_sparse_attention(q, k, v, layout, implementation="mosaic_gpu")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_m))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_m))
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))  # fp32: Triton
    out32, _ = block_sparse_attention(q32, k32, v32, layout)
    out_t, _ = block_sparse_attention(q32, k32, v32, layout, implementation="triton")
    np.testing.assert_array_equal(np.asarray(out32), np.asarray(out_t))
    rng = np.random.default_rng(5)
    cols = random_layout(rng, 1, 4, 512, 512, 128, 64, density=0.3, columns=24)  # single key columns: Mosaic
    np.testing.assert_array_equal(np.asarray(block_sparse_attention(q, k, v, cols)[0]),
                                  np.asarray(block_sparse_attention(q, k, v, cols, implementation="mosaic_gpu")[0]))
    # key windows from multiples of 8 (window_align 8): Mosaic
    starts = np.sort(np.stack([rng.choice(np.arange(0, 512 - 64, 8), 3, replace=False) for _ in range(4 * 8)]))
    windows = BlockLayout(kv_blocks=jnp.asarray(starts.reshape(1, 4, 8, 3), jnp.int32),
                          kv_block_count=jnp.full((1, 4, 8), 3, jnp.int32), block_q=64, block_k=64, q_len=512,
                          kv_len=512, kv_windows=True, window_align=8)
    out_w, lse_w = block_sparse_attention(q, k, v, windows)
    out_wm, lse_wm = block_sparse_attention(q, k, v, windows, implementation="mosaic_gpu")
    np.testing.assert_array_equal(np.asarray(out_w), np.asarray(out_wm))
    np.testing.assert_array_equal(np.asarray(lse_w), np.asarray(lse_wm))


@needs_hopper
@pytest.mark.parametrize("bk,stages", [(64, None), (128, None), (128, 2)])
def test_mosaic_dense_layout_matches_cudnn(bk, stages):
    q, k, v = random_qkv(3, 1, 4096, 4096, 28, 4, 128, jnp.bfloat16)
    layout = BlockLayout.dense_causal(4096, 4096, block_q=128, block_k=bk)
    out, _ = block_sparse_attention(q, k, v, layout, implementation="mosaic_gpu", num_stages=stages)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    assert rel_err(out, ref) < 2e-2


@needs_hopper
def test_mosaic_empty_rows_and_ids_out_of_range():
    b, t, s, n, kh, d = 1, 384, 384, 2, 1, 64
    q, k, v = random_qkv(5, b, t, s, n, kh, d, jnp.bfloat16)
    layout = BlockLayout.dense_causal(t, s, block_q=128, block_k=64, heads=n)
    counts = np.array(layout.kv_block_count)
    counts[:, 0, 1] = 0  # head 0, query block 1 computes nothing
    layout = layout.replace(kv_block_count=jnp.asarray(counts))
    out, lse = block_sparse_attention(q, k, v, layout, implementation="mosaic_gpu")
    _check(out, lse, q, k, v, layout, jnp.bfloat16)
    # An id out of range under jit (not checkable there) contributes nothing.
    bad = layout.replace(kv_blocks=layout.kv_blocks.at[..., 0].set(99))
    f = jax.jit(lambda q, k, v, lay: block_sparse_attention(q, k, v, lay, implementation="mosaic_gpu"))
    out_bad, lse_bad = f(q, k, v, bad)
    ref_layout = BlockLayout.from_block_mask(  # the same lists with block 0 left out
        jnp.asarray(_block_mask(layout) & (np.arange(layout.num_kv_blocks) != 0)),
        q_len=t, kv_len=s, block_q=128, block_k=64)
    _check(out_bad, lse_bad, q, k, v, ref_layout, jnp.bfloat16)


def _block_mask(layout):
    nk = layout.num_kv_blocks
    blocks = np.broadcast_to(np.asarray(layout.kv_blocks), layout.kv_block_count.shape + (layout.max_blocks,))
    count = np.asarray(layout.kv_block_count)
    mask = np.zeros(count.shape + (nk,), bool)
    for idx in np.ndindex(*count.shape):
        mask[idx][blocks[idx][: count[idx]]] = True
    return mask


@needs_hopper
def test_mosaic_nonfinite_value_poisons_its_rows():
    b, t, s, n, kh, d = 1, 256, 256, 2, 1, 64
    q, k, v = random_qkv(9, b, t, s, n, kh, d, jnp.bfloat16)
    v = v.at[0, 100, 0, 3].set(jnp.nan)
    layout = BlockLayout.dense_causal(t, s, block_q=128, block_k=64)
    out, lse = block_sparse_attention(q, k, v, layout, implementation="mosaic_gpu")
    out32 = np.asarray(out, np.float32)
    assert np.isnan(out32[0, 100:]).all() and np.isnan(np.asarray(lse)[0, :, 100:]).all()
    assert np.isfinite(out32[0, :100]).all() and np.isfinite(np.asarray(lse)[0, :, :100]).all()


@needs_hopper
@pytest.mark.parametrize("block_q,perm,columns,extra", [(128, False, 0, {}), (64, False, 0, {}), (128, True, 24, {}),
                                                        (64, True, 0, {}), (64, False, 0, {"overlap": True}),
                                                        (128, True, 24, {"column_pass": "mosaic"})])
def test_mosaic_persistent_grid_runs_many_items_per_cta(block_q, perm, columns, extra):
    """More work items (128 query rows, head, batch) than multiprocessors: each CTA of the persistent grid
    (``persistent=True``) runs several in turn (longest first, `item_order`, in snake rounds), its rings of K / V
    stages carrying over from item to item and each consumer's next Q loading during its last step. The result is
    the masked dense one and equals, bit for bit, the kernel's with one CTA per item; the API runs the persistent
    grid here by default (`auto_persistent`: short work)."""
    b, t, s, n, kh, d = 2, 3000, 3000, 16, 4, 128  # 24 x 16 x 2 = 768 items
    rng = np.random.default_rng(block_q + 3 * perm + columns)
    q, k, v = random_qkv(int(rng.integers(1 << 30)), b, t, s, n, kh, d, jnp.bfloat16)
    layout = random_layout(rng, b, n, t, s, block_q, 64, density=0.2, perm=perm, columns=columns)
    persistent = block_sparse_attention_mosaic_gpu(q, k, v, layout, sm_scale=d ** -0.5, persistent=True, **extra)
    _check(*persistent, q, k, v, layout, jnp.bfloat16)
    per_item = block_sparse_attention_mosaic_gpu(q, k, v, layout, sm_scale=d ** -0.5, persistent=False, **extra)
    if not extra:  # the API's defaults
        out, _ = block_sparse_attention(q, k, v, layout, implementation="mosaic_gpu")
        np.testing.assert_array_equal(np.asarray(persistent[0]), np.asarray(out))
    for a, c in zip(persistent, per_item, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@needs_hopper
@pytest.mark.parametrize("block_q,persistent,perm,columns", [(128, False, False, 0), (64, False, True, 24),
                                                             (128, True, False, 0), (64, True, False, 0)])
def test_mosaic_heads_first_is_the_same_result(block_q, persistent, perm, columns):
    """``heads_first=True`` only changes which work items run together (the query heads fastest): the result is
    the masked dense one and equals, bit for bit, the kernel's with query blocks fastest (GQA 4, ragged length)."""
    b, t, s, n, kh, d = 2, 1500, 1500, 16, 4, 128
    rng = np.random.default_rng(block_q + 7 * perm + persistent)
    q, k, v = random_qkv(int(rng.integers(1 << 30)), b, t, s, n, kh, d, jnp.bfloat16)
    layout = random_layout(rng, b, n, t, s, block_q, 64, density=0.3, perm=perm, columns=columns)
    kw = dict(sm_scale=d ** -0.5, persistent=persistent)
    first = block_sparse_attention_mosaic_gpu(q, k, v, layout, heads_first=True, **kw)
    _check(*first, q, k, v, layout, jnp.bfloat16)
    base = block_sparse_attention_mosaic_gpu(q, k, v, layout, heads_first=False, **kw)
    for x, y in zip(first, base, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@needs_hopper
@pytest.mark.parametrize("bq,bk,perm,columns,column_pass", [
    (128, 64, False, 0, "mosaic"), (64, 64, False, 24, "triton"), (64, 64, True, 24, "mosaic"),
    (128, 128, True, 0, "mosaic"), (64, 64, False, 24, "mosaic"), (64, 32, True, 24, "triton"),
    (128, 32, False, 0, "mosaic")])
def test_mosaic_key_windows_match_dense(bq, bk, perm, columns, column_pass):
    """Key windows at any start (`BlockLayout.kv_windows`, overlapping ones trimmed), ragged suffix queries, GQA,
    an empty query block; single columns through either column pass."""
    b, t, s, n, kh, d = 1, 700, 1000, 8, 2, 128
    rng = np.random.default_rng(bq + bk + perm + columns)
    q, k, v = random_qkv(int(rng.integers(1 << 30)), b, t, s, n, kh, d, jnp.bfloat16)
    layout = random_window_layout(rng, b, n, t, s, bq, bk, columns=columns, perm=perm, max_windows=12)
    out, lse = block_sparse_attention_mosaic_gpu(q, k, v, layout, sm_scale=d ** -0.5, column_pass=column_pass)
    _check(out, lse, q, k, v, layout, jnp.bfloat16)


@needs_hopper
@pytest.mark.parametrize("bq,perm,columns,windows,gap,density,bk", [
    (64, False, 0, False, 0, 0.3, 64),    # odd and even list lengths: a masked half ends odd lists
    (64, False, 0, False, 0, 0.05, 64),   # lists of one entry, very different lengths (idle steps), empty rows
    (128, False, 0, False, 0, 0.3, 64),
    (64, True, 24, False, 0, 0.3, 64),    # positions with the V slot, single columns merged
    (128, True, 0, False, 64, 0.5, 64),   # positions and a causal gap
    (64, False, 0, True, 0, 0.0, 64),     # key windows: two window tiles per step
    (64, False, 0, False, 0, 0.3, 32),    # 32-key entries, two per 64-key step
    (128, True, 24, False, 64, 0.2, 32),
    (64, True, 0, True, 0, 0.0, 32),
])
def test_mosaic_key_pairs_match_dense(bq, perm, columns, windows, gap, density, bk):
    """``key_pairs=True``: two consecutive entries per step (64-row query blocks and 64-key entries: two K stages
    and one V stage per consumer) give the masked dense result and the lse of the one-entry steps (32-key entries:
    of the Triton kernel)."""
    b, t, s, n, kh, d = 1, 1000, 1300, 8, 2, 128
    rng = np.random.default_rng(bq + 3 * perm + columns + 5 * windows + gap + int(100 * density) + bk)
    q, k, v = random_qkv(int(rng.integers(1 << 30)), b, t, s, n, kh, d, jnp.bfloat16)
    if windows:
        layout = random_window_layout(rng, b, n, t, s, bq, bk, columns=columns, perm=perm, max_windows=13)
    else:
        layout = random_layout(rng, b, n, t, s, bq, bk, density=density, perm=perm, columns=columns)
        layout = layout.replace(gap=gap)
    out, lse = block_sparse_attention_mosaic_gpu(q, k, v, layout, sm_scale=d ** -0.5, key_pairs=True)
    _check(out, lse, q, k, v, layout, jnp.bfloat16)
    if bk == 32:
        _, lse_one = block_sparse_attention(q, k, v, layout, implementation="triton")
    else:
        _, lse_one = block_sparse_attention_mosaic_gpu(q, k, v, layout, sm_scale=d ** -0.5, key_pairs=False)
    fin = np.isfinite(np.asarray(lse_one))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(lse_one)[fin], atol=1e-2)



@needs_hopper
@pytest.mark.parametrize("bq,bk,pairs,perm,columns,windows,density", [
    (64, 64, False, False, 0, False, 0.3),   # odd and even list lengths
    (64, 64, False, False, 0, False, 0.05),  # lists of 0 / 1 entries (no step after the first), empty rows
    (128, 64, True, False, 0, False, 0.3),   # 128-key steps of two entries
    (64, 64, False, True, 24, False, 0.3),   # positions (the next step's with its V tile), columns merged
    (128, 128, False, True, 0, False, 0.5),
    (64, 32, True, False, 24, True, 0.0),    # 32-key windows, two per step; Mosaic column pass with positions
])
def test_mosaic_overlap_matches_dense(bq, bk, pairs, perm, columns, windows, density):
    """``overlap=True`` (step j + 1's S, then step j's P V; step j + 1's softmax while P V runs), with and without the
    schedule barrier, and the default steps without it (``pingpong=False``) give the masked dense result and the
    lse of the default schedule."""
    b, t, s, n, kh, d = 1, 1000, 1300, 8, 2, 128
    rng = np.random.default_rng(bq + bk + 3 * perm + columns + 5 * windows + int(100 * density))
    q, k, v = random_qkv(int(rng.integers(1 << 30)), b, t, s, n, kh, d, jnp.bfloat16)
    if windows:
        layout = random_window_layout(rng, b, n, t, s, bq, bk, columns=columns, perm=perm, max_windows=13)
    else:
        layout = random_layout(rng, b, n, t, s, bq, bk, density=density, perm=perm, columns=columns)
    kw = dict(sm_scale=d ** -0.5, key_pairs=pairs, column_pass="mosaic")
    _, lse_default = block_sparse_attention_mosaic_gpu(q, k, v, layout, **kw)
    fin = np.isfinite(np.asarray(lse_default))
    for overlap, pingpong in ((True, True), (True, False), (False, False)):
        out, lse = block_sparse_attention_mosaic_gpu(q, k, v, layout, overlap=overlap, pingpong=pingpong, **kw)
        _check(out, lse, q, k, v, layout, jnp.bfloat16)
        np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(lse_default)[fin], atol=1e-2)


def _check_range_layout(q, k, v, layout):
    """A layout with a q_block_range through `block_sparse_attention` (a whole result, against the masked dense
    reference) and `block_sparse_attention_rows` (its rows: the whole result's, bit for bit)."""
    t, n = q.shape[1], q.shape[2]
    out, lse = block_sparse_attention(q, k, v, layout, implementation="mosaic_gpu")
    _check(out, lse, q, k, v, layout, jnp.bfloat16)
    rows, o, l = block_sparse_attention_rows(q, k, v, layout, implementation="mosaic_gpu")
    r = np.broadcast_to(np.asarray(rows), (1, n, rows.shape[-1]))
    for h in range(n):
        ok = r[0, h] < t
        np.testing.assert_array_equal(np.asarray(o)[0, ok, h], np.asarray(out)[0, r[0, h][ok], h])


@needs_hopper
@pytest.mark.parametrize("t,s,n,kh,bq,lo,hi,perm,gap", [
    (300, 20000, 8, 2, 128, 2, 3, False, 0),  # the last (ragged) block over 313 64-key blocks: 3 chunks
    (1000, 12000, 4, 2, 64, 0, 4, True, 128),  # permuted, a causal gap, 64-row blocks (Grid's horizontal lines)
])
def test_mosaic_q_block_range_matches_dense(t, s, n, kh, bq, lo, hi, perm, gap):
    """A layout naming a q_block_range: its rows alone, lists in chunks merged by lse (`mosaic_gpu._rows_pass`),
    through `block_sparse_attention` (a whole result) and `block_sparse_attention_rows` (its rows)."""
    rng = np.random.default_rng(t + s)
    q, k, v = random_qkv(11, 1, t, s, n, kh, 128, jnp.bfloat16)
    layout = range_layout(rng, 1, n, t, s, bq, 64, lo, hi, perm=perm, density=0.7).replace(gap=gap)
    assert layout.max_blocks > 128  # more than one chunk
    _check_range_layout(q, k, v, layout)


@needs_hopper
@pytest.mark.parametrize("column_pass", [None, "triton", "mosaic"])
def test_mosaic_shared_columns_match_dense(column_pass):
    """SF-fixed-like columns (one list for every query block and head, each block a prefix): gathered once per key
    / value head and run as windows of this kernel, by default in the block pass's launch (`_fused_column_pass`),
    with ``"mosaic"`` in one of their own (`_shared_column_pass`)."""
    rng = np.random.default_rng(3)
    t, s, n, kh = 1000, 3000, 8, 2
    q, k, v = random_qkv(12, 1, t, s, n, kh, 128, jnp.bfloat16)
    nq, nk = 8, 47
    mask = rng.random((1, n, nq, nk)) < 0.5
    mask[..., 20:] = False
    cols = np.sort(rng.choice(np.arange(20 * 64, s), size=700, replace=False)).astype(np.int32)
    layout = BlockLayout.from_block_mask(jnp.asarray(mask), q_len=t, kv_len=s, block_q=128, block_k=64,
                                         kv_columns=jnp.asarray(cols)[None, None, None],
                                         kv_column_count=jnp.asarray(rng.integers(0, 701, (1, n, nq)), jnp.int32))
    out, lse = block_sparse_attention_mosaic_gpu(q, k, v, layout, sm_scale=128 ** -0.5, column_pass=column_pass)
    _check(out, lse, q, k, v, layout, jnp.bfloat16)


@needs_hopper
@pytest.mark.parametrize("bq,perm", [(128, False), (64, True)])
def test_mosaic_q_block_range_with_shared_columns_matches_dense(bq, perm):
    """A row range with shared columns (a boundary wrapper's horizontal lines with the straddling keys): the rows
    pass with the column tiles on each list, in chunks (`mosaic_gpu._rows_pass`), through `block_sparse_attention`
    and `block_sparse_attention_rows`."""
    rng = np.random.default_rng(bq + perm)
    t, s, n, kh, lo, hi = 1000, 20000, 8, 2, 1, 3
    q, k, v = random_qkv(13, 1, t, s, n, kh, 128, jnp.bfloat16)
    nq, nk = -(-t // bq), -(-s // 64)
    mask = rng.random((1, n, nq, nk)) < 0.7
    mask[..., 250:] = False
    mask[:, :, :lo] = mask[:, :, hi:] = False
    cols = np.sort(rng.choice(np.arange(250 * 64, s), size=150, replace=False)).astype(np.int32)
    ccount = np.where((np.arange(nq) >= lo) & (np.arange(nq) < hi), rng.integers(1, 151, (1, n, nq)), 0)
    perms = dict(q_perm=jnp.asarray(rng.permutation(t), jnp.int32)[None, None],
                 kv_perm=jnp.asarray(rng.permutation(s), jnp.int32)[None, None]) if perm else {}
    layout = BlockLayout.from_block_mask(jnp.asarray(mask), q_len=t, kv_len=s, block_q=bq, block_k=64,
                                         kv_columns=jnp.asarray(cols)[None, None, None],
                                         kv_column_count=jnp.asarray(ccount, jnp.int32), **perms
                                         ).replace(q_block_range=(lo, hi))
    assert layout.max_blocks > 128  # more than one chunk
    _check_range_layout(q, k, v, layout)


@needs_hopper
@pytest.mark.parametrize("bq,persistent,columns", [(128, False, 0), (128, True, 0), (64, False, 0), (128, False, 300)])
def test_mosaic_strided_rows_match_dense(bq, persistent, columns):
    """Grid-like phase-major rows (`BlockLayout.q_row_stride`: each query block one phase, consecutive frames; each
    head its own phase order): Q read and O written as strided boxes of the original arrays. Against the masked
    dense reference, and bit for bit against the same layout with the rows gathered (q_row_stride=0)."""
    t, n = 8192, 8
    q, k, v = random_qkv(14, 1, t, t, n, 2, 128, jnp.bfloat16)
    layout = strided_layout(np.random.default_rng(bq + persistent + columns), t, n, 16, bq, 0.05, columns)
    run = jax.jit(lambda lay: block_sparse_attention_mosaic_gpu(q, k, v, lay, sm_scale=128 ** -0.5,
                                                                persistent=persistent))
    out, lse = run(layout)
    _check(out, lse, q, k, v, layout, jnp.bfloat16)
    out0, lse0 = run(layout.replace(q_row_stride=0))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out0, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse0))


@needs_hopper
@pytest.mark.parametrize("shared", [True, False])
def test_mosaic_per_head_key_orders_match_dense(shared):
    """A key order per query head over grouped heads: one copy of k / v per key / value head where each group's heads
    agree (`same_key_orders`), one per query head where they do not (a `lax.cond` on the device). Against the masked
    dense reference, and bit for bit against the per-query-head copy of the same layout (the heads as one group)."""
    b, t, n, kh = 1, 4096, 8, 2
    rng = np.random.default_rng(40 + shared)
    q, k, v = random_qkv(17, b, t, t, n, kh, 128, jnp.bfloat16)
    layout = random_layout(rng, b, n, t, t, 128, 64, density=0.1, perm=True)
    if shared:
        layout = layout.replace(kv_perm=jnp.repeat(layout.kv_perm[:, ::n // kh], n // kh, axis=1))
    run = jax.jit(lambda q, k, v, lay: block_sparse_attention_mosaic_gpu(q, k, v, lay, sm_scale=128 ** -0.5))
    out, lse = run(q, k, v, layout)
    _check(out, lse, q, k, v, layout, jnp.bfloat16)
    k_all, v_all = jnp.repeat(k, n // kh, axis=2), jnp.repeat(v, n // kh, axis=2)  # groups of one: no cond
    out1, lse1 = run(q, k_all, v_all, layout)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out1, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse1))


@needs_hopper
@pytest.mark.parametrize("case", ["plain", "persistent", "strided", "strided-persistent", "bq64", "permuted",
                                  "masked-persistent", "masked-strided", "mask-alone"])
def test_mosaic_prior_matches_merge_attention(case):
    """A prior result merged into the pass (``prior`` with ``merge_in_launch``; in the launch but for "permuted",
    whose rows are gathered), on the rows of a row mask for "masked-*" (the others keep the prior) and a mask with
    no prior ("mask-alone": the others empty): against `merge.merge_onto` of the prior with the pass's own result,
    with the prior's empty rows (lse -inf) holding NaN in out, which must add nothing."""
    t, n = 4096, 8
    rng = np.random.default_rng(len(case))
    q, k, v = random_qkv(31, 1, t, t, n, 2, 128, jnp.bfloat16)
    if "strided" in case:
        layout = strided_layout(rng, t, n, 16, 128, 0.05)
    else:
        layout = random_layout(rng, 1, n, t, t, 64 if case == "bq64" else 128, 64, density=0.1,
                               perm=case == "permuted")
    other = random_layout(rng, 1, n, t, t, 128, 64, density=0.05)  # some query blocks empty
    p_out, p_lse = block_sparse_attention(q, k, v, other, implementation="reference")
    empty = np.isneginf(np.asarray(p_lse))
    assert empty.any() and not empty.all()
    p_out = jnp.where(jnp.einsum("bnt->btn", jnp.isneginf(p_lse))[..., None], jnp.nan, p_out)
    mask = jnp.asarray(rng.random((1, t)) < 0.4) if "mask" in case else None
    prior = None if case == "mask-alone" else (p_out, p_lse)
    run = jax.jit(lambda lay, prior, mask: block_sparse_attention_mosaic_gpu(
        q, k, v, lay, sm_scale=128 ** -0.5, persistent=case.endswith("persistent"), prior=prior, row_mask=mask,
        merge_in_launch=True))
    out, lse = run(layout, prior, mask)
    ref_out, ref_lse = merge_onto(prior, [run(layout, None, None)], mask)
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    assert out.dtype == jnp.bfloat16 and not np.isnan(out32).any()
    assert rel_err(out32, ref32) < TOL[jnp.bfloat16], rel_err(out32, ref32)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=1e-3)
