"""Intra-modality patterns: outputs equal masked dense attention for the layout each builds;
estimators recover planted structure; bad hyper-parameters name themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax.sparse.layouts import LayoutSet
from mmjax.sparse.patterns import AShape, Dense, Grid, KernelOptions, SFFixed, SFStrided, TriShape, VerticalSlash
from mmjax.sparse.patterns.vertical_slash import index_pairs
from pallas_kernels import block_sparse_attention
from pallas_kernels.block_sparse.layout import causal_pairs
from pallas_kernels.block_sparse.validation import check_layout_values
from tests.pallas_kernels.helpers import masked_dense_attention, random_qkv, rel_err, wholly_masked_entries

SMALL = dict(block_q=32, block_k=16)
PATTERNS = [
    Dense(**SMALL),
    AShape(sink=20, local=70, **SMALL),
    TriShape(sink=20, local=70, last=40, **SMALL),
    SFFixed(local=40, stride=96, summary=8, **SMALL),
    SFStrided(local=40, stride=96, **SMALL),
    VerticalSlash(vertical_size=24, slash_size=32, last_q=16, keep_first=8, keep_local=16, **SMALL),
    VerticalSlash(vertical_size=24, slash_size=32, last_q=16, keep_first=8, keep_local=16, windows=True, **SMALL),
    Grid(stride_space=(64, 96, 100), last_q=16, local=48, **SMALL),
]


def _parts(layout):
    return layout.parts if isinstance(layout, LayoutSet) else (layout,)


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: type(p).__name__)
def test_no_listed_tile_is_wholly_masked(pattern):
    """Every tile a pattern's layout lists holds a pair some row of its query block sees: a wholly masked tile
    costs the kernels a step for nothing (Grid's horizontal lines listed every key block until 2026-11-29: 38% of
    that part's tiles at 128k)."""
    for b, t, s, n, kh in [(1, 200, 200, 4, 2), (2, 150, 230, 3, 1)]:
        q, k, _ = random_qkv(t + s + n, b, t, s, n, kh, 32)
        for part in _parts(mmjax.build_layout(q, k, pattern)):
            assert not wholly_masked_entries(part).any(), (t, s)


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("b,t,s,n,kh", [(1, 200, 200, 4, 2), (2, 150, 230, 3, 1)])
def test_output_equals_masked_dense_for_built_layout(pattern, b, t, s, n, kh):
    q, k, v = random_qkv(t + s + n, b, t, s, n, kh, 32)
    layout = jax.jit(lambda q, k: mmjax.build_layout(q, k, pattern))(q, k)
    for part in _parts(layout):
        check_layout_values(part)  # ids in range, distinct, columns outside blocks, perms
    ref, _ = masked_dense_attention(q, k, v, layout.to_dense_mask())
    out = mmjax.sparse_attention(q, k, v, pattern, options=KernelOptions(interpret=True))
    assert out.shape == q.shape and rel_err(out, ref) < 1e-5
    out_ref = mmjax.sparse_attention(q, k, v, pattern, options=KernelOptions(implementation="reference"))
    assert rel_err(out_ref, ref) < 1e-5


TOKEN_RULES = [
    (AShape(sink=40, local=100, **SMALL), lambda i, j: (j < 40) | (i - j < 100)),
    (TriShape(sink=40, local=100, last=50, **SMALL), lambda i, j: (j < 40) | (i - j < 100) | (i >= 650 + 50)),
    (SFFixed(local=60, stride=128, summary=8, **SMALL),
     lambda i, j: (j // 128 == i // 128) | (i - j < 60) | (j % 128 >= 120)),
    (SFStrided(local=60, stride=128, **SMALL), lambda i, j: ((i - j) % 128 == 0) | (i - j < 60)),
]


@pytest.mark.parametrize("pattern,rule", TOKEN_RULES, ids=lambda x: type(x).__name__)
def test_static_patterns_cover_their_token_rule(pattern, rule):
    t, s = 700, 750
    q, k = jnp.ones((1, t, 1, 16)), jnp.ones((1, s, 1, 16))
    mask = np.asarray(pattern.build_layout(q, k).to_dense_mask())[0, 0]
    i = np.arange(t)[:, None] + (s - t)
    j = np.arange(s)[None, :]
    tok = rule(i, j) & (j <= i)
    assert (mask >= tok).all()
    assert not (mask & (j > i)).any()  # causal on original positions
    # Block granularity adds at most a block around each rule region, not a dense matrix.
    assert mask.sum() < 0.8 * (j <= i).sum()


def _sinusoid(pos, freqs):
    ang = pos[:, None] * freqs[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], -1)


def _planted_vs(t, s, offsets, columns, d=64, seed=0):
    """Per head: slashes at `offsets` (relative-position features) and verticals at `columns`."""
    rng = np.random.default_rng(seed)
    nf = d // (2 * len(offsets)) - 1
    qs, ks = [], []
    qpos = np.arange(t) + s - t
    kpos = np.arange(s)
    for o in offsets:
        freqs = rng.uniform(0.05, 3.0, nf)
        qs.append(0.8 * _sinusoid(qpos, freqs))
        ks.append(_sinusoid(kpos + o, freqs))
    q = np.concatenate(qs, -1)
    k = np.concatenate(ks, -1)
    pad = d - q.shape[-1]
    q = np.concatenate([q, np.ones((t, pad))], -1)
    kv = np.zeros((s, pad))
    kv[columns, :] = 3.0
    k = np.concatenate([k, kv], -1)
    return jnp.asarray(q[None, :, None], jnp.float32), jnp.asarray(k[None, :, None], jnp.float32)


@pytest.mark.parametrize("offsets,columns", [((37, 300), (5, 222, 640)), ((100, 513), (77, 400, 401))])
def test_vertical_slash_estimator_recovers_planted_lines(offsets, columns):
    t, s = 512, 900
    q, k = _planted_vs(t, s, offsets, list(columns))
    pattern = VerticalSlash(vertical_size=140, slash_size=12, last_q=64, keep_first=0, keep_local=0, **SMALL)
    cols, offs, _ = pattern.estimate(q, k)
    assert set(columns) <= set(np.asarray(cols)[0, 0].tolist())
    assert set(offsets) <= set(np.asarray(offs)[0, 0].tolist())
    layout = pattern.build_layout(q, k)
    mask = np.asarray(layout.to_dense_mask())[0, 0]
    i = np.arange(t)[:, None] + s - t
    j = np.arange(s)[None, :]
    planted = (np.isin(i - j, offsets) | np.isin(j, columns)) & (j <= i)
    assert (mask >= planted).all()


def _planted_grid(t, s, stride, phase, n=1, d=32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, t, n, d)) * 0.3
    k = rng.normal(size=(1, s, 1, d)) * 0.3
    q[..., 0] += 2.0
    k[:, np.arange(s) % stride == phase, :, 0] += 3.0
    return jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)


