"""The plain decoding loop of `mmjax.generate`: one compiled step for all tokens, steps dispatched one
ahead of the host's token check with the same tokens as a step-by-step loop, streaming and the end
of rows unchanged."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mmjax
from mmjax.inference import decode_step, prefill
from models.qwen2_5_vl import Qwen2_5_VL
from tests.models.helpers import small_config

generate_mod = importlib.import_module("mmjax.speculative.generate")  # the package re-exports the function


@pytest.fixture(scope="module")
def model():
    return Qwen2_5_VL(small_config(), dtype=jnp.float32, key=jax.random.key(11))


def _stepwise_greedy(model, ids, n):
    """Greedy tokens of a step-by-step loop that reads every token before the next step."""
    pre = prefill(model, {"input_ids": ids}, max_length=ids.shape[1] + n + 1)
    tok = jnp.argmax(pre.logits, -1).astype(jnp.int32)
    out, cache = [np.asarray(tok)], pre.cache
    for _ in range(n - 1):
        logits, cache = decode_step(model, cache, tok)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        out.append(np.asarray(tok))
    return np.stack(out, 1)


def test_plain_generate_compiles_one_step_and_matches_a_stepwise_loop(model):
    ids = np.asarray([[3, 9, 14, 27, 2, 11], [4, 4, 8, 15, 16, 23]])
    streamed = []
    before = generate_mod._decode_and_sample._cache_size()
    out = mmjax.generate(model, {"input_ids": ids}, 7,
                         on_tokens=lambda toks: streamed.append([t.tolist() for t in toks]))
    np.testing.assert_array_equal(out.tokens, _stepwise_greedy(model, ids, 7))
    assert out.tau.shape == (6, 2) and (out.tau == 1).all()  # the extra step dispatched ahead is not emitted
    assert streamed == [[[int(out.tokens[r, i])] for r in range(2)] for i in range(7)]
    assert generate_mod._decode_and_sample._cache_size() == before + 1  # one program for every step
    mmjax.generate(model, {"input_ids": ids}, 7)  # same shapes: no new compilation
    assert generate_mod._decode_and_sample._cache_size() == before + 1


def test_rows_that_end_early_stop_emitting(model):
    ids = np.asarray([[3, 9, 14, 27, 2, 11], [4, 4, 8, 15, 16, 23]])
    ref = mmjax.generate(model, {"input_ids": ids}, 6).tokens
    eos = int(ref[0, 2])  # row 0 emits it as its third token
    out = mmjax.generate(model, {"input_ids": ids}, 6, eos_token_id=eos)
    n0 = int(np.argmax(ref[0] == eos)) + 1
    np.testing.assert_array_equal(out.tokens[0, :n0], ref[0, :n0])
    assert (out.tokens[0, n0:] == -1).all() and out.num_tokens[0] == n0
    n1 = int(np.argmax(ref[1] == eos)) + 1 if (ref[1] == eos).any() else 6
    np.testing.assert_array_equal(out.tokens[1, :n1], ref[1, :n1])
    assert out.num_tokens[1] == n1
