"""Atomic writes (`models.files`): interrupted at every step, a save leaves the old artefact or
the new one whole, never a mixture and never a stray temporary; replacing needs overwrite=True;
`read_json` names the file. The orbax checkpoint of the model goes through the same test."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from models import qwen2_5_vl
from models.files import atomic_directory, atomic_write, read_json, require_artifact
from models.qwen2_5_vl import Qwen2_5_VL
from tests.fault_injection import interrupt_every_step
from tests.models.helpers import small_config


def _no_temporaries(parent, name):
    left = [x for x in os.listdir(parent) if x.startswith(f".{name}.")]
    assert not left, f"temporaries left behind: {left}"


def test_atomic_write_interrupted_at_every_step(tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    atomic_write(path, "old")

    def check(n):
        _no_temporaries(tmp_path, "a.txt")
        return {"old": "old", "new" * 1000: "new"}[path.read_text()]

    steps, found = interrupt_every_step(monkeypatch, lambda: atomic_write(path, "new" * 1000, overwrite=True), check,
                                        reset=lambda: atomic_write(path, "old", overwrite=True))
    assert steps >= 4 and found[0] == "old" and "new" in found  # early steps keep the old file


def test_overwrite_is_explicit(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write(path, "one")
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
        atomic_write(path, "two")
    assert path.read_text() == "one"
    with pytest.raises(FileExistsError, match="already exists"):
        with atomic_directory(tmp_path / "d0") as tmp:
            pass
        with atomic_directory(tmp_path / "d0") as tmp:
            raise AssertionError("not reached")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        atomic_write(tmp_path / "missing" / "a.txt", "x")


def test_directory_swap_interrupted_at_every_step(tmp_path, monkeypatch):
    target = tmp_path / "art"

    def write(tag, overwrite):
        with atomic_directory(target, overwrite=overwrite) as tmp:
            for i in range(3 if tag == "old" else 1):  # the new artefact has fewer parts
                atomic_write(os.path.join(tmp, f"part{i}"), tag)
            atomic_write(os.path.join(tmp, "done"), tag)

    write("old", False)

    def check(n):
        _no_temporaries(tmp_path, "art")
        require_artifact(target, "done", "write")
        parts = sorted(os.listdir(target))
        tags = {(target / p).read_text() for p in parts}
        assert len(tags) == 1, f"a mixture after step {n}: {parts} {tags}"
        assert parts == (["done", "part0", "part1", "part2"] if tags == {"old"} else ["done", "part0"])
        return tags.pop()

    steps, found = interrupt_every_step(monkeypatch, lambda: write("new", True), check,
                                        reset=lambda: write("old", True))
    assert steps >= 10 and set(found) == {"old", "new"}


def test_require_artifact_names_an_interrupted_swap(tmp_path):
    aside = tmp_path / ".ckpt.x1.old" / "ckpt"
    aside.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"ckpt: expected config.json \(written by save\); an interrupted "
                                                r"save set the previous copy aside at .*\.ckpt\.x1\.old/ckpt"):
        require_artifact(tmp_path / "ckpt", "config.json", "save")


def test_read_json_names_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match=r"config.json: not UTF-8 text \(byte 7"):
        read_json(bad)
    bad.write_text('{"a": ')
    with pytest.raises(ValueError, match=r"config.json: not valid JSON \(Expecting value at line 1, column 7\)"):
        read_json(bad)
    bad.write_text("[1]")
    with pytest.raises(ValueError, match=r"config.json: expected a JSON object; received list"):
        read_json(bad)


def test_checkpoint_save_interrupted_at_every_step(tmp_path, monkeypatch):
    """The audit case: saving over a checkpoint rewrote config.json before orbax refused, and a
    later load returned the new config with the old weights."""
    cfg = small_config(layers=1)
    old = Qwen2_5_VL(cfg, dtype=jnp.float32, key=jax.random.key(0))
    new_cfg = cfg.__class__(**{**cfg.__dict__, "image_token_id": cfg.image_token_id + 1})
    new = Qwen2_5_VL(new_cfg, dtype=jnp.float32, key=jax.random.key(1))
    ckpt = tmp_path / "ckpt"
    qwen2_5_vl.save(old, str(ckpt))
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        qwen2_5_vl.save(new, str(ckpt))
    embed = {"old": np.asarray(old.language_model.embed[...]), "new": np.asarray(new.language_model.embed[...])}

    def check(n):
        _no_temporaries(tmp_path, "ckpt")
        got = qwen2_5_vl.load(str(ckpt))
        tag = "old" if got.config.image_token_id == cfg.image_token_id else "new"
        np.testing.assert_array_equal(np.asarray(got.language_model.embed[...]), embed[tag],
                                      err_msg=f"config and weights of different saves after step {n}")
        return tag

    steps, found = interrupt_every_step(
        monkeypatch, lambda: qwen2_5_vl.save(new, str(ckpt), overwrite=True), check,
        reset=lambda: qwen2_5_vl.save(old, str(ckpt), overwrite=True),
        extras=[(ocp.StandardCheckpointer, "save")])
    assert found[0] == "old" and "new" in found, found
    with pytest.raises(FileNotFoundError, match=r"expected config.json \(written by models.qwen2_5_vl.save\)"):
        qwen2_5_vl.load(str(tmp_path / "nowhere"))
    (ckpt / "config.json").write_text(json.dumps({"text": {}}))
    with pytest.raises(ValueError, match=r"ckpt/config.json: not a config written by models.qwen2_5_vl.save"):
        qwen2_5_vl.load(str(ckpt))
