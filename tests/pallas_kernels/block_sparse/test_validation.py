"""Bad arguments raise ValueError naming the argument, before any kernel is traced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import BlockLayout, block_sparse_attention
from tests.pallas_kernels.helpers import random_qkv


@pytest.fixture
def qkv():
    return random_qkv(0, 1, 32, 48, 4, 2, 16)


def _layout(t=32, s=48):
    return BlockLayout.dense_causal(t, s, block_q=16, block_k=16)


def _raises(match, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        block_sparse_attention(*args, **kwargs)


def test_rank_shape_dtype(qkv):
    q, k, v = qkv
    lay = _layout()
    _raises(r"q: expected rank 4 \[B, T, N, D\]; received shape \[32, 4, 16\]", q[0], k, v, lay)
    _raises(r"k: expected rank 4", q, k[0], v, lay)
    _raises(r"v: expected the shape of k", q, k, v[:, :, :1], lay)
    _raises(r"q: expected dtype bfloat16, float16 or float32; received int32", q.astype(jnp.int32), k, v, lay)
    _raises(r"q, k, v: expected one dtype", q.astype(jnp.bfloat16), k, v, lay)
    _raises(r"k: expected head dim 16", q, k[..., :8], v[..., :8], lay)
    _raises(r"k: expected batch 1", q, jnp.concatenate([k, k]), jnp.concatenate([v, v]), lay)


def test_gqa_and_lengths(qkv):
    q, k, v = qkv
    _raises(r"k: expected a number of key heads K dividing the query heads N=4.*received K=3",
            q, jnp.concatenate([k, k[:, :, :1]], 2), jnp.concatenate([v, v[:, :, :1]], 2), _layout())
    big_q = random_qkv(1, 1, 64, 48, 4, 2, 16)[0]
    _raises(r"q: expected T <= S", big_q, k, v, _layout())
    _raises(r"layout: expected q_len=32, kv_len=48", q, k, v, _layout(16, 48))
    _raises(r"layout: expected a BlockLayout", q, k, v, {"kv_blocks": 0})


def test_layout_arrays(qkv):
    q, k, v = qkv
    lay = _layout()
    _raises(r"layout.kv_blocks: expected shape \[1\|1, 4\|1, 2\|1, max_blocks\]; received \[1, 1, 3, 3\]",
            q, k, v, lay.replace(kv_blocks=jnp.zeros((1, 1, 3, 3), jnp.int32)))
    _raises(r"layout.kv_block_count: expected dtype int32; received float32",
            q, k, v, lay.replace(kv_block_count=lay.kv_block_count.astype(jnp.float32)))
    _raises(r"layout.kv_blocks: expected shape \[1\|1, 4\|1",
            q, k, v, lay.replace(kv_blocks=jnp.zeros((1, 3, 2, 3), jnp.int32)))
    _raises(r"layout.kv_block_count: expected 0 <= count <= max_blocks=3; received values in \[3, 4\]",
            q, k, v, lay.replace(kv_block_count=lay.kv_block_count + 1))
    _raises(r"layout.kv_blocks: expected block ids in \[0, 3\).*received ids in \[1, 5\]",
            q, k, v, lay.replace(kv_blocks=lay.kv_blocks.at[0, 0, 0, 0].set(5)))
    _raises(r"layout.kv_blocks: expected distinct block ids",
            q, k, v, lay.replace(kv_blocks=lay.kv_blocks.at[0, 0, 0, 1].set(0)))
    _raises(r"layout.kv_columns / kv_column_count: expected both or neither",
            q, k, v, lay.replace(kv_columns=jnp.zeros((1, 1, 2, 4), jnp.int32)))
    cols = jnp.zeros((1, 1, 2, 4), jnp.int32)
    _raises(r"layout.kv_columns: expected key indices in \[0, 48\)",
            q, k, v, lay.replace(kv_columns=cols.at[0, 0, 0, 0].set(48),
                                 kv_column_count=jnp.ones((1, 1, 2), jnp.int32)))
    _raises(r"layout.kv_columns: expected columns outside the listed key blocks",
            q, k, v, lay.replace(kv_columns=cols, kv_column_count=jnp.ones((1, 1, 2), jnp.int32)))
    _raises(r"layout.q_perm: expected shape", q, k, v, lay.replace(q_perm=jnp.zeros((1, 1, 31), jnp.int32)))
    _raises(r"layout.kv_perm: expected a permutation of 0..47",
            q, k, v, lay.replace(kv_perm=jnp.zeros((1, 1, 48), jnp.int32)))


def test_implementation_name(qkv):
    q, k, v = qkv
    _raises(r"implementation: expected one of \('reference', 'triton', 'mosaic_gpu'\)", q, k, v, _layout(),
            implementation="cuda")


def test_validation_runs_before_tracing_inside_jit(qkv):
    q, k, v = qkv
    lay = _layout()

    @jax.jit
    def run(q, k, v, lay):
        return block_sparse_attention(q, k, v, lay, interpret=True)

    with pytest.raises(ValueError, match="q: expected dtype"):
        run(q.astype(jnp.int8), k, v, lay)
    # A valid traced layout gives exactly the eager (validated) result.
    out, lse = run(q, k, v, lay)
    ref, ref_lse = block_sparse_attention(q, k, v, lay, implementation="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-6)


def test_traced_out_of_range_entries_are_neutralised_identically(qkv):
    """Inside jit the values of a layout cannot be checked: ids / columns out of range add
    nothing and counts are clamped, in the reference and the kernel alike, so the result is
    the attention of the valid entries alone (the documented result, not a clamped block)."""
    q, k, v = qkv  # T=32, S=48, block 16: 3 key blocks
    good = jnp.array([[[[0, 1, 0, 0], [0, 1, 2, 0]]]], jnp.int32)
    bad = jnp.array([[[[0, 7, 1, -4], [0, 1, 2, 99]]]], jnp.int32)
    cols = jnp.array([[[[47, 0, 0], [-3, 60, 0]]]], jnp.int32)
    expected = BlockLayout(good, jnp.array([[[2, 3]]], jnp.int32), q_len=32, kv_len=48, block_q=16, block_k=16)
    traced = BlockLayout(bad, jnp.array([[[4, 9]]], jnp.int32), kv_columns=cols,
                         kv_column_count=jnp.array([[[0, 2]]], jnp.int32), q_len=32, kv_len=48, block_q=16, block_k=16)
    want, want_lse = block_sparse_attention(q, k, v, expected, implementation="reference")
    with pytest.raises(ValueError, match=r"layout.kv_block_count: expected 0 <= count <= max_blocks=4"):
        block_sparse_attention(q, k, v, traced)  # concrete: rejected before tracing
    for impl in ("reference", "triton"):
        out, lse = jax.jit(lambda q, k, v, lay: block_sparse_attention(q, k, v, lay, implementation=impl,
                                                                      interpret=True))(q, k, v, traced)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=impl)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-6, err_msg=impl)
