"""Boundary wrappers: each one's output equals masked dense attention for the mask it builds
(causal on original positions); rows follow their own modality; bad arguments name themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax import Modality
from mmjax.sparse.layouts import LayoutSet, map_parts
from mmjax.sparse.patterns import (
    AShape,
    Dense,
    Grid,
    KBoundary,
    KernelOptions,
    NoBoundary,
    QBoundary,
    RowSplit,
    SFFixed,
    TriShape,
    TwoDBoundary,
    VerticalSlash,
    boundary,
)
from mmjax.sparse.placement import restrict_from, restrict_to_valid
from pallas_kernels import BlockLayout
from pallas_kernels.block_sparse.mosaic_gpu import fused_columns
from pallas_kernels.block_sparse.validation import check_layout_values
from pallas_kernels.tiling import cdiv
from tests.pallas_kernels.helpers import masked_dense_attention, random_qkv, rel_err

SMALL = dict(block_q=32, block_k=16)
A = AShape(sink=16, local=40, **SMALL)
VS = VerticalSlash(vertical_size=16, slash_size=16, last_q=8, keep_first=8, keep_local=16, **SMALL)
G = Grid(stride_space=(24, 32), last_q=8, local=24, **SMALL)
TRI = TriShape(sink=8, local=24, last=8, **SMALL)
D = Dense(**SMALL)
NAMES = ("text", "image", "video")


def _modality(b, s, seed):
    """Runs of text / image / video of random lengths (every kind present in each row)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(b):
        row = []
        while len(row) < s:
            row += [int(rng.integers(0, 3))] * int(rng.integers(10, 60))
        row = np.array(row[:s])
        row[:3], row[-20:-10], row[-10:] = 0, 1, 2
        rows.append(row)
    return Modality.from_token_types(np.stack(rows), names=NAMES)


WRAPPERS = [
    NoBoundary(TRI),
    KBoundary(A),
    KBoundary(G),
    QBoundary({"text": A, "image": G, "video": VS}),
    QBoundary({"video": TRI}, default=A),
    TwoDBoundary({("text", "text"): D, ("video", "video"): VS, ("video", "text"): A,
                  ("text", "video"): TRI, ("image", "image"): D, ("image", "text"): A}, default=TRI),
    TwoDBoundary({("video", "video"): G, ("video", "text"): A, ("text", "text"): G, ("image", "video"): VS},
                 skip_missing=True),
]


def _parts(layout):
    if isinstance(layout, RowSplit):
        return [p for part in layout.parts for p in _parts(part)]
    return list(layout.parts) if isinstance(layout, LayoutSet) else [layout]


# Every wrapper through the Pallas kernel (interpret) on one shape; batch 2 / GQA / T < S on
# the reference path for the wrappers with their own permutation code. `make test` runs each
# wrapper type once per path (about 20-45 s a case on 2 cores); the cases marked slow (a second
# wrapper of a type already covered on that path) run before a release (`make test SLOW=1`).
CASES = ([(w, (1, 160, 160, 2, 1), True) for w in WRAPPERS]
         + [(w, (2, 112, 176, 2, 2), False) for w in (WRAPPERS[1], WRAPPERS[2], WRAPPERS[3], WRAPPERS[5],
                                                       WRAPPERS[6])])
SLOW_CASES = {1, 4, 5, 7, 10}


@pytest.mark.parametrize("wrapper,shape,interpret",
                         [pytest.param(*c, marks=pytest.mark.slow) if i in SLOW_CASES else c
                          for i, c in enumerate(CASES)],
                         ids=[f"{type(w).__name__}{i}" for i, (w, _, _) in enumerate(CASES)])
def test_output_equals_masked_dense_for_built_mask(wrapper, shape, interpret):
    b, t, s, n, kh = shape
    q, k, v = random_qkv(t + s + b, b, t, s, n, kh, 16)
    m = _modality(b, s, seed=t + b)
    layout = jax.jit(lambda q, k, m: mmjax.build_layout(q, k, wrapper, m))(q, k, m)
    for part in _parts(layout):
        check_layout_values(part)
    mask = layout.to_dense_mask()
    ref, ref_lse = masked_dense_attention(q, k, v, mask)
    if interpret:
        out = mmjax.sparse_attention(q, k, v, wrapper, m, options=KernelOptions(interpret=True))
        assert rel_err(out, ref) < 1e-5
    out_r = mmjax.sparse_attention(q, k, v, wrapper, m, options=KernelOptions(implementation="reference"))
    assert rel_err(out_r, ref) < 1e-5
    mask = np.asarray(mask)
    i = np.arange(t)[:, None] + s - t
    assert not (mask & (np.arange(s)[None, :] > i)).any()  # causal on original positions
    assert mask.any(-1).mean() > 0.5