@pytest.mark.parametrize("stride,phase", [(100, 37), (196, 5), (128, 64), (72, 10), (248, 247)])
def test_grid_estimator_recovers_stride_and_phase(stride, phase):
    q, k = _planted_grid(1500, 2000, stride, phase)
    grid = Grid(stride_space=tuple(range(64, 400, 4)), last_q=64, local=128, **SMALL)
    st, ph, _ = grid.estimate(q, k)
    assert int(st[0, 0]) == stride and int(ph[0, 0, 0]) == phase
    layout = grid.build_layout(q, k)
    mask = np.asarray(layout.to_dense_mask())[0, 0]
    i = np.arange(1500)[:, None] + 500
    j = np.arange(2000)[None, :]
    lines = ((j % stride == phase) | (i % stride == phase) | (i - j < 128)) & (j <= i)
    assert (mask >= lines).all()
    assert not (mask & (j > i)).any()
    assert float(layout.density().mean()) < 0.35


def test_grid_permutations_round_trip_and_are_causal_in_permuted_space():
    q, k = _planted_grid(300, 400, 96, 11, n=2)
    layout = Grid(stride_space=(64, 96), last_q=32, local=48, **SMALL).build_layout(q, k)
    band, lines, rows = layout.parts
    assert band.q_perm is None and band.window == 48 and lines.gap == 48 and rows.gap == 48
    assert rows.kv_perm is None and rows.q_block_range is not None  # every key, in original order; few blocks
    for part in (lines, rows):
        qp = np.asarray(part.q_perm)
        np.testing.assert_array_equal(np.sort(qp, -1), np.broadcast_to(np.arange(300), qp.shape))
        if part.kv_perm is not None:
            kp = np.asarray(part.kv_perm)
            np.testing.assert_array_equal(np.sort(kp, -1), np.broadcast_to(np.arange(400), kp.shape))
        permuted = np.asarray(part.computed_pairs_permuted())
        q_pos, k_pos = (np.asarray(x) for x in part.positions())
        visible = permuted & (k_pos[..., None, :] + part.gap <= q_pos[..., :, None])
        # The mask in original order is the permuted mask moved back: same number of pairs.
        assert visible.sum() == np.asarray(part.to_dense_mask()).sum()
    np.testing.assert_array_equal(np.asarray(lines.q_perm), np.asarray(rows.q_perm))
    # A horizontal-line row sees every key at distance >= 48; the other rows none of the rows part's.
    rmask = np.asarray(rows.to_dense_mask())[0]  # [N, T, S]
    far = np.arange(400)[None, :] + 48 <= np.arange(300)[:, None] + 100
    listed = rmask.any(-1)
    assert listed.any() and not listed.all()
    np.testing.assert_array_equal(rmask, listed[..., None] & far)
    # Band (distance < 48) and lines (distance >= 48) never share a pair.
    assert not (np.asarray(band.to_dense_mask()) & np.asarray(lines.to_dense_mask())).any()


