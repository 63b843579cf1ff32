"""Key windows (``BlockLayout.kv_windows``): block_k-wide key tiles at any start, a window computing
only the keys past the previous one's end. Kernel (interpret) and reference equal masked dense
attention on the mask the layout names; the mask follows the trimming rule; bad layouts are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from pallas_kernels import BlockLayout, block_sparse_attention
from pallas_kernels.block_sparse.mosaic_gpu import block_sparse_attention_mosaic_gpu
from pallas_kernels.block_sparse.mosaic_lists import window_tiles
from pallas_kernels.block_sparse.mosaic_options import check_supported, preferred
from pallas_kernels.block_sparse.validation import check_layout_values
from tests.pallas_kernels.helpers import masked_dense_attention, random_qkv, rel_err


def random_window_layout(rng, b, n, t, s, bq, bk, *, columns=0, perm=False, max_windows=6):
    """Random ascending window starts in (-bk, s) (overlapping ones included), an empty query block,
    and optional single columns outside every window."""
    nq = -(-t // bq)
    starts = np.zeros((b, n, nq, max_windows), np.int32)
    count = np.zeros((b, n, nq), np.int32)
    cols = np.zeros((b, n, nq, max(columns, 1)), np.int32)
    ccount = np.zeros((b, n, nq), np.int32)
    for idx in np.ndindex(b, n, nq):
        if idx[2] == 1:
            continue  # an empty query block
        m = int(rng.integers(1, max_windows + 1))
        a = np.sort(rng.choice(np.arange(-bk + 1, s), size=m, replace=False))
        starts[idx][:m], count[idx] = a, m
        if columns:
            covered = np.zeros(s, bool)
            for x in a:
                covered[max(x, 0):x + bk] = True
            free = np.flatnonzero(~covered)
            c = rng.choice(free, size=min(columns, free.size, int(rng.integers(0, columns + 1))), replace=False)
            cols[idx][:c.size], ccount[idx] = c, c.size
    kw = {}
    if columns:
        kw = dict(kv_columns=jnp.asarray(cols), kv_column_count=jnp.asarray(ccount))
    if perm:
        kw["q_perm"] = jnp.asarray(np.stack([rng.permutation(t) for _ in range(b * n)]).reshape(b, n, t), jnp.int32)
        kw["kv_perm"] = jnp.asarray(np.stack([rng.permutation(s) for _ in range(b * n)]).reshape(b, n, s), jnp.int32)
    return BlockLayout(kv_blocks=jnp.asarray(starts), kv_block_count=jnp.asarray(count), block_q=bq, block_k=bk,
                       q_len=t, kv_len=s, kv_windows=True, **kw)


def _trimmed_mask(layout):
    """Permuted-order computed pairs by the trimming rule, in NumPy."""
    starts, count = (np.broadcast_to(np.asarray(x), np.broadcast_shapes(
        layout.kv_blocks.shape[:3], layout.kv_block_count.shape) + tail)
        for x, tail in ((layout.kv_blocks, (layout.max_blocks,)), (layout.kv_block_count, ())))
    out = np.zeros(count.shape + (layout.kv_len,), bool)
    for idx in np.ndindex(count.shape):
        end = -(2 ** 30)
        for a in starts[idx][: count[idx]]:
            lo = max(a, end, 0)
            out[idx][lo:max(lo, min(a + layout.block_k, layout.kv_len))] = True
            end = a + layout.block_k
    return out


CASES = [  # b, t, s, n, kh, bq, bk, columns, perm
    (1, 96, 96, 2, 1, 32, 16, 0, False),
    (2, 70, 130, 4, 2, 32, 32, 5, False),  # ragged (queries are the last 70 of 130), GQA, columns
    (1, 64, 100, 2, 2, 16, 32, 3, True),   # block_q < block_k, permuted queries and keys
]


@pytest.mark.parametrize("b,t,s,n,kh,bq,bk,columns,perm", CASES)
def test_windows_equal_masked_dense_attention(b, t, s, n, kh, bq, bk, columns, perm):
    rng = np.random.default_rng(b * t + s)
    layout = random_window_layout(rng, b, n, t, s, bq, bk, columns=columns, perm=perm)
    check_layout_values(layout)
    np.testing.assert_array_equal(np.asarray(layout.computed_pairs_permuted())[..., ::bq, :],
                                  _trimmed_mask(layout) | np.asarray(
                                      layout.replace(kv_block_count=jnp.zeros_like(layout.kv_block_count))
                                      .computed_pairs_permuted())[..., ::bq, :])
    q, k, v = random_qkv(s + t, b, t, s, n, kh, 32)
    ref, ref_lse = masked_dense_attention(q, k, v, layout.to_dense_mask())
    for impl in ("triton", "reference"):
        out, lse = block_sparse_attention(q, k, v, layout, implementation=impl, interpret=True)
        assert rel_err(out, ref) < 1e-5, impl
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4, rtol=1e-5)


def test_overlapping_windows_count_each_key_once():
    """Windows at 0, 10, 20 (block_k 16) compute keys 0..35 once: same result as one dense prefix."""
    t = s = 64
    q, k, v = random_qkv(3, 1, t, s, 1, 1, 16)
    starts = jnp.asarray([[[[0, 10, 20]]]], jnp.int32)
    win = BlockLayout(kv_blocks=starts, kv_block_count=jnp.full((1, 1, 4), 3, jnp.int32), block_q=16, block_k=16,
                      q_len=t, kv_len=s, kv_windows=True)
    mask = (jnp.arange(s) < 36)[None, None, None, :] & (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None])
    ref, _ = masked_dense_attention(q, k, v, mask)
    np.testing.assert_array_equal(np.asarray(win.to_dense_mask()), np.asarray(mask))
    for impl in ("triton", "reference"):
        out, _ = block_sparse_attention(q, k, v, win, implementation=impl, interpret=True)
        assert rel_err(out, ref) < 1e-5, impl
    # density counts whole windows the kernel multiplies (clipped to [0, S)), not the trimmed keys
    assert float(win.density(causal=False)[0, 0]) == pytest.approx(48 / s)


def test_windows_jit_and_traced_out_of_range_starts_contribute_nothing():
    t = s = 64
    q, k, v = random_qkv(4, 1, t, s, 2, 1, 16)
    ok = jnp.asarray([[[[-5, 30]]]], jnp.int32)
    bad = jnp.asarray([[[[-40, -5, 30, 64, 90]]]], jnp.int32)  # -40 and >= S: nothing; -5: keys 0..10

    def run(starts):
        lay = BlockLayout(kv_blocks=starts, kv_block_count=jnp.full((1, 1, 4), starts.shape[-1], jnp.int32),
                          block_q=16, block_k=16, q_len=t, kv_len=s, kv_windows=True)
        return block_sparse_attention(q, k, v, lay, implementation="triton", interpret=True)[0]

    want = jax.jit(run)(ok)
    got = jax.jit(run)(bad)
    assert bool(jnp.all(jnp.isfinite(got))) and rel_err(got, want) < 1e-6


@pytest.mark.parametrize("starts,count,match", [
    ([[-16, 5]], [2], r"window starts in \(-16, 64\)"),
    ([[3, 64]], [2], r"window starts in \(-16, 64\)"),
    ([[8, 8]], [2], "strictly ascending"),
    ([[20, 4]], [2], "strictly ascending"),
])
def test_bad_windows_are_refused_naming_the_field(starts, count, match):
    lay = BlockLayout(kv_blocks=jnp.asarray([[starts[0]]] * 1, jnp.int32)[None].reshape(1, 1, 1, -1),
                      kv_block_count=jnp.asarray(count * 4, jnp.int32).reshape(1, 1, 4), block_q=16, block_k=16,
                      q_len=64, kv_len=64, kv_windows=True)
    with pytest.raises(ValueError, match=match):
        check_layout_values(lay)
    q, k, v = random_qkv(5, 1, 64, 64, 1, 1, 16)
    with pytest.raises(ValueError, match="layout.kv_blocks"):
        block_sparse_attention(q, k, v, lay, interpret=True)


def test_column_inside_a_window_is_refused():
    lay = BlockLayout(kv_blocks=jnp.asarray([[[[3, 40]]]], jnp.int32), kv_block_count=jnp.full((1, 1, 4), 2, jnp.int32),
                      kv_columns=jnp.asarray([[[[30, 18]]]], jnp.int32),  # 18 is inside [3, 19)
                      kv_column_count=jnp.full((1, 1, 4), 2, jnp.int32), block_q=16, block_k=16, q_len=64, kv_len=64,
                      kv_windows=True)
    with pytest.raises(ValueError, match="columns outside the listed key windows"):
        check_layout_values(lay)
    ok = lay.replace(kv_columns=jnp.asarray([[[[30, 19]]]], jnp.int32))
    check_layout_values(ok)


def test_checkify_contract_check_knows_windows():
    good = BlockLayout(kv_blocks=jnp.asarray([[[[-3, 20]]]], jnp.int32), kv_block_count=jnp.full((1, 1, 4), 2,
                       jnp.int32), block_q=16, block_k=16, q_len=64, kv_len=64, kv_windows=True)
    err, _ = checkify.checkify(lambda lay: lay.check())(good)
    err.throw()
    bad = good.replace(kv_blocks=jnp.asarray([[[[20, -3]]]], jnp.int32))
    err, _ = checkify.checkify(lambda lay: lay.check())(bad)
    with pytest.raises(checkify.JaxRuntimeError, match="strictly ascending"):
        err.throw()
    aligned = good.replace(kv_blocks=jnp.asarray([[[[-3, 24]]]], jnp.int32), window_align=8)  # starts <= 0: any
    err, _ = checkify.checkify(lambda lay: lay.check())(aligned)
    err.throw()
    check_layout_values(aligned)
    err, _ = checkify.checkify(lambda lay: lay.check())(good.replace(window_align=8))  # 20 is no multiple of 8
    with pytest.raises(checkify.JaxRuntimeError, match="multiples of window_align=8"):
        err.throw()
    with pytest.raises(ValueError, match="multiples of layout.window_align=8; received e.g. 20"):
        check_layout_values(good.replace(window_align=8))
    with pytest.raises(ValueError, match="layout.window_align: expected 1 for a layout without kv_windows"):
        check_layout_values(good.replace(kv_windows=False, kv_blocks=jnp.asarray([[[[0, 1]]]], jnp.int32),
                                          window_align=8))


@pytest.mark.parametrize("bq,perm,columns,align", [(128, False, 0, 1), (64, False, 5, 1), (64, True, 0, 1),
                                                   (64, False, 0, 8)])
def test_mosaic_gpu_window_layouts_lower_for_cuda(bq, perm, columns, align):
    """The Mosaic GPU kernel takes key windows (run on the GPU: test_mosaic_gpu_gpu.py); it is the default for
    them on sm90 (`preferred`) only where the layout promises starts on multiples of 8 (``window_align``; the
    wrapper then passes one tile per window, `window_tiles(aligned=True)`)."""
    lay = random_window_layout(np.random.default_rng(bq + perm), 1, 2, 300, 340, bq, 64, columns=columns, perm=perm)
    q = jnp.ones((1, 300, 2, 128), jnp.bfloat16)
    check_supported(q, lay, None)
    assert not preferred(q, lay, 1)
    assert preferred(q, lay.replace(window_align=8), 1) and not preferred(q, lay.replace(window_align=4), 1)
    lay = lay.replace(window_align=align)  # lowered from shapes: the starts' values do not matter here
    # the Mosaic column pass: the default Triton one needs a GPU to lower its Triton kernel
    f = jax.jit(lambda q, k, v, lay: block_sparse_attention_mosaic_gpu(q, k, v, lay, sm_scale=0.1,
                                                                        column_pass="mosaic"))
    kv = jax.ShapeDtypeStruct((1, 340, 1, 128), jnp.bfloat16)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), lay)
    lowered = f.trace(jax.ShapeDtypeStruct(q.shape, q.dtype), kv, kv, abstract).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("bk,s", [(64, 300), (128, 1000)])
def test_mosaicwindow_tiles_cover_each_windows_keys_once(bk, s):
    """`window_tiles` (the Mosaic GPU kernel's form of a window list): tile starts are multiples of 8 inside the
    padded keys, each tile's range lies inside it, and per query block the ranges cover exactly the keys the
    layout's rule names (`_trimmed_mask`), each once; a window on a multiple of 8 takes one tile."""
    rng = np.random.default_rng(bk + s)
    lay = random_window_layout(rng, 2, 3, 200, s, 64, bk, max_windows=9)
    s_pad = -(-s // bk) * bk
    tiles, lo, hi, count = (np.asarray(x) for x in window_tiles(lay.kv_blocks, lay.kv_block_count, bk, s, s_pad))
    want = _trimmed_mask(lay)
    for idx in np.ndindex(count.shape):
        got = np.zeros(s, int)
        for t, a, z in zip(tiles[idx][:count[idx]], lo[idx][:count[idx]], hi[idx][:count[idx]]):
            assert t % 8 == 0 and 0 <= t <= s_pad - bk and t <= a < z <= t + bk, (t, a, z)
            got[a:z] += 1
        np.testing.assert_array_equal(got, want[idx].astype(int))
    aligned = jnp.asarray([[[[-64, 0, 40, 200]]]], jnp.int32)
    _, _, _, n = window_tiles(aligned, jnp.full((1, 1, 1), 4, jnp.int32), 64, 300, 320)
    assert int(n[0, 0, 0]) == 3  # -64 computes nothing; 0, 40 and 200 one tile each


@pytest.mark.parametrize("bk,s", [(32, 300), (64, 1000)])
def test_window_tiles_of_aligned_windows_are_the_general_forms_first_entries(bk, s):
    """``aligned=True`` (starts on multiples of 8, overlapping, before 0 and past the keys included): M-wide
    outputs equal to the first M entries of the general form, whose other entries are unused."""
    rng = np.random.default_rng(bk + s)
    m, s_pad = 9, -(-s // bk) * bk
    starts = np.sort(np.stack([rng.choice(np.arange(-bk + 8, s + 16, 8), m, replace=False) for _ in range(2 * 3 * 4)]))
    starts = jnp.asarray(starts.reshape(2, 3, 4, m), jnp.int32)
    count = jnp.asarray(rng.integers(0, m + 1, size=(2, 3, 4)), jnp.int32)
    general = window_tiles(starts, count, bk, s, s_pad)
    fit = window_tiles(starts, count, bk, s, s_pad, aligned=True)
    assert fit[0].shape == starts.shape and general[0].shape[-1] == 2 * m
    np.testing.assert_array_equal(fit[3], general[3])
    assert int(jnp.max(general[3])) <= m
    for got, want in zip(fit[:3], general[:3], strict=True):
        np.testing.assert_array_equal(got, want[..., :m])
        assert not np.asarray(want[..., m:]).any()
