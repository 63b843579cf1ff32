"""A prior result merged into a block-sparse pass (``prior``): `block_sparse_attention`'s argument and its checks,
the Mosaic GPU passes with the kernel emulated on the CPU (which launches take the prior in, which merge it
afterwards), and `block_sparse_attention_parts` (the kernel itself: test_mosaic_gpu_gpu.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.sparse.layouts import KernelOptions, attend
from mmjax.sparse.modality import Modality
from mmjax.sparse.patterns import AShape, Grid, QBoundary, TwoDBoundary
from pallas_kernels.block_sparse import (
    api,
    block_sparse_attention,
    block_sparse_attention_parts,
    merge_attention,
    merge_attention_all,
    mosaic_gpu,
)
from pallas_kernels.block_sparse.merge import merge_onto
from tests.pallas_kernels.block_sparse.test_rows import emulated_launch, range_layout, strided_layout
from tests.pallas_kernels.helpers import random_layout, random_qkv, rel_err

SCALE = 64 ** -0.5


def _prior(q, k, v, seed: int):
    """A result over another random layout (some rows empty: lse -inf), as the reference computes it."""
    t, s, n = q.shape[1], k.shape[1], q.shape[2]
    other = random_layout(np.random.default_rng(seed), 1, n, t, s, 64, 64, density=0.3)
    return block_sparse_attention(q, k, v, other, implementation="reference")


def _close(got, want) -> None:
    (o, l), (ro, rl) = got, want
    assert rel_err(np.asarray(o), np.asarray(ro)) < 1e-5
    fin = np.isfinite(np.asarray(rl))
    np.testing.assert_array_equal(np.isfinite(np.asarray(l)), fin)
    np.testing.assert_allclose(np.asarray(l)[fin], np.asarray(rl)[fin], rtol=1e-5, atol=1e-5)


def _case(kind: str, t: int, n: int):
    rng = np.random.default_rng(len(kind) + t)
    if kind == "strided":
        return strided_layout(rng, t, n, 4, 128, 0.3), {}
    if kind == "rows":
        return range_layout(rng, 1, n, t, t, 128, 64, 1, 3, density=0.5), {}
    if kind == "columns":  # a second (column) launch, merged with the block pass's
        return random_layout(rng, 1, n, t, t, 128, 64, columns=40), {"column_pass": "mosaic"}
    lay = random_layout(rng, 1, n, t, t, 128, 64, perm=kind == "permuted", density=0.3)
    return lay, {"persistent": True} if kind == "persistent" else {}


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("merge_in_launch", [False, True])
@pytest.mark.parametrize("kind,in_launch", [
    ("plain", True), ("persistent", True), ("strided", True),
    ("columns", False),  # a second (column) launch: merged after both
    ("permuted", False),  # rows gathered into a per-head order: merged after the pass
    ("rows", False),  # a row-range pass: merged on its rows (`merge_rows`)
])
def test_prior_merges_as_merge_attention_with_the_kernel_emulated(monkeypatch, kind, in_launch, merge_in_launch,
                                                                   masked):
    """The Mosaic passes with a prior give `merge_attention` of it with their result without one (``masked``: on the
    rows of a row mask, the others keeping the prior, `merge_onto`); with ``merge_in_launch`` the launches whose rows
    are the original ones (or strided boxes of them, the prior's lse and the mask gathered into the layout's row
    order) take them in, the others merge afterwards (all of them without)."""
    priors = []
    monkeypatch.setattr(mosaic_gpu, "launch", lambda *a, **kw: priors.append(kw.get("prior") is not None)
                        or emulated_launch(*a, **kw))
    monkeypatch.setattr(mosaic_gpu, "check_supported", lambda *a, **kw: None)  # (float32 inputs for the emulation)
    t, n = 512, 4
    q, k, v = random_qkv(21, 1, t, t, n, 2, 64, jnp.float32)
    layout, opts = _case(kind, t, n)
    run = mosaic_gpu.block_sparse_attention_mosaic_gpu.__wrapped__
    plain = run(q, k, v, layout, sm_scale=SCALE, key_pairs=False, **opts)
    priors.clear()
    prior = _prior(q, k, v, 5)
    mask = jnp.asarray(np.random.default_rng(8).random((1, t)) < 0.5) if masked else None
    got = run(q, k, v, layout, sm_scale=SCALE, key_pairs=False, prior=prior, row_mask=mask,
              merge_in_launch=merge_in_launch, **opts)
    _close(got, merge_onto(prior, [plain], mask))
    if masked:
        off = ~np.asarray(mask)[0]
        np.testing.assert_array_equal(np.asarray(got[0])[0, off], np.asarray(prior[0])[0, off])
    assert any(priors) == (in_launch and merge_in_launch)
    assert priors.count(True) <= 1  # never merged twice (a column pass takes none)


def test_prior_argument_is_checked():
    q, k, v = random_qkv(22, 1, 256, 256, 2, 1, 64, jnp.float32)
    layout = random_layout(np.random.default_rng(1), 1, 2, 256, 256, 64, 64)
    out, lse = _prior(q, k, v, 2)
    for bad in [out, (out,), (out[:, :128], lse), (out.astype(jnp.bfloat16), lse), (out, lse[:, :1]),
                (out, lse.astype(jnp.bfloat16))]:
        with pytest.raises(ValueError, match=r"prior: expected None or \(out float32\[1, 256, 2, 64\] as q, lse "
                                             r"float32\[1, 2, 256\]\)"):
            block_sparse_attention(q, k, v, layout, implementation="reference", prior=bad)
    with pytest.raises(ValueError, match="merge_in_launch: expected True or False; received 1"):
        block_sparse_attention(q, k, v, layout, implementation="reference", prior=(out, lse), merge_in_launch=1)
    with pytest.raises(ValueError, match="merge_in_launch: expected True or False; received 'yes'"):
        block_sparse_attention_parts(q, k, v, [layout], implementation="reference", merge_in_launch="yes")
    for bad in [jnp.ones((1, 255), bool), jnp.ones((1, 256), jnp.int32)]:
        with pytest.raises(ValueError, match=r"row_mask: expected None or bool\[1, 256\] \(\[B, T\] of q\)"):
            block_sparse_attention_parts(q, k, v, [layout], implementation="reference", row_mask=bad)


def test_reference_with_a_prior_is_merge_attention():
    q, k, v = random_qkv(23, 1, 256, 320, 4, 2, 64, jnp.float32)
    layout = random_layout(np.random.default_rng(3), 1, 4, 256, 320, 64, 64, perm=True)
    prior = _prior(q, k, v, 4)
    got = block_sparse_attention(q, k, v, layout, implementation="reference", prior=prior)
    want = merge_attention(*prior, *block_sparse_attention(q, k, v, layout, implementation="reference"))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _three_parts(t: int, n: int):
    rng = np.random.default_rng(9)
    return [random_layout(rng, 1, n, t, t, 128, 64, density=0.2),
            strided_layout(rng, t, n, 4, 128, 0.2),
            random_layout(rng, 1, n, t, t, 128, 64, perm=True, density=0.2)]


def test_parts_off_the_mosaic_kernel_merge_once():
    """Off the Mosaic kernel the parts' results are merged in one pass, bit for bit `merge_attention_all`."""
    t, n = 512, 2
    q, k, v = random_qkv(24, 1, t, t, n, 1, 64, jnp.float32)
    parts = _three_parts(t, n)
    got = block_sparse_attention_parts(q, k, v, parts, implementation="reference")
    want = merge_attention_all(*zip(*[block_sparse_attention(q, k, v, p, implementation="reference")
                                      for p in parts]))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="layouts: expected at least one BlockLayout"):
        block_sparse_attention_parts(q, k, v, [], implementation="reference")


