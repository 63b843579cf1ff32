"""Inter-modality wrappers around intra-modality patterns (MMInference boundaries).

* `NoBoundary(p)`: the intra pattern on the original order, index estimated globally.
* `KBoundary(p)`: keys packed by modality (each kind's keys contiguous, in position order);
  the intra pattern estimated globally, its rules on original positions (so its key blocks
  hold one modality; order-based rules such as A-shape's sink take the first keys of the
  first modality).
* `QBoundary({name: p})`: for each query modality m, rows are permuted so that m's rows
  come last; m's pattern is estimated from the last queries of m and built for every row;
  query blocks holding no row of m are dropped (where the static spans say m's rows fill at
  most `ROW_RANGE_SHARE` of the blocks, its parts name the blocks of its rows as their
  ``q_block_range`` and run on those rows alone). Each row takes the result of its own
  modality's part (`RowSplit`).
* `TwoDBoundary({(mq, mk): p})`: as QBoundary for the queries; each pair's pattern sees the
  keys of mk only (packed first; estimation over them), so every key is attended through
  the pattern of its own modality: a key block straddling mk's last key becomes single
  columns (one list shared by every query block and head). Where mk's keys are one run that ends after every
  row of mq (a video's own keys for its rows, between a prompt and a question), they stay in the original
  order instead, cut below the run's first key (`_keys_in_place`). The pairs of one query modality
  are disjoint and are merged by lse (`LayoutSet`). Every (query kind, key kind) pair of the
  modalities present must be listed, or ``default`` given (it serves the unlisted pairs);
  ``skip_missing=True`` says explicitly that unlisted pairs are not computed (their rows may
  then see no key and give 0).

Inner patterns build through `Pattern.build_placed` (`mmjax.sparse.placement`): windows, slash
offsets, Grid line phases and causal cut-offs are on original positions whatever the
permutation. Every permutation is a `BlockLayout` ``q_perm`` / ``kv_perm``: the kernel
applies causality on original positions, so each wrapper computes exactly
``layout.to_dense_mask()``. Patterns with their own permutation (Grid) compose with every
wrapper. Modality names key the dicts; kinds missing from a QBoundary use ``default``.
A wrapper never leaves a present modality uncovered without being told: a QBoundary without a
pattern for a present kind, or a TwoDBoundary without a present pair, raises a ValueError
naming what is missing unless a ``default`` is given.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp

from mmjax.sparse.layouts import AnyLayout, LayoutSet, RowSplit, block_parts, with_parts
from mmjax.sparse.modality import Modality
from mmjax.sparse.patterns.base import Pattern
from mmjax.sparse.placement import Placement, restrict_from, restrict_to_valid
from pallas_kernels import BlockLayout
from pallas_kernels.tiling import cdiv


# ---------------------------------------------------------------- layout surgery
def _sort_perm(keys: jax.Array) -> jax.Array:
    """Stable argsort of int keys ``[B, L]`` -> int32 ``[B, L]``."""
    return jnp.argsort(keys, axis=-1, stable=True).astype(jnp.int32)


def _keep_query_blocks(part: BlockLayout, q_kind: jax.Array, kind: int) -> BlockLayout:
    """Zero the counts of query blocks holding no row of ``kind`` (q_kind ``[B, T]``)."""
    t, bq = part.q_len, part.block_q
    nq = cdiv(t, bq)
    perm = part.q_perm if part.q_perm is not None else jnp.arange(t, dtype=jnp.int32)[None, None]
    kinds = jnp.take_along_axis(jnp.broadcast_to(q_kind[:, None], (q_kind.shape[0], perm.shape[1], t)),
                                jnp.broadcast_to(perm, (q_kind.shape[0],) + perm.shape[1:]), axis=-1)
    own = jnp.pad(kinds == kind, ((0, 0), (0, 0), (0, nq * bq - t)))
    has = own.reshape(own.shape[:2] + (nq, bq)).any(-1)  # [B, N|1, nq]
    changes = dict(kv_block_count=jnp.where(has, part.kv_block_count, 0))
    if part.kv_columns is not None:
        changes["kv_column_count"] = jnp.where(has, part.kv_column_count, 0)
    return part.replace(**changes)


# --------------------------------------------------------------------- helpers
def _need_modality(modality, who: str, q, k) -> Modality:
    if not isinstance(modality, Modality):
        raise ValueError(f"modality: {who} needs a Modality (per-token kinds); received "
                         f"{type(modality).__name__}")
    modality.check(q, k)  # ids cover k; static spans agree with the ids
    # A no-op at run time. Under jit, ids closed over as a constant would let XLA evaluate the whole layout (its
    # sorts over S) at compile time: TwoDBoundary(Grid(frame))'s layout compiled in 25.0 s at 128k and 211.3 s at 1M
    # on a CPU, 3.1 / 3.0 s with this (`tools/boundary_compile_time.py`).
    return dataclasses.replace(modality, ids=jax.lax.optimization_barrier(modality.ids))


def _present(m: Modality) -> frozenset[int]:
    """Kinds that occur (from the static spans; every kind when they are unknown)."""
    if m.spans is None:
        return frozenset(range(m.num_kinds))
    return frozenset(kind for row in m.spans for kind, _, _ in row)


def _check_inner(name: str, p) -> None:
    if not isinstance(p, Pattern):
        raise ValueError(f"{name}: expected an mmjax.sparse.patterns pattern; received {type(p).__name__}")


def _query_modality_layout(pattern: Pattern, q, k, m: Modality, q_kind, kind: int,
                           key_kind: int | None = None) -> AnyLayout:
    """The intra layout of one query modality: rows of ``kind`` moved last (stable), the
    pattern estimated from them over the valid keys (those of ``key_kind``; None: every key), query blocks without
    such rows dropped, listed keys restricted to the valid ones (exactly, per key). From the static spans of
    ``m`` (`_query_rows`): the parts in the wrapper's row order (no row order of their own) name
    the query blocks of the kind's last rows as their ``q_block_range`` where they are at most
    `ROW_RANGE_SHARE` of the blocks, so they run on those rows alone (`_kind_range`); or, where
    the kind's rows sit in a few runs (`_in_place`), the rows stay in the original order (the
    pattern still estimated from the last rows of ``kind``) and the parts in that order have no
    ``q_perm`` (no gather of q, no output put back). Where the valid keys are one run that ends after
    every row of ``kind`` (`_keys_in_place`: a video's own keys for its rows), the parts in the plain key order keep
    the keys in the original order (no ``kv_perm``), cut below the run (`restrict_from`)."""
    order = _sort_perm((q_kind == kind).astype(jnp.int32))
    b, t, s = k.shape[0], q.shape[1], k.shape[1]
    in_place = _in_place(m, kind, t, pattern.block_q)
    k_valid = None if key_kind is None else m.ids == key_kind
    keys_in_place = key_kind is not None and _keys_in_place(m, kind, key_kind, t)
    rows = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if in_place else order
    pl = Placement(rows=rows, k_group=jnp.zeros((b, s), jnp.int32), k_valid=k_valid,
                   est_order=order if in_place else None, frame_tokens=m.frame_tokens, keys_in_place=keys_in_place)
    layout = pattern.build_placed(q, k, pl)
    parts = [_keep_query_blocks(p, q_kind, kind) for p in block_parts(layout)]
    plain = [p.kv_perm is pl.plain_keys.perm for p in parts]
    if keys_in_place:  # the plain order is the original one from the run's first key on; the rest packed
        n_valid = k_valid.sum(-1).astype(jnp.int32)[:, None]
        parts = [restrict_from(p, pl.plain_keys.start).replace(kv_perm=None) if mine
                 else restrict_to_valid(p, n_valid) for p, mine in zip(parts, plain)]
    elif k_valid is not None:
        n_valid = k_valid.sum(-1).astype(jnp.int32)[:, None]
        parts = [restrict_to_valid(p, n_valid) for p in parts]
    else:  # keys in the plain packed order are in the original order (one group, all valid)
        parts = [p.replace(kv_perm=None) if mine else p for p, mine in zip(parts, plain)]
    own_order = [p.q_perm is pl.row_perm and p.q_block_range is None for p in parts]
    if in_place:
        parts = [p.replace(q_perm=None) if mine else p for p, mine in zip(parts, own_order)]
        return with_parts(layout, parts)
    kind_rows = _query_rows(m, kind, t)
    ranges = [_kind_range(t, p.block_q, kind_rows) if mine else None for p, mine in zip(parts, own_order)]
    parts = [p if rng is None else p.replace(q_block_range=rng) for p, rng in zip(parts, ranges)]
    return with_parts(layout, parts)


# A query modality's parts run on its rows alone (`BlockLayout.q_block_range`) where those rows fill at most this
# share of the query blocks (the text of a long video: its parts otherwise compute, unpermute and merge whole outputs
# for a few hundred rows).
ROW_RANGE_SHARE = 0.25


def _kind_range(t: int, block_q: int, kind_rows: int | None) -> tuple[int, int] | None:
    """The query blocks ``(lo, nq)`` holding the last ``kind_rows`` of ``t`` rows, or None (unknown, none, or more
    than `ROW_RANGE_SHARE` of the blocks)."""
    nq = cdiv(t, block_q)
    if not kind_rows:
        return None
    lo = (t - kind_rows) // block_q
    return (lo, nq) if nq - lo <= ROW_RANGE_SHARE * nq else None


# A query modality keeps its rows in the original order (`_in_place`) where the query blocks of its pattern holding
# any of them, in that order, are at most this many more than its rows fill (a video between a prompt and a
# question: one or two blocks shared with the text, computed for the video's pattern and discarded on the text rows;
# modalities interleaved in many runs are moved last, each block then holding one modality).
IN_PLACE_EXTRA = 2


def _in_place(m: Modality, kind: int, t: int, block_q: int) -> bool:
    """Whether ``kind``'s query rows (the last ``t`` positions) stay in the original order: the static spans are
    known, the kind does not run on its rows alone (`_kind_range`), and in every batch row the blocks of
    ``block_q`` rows holding any of its rows are at most `IN_PLACE_EXTRA` more than ``ceil(rows / block_q)``."""
    rows = _query_rows(m, kind, t)
    if not rows or _kind_range(t, block_q, rows) is not None:
        return False
    for runs in _query_runs(m, kind, t):
        touched = set()
        for a, e in runs:
            touched.update(range(a // block_q, cdiv(e, block_q)))
        if len(touched) - cdiv(sum(e - a for a, e in runs), block_q) > IN_PLACE_EXTRA:
            return False
    return True


def _keys_in_place(m: Modality, kind: int, key_kind: int, t: int) -> bool:
    """Whether the keys of ``key_kind`` can stay in the original order for the query rows of ``kind`` (the last
    ``t`` positions): from the static spans, in every batch row they are one run and every query row of ``kind``
    lies before its end, so no kept row sees a key past it (causality) and only the run's start needs a cut."""
    runs = _query_runs(m, kind, t)
    if runs is None:
        return False
    s = int(m.ids.shape[1])
    for row, q_runs in zip(m.spans, runs):
        key_runs = [(a, e) for k_, a, e in row if k_ == key_kind]
        if len(key_runs) != 1 or any(e + s - t > key_runs[0][1] for _, e in q_runs):
            return False
    return True


def _query_runs(m: Modality, kind: int, t: int) -> list[list[tuple[int, int]]] | None:
    """The runs ``[a, e)`` of ``kind`` among the query rows (the last ``t`` positions, row 0 first), per batch row,
    from the static spans (None when they are unknown)."""
    if m.spans is None:
        return None
    s = int(m.ids.shape[1])
    q0 = s - t
    return [[(max(a, q0) - q0, min(e, s) - q0) for k_, a, e in row if k_ == kind and e > q0] for row in m.spans]


def _query_rows(m: Modality, kind: int, t: int) -> int | None:
    """The most query rows (the last ``t`` positions) of ``kind`` in a batch row, from the static spans (None when
    they are unknown)."""
    runs = _query_runs(m, kind, t)
    return None if runs is None else max(sum(e - a for a, e in row) for row in runs)


# -------------------------------------------------------------------- wrappers
@dataclasses.dataclass(frozen=True)
class NoBoundary(Pattern):
    """The intra pattern on the original order (modality ignored)."""

    pattern: Pattern

    def validate(self) -> None:
        _check_inner("pattern", self.pattern)

    def build_layout(self, q, k, *, modality=None) -> AnyLayout:
        return self.pattern.build_layout(q, k, modality=modality)


@dataclasses.dataclass(frozen=True)
class KBoundary(Pattern):
    """Keys permuted by modality (contiguous per kind); the intra pattern estimated globally."""

    pattern: Pattern

    def validate(self) -> None:
        _check_inner("pattern", self.pattern)

    def build_layout(self, q, k, *, modality=None) -> AnyLayout:
        m = _need_modality(modality, "KBoundary", q, k)
        b, t = q.shape[0], q.shape[1]
        pl = Placement(rows=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), k_group=m.ids,
                       num_groups=m.num_kinds, frame_tokens=m.frame_tokens)
        return self.pattern.build_placed(q, k, pl)