def test_qboundary_dense_everywhere_is_dense_causal():
    q, k, v = random_qkv(1, 1, 180, 180, 2, 1, 16)
    m = _modality(1, 180, seed=3)
    layout = mmjax.build_layout(q, k, QBoundary({"text": D, "image": D, "video": D}), m)
    causal = np.arange(180)[None, :] <= np.arange(180)[:, None]
    np.testing.assert_array_equal(np.asarray(layout.to_dense_mask())[0, 0], causal)


def test_rows_follow_their_modality():
    q, k, v = random_qkv(2, 1, 200, 200, 2, 1, 16)
    m = _modality(1, 200, seed=5)
    kinds = np.asarray(m.ids)[0]
    # Text rows take the AShape part, the others Dense: their rows are the full causal rows.
    layout = mmjax.build_layout(q, k, QBoundary({"text": AShape(sink=16, local=16, **SMALL)}, default=D), m)
    mask = np.asarray(layout.to_dense_mask())[0, 0]
    causal = np.arange(200)[None, :] <= np.arange(200)[:, None]
    np.testing.assert_array_equal(mask[kinds != 0], causal[kinds != 0])
    assert mask[kinds == 0].sum() < 0.8 * causal[kinds == 0].sum()
    # TwoD: missing pairs are an error naming them, unless skip_missing (then unlisted query
    # kinds get no keys); a listed pair sees exactly the causal keys of its key kind (per key:
    # blocks straddling two kinds become single columns).
    with pytest.raises(ValueError, match=r"missing \[\('text', 'text'\), \('text', 'image'\), .*\('video', 'video'\)\]"):
        mmjax.build_layout(q, k, TwoDBoundary({("video", "text"): D}), m)
    two = mmjax.build_layout(q, k, TwoDBoundary({("video", "text"): D}, skip_missing=True), m)
    mask2 = np.asarray(two.to_dense_mask())[0, 0]
    assert not mask2[kinds != 2].any()
    np.testing.assert_array_equal(mask2[kinds == 2], (causal & (kinds == 0)[None, :])[kinds == 2])
    # All pairs dense: every row's keys are its causal keys, each reached through one pair.
    pairs = {(a, b_): D for a in NAMES for b_ in NAMES}
    full = mmjax.build_layout(q, k, TwoDBoundary(pairs), m)
    np.testing.assert_array_equal(np.asarray(full.to_dense_mask())[0, 0], causal)
    for part in full.parts:
        cover = sum(np.asarray(p.to_dense_mask())[0, 0].astype(int) for p in part.parts)
        assert cover.max() == 1  # pairs disjoint per key
    out = mmjax.sparse_attention(q, k, v, TwoDBoundary({("video", "text"): D}, skip_missing=True), m,
                                 options=KernelOptions(implementation="reference"))
    assert not np.asarray(out)[0, kinds != 2].any()
    # A default serves every unlisted pair: Dense everywhere but one pair is dense causal.
    dflt = mmjax.build_layout(q, k, TwoDBoundary({("video", "text"): D}, default=D), m)
    np.testing.assert_array_equal(np.asarray(dflt.to_dense_mask())[0, 0], causal)


def test_kboundary_permutes_keys_by_modality():
    q, k, _ = random_qkv(4, 2, 100, 120, 2, 1, 16)
    m = _modality(2, 120, seed=9)
    layout = mmjax.build_layout(q, k, KBoundary(A), m)
    perm = np.asarray(layout.kv_perm)[:, 0]
    kinds = np.take_along_axis(np.asarray(m.ids), perm, -1)
    assert (np.diff(kinds, axis=-1) >= 0).all()
    np.testing.assert_array_equal(perm, np.argsort(np.asarray(m.ids), axis=-1, kind="stable"))


