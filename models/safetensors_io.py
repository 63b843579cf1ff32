"""Lazy reading of (sharded) safetensors checkpoints as numpy memmaps.

Parses the safetensors header directly, so bf16 tensors come back as ``ml_dtypes.bfloat16`` views
without copying; a tensor is only read when it is used.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def read_header(path: str) -> dict[str, TensorInfo]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        s, e = meta["data_offsets"]
        out[name] = TensorInfo(path, meta["dtype"], tuple(meta["shape"]), base + s, base + e)
    return out


def index_checkpoint(directory: str) -> dict[str, TensorInfo]:
    """All tensors of a snapshot directory: ``model.safetensors.index.json`` shards or a single
    ``model.safetensors``. Raises ValueError if neither exists or the index names a missing shard."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        weight_map, files = None, ["model.safetensors"]
    else:
        raise ValueError(f"path: expected model.safetensors.index.json or model.safetensors in {directory}")
    tensors: dict[str, TensorInfo] = {}
    for fname in files:
        full = os.path.join(directory, fname)
        if not os.path.exists(full):
            raise ValueError(f"path: index names shard {fname!r}, which is missing from {directory}")
        tensors.update(read_header(full))
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"path: tensors listed in the index but absent from their shards: {missing[:10]}")
    return tensors


def load(info: TensorInfo) -> np.ndarray:
    """Memory-mapped, read-only view of one tensor."""
    dtype = np.dtype(_DTYPES[info.dtype])
    count = (info.end - info.start) // dtype.itemsize
    arr = np.memmap(info.file, dtype=dtype, mode="r", offset=info.start, shape=(count,))
    return arr.reshape(info.shape)