@pytest.mark.parametrize("merge_in_launch", [False, True])
def test_parts_on_the_mosaic_kernel_emulated(monkeypatch, merge_in_launch):
    """On the Mosaic kernel the parts' results are merged in one pass, or with ``merge_in_launch`` they run in turn,
    those whose launch cannot take a prior first, each later one merging the result so far in its launch; the
    result is the parts' merge either way."""
    priors = []
    monkeypatch.setattr(mosaic_gpu, "launch", lambda *a, **kw: priors.append(kw.get("prior") is not None)
                        or emulated_launch(*a, **kw))
    monkeypatch.setattr(api, "check_supported", lambda *a, **kw: None)  # (float32 inputs for the emulation)
    monkeypatch.setattr(api, "block_sparse_attention_mosaic_gpu",
                        mosaic_gpu.block_sparse_attention_mosaic_gpu.__wrapped__)
    t, n = 512, 2
    q, k, v = random_qkv(25, 1, t, t, n, 1, 64, jnp.float32)
    parts = _three_parts(t, n)
    got = block_sparse_attention_parts(q, k, v, parts, implementation="mosaic_gpu", merge_in_launch=merge_in_launch)
    # the permuted rows (per-head key orders: two launches, both branches of a cond) first, then the other two,
    # each taking the result so far in its launch
    assert priors == ([False, False, True, True] if merge_in_launch else [False] * 4)
    singles = [block_sparse_attention(q, k, v, p, implementation="reference") for p in parts]
    _close(got, merge_attention_all(*zip(*singles)))
    prior, mask = _prior(q, k, v, 6), jnp.asarray(np.random.default_rng(2).random((1, t)) < 0.3)
    got = block_sparse_attention_parts(q, k, v, parts, implementation="mosaic_gpu", prior=prior, row_mask=mask,
                                       merge_in_launch=merge_in_launch)
    _close(got, merge_onto(prior, singles, mask))


