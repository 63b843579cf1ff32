"""Offline modality-aware pattern search (MMInference Algorithm 4).

For every layer of the calibration input, with dense attention as the reference:

1. intra-modality: each candidate of the `SearchSpace` is built for each query modality
   (inside `QBoundary`, estimated from that modality's last queries) and scored on that
   modality's rows;
2. cross-modality: each candidate is built for each (query modality, key modality) pair
   (inside `TwoDBoundary`, the other pairs dense) and scored on the pair's query rows;
3. inter-modality: per head, the best `NoBoundary(p)` and `KBoundary(p)` candidates, the
   `QBoundary` assembled from the per-modality winners and the `TwoDBoundary` assembled
   from the per-pair winners are compared; the type with the least attention-output error
   (relative L2 against dense, over all rows) wins; errors within ``tie_tolerance`` of the
   least (absolute, default 0.01) tie, and ties go to the simpler type (the order of
   ``space.boundaries``). Among candidates of one kind, ties go to the cheaper one.

Kernel-aware budget: a candidate's cost for a head is its measured kernel time on a GPU
(the launch's time shared out by the head's computed pairs), else the FLOPs of the query-key
pairs its layout computes (whole tiles, every layout part, ``4 * D`` per pair). Candidates
and assemblies whose cost exceeds the head's budget are excluded; the default budget is the
cost of ``AShape(sink=1024, local=4096)`` on the same input.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.progress import progress_bar
from mmjax.sparse.attention import gather_heads, head_groups
from mmjax.sparse.config import SparseConfig
from mmjax.sparse.layouts import KernelOptions, RowSplit, attend
from mmjax.sparse.modality import Modality
from mmjax.sparse.pattern_search.calibration import as_calibration
from mmjax.sparse.pattern_search.space import SearchSpace
from mmjax.sparse.patterns import AShape, Dense, KBoundary, NoBoundary, Pattern, QBoundary, TwoDBoundary
from mmjax.timing import time_fn
from pallas_kernels.block_sparse.layout import causal_pairs

DEFAULT_BUDGET = AShape(sink=1024, local=4096)


@dataclasses.dataclass(frozen=True)
class _Eval:
    """One evaluated pattern: output ``[B, T, N, D]`` and lse ``[B, N, T]`` (float64), cost
    per head ``[N]`` and, for row-split layouts, cost per query kind ``{kind: [N]}``."""

    out: np.ndarray
    lse: np.ndarray
    cost: np.ndarray
    part_cost: dict | None = None


def _on_gpu(options: KernelOptions) -> bool:
    return jax.default_backend() == "gpu" and not options.interpret and options.implementation in (None, "triton")


MASKED_MAX_SCORES = 1 << 26  # T * S * N up to which CPU evaluation uses the dense mask


def _densities(layout) -> list[jax.Array]:
    """[total density, then one per RowSplit part] (each ``[B|1, N|1]``)."""
    out = [layout.density()]
    if isinstance(layout, RowSplit):
        out += [p.density() for p in layout.parts]
    return out


def _row_split_kinds(pattern, m: Modality) -> list[int]:
    """Query kinds of the parts of the RowSplit a QBoundary / TwoDBoundary builds (present
    kinds in id order; TwoD only those with a listed pair)."""
    present = sorted({kind for row in m.spans for kind, _, _ in row})
    if isinstance(pattern, TwoDBoundary):
        listed = {qk for qk, _ in pattern.pair_patterns(m)}
        return [x for x in present if x in listed]
    return present


def _masked_attention(q, k, v, mask, sm_scale):
    """Exact attention over a bool mask ``[B|1, N|1, T, S]``: out ``[B, T, N, D]`` float32,
    lse ``[B, N, T]`` (rows without keys: 0 and -inf)."""
    g = q.shape[2] // k.shape[2]
    kk = jnp.repeat(k.astype(jnp.float32), g, axis=2)
    vv = jnp.repeat(v.astype(jnp.float32), g, axis=2)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    s = jnp.einsum("btnd,bsnd->bnts", q.astype(jnp.float32), kk, precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(mask, s, -jnp.inf)
    top = s.max(-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.exp(s - top)
    l = p.sum(-1, keepdims=True)
    out = jnp.einsum("bnts,bsnd->btnd", p / jnp.where(l > 0, l, 1.0), vv, precision=jax.lax.Precision.HIGHEST)
    lse = jnp.where(l[..., 0] > 0, top[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)), -jnp.inf)
    return out, lse


def merge(results: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """lse-merge of attention results over disjoint key sets: [(out [B,T,N,D], lse [B,N,T])]."""
    lses = np.stack([l for _, l in results])
    top = lses.max(0)
    safe = np.where(np.isfinite(top), top, 0.0)
    w = np.exp(lses - safe)  # [P, B, N, T]
    total = w.sum(0)
    out = sum(np.einsum("bnt,btnd->btnd", wi / np.where(total > 0, total, 1.0), o) for wi, (o, _) in zip(w, results))
    lse = np.where(total > 0, safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return out, lse


class _Layer:
    """Evaluates patterns on one layer's calibration q / k / v against dense attention."""

    def __init__(self, q, k, v, modality: Modality, options: KernelOptions, dense: Pattern):
        b, t, n, d = q.shape
        s = k.shape[1]
        self.q, self.k, self.v, self.m, self.options = q, k, v, modality, options
        self.n, self.d = n, d
        self.causal_pairs = causal_pairs(t, s)
        self.row_kind = np.asarray(modality.query_ids(t))  # [B, T]
        self.present = tuple(int(x) for x in np.unique(self.row_kind))
        self.key_kinds = tuple(int(x) for x in np.unique(np.asarray(modality.ids)))
        self.timed = _on_gpu(options)
        self.ref = self.evaluate(dense).out
        self.norm2 = self._by_kind((self.ref ** 2).sum(-1))

    def _by_kind(self, x: np.ndarray) -> np.ndarray:
        """x ``[B, T, N]`` -> sums over the rows of each kind ``[M, N]``."""
        return np.stack([x[self.row_kind == kind].sum(0) for kind in range(self.m.num_kinds)])

    def _attend(self, pattern: Pattern, q, k, v):
        """(out, lse, layout densities, kernel ms or None) of one pattern: on a GPU through
        the kernel (the kernel alone timed on the built layout), else exact masked dense
        attention over the layout's mask (what the kernel computes; small calibrations)."""
        o = self.options
        if self.timed or q.shape[1] * k.shape[1] * q.shape[2] > MASKED_MAX_SCORES:
            build = jax.jit(lambda q, k, m: pattern.build_layout(q, k, modality=m))
            run = jax.jit(lambda q, k, v, lay: attend(q, k, v, lay, o))
            lay = build(q, k, self.m)
            out, lse = run(q, k, v, lay)
            dens = jax.jit(_densities)(lay)
            ms = None
            if self.timed:  # the kernel on the built layout (estimation and build not counted)
                ms = time_fn(lambda: run(q, k, v, lay), reps=3)["ms"]
        else:
            def masked(q, k, v, m):
                lay = pattern.build_layout(q, k, modality=m)
                out, lse = _masked_attention(q, k, v, lay.to_dense_mask(), o.sm_scale)
                return out, lse, _densities(lay)

            out, lse, dens = jax.jit(masked)(q, k, v, self.m)
            ms = None
        dens = [np.broadcast_to(np.asarray(d, np.float64).mean(0), (q.shape[2],)) for d in dens]
        return np.asarray(out, np.float64), np.asarray(lse, np.float64), dens, ms

    def _cost(self, pairs: np.ndarray, ms: float | None, total_pairs: float) -> np.ndarray:
        """FLOPs of the pairs, or the measured time shared out by pairs."""
        if ms is None:
            return pairs * 4.0 * self.d
        return ms * pairs / max(total_pairs, 1.0)

    def evaluate(self, pattern: Pattern | tuple[Pattern, ...]) -> _Eval:
        """Run one pattern for all heads, or one pattern per head (grouped)."""
        if isinstance(pattern, tuple):
            out = np.zeros(self.q.shape, np.float64)
            lse = np.zeros((self.q.shape[0], self.n, self.q.shape[1]))
            cost = np.zeros(self.n)
            for p, heads in head_groups(pattern, self.n):
                qg, kg, vg = gather_heads(self.q, self.k, self.v, heads)
                o, l, dens, ms = self._attend(p, qg, kg, vg)
                out[:, :, list(heads)], lse[:, list(heads)] = o, l
                pairs = dens[0] * self.causal_pairs
                cost[list(heads)] = self._cost(pairs, ms, pairs.sum())
            return _Eval(out, lse, cost)
        out, lse, dens, ms = self._attend(pattern, self.q, self.k, self.v)
        pairs = dens[0] * self.causal_pairs
        part_cost = None
        if isinstance(pattern, (QBoundary, TwoDBoundary)):  # RowSplit: dens[1:] per query kind
            kinds = _row_split_kinds(pattern, self.m)
            part_cost = {kind: self._cost(d * self.causal_pairs, ms, pairs.sum()) for kind, d in zip(kinds, dens[1:])}
        return _Eval(out, lse, self._cost(pairs, ms, pairs.sum()), part_cost)

    def err2(self, out: np.ndarray) -> np.ndarray:
        """Squared output error per (query kind, head) ``[M, N]``."""
        return self._by_kind(((out - self.ref) ** 2).sum(-1))

    def rel_error(self, err2_rows: np.ndarray, kinds=None) -> np.ndarray:
        """Relative L2 error per head over the rows of ``kinds`` (default all)."""
        kinds = list(self.present if kinds is None else kinds)
        return np.sqrt(err2_rows[kinds].sum(0) / np.maximum(self.norm2[kinds].sum(0), 1e-30))


