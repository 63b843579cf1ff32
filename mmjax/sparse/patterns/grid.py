"""Grid head (MMInference Algorithm 1 and its Table 3 family): lines at a regular stride,
permuted into dense blocks.

The pattern, per head, for a stride ``s`` and line phases ``P`` (``phases`` of them):

* main diagonal band: the ``local`` nearest keys of every query (always kept; 0 = none);
* sink: the first ``sink`` keys (e.g. the text before the video), always kept;
* slash lines (``use_slash``): the diagonals at offsets ``m * s``, ``m >= 1``: a query
  attends the same phase, i.e. the same spatial position, in every earlier frame;
* vertical lines (``use_vline``): the keys at a phase in P (e.g. each frame's sink token);
* horizontal lines (``use_hline``): the queries at a phase in P attend every key (the
  last_q rows cannot observe other row phases, so rows reuse the key phases: in video the
  grid is symmetric, as in MMInference's kernels).

Stride (``stride``): ``"search"`` estimates it online from the attention of the last
``last_q`` queries over the candidates ``stride_space`` up to ``max_stride`` (1024 in the
paper); ``"frame"`` takes the tokens per frame of the video from `Modality.frame_tokens`
(from ``video_grid_thw``); an int fixes it. The phases P are then the phases of that stride
with the most column mass in the last rows. A searched stride with the frame size known (``frame_first``,
`Grid.attend`) attends on the frame stride's layout where every head finds that stride: one key order for all
heads and rows in place (`BlockLayout.q_row_stride`), which per-head strides cannot promise statically.

## The stride permutation

Queries are reordered *phase-major* by (phase group, position), where the phase group of position x is
``i`` if ``x mod s`` is the i-th line phase, else ``|P| + (x mod s)``: every query of one phase (one
spatial position in every frame) is contiguous and in frame order, the line phases first. Keys are
reordered by (phase, position) alone (`key_groups`): an order that does not depend on the head's line
phases, so all heads of one static stride (``"frame"`` or an int) share it and the kernel gathers each
key / value head once instead of copying k / v per query head (sink keys, with ``sink`` > 0, form one
group in front). In those orders

* the slash lines are block diagonal: the pairs at offsets ``m * s`` are exactly the pairs of
  equal phase, so a query block whose rows span phase groups ``[a, b]`` lists the keys of their
  phases, each phase up to the last position its rows see (`Grid.MAX_CAUSAL_GROUPS`; past that many
  groups, the keys of phases ``a .. b`` as one range: their phases ascend as the keys' do, and the range
  holds the line phases between them too); a few dense tiles;
* the vertical lines are ``|P|`` key groups: one contiguous range each (the causal prefix of its phase);
* the horizontal lines are the first ``|P|`` query groups: the first query blocks, which
  list every key block.

So every line becomes whole ``block_q x block_k`` tiles the kernel computes at full speed;
it gathers permuted keys through ``kv_perm`` and masks on original positions. Blocks are computed whole:
a block holds the pairs of every row with every listed key (a superset of the lines at the block edges).

## Layout

A `LayoutSet` of up to three parts whose pairs are disjoint by construction:

1. band: original order, causal ``window = local`` (pairs at distance < local);
2. lines: permuted, causal ``gap = local`` (distance >= local): per query block the causal
   prefix of each vertical-line group and the slash ranges of its rows' phases;
3. rows: permuted rows, ``gap = local``: the horizontal-line blocks list every key block up to the last
   key their rows see (a prefix of one shared ``arange`` list over the keys in original order, or, in a
   placement with invalid keys, over the valid keys in position order; part 2 lists nothing for them). They
   are the first query blocks, at most `Grid.max_line_rows` rows: the part names them as its
   ``q_block_range`` and runs on them alone.

Inside a boundary wrapper (`build_placed`) keys are packed by (invalid, key group, phase, position) (the rows part:
by (invalid, position)) and rows by phase group within the wrapper's row order; the rules stay on original
positions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.sparse import placement as plc
from mmjax.sparse.block_lists import bisect_many, query_block_bounds, ranges_to_lists
from mmjax.sparse.layouts import KernelOptions, LayoutSet, attend
from mmjax.sparse.patterns.base import Pattern
from mmjax.sparse.patterns.static import placed_ashape
from pallas_kernels import BlockLayout
from pallas_kernels.checks import check_int
from pallas_kernels.last_q_scores import last_q_scores
from pallas_kernels.phase_mass import phase_masses
from pallas_kernels.tiling import cdiv, inverse_permutation

# Multiples of 16 and the token counts of common square patch grids (e.g. 14 x 14 = 196),
# from 64 up: the smallest stride bounds the vertical-line list length (S / stride keys).
DEFAULT_STRIDES = tuple(sorted(set(range(64, 1025, 16)) | {81, 100, 144, 196, 225, 324, 400,
                                                           484, 576, 676, 784, 900}))
STRIDE_SOURCES = ("search", "frame")
LIFT_TOLERANCE = 0.6  # a divisor s / m of the true stride keeps ~1/m <= 1/2 of its lift


def multiple_mass(slash: jax.Array, stride: int) -> jax.Array:
    """slash ``[B,N,S]`` (mass per offset) -> mass at the offsets ``m * stride``, m >= 1, ``[B,N]``."""
    return slash[..., stride::stride].sum(-1)


def phase_groups(pos: jax.Array, stride: jax.Array, phase: jax.Array, sink: int = 0) -> jax.Array:
    """Phase group of every position (see the module docstring): pos int32 ``[L]`` or
    ``[B|1, 1, L]``, stride ``[B, N]``, phase ``[B, N, P]`` -> int32 ``[B, N, L]``. With
    ``sink`` > 0 the positions below it form group 0 and every other group moves up by one."""
    pos = jnp.asarray(pos, jnp.int32)
    if pos.ndim == 1:
        pos = pos[None, None]
    s = stride[..., None]
    ph = pos % s  # [B, N, L]
    n_lines = phase.shape[-1]
    line = ph[..., None] == phase[..., None, :]  # [B, N, L, P]
    rest = n_lines + ph
    group = jnp.where(line.any(-1), jnp.argmax(line, -1), rest)
    if sink:
        group = jnp.where(pos < sink, 0, group + 1)
    return group.astype(jnp.int32)


def key_groups(pos: jax.Array, stride: jax.Array, sink: int = 0) -> jax.Array:
    """Group of every key in the phase-major key order (module docstring): its phase ``pos mod stride``; with
    ``sink`` > 0 the positions below it form group 0 and every phase moves up by one. pos int32 ``[L]`` or
    ``[B|1, 1, L]``, stride ``[B|1, N|1]`` -> int32 ``[B|1, N|1, L]``. It does not depend on the line phases, so
    heads of one stride share it."""
    pos = jnp.asarray(pos, jnp.int32)
    if pos.ndim not in (1, 3) or jnp.ndim(stride) != 2 or sink < 0:
        raise ValueError(f"pos, stride, sink: expected pos [L] or [B|1, 1, L], stride [B|1, N|1] and sink >= 0; "
                         f"received {list(pos.shape)}, {list(jnp.shape(stride))} and {sink}")
    if pos.ndim == 1:
        pos = pos[None, None]
    group = pos % stride[..., None]
    if sink:
        group = jnp.where(pos < sink, 0, group + 1)
    return group.astype(jnp.int32)


def phase_major_keys(s: int, stride: int) -> tuple[jax.Array, jax.Array]:
    """The stable argsort of `key_groups` (no sink) in closed form for one static ``stride`` dividing ``s``: (kv_perm,
    its groups ascending) int32 ``[1, 1, S]``; entry j is position ``(j mod S / stride) * stride + j div (S / stride)``
    of group ``j div (S / stride)``."""
    if stride < 1 or s % stride:
        raise ValueError(f"stride: expected a divisor of S={s}; received {stride}")
    per = s // stride
    j = jnp.arange(s, dtype=jnp.int32)
    return ((j % per) * stride + j // per)[None, None], (j // per)[None, None]


def phase_major_rows(t: int, off: int, stride: int, phase: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The stable argsort of `phase_groups` (no sink) in closed form for one static ``stride`` dividing ``t``, rows at
    positions ``off + i``: (q_perm, its groups ascending) int32 ``[B, N, T]`` from phase int32 ``[B, N, P]``.

    Every phase holds T / stride rows, so slot j of the order is row ``w`` (j's place in its group) of its group's
    phase: the line groups first (a phase named twice holds its rows in its first group; the later one is empty), then
    the other phases ascending, the m-th of them found by stepping m past each (distinct) line phase at or below it.
    Elementwise over ``[B, N, T]``, with no sort (an argsort of 28 x 1M rows takes 4.7 ms on an H100)."""
    if stride < 1 or t % stride:
        raise ValueError(f"stride: expected a divisor of T={t}; received {stride}")
    if jnp.ndim(phase) != 3 or not jnp.issubdtype(phase.dtype, jnp.integer):
        raise ValueError(f"phase: expected int [B, N, P]; received {jnp.shape(phase)} {phase.dtype}")
    n, p = t // stride, phase.shape[-1]
    phase = phase.astype(jnp.int32)
    first = [jnp.ones(phase.shape[:-1], bool)] + [
        jnp.all(phase[..., i, None] != phase[..., :i], -1) for i in range(1, p)]  # [B, N] each: not named before
    starts, line_rows = [], jnp.zeros(phase.shape[:-1], jnp.int32)
    for f in first:
        starts.append(line_rows)
        line_rows = line_rows + n * f
    j = jnp.arange(t, dtype=jnp.int32)
    # the line group of slot j: the last group starting at or before it (an empty group starts where the next does);
    # its start and phase by selects, not gathers (with one line phase they are constants XLA would fold, slowly)
    g, start, line_phase = jnp.int32(0), jnp.int32(0), phase[..., :1]
    for i in range(1, p):
        later = j >= starts[i][..., None]  # [B, N, T]
        g = jnp.where(later, i, g)
        start = jnp.where(later, starts[i][..., None], start)
        line_phase = jnp.where(later, phase[..., i, None], line_phase)
    rest = j - line_rows[..., None]  # slots past the line groups
    m = rest // n
    ph_rest = m
    sorted_ph = jnp.sort(phase, -1)
    for i in range(p):
        new = sorted_ph[..., i, None] if i == 0 else jnp.where(sorted_ph[..., i] != sorted_ph[..., i - 1],
                                                               sorted_ph[..., i], stride)[..., None]
        ph_rest = ph_rest + (ph_rest >= new)
    in_line = rest < 0
    ph = jnp.where(in_line, line_phase, ph_rest)
    w = jnp.where(in_line, j - start, rest - m * n)
    rows = (ph - off) % stride + stride * w
    return rows.astype(jnp.int32), jnp.where(in_line, g, p + ph).astype(jnp.int32)


