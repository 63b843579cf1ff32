"""Grid (MMInference's family) on CPU: every variant == masked dense attention for its own
mask (reference and Triton interpret mode), the mask holds the pattern's rule pairs, the
stride sources, validation, and the fidelity target on a video-like input (slow)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmjax.drivers.bench.patterns import frame_grid_patterns
from mmjax.sparse.attention import attention_recall
from mmjax.sparse.block_lists import bisect_right
from mmjax.sparse.layouts import KernelOptions, RowSplit, attend, block_parts, with_parts
from mmjax.sparse.metrics import block_mass_matrix, oracle_recall
from mmjax.sparse.modality import Modality, frame_tokens_from_grid_thw
from mmjax.sparse.pattern_search.space import GRID_FLAGS
from mmjax.sparse.patterns import AShape, Grid, KBoundary, QBoundary, TwoDBoundary
from mmjax.sparse.patterns.grid import key_groups, phase_groups, phase_major_keys, phase_major_rows, phase_order
from mmjax.sparse.synthetic import VIDEO_FAMILIES, GridVideo, grid_video_qkv
from pallas_kernels.block_sparse.validation import check_layout_values
from tests.pallas_kernels.helpers import (
    masked_dense_attention,
    random_qkv,
    rel_err,
    wholly_masked_entries,
)

SMALL = dict(block_q=32, block_k=16)
SPEC = GridVideo(7, (4, 7), sink_phase=3, broadcast_phase=20, prefix=5)  # S = 201, frame stride 28
FLAGS = list(GRID_FLAGS) + [(True, False, True)]  # Table 3's six and the seventh non-empty one


def _inputs():
    q, k, v = grid_video_qkv(jax.random.PRNGKey(1), SPEC, heads=4, kv_heads=2, head_dim=32)
    mod = Modality.from_token_types(np.full((1, SPEC.seq_len), 2, np.int32), frame_tokens=SPEC.frame_tokens)
    return q, k, v, mod


@pytest.mark.parametrize("stride", ["frame", "search"])
@pytest.mark.parametrize("flags", FLAGS)
def test_every_table3_variant_equals_masked_dense_attention(stride, flags):
    q, k, v, mod = _inputs()
    h, vl, sl = flags
    g = Grid(stride=stride, use_hline=h, use_vline=vl, use_slash=sl, local=20, last_q=16,
             stride_space=(14, 28, 56), **SMALL)
    layout = g.build_layout(q, k, modality=mod)
    ref, ref_lse = masked_dense_attention(q, k, v, layout.to_dense_mask())
    for opts in (KernelOptions(implementation="reference"), KernelOptions(interpret=True)):
        out, lse = attend(q, k, v, layout, opts)
        assert rel_err(out, ref) < 1e-5
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4)


@pytest.mark.parametrize("flags", FLAGS + [(False, False, False)])
def test_mask_holds_the_rule_pairs(flags):
    """band (distance < local), vertical lines (keys at the phase), slash lines (offsets
    that are multiples of the stride), horizontal lines (rows at the phase)."""
    q, k, _, mod = _inputs()
    h, vl, sl = flags
    g = Grid(stride=28, use_hline=h, use_vline=vl, use_slash=sl, local=9, last_q=16, **SMALL)
    stride, phase, _ = g.estimate(q, k)
    assert (np.asarray(stride) == 28).all()
    layout = g.build_layout(q, k)
    mask = np.asarray(layout.to_dense_mask())  # [1, N, T, S]
    i = np.arange(SPEC.seq_len)[:, None]
    j = np.arange(SPEC.seq_len)[None, :]
    for n in range(q.shape[2]):
        p = int(phase[0, n, 0])
        rule = (i - j < 9)
        rule |= vl & (j % 28 == p)
        rule |= sl & ((i - j) % 28 == 0)
        rule |= h & (i % 28 == p)
        rule &= j <= i
        m = mask[0, min(n, mask.shape[1] - 1)]  # a band-only layout is shared by the heads
        assert (m >= rule).all()
        assert not (m & (j > i)).any()


def test_phase_groups_put_line_phases_first_and_follow_the_stride():
    g = np.asarray(phase_groups(jnp.arange(40), jnp.asarray([[10]]), jnp.asarray([[[3, 7]]])))[0, 0]
    assert g[3] == 0 and g[13] == 0 and g[7] == 1 and g[27] == 1
    assert g[4] == 2 + 4 and g[2] == 2 + 2  # the rest by x mod 10 after the line groups
    assert (g[np.arange(40) % 10 == 5] == g[5]).all()


def test_frame_stride_comes_from_the_modality():
    q, k, _, mod = _inputs()
    g = Grid(stride="frame", last_q=16, **SMALL)
    stride, phase, _ = g.estimate(q, k, modality=mod)
    assert (np.asarray(stride) == SPEC.frame_tokens).all()
    # the sink tokens sit at prefix + sink_phase (mod frame)
    assert (np.asarray(phase)[..., 0][:, 1:] == (SPEC.prefix + SPEC.sink_phase) % SPEC.frame_tokens).all()
    with pytest.raises(ValueError, match="^stride: 'frame' needs"):
        g.build_layout(q, k)
    assert frame_tokens_from_grid_thw(np.array([[12, 24, 32]])) == 192
    with pytest.raises(ValueError, match="^video_grid_thw"):
        frame_tokens_from_grid_thw(np.array([12, 24, 32]))


def test_frame_grid_inside_a_query_boundary_equals_masked_dense():
    q, k, v, _ = _inputs()
    kinds = np.ones((1, SPEC.seq_len), np.int32)
    kinds[0, :SPEC.prefix] = 0
    mod = Modality.from_token_types(kinds, names=("text", "video"), frame_tokens=SPEC.frame_tokens)
    g = Grid(stride="frame", local=12, last_q=16, **SMALL)
    wrapper = QBoundary({"video": g, "text": Grid(stride=28, use_hline=False, local=8, last_q=4, **SMALL)})
    layout = wrapper.build_layout(q, k, modality=mod)
    ref, _ = masked_dense_attention(q, k, v, layout.to_dense_mask())
    out, _ = attend(q, k, v, layout, KernelOptions(implementation="reference"))
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("kw,name", [
    (dict(stride="grid"), "stride"), (dict(stride=0), "stride"), (dict(stride=True), "stride"),
    (dict(local=0, use_hline=False, use_vline=False, use_slash=False), "local"), (dict(local=-1), "local"),
    (dict(phases=0), "phases"), (dict(stride=4, phases=5), "phases"), (dict(max_stride=0), "max_stride"),
    (dict(stride_space=()), "stride_space"), (dict(stride_space=(0, 64)), "stride_space"),
    (dict(use_slash=1), "use_slash"), (dict(sink=-1), "sink"),
])
def test_bad_hyper_parameters_raise_value_error_naming_them(kw, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        Grid(**kw)


@pytest.mark.slow
def test_fidelity_target_on_the_4608_token_video():
    """24 frames of 12 x 16 tokens: the best Grid variant keeps >= 90% of the attention at
    <= 35% density and is within 3 points of the oracle block mask at its density."""
    spec = VIDEO_FAMILIES[0]
    q, k, v = grid_video_qkv(jax.random.PRNGKey(0), spec, heads=4, kv_heads=2)
    mod = Modality.from_token_types(np.full((1, spec.seq_len), 2, np.int32), frame_tokens=spec.frame_tokens)
    s = spec.seq_len
    mass = block_mass_matrix(q, k, block_q=128, block_k=64)
    best = None
    for stride in ("frame", "search"):
        layout = Grid(stride=stride).build_layout(q, k, modality=mod)
        dens = float(np.asarray(layout.density()).mean())
        rec = float(np.asarray(attention_recall(q, k, v, layout, options=KernelOptions(implementation="reference"))).mean())
        orc = float(np.asarray(oracle_recall(mass, dens, q_len=s, kv_len=s, block_q=128, block_k=64)).mean())
        if dens <= 0.35 and (best is None or rec > best[0]):
            best = (rec, dens, orc)
    assert best is not None and best[0] >= 0.90 and best[0] >= best[2] - 0.03, best


@pytest.mark.parametrize("stride,phases,sink", [pytest.param(14, 1, 0, marks=pytest.mark.slow), (14, 3, 5),
                                                 pytest.param(28, 2, 0, marks=pytest.mark.slow), (17, 4, 9)])
def test_horizontal_lines_stay_in_their_q_block_range(stride, phases, sink):
    """The rows part names the query blocks of at most `Grid.max_line_rows` rows: every phase choice of the
    stride lists nothing past them (the concrete layout's check), and attend over the range equals the part
    over all rows."""
    q, k, v, _ = _inputs()
    g = Grid(stride=stride, phases=phases, sink=sink, local=9, last_q=16, **SMALL)
    rng = np.random.default_rng(stride + phases)
    for _ in range(3):
        phase = jnp.asarray(rng.choice(stride, (1, q.shape[2], phases), replace=False), jnp.int32)
        layout = g.layout_from_index(jnp.full((1, q.shape[2]), stride, jnp.int32), phase, q.shape[1], k.shape[1],
                                     bounds=(stride, stride))
        rows = layout.parts[-1]
        assert rows.q_block_range == (0, -(-g.max_line_rows(q.shape[1], stride) // SMALL["block_q"]))
        check_layout_values(rows)
        count = np.asarray(rows.kv_block_count)
        assert count[..., :rows.q_block_range[1]].any()
    out, lse = attend(q, k, v, layout, KernelOptions(implementation="reference"))
    plain = with_parts(layout, [p.replace(q_block_range=None) for p in layout.parts])
    ref, ref_lse = attend(q, k, v, plain, KernelOptions(implementation="reference"))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-6)


@pytest.mark.parametrize("sink", [0, 5])
def test_horizontal_lines_list_the_keys_up_to_their_rows_reach(sink):
    """The rows part (keys in original order) lists each query block's key blocks up to the last key one of its rows
    sees (``gap`` = local before it), so no listed tile is wholly masked; the other blocks list nothing."""
    q, k, _, _ = _inputs()
    t, s = q.shape[1], k.shape[1]
    g = Grid(stride=14, phases=2, sink=sink, local=9, last_q=16, **SMALL)
    phase = jnp.asarray(np.random.default_rng(3).choice(14, (1, q.shape[2], 2), replace=False), jnp.int32)
    rows = g.layout_from_index(jnp.full((1, q.shape[2]), 14, jnp.int32), phase, t, s, bounds=(14, 14)).parts[-1]
    assert rows.kv_perm is None and rows.gap == 9
    bq, bk = SMALL["block_q"], SMALL["block_k"]
    q_pos = np.asarray(rows.positions()[0])  # [1, N, T]
    q_pos = np.pad(q_pos, ((0, 0), (0, 0), (0, rows.num_q_blocks * bq - t)), mode="edge")
    reach = q_pos.reshape(q_pos.shape[:2] + (-1, bq)).max(-1) - rows.gap  # [1, N, nq]
    count = np.asarray(rows.kv_block_count)
    lo, hi = rows.q_block_range
    listed = count[..., lo:hi] > 0
    assert listed.any() and not count[..., hi:].any()
    up_to_reach = np.clip(reach[..., lo:hi] // bk + 1, 0, -(-s // bk))
    np.testing.assert_array_equal(count[..., lo:hi][listed], up_to_reach[listed])
    # every listed tile holds a pair some row of its block sees: its first key is within the reach
    assert ((count[..., lo:hi] - 1) * bk <= reach[..., lo:hi])[listed].all()


@pytest.mark.parametrize("wrap", ["k", "q", "2d"])
def test_horizontal_lines_inside_a_boundary_list_the_keys_up_to_their_rows_reach(wrap):
    """Inside a boundary wrapper (packed keys; with TwoDBoundary only the video keys valid) the rows part lists each
    block's (valid) keys up to its rows' reach: no listed tile is wholly masked (50 frames of 8 tokens: the line
    rows fill two query blocks, and the first one's rows see only the earlier keys), and attend equals masked dense
    attention."""
    t, frame = 400, 8
    q, k, v = random_qkv(7, 1, t, t, 2, 1, 16)
    kinds = np.ones((1, t), np.int32)
    kinds[0, :16] = 0
    mod = Modality.from_token_types(kinds, names=("text", "video"), frame_tokens=frame)
    g = Grid(stride="frame", local=9, last_q=16, **SMALL)
    text = AShape(sink=4, local=16, **SMALL)
    w = {"k": KBoundary(g), "q": QBoundary({"video": g, "text": text}),
         "2d": TwoDBoundary({("video", "video"): g}, default=text)}[wrap]
    layout = w.build_layout(q, k, modality=mod)
    video = layout.parts[layout.kinds.index(1)] if isinstance(layout, RowSplit) else layout  # (text: its own range)
    rows = [p for p in block_parts(video) if p.q_block_range is not None]
    assert rows and all((np.asarray(p.kv_block_count) > 0).sum() >= 2 for p in rows)
    for p in block_parts(layout):
        check_layout_values(p)
    for p in rows:
        assert not wholly_masked_entries(p).any()
    ref, ref_lse = masked_dense_attention(q, k, v, layout.to_dense_mask())
    out, lse = attend(q, k, v, layout, KernelOptions(implementation="reference"))
    assert rel_err(out, ref) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4)


@pytest.mark.parametrize("stride,shared", [(28, True), ("frame", True), ("search", False)])
def test_a_static_stride_gives_every_head_one_key_order(stride, shared):
    """Keys go by (phase, position) alone: with one stride for all heads the lines part has one ``kv_perm``
    ``[1, 1, S]`` (the kernels gather each key / value head once), with searched strides one per head."""
    q, k, _, mod = _inputs()
    layout = Grid(stride=stride, local=9, last_q=16, stride_space=(14, 28, 56), **SMALL).build_layout(
        q, k, modality=mod)
    lines = layout.parts[1]
    assert lines.kv_perm.shape == ((1, 1, k.shape[1]) if shared else (1, q.shape[2], k.shape[1]))
    if shared:  # the phase-major order: ascending phases, positions ascending within one
        perm = np.asarray(lines.kv_perm)[0, 0]
        np.testing.assert_array_equal(perm, np.lexsort((np.arange(k.shape[1]), np.arange(k.shape[1]) % 28)))
    with pytest.raises(ValueError, match="^pos, stride, sink"):
        key_groups(jnp.arange(10), jnp.asarray([28]))


def test_sink_keys_longer_than_a_phase_are_all_kept():
    """40 sink keys where one phase of stride 28 holds 8 keys: every row sees every earlier sink key."""
    q, k, v, _ = _inputs()
    for h, vl, sl in FLAGS:
        g = Grid(stride=28, sink=40, use_hline=h, use_vline=vl, use_slash=sl, local=9, last_q=16, **SMALL)
        layout = g.build_layout(q, k)
        mask = np.asarray(layout.to_dense_mask())[0]
        i, j = np.arange(SPEC.seq_len)[:, None], np.arange(SPEC.seq_len)[None, :]
        assert (mask >= ((j < 40) & (j <= i))).all(), (h, vl, sl)
    ref, _ = masked_dense_attention(q, k, v, layout.to_dense_mask())
    out, _ = attend(q, k, v, layout, KernelOptions(implementation="reference"))
    assert rel_err(out, ref) < 1e-5


def test_bisect_right_matches_numpy_on_ascending_runs():
    rng = np.random.default_rng(0)
    values = np.sort(rng.integers(0, 50, (2, 3, 37)), -1).astype(np.int32)
    lo = rng.integers(0, 38, (2, 3, 11)).astype(np.int32)
    hi = np.minimum(lo + rng.integers(0, 20, lo.shape), 37).astype(np.int32)
    x = rng.integers(-2, 52, lo.shape).astype(np.int32)
    got = np.asarray(bisect_right(jnp.asarray(values), jnp.asarray(lo), jnp.asarray(hi), jnp.asarray(x)))
    want = np.array([[[lo[b, n, r] + np.searchsorted(values[b, n, lo[b, n, r]:hi[b, n, r]], x[b, n, r], "right")
                       for r in range(lo.shape[2])] for n in range(3)] for b in range(2)])
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="values, lo, hi, x"):
        bisect_right(jnp.asarray(values), jnp.asarray(lo[0]), jnp.asarray(hi), jnp.asarray(x))


@pytest.mark.parametrize("sink", [0, 7])
def test_slash_lists_stop_at_what_the_rows_see(sink):
    """Each listed tile of the lines part holds a key some row of its block sees (position <= the rows' last
    position - local): a phase's keys past its rows are not listed (blocks spanning few query groups)."""
    q, k, _, _ = _inputs()
    g = Grid(stride=28, sink=sink, use_hline=False, use_vline=False, local=9, last_q=16, **SMALL)
    assert g._widths(q.shape[1], k.shape[1], (28, 28))[1] <= g.MAX_CAUSAL_GROUPS
    lines = g.build_layout(q, k).parts[1]
    blocks, count = np.asarray(lines.kv_blocks), np.asarray(lines.kv_block_count)
    k_pos, q_pos = np.asarray(lines.kv_perm)[0, 0], np.asarray(lines.q_perm)[0]  # keys shared, rows per head
    bq, bk = SMALL["block_q"], SMALL["block_k"]
    listed = 0
    for n in range(q.shape[2]):
        for i in range(count.shape[2]):
            last = q_pos[n, i * bq:(i + 1) * bq].max()
            for j in blocks[0, n, i, :count[0, n, i]]:
                assert k_pos[j * bk:(j + 1) * bk].min() <= last - 9, (n, i, j)
                listed += 1
    assert listed > 0


@pytest.mark.parametrize("wrapper", ["q", "k"])
@pytest.mark.parametrize("sink", [0, 3])
def test_frame_grid_inside_a_boundary_holds_the_rule_pairs(wrapper, sink):
    """Inside a boundary wrapper (packed keys, rows by phase within the wrapper's order) the layout still holds the
    video rows' band and slash pairs with the video keys (the masked-dense test above checks only its own mask)."""
    q, k, _, _ = _inputs()
    kinds = np.ones((1, SPEC.seq_len), np.int32)
    kinds[0, :SPEC.prefix] = 0
    mod = Modality.from_token_types(kinds, names=("text", "video"), frame_tokens=SPEC.frame_tokens)
    g = Grid(stride="frame", local=12, last_q=16, sink=sink, **SMALL)
    w = (QBoundary({"video": g, "text": Grid(stride=28, use_hline=False, local=8, last_q=4, **SMALL)})
         if wrapper == "q" else KBoundary(g))
    mask = np.asarray(w.build_layout(q, k, modality=mod).to_dense_mask())[0]  # [N, T, S]
    i, j = np.arange(SPEC.seq_len)[:, None], np.arange(SPEC.seq_len)[None, :]
    video = (i >= SPEC.prefix) & (j >= SPEC.prefix) & (j <= i)
    rule = video & ((i - j < 12) | ((i - j) % SPEC.frame_tokens == 0))
    assert (mask >= rule).all()
    assert not (mask & (j > i)).any()


def test_frame_grid_patterns_take_the_frame_size():
    (g,) = frame_grid_patterns((4, 7)).values()
    assert g.stride == 28 and frame_grid_patterns()["Grid(frame)"].stride == 256
    with pytest.raises(ValueError, match="^frame_hw: expected two ints"):
        frame_grid_patterns((4, 0))


def test_lines_promise_strided_rows_where_each_block_is_one_phase():
    """With one static stride dividing T into a whole number of query blocks per phase (and no sink group), every
    query block of the lines part is one phase and ``block_q`` consecutive frames: the part says so
    (`BlockLayout.q_row_stride`, checked on the concrete layout), so the Mosaic GPU kernel reads and writes those
    rows in place. Otherwise (a searched stride, T not a whole number of blocks per phase, a sink) it does not."""
    t = 16 * 64  # 64 frames of 16 tokens: two query blocks of 32 rows per phase
    q, k, v = random_qkv(31, 1, t, t, 4, 2, 16)

    def lines(g):
        parts = block_parts(g.build_layout(q, k))
        return [p for p in parts if p.q_perm is not None and p.q_block_range is None][0]

    part = lines(Grid(stride=16, local=9, last_q=16, **SMALL))
    assert part.q_row_stride == 16
    check_layout_values(part)
    assert lines(Grid(stride=16, local=9, last_q=16, sink=8, **SMALL)).q_row_stride == 0
    assert lines(Grid(stride="search", stride_space=(8, 16), local=9, last_q=16, **SMALL)).q_row_stride == 0
    q2, k2 = q[:, :t - 16], k[:, :t - 16]  # 63 frames: a block would span two phases
    parts = block_parts(Grid(stride=16, local=9, last_q=16, **SMALL).build_layout(q2, k2))
    assert all(p.q_row_stride == 0 for p in parts)
    out, _ = attend(q, k, v, Grid(stride=16, local=9, last_q=16, **SMALL).build_layout(q, k),
                    KernelOptions(implementation="reference"))
    ref, _ = masked_dense_attention(q, k, v, Grid(stride=16, local=9, last_q=16, **SMALL).build_layout(
        q, k).to_dense_mask())
    assert rel_err(out, ref) < 1e-5


def _attend_spy(monkeypatch):
    """Record, when it runs on the device, which layout `Grid.attend` attends: the lines part's ``kv_perm`` heads
    (1: one key order for every head, the frame stride's; N: the searched strides' key order per head)."""
    from mmjax.sparse.patterns import grid as grid_module

    ran = []

    def spy(q, k, v, layout, options):
        heads = block_parts(layout)[1].kv_perm.shape[1]
        jax.debug.callback(lambda: ran.append(heads))
        return attend(q, k, v, layout, options)

    monkeypatch.setattr(grid_module, "attend", spy)
    return ran


@pytest.mark.parametrize("frame,branch", [(28, 1), (56, 4)])
def test_searched_grid_attends_the_frame_layout_where_every_head_finds_the_frame(monkeypatch, frame, branch):
    """Every head of `_inputs` finds the frame stride 28: with the modality's frame size 28 `Grid.attend` runs
    Grid(frame)'s layout (one key order) and gives its result bit for bit; with a frame size no head finds (56,
    a candidate) it runs the searched layout and gives the result of ``frame_first=False``."""
    q, k, v, _ = _inputs()
    mod = Modality.from_token_types(np.full((1, SPEC.seq_len), 2, np.int32), frame_tokens=frame)
    opts = KernelOptions(implementation="reference")
    kw = dict(local=20, last_q=16, stride_space=(14, 28, 56), **SMALL)
    searched = Grid(**kw)
    assert searched.frame_guess(k.shape[1], mod) == frame
    np.testing.assert_array_equal(np.asarray(searched.estimate(q, k)[0]), 28)
    ran = _attend_spy(monkeypatch)
    out, lse = jax.jit(lambda q, k, v: searched.attend(q, k, v, modality=mod, options=opts))(q, k, v)
    assert ran == [branch]
    monkeypatch.undo()
    want = Grid(stride="frame", **kw) if frame == 28 else Grid(frame_first=False, **kw)
    ref, ref_lse = want.attend(q, k, v, modality=mod, options=opts)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))
    mask = want.build_layout(q, k, modality=mod).to_dense_mask()
    assert rel_err(out, masked_dense_attention(q, k, v, mask)[0]) < 1e-5


