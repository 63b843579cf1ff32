"""Per-head dispatch: one pattern per query head equals per-head masked dense attention;
heads with an identical pattern share one kernel launch; GQA stays correct."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
import mmjax.sparse.layouts
from mmjax.sparse.attention import attend_heads, head_groups
from mmjax.sparse.patterns import AShape, Dense, Grid, KernelOptions, VerticalSlash
from tests.pallas_kernels.helpers import masked_dense_attention, random_qkv, rel_err

SMALL = dict(block_q=32, block_k=16)
INTERPRET = KernelOptions(interpret=True)
REF = KernelOptions(implementation="reference")


def _per_head_mask(q, k, patterns):
    """bool [B, N, T, S]: head h's mask from its own pattern's layout on the full inputs."""
    masks = []
    for h, p in enumerate(patterns):
        m = mmjax.build_layout(q, k, p).to_dense_mask()
        m = jnp.broadcast_to(m, (q.shape[0], q.shape[2]) + m.shape[2:])
        masks.append(m[:, h])
    return jnp.stack(masks, 1)


@pytest.mark.parametrize("n,kh,assign", [
    (4, 2, (0, 0, 1, 1)),  # whole GQA groups per pattern: GQA kept
    (6, 1, (2, 0, 1, 2, 0, 1)),  # groups split across GQA groups: k/v copied per head
])
def test_per_head_equals_masked_dense(n, kh, assign):
    kinds = [AShape(sink=16, local=48, **SMALL),
             VerticalSlash(vertical_size=16, slash_size=16, last_q=16, keep_first=8, keep_local=16, **SMALL),
             Grid(stride_space=(32, 48), last_q=16, local=32, **SMALL)]
    patterns = [kinds[a] for a in assign]
    q, k, v = random_qkv(n + kh, 2, 96, 128, n, kh, 16)
    ref, ref_lse = masked_dense_attention(q, k, v, _per_head_mask(q, k, patterns))
    if assign == (0, 0, 1, 1):  # the Pallas kernel on the GQA-kept case; the reference path on all
        out = mmjax.sparse_attention(q, k, v, patterns, options=INTERPRET)
        assert out.shape == q.shape and rel_err(out, ref) < 1e-5
    out_ref, lse = jax.jit(lambda q, k, v: attend_heads(q, k, v, patterns, options=REF))(q, k, v)
    assert rel_err(out_ref, ref) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-5)


def test_identical_patterns_share_one_launch(monkeypatch):
    calls = []

    def counting(real):
        def run(q, *args, **kw):
            calls.append(q.shape[2])
            return real(q, *args, **kw)
        return run

    monkeypatch.setattr(mmjax.sparse.layouts, "block_sparse_attention_parts",
                        counting(mmjax.sparse.layouts.block_sparse_attention_parts))
    a, b = AShape(sink=16, local=32, **SMALL), Dense(**SMALL)
    q, k, v = random_qkv(1, 1, 64, 64, 8, 4, 16)
    mmjax.sparse_attention(q, k, v, [a, b, a, a, b, a, a, a], options=REF)
    assert sorted(calls) == [2, 6]  # one launch per distinct pattern, over its heads
    calls.clear()
    mmjax.sparse_attention(q, k, v, [AShape(sink=16, local=32, **SMALL) for _ in range(8)], options=REF)
    assert calls == [8]


def test_single_pattern_and_uniform_list_agree():
    q, k, v = random_qkv(5, 1, 96, 96, 4, 2, 16)
    p = AShape(sink=16, local=32, **SMALL)
    one = mmjax.sparse_attention(q, k, v, p, options=REF)
    many = mmjax.sparse_attention(q, k, v, (p,) * 4, options=REF)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(many))


def test_recall_per_head_matches_single_pattern_recall():
    q, k, v = random_qkv(6, 1, 96, 128, 4, 2, 16)
    a, d = AShape(sink=16, local=32, **SMALL), Dense(**SMALL)
    got = np.asarray(mmjax.attention_recall(q, k, v, [a, d, d, a], options=REF))
    ra = np.asarray(mmjax.attention_recall(q, k, v, a, options=REF))
    np.testing.assert_allclose(got[:, [0, 3]], ra[:, [0, 3]], rtol=1e-5)
    np.testing.assert_allclose(got[:, [1, 2]], 1.0, rtol=1e-5)


def test_bad_per_head_patterns_name_the_argument():
    q, k, v = random_qkv(0, 1, 32, 32, 4, 2, 16)
    with pytest.raises(ValueError, match=r"patterns: expected one pattern per query head \(N=4\); received 3"):
        mmjax.sparse_attention(q, k, v, [Dense(**SMALL)] * 3)
    with pytest.raises(ValueError, match="pattern: expected an mmjax.sparse.patterns pattern"):
        mmjax.sparse_attention(q, k, v, [Dense(**SMALL)] * 3 + ["grid"])
    with pytest.raises(ValueError, match=r"modality: expected ids of shape \[1, 32\]"):
        mmjax.sparse_attention(q, k, v, Dense(**SMALL), modality=np.zeros((1, 31), np.int32))
    assert head_groups([Dense(**SMALL), Dense(**SMALL)], 2) == [(Dense(**SMALL), (0, 1))]
