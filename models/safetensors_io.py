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

from models.files import read_json

MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's limit

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
    """Parse and check a safetensors header: every error is a ValueError naming the file (and
    the tensor): a header length beyond the file, a header that is not a UTF-8 JSON object,
    an unknown dtype, a shape that does not match its byte range, a byte range outside the
    data section, two tensors sharing bytes."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes; expected an 8-byte header length "
                             f"first)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {n} exceeds the file ({size} bytes) or the format's "
                             f"{MAX_HEADER_BYTES}-byte limit: truncated or not a safetensors file")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the {n}-byte header is not UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: expected the header to be a JSON object; received {type(header).__name__}")
    base = 8 + n
    data_size = size - base
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= set(meta):
            raise ValueError(f"{where}: expected an object with dtype, shape and data_offsets; received {meta!r}"[:300])
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{where}: unsupported dtype {meta['dtype']!r}; expected one of {sorted(_DTYPES)}")
        shape, offsets = meta["shape"], meta["data_offsets"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise ValueError(f"{where}: expected shape a list of ints >= 0; received {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise ValueError(f"{where}: expected data_offsets [start, end]; received {offsets!r}")
        s, e = offsets
        if not 0 <= s <= e <= data_size:
            raise ValueError(f"{where}: data_offsets [{s}, {e}] lie outside the data section of {data_size} bytes "
                             f"(file of {size} bytes): truncated or corrupt")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[meta["dtype"]]).itemsize
        if nbytes != e - s:
            raise ValueError(f"{where}: shape {shape} of {meta['dtype']} needs {nbytes} bytes; data_offsets "
                             f"[{s}, {e}] hold {e - s}")
        out[name] = TensorInfo(path, meta["dtype"], tuple(shape), base + s, base + e)
    spans = sorted((t.start, t.end, name) for name, t in out.items() if t.end > t.start)
    for (s0, e0, a), (s1, _, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(f"{path}: tensors {a!r} and {b!r} share bytes (data_offsets overlap at "
                             f"{s1 - base}): corrupt header")
    return out


def index_checkpoint(directory: str) -> dict[str, TensorInfo]:
    """All tensors of a snapshot directory: ``model.safetensors.index.json`` shards or a single
    ``model.safetensors``. Raises ValueError naming the file if neither exists, the index is
    malformed (not UTF-8 JSON, no ``weight_map`` of tensor -> shard file name) or names a
    missing shard, or a shard's header is corrupt."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index_path):
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError(f"{index_path}: expected \"weight_map\": an object of tensor name -> shard file; "
                             f"received {type(weight_map).__name__}")
        files = sorted(set(weight_map.values()))
        for fname in files:
            if os.path.basename(fname) != fname or fname in ("", ".", ".."):
                raise ValueError(f"{index_path}: weight_map names {fname!r}; expected a file name in {directory}")
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        weight_map, files = None, ["model.safetensors"]
    else:
        raise ValueError(f"path: expected model.safetensors.index.json or model.safetensors in {directory}")
    tensors: dict[str, TensorInfo] = {}
    for fname in files:
        full = os.path.join(directory, fname)
        if not os.path.exists(full):
            raise ValueError(f"{index_path}: names shard {fname!r}, which is missing from {directory}")
        for name, info in read_header(full).items():
            if name in tensors:
                raise ValueError(f"{full}: tensor {name!r} is also in {tensors[name].file}")
            tensors[name] = info
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"{index_path}: tensors listed in the index but absent from their shards: {missing[:10]}")
        moved = sorted(k for k, f in weight_map.items() if os.path.basename(tensors[k].file) != f)
        if moved:
            raise ValueError(f"{index_path}: tensors found in another shard than the index says: {moved[:10]}")
    return tensors


def load(info: TensorInfo) -> np.ndarray:
    """Memory-mapped, read-only view of one tensor (its byte range was checked against the
    file by `read_header`; a file truncated since raises a ValueError naming it)."""
    dtype = np.dtype(_DTYPES[info.dtype])
    count = (info.end - info.start) // dtype.itemsize
    if count == 0:  # an empty tensor has no bytes to map
        return np.zeros(info.shape, dtype)
    try:
        arr = np.memmap(info.file, dtype=dtype, mode="r", offset=info.start, shape=(count,))
    except (OSError, ValueError) as e:
        raise ValueError(f"{info.file}: cannot map bytes [{info.start}, {info.end}) ({e})") from e
    return arr.reshape(info.shape)