def test_frame_guess_needs_a_searched_stride_a_frame_size_among_the_candidates_and_frame_first():
    s = SPEC.seq_len
    mod = Modality.from_token_types(np.full((1, s), 2, np.int32), frame_tokens=28)
    kw = dict(local=20, last_q=16, stride_space=(14, 28, 56), **SMALL)
    assert Grid(**kw).frame_guess(s, mod) == 28
    assert Grid(**kw).frame_guess(s, None) is None
    assert Grid(**kw).frame_guess(s, Modality.from_token_types(np.full((1, s), 2, np.int32))) is None
    assert Grid(**dict(kw, stride_space=(14, 56))).frame_guess(s, mod) is None
    assert Grid(**dict(kw, frame_first=False)).frame_guess(s, mod) is None
    assert Grid(**dict(kw, stride="frame")).frame_guess(s, mod) is None
    with pytest.raises(ValueError, match="^frame_first: expected a bool"):
        Grid(frame_first=1)


@pytest.mark.parametrize("stride, frames, off, phases", [(1, 3, 0, 1), (4, 3, 5, 1), (7, 2, 3, 2), (8, 4, 17, 3),
                                                         (16, 2, 0, 2)])
def test_phase_major_orders_are_the_stable_argsorts_of_the_groups(stride, frames, off, phases):
    """The closed forms `layout_from_index` uses for one stride dividing T / S give the stable argsort of
    `phase_groups` / `key_groups` and the groups in that order, with repeated line phases among the draws."""
    t = stride * frames
    rng = np.random.default_rng(stride * 100 + off)
    phase = rng.integers(0, stride, (2, 3, phases)).astype(np.int32)
    phase[0, 0] = phase[0, 0, :1]  # one head names its first phase every time
    groups = phase_groups(jnp.arange(t) + off, jnp.full((2, 3), stride, jnp.int32), jnp.asarray(phase))
    order = jnp.argsort(groups, -1, stable=True)
    rows, row_groups = phase_major_rows(t, off, stride, jnp.asarray(phase))
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(order))
    np.testing.assert_array_equal(np.asarray(row_groups), np.asarray(jnp.take_along_axis(groups, order, -1)))
    s = t + off - off % stride  # a multiple of the stride
    kg = key_groups(jnp.arange(s), jnp.full((1, 1), stride, jnp.int32))
    keys, key_order_groups = phase_major_keys(s, stride)
    np.testing.assert_array_equal(np.asarray(keys), np.asarray(jnp.argsort(kg, -1, stable=True)))
    np.testing.assert_array_equal(np.asarray(key_order_groups), np.asarray(jnp.sort(kg, -1)))