@pytest.mark.parametrize("kind,persistent,with_prior,masked", [("strided", True, True, True),
                                                                ("bq64", False, True, False),
                                                                ("plain", True, False, True)])
def test_prior_in_launch_lowers_for_cuda(kind, persistent, with_prior, masked):
    """The kernel with a prior and / or a row mask merged in (loaded during the item, merged before the store)
    lowers for CUDA from shapes: on the persistent grid over strided rows, one CTA per item over 64-row query
    blocks, and a mask alone."""
    t, n = 1024, 4
    rng = np.random.default_rng(7)
    layout = (strided_layout(rng, t, n, 8, 128, 0.2) if kind == "strided"
              else random_layout(rng, 1, n, t, t, 64 if kind == "bq64" else 128, 64, density=0.2))
    sd = jax.ShapeDtypeStruct
    shapes = (sd((1, t, n, 128), jnp.bfloat16), sd((1, t, 2, 128), jnp.bfloat16), sd((1, t, 2, 128), jnp.bfloat16),
              jax.tree.map(lambda x: sd(x.shape, x.dtype), layout))
    prior = (sd((1, t, n, 128), jnp.bfloat16), sd((1, n, t), jnp.float32))
    run = jax.jit(functools.partial(mosaic_gpu.block_sparse_attention_mosaic_gpu, sm_scale=SCALE,
                                    persistent=persistent, merge_in_launch=True))
    extra = dict(prior=prior if with_prior else None, row_mask=sd((1, t), jnp.bool_) if masked else None)
    with_prior = run.trace(*shapes, **extra).lower(lowering_platforms=("cuda",)).as_text()
    without = run.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in with_prior and "mosaic_gpu" in without
    assert len(with_prior) > len(without)  # the kernel's prior operands and merge


@pytest.mark.parametrize("wrap", ["q", "2d"])
def test_boundary_row_kinds_merged_in_launch_with_the_kernel_emulated(monkeypatch, wrap):
    """A boundary wrapper's row kinds (`RowSplit`) through `attend` on the Mosaic kernel (emulated) with
    ``merge_in_launch``: each kind's parts merged onto the result so far on that kind's rows in the launches that can
    take it (a row mask in the launch); against `attend` on the reference."""
    masks = []
    monkeypatch.setattr(mosaic_gpu, "launch", lambda *a, **kw: masks.append(kw.get("row_mask") is not None)
                        or emulated_launch(*a, **kw))
    monkeypatch.setattr(mosaic_gpu, "check_supported", lambda *a, **kw: None)
    monkeypatch.setattr(api, "check_supported", lambda *a, **kw: None)
    monkeypatch.setattr(api, "block_sparse_attention_mosaic_gpu",
                        mosaic_gpu.block_sparse_attention_mosaic_gpu.__wrapped__)
    t, n = 768, 4
    q, k, v = random_qkv(26, 1, t, t, n, 2, 64, jnp.float32)
    kinds = np.ones((1, t), np.int32)
    kinds[0, :96], kinds[0, -40:] = 0, 0
    mod = Modality.from_token_types(kinds, names=("text", "video"), frame_tokens=64)
    g = Grid(stride="frame", last_q=16, local=64)
    text = AShape(sink=64, local=128)
    w = QBoundary({"video": g}, default=text) if wrap == "q" else TwoDBoundary({("video", "video"): g}, default=text)
    layout = w.build_layout(q, k, modality=mod)
    got = attend(q, k, v, layout, KernelOptions(implementation="mosaic_gpu", merge_in_launch=True))
    _close(got, attend(q, k, v, layout, KernelOptions(implementation="reference")))
    assert any(masks)