def _pick(errors: np.ndarray, costs: np.ndarray, ok: np.ndarray, tol: float) -> int | None:
    """Index with the least error among ``ok`` (ties within ``tol`` -> the cheapest)."""
    if not ok.any():
        return None
    best = errors[ok].min()
    near = ok & (errors <= best + tol)
    return int(np.flatnonzero(near)[np.argmin(costs[near])])


def _budget(layer: _Layer, budget, space: SearchSpace) -> np.ndarray:
    """Per-head budget ``[N]`` in the cost unit of ``layer``."""
    if budget is None:
        budget = dataclasses.replace(DEFAULT_BUDGET, block_q=space.block_q, block_k=space.block_k)
    if isinstance(budget, Pattern):
        return layer.evaluate(budget).cost
    if isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0:
        if layer.timed:
            dense = layer.evaluate(Dense(block_q=space.block_q, block_k=space.block_k)).cost
            return budget * dense
        return np.full(layer.n, budget * layer.causal_pairs * 4.0 * layer.d)
    raise ValueError(f"budget: expected None, a Pattern or a density > 0 (fraction of dense causal pairs); "
                     f"received {budget!r}")


def search(calibration, modality=None, space: SearchSpace | None = None, budget: Any = None, *,
           options: KernelOptions = KernelOptions(), progress: bool = True, tie_tolerance: float = 0.01,
           return_report: bool = False):
    """Search a `SparseConfig` (one boundary pattern per layer and head) on calibration data.

    calibration: a `Calibration`, a mapping in the npz layout (``q_<l>`` ``[B, T, N, D]``,
    ``k_<l>`` / ``v_<l>`` ``[B, S, K, D]``, ``modality`` int ``[B, S]``, optional
    ``modality_names``) or a path to such an ``.npz``. modality: overrides the calibration's
    (a `Modality` or int ids ``[B, S]``). space: a `SearchSpace` (default: MMInference
    Table 3-like). budget: None (cost of A-shape with 1k sink and 4k local), a `Pattern`
    (its cost), or a density in (0, ...] (fraction of dense causal pairs, or of dense
    kernel time on a GPU). options: how kernels run (``implementation="reference"`` on CPU).
    Returns the config, or (config, report) with ``return_report``: per layer and head the
    error and cost of each boundary type.
    """
    space = SearchSpace() if space is None else space
    if not isinstance(space, SearchSpace):
        raise ValueError(f"space: expected a SearchSpace; received {type(space).__name__}")
    if not isinstance(tie_tolerance, (int, float)) or tie_tolerance < 0:
        raise ValueError(f"tie_tolerance: expected a number >= 0; received {tie_tolerance!r}")
    cal = as_calibration(calibration, modality)
    m = cal.modality
    cands = space.candidates(frame_tokens=None if m is None else m.frame_tokens)
    dense = Dense(block_q=space.block_q, block_k=space.block_k)
    bar = progress_bar(cal.num_layers * cal.num_heads, "mmjax search", progress)
    layers, report = [], []
    try:
        for li, (q, k, v) in enumerate(cal.layers):
            bar.set_postfix_str(f"layer {li}: dense reference")
            layer = _Layer(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), m, options, dense)
            bud = _budget(layer, budget, space)
            heads, rep = _search_layer(layer, cands, dense, space, bud, tie_tolerance, bar, li)
            layers.append(heads)
            report.append(rep)
    finally:
        bar.close()
    config = SparseConfig(tuple(layers), options)
    return (config, report) if return_report else config