@settings(max_examples=30, deadline=None)
@given(n=st.sampled_from([1, 37, 128, 300]), off=st.integers(0, 200), sink=st.sampled_from([0, 0, 1, 7, 64, 250]),
       phases=st.integers(0, 3), heads=st.sampled_from([1, 3]), repeat=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_phase_order_is_the_stable_argsort_of_the_groups(n, off, sink, phases, heads, repeat, seed):
    """`phase_order` (any per-head strides, offsets, sinks, repeated line phases, phases outside the stride; no phases:
    the key groups) gives the stable argsort of `phase_groups` / `key_groups` and the groups in that order."""
    rng = np.random.default_rng(seed)
    stride = rng.integers(1, 40, (2, heads)).astype(np.int32)
    pos = jnp.arange(n) + off
    if phases:
        phase = np.stack([rng.integers(0, stride) for _ in range(phases)], -1).astype(np.int32)
        if repeat:
            phase[..., -1] = phase[..., 0]
            phase[0, 0, 0] = -1 if seed % 2 else stride[0, 0]  # a phase outside [0, stride) names no rows
        groups = phase_groups(pos, jnp.asarray(stride), jnp.asarray(phase), sink)
        got = phase_order(off, n, jnp.asarray(stride), jnp.asarray(phase), sink)
    else:
        groups = key_groups(pos, jnp.asarray(stride), sink)
        got = phase_order(off, n, jnp.asarray(stride), sink=sink)
    order = jnp.argsort(groups, -1, stable=True)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(order))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(jnp.take_along_axis(groups, order, -1)))


def test_phase_order_broadcasts_one_stride_and_names_bad_arguments():
    order, groups = phase_order(0, 50, jnp.full((1, 1), 8, jnp.int32), sink=3)
    assert order.shape == groups.shape == (1, 1, 50)
    np.testing.assert_array_equal(np.asarray(order[0, 0, :5]), [0, 1, 2, 8, 16])  # the sink, then phase 0
    with pytest.raises(ValueError, match="^stride, phase, sink, n: expected"):
        phase_order(0, 10, jnp.full((4,), 2, jnp.int32))
    with pytest.raises(ValueError, match="^stride, phase, sink, n: expected"):
        phase_order(0, 10, jnp.full((1, 1), 2, jnp.int32), jnp.zeros((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="^stride, phase, sink, n: expected"):
        phase_order(0, 0, jnp.full((1, 1), 2, jnp.int32))


def test_phase_major_orders_need_a_dividing_stride():
    with pytest.raises(ValueError, match="stride"):
        phase_major_rows(10, 0, 4, jnp.zeros((1, 1, 1), jnp.int32))
    with pytest.raises(ValueError, match="stride"):
        phase_major_keys(10, 4)
