"""Fused query-sparse attention + online block top-k in the Pallas Triton lowering.

One program per (tile of R sampled rows, query head, batch). The wrapper gathers the
sampled rows (every gamma-th query) into a contiguous ``[B, Tg, N, D]`` array, so a tile of
R = 64 rows covers 64 * gamma real positions. The program scans the key blocks of size
``block_kv`` that its last row may see; per block it computes ``s = q k^T`` (float32
``[R, block_kv]``, base 2), the block max ``mb`` and ``p = exp2(s - mb)``, which give both

* the block score ``S(j) = (mb + log2 sum p) * ln 2`` (natural-log logsumexp over the
  block), and
* the online-softmax update of O_gamma, rescaling ``p @ v`` by ``exp2(mb - m_new)``: one
  exponential per score, as in flash attention.

and offers ``S(j)`` to the row's top-k structure (`topk.py`: exact buffer, tournament tree
or estimated hybrid), held in registers for the whole scan; the estimated hybrid keeps only
its k_exact slots there and stores accepted items straight to the output. Only candidate
blocks are offered (see `common.py`); the causal mask is computed only for tiles that need
it. With ``scan="golden"`` or ``"golden_pairs"`` (the "estimated" top-k only) step ``i`` loads block
``j(i)``, a permutation of the tile's first candidates (a few scalar ops per step, from a per-tile (n, a)
table): the same blocks, the same work, another order. Non-finite inputs follow `pallas_kernels.nonfinite`: a block with a visible non-finite
score has a NaN score (ranked first, see `topk.py`), a non-finite value row poisons the rows
that see it (a per-key flag next to v, whose bad rows are zeroed once by the wrapper). The
score poison comes from per-row flags the wrapper computes once (a sampled query row or a key
row holding a NaN / inf): a tile without masking adds ``qp + sum(kp)`` to each row's block sum
instead of checking its ``[R, bk]`` scores. A score that overflows from finite inputs is not
flagged: +inf still ends NaN (``inf - inf`` in the exponent), -inf counts as weight 0.

The flags cost 15-22% (a regression bisected to the commit that added the non-finite contract), so
the wrapper runs the kernel without them (``poison=False``) when the sampled queries, k and v are all
finite, chosen on the device (`nonfinite.checked_if_nonfinite`). Same run on an H100 (2026-11-25,
`tools/poison_cost.py`, 128k tokens): no top-k 29.9 -> 23.3 ms, estimated top-k 41.1 -> 34.7 ms
(before the contract, `tools/qsa_bisect.py`: 25.2 and 35.3 ms).

Launch order: the grid is (query head, row tile, batch) with the head fastest, so the programs
running at the same time are the heads of one row tile; the 7 query heads of a GQA group read the
same K / V blocks in the same order (also with ``scan="golden"``, whose order is per tile) and
share them through L2. With the tile fastest, the golden order gave every concurrent program its
own block order (1M tokens, H200, 2026-11-23: 2.68 s against 2.29 s for the natural order). Measured
with this grid and the flag-based poison, same run on an H100 (2026-11-25): golden 2628 -> 2536 ms,
natural 2454 ms; the H200 gap is not re-measured.

Measured on an H200 (2026-11-21; B=1, N=28, K=4, D=128, bf16, gamma=16, beta=64, 64
sampled rows per program): at 128k tokens the kernel takes 25 ms without top-k (about
300 TFLOP/s on the sampled rows), 34 ms with the estimated hybrid at k=128 (k_exact=8),
63 ms with the exact buffer, 281 ms with the tournament tree; at 1M tokens 1.9 s
(estimated, k=128). 32-row tiles were 2.7x slower. The register-resident structures cost
through register pressure more than through their update arithmetic (skipping updates no
row needs saved only 14% for the exact buffer).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.nonfinite import checked_if_nonfinite, finish, value_poison
from pallas_kernels.online_softmax import masked_flag_tile, unmasked_flag_tile
from pallas_kernels.qsa_topk import topk as topk_lib
from pallas_kernels.qsa_topk.common import QSATopKResult, scan_start, scan_table, scan_unit
from pallas_kernels.tiling import LN2, LOG2E, cdiv
from pallas_kernels.tiling import pad_to as _pad_to


def default_launch(rows: int, register_slots: int, d_pad: int) -> tuple[int, int]:
    """(num_warps, num_stages): 8 warps when the row tile plus the top-k slots held in
    registers are large, 4 otherwise."""
    regs = rows * (d_pad + 2 * topk_lib.next_pow2(max(register_slots, 1)))
    return (8 if regs > 64 * 192 else 4), 2


def _kernel(q_ref, *refs, sm_scale, gamma, rows, block_kv, num_tiles,
            tg, kv_len, q_offset, algorithm, top_k, k_exact, sink_blocks, local, unit, poison, quantile):
    if poison:
        qp_ref, k_ref, v_ref, kp_ref, vp_ref, *refs = refs
    else:
        k_ref, v_ref, *refs = refs
    if unit:
        scan_ref, o_ref, lse_ref, *topk_refs = refs
    else:
        o_ref, lse_ref, *topk_refs = refs
    tile = num_tiles - 1 - pl.program_id(1)  # longest causal rows start first
    q = q_ref[...]
    qp = qp_ref[...] if poison else None  # [R] 0, or NaN for a sampled query row holding a NaN / inf
    scale = sm_scale * LOG2E
    iota_k = lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
    g = tile * rows + lax.broadcasted_iota(jnp.int32, (rows,), 0)
    pos = g * gamma + q_offset  # [R] positions of the sampled rows
    lo = jnp.maximum(pos - local, 0) // block_kv  # candidates: sink_blocks <= j < lo
    first_pos = tile * rows * gamma + q_offset
    last_row = jnp.minimum((tile + 1) * rows, tg) - 1
    n_blocks = jnp.minimum(cdiv(kv_len, block_kv), (last_row * gamma + q_offset) // block_kv + 1)

    if unit:
        # Steps first + u w + o (w < span, o < u) visit first + u r + o with r = w * mult mod span
        # (`common.py`), r kept incrementally (no overflow); other steps j = i.
        span, mult = scan_ref[tile, 0], scan_ref[tile, 1]
        first = scan_start(sink_blocks, unit)

    def body(i, carry):
        m, l, acc, state, r = carry
        if unit:
            o = lax.rem(jnp.maximum(i - first, 0), unit)
            permuted = (i >= first) & (i < first + span * unit)
            j = jnp.where(permuted, first + r * unit + o, i)
            r_next = r + mult
            r = jnp.where(permuted & (o == unit - 1), jnp.where(r_next >= span, r_next - span, r_next), r)
        else:
            j = i
        start = j * block_kv
        k = k_ref[pl.ds(start, block_kv), :]
        v = v_ref[pl.ds(start, block_kv), :]
        s = pltriton.dot(q, k, trans_b=True) * scale  # [R, bk] f32, base 2
        k_pos = start + iota_k
        zero = jnp.zeros((rows,), jnp.float32)

        # The score poison from the wrapper's per-row flags (`online_softmax.masked_flag_tile`);
        # without ``poison`` (every input known finite) there is none.
        def mask():
            ok = (k_pos[None, :] <= pos[:, None]) & (k_pos[None, :] < kv_len)
            if not poison:
                return jnp.where(ok, s, -jnp.inf), zero, zero
            kp = kp_ref[pl.ds(start, block_kv)]  # [bk] 0, or NaN for a key row holding a NaN / inf
            vp = vp_ref[pl.ds(start, block_kv)]  # [bk] 0, or NaN for a non-finite value row
            return masked_flag_tile(s, ok, qp, kp) + (jnp.sum(jnp.where(ok, vp[None, :], 0.0), axis=1),)

        def no_mask():
            if not poison:
                return s, zero, zero
            kp = kp_ref[pl.ds(start, block_kv)]
            vp = vp_ref[pl.ds(start, block_kv)]
            return unmasked_flag_tile(s, qp, kp) + (zero + jnp.sum(vp),)

        need = (start + block_kv - 1 > first_pos) | (start + block_kv > kv_len)
        s, s_poison, v_poison = lax.cond(need, mask, no_mask)
        mb = jnp.max(s, axis=1)
        mb_safe = jnp.where(mb == -jnp.inf, 0.0, mb)
        p = jnp.exp2(s - mb_safe[:, None])
        lb = jnp.sum(p, axis=1) + s_poison  # NaN for a block with a visible non-finite score
        empty = lb == 0.0
        score = topk_lib.rank_value(
            jnp.where(empty, -jnp.inf, (mb_safe + jnp.log2(jnp.where(empty, 1.0, lb))) * LN2))
        m_new = jnp.maximum(m, mb)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        w = jnp.exp2(mb_safe - m_safe)
        l = l * alpha + lb * w + v_poison
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v) * w[:, None]
        # A row's candidates are offered at steps sink_blocks <= i < lo (common.py).
        active = (i >= sink_blocks) & (i < lo)
        if algorithm == "estimated":
            # Accepted items go straight to the output: the estimated slots never live in
            # registers. Each row writes its own slot ``count`` (distinct addresses).
            state, (accept, sv, si, slot) = topk_lib.estimated_step(
                state, score, j, active, lo - i, k=top_k, k_exact=k_exact, step=i)
            est_v_ref, est_i_ref = topk_refs[2], topk_refs[3]
            pltriton.store(est_v_ref.at[row_iota, slot], sv, mask=accept)
            pltriton.store(est_i_ref.at[row_iota, slot], si, mask=accept)
        elif algorithm == "exact":
            # Most blocks of a long scan beat no row's weakest slot: skip the O(k) update
            # unless some row of the tile takes the block (H200, 128k, k=128: 73 -> 63 ms;
            # the same skip made the tournament tree slower, 281 -> 310 ms, so it has none).
            takes = active & (score > topk_lib.weakest_value(algorithm, state))
            state = lax.cond(
                jnp.max(takes.astype(jnp.int32)) > 0,
                lambda st: topk_lib.offer(algorithm, st, score, j, active, lo - j, k=top_k,
                                          k_exact=k_exact),
                lambda st: st,
                state,
            )
        elif algorithm == "tournament":
            state = topk_lib.offer(algorithm, state, score, j, active, lo - j, k=top_k,
                                   k_exact=k_exact)
        return m_new, l, acc, state, r

    row_iota = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    if algorithm == "estimated":
        state0 = topk_lib.estimated_init(rows, top_k, k_exact, buffers=False, quantile=quantile)
    else:
        state0 = topk_lib.init(algorithm, rows, top_k, k_exact)
    carry = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, q.shape[-1]), jnp.float32),
        state0,
        jnp.int32(0),
    )
    m, l, acc, state, _ = lax.fori_loop(0, n_blocks, body, carry)
    out, lse = finish(m, l, acc, base2=True)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse
    if algorithm == "estimated":
        (ev, ei), _ = topk_lib.estimated_result(state, k_exact)
        topk_refs[0][...] = ev
        topk_refs[1][...] = ei
        # Slots past each row's count are empty (disjoint from the scattered writes).
        size = topk_refs[2].shape[-1]
        slot = lax.broadcasted_iota(jnp.int32, (rows, size), 1)
        empty = slot >= state.count[:, None]
        fill = jnp.where(slot < top_k - k_exact, -jnp.inf, jnp.inf).astype(jnp.float32)
        pltriton.store(topk_refs[2].at[:, :], fill, mask=empty)
        pltriton.store(topk_refs[3].at[:, :], -1 - slot, mask=empty)
    else:
        for i, (vals, ids) in enumerate(topk_lib.parts(algorithm, state, k_exact)):
            topk_refs[2 * i][...] = vals
            topk_refs[2 * i + 1][...] = ids


def _part_sizes(algorithm: str, top_k: int, k_exact: int) -> tuple[int, ...]:
    if algorithm == "none":
        return ()
    if algorithm == "estimated":
        return (topk_lib.next_pow2(max(k_exact, 1)), topk_lib.next_pow2(max(top_k - k_exact, 1)))
    return (topk_lib.next_pow2(top_k),)


@functools.partial(jax.jit, static_argnames=(
    "gamma", "block_kv", "top_k", "k_exact", "topk", "sink_blocks", "local", "sm_scale",
    "rows", "interpret", "num_warps", "num_stages", "scan", "poison", "quantile"))
def qsa_topk_triton(q: jax.Array, k: jax.Array, v: jax.Array, *, gamma: int, block_kv: int,
                    top_k: int, k_exact: int, topk: str, sink_blocks: int, local: int,
                    sm_scale: float, rows: int = 64, interpret: bool = False,
                    num_warps: int | None = None, num_stages: int | None = None,
                    scan: str = "natural", poison: bool | None = None, quantile: str = "histogram") -> QSATopKResult:
    """See `api.qsa_topk`; inputs are assumed validated. ``rows``: sampled rows per program
    (a power of two >= 16). ``topk="none"`` (benchmarks only, not accepted by the API) runs
    the attention and block scores without any top-k structure and selects nothing.
    ``scan="golden"`` / ``"golden_pairs"`` change the block order of the "estimated" scan only (a scalar
    permutation of the loop index, the same blocks and work; `common.py`). ``poison``: None
    (default) runs the kernel without the non-finite flags when the sampled queries, k and v are all
    finite (`nonfinite.all_finite`, chosen on the device by ``lax.cond``) and with them otherwise;
    True / False force one of the two. ``quantile``: the "estimated" threshold rule (`topk.py`)."""
    run = functools.partial(_qsa_topk, q, k, v, gamma=gamma, block_kv=block_kv, top_k=top_k, k_exact=k_exact,
                            topk=topk, sink_blocks=sink_blocks, local=local, sm_scale=sm_scale, rows=rows,
                            interpret=interpret, num_warps=num_warps, num_stages=num_stages, scan=scan,
                            quantile=quantile)
    return checked_if_nonfinite(run, q[:, ::gamma], k, v) if poison is None else run(poison)


def _qsa_topk(q, k, v, poison, *, gamma, block_kv, top_k, k_exact, topk, sink_blocks, local, sm_scale, rows, interpret,
              num_warps, num_stages, scan, quantile) -> QSATopKResult:
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    tg = cdiv(t, gamma)
    num_tiles = cdiv(tg, rows)
    nk = cdiv(s, block_kv)
    d_pad = max(16, topk_lib.next_pow2(d))
    qg = _pad_to(_pad_to(q[:, ::gamma], 3, d_pad), 1, num_tiles * rows)  # [B, Tgp, N, Dp]
    k_in = _pad_to(_pad_to(k, 3, d_pad), 1, nk * block_kv)
    if poison:
        vp = value_poison(v)  # [B, S, K]: a non-finite value row poisons the rows that see it
        kp = _pad_to(value_poison(k), 1, nk * block_kv)  # [B, S, K]: NaN for a key row holding a NaN / inf
        qp = value_poison(qg)  # [B, Tgp, N]
        v_in = _pad_to(_pad_to(jnp.where(jnp.isnan(vp)[..., None], 0, v), 3, d_pad), 1, nk * block_kv)
        vp_in = _pad_to(vp, 1, nk * block_kv)
    else:
        v_in = _pad_to(_pad_to(v, 3, d_pad), 1, nk * block_kv)
    tgp = num_tiles * rows
    sizes = _part_sizes(topk, top_k, k_exact)
    unit = scan_unit(scan) if topk == "estimated" else 0  # 0: id order
    # Grid (head, tile, batch), head fastest (see the module docstring).
    q_spec = pl.BlockSpec((None, rows, None, d_pad), lambda h, i, z: (z, num_tiles - 1 - i, h, 0))
    qp_spec = pl.BlockSpec((None, rows, None), lambda h, i, z: (z, num_tiles - 1 - i, h))
    kv_spec = pl.BlockSpec((None, nk * block_kv, None, d_pad), lambda h, i, z: (z, 0, h // groups, 0))
    vp_spec = pl.BlockSpec((None, nk * block_kv, None), lambda h, i, z: (z, 0, h // groups))
    lse_spec = pl.BlockSpec((None, None, rows), lambda h, i, z: (z, h, num_tiles - 1 - i))
    part_specs, part_shapes = [], []
    for size in sizes:
        spec = pl.BlockSpec((None, None, rows, size), lambda h, i, z: (z, h, num_tiles - 1 - i, 0))
        part_specs += [spec, spec]
        part_shapes += [jax.ShapeDtypeStruct((b, n, tgp, size), jnp.float32),
                        jax.ShapeDtypeStruct((b, n, tgp, size), jnp.int32)]
    if num_warps is None or num_stages is None:
        slots = {"none": 0, "estimated": k_exact}.get(topk, top_k)
        dw, ds = default_launch(rows, slots, d_pad)
        num_warps = dw if num_warps is None else num_warps
        num_stages = ds if num_stages is None else num_stages
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, gamma=gamma, rows=rows, block_kv=block_kv,
        num_tiles=num_tiles, tg=tg, kv_len=s, q_offset=s - t, algorithm=topk, top_k=top_k,
        k_exact=k_exact, sink_blocks=sink_blocks, local=local, unit=unit, poison=poison, quantile=quantile,
    )
    extra = []
    if unit:
        extra = [jnp.asarray(scan_table(t, s, gamma=gamma, block_kv=block_kv, local=local,
                                        sink_blocks=sink_blocks, rows=rows, order=scan))]
    out, lse, *parts = pl.pallas_call(
        kernel,
        grid=(n, num_tiles, b),
        in_specs=([q_spec, qp_spec, kv_spec, kv_spec, vp_spec, vp_spec] if poison else [q_spec, kv_spec, kv_spec])
        + [pl.no_block_spec] * len(extra),
        out_specs=[q_spec, lse_spec] + part_specs,
        out_shape=[jax.ShapeDtypeStruct(qg.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, n, tgp), jnp.float32)] + part_shapes,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="qsa_topk",
    )(*((qg, qp, k_in, v_in, kp, vp_in) if poison else (qg, k_in, v_in)), *extra)
    if not parts:
        vals = jnp.full((b, n, tg, top_k), -jnp.inf, jnp.float32)
        ids = jnp.full((b, n, tg, top_k), -1, jnp.int32)
    else:
        vals = jnp.concatenate(parts[0::2], axis=-1)[:, :, :tg]
        ids = jnp.concatenate(parts[1::2], axis=-1)[:, :, :tg]
        vals, ids = topk_lib.finalize(vals, ids, top_k)
    return QSATopKResult(out[:, :tg, :, :d], lse[:, :, :tg], ids, vals)
