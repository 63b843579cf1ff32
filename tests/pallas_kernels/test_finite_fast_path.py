"""The Triton kernels' finite fast path: with ``poison=None`` (the default) the block-sparse and QSA
kernels run without their non-finite checks when every input is finite and with them otherwise
(``lax.cond`` on `nonfinite.all_finite`). Both branches must give bit-identical results to the forced
forms (interpret mode), and the choice must follow the inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_sparse.triton import block_sparse_attention_triton
from pallas_kernels.nonfinite import all_finite
from pallas_kernels.qsa_topk.triton import qsa_topk_triton
from tests.pallas_kernels.helpers import random_layout, random_qkv


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_all_finite():
    x = jnp.ones((3, 4))
    assert bool(all_finite(x, x))
    assert not bool(all_finite(x, x.at[1, 2].set(jnp.inf)))
    assert not bool(all_finite(x.at[0, 0].set(jnp.nan), x))


@pytest.mark.parametrize("bad", [None, "k", "v"])
def test_block_sparse_auto_equals_the_forced_form(bad):
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(5, 1, 48, 64, 4, 2, 16)
    if bad == "k":
        k = k.at[0, 9, 1, 3].set(jnp.nan)
    elif bad == "v":
        v = v.at[0, 30, 0, 0].set(jnp.inf)
    layout = random_layout(rng, 1, 4, 48, 64, 16, 16, density=0.5, perm=True, columns=5)
    kw = dict(sm_scale=0.25, interpret=True)
    auto = block_sparse_attention_triton(q, k, v, layout, **kw)
    _equal(auto, block_sparse_attention_triton(q, k, v, layout, poison=True, **kw))
    if bad is None:
        _equal(auto, block_sparse_attention_triton(q, k, v, layout, poison=False, **kw))
    else:
        assert np.isnan(np.asarray(auto[0])).any()


@pytest.mark.parametrize("topk,bad", [("estimated", None), ("exact", None), ("estimated", "q")])
def test_qsa_auto_equals_the_forced_form(topk, bad):
    q, k, v = random_qkv(6, 1, 256, 256, 4, 2, 16)
    if bad == "q":
        q = q.at[0, 32, 2, 1].set(jnp.nan)  # a sampled row (gamma 16)
    kw = dict(gamma=16, block_kv=16, top_k=4, k_exact=2 if topk == "estimated" else 0, topk=topk, sink_blocks=1,
              local=32, sm_scale=0.25, rows=16, interpret=True)
    auto = qsa_topk_triton(q, k, v, **kw)
    _equal(auto, qsa_topk_triton(q, k, v, poison=True, **kw))
    if bad is None:
        _equal(auto, qsa_topk_triton(q, k, v, poison=False, **kw))
    else:
        assert np.isnan(np.asarray(auto.out_gamma)).any()


def test_auto_compiles_both_kernels_behind_one_cond():
    q, k, v = random_qkv(7, 1, 32, 32, 2, 1, 16)
    layout = random_layout(np.random.default_rng(7), 1, 2, 32, 32, 16, 16, density=0.5)

    def count(poison):
        text = str(jax.make_jaxpr(lambda q, k, v: block_sparse_attention_triton(
            q, k, v, layout, sm_scale=0.25, interpret=True, poison=poison))(q, k, v))
        return text.count("cond["), text.count("pallas_call[")

    conds_auto, calls_auto = count(None)
    conds_forced, calls_forced = count(True)
    assert calls_auto == 2 and calls_forced == 1
    assert conds_auto == 2 * conds_forced + 1  # each kernel body holds its own tile conds