def _items(name: str, mapping, key_ok) -> tuple:
    if not isinstance(mapping, Mapping) and not isinstance(mapping, tuple):
        raise ValueError(f"{name}: expected a mapping; received {type(mapping).__name__}")
    items = tuple(mapping.items()) if isinstance(mapping, Mapping) else mapping
    if not items:
        raise ValueError(f"{name}: expected at least one entry")
    for key, p in items:
        if not key_ok(key):
            raise ValueError(f"{name}: bad key {key!r}")
        _check_inner(f"{name}[{key!r}]", p)
    return tuple(sorted(items, key=lambda kv: repr(kv[0])))


@dataclasses.dataclass(frozen=True)
class QBoundary(Pattern):
    """One intra pattern per query modality (by name), estimated from that modality's last
    queries; rows of kinds not listed use ``default`` (error when None)."""

    patterns: Mapping[str, Pattern] | tuple
    default: Pattern | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "patterns", _items("patterns", self.patterns,
                                                    lambda key: isinstance(key, str)))
        super().__post_init__()

    def validate(self) -> None:
        if self.default is not None:
            _check_inner("default", self.default)

    def build_layout(self, q, k, *, modality=None) -> RowSplit:
        m = _need_modality(modality, "QBoundary", q, k)
        given = dict(self.patterns)
        unknown = sorted(set(given) - set(m.names))
        if unknown:
            raise ValueError(f"patterns: expected modality names from {m.names}; received {unknown}")
        if self.default is None and set(given) != set(m.names):
            raise ValueError(f"patterns: expected a pattern for every modality {m.names} (or a default); "
                             f"missing {sorted(set(m.names) - set(given))}")
        q_kind = m.query_ids(q.shape[1])
        parts, kinds = [], []
        for kind, name in enumerate(m.names):
            if kind not in _present(m):
                continue
            pattern = given.get(name, self.default)
            layout = _query_modality_layout(pattern, q, k, m, q_kind, kind)
            parts.append(layout)
            kinds.append(kind)
        return RowSplit(tuple(parts), q_kind, tuple(kinds))


