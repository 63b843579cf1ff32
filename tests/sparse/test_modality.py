"""Modality: constructors, static spans, validation naming the argument, pytree behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax import Modality
from mmjax.sparse.modality import as_modality, compute_spans


def test_from_token_types_spans_and_names():
    types = np.array([[0, 0, 1, 1, 1, 0, 2, 2], [3, 3, 3, 3, 0, 0, 0, 0]])
    m = Modality.from_token_types(types, names=("text", "image", "video", "audio"))
    assert m.ids.dtype == jnp.int32 and m.shape == (2, 8) and m.num_kinds == 4
    assert m.spans == (((0, 0, 2), (1, 2, 5), (0, 5, 6), (2, 6, 8)), ((3, 0, 4), (0, 4, 8)))
    assert m.spans_of(0, "text") == ((0, 2), (5, 6))
    assert m.spans_of(1, 3) == ((0, 4),)
    assert m.kind("audio") == 3
    np.testing.assert_array_equal(np.asarray(m.query_ids(3)), types[:, -3:])


def test_spans_cover_every_row_exactly():
    rng = np.random.default_rng(0)
    types = rng.integers(0, 3, size=(3, 50)) * (rng.random((3, 50)) < 0.7)
    for row, spans in zip(types, compute_spans(types)):
        rebuilt = np.concatenate([np.full(e - s, k) for k, s, e in spans])
        np.testing.assert_array_equal(rebuilt, row)
        assert all(a[0] != b[0] for a, b in zip(spans, spans[1:]))  # runs are maximal


def test_from_input_ids_maps_pad_tokens():
    ids = np.array([[5, 151655, 151655, 7, 151656, 151656, 151656, 9, 42]])
    m = Modality.from_input_ids(ids, image_token_id=151655, video_token_id=151656, audio_token_id=42)
    assert m.names == ("text", "image", "video", "audio")
    np.testing.assert_array_equal(np.asarray(m.ids), [[0, 1, 1, 0, 2, 2, 2, 0, 3]])
    m2 = Modality.from_input_ids(ids, image_token_id=151655, video_token_id=151656,
                                 extra_token_ids={"depth": 9})
    assert m2.names == ("text", "image", "video", "depth")
    np.testing.assert_array_equal(np.asarray(m2.ids), [[0, 1, 1, 0, 2, 2, 2, 3, 0]])


def test_pytree_and_traced_construction():
    m = Modality.from_token_types(np.array([[0, 1, 1, 2]]))
    leaves, tree = jax.tree_util.tree_flatten(m)
    assert len(leaves) == 1
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert back.spans == m.spans and back.names == m.names
    out = jax.jit(lambda mm: mm.ids.sum())(m)
    assert int(out) == 4
    traced = jax.jit(lambda t: Modality.from_token_types(t).ids * 2)(jnp.array([[0, 1, 2]]))
    np.testing.assert_array_equal(np.asarray(traced), [[0, 2, 4]])


@pytest.mark.parametrize("call,match", [
    (lambda: Modality.from_token_types(np.zeros((2, 3, 4), np.int32)), "token_types: expected"),
    (lambda: Modality.from_token_types(np.zeros((2, 3), np.float32)), "token_types: expected an integer"),
    (lambda: Modality.from_token_types(np.array([[0, 3]])), r"token_types: expected ids in \[0, 3\)"),
    (lambda: Modality.from_token_types(np.array([[0, -1]])), "token_types"),
    (lambda: Modality.from_token_types(np.array([[0]]), names=("a", "a")), "names: expected distinct"),
    (lambda: Modality.from_token_types(np.array([[0]]), names="text"), "names"),
    (lambda: Modality.from_input_ids(np.array([[1]]), image_token_id=3, video_token_id=3), "distinct pad"),
    (lambda: Modality.from_input_ids(np.array([[1]]), image_token_id="x", video_token_id=3), "image_token_id"),
    (lambda: Modality.from_input_ids(np.array([[1.0]]), image_token_id=2, video_token_id=3), "input_ids"),
    (lambda: Modality.from_token_types(np.array([[0, 1]])).kind("audio"), "name: expected one of"),
])
def test_validation_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_lengths_checked_against_qk():
    q, k = jnp.zeros((2, 6, 4, 8)), jnp.zeros((2, 10, 2, 8))
    m = Modality.from_token_types(np.zeros((2, 10), np.int32))
    m.check(q, k)
    with pytest.raises(ValueError, match=r"modality: expected ids of shape \[2, 10\]"):
        Modality.from_token_types(np.zeros((2, 9), np.int32)).check(q, k)
    with pytest.raises(ValueError, match=r"modality: expected ids of shape \[2, 10\]"):
        as_modality(np.zeros((1, 10), np.int32), q, k)
    with pytest.raises(ValueError, match="modality: expected a Modality or integer ids"):
        as_modality(np.zeros((2, 10), np.float32), q, k)
    raw = as_modality(jnp.array([[0, 1, 2, 0, 0, 0, 0, 0, 0, 0]] * 2), q, k)
    assert raw.names == ("text", "image", "video") and raw.spans[0][1] == (1, 1, 2)
    with pytest.raises(ValueError, match="spans are unknown"):
        jax.jit(lambda t: Modality.from_token_types(t).spans_of(0, 0))(jnp.zeros((1, 3), jnp.int32))