def test_recall_is_one_for_dense_and_matches_exact_recall():
    q, k, v = random_qkv(3, 1, 160, 200, 4, 2, 32)
    opts = KernelOptions(interpret=True)
    np.testing.assert_allclose(np.asarray(mmjax.attention_recall(q, k, v, Dense(**SMALL), options=opts)),
                               1.0, rtol=1e-5)
    pattern = AShape(sink=16, local=48, **SMALL)
    got = np.asarray(mmjax.attention_recall(q, k, v, pattern, options=opts))
    mask = np.asarray(pattern.build_layout(q, k).to_dense_mask())
    g = 2
    logits = np.einsum("btnd,bsnd->bnts", np.asarray(q), np.repeat(np.asarray(k), g, 2)) / np.sqrt(32)
    causal = np.arange(200)[None, :] <= np.arange(160)[:, None] + 40
    logits = np.where(causal, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    exact = (p * mask).sum(-1).mean(-1)
    np.testing.assert_allclose(got, exact, rtol=1e-4)
    assert (got < 0.999).all()


@pytest.mark.parametrize("make,match", [
    (lambda: AShape(sink=-1), "sink"),
    (lambda: AShape(local=0), "local"),
    (lambda: AShape(block_q=100), "block_q"),
    (lambda: TriShape(last=0), "last"),
    (lambda: SFFixed(stride=0), "stride"),
    (lambda: SFFixed(stride=8, summary=16), "summary"),
    (lambda: SFStrided(local=-5), "local"),
    (lambda: VerticalSlash(vertical_size=0), "vertical_size"),
    (lambda: VerticalSlash(slash_size=-1), "slash_size"),
    (lambda: VerticalSlash(block_q=32, block_k=64), "block_q"),
    (lambda: Grid(stride_space=()), "stride_space"),
    (lambda: Grid(stride_space=(0, 64)), "stride_space"),
    (lambda: Grid(use_hline=False, use_vline=False, use_slash=False, local=0), "local"),
    (lambda: Grid(phases=0), "phases"),
])
def test_bad_hyper_parameters_name_themselves(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_last_q_longer_than_queries_and_bad_pattern():
    q, k, v = random_qkv(0, 1, 32, 64, 2, 1, 16)
    with pytest.raises(ValueError, match="last_q"):
        mmjax.build_layout(q, k, VerticalSlash(last_q=64, **SMALL))
    with pytest.raises(ValueError, match="last_q"):
        mmjax.build_layout(q, k, Grid(last_q=33, stride_space=(16,), phases=1, **SMALL))
    with pytest.raises(ValueError, match="last"):
        mmjax.build_layout(q, k, TriShape(last=40, **SMALL))
    with pytest.raises(ValueError, match="pattern: expected an mmjax.sparse.patterns pattern"):
        mmjax.sparse_attention(q, k, v, "grid")


@pytest.mark.parametrize("t,s,bound", [(4096, 4096, 1.1), pytest.param(3000, 4200, 1.15, marks=pytest.mark.slow)])
def test_vertical_slash_windows_compute_about_the_named_pairs(t, s, bound):
    """Slash ranges start anywhere: windows compute about the pairs the index names (blocks of 128
    rows; a run of slash keys costs whole 64-key windows, so two lines a few offsets apart cost a
    third window); aligned key blocks compute more. Bands of adjacent offsets and isolated lines."""
    rng = np.random.default_rng(t)
    offsets = np.concatenate([np.arange(0, 64), np.arange(200, 230), rng.choice(np.arange(300, t), 20, replace=False)])
    cols = np.sort(rng.choice(s, 30, replace=False))
    offsets, cols = jnp.asarray(offsets[None, None], jnp.int32), jnp.asarray(cols[None, None], jnp.int32)
    score = jnp.zeros((1, 1, s), jnp.float32)
    named = float(index_pairs(cols, offsets, t, s, 128)[0, 0])
    pairs = {}
    for windows in (True, False):
        vs = VerticalSlash(vertical_size=30, slash_size=offsets.shape[-1], block_q=128, block_k=64, windows=windows)
        layout = vs.layout_from_index(cols, offsets, score, t, s)
        check_layout_values(layout)
        pairs[windows] = float(layout.density()[0, 0]) * causal_pairs(t, s)
        # every named pair is computed: the mask holds the index's lines and columns
        mask = np.asarray(layout.to_dense_mask())[0, 0]
        i = np.arange(t)[:, None] + s - t
        j = np.arange(s)[None, :]
        assert (mask >= ((np.isin(i - j, np.asarray(offsets)) | np.isin(j, np.asarray(cols))) & (j <= i))).all()
    assert named <= pairs[True] <= bound * named
    assert pairs[True] < pairs[False]


def test_vertical_slash_window_tails_become_columns():
    """A run of slash keys whose last window would hold at most ``window_tail`` keys computes them as single
    columns: fewer pairs than whole windows, every named pair still computed, nothing twice, and the output
    equals masked dense attention. Runs here (128-row blocks, 64-key windows; a run of n adjacent offsets spans
    n + 127 relative keys): 5 offsets (4 tail keys), two lines 2 apart (2), two adjacent lines (1), one line
    (none); the band of 70 (5) keeps its window."""
    t = s = 1024
    offsets = np.concatenate([np.arange(0, 5), [300, 302, 600, 601, 800], np.arange(850, 920)])
    cols = np.array([3, 40, 700, 1020])  # 1020: a tail key of the 5-offset band in the last query block
    q, k, v = random_qkv(3, 1, t, s, 1, 1, 16)
    named = float(index_pairs(jnp.asarray(cols[None, None], jnp.int32), jnp.asarray(offsets[None, None], jnp.int32),
                              t, s, 128)[0, 0])
    pairs, layouts = {}, {}
    for tail in (0, 4):
        vs = VerticalSlash(vertical_size=len(cols), slash_size=len(offsets), block_q=128, block_k=64, windows=True,
                           window_tail=tail, max_blocks=64)
        lay = jax.jit(vs.layout_from_index, static_argnums=(3, 4))(
            jnp.asarray(cols[None, None], jnp.int32), jnp.asarray(offsets[None, None], jnp.int32),
            jnp.zeros((1, 1, s)), t, s)
        check_layout_values(lay)  # columns distinct and in no listed window
        mask = np.asarray(lay.to_dense_mask())[0, 0]
        i, j = np.arange(t)[:, None], np.arange(s)[None, :]
        assert (mask >= ((np.isin(i - j, offsets) | np.isin(j, cols)) & (j <= i))).all()
        pairs[tail], layouts[tail] = float(lay.density()[0, 0]) * causal_pairs(t, s), lay
    # the last query block lists the tail keys of the three short runs (4 + 2 + 1) as columns
    assert int(layouts[4].kv_column_count[0, 0, -1]) > int(layouts[0].kv_column_count[0, 0, -1])
    assert named <= pairs[4] < pairs[0]
    out, _ = block_sparse_attention(q, k, v, layouts[4], implementation="reference")
    ref, _ = masked_dense_attention(q, k, v, layouts[4].to_dense_mask())
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("t,s", [(1024, 1024), (1000, 1037)])
def test_vertical_slash_aligned_windows_start_on_multiples_of_8(t, s):
    """``window_align=8``: every window of a run starts on a key position that is a multiple of 8 (reaching back
    from the run's first key), windows of neighbouring runs stay strictly ascending, every named pair is still
    computed, columns stay outside the windows, and the computed pairs grow little."""
    rng = np.random.default_rng(t + s)
    offsets = np.unique(np.concatenate([np.arange(0, 9), rng.choice(np.arange(9, t), 60, replace=False),
                                        np.arange(500, 530), [531, 533]]))  # runs 1 and 2 keys apart
    cols = np.sort(rng.choice(s, 12, replace=False))
    q, k, v = random_qkv(5, 1, t, s, 1, 1, 16)
    lays = {}
    for align in (1, 8):
        vs = VerticalSlash(vertical_size=len(cols), slash_size=len(offsets), block_q=64, block_k=64, windows=True,
                           max_blocks=128, window_align=align)
        lay = jax.jit(vs.layout_from_index, static_argnums=(3, 4))(
            jnp.asarray(cols[None, None], jnp.int32), jnp.asarray(offsets[None, None], jnp.int32),
            jnp.zeros((1, 1, s)), t, s)
        check_layout_values(lay)
        mask = np.asarray(lay.to_dense_mask())[0, 0]
        i, j = np.arange(t)[:, None] + s - t, np.arange(s)[None, :]
        assert (mask >= ((np.isin(i - j, offsets) | np.isin(j, cols)) & (j <= i))).all()
        lays[align] = lay
    starts, count = np.asarray(lays[8].kv_blocks)[0, 0], np.asarray(lays[8].kv_block_count)[0, 0]
    listed = np.concatenate([row[:c] for row, c in zip(starts, count)])
    assert listed.size and (listed[listed > 0] % 8 == 0).all()
    assert not (np.asarray(lays[1].kv_blocks)[0, 0][np.arange(starts.shape[1]) < count[:, None]] % 8 == 0).all()
    p1, p8 = (float(lays[a].density()[0, 0]) for a in (1, 8))
    assert p8 <= p1 * 1.2  # whole windows the kernel multiplies (neighbouring runs may share one)
    out, _ = block_sparse_attention(q, k, v, lays[8], implementation="reference")
    ref, _ = masked_dense_attention(q, k, v, lays[8].to_dense_mask())
    assert rel_err(out, ref) < 1e-5
    assert lays[8].window_align == 8 and lays[1].window_align == 1  # the promise the Mosaic dispatch reads
    with pytest.raises(ValueError, match="layout.kv_blocks: expected window starts > 0 that are multiples of"):
        check_layout_values(lays[1].replace(window_align=8))
    with pytest.raises(ValueError, match="window_align: expected a divisor of block_q=64"):
        VerticalSlash(windows=True, block_q=64, window_align=48).validate()
    with pytest.raises(ValueError, match="window_align: expected a divisor of block_q=64 and block_k=32"):
        VerticalSlash(windows=True, block_q=64, block_k=32, window_align=64).validate()
