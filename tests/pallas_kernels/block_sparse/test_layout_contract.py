"""The layout value contract (`pallas_kernels.block_sparse.layout`): every builder keeps it,
and `BlockLayout.check` finds each violation eagerly and under ``checkify`` inside jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from pallas_kernels import BlockLayout, block_sparse_attention
from tests.pallas_kernels.helpers import random_layout, random_qkv

T, S, B = 40, 56, 16


def _base(**changes):
    lay = BlockLayout(kv_blocks=jnp.array([[[[0, 1, 0], [0, 1, 2]], [[1, 0, 0], [2, 3, 0]]]], jnp.int32),
                      kv_block_count=jnp.array([[[2, 3], [1, 2]]], jnp.int32),
                      kv_columns=jnp.array([[[[40, 0], [50, 3]]]], jnp.int32),
                      kv_column_count=jnp.array([[[1, 0]]], jnp.int32),
                      q_len=32, kv_len=56, block_q=16, block_k=16)
    return lay.replace(**changes)


def test_builders_keep_the_contract():
    rng = np.random.default_rng(0)
    for lay in (BlockLayout.dense_causal(T, S, block_q=16, block_k=16, heads=2),
                BlockLayout.random_causal(jax.random.key(1), T, S, keep=0.5, block_q=16, block_k=16, heads=3),
                random_layout(rng, 2, 2, T, S, 16, 16, perm=True, columns=6)):
        lay.check()  # eager: raises on a violation
        err, _ = checkify.checkify(jax.jit(lambda lay: lay.check()))(lay)
        assert err.get() is None
    _base().check()


VIOLATIONS = [
    (dict(kv_block_count=jnp.array([[[2, 4], [1, 2]]], jnp.int32)), r"kv_block_count: expected 0 <= count <= max_blocks=3"),
    (dict(kv_blocks=jnp.array([[[[0, 9, 0], [0, 1, 2]], [[1, 0, 0], [2, 3, 0]]]], jnp.int32)),
     r"kv_blocks: expected listed ids in \[0, 4\)"),
    (dict(kv_blocks=jnp.array([[[[0, 0, 5], [0, 1, 2]], [[1, 0, 0], [2, 3, 0]]]], jnp.int32)),
     r"kv_blocks: expected distinct ids per query block"),
    (dict(kv_columns=jnp.array([[[[20, 0], [50, 3]]]], jnp.int32)), r"kv_columns: expected columns outside the listed"),
    (dict(kv_columns=jnp.array([[[[40, 40], [50, 3]]]], jnp.int32), kv_column_count=jnp.array([[[2, 0]]], jnp.int32)),
     r"kv_columns: expected distinct columns"),
    (dict(kv_columns=jnp.array([[[[56, 0], [50, 3]]]], jnp.int32)), r"kv_columns: expected key indices in \[0, 56\)"),
    (dict(kv_perm=jnp.zeros((1, 1, 56), jnp.int32)), r"kv_perm: expected a permutation of 0..55"),
]


@pytest.mark.parametrize("changes,match", VIOLATIONS, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(VIOLATIONS)])
def test_check_names_each_violation(changes, match):
    bad = _base(**changes)
    with pytest.raises(checkify.JaxRuntimeError, match=match):
        bad.check()
    err, _ = checkify.checkify(jax.jit(lambda lay: lay.check()))(bad)
    with pytest.raises(checkify.JaxRuntimeError, match=match):
        err.throw()


def test_a_repeated_id_is_what_check_prevents():
    """Why the contract matters: a repeated block is counted twice (lse + ln 2 when it is the
    only block); `check` under checkify catches it inside the same jit as the kernel."""
    q, k, v = random_qkv(0, 1, 16, 16, 1, 1, 16)
    once = BlockLayout(jnp.array([[[[0, 0]]]], jnp.int32), jnp.array([[[1]]], jnp.int32), q_len=16, kv_len=16,
                       block_q=16, block_k=16)
    twice = once.replace(kv_block_count=jnp.array([[[2]]], jnp.int32))

    def attend(lay):
        lay.check()
        return block_sparse_attention(q, k, v, lay, implementation="reference")

    f = checkify.checkify(jax.jit(attend))
    err, (_, lse1) = f(once)
    assert err.get() is None
    err, (_, lse2) = f(twice)
    assert "distinct ids" in str(err.get())
    np.testing.assert_allclose(np.asarray(lse2), np.asarray(lse1) + np.log(2.0), rtol=1e-5)
