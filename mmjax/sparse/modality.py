"""`Modality`: the modality kind of every token (text, image, video, audio, ...).

A `Modality` holds int32 ids ``[B, S]`` (one per key position; queries are the last T of
the S positions, so their ids are ``ids[:, S - T:]``) and the static names of the kinds
(id ``i`` is ``names[i]``; any number of kinds). When the ids are concrete (built on the
host, outside jit) the constructors also record the static *spans*: per batch row, the
contiguous runs ``(kind, start, end)`` (end exclusive) that cover the row.

It is a pytree: ids are a leaf, names and spans are static, so a `Modality` passes through
`jax.jit` (spans then stay those computed on the host). ``frame_tokens`` (static, optional)
is the number of tokens per video frame (`frame_tokens_from_grid_thw`): the stride of
Grid heads with ``stride="frame"``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.checks import concrete

DEFAULT_NAMES = ("text", "image", "video")

Span = tuple[int, int, int]  # (kind id, start, end) with end exclusive


def compute_spans(ids: np.ndarray) -> tuple[tuple[Span, ...], ...]:
    """int ``[B, S]`` -> per row the contiguous runs ``(kind, start, end)`` covering it."""
    ids = np.asarray(ids)
    rows = []
    for row in ids:
        cut = np.flatnonzero(np.diff(row)) + 1
        starts = np.concatenate([[0], cut])
        ends = np.concatenate([cut, [row.size]])
        rows.append(tuple((int(row[a]), int(a), int(b)) for a, b in zip(starts, ends)))
    return tuple(rows)


def check_spans(spans, ids: np.ndarray | None, batch: int, length: int, num_kinds: int) -> None:
    """Raise ValueError naming the row unless ``spans`` are ``batch`` rows of contiguous runs
    ``(kind, start, end)`` covering ``[0, length)`` with kinds in ``[0, num_kinds)``, and (when
    ``ids`` ``[B, S]`` is given) each run holds exactly its kind."""
    if len(spans) != batch:
        raise ValueError(f"modality.spans: expected {batch} rows (B of the ids); received {len(spans)}")
    for r, row in enumerate(spans):
        pos = 0
        for kind, start, end in row:
            if start != pos or end <= start or not 0 <= kind < num_kinds:
                raise ValueError(f"modality.spans[{r}]: expected contiguous runs (kind in [0, {num_kinds}), start, "
                                 f"end) from 0 to {length}; received {(kind, start, end)} at position {pos}")
            pos = end
        if pos != length:
            raise ValueError(f"modality.spans[{r}]: expected runs covering [0, {length}); they end at {pos}")
        if ids is not None:
            want = np.repeat([kind for kind, _, _ in row], [end - start for _, start, end in row])
            if not np.array_equal(want, ids[r]):
                at = int(np.flatnonzero(want != ids[r])[0])
                raise ValueError(f"modality.spans[{r}]: expected the runs of the ids; position {at} has id "
                                 f"{int(ids[r][at])} but its span says {int(want[at])} (present kinds would be "
                                 f"wrong: {sorted(set(ids[r].tolist()))} in the ids)")


def _check_names(names) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise ValueError(f"names: expected a non-empty sequence of modality names; received {names!r}")
    names = tuple(names)
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"names: expected non-empty strings; received {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"names: expected distinct names; received {names!r}")
    return names


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Modality:
    """Per-token modality ids with static kind names and (when known) static spans.

    Attributes:
      ids: int32 ``[B, S]``, ``0 <= ids < len(names)``.
      names: static kind names, id ``i`` is ``names[i]``.
      spans: static per-row runs ``((kind, start, end), ...)`` or None when the ids were
        traced at construction.
      frame_tokens: static tokens per video frame, or None when unknown.

    Build with `from_token_types` or `from_input_ids` (they validate); the plain constructor
    does not validate (it is also the pytree unflatten path).
    """

    ids: jax.Array
    names: tuple[str, ...] = dataclasses.field(default=DEFAULT_NAMES, metadata=dict(static=True))
    spans: tuple[tuple[Span, ...], ...] | None = dataclasses.field(default=None, metadata=dict(static=True))
    frame_tokens: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    # ----------------------------------------------------------- constructors
    @classmethod
    def from_token_types(cls, token_types, names: Sequence[str] = DEFAULT_NAMES,
                         frame_tokens: int | None = None) -> "Modality":
        """token_types: integer ``[B, S]`` (or ``[S]``, taken as one row) of kind ids into
        ``names``. Values are checked (and spans computed) when concrete. frame_tokens:
        tokens per video frame (see the module docstring)."""
        names = _check_names(names)
        if frame_tokens is not None and (not isinstance(frame_tokens, (int, np.integer)) or
                                         isinstance(frame_tokens, bool) or frame_tokens < 1):
            raise ValueError(f"frame_tokens: expected None or an int >= 1; received {frame_tokens!r}")
        x = token_types if isinstance(token_types, jax.Array) else np.asarray(token_types)
        if x.ndim == 1:
            x = x[None]
        if x.ndim != 2 or min(x.shape) < 1:
            raise ValueError(f"token_types: expected a non-empty integer array [B, S]; received shape "
                             f"{tuple(np.shape(token_types))}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"token_types: expected an integer dtype; received {x.dtype}")
        host = concrete(x)
        spans = None
        if host is not None:
            lo, hi = int(host.min()), int(host.max())
            if lo < 0 or hi >= len(names):
                raise ValueError(f"token_types: expected ids in [0, {len(names)}) (names={names}); "
                                 f"received ids in [{lo}, {hi}]")
            spans = compute_spans(host)
        return cls(ids=jnp.asarray(x, jnp.int32), names=names, spans=spans,
                   frame_tokens=None if frame_tokens is None else int(frame_tokens))

    @classmethod
    def from_input_ids(cls, input_ids, *, image_token_id: int, video_token_id: int,
                       audio_token_id: int | None = None,
                       extra_token_ids: Mapping[str, int] | None = None) -> "Modality":
        """Modality from model inputs: tokens equal to a modality's pad token id get that
        modality, every other token is text.

        Kinds are ``("text", "image", "video")`` (the ids models use: 0, 1, 2), then
        ``"audio"`` when ``audio_token_id`` is given, then ``extra_token_ids`` in order
        (name -> pad token id). input_ids: integer ``[B, S]`` (or ``[S]``).
        """
        pads: dict[str, int] = {"image": image_token_id, "video": video_token_id}
        if audio_token_id is not None:
            pads["audio"] = audio_token_id
        for name, tok in dict(extra_token_ids or {}).items():
            if name in pads or name == "text":
                raise ValueError(f"extra_token_ids: expected new modality names; received {name!r} again")
            pads[name] = tok
        for name, tok in pads.items():
            if not isinstance(tok, (int, np.integer)) or isinstance(tok, bool):
                arg = f"{name}_token_id" if name in ("image", "video", "audio") else f"extra_token_ids[{name!r}]"
                raise ValueError(f"{arg}: expected an int token id; received {tok!r}")
        if len(set(int(t) for t in pads.values())) != len(pads):
            raise ValueError(f"image_token_id / video_token_id / ...: expected distinct pad token ids; "
                             f"received {pads}")
        x = input_ids if isinstance(input_ids, jax.Array) else np.asarray(input_ids)
        if x.ndim not in (1, 2) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"input_ids: expected an integer array [B, S]; received shape "
                             f"{tuple(np.shape(input_ids))}, dtype {x.dtype}")
        xp = jnp if isinstance(x, jax.Array) else np
        types = xp.zeros(x.shape, np.int32)
        for kind, tok in enumerate(pads.values(), start=1):
            types = xp.where(x == int(tok), kind, types)
        return cls.from_token_types(types, names=("text",) + tuple(pads))

    # -------------------------------------------------------------- queries
    @property
    def num_kinds(self) -> int:
        return len(self.names)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(d) for d in self.ids.shape)  # type: ignore[return-value]

    def kind(self, name: str) -> int:
        """Id of the kind called ``name``."""
        if name not in self.names:
            raise ValueError(f"name: expected one of {self.names}; received {name!r}")
        return self.names.index(name)

    def query_ids(self, q_len: int) -> jax.Array:
        """int32 ``[B, T]``: ids of the queries (the last ``q_len`` positions)."""
        return self.ids[:, self.ids.shape[1] - q_len:]

    def check(self, q: jax.Array, k: jax.Array) -> None:
        """Raise ValueError unless the ids cover k's ``[B, S]`` (q ``[B,T,N,D]``, k ``[B,S,K,D]``)
        and the static spans (when known) are the runs of the ids: each row's spans cover
        ``[0, S)`` in order with known kinds, and, when the ids are concrete, hold their kinds
        (spans decide which kinds are present, so a span that omits a kind would leave its
        rows uncovered)."""
        b, s = int(k.shape[0]), int(k.shape[1])
        if self.ids.ndim != 2 or tuple(self.ids.shape) != (b, s):
            raise ValueError(f"modality: expected ids of shape [{b}, {s}] ([B, S] of k); received "
                             f"{list(self.ids.shape)}")
        if int(q.shape[1]) > s:
            raise ValueError(f"modality: expected T <= S; received q length {q.shape[1]} > S={s}")
        if self.spans is not None:
            check_spans(self.spans, concrete(self.ids), b, s, len(self.names))

    def spans_of(self, row: int, kind: int | str) -> tuple[tuple[int, int], ...]:
        """Static ``(start, end)`` runs of one kind in one batch row (needs concrete spans)."""
        if self.spans is None:
            raise ValueError("modality: spans are unknown (ids were traced when the Modality was built); "
                             "build it on the host with concrete ids")
        kid = self.kind(kind) if isinstance(kind, str) else int(kind)
        return tuple((a, b) for k_, a, b in self.spans[row] if k_ == kid)


def frame_tokens_from_grid_thw(video_grid_thw, spatial_merge_size: int = 2) -> int:
    """Tokens per frame in the LLM's token stream of the first video of ``video_grid_thw``
    (int ``[V, 3]`` patches (t, h, w), as the HF processors return it): ``h * w /
    spatial_merge_size**2`` (Qwen2.5-VL merges 2 x 2 patches into one token)."""
    g = np.asarray(video_grid_thw)
    if g.ndim != 2 or g.shape[1] != 3 or g.shape[0] < 1:
        raise ValueError(f"video_grid_thw: expected an int array [V, 3] (t, h, w); received shape {g.shape}")
    if not isinstance(spatial_merge_size, int) or spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size: expected an int >= 1; received {spatial_merge_size!r}")
    h, w = int(g[0, 1]), int(g[0, 2])
    m2 = spatial_merge_size ** 2
    if (h * w) % m2:
        raise ValueError(f"video_grid_thw: expected h * w divisible by spatial_merge_size**2={m2}; "
                         f"received h={h}, w={w}")
    return h * w // m2


def as_modality(modality, q: jax.Array, k: jax.Array) -> Modality | None:
    """None, a `Modality`, or int ids ``[B, S]`` (the models' hook passes raw token types:
    0 text, 1 image, 2 video) -> a checked `Modality` or None."""
    if modality is None:
        return None
    if not isinstance(modality, Modality):
        x = modality if isinstance(modality, jax.Array) else np.asarray(modality)
        if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"modality: expected a Modality or integer ids [B, S]; received "
                             f"{type(modality).__name__} of shape {tuple(np.shape(x))}")
        names = DEFAULT_NAMES
        host = concrete(x)
        if host is not None and host.size and int(host.max()) >= len(names):
            names = names + tuple(f"kind{i}" for i in range(len(names), int(host.max()) + 1))
        modality = Modality.from_token_types(x, names=names)
    modality.check(q, k)
    return modality
