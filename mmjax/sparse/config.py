"""`SparseConfig`: which sparse pattern (and hyper-parameters) each layer and head uses.

Saved as versioned JSON::

    {"schema_version": 2, "num_layers": L, "num_heads": N,
     "layers": [[{"pattern": "VerticalSlash", "params": {"vertical_size": 1000, ...}}, ...N],
                ...L]}

Every pattern field is written (defaults included), so a file states the whole config.
Boundary wrappers nest their intra patterns: ``{"pattern": "KBoundary", "params":
{"pattern": {...}}}``, QBoundary ``{"patterns": {name: {...}}, "default": {...} | null}``,
TwoDBoundary ``{"patterns": [{"query": mq, "key": mk, "pattern": {...}}, ...], "default": {...} | null,
"skip_missing": false}`` (the last two may be absent: null / false).
Loading checks the version, the layer/head counts, the pattern names, the parameter names
and types, and each pattern's own hyper-parameter checks; every error is a ValueError that
names the place (``layers[3][5] (Grid).local: ...``).

Version 1 files (written before Grid became MMInference's family) still load, meaning what
they meant: a v1 Grid's ``use_slash`` was its local band, so it becomes ``local`` (0 when
it was off) with ``use_slash=False`` (v1 had no stride diagonals) and ``stride="search"``;
a v1 Momo ranked blocks by mean score, so it gets ``trim_rule="mean"``. Fields a v1 file
left out take v1's defaults (`migrate_v1`).

A config plugs into the models' attention hooks (``models.attention``):
``config.uniform_attention()`` is one ``attn_fn(q, k, v, *, layer, q_positions, kv_valid,
modality)`` for every layer (layers under ``lax.scan``, the layer index traced), and
``config.layer_attention(i)`` that of layer i alone; both run in `mmjax.sparse.model_attention`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from mmjax.files import atomic_write, read_json
from mmjax.sparse.layouts import KernelOptions
from mmjax.sparse.model_attention import SparseModelAttention
from mmjax.sparse.patterns import (
    AShape,
    Dense,
    Grid,
    KBoundary,
    Momo,
    NoBoundary,
    Pattern,
    QBoundary,
    SFFixed,
    SFStrided,
    TriShape,
    TwoDBoundary,
    VerticalSlash,
)

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
# Grid's fields and defaults in schema version 1.
V1_GRID_DEFAULTS = dict(stride_space=None, max_stride=1024, use_hline=True, use_vline=True, use_slash=True,
                        last_q=64, local=1024, phases=1, block_q=128, block_k=64)

PATTERNS: dict[str, type[Pattern]] = {
    cls.__name__: cls for cls in (Dense, AShape, TriShape, SFFixed, SFStrided, VerticalSlash, Grid, Momo,
                                  NoBoundary, KBoundary, QBoundary, TwoDBoundary)
}
WRAPPERS = ("NoBoundary", "KBoundary", "QBoundary", "TwoDBoundary")

_JSON_TYPES = {"int": int, "bool": bool, "str": str, "float": float, "None": type(None)}


def _field_types(cls: type, field: dataclasses.Field) -> tuple[str, ...]:
    """Simple type names allowed by a field annotation ('int | None' -> ('int', 'None'));
    tuples are 'tuple[int]' (a tuple of ints)."""
    ann = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    return tuple(part.strip().replace("tuple[int, ...]", "tuple[int]") for part in ann.split("|"))


def _type_ok(value: Any, allowed: tuple[str, ...]) -> bool:
    for name in allowed:
        if name == "tuple[int]":
            if isinstance(value, (list, tuple)) and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in value):
                return True
        elif name in ("int", "float") and isinstance(value, bool):
            continue
        elif name == "float" and isinstance(value, (int, float)):
            return True
        elif name in _JSON_TYPES and isinstance(value, _JSON_TYPES[name]):
            return True
    return False


def pattern_to_dict(pattern: Pattern) -> dict[str, Any]:
    """``{"pattern": name, "params": {field: value}}`` (tuples as lists)."""
    name = type(pattern).__name__
    if PATTERNS.get(name) is not type(pattern):
        raise ValueError(f"pattern: expected one of {sorted(PATTERNS)}; received {name}")
    if name in WRAPPERS:
        return {"pattern": name, "params": _wrapper_to_params(pattern)}
    params = {}
    for f in dataclasses.fields(pattern):
        value = getattr(pattern, f.name)
        params[f.name] = list(value) if isinstance(value, tuple) else value
    return {"pattern": name, "params": params}


def pattern_from_dict(entry: Any, where: str = "pattern") -> Pattern:
    """Inverse of `pattern_to_dict`; ValueErrors start with ``where``."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object {{\"pattern\": ..., \"params\": {{...}}}}; "
                         f"received {type(entry).__name__}")
    unknown_keys = set(entry) - {"pattern", "params"}
    if unknown_keys:
        raise ValueError(f"{where}: unexpected keys {sorted(unknown_keys)}; expected 'pattern' and 'params'")
    name = entry.get("pattern")
    if name not in PATTERNS:
        raise ValueError(f"{where}.pattern: expected one of {sorted(PATTERNS)}; received {name!r}")
    cls = PATTERNS[name]
    params = entry.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"{where} ({name}).params: expected an object; received {type(params).__name__}")
    if name in WRAPPERS:
        return _wrapper_from_params(cls, params, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ValueError(f"{where} ({name}).params: unknown parameter(s) {unknown}; expected a subset of "
                         f"{sorted(fields)}")
    kwargs = {}
    for key, value in params.items():
        allowed = _field_types(cls, fields[key])
        if not _type_ok(value, allowed):
            raise ValueError(f"{where} ({name}).{key}: expected {' or '.join(allowed)}; received {value!r}")
        kwargs[key] = tuple(value) if isinstance(value, list) else value
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"{where} ({name}).{e}") from e


