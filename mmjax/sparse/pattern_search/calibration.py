"""Calibration data for the pattern search: q / k / v of each layer on one input, plus the
modality of every token.

Arrays per layer: q ``[B, T, N, D]``, k / v ``[B, S, K, D]`` (N % K == 0, T <= S; queries
are the last T positions). The modality: int ids ``[B, S]`` (0 text, 1 image, 2 video by
default) or a `Modality`.

File layout (``.npz``, what ``mmjax search --calibration`` reads)::

    q_0, k_0, v_0, q_1, k_1, v_1, ...   one triple per layer, layers 0..L-1
    modality                           int [B, S] token kinds
    modality_names                     optional str [M]: the name of each kind id
    frame_tokens                       optional int scalar: tokens per video frame (Grid "frame")

`CalibrationRecorder` captures the triples during a dense prefill
(``mmjax.prefill(model, inputs, attention=recorder)``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.files import atomic_write_with
from mmjax.sparse.modality import DEFAULT_NAMES, Modality
from models.attention import dense_attention

_KEY = re.compile(r"^([qkv])_(\d+)$")


def _shape(x) -> str:
    return "[" + ", ".join(str(d) for d in np.shape(x)) + "]"


def _check_layer(i: int, q, k, v) -> None:
    for name, x, want in (("q", q, "[B, T, N, D]"), ("k", k, "[B, S, K, D]"), ("v", v, "[B, S, K, D]")):
        if np.ndim(x) != 4:
            raise ValueError(f"calibration {name}_{i}: expected {want}; received shape {_shape(x)}")
        if not jnp.issubdtype(jnp.dtype(getattr(x, "dtype", np.asarray(x).dtype)), jnp.floating):
            raise ValueError(f"calibration {name}_{i}: expected a float dtype; received {x.dtype}")
        if not isinstance(x, jax.core.Tracer):
            finite = np.asarray(jnp.isfinite(jnp.asarray(x)))
            if not finite.all():
                at = [int(j) for j in np.argwhere(~finite)[0]]
                raise ValueError(f"calibration {name}_{i}: expected finite values (the search compares attention "
                                 f"outputs); received {int((~finite).sum())} NaN / inf, the first at index {at}")
    b, t, n, d = np.shape(q)
    if np.shape(k) != np.shape(v):
        raise ValueError(f"calibration v_{i}: expected the shape of k_{i} {_shape(k)}; received {_shape(v)}")
    bk, s, kh, dk = np.shape(k)
    if bk != b or dk != d or kh < 1 or n % kh or t > s:
        raise ValueError(f"calibration k_{i}: expected [B={b}, S>={t}, K dividing N={n}, D={d}] (from q_{i} "
                         f"{_shape(q)}); received {_shape(k)}")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """layers: ((q, k, v), ...) one triple per layer; modality: `Modality` or None."""

    layers: tuple[tuple[Any, Any, Any], ...]
    modality: Modality | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layers, (tuple, list)) or not self.layers:
            raise ValueError("calibration: expected at least one layer of (q, k, v)")
        shapes = None
        for i, triple in enumerate(self.layers):
            if not isinstance(triple, (tuple, list)) or len(triple) != 3:
                raise ValueError(f"calibration layers[{i}]: expected a (q, k, v) triple")
            _check_layer(i, *triple)
            now = tuple(np.shape(x) for x in triple)
            if shapes is not None and now != shapes:
                raise ValueError(f"calibration q_{i}/k_{i}/v_{i}: expected the shapes of layer 0 {shapes}; "
                                 f"received {now}")
            shapes = now
        object.__setattr__(self, "layers", tuple(tuple(t) for t in self.layers))
        if self.modality is not None:
            _, s = self.batch_and_length()
            b = int(np.shape(self.layers[0][1])[0])
            if not isinstance(self.modality, Modality) or self.modality.shape != (b, s):
                got = self.modality.shape if isinstance(self.modality, Modality) else type(self.modality).__name__
                raise ValueError(f"modality: expected ids of shape [{b}, {s}] ([B, S] of k); received {got}")

    def batch_and_length(self) -> tuple[int, int]:
        k = self.layers[0][1]
        return int(np.shape(k)[0]), int(np.shape(k)[1])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_heads(self) -> int:
        return int(np.shape(self.layers[0][0])[2])

    # ------------------------------------------------------------ arrays / files
    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any], modality=None) -> "Calibration":
        """From ``{"q_0": ..., "k_0": ..., "v_0": ..., ..., "modality": ids [B, S],
        "modality_names": [...]}`` (the npz layout; see the module docstring)."""
        if not isinstance(arrays, Mapping):
            raise ValueError(f"calibration: expected a mapping of arrays (q_0, k_0, v_0, ...); received "
                             f"{type(arrays).__name__}")
        found: dict[int, dict[str, Any]] = {}
        for key in arrays:
            m = _KEY.match(str(key))
            if m:
                found.setdefault(int(m.group(2)), {})[m.group(1)] = arrays[key]
            elif key not in ("modality", "modality_names", "frame_tokens"):
                raise ValueError(f"calibration: unexpected key {key!r}; expected q_<layer>, k_<layer>, v_<layer>, "
                                 f"modality, modality_names, frame_tokens")
        if not found:
            raise ValueError("calibration: expected arrays q_0, k_0, v_0 (one triple per layer); found none")
        layers = []
        for i in range(max(found) + 1):
            got = found.get(i, {})
            missing = [f"{x}_{i}" for x in "qkv" if x not in got]
            if missing:
                raise ValueError(f"calibration: missing {missing} (layers must be 0..{max(found)} with q, k, v each)")
            layers.append((got["q"], got["k"], got["v"]))
        if modality is None and "modality" in arrays:
            names = tuple(str(x) for x in np.asarray(arrays["modality_names"]).tolist()) \
                if "modality_names" in arrays else None
            ids = np.asarray(arrays["modality"])
            if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"calibration modality: expected integer ids [B, S]; received shape {_shape(ids)}, "
                                 f"dtype {ids.dtype}")
            if names is None:
                top = int(ids.max(initial=0))
                names = DEFAULT_NAMES + tuple(f"kind{i}" for i in range(len(DEFAULT_NAMES), top + 1))
            frame = arrays.get("frame_tokens")
            if frame is not None and (np.ndim(frame) != 0 or not np.issubdtype(np.asarray(frame).dtype, np.integer)):
                raise ValueError(f"calibration frame_tokens: expected an int scalar; received shape {_shape(frame)}")
            modality = Modality.from_token_types(ids, names=names,
                                                 frame_tokens=None if frame is None else int(frame))
        return cls(tuple(layers), modality)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        """Read an ``.npz`` in the layout of the module docstring; errors name the file."""
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
        except (OSError, ValueError) as e:
            raise ValueError(f"{os.fspath(path)}: cannot read a calibration .npz ({e})") from e
        try:
            return cls.from_arrays(arrays)
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)}: {e}") from e

    def to_arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for i, (q, k, v) in enumerate(self.layers):
            for name, x in (("q", q), ("k", k), ("v", v)):
                x = np.asarray(jnp.asarray(x).astype(jnp.float32)) if jnp.dtype(x.dtype) == jnp.bfloat16 \
                    else np.asarray(x)
                out[f"{name}_{i}"] = x
        if self.modality is not None:
            out["modality"] = np.asarray(self.modality.ids)
            out["modality_names"] = np.asarray(self.modality.names)
            if self.modality.frame_tokens is not None:
                out["frame_tokens"] = np.asarray(self.modality.frame_tokens, np.int64)
        return out

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        """Write the npz layout (bfloat16 arrays are stored as float32) to ``path`` exactly
        (no suffix is added), atomically: a temporary file beside it, renamed into place. An
        existing file is replaced only with ``overwrite=True``."""
        arrays = self.to_arrays()
        atomic_write_with(path, lambda f: np.savez(f, **arrays), binary=True, overwrite=overwrite)


def as_calibration(calibration, modality=None) -> Calibration:
    """A `Calibration`, a mapping in the npz layout, or a path to an ``.npz``; ``modality``
    (a `Modality` or int ids ``[B, S]``) overrides the calibration's own."""
    if isinstance(calibration, (str, os.PathLike)):
        calibration = Calibration.load(calibration)
    elif isinstance(calibration, Mapping):
        calibration = Calibration.from_arrays(calibration)
    elif not isinstance(calibration, Calibration):
        raise ValueError(f"calibration: expected a Calibration, a mapping of arrays or an .npz path; received "
                         f"{type(calibration).__name__}")
    if modality is not None:
        if not isinstance(modality, Modality):
            ids = np.asarray(modality)
            if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"modality: expected a Modality or integer ids [B, S]; received shape "
                                 f"{_shape(ids)}")
            top = int(ids.max(initial=0))
            names = DEFAULT_NAMES + tuple(f"kind{i}" for i in range(len(DEFAULT_NAMES), top + 1))
            modality = Modality.from_token_types(ids, names=names)
        calibration = Calibration(calibration.layers, modality)
    if calibration.modality is None:
        raise ValueError("modality: expected per-token modality ids [B, S] (in the calibration or as the "
                         "modality argument); received none")
    if calibration.modality.spans is None:
        raise ValueError("modality: expected concrete ids (built on the host), not traced ones")
    return calibration


