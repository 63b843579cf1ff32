"""Broken weight files: every error names the file (and the tensor), before anything is
mapped: header length beyond the file, offsets outside the data, overlapping tensors, shape /
byte-count mismatches, truncated files; a corrupt index or config names its file."""

import json
import os
import shutil
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from models.qwen2_5_vl import from_hf
from models.qwen2_5_vl.config import load_hf_config
from models.safetensors_io import index_checkpoint, load, read_header

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _write(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def test_a_good_file_reads_back(tmp_path):
    path = str(tmp_path / "ok.safetensors")
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((0,), np.int32)
    save_file({"a": a, "b": b}, path)
    info = read_header(path)
    np.testing.assert_array_equal(load(info["a"]), a)
    assert load(info["b"]).shape == (0,)


@pytest.mark.parametrize("make,match", [
    (lambda p: p.write_bytes(b"\x01\x02"), r"bad.safetensors: not a safetensors file \(2 bytes"),
    (lambda p: p.write_bytes(struct.pack("<Q", 2**40) + b"{}"),
     r"bad.safetensors: header length 1099511627776 exceeds the file \(10 bytes\)"),
    (lambda p: _write(p, [1], b""), r"bad.safetensors: expected the header to be a JSON object"),
    (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{\xff}}"), r"bad.safetensors: the 4-byte header is not UTF-8 JSON"),
    (lambda p: _write(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
     r"bad.safetensors: tensor 'w': data_offsets \[0, 16\] lie outside the data section of 8 bytes"),
    (lambda p: _write(p, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
     r"tensor 'w': shape \[3\] of F32 needs 12 bytes; data_offsets \[0, 8\] hold 8"),
    (lambda p: _write(p, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
     r"bad.safetensors: tensors 'w' and 'u' share bytes"),
    (lambda p: _write(p, {"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}, b"\0"),
     r"tensor 'w': unsupported dtype 'Q4'"),
    (lambda p: _write(p, {"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 0]}}, b""),
     r"tensor 'w': expected shape a list of ints >= 0"),
    (lambda p: _write(p, {"w": {"dtype": "F32", "shape": [2]}}, b""),
     r"tensor 'w': expected an object with dtype, shape and data_offsets"),
])
def test_corrupt_headers_name_file_and_tensor(tmp_path, make, match):
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(ValueError, match=match):
        read_header(str(path))


def _snapshot(tmp_path):
    dst = tmp_path / "snap"
    shutil.copytree(os.path.join(FIXTURES, "vl_nested"), dst)
    return dst


def test_corrupt_index_config_and_shards_name_their_file(tmp_path):
    dst = _snapshot(tmp_path)
    index = dst / "model.safetensors.index.json"
    good = index.read_text()
    for text, match in [("{}", r"model.safetensors.index.json: expected \"weight_map\": an object"),
                        ('{"weight_map": ', r"model.safetensors.index.json: not valid JSON"),
                        ('{"weight_map": {"x": "../../etc/passwd"}}', r"weight_map names '../../etc/passwd'")]:
        index.write_text(text)
        with pytest.raises(ValueError, match=match):
            index_checkpoint(str(dst))
    index.write_text(good)
    shard = sorted(p for p in os.listdir(dst) if p.endswith(".safetensors"))[0]
    data = (dst / shard).read_bytes()
    (dst / shard).write_bytes(data[: len(data) - 7])  # truncated download
    with pytest.raises(ValueError, match=rf"{shard}: tensor '.*': data_offsets .* lie outside the data section"):
        from_hf(str(dst))
    (dst / "config.json").write_bytes(b'{"vision_config": {"depth": \xff}}')
    with pytest.raises(ValueError, match=r"snap/config.json: not UTF-8 text"):
        from_hf(str(dst))
    (dst / "config.json").write_text('{"vision_config": {"patch_size": [14, 16]}}')
    with pytest.raises(ValueError, match=r"snap/config.json: vision patch_size: expected a single size"):
        load_hf_config(str(dst / "config.json"))