def migrate_v1(entry: Any) -> Any:
    """A version-1 pattern entry (nested wrappers included) in version-2 terms (see the
    module docstring); anything malformed is returned as is for the parser to report."""
    if not isinstance(entry, dict) or not isinstance(entry.get("params", {}), dict):
        return entry
    name, params = entry.get("pattern"), dict(entry.get("params", {}))
    if name == "Grid" and "stride" not in params:
        old = {**V1_GRID_DEFAULTS, **params}
        band = old["use_slash"] is True
        params = {**params, "stride": "search", "use_slash": False,
                  "local": old["local"] if band else 0}
    elif name == "Momo":
        params.setdefault("trim_rule", "mean")
    elif name in ("NoBoundary", "KBoundary") and "pattern" in params:
        params["pattern"] = migrate_v1(params["pattern"])
    elif name == "QBoundary":
        if isinstance(params.get("patterns"), dict):
            params["patterns"] = {m: migrate_v1(e) for m, e in params["patterns"].items()}
        if params.get("default") is not None:
            params["default"] = migrate_v1(params["default"])
    elif name == "TwoDBoundary" and isinstance(params.get("patterns"), list):
        params["patterns"] = [{**e, "pattern": migrate_v1(e["pattern"])} if isinstance(e, dict) and "pattern" in e
                              else e for e in params["patterns"]]
    return {**entry, "params": params}


# ------------------------------------------------------------ boundary wrappers
def _wrapper_to_params(p: Pattern) -> dict[str, Any]:
    """JSON params of a boundary wrapper (nested patterns)."""
    if isinstance(p, (NoBoundary, KBoundary)):
        return {"pattern": pattern_to_dict(p.pattern)}
    if isinstance(p, QBoundary):
        return {"patterns": {name: pattern_to_dict(x) for name, x in p.patterns},
                "default": None if p.default is None else pattern_to_dict(p.default)}
    if isinstance(p, TwoDBoundary):
        return {"patterns": [{"query": mq, "key": mk, "pattern": pattern_to_dict(x)} for (mq, mk), x in p.patterns],
                "default": None if p.default is None else pattern_to_dict(p.default),
                "skip_missing": p.skip_missing}
    raise ValueError(f"pattern: expected a boundary wrapper; received {type(p).__name__}")