@dataclasses.dataclass(frozen=True)
class TwoDBoundary(Pattern):
    """One intra pattern per (query modality, key modality) pair, restricted to that pair's
    key blocks in modality order and merged by lse per query modality.

    Every pair of present kinds needs a pattern: listed in ``patterns``, else ``default``;
    without a default a missing pair is a ValueError naming it, unless ``skip_missing=True``
    (unlisted pairs are then not computed)."""

    patterns: Mapping[tuple[str, str], Pattern] | tuple
    default: Pattern | None = None
    skip_missing: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "patterns", _items(
            "patterns", self.patterns,
            lambda key: isinstance(key, tuple) and len(key) == 2 and all(isinstance(x, str) for x in key)))
        super().__post_init__()

    def validate(self) -> None:
        if self.default is not None:
            _check_inner("default", self.default)
        if not isinstance(self.skip_missing, bool):
            raise ValueError(f"skip_missing: expected a bool; received {self.skip_missing!r}")
        if self.skip_missing and self.default is not None:
            raise ValueError("default / skip_missing: expected at most one (a default computes the unlisted "
                             "pairs, skip_missing leaves them out); received both")

    def pair_patterns(self, m: Modality) -> dict[tuple[int, int], Pattern]:
        """(query kind, key kind) -> pattern for the present kinds of ``m`` (listed pairs, then
        ``default``). Raises ValueError naming the missing pairs when neither covers one and
        ``skip_missing`` is False."""
        unknown = sorted({x for key, _ in self.patterns for x in key} - set(m.names))
        if unknown:
            raise ValueError(f"patterns: expected modality names from {m.names}; received {unknown}")
        present = sorted(_present(m))
        given = {(m.kind(a), m.kind(b)): p for (a, b), p in self.patterns}
        out, missing = {}, []
        for qk in present:
            for kk in present:
                p = given.get((qk, kk), self.default)
                if p is not None:
                    out[(qk, kk)] = p
                elif not self.skip_missing:
                    missing.append((m.names[qk], m.names[kk]))
        if missing:
            raise ValueError(f"patterns: expected a pattern for every (query, key) pair of the modalities present "
                             f"{tuple(m.names[x] for x in present)}, or default=..., or skip_missing=True; "
                             f"missing {missing}")
        return out

    def build_layout(self, q, k, *, modality=None) -> RowSplit:
        m = _need_modality(modality, "TwoDBoundary", q, k)
        pairs = self.pair_patterns(m)
        q_kind = m.query_ids(q.shape[1])
        parts, kinds = [], []
        for qk in range(m.num_kinds):
            mine = [(kk, p) for (a, kk), p in pairs.items() if a == qk]
            if not mine:
                continue
            pair_parts = []
            for kk, pattern in mine:
                layout = _query_modality_layout(pattern, q, k, m, q_kind, qk, key_kind=kk)
                pair_parts += list(block_parts(layout))
            parts.append(LayoutSet(tuple(pair_parts)))
            kinds.append(qk)
        return RowSplit(tuple(parts), q_kind, tuple(kinds))