def phase_order(off: int, n: int, stride: jax.Array, phase: jax.Array | None = None, sink: int = 0
                ) -> tuple[jax.Array, jax.Array]:
    """The stable argsort of `phase_groups` (``phase`` None: of `key_groups`) over the positions ``off .. off + n - 1``
    for any strides, without a sort: (order, its groups ascending) int32 ``[B|1, N|1, n]`` (order entries are
    indices ``0 .. n - 1``) from stride int ``[B|1, N|1]`` (each >= 1) and phase int ``[B|1, N|1, P]`` (a phase
    outside ``[0, stride)`` names no rows, as in `phase_groups`).

    Each position's slot is computed: the sink rows first, then per group the rows before it plus the position's
    place in it. The positions ``[lo, hi)`` past the sink hold ``L // s`` or ``L // s + 1`` rows of each phase (one
    more for the phases ``(lo + e) mod s``, ``e < L mod s``), so the rows of the phases below r and a row's place in
    its phase, ``(x - lo) // s``, are closed forms; the order is the slots' inverse (`tiling.inverse_permutation`, one
    scatter). (An argsort of 28 x 1M rows takes 4.7 ms on an H100; `phase_major_rows` is the gather form for one
    static stride dividing n.)"""
    stride = jnp.asarray(stride, jnp.int32)
    if jnp.ndim(stride) != 2 or (phase is not None and (jnp.ndim(phase) != 3 or not jnp.issubdtype(
            jnp.asarray(phase).dtype, jnp.integer))) or sink < 0 or n < 1:
        raise ValueError(f"stride, phase, sink, n: expected stride [B|1, N|1], phase None or int [B|1, N|1, P], "
                         f"sink >= 0 and n >= 1; received {list(jnp.shape(stride))}, "
                         f"{None if phase is None else list(jnp.shape(phase))}, {sink} and {n}")
    phase = jnp.zeros(stride.shape + (0,), jnp.int32) if phase is None else jnp.asarray(phase, jnp.int32)
    shape = jnp.broadcast_shapes(stride.shape, phase.shape[:-1])
    st = jnp.broadcast_to(stride, shape)[..., None]  # [B, N, 1]
    phase = jnp.broadcast_to(phase, shape + phase.shape[-1:])
    x = off + jnp.arange(n, dtype=jnp.int32)  # [n]
    lo = max(off, sink)
    length = max(0, off + n - lo)
    n_sink = n - length
    d, q, rem = lo % st, length // st, length % st  # [B, N, 1]

    def count(r):
        """Rows of phase r in [lo, hi)."""
        return q + ((r - d) % st < rem)

    def below(r):
        """Rows of the phases below r in [lo, hi): q each, plus those of the one-more phases [d, d + rem) mod s."""
        return q * r + jnp.maximum(0, jnp.minimum(r, d + rem) - d) + jnp.maximum(0, jnp.minimum(r, d + rem - st))

    ph = x % st  # [B, N, n]
    p = phase.shape[-1]
    lines = [phase[..., i, None] for i in range(p)]  # [B, N, 1] each
    # a line group holds rows when its phase is one of the stride's and was not named before (else it is empty)
    first = [(lines[i] >= 0) & (lines[i] < st) & jnp.all(lines[i] != phase[..., :i], -1, keepdims=True)
             for i in range(p)]
    counts = [jnp.where(f, count(line), 0) for line, f in zip(lines, first, strict=True)]  # [B, N, 1] each
    starts, total = [], jnp.zeros_like(st)
    for c in counts:
        starts.append(total)
        total = total + c
    in_line, start, group = jnp.zeros(ph.shape, bool), total + below(ph), p + ph
    for i in reversed(range(p)):  # a row in the first line group of its phase
        hit = ph == lines[i]
        in_line, start, group = in_line | hit, jnp.where(hit, starts[i], start), jnp.where(hit, i, group)
    for line, c in zip(lines, counts, strict=True):  # the other rows: past the line groups, less their phases below
        start = jnp.where(in_line | (line >= ph), start, start - c)
    slot = n_sink + start + (x - lo) // st
    if sink:
        slot, group = jnp.where(x < sink, x - off, slot), jnp.where(x < sink, 0, group + 1)
    order = inverse_permutation(slot.astype(jnp.int32))
    return order, jnp.take_along_axis(group.astype(jnp.int32), order, -1)