def test_recall_and_per_head_with_boundaries():
    q, k, v = random_qkv(6, 1, 128, 128, 2, 1, 16)
    m = _modality(1, 128, seed=1)
    opts = KernelOptions(implementation="reference")
    qb = QBoundary({"text": D, "image": D, "video": D})
    np.testing.assert_allclose(np.asarray(mmjax.attention_recall(q, k, v, qb, m, options=opts)), 1.0, rtol=1e-5)
    out = mmjax.sparse_attention(q, k, v, [qb, KBoundary(A)], m, options=opts)
    mask = jnp.concatenate([mmjax.build_layout(q, k, qb, m).to_dense_mask()[:, :1],
                            mmjax.build_layout(q, k, KBoundary(A), m).to_dense_mask()[:, :1]], 1)
    ref, _ = masked_dense_attention(q, k, v, mask)
    assert rel_err(out, ref) < 1e-5


def test_bad_arguments_name_themselves():
    q, k, _ = random_qkv(0, 1, 64, 64, 1, 1, 16)
    m = _modality(1, 64, seed=0)
    with pytest.raises(ValueError, match="modality: QBoundary needs a Modality"):
        mmjax.build_layout(q, k, QBoundary({"text": A}, default=A))
    with pytest.raises(ValueError, match="modality: KBoundary needs a Modality"):
        mmjax.build_layout(q, k, KBoundary(A))
    with pytest.raises(ValueError, match=r"patterns: expected a pattern for every modality"):
        mmjax.build_layout(q, k, QBoundary({"text": A}), m)
    with pytest.raises(ValueError, match=r"patterns: expected modality names from .*'audio'"):
        mmjax.build_layout(q, k, QBoundary({"audio": A}, default=A), m)
    with pytest.raises(ValueError, match=r"pattern: SFFixed has no position-aware layout"):
        mmjax.build_layout(q, k, TwoDBoundary({("video", "video"): SFFixed(local=16, stride=16, summary=4, **SMALL)},
                                              skip_missing=True), m)
    with pytest.raises(ValueError, match=r"default / skip_missing: expected at most one"):
        TwoDBoundary({("text", "text"): A}, default=A, skip_missing=True)
    with pytest.raises(ValueError, match=r"patterns\['text'\]: expected an mmjax.sparse.patterns pattern"):
        QBoundary({"text": "grid"})
    with pytest.raises(ValueError, match="patterns: bad key"):
        TwoDBoundary({"text": A})
    with pytest.raises(ValueError, match="pattern: expected an mmjax.sparse.patterns pattern"):
        KBoundary("a")


def _interleaved(frames=4, frame=48, text=16):
    """Text segments between video frames (25% text, as in MM-NIAH): ids [1, S]."""
    row = []
    for _ in range(frames):
        row += [0] * text + [2] * frame
    return Modality.from_token_types(np.array([row]), names=NAMES)


def test_inner_windows_are_on_original_positions_when_modalities_interleave():
    m = _interleaved()
    s = m.ids.shape[1]
    kinds = np.asarray(m.ids)[0]
    q, k, v = random_qkv(11, 1, s, s, 2, 1, 16)
    pos = np.arange(s)
    causal = pos[None, :] <= pos[:, None]
    sink, local = 16, 40
    window = causal & (pos[None, :] > pos[:, None] - local)
    text_rows = kinds == 0
    slack = local + 2 * 32 + 2 * 48 + 16  # block granularity + a block spanning a frame
    far = pos[None, :] < pos[:, None] - slack
    # QBoundary: text rows get the A-shape in original positions (sink = first positions).
    qb = mmjax.build_layout(q, k, QBoundary({"text": AShape(sink=sink, local=local, **SMALL)}, default=D), m)
    mask = np.asarray(qb.to_dense_mask())[0, 0]
    intended = window | (causal & (pos[None, :] < sink))
    assert (mask[text_rows] >= intended[text_rows]).all()
    assert not (mask & far & (pos[None, :] >= sink))[text_rows].any()
    np.testing.assert_array_equal(mask[~text_rows], causal[~text_rows])
    # KBoundary: window on positions; sink = the first keys of the first modality (text).
    kb = mmjax.build_layout(q, k, KBoundary(AShape(sink=sink, local=local, **SMALL)), m)
    mask = np.asarray(kb.to_dense_mask())[0, 0]
    first_text = np.zeros(s, bool)
    first_text[np.flatnonzero(kinds == 0)[:sink]] = True
    intended = window | (causal & first_text[None, :])
    assert (mask >= intended).all()
    sink_blocks = np.zeros(s, bool)
    sink_blocks[np.argsort(kinds, kind="stable")[:cdiv(sink, 16) * 16]] = True
    assert not (mask & far & ~sink_blocks[None, :]).any()
    # Dense inside KBoundary is dense causal (cut-offs on positions, not packed indices).
    kd = mmjax.build_layout(q, k, KBoundary(D), m)
    np.testing.assert_array_equal(np.asarray(kd.to_dense_mask())[0, 0], causal)
    # Outputs still equal masked dense for the built mask.
    out = mmjax.sparse_attention(q, k, v, KBoundary(AShape(sink=sink, local=local, **SMALL)), m,
                                 options=KernelOptions(implementation="reference"))
    ref, _ = masked_dense_attention(q, k, v, kb.to_dense_mask())
    assert rel_err(out, ref) < 1e-5