def _search_layer(layer: _Layer, cands, dense, space: SearchSpace, bud: np.ndarray, tol: float, bar, li: int):
    """Per-head boundary patterns of one layer and the per-head report."""
    m, n, names, want = layer.m, layer.n, layer.m.names, space.boundaries
    present, key_kinds = layer.present, layer.key_kinds

    def note(stage):
        bar.set_postfix_str(f"layer {li}: {stage}")

    choice = {t: [None] * n for t in want}
    errs = {t: np.full(n, np.inf) for t in want}
    costs = {t: np.full(n, np.inf) for t in want}

    def take(t, h, pattern, err, cost):
        choice[t][h], errs[t][h], costs[t][h] = pattern, err, cost

    # Every candidate on all rows (NoBoundary): also the default for kinds absent here.
    note("NoBoundary candidates")
    nb = [layer.evaluate(NoBoundary(p)) for p in cands]
    nb_err = np.stack([layer.rel_error(layer.err2(e.out)) for e in nb])  # [C, N]
    nb_cost = np.stack([e.cost for e in nb])
    best_nb = []
    for h in range(n):
        i = _pick(nb_err[:, h], nb_cost[:, h], nb_cost[:, h] <= bud[h], tol)
        best_nb.append(cands[i] if i is not None else cands[int(np.argmin(nb_cost[:, h]))])
        if i is not None and "NoBoundary" in want:
            take("NoBoundary", h, NoBoundary(cands[i]), nb_err[i, h], nb_cost[i, h])
    if "KBoundary" in want:
        note("KBoundary candidates")
        kb = [layer.evaluate(KBoundary(p)) for p in cands]
        kb_err = np.stack([layer.rel_error(layer.err2(e.out)) for e in kb])
        kb_cost = np.stack([e.cost for e in kb])
        for h in range(n):
            i = _pick(kb_err[:, h], kb_cost[:, h], kb_cost[:, h] <= bud[h], tol)
            if i is not None:
                take("KBoundary", h, KBoundary(cands[i]), kb_err[i, h], kb_cost[i, h])
    if "QBoundary" in want:
        note("intra-modality candidates")
        qb = [layer.evaluate(QBoundary({names[x]: p for x in present}, default=p)) for p in cands]
        qb_err2 = np.stack([layer.err2(e.out) for e in qb])  # [C, M, N]
        for h in range(n):
            picks, err2, cost = {}, 0.0, 0.0
            for kind in present:
                c = np.array([e.part_cost[kind][h] for e in qb])
                rel = np.sqrt(qb_err2[:, kind, h] / max(layer.norm2[kind, h], 1e-30))
                i = _pick(rel, c, c <= bud[h], tol)
                if i is None:
                    break
                picks[names[kind]] = cands[i]
                err2, cost = err2 + qb_err2[i, kind, h], cost + c[i]
            else:
                if cost <= bud[h]:
                    total = np.sqrt(err2 / max(layer.norm2[list(present), h].sum(), 1e-30))
                    take("QBoundary", h, QBoundary(picks, default=best_nb[h]), total, cost)
    if "TwoDBoundary" in want:
        _two_d(layer, cands, dense, bud, tol, note, best_nb, take)
    heads, rep = [], []
    for h in range(n):
        ok = [t for t in want if choice[t][h] is not None]
        row = {"budget": float(bud[h]),
               **{t: {"error": float(errs[t][h]), "cost": float(costs[t][h]),
                      "pattern": None if choice[t][h] is None else repr(choice[t][h])} for t in want}}
        if ok:
            best = min(errs[t][h] for t in ok)
            t = next(t for t in ok if errs[t][h] <= best + tol)
            heads.append(choice[t][h])
            row["choice"] = t
        else:
            heads.append(NoBoundary(best_nb[h]))
            row["choice"] = "fallback: every candidate over the budget; the cheapest NoBoundary candidate"
        rep.append(row)
        bar.update(1)
    return tuple(heads), rep