def _search(code: jax.Array, values: list, *, shape: tuple[int, ...]) -> list[jax.Array]:
    """Where each of the int codes ``values`` (each broadcast to ``shape`` ``[B, N, R]``) first appears in the
    ascending int ``code`` ``[B|1, N|1, S]`` (`jnp.searchsorted`'s "left": the first index with a code >= it;
    the "right" of c is the "left" of c + 1): a list of int32 ``shape``, all from one `bisect_many` over the whole
    order. A key order shared by the heads (``N|1`` = 1) is searched as it is, not copied per head."""
    whole = (jnp.zeros(shape, jnp.int32), jnp.full(shape, code.shape[-1], jnp.int32))
    return bisect_many(code, [whole + (jnp.asarray(v, jnp.int32) - 1,) for v in values], shape)


@dataclasses.dataclass(frozen=True)
class Grid(Pattern):
    """Grid head: band + slash / vertical / horizontal lines at a stride (module docstring).

    stride: "search" | "frame" | an int; max_stride: largest searched stride;
    stride_space: searched candidates (None: `DEFAULT_STRIDES`); phases: line phases per
    head; local: main diagonal band in tokens (0: none); sink: first keys always kept;
    last_q: estimation rows. frame_first: with ``stride="search"`` and the video's frame size known
    (`Modality.frame_tokens`, one of the searched candidates), `attend` runs Grid(frame)'s layout when every head's
    searched stride is the frame's (`frame_guess`); False: always the searched layout.
    """

    stride: int | str = "search"
    use_hline: bool = True
    use_vline: bool = True
    use_slash: bool = True
    max_stride: int = 1024
    local: int = 128
    phases: int = 1
    sink: int = 0
    last_q: int = 64
    stride_space: tuple[int, ...] | None = None
    block_q: int = 128
    block_k: int = 64
    frame_first: bool = True

    def validate(self) -> None:
        if isinstance(self.stride, bool) or not (
                self.stride in STRIDE_SOURCES or (isinstance(self.stride, int) and self.stride >= 1)):
            raise ValueError(f"stride: expected one of {STRIDE_SOURCES} or an int >= 1; received {self.stride!r}")
        if self.stride_space is not None and (not self.stride_space or any(
                not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in self.stride_space)):
            raise ValueError(f"stride_space: expected None or a non-empty tuple of ints >= 1; received "
                             f"{self.stride_space!r}")
        for name in ("use_hline", "use_vline", "use_slash", "frame_first"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool; received {getattr(self, name)!r}")
        check_int("max_stride", self.max_stride, 1)
        check_int("last_q", self.last_q, 1)
        check_int("local", self.local, 0)
        check_int("phases", self.phases, 1)
        check_int("sink", self.sink, 0)
        if isinstance(self.stride, int) and self.phases > self.stride:
            raise ValueError(f"phases: expected phases <= stride={self.stride}; received {self.phases}")
        if not self.local and not self.has_lines:
            raise ValueError("local: expected a band (local >= 1) when use_hline, use_vline and use_slash are all "
                             "False; received local=0")

    # -------------------------------------------------------------- stride
    @property
    def has_lines(self) -> bool:
        return self.use_hline or self.use_vline or self.use_slash or self.sink > 0

    def candidate_strides(self, s: int) -> tuple[int, ...]:
        space = DEFAULT_STRIDES if self.stride_space is None else self.stride_space
        cands = tuple(x for x in space if self.phases <= x <= min(self.max_stride, s))
        if not cands:
            raise ValueError(f"stride_space: expected a stride in [phases={self.phases}, min(max_stride="
                             f"{self.max_stride}, S={s})]; received {space!r}")
        return cands

    def fixed_stride(self, s: int, modality=None) -> int | None:
        """The static stride ("frame" / int), or None for "search". ValueError when "frame"
        has no frame size to use."""
        if self.stride == "search":
            return None
        if self.stride == "frame":
            frame = getattr(modality, "frame_tokens", None)  # a Modality or a Placement
            if frame is None:
                raise ValueError("stride: 'frame' needs the tokens per frame: pass a Modality with frame_tokens "
                                 "(Modality.from_token_types(..., frame_tokens=...) or frame_tokens_from_grid_thw); "
                                 "received none")
            stride = int(frame)
        else:
            stride = int(self.stride)
        if not self.phases <= stride <= s:
            raise ValueError(f"stride: expected phases={self.phases} <= stride <= S={s}; received {stride}")
        return stride

    def max_line_rows(self, t: int, min_stride: int) -> int:
        """A static bound on the rows of the horizontal lines (and the sink rows) among ``t`` queries: at most
        ``sink`` rows below the sink and ``ceil(t / stride)`` rows per line phase. The rows part names the query
        blocks they fill first in its ``q_block_range``."""
        return min(t, self.sink + self.phases * cdiv(t, min_stride))

    def stride_bounds(self, s: int, modality=None) -> tuple[int, int]:
        """(smallest, largest) stride this head can use at S = s (static)."""
        fixed = self.fixed_stride(s, modality)
        if fixed is not None:
            return fixed, fixed
        cands = self.candidate_strides(s)
        return min(cands), max(cands)

    def estimate(self, q, k, *, rows=None, k_valid=None, modality=None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Stride int32 ``[B,N]``, phases int32 ``[B,N,phases]`` and excess lift float32
        ``[B,N]`` (mass of the variant's lines per fraction of keys they cost, relative to
        uniform attention, minus 1). rows / k_valid: estimation rows and keys as in `last_q_scores`."""
        t, s = q.shape[1], k.shape[1]
        if self.last_q > t:
            raise ValueError(f"last_q: expected last_q <= T={t} (query length); received {self.last_q}")
        vertical, slash = last_q_scores(q, k, last_q=self.last_q, rows=rows, k_valid=k_valid)
        fixed = self.fixed_stride(s, modality)
        cands = (fixed,) if fixed is not None else self.candidate_strides(s)
        lines = self.use_vline or self.use_hline
        # Every stride's phase masses in one call (a Triton kernel on a GPU), ranked by one top_k. The slash side
        # stays a strided sum per stride: it reads S / stride offsets, where a phase mass reads all S (one H100,
        # 2026-12-07: the search 1.04 -> 0.42 ms at 128k, 4.23 -> 2.10 at 1M; `tools/phase_mass_bench.py`).
        mass, phases = jax.lax.top_k(phase_masses(vertical, cands), self.phases)  # [B,N,C,phases]
        multiples = jnp.stack([multiple_mass(slash, c) for c in cands], -1) if self.use_slash else 0.0  # [B,N,C]
        kept = (mass.sum(-1) if lines else 0.0) + multiples
        cost = (self.phases if lines else 0) + (1 if self.use_slash else 0)
        # Excess lift over uniform attention (which has lift 1 at every stride).
        lift = jnp.broadcast_to(kept * jnp.asarray(cands, jnp.float32) / max(cost, 1) - 1.0,
                                (*vertical.shape[:2], len(cands)))  # [B,N,C]
        # The best-lift stride may be a multiple m * s of the true stride s (the same lift,
        # and it wins on noise): walk down to the smallest divisor of it that keeps
        # LIFT_TOLERANCE of its lift; a divisor s / m of the true stride keeps ~1/m. (The max over
        # more phases of a larger stride is biased upwards: measured 0.68 for the true stride
        # against 5x it on a sink head, so the tolerance sits between 1/2 and that: 0.6.)
        best = jnp.argmax(lift, axis=-1)
        divides = jnp.asarray(np.array(cands)[None, :] % np.array(cands)[:, None] == 0)  # [i, j]: c_i | c_j
        best_lift = jnp.take_along_axis(lift, best[..., None], -1)
        ok = divides[:, best].transpose(1, 2, 0) & (lift >= LIFT_TOLERANCE * best_lift)
        pick = jnp.argmax(ok, axis=-1)  # candidates ascend: the smallest qualifying divisor
        stride = jnp.asarray(cands, jnp.int32)[pick]
        phase = jnp.take_along_axis(phases, pick[..., None, None], axis=-2)[..., 0, :]
        return stride, phase.astype(jnp.int32), jnp.take_along_axis(lift, pick[..., None], -1)[..., 0]

    # -------------------------------------------------------------- layouts
    def build_layout(self, q, k, *, modality=None) -> LayoutSet | BlockLayout:
        stride, phase, _ = self.estimate(q, k, modality=modality)
        return self.layout_from_index(stride, phase, q.shape[1], k.shape[1],
                                      bounds=self.stride_bounds(k.shape[1], modality))

    def frame_guess(self, s: int, modality=None) -> int | None:
        """The static stride `attend` tries first at S = s: the video's frame size (`Modality.frame_tokens`) for
        ``stride="search"`` with ``frame_first`` when it is one of the searched candidates; else None."""
        frame = getattr(modality, "frame_tokens", None)
        if self.stride != "search" or not self.frame_first or frame is None:
            return None
        return int(frame) if int(frame) in self.candidate_strides(s) else None

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, modality=None,
               options: KernelOptions = KernelOptions()) -> tuple[jax.Array, jax.Array]:
        """out ``[B, T, N, D]``, lse ``[B, N, T]``. With a `frame_guess` F, a ``lax.cond`` on the searched strides:
        where every head found F, the layout of ``stride=F`` (what Grid(frame) builds: one key order for all heads,
        rows stepping by F when F divides T into whole query blocks per phase, lists and the rows part sized for
        F, so no per-head copy of k / v, no gathered q or put-back output); else the searched layout. Either
        branch is `layout_from_index` at the strides the heads found (the searched bounds may list blocks the frame's do
        not: where they allow a block more than `MAX_CAUSAL_GROUPS` query groups, short sequences, its slash keys are
        one range); both branches compile. Inside a boundary wrapper (`build_placed`) the searched layout always."""
        t, s = q.shape[1], k.shape[1]
        guess = self.frame_guess(s, modality)
        if guess is None:
            return super().attend(q, k, v, modality=modality, options=options)
        stride, phase, _ = self.estimate(q, k, modality=modality)

        def run(bounds):
            return lambda q, k, v, stride, phase: attend(
                q, k, v, self.layout_from_index(stride, phase, t, s, bounds=bounds), options)

        return jax.lax.cond(jnp.all(stride == guess), run((guess, guess)), run(self.stride_bounds(s)),
                            q, k, v, stride, phase)

    def _band(self, t: int, s: int) -> BlockLayout:
        bk = self.block_k
        qs, qe = query_block_bounds(t, s, self.block_q)
        lo = jnp.maximum(qs - self.local + 1, 0) // bk
        blocks, count = ranges_to_lists([(lo[:, None], (qe // bk)[:, None], cdiv(self.local + self.block_q, bk) + 1)],
                                        cdiv(s, bk))
        return BlockLayout(kv_blocks=blocks[None, None], kv_block_count=count[None, None], block_q=self.block_q,
                           block_k=bk, q_len=t, kv_len=s, window=self.local)

    # A block whose rows span at most this many query groups lists each group's keys up to its rows' reach
    # (the causal prefix of the group); past it, the keys of all its phases as one range (fewer, wider ranges:
    # short sequences with long strides, where the groups hold few rows).
    MAX_CAUSAL_GROUPS = 16

    def _widths(self, t: int, s: int, bounds: tuple[int, int]) -> tuple[int, int, int]:
        """Static bounds: the keys of one phase, the query groups past the line phases a block's rows can span
        (with the unused numbers of the line phases between them), and the keys of their phases."""
        s_min, s_max = bounds
        per_group = cdiv(s, s_min)
        groups = min(self.block_q, cdiv(self.block_q, max(1, t // s_max)) + 1) + self.phases
        return per_group, groups, min(s, groups * per_group)

    def layout_from_index(self, stride, phase, t: int, s: int, *, bounds: tuple[int, int]
                          ) -> LayoutSet | BlockLayout:
        """stride ``[B,N]``, phase ``[B,N,P]`` -> the `LayoutSet` of the module docstring.
        bounds: static (smallest, largest) stride, every stride within them (list widths; equal bounds: one key
        order for every head, ``kv_perm`` ``[1,1,S]``, and with no sink the phase-major orders in closed form,
        `phase_major_keys` / `phase_major_rows`, where the stride divides S / T; else `phase_order`'s slots, the
        stable argsorts' orders without a sort)."""
        off = s - t
        one = bounds[0] == bounds[1] and not self.sink
        if one and s % bounds[0] == 0:  # one stride: the phase-major orders in closed form, no sort
            kv_perm, kg_sorted = phase_major_keys(s, bounds[0])
        else:
            kv_perm, kg_sorted = phase_order(0, s, self._key_stride(stride, bounds), sink=self.sink)  # [1|B, 1|N, S]
        if one and t % bounds[0] == 0:
            q_perm, qg_sorted = phase_major_rows(t, off, bounds[0], phase)
        else:
            q_perm, qg_sorted = phase_order(off, t, stride, phase, self.sink)
        q_pos = q_perm + off
        return self._assemble(kv_perm, q_perm, kg_sorted, qg_sorted, q_pos, kv_perm, stride, phase, t, s, bounds,
                              band=self._band(t, s) if self.local else None, rows_keys=None,
                              row_stride=self._row_stride(t, bounds))

    def _row_stride(self, t: int, bounds: tuple[int, int]) -> int:
        """The lines part's `BlockLayout.q_row_stride`: its rows go by phase, each phase's rows stepping by the
        stride, so with one static stride dividing T, a whole number of query blocks per phase and no sink group,
        every query block is one phase and ``block_q`` consecutive frames (0 otherwise)."""
        st = bounds[0]
        ok = bounds[0] == bounds[1] and not self.sink and t % st == 0 and (t // st) % self.block_q == 0
        return st if ok else 0

    @staticmethod
    def _key_stride(stride: jax.Array, bounds: tuple[int, int]) -> jax.Array:
        """The stride the key order follows: one static stride ``[1,1]`` when the bounds are equal, else
        ``stride`` ``[B,N]`` (a key order per head)."""
        return jnp.full((1, 1), bounds[0], jnp.int32) if bounds[0] == bounds[1] else stride

    def _assemble(self, kv_perm, q_perm, code, qg_sorted, q_pos, k_pos, stride, phase, t: int, s: int,
                  bounds, *, band, rows_keys, seg_base=(0,), row_stride: int = 0) -> LayoutSet | BlockLayout:
        """Lines and rows parts from the packed keys and the sorted query groups.

        code ``[B|1, N|1, S]``: each packed key's code, ascending: ``seg_base[i]`` + its `key_groups` group for
        the keys of valid segment i (one segment: the groups themselves; invalid keys sort past every code);
        k_pos: their positions, ascending within a code. qg_sorted / q_pos ``[B,N,T]``: each permuted row's
        `phase_groups` group and position; stride ``[B,N]``, phase ``[B,N,P]``. rows_keys: the rows part's key
        order, None (every key, in original order) or (kv_perm int32 ``[B, 1, S]``: the valid keys first, by
        position; int32 ``[B, S]``: the valid keys at positions up to each position). row_stride: the lines part's
        `BlockLayout.q_row_stride` (`_row_stride`)."""
        bq, bk = self.block_q, self.block_k
        nq, nk = cdiv(t, bq), cdiv(s, bk)
        front = 1 if self.sink else 0  # the sink group
        p_lines = self.phases + front  # query groups [0, p_lines): sink, then the line phases
        gap = self.local
        parts = [] if band is None else [band]
        if not self.has_lines:
            return parts[0]
        pad = nq * bq - t
        qg_blk = jnp.pad(qg_sorted, ((0, 0), (0, 0), (0, pad)), mode="edge").reshape(qg_sorted.shape[:2] + (nq, bq))
        qp_blk = jnp.pad(q_pos, ((0, 0), (0, 0), (0, pad)), mode="edge").reshape(q_pos.shape[:2] + (nq, bq))
        g_lo, g_hi = qg_blk.min(-1), qg_blk.max(-1)  # [B, N, nq]
        reach = qp_blk.max(-1) - gap  # keys at positions <= reach can be seen
        search = functools.partial(_search, code, shape=g_lo.shape)
        per_group, n_rest, rest_keys = self._widths(t, s, bounds)
        sink_keys = min(self.sink, s)

        def group_reach(g):
            """(any row of the block in query group g, the last key position those rows see) ``[B, N, nq]``."""
            rows = qg_blk == g[..., None]
            return rows.any(-1), jnp.where(rows, qp_blk, -1).max(-1) - gap

        # (query group, key group, width) of the sink and of each line phase
        lines = ([(0, 0, sink_keys)] if front else []) + [
            (front + i, front + phase[..., i, None], per_group) for i in range(self.phases)]
        groups = []
        for base in seg_base:
            # every search of the segment in one bisection: each line group's keys [lo, end) (its code's first key
            # and the next code's), for its vertical line and its slash span, and the rest of the slash codes
            codes = [base + c for _, c, _ in lines]
            rest = []
            if self.use_slash:
                a, b = jnp.maximum(g_lo, p_lines), g_hi
                if n_rest <= self.MAX_CAUSAL_GROUPS:  # rows past the line phases: group a + j, phase a + j - p_lines
                    rest = [base + front + a + j - p_lines for j in range(n_rest)]
                    rest = rest + [c + 1 for c in rest]
                else:  # their groups [a, b] hold phases a - p_lines .. b - p_lines (and the line phases between)
                    rest = [base + front + a - p_lines, base + front + b - p_lines + 1]
            first = search(codes + [c + 1 for c in codes] + rest)
            found = list(zip(first[:len(codes)], first[len(codes):2 * len(codes)], strict=True))
            rest = first[2 * len(codes):]
            # vertical lines (and the sink keys): each line group's causal prefix; slash lines: the keys of the phases
            # of the block's rows, each phase up to the last position its rows see (the kernel masks on positions,
            # causal with the gap); all their ends in one bisection
            ends = [(lo, end, reach, width, None) for i, ((lo, end), (_, _, width)) in
                    enumerate(zip(found, lines, strict=True)) if i < front or self.use_vline]
            n_vertical = len(ends)
            merged = []  # past MAX_CAUSAL_GROUPS: the phases of [a, b] as one key range
            if self.use_slash:
                spans = [(g, lo, end, width) for (g, _, width), (lo, end) in zip(lines, found, strict=True)]
                if n_rest <= self.MAX_CAUSAL_GROUPS:
                    spans += [(a + j, rest[j], rest[n_rest + j], per_group) for j in range(n_rest)]
                else:
                    merged = [(rest[0], jnp.where(b >= a, rest[1] - 1, rest[0] - 1), rest_keys)]
                for g, lo, end, width in spans:
                    has, seen = group_reach(jnp.broadcast_to(g, g_lo.shape))
                    ends.append((lo, end, seen, width, has))
            cut = bisect_many(k_pos, [(lo, end, x) for lo, end, x, _, _ in ends], g_lo.shape)
            last = [(lo, c - 1 if has is None else jnp.where(has, c - 1, lo - 1), width)
                    for (lo, _, _, width, has), c in zip(ends, cut, strict=True)]
            groups += last[:n_vertical] + merged + last[n_vertical:]
        cand = [((lo // bk)[..., None], jnp.where(hi >= lo, hi // bk, lo // bk - 1)[..., None], cdiv(width, bk) + 1)
                for lo, hi, width in groups]
        if cand:
            blocks, count = ranges_to_lists(cand, nk)
        else:
            blocks, count = jnp.zeros(g_lo.shape + (1,), jnp.int32), jnp.zeros_like(g_lo)
        common = dict(q_perm=q_perm, kv_perm=kv_perm, block_q=bq, block_k=bk, q_len=t, kv_len=s, gap=gap)
        if self.use_hline:
            n_rows = (qg_sorted < p_lines).sum(-1)  # [B, N] (sink rows, the first queries, too)
            h_rows = jnp.arange(nq) * bq < n_rows[..., None]
            count = jnp.where(h_rows, 0, count)
            # every (valid) key in position order, each block up to the last key its rows see: the tiles past it
            # would be computed wholly masked (38% of the part's tiles at 128k and 48% at 1M on `bench patterns`'
            # video input, frame stride 256); in original key order no copy of k / v per head
            if rows_keys is None:
                listed = jnp.clip(reach // bk + 1, 0, nk)
                rows_common = dict(common, kv_perm=None)
            else:
                rows_perm, valid_upto = rows_keys
                batch = jnp.arange(valid_upto.shape[0])[:, None, None]
                seen = jnp.where(reach >= 0, valid_upto[batch, jnp.clip(reach, 0, s - 1)], 0)  # [B, N, nq]
                listed = (seen + bk - 1) // bk
                rows_common = dict(common, kv_perm=rows_perm)
            full = BlockLayout(kv_blocks=jnp.arange(nk, dtype=jnp.int32)[None, None, None],
                               kv_block_count=jnp.where(h_rows, listed, 0).astype(jnp.int32),
                               q_block_range=(0, cdiv(self.max_line_rows(t, bounds[0]), bq)), **rows_common)
        if front or self.use_vline or self.use_slash:
            parts.append(BlockLayout(kv_blocks=blocks, kv_block_count=count.astype(jnp.int32),
                                     q_row_stride=row_stride, **common))
        if self.use_hline:
            parts.append(full)
        return LayoutSet(tuple(parts)) if len(parts) > 1 else parts[0]

    def build_placed(self, q, k, placement) -> LayoutSet | BlockLayout:
        """Grid inside a boundary wrapper: stride and phases estimated from the last rows of
        the row order over the valid keys; the band as A-shape windows of each key segment;
        keys packed by (invalid, key group, phase, position), rows by phase group
        within the wrapper's order; lines as in `layout_from_index` on original positions."""
        t, s = q.shape[1], k.shape[1]
        stride, phase, _ = self.estimate(q, k, rows=placement.est_rows(self.last_q), k_valid=placement.k_valid,
                                         modality=placement)
        bounds = self.stride_bounds(s, placement)
        b = k.shape[0]
        kg = key_groups(jnp.arange(s), self._key_stride(stride, bounds), self.sink)  # [1|B, 1|N, S]
        invalid = jnp.zeros((b, s), jnp.int32) if placement.k_valid is None else (~placement.k_valid).astype(jnp.int32)
        seg = (invalid * placement.num_groups + placement.k_group)[:, None]  # [B, 1, S]
        n_codes = bounds[1] + 1  # key groups: the sink and the phases
        key_code = seg * n_codes + kg  # < 2 * groups * (max stride + 1): int32
        kv_perm = jnp.argsort(key_code, axis=-1, stable=True).astype(jnp.int32)
        code_sorted = jnp.take_along_axis(key_code, kv_perm, -1)
        row_pos = placement.rows + (s - t)  # [B, T]
        qg = phase_groups(row_pos[:, None], stride, phase, self.sink)  # [B, N, T]
        inner = jnp.argsort(qg, axis=-1, stable=True).astype(jnp.int32)
        q_perm, q_pos = plc.q_positions(placement, s, inner)
        qg_sorted = jnp.take_along_axis(qg, inner, -1)
        band = None
        if self.local:
            order = plc.pack_keys(placement)
            q_perm_band, q_pos_band = plc.q_positions(placement, s)
            band = placed_ashape(self, 0, self.local, order, q_perm_band, q_pos_band, t, s).replace(window=self.local)
        seg_base = tuple(g * n_codes for g in range(placement.num_groups))
        rows_keys = None  # the horizontal lines see every key: in original order
        if placement.k_valid is not None:  # the valid keys first (as the wrapper's `restrict_to_valid` counts them)
            rows_keys = (jnp.argsort(invalid, axis=-1, stable=True).astype(jnp.int32)[:, None],
                         jnp.cumsum(1 - invalid, axis=-1).astype(jnp.int32))
        return self._assemble(kv_perm, q_perm, code_sorted, qg_sorted, q_pos, kv_perm, stride, phase, t, s, bounds,
                              band=band, rows_keys=rows_keys, seg_base=seg_base)