def test_grid_and_slashes_inside_wrappers_use_original_positions():
    """A video head with salient keys every 64 positions (Grid lines) and a slash at offset
    64: inside QBoundary, the video rows' layout holds the lines and the slash although
    text rows are permuted away."""
    m = _interleaved(frames=4, frame=48, text=16)
    s = m.ids.shape[1]
    kinds = np.asarray(m.ids)[0]
    pos = np.arange(s)
    d = 16
    q = np.zeros((1, s, 1, d), np.float32)
    k = np.zeros((1, s, 1, d), np.float32)
    q[..., 0] = 1.0
    k[0, pos % 64 == 5, 0, 0] = 8.0  # lines at phase 5 of stride 64
    q, k = jnp.asarray(q), jnp.asarray(k)
    g = Grid(stride_space=(32, 64), last_q=16, local=16, use_hline=False, **SMALL)
    mask = np.asarray(mmjax.build_layout(q, k, QBoundary({"video": g}, default=D), m).to_dense_mask())[0, 0]
    causal = pos[None, :] <= pos[:, None]
    lines = causal & (pos[None, :] % 64 == 5)
    vid = kinds == 2
    assert (mask[vid] >= lines[vid]).all()
    # The same inside TwoD (video, video): lines of video keys only, text keys never.
    two = mmjax.build_layout(q, k, TwoDBoundary({("video", "video"): g}, skip_missing=True), m)
    mask2 = np.asarray(two.to_dense_mask())[0, 0]
    assert (mask2[vid] >= (lines & vid[None, :])[vid]).all()
    assert not mask2[:, ~vid].any() and not mask2[~vid].any()


def test_spans_that_disagree_with_the_ids_are_refused():
    """Spans decide which kinds are present: a Modality whose spans omit a kind would leave
    that kind's rows uncovered (all zero) without a word."""
    q, k, _ = random_qkv(1, 1, 64, 64, 1, 1, 16)
    m = _modality(1, 64, seed=2)
    spans = tuple(tuple((0 if kind == 1 else kind, a, b) for kind, a, b in row) for row in m.spans)  # image -> text
    liar = Modality(m.ids, m.names, spans)
    for wrapper in (QBoundary({"text": A}, default=A), TwoDBoundary({("text", "text"): A}, default=A), KBoundary(A)):
        with pytest.raises(ValueError, match=r"modality.spans\[0\]: expected the runs of the ids; position \d+ has id 1"):
            mmjax.build_layout(q, k, wrapper, liar)
    short = Modality(m.ids, m.names, ((m.spans[0][0],),))
    with pytest.raises(ValueError, match=r"modality.spans\[0\]: expected runs covering \[0, 64\)"):
        mmjax.build_layout(q, k, QBoundary({"text": A}, default=A), short)


def test_straddling_keys_become_one_shared_column_list():
    """`restrict_to_valid` on a part without columns: the key block straddling the valid keys' end becomes one column
    list for every query block and head (`shared_columns`, which the Mosaic kernel runs inside the block pass),
    each block reading the valid prefix where it listed the block; attend is unchanged (masked-dense tests above)."""
    bk = 16
    blocks = jnp.asarray([[[[0, 1, 2, 0], [0, 1, 3, 4], [1, 0, 0, 0]]]], jnp.int32)  # [1, 1, 3, 4]
    part = BlockLayout(kv_blocks=jnp.broadcast_to(blocks, (1, 2, 3, 4)),
                       kv_block_count=jnp.asarray([[[3, 4, 1], [2, 4, 1]]], jnp.int32), block_q=16, block_k=bk,
                       q_len=48, kv_len=80)
    out = restrict_to_valid(part, jnp.asarray([[37]], jnp.int32))  # 37 valid keys: block 2 straddles (5 valid)
    assert out.kv_columns.shape == (1, 1, 1, bk) and fused_columns(out)
    np.testing.assert_array_equal(np.asarray(out.kv_columns)[0, 0, 0, :5], np.arange(32, 37))
    np.testing.assert_array_equal(np.asarray(out.kv_column_count), [[[5, 0, 0], [0, 0, 0]]])
    np.testing.assert_array_equal(np.asarray(out.kv_block_count), [[[2, 2, 1], [2, 2, 1]]])
    check_layout_values(out)