class CalibrationRecorder:
    """An attention hook for ``mmjax.prefill(model, inputs, attention=recorder)`` that runs
    exact dense attention and records each layer's q / k / v (and the token kinds) on the
    host. Layers run unrolled (per-layer hook), so ``layer`` is a Python int.

    ``max_tokens``: keep only the last ``max_tokens`` queries (keys stay whole)."""

    def __init__(self, max_tokens: int | None = None):
        self.max_tokens = max_tokens
        self.records: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.kinds: np.ndarray | None = None

    def layer_attention(self, layer_idx: int):
        def attn(q, k, v, *, layer=None, q_positions, kv_valid, modality=None):
            t = q.shape[1] if self.max_tokens is None else min(q.shape[1], self.max_tokens)
            ids = jnp.zeros(k.shape[:2], jnp.int32) if modality is None else modality.astype(jnp.int32)

            def store(qh, kh, vh, mh):
                self.records[layer_idx] = (np.asarray(qh), np.asarray(kh), np.asarray(vh))
                self.kinds = np.asarray(mh)

            jax.debug.callback(store, q[:, q.shape[1] - t:], k, v, ids)
            return dense_attention(q, k, v, q_positions=q_positions, kv_valid=kv_valid)

        return attn

    def calibration(self, names: tuple[str, ...] = DEFAULT_NAMES) -> Calibration:
        """The recorded layers (0..L-1) and token kinds as a `Calibration`."""
        if not self.records:
            raise ValueError("recorder: nothing recorded; run mmjax.prefill(..., attention=recorder) first")
        layers = tuple(self.records[i] for i in sorted(self.records))
        return Calibration(layers, Modality.from_token_types(self.kinds, names=names))