def _wrapper_from_params(cls: type, params: dict, where: str) -> Pattern:
    name = cls.__name__
    allowed = {"NoBoundary": {"pattern"}, "KBoundary": {"pattern"}, "QBoundary": {"patterns", "default"},
               "TwoDBoundary": {"patterns", "default", "skip_missing"}}[name]
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(f"{where} ({name}).params: unknown parameter(s) {unknown}; expected a subset of "
                         f"{sorted(allowed)}")
    missing = sorted({"pattern", "patterns"} & allowed - set(params))
    if missing:
        raise ValueError(f"{where} ({name}).params: missing {missing}")
    try:
        if name in ("NoBoundary", "KBoundary"):
            return cls(pattern_from_dict(params["pattern"], f"{where} ({name}).pattern"))
        if name == "QBoundary":
            pats = params["patterns"]
            if not isinstance(pats, dict):
                raise ValueError(f"{where} ({name}).patterns: expected an object {{modality name: pattern}}; "
                                 f"received {type(pats).__name__}")
            default = params.get("default")
            return cls({m: pattern_from_dict(e, f"{where} ({name}).patterns[{m!r}]") for m, e in pats.items()},
                       None if default is None else pattern_from_dict(default, f"{where} ({name}).default"))
        pats = params["patterns"]
        if not isinstance(pats, list) or not all(isinstance(e, dict) and set(e) == {"query", "key", "pattern"}
                                                 for e in pats):
            raise ValueError(f"{where} ({name}).patterns: expected a list of {{\"query\", \"key\", \"pattern\"}} "
                             f"objects; received {pats!r}"[:400])
        default = params.get("default")
        skip = params.get("skip_missing", False)
        if not isinstance(skip, bool):
            raise ValueError(f"{where} ({name}).skip_missing: expected bool; received {skip!r}")
        return cls({(e["query"], e["key"]): pattern_from_dict(e["pattern"], f"{where} ({name}).patterns[{i}]")
                    for i, e in enumerate(pats)},
                   None if default is None else pattern_from_dict(default, f"{where} ({name}).default"), skip)
    except ValueError as e:
        if str(e).startswith(where):
            raise
        raise ValueError(f"{where} ({name}).{e}") from e


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """Per layer, per query head sparse patterns.

    Attributes:
      layers: ``layers[l][h]`` is the pattern of head h in layer l (every layer has the same
        number of heads).
      options: how kernels run (not saved; pass it to `load`).
    """

    layers: tuple[tuple[Pattern, ...], ...]
    options: KernelOptions = dataclasses.field(default=KernelOptions(), compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Sequence) or not self.layers:
            raise ValueError(f"layers: expected a non-empty sequence of per-head pattern sequences; "
                             f"received {self.layers!r}")
        layers = tuple(tuple(layer) if isinstance(layer, Sequence) else layer for layer in self.layers)
        n = len(layers[0]) if isinstance(layers[0], tuple) else 0
        for i, layer in enumerate(layers):
            if not isinstance(layer, tuple) or not layer:
                raise ValueError(f"layers[{i}]: expected a non-empty sequence of patterns (one per head); "
                                 f"received {layer!r}")
            if len(layer) != n:
                raise ValueError(f"layers[{i}]: expected {n} heads (as layers[0]); received {len(layer)}")
            for h, p in enumerate(layer):
                if not isinstance(p, Pattern):
                    raise ValueError(f"layers[{i}][{h}]: expected an mmjax.sparse.patterns pattern; "
                                     f"received {type(p).__name__}")
        object.__setattr__(self, "layers", layers)
        if not isinstance(self.options, KernelOptions):
            raise ValueError(f"options: expected KernelOptions; received {type(self.options).__name__}")

    @classmethod
    def uniform(cls, pattern: Pattern, *, num_layers: int, num_heads: int,
                options: KernelOptions = KernelOptions()) -> "SparseConfig":
        """The same pattern for every layer and head."""
        return cls(tuple((pattern,) * num_heads for _ in range(num_layers)), options)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_heads(self) -> int:
        return len(self.layers[0])

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "num_layers": self.num_layers, "num_heads": self.num_heads,
                "layers": [[pattern_to_dict(p) for p in layer] for layer in self.layers]}

    @classmethod
    def from_dict(cls, data: Any, *, options: KernelOptions = KernelOptions()) -> "SparseConfig":
        """Parse and validate the JSON object (see the module docstring)."""
        if not isinstance(data, dict):
            raise ValueError(f"config: expected a JSON object; received {type(data).__name__}")
        if "schema_version" not in data:
            raise ValueError(f"schema_version: missing; expected {SCHEMA_VERSION}")
        version = data["schema_version"]
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise ValueError(f"schema_version: expected one of {READABLE_VERSIONS}; received {version!r}")
        unknown = sorted(set(data) - {"schema_version", "num_layers", "num_heads", "layers"})
        if unknown:
            raise ValueError(f"config: unexpected keys {unknown}; expected schema_version, num_layers, "
                             f"num_heads, layers")
        for key in ("num_layers", "num_heads"):
            val = data.get(key)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{key}: expected an int >= 1; received {val!r}")
        layers = data.get("layers")
        if not isinstance(layers, list) or len(layers) != data["num_layers"]:
            got = len(layers) if isinstance(layers, list) else type(layers).__name__
            raise ValueError(f"layers: expected a list of num_layers={data['num_layers']} layers; received {got}")
        parsed = []
        for i, layer in enumerate(layers):
            if not isinstance(layer, list) or len(layer) != data["num_heads"]:
                got = len(layer) if isinstance(layer, list) else type(layer).__name__
                raise ValueError(f"layers[{i}]: expected a list of num_heads={data['num_heads']} head "
                                 f"patterns; received {got}")
            if version == 1:
                layer = [migrate_v1(e) for e in layer]
            parsed.append(tuple(pattern_from_dict(e, f"layers[{i}][{h}]") for h, e in enumerate(layer)))
        return cls(tuple(parsed), options)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str, *, options: KernelOptions = KernelOptions()) -> "SparseConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"config: not valid JSON ({e})") from e
        return cls.from_dict(data, options=options)

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        """Write the config as JSON to ``path`` atomically (a temporary file beside it, renamed
        into place). An existing file is replaced only with ``overwrite=True``."""
        atomic_write(path, self.to_json(), overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike, *, options: KernelOptions = KernelOptions()) -> "SparseConfig":
        """Read a config written by `save`; malformed files (not UTF-8, not JSON, a bad
        entry) raise ValueError naming the file and the place."""
        data = read_json(path, expect=None)
        try:
            return cls.from_dict(data, options=options)
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)}: {e}") from e

    # ---------------------------------------------------------- model hooks
    def uniform_attention(self, frame_tokens: int | None = None) -> SparseModelAttention:
        """The attention of every decoder layer, for layers under ``lax.scan`` (the traced layer
        index picks the layer's plan; see `mmjax.sparse.model_attention`). frame_tokens: the video's tokens per
        frame, if known (`SparseModelAttention.frame_tokens`)."""
        return SparseModelAttention(self.layers, self.options, frame_tokens=frame_tokens)

    def layer_attention(self, layer_idx: int, frame_tokens: int | None = None) -> SparseModelAttention:
        """attn_fn of decoder layer ``layer_idx`` alone (the per-layer ``models.attention`` hook)."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx: expected an int in [0, {self.num_layers}); received {layer_idx!r}")
        return SparseModelAttention(self.layers, self.options, only_layer=layer_idx, frame_tokens=frame_tokens)
