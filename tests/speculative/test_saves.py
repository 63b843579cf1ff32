"""Draft checkpoints and example shards are directory artefacts swapped in whole: interrupted
at every step a save leaves the old artefact or the new one (never stale shards or a
draft.json of one save with the weights of another); replacing needs overwrite=True."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mmjax.speculative import DraftConfig, SparrowDraft
from mmjax.speculative.data import Example, load_examples, save_examples
from models.qwen2_5_vl import Qwen2_5_VL
from tests.fault_injection import interrupt_every_step
from tests.models.helpers import small_config


def _examples(n, seed, length=16, hidden=8):
    rng = np.random.default_rng(seed)
    return [Example(input_ids=rng.integers(0, 50, length).astype(np.int32),
                    token_types=np.zeros(length, np.int32), positions=np.zeros((3, length), np.int32),
                    valid=np.ones(length, bool),
                    states=rng.standard_normal((length, hidden)).astype(ml_dtypes.bfloat16),
                    final=rng.standard_normal((length, hidden)).astype(np.float32),
                    prompt_length=4 + i, feature_layer=1, visual_layer=0) for i in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(
        all(np.array_equal(getattr(x, f.name), getattr(y, f.name)) for f in dataclasses.fields(x)) for x, y in zip(a, b))


def test_example_shards_interrupted_at_every_step(tmp_path, monkeypatch):
    """The audit case: save_examples into a used directory left stale shards that
    load_examples returned."""
    old, new = _examples(5, 0), _examples(2, 1)
    directory = str(tmp_path / "examples")
    save_examples(old, directory, shard_size=2)  # 3 shards
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        save_examples(new, directory, shard_size=2)
    save_examples(new, directory, shard_size=2, overwrite=True)  # 1 shard: the old shards must not survive
    assert _same(load_examples(directory), new) and sorted(os.listdir(directory)) == ["index.json", "shard-00000.npz"]
    save_examples(old, directory, shard_size=2, overwrite=True)

    def check(n):
        assert not [x for x in os.listdir(tmp_path) if x.startswith(".examples.")]
        back = load_examples(directory)
        assert _same(back, old) or _same(back, new), f"a mixture after step {n}"
        return "old" if _same(back, old) else "new"

    _, found = interrupt_every_step(monkeypatch, lambda: save_examples(new, directory, shard_size=2, overwrite=True),
                                    check, reset=lambda: save_examples(old, directory, shard_size=2, overwrite=True),
                                    extras=[(np, "savez")])
    assert found[0] == "old" and "new" in found
    (tmp_path / "examples" / "index.json").write_text('{"shards": ["shard-00000.npz"], "examples": 7}')
    with pytest.raises(ValueError, match=r"index.json: lists 7 examples; its shards hold 2"):
        load_examples(directory)


def test_draft_checkpoint_interrupted_at_every_step(tmp_path, monkeypatch):
    model = Qwen2_5_VL(small_config(layers=1), dtype=jnp.float32, key=jax.random.key(0))
    old = SparrowDraft.init(model, jax.random.key(1))
    new = SparrowDraft.init(model, jax.random.key(2), DraftConfig(vata=False))
    ckpt = str(tmp_path / "draft")
    old.save(ckpt)
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        new.save(ckpt)
    wq = {"old": np.asarray(old.params()["wq"]), "new": np.asarray(new.params()["wq"])}

    def check(n):
        assert not [x for x in os.listdir(tmp_path) if x.startswith(".draft.")]
        back = SparrowDraft.load(ckpt, model)
        tag = "old" if back.config == old.config else "new"
        np.testing.assert_array_equal(np.asarray(back.params()["wq"]), wq[tag],
                                      err_msg=f"draft.json and weights of different saves after step {n}")
        return tag

    _, found = interrupt_every_step(monkeypatch, lambda: new.save(ckpt, overwrite=True), check,
                                    reset=lambda: old.save(ckpt, overwrite=True),
                                    extras=[(ocp.StandardCheckpointer, "save")])
    assert found[0] == "old" and "new" in found
    (tmp_path / "draft" / "draft.json").write_bytes(b"\xfe{}")
    with pytest.raises(ValueError, match=r"draft/draft.json: not UTF-8 text"):
        SparrowDraft.load(ckpt, model)