def _two_d(layer: _Layer, cands, dense, bud, tol, note, best_nb, take) -> None:
    """Cross-modality search: each candidate on each key modality's keys (pairs of every
    query modality), scored with the other key modalities dense (lse-merged); per head and
    pair the best candidate; the assembly is the lse-merge of the chosen pair results."""
    m, n, names = layer.m, layer.n, layer.m.names
    present, key_kinds = layer.present, layer.key_kinds
    C = len(cands)

    def pairs_for(mk, p):  # the pairs of one key kind; the others are scored from their own parts
        return TwoDBoundary({(names[a], names[mk]): p for a in present}, skip_missing=True)

    dense_by_key, pair = {}, {}
    for mk in key_kinds:
        note(f"cross-modality candidates (keys: {names[mk]})")
        dense_by_key[mk] = layer.evaluate(pairs_for(mk, dense))
        for ci, p in enumerate(cands):
            pair[(ci, mk)] = layer.evaluate(pairs_for(mk, p))
    sel = {}  # (mk) -> int [M, N] chosen candidate per (query kind, head)
    for mk in key_kinds:
        others = [(dense_by_key[x].out, dense_by_key[x].lse) for x in key_kinds if x != mk]
        err2 = np.stack([layer.err2(merge([(pair[(ci, mk)].out, pair[(ci, mk)].lse)] + others)[0])
                         for ci in range(C)])  # [C, M, N]
        choose = np.zeros((m.num_kinds, n), int)
        for a in present:
            for h in range(n):
                c = np.array([pair[(ci, mk)].part_cost[a][h] for ci in range(C)])
                rel = np.sqrt(err2[:, a, h] / max(layer.norm2[a, h], 1e-30))
                choose[a, h] = _pick(rel, c, np.ones(C, bool), tol)
        sel[mk] = choose
    # Assemble: per key kind, each (row, head) takes its chosen candidate's result; merge.
    rows = layer.row_kind  # [B, T]
    parts = []
    for mk in key_kinds:
        outs = np.stack([pair[(ci, mk)].out for ci in range(C)])  # [C, B, T, N, D]
        lses = np.stack([pair[(ci, mk)].lse for ci in range(C)])  # [C, B, N, T]
        idx = sel[mk][rows]  # [B, T, N]
        o = np.take_along_axis(outs, idx[None, ..., None], 0)[0]
        l = np.take_along_axis(lses, np.einsum("btn->bnt", idx)[None], 0)[0]
        parts.append((o, l))
    out, _ = merge(parts)
    err = layer.rel_error(layer.err2(out))
    for h in range(n):
        patterns, cost = {}, 0.0
        for a in range(m.num_kinds):
            for b in range(m.num_kinds):
                if a in present and b in key_kinds:
                    ci = sel[b][a, h]
                    patterns[(names[a], names[b])] = cands[ci]
                    cost += pair[(ci, b)].part_cost[a][h]
                else:  # kinds absent from the calibration: the head's NoBoundary pick
                    patterns[(names[a], names[b])] = best_nb[h]
        if cost <= bud[h]:
            take("TwoDBoundary", h, TwoDBoundary(patterns), err[h], cost)
