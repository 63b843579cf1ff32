"""Boundary wrappers: each one's output equals masked dense attention for the mask it builds
(causal on original positions); rows follow their own modality; bad arguments name themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax import Modality
from mmjax.layout_ops import LayoutSet
from mmjax.patterns import (AShape, Dense, Grid, KBoundary, KernelOptions, NoBoundary, QBoundary, RowSplit,
                            TriShape, TwoDBoundary, VerticalSlash)
from pallas_kernels.block_sparse.validation import check_layout_values
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
                  ("text", "video"): TRI, ("image", "image"): D, ("image", "text"): A}),
]


def _parts(layout):
    if isinstance(layout, RowSplit):
        return [p for part in layout.parts for p in _parts(part)]
    return list(layout.parts) if isinstance(layout, LayoutSet) else [layout]


# Every wrapper through the Pallas kernel (interpret) on one shape; batch 2 / GQA / T < S on
# the reference path for the wrappers with their own permutation code.
CASES = ([(w, (1, 160, 160, 2, 1), True) for w in WRAPPERS]
         + [(w, (2, 112, 176, 2, 2), False) for w in (WRAPPERS[1], WRAPPERS[2], WRAPPERS[3], WRAPPERS[5])])


@pytest.mark.parametrize("wrapper,shape,interpret", CASES,
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
    # TwoD: unlisted query kinds get no keys; listed pairs only see keys of blocks owned by
    # their key kind (block owner = kind of its first key in modality order).
    two = mmjax.build_layout(q, k, TwoDBoundary({("video", "text"): D}), m)
    mask2 = np.asarray(two.to_dense_mask())[0, 0]
    assert not mask2[kinds != 2].any() and mask2[kinds == 2].any()
    order = np.argsort(kinds, kind="stable")
    owner = kinds[order][::16][np.arange(200) // 16]  # owner of each sorted key's block
    allowed = np.zeros(200, bool)
    allowed[order[owner == 0]] = True
    assert not mask2[:, ~allowed].any()
    out = mmjax.sparse_attention(q, k, v, TwoDBoundary({("video", "text"): D}), m,
                                 options=KernelOptions(implementation="reference"))
    assert not np.asarray(out)[0, kinds != 2].any()


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
    with pytest.raises(ValueError, match=r"patterns\[\('video', 'video'\)\]: expected an intra pattern without"):
        mmjax.build_layout(q, k, TwoDBoundary({("video", "video"): G}), m)
    with pytest.raises(ValueError, match=r"patterns\['text'\]: expected an mmjax.patterns pattern"):
        QBoundary({"text": "grid"})
    with pytest.raises(ValueError, match="patterns: bad key"):
        TwoDBoundary({"text": A})
    with pytest.raises(ValueError, match="pattern: expected an mmjax.patterns pattern"):
        KBoundary("a")