@pytest.mark.parametrize("wrap", ["q", "2d"])
def test_a_kind_with_few_rows_runs_on_its_rows_alone(wrap):
    """A query kind whose rows fill at most a quarter of the query blocks (the text of a long video): its parts in the
    wrapper's row order name the blocks of its rows (the last, in that order) as their ``q_block_range`` and
    `attend` merges them on those rows alone; parts of the other kind and parts with a row order of their own
    (Grid's lines) do not. Exact against the layout's mask, and the same layout without the ranges gives the same
    result. Spans unknown (ids traced): no ranges."""
    s, text = 480, 40
    q, k, v = random_qkv(21, 1, s, s, 2, 1, 16)
    kinds = np.ones((1, s), np.int32)
    kinds[0, :24], kinds[0, -16:] = 0, 0  # a prompt before the video and a question after it
    m = Modality.from_token_types(kinds, names=("text", "video"), frame_tokens=24)
    g = Grid(stride="frame", local=24, last_q=8, **SMALL)
    w = (QBoundary({"video": g, "text": A}) if wrap == "q"
         else TwoDBoundary({("video", "video"): g, ("text", "text"): A}, default=TRI))
    layout = w.build_layout(q, k, modality=m)
    text_parts = _parts(layout.parts[layout.kinds.index(0)])
    nq = -(-s // 32)
    assert (s - text) // 32 >= 0.75 * nq
    ranges = [p.q_block_range for p in text_parts]  # (TriShape's last rows keep their own, inside the kind's)
    assert ((s - text) // 32, nq) in ranges and all(r is not None and r[0] >= (s - text) // 32 for r in ranges)
    video_ranges = [p.q_block_range for p in _parts(layout.parts[layout.kinds.index(1)])]
    assert video_ranges.count(None) >= 2 and ((0, 1) in video_ranges)  # Grid's lines keep theirs
    for part in _parts(layout):
        check_layout_values(part)
    ref, ref_lse = masked_dense_attention(q, k, v, layout.to_dense_mask())
    opts = KernelOptions(implementation="reference")
    out, lse = mmjax.sparse.attend(q, k, v, layout, opts)
    assert rel_err(out, ref) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4)
    whole = map_parts(layout, lambda p: p.replace(q_block_range=None))
    out_w, lse_w = mmjax.sparse.attend(q, k, v, whole, opts)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_w), atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_w), atol=1e-6)
    traced = jax.jit(lambda ids: w.build_layout(q, k, modality=Modality(ids=ids, names=m.names, frame_tokens=24)))(
        m.ids)
    assert [p.q_block_range for p in _parts(traced.parts[traced.kinds.index(0)])] == [
        None if r == ((s - text) // 32, nq) else r for r in ranges]


def test_map_parts_keeps_the_structure():
    """`map_parts` applies a function to every `BlockLayout` of a `RowSplit` of `LayoutSet`s and keeps both levels;
    anything else is refused by name."""
    s = 256
    q, k, _ = random_qkv(25, 1, s, s, 2, 1, 16)
    kinds = np.ones((1, s), np.int32)
    kinds[0, :40] = 0
    m = Modality.from_token_types(kinds, names=("text", "video"))
    layout = TwoDBoundary({("video", "video"): A}, default=TRI).build_layout(q, k, modality=m)
    out = map_parts(layout, lambda p: p.replace(gap=3))
    assert isinstance(out, RowSplit) and out.kinds == layout.kinds
    assert [type(p) for p in out.parts] == [type(p) for p in layout.parts]
    assert [len(_parts(p)) for p in out.parts] == [len(_parts(p)) for p in layout.parts]
    assert all(p.gap == 3 for p in _parts(out))
    with pytest.raises(ValueError, match="layout: expected a BlockLayout, LayoutSet or RowSplit; received tuple"):
        map_parts((1,), lambda p: p)


def test_a_modality_between_prompt_and_question_keeps_its_rows_in_place(monkeypatch):
    """A query modality whose rows, in the original order, fill at most `IN_PLACE_EXTRA` more blocks than they need
    (a video between a prompt and a question) keeps its rows in place: its parts without a row order of their own
    have no ``q_perm`` (and, in a QBoundary, where every key is valid, parts in the plain key order no ``kv_perm``).
    Its pattern is estimated from its last rows as when they are moved last (the same Grid stride / phases: the
    same key order of the lines), and attend equals masked dense attention over the layout's mask."""
    s = 640
    q, k, v = random_qkv(23, 1, s, s, 2, 1, 16)
    kinds = np.ones((1, s), np.int32)
    kinds[0, :40], kinds[0, -24:] = 0, 0
    m = Modality.from_token_types(kinds, names=("text", "video"), frame_tokens=32)
    g = Grid(stride_space=(24, 32), last_q=16, local=24, **SMALL)
    for w in (QBoundary({"video": g, "text": A}), QBoundary({"video": A}, default=A),
              TwoDBoundary({("video", "video"): g}, default=A)):
        layout = w.build_layout(q, k, modality=m)
        vparts = _parts(layout.parts[layout.kinds.index(1)])
        assert any(p.q_perm is None for p in vparts)
        if isinstance(w, QBoundary):  # every key valid: the plain packed order is the original one, no kv_perm
            assert any(p.q_perm is None and p.kv_perm is None for p in vparts)
        with monkeypatch.context() as mp:
            mp.setattr(boundary, "_in_place", lambda *a: False)
            moved = w.build_layout(q, k, modality=m)
        mparts = _parts(moved.parts[moved.kinds.index(1)])
        assert all(p.q_perm is not None for p in mparts)
        for p, p_moved in zip(vparts, mparts):
            if p.kv_perm is not None:  # Grid's lines: keys by the estimated phases
                np.testing.assert_array_equal(np.asarray(p.kv_perm), np.asarray(p_moved.kv_perm))
        ref, ref_lse = masked_dense_attention(q, k, v, layout.to_dense_mask())
        out, lse = mmjax.sparse.attend(q, k, v, layout, KernelOptions(implementation="reference"))
        assert rel_err(out, ref) < 1e-5
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4)


@pytest.mark.parametrize("with_columns", [False, True])
def test_restricting_keys_keeps_exactly_the_valid_pairs(with_columns):
    """`restrict_to_valid` (keys below ``n_valid``) and `restrict_from` (keys from ``start`` on: keys in place) keep
    exactly the pairs of the part on those keys, per key: blocks outside go, the straddling block's valid keys become
    columns (one shared list, each query block reading a prefix, for a part without columns and one cut per batch
    row; else per query block, after the part's own columns outside that block)."""
    t, s, bk = 96, 160, 16
    part = BlockLayout.random_causal(jax.random.PRNGKey(5), t, s, keep=0.5, block_q=32, block_k=bk, batch=2,
                                     heads=2)
    pos = np.arange(s)
    if with_columns:  # a few columns per query block outside its listed blocks
        listed = np.asarray(part.computed_pairs_permuted())[..., ::32, :]  # [B, N, nq, S]: the listed keys
        cols = np.zeros(listed.shape[:3] + (6,), np.int32)
        ccount = np.zeros(listed.shape[:3], np.int32)
        for idx in np.ndindex(*listed.shape[:3]):
            free = pos[~listed[idx]][::5][:6]
            cols[idx][:len(free)], ccount[idx] = free, len(free)
        part = part.replace(kv_columns=jnp.asarray(cols), kv_column_count=jnp.asarray(ccount))
    full = np.asarray(part.to_dense_mask())
    cut = np.asarray([[37], [64]], np.int32)  # a straddling block in row 0, none in row 1
    for out, keep in ((restrict_to_valid(part, jnp.asarray(cut)), pos[None, :] < cut),
                      (restrict_from(part, jnp.asarray(cut)), pos[None, :] >= cut)):
        check_layout_values(out)
        assert (out.kv_columns.shape[2] == 1) == (not with_columns)  # the shared list
        np.testing.assert_array_equal(np.asarray(out.to_dense_mask()), full & keep[:, None, None, :])


def test_a_video_between_prompt_and_question_keeps_its_keys_in_place(monkeypatch):
    """In a TwoDBoundary the video rows' (video, video) pair has its keys in one run that ends after every video row:
    the parts in the plain key order keep the original key order (no ``kv_perm``), cut below the video's first key
    (`restrict_from`), so the band lists the pattern's aligned key blocks; keys past the video are left to causality.
    The video rows still see video keys only, Grid's mask is the one of the packed keys (its band is exact by its
    window) with fewer entries, and attend equals masked dense attention. Pairs whose keys are two runs (the text)
    or end before the query rows (the question's rows over the video) keep the packed order, as do traced ids."""
    s = 640
    q, k, v = random_qkv(27, 1, s, s, 2, 1, 16)
    kinds = np.ones((1, s), np.int32)
    kinds[0, :40], kinds[0, -24:] = 0, 0
    m = Modality.from_token_types(kinds, names=("text", "video"), frame_tokens=32)
    assert boundary._keys_in_place(m, 1, 1, s)
    assert not boundary._keys_in_place(m, 1, 0, s) and not boundary._keys_in_place(m, 0, 1, s)
    g = Grid(stride_space=(24, 32), last_q=16, local=16, **SMALL)  # a band of 32 + 15 keys: 3 aligned blocks
    w = TwoDBoundary({("video", "video"): g}, default=A)
    vid = kinds[0] == 1
    layout = w.build_layout(q, k, modality=m)
    with monkeypatch.context() as mp:
        mp.setattr(boundary, "_keys_in_place", lambda *a: False)
        packed = w.build_layout(q, k, modality=m)
    vparts, pparts = _parts(layout.parts[layout.kinds.index(1)]), _parts(packed.parts[packed.kinds.index(1)])
    band = [p for p in vparts if p.window]
    assert len(band) == 1 and band[0].kv_perm is None and band[0].q_perm is None
    band_packed = [p for p in pparts if p.window][0]
    assert band_packed.kv_perm is not None
    assert int(band[0].kv_block_count.sum()) < int(band_packed.kv_block_count.sum())
    only_video = TwoDBoundary({("video", "video"): g}, skip_missing=True)
    mask = np.asarray(only_video.build_layout(q, k, modality=m).to_dense_mask())[0]
    assert not mask[:, vid][:, :, ~vid].any() and not mask[:, ~vid].any()
    with monkeypatch.context() as mp:
        mp.setattr(boundary, "_keys_in_place", lambda *a: False)
        mask_packed = np.asarray(only_video.build_layout(q, k, modality=m).to_dense_mask())[0]
    np.testing.assert_array_equal(mask, mask_packed)
    for part in _parts(layout):
        check_layout_values(part)
    ref, ref_lse = masked_dense_attention(q, k, v, layout.to_dense_mask())
    out, lse = mmjax.sparse.attend(q, k, v, layout, KernelOptions(implementation="reference"))
    assert rel_err(out, ref) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4)
    traced = jax.jit(lambda ids: w.build_layout(q, k, modality=Modality(ids=ids, names=m.names, frame_tokens=32)))(
        m.ids)
    assert all(p.kv_perm is not None for p in _parts(traced.parts[traced.kinds.index(1)]))


