"""Speculative decoding on a GPU: the split-K Pallas verification kernel inside the decoding loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax.speculative import SparrowDraft, TargetDraft, TreeConfig
from models.qwen2_5_vl.model import cached_forward
from pallas_kernels.tree_decode import tree_decode_attention
from tests.models.helpers import video_prompt
from tests.speculative.test_speculative import _model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")]


def model_and_prompt():
    """The tiny target (`test_speculative._model`) and a 4-frame video prompt."""
    model = _model()
    return model, video_prompt(model.config, frames=4, rng=np.random.default_rng(0))


@pytest.fixture(scope="module")
def setup():
    return model_and_prompt()


def verification_case(model, inputs):
    """The prompt prefilled with 64 free slots, then a 9-token tree block to verify (random tokens, a random
    ancestor mask with the diagonal): (prefill result, block start t, tokens [1, 9], block mask [1, 9, 9],
    positions [1, 9])."""
    pre = mmjax.prefill(model, inputs, max_length=inputs["input_ids"].shape[1] + 64)
    t = int(pre.cache.length)
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(0, 60, (1, 9)), jnp.int32)
    block = jnp.asarray(np.tril(rng.random((1, 9, 9)) < 0.5) | np.eye(9, dtype=bool)[None])
    pos = pre.cache.next_position[:, None] + jnp.arange(9)
    return pre, t, toks, block, pos


def verification_logits(model, case, attn) -> np.ndarray:
    """float32 ``[1, 9, V]``: the case's block through `cached_forward` with ``attn`` as its tree attention (on a
    copy of the cache, which the forward donates)."""
    pre, t, toks, block, pos = case
    cache = jax.tree.map(jnp.copy, pre.cache)
    logits, _, _ = cached_forward(model, cache, toks, pos, jnp.asarray(t, jnp.int32), pre.cache.valid,
                                  jnp.asarray(t, jnp.int32), block, tree_attn=attn)
    return np.asarray(logits)


def test_greedy_speculative_equals_plain_on_gpu(setup):
    model, inputs = setup
    plain = mmjax.generate(model, inputs, 20)
    for draft, tree in ((TargetDraft(), TreeConfig(30, 4, 8)), (SparrowDraft.init(model, jax.random.key(1)),
                                                                 TreeConfig(48, 5, 10))):
        out = mmjax.generate(model, inputs, 20, draft=draft, tree=tree)
        np.testing.assert_array_equal(out.tokens, plain.tokens)


def test_verification_kernel_matches_xla(setup):
    model, inputs = setup
    case = verification_case(model, inputs)
    ref = verification_logits(model, case, functools.partial(tree_decode_attention, implementation="reference"))
    np.testing.assert_allclose(verification_logits(model, case, tree_decode_attention), ref, atol=2e-3, rtol=2e-3)