@pytest.mark.parametrize("wrap", ["k", "q", "2d"])
def test_a_closed_over_modality_is_not_folded_at_compile_time(wrap):
    """Under jit a Modality closed over as a constant would let XLA evaluate the whole layout at compile time (its sorts
    over S: TwoDBoundary(Grid(frame))'s layout at 128k compiled in 25.0 s on a CPU, 2.9 s with the ids as a jit
    argument); the wrappers put the ids behind an optimization barrier, so the program computes the layout, the same
    one as eagerly."""
    s = 320
    q, k, _ = random_qkv(28, 1, s, s, 2, 1, 16)
    kinds = np.ones((1, s), np.int32)
    kinds[0, :40], kinds[0, -24:] = 0, 0
    m = Modality.from_token_types(kinds, names=("text", "video"), frame_tokens=32)
    w = {"k": KBoundary(A), "q": QBoundary({"video": G}, default=A),
         "2d": TwoDBoundary({("video", "video"): G}, default=A)}[wrap]
    build = jax.jit(lambda q, k: w.build_layout(q, k, modality=m))
    assert "optimization_barrier" in build.lower(q, k).as_text()
    np.testing.assert_array_equal(np.asarray(build(q, k).to_dense_mask()),
                                  np.asarray(w.build_layout(q, k, modality=m).to_dense_mask()))
