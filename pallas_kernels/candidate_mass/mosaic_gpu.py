"""Candidate mass for Hopper (sm90) in Pallas Mosaic GPU.

The wrapper takes every ``stride``-th row of each query block (``rows = query_block / stride``, 64 or 128) and
cuts them into 64-row tiles. One CTA runs two tiles, three warpgroups:

* a producer warpgroup walks each tile's candidate list and brings the listed K blocks into a ring of
  shared-memory stages with TMA (one ring shared by both consumers when their tiles are the two halves of one
  query block, ``rows == 128``; one ring each when they are two query blocks, ``rows == 64``);
* two consumer warpgroups own one tile each (its Q tile stays in shared memory). Per candidate a consumer
  computes ``S = Q K^T`` ``[64, block]`` with wgmma, ``exp2(S * scale - ref_r)`` (float32; masked to 0 for keys
  after the row's position, padding keys and ids out of range; ``ref_r`` the base-2 log-sum-exp of row r's
  gamma group's sampled row) and its row sums: a ``[64]`` row vector, the mass each row puts on the block.
  It writes that vector into row ``c % 64`` of a ``[64, 64]`` float32 tile in shared memory; every 64
  candidates the tile is read back with the candidates as rows and summed over its columns (the query rows),
  which gives the 64 candidates' masses in one reduction within each warp (`_flush`), stored to the output.

With ``rows == 128`` the two halves' masses are separate outputs the wrapper adds. Empty slots (-1) and ids out
of range load block 0 and count nothing. Limits: bf16 / fp16, ``block`` 64 or 128, ``rows`` 64 or 128 (wgmma
tiles of 64 rows), head dims zero-padded to 64 or 128. The Triton kernel (`triton.py`) covers the rest.

The kernel is bound by its K reads (16 KB per candidate for 64 rows), so the wrapper sorts each list by id and the grid
runs the query heads fastest (see `candidate_mass_mosaic_gpu`). Measured (one H100, 2026-11-26,
`tools/candidate_mass_tune.py`, 128k tokens, 28 / 4 heads, 512 random candidates per query block): every 2nd row
37.1 ms, every row 67.2 ms (two candidates per step), against 73.7 / 100.3 ms for the Triton kernel's best tiles;
MOMO's default re-rank at 1M 417 ms with one candidate per step (`bench momo`). A FlashAttention-3 pingpong of the
consumers, Q as a register operand and the lists in shared memory did not make it faster.

Where its time goes (one H200, 2026-11-28, `tools/candidate_mass_tune.py` at 128k with 512 candidates per query block,
`candidate-mass-{exp-dtypes,overlap,poly,fp8}_NVIDIA-H200_2026-11-28.jsonl`): every 2nd row takes 37-39 ms, every
row 68-71 ms, the same K tiles read in both (one ring per query block, or one for the two halves of one), so at
every 2nd row the kernel is bound by those reads (about 6.3 TB/s of K from L2), at every row by its arithmetic.
None of these moved the first: the exponentials as packed bf16 pairs (``ex2.approx.ftz.bf16x2``: 39.5 ms); each
consumer issuing its next ``Q K^T`` before the current step's masses (38.6 against 38.1 ms); 2 / 3 / 4 of every 8
exponentials from a polynomial on the FMA pipes, FlashAttention-4's trick (38.0 / 40.7 / 41.7 against 38.7 ms).
What does: fewer bytes per K block, ``qk_fp8`` (33.2 against 38.4 ms; every row 63.3 against 70.2). Those reads are
not HBM reads: with the 7 query heads of each key head listing the same blocks, so that all but the first read of a
block hit L2 (``--shared-in-group``, `candidate-mass-shared-in-group_NVIDIA-H200_2026-11-28.jsonl`), every 2nd row takes
36.5 against 36.8 ms and every row 67.1 against 67.0. What bounds every 2nd row is moving K from L2 into shared memory
(about 6.4 TB/s) close to its arithmetic (about half of every row's 67 ms), so a walk over the union of a key head's
lists (each K block loaded once for its query heads) would gain at most about 10%.

CPU: the kernel lowers for CUDA on a CPU machine (tests/pallas_kernels/candidate_mass/test_candidate_mass.py);
it runs on a Hopper GPU only (test_candidate_mass_gpu.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import memref, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_fa3 as fa3
from pallas_kernels.tiling import LOG2E, cdiv
from pallas_kernels.tiling import pad_to as _pad_to

WG_ROWS = fa3.WG_ROWS
ROW = fa3.ROW
CHUNK = 64  # candidates per reduction over the rows (the rows of the shared-memory tile)
BLOCKS = (64, 128)
ROWS = (64, 128)  # rows per query block the kernel takes: one or two wgmma tiles
_SMEM_BUDGET = 220 * 1024
_MAX_STAGES = 4


def check_supported(q: jax.Array, *, query_block: int, block: int, stride: int) -> None:
    """The kernel's own limits, as ValueErrors naming the argument (before anything is traced)."""
    fa3.check_q(q)
    if block not in BLOCKS:
        raise ValueError(f"block: expected one of {BLOCKS} for implementation='mosaic_gpu'; received {block}")
    if query_block // stride not in ROWS:
        raise ValueError(f"stride: expected query_block / stride in {ROWS} for implementation='mosaic_gpu' (rows per "
                         f"query block, wgmma tiles of {WG_ROWS}); received stride={stride} with "
                         f"query_block={query_block}")


def stages_for(block: int, head_dim: int, rings: int) -> int:
    """K stages per ring that fit next to the Q tiles and the two mass tiles, in [2, 4]."""
    fixed = 2 * WG_ROWS * head_dim * 2 + 2 * CHUNK * WG_ROWS * 4 + 2 * WG_ROWS * 4
    return max(2, min(_MAX_STAGES, (_SMEM_BUDGET - fixed) // (rings * block * head_dim * 2)))


def _flush(tile_ref, out_ref) -> None:
    """``out[c] = sum_r tile[c, r]`` for a ``[64, 64]`` float32 shared-memory tile written by the warpgroup (row c:
    candidate c's mass per query row) into a ``[64]`` float32 GMEM view. Warpgroup barriers on both sides: the
    tile holds every warp's rows, and is written again after this."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def flush(ctx, tile, out):
        del ctx
        mgpu_utils.warpgroup_barrier()
        x = mgpu_fa.FragmentedArray.load_untiled(tile, layout=mgpu_fa.WGMMA_LAYOUT, optimized=False)
        total = x.reduce("add", 1)  # within each warp: a WGMMA tile's row lives in one quad of lanes
        for (c,), reg in zip(total.layout.thread_idxs(total.shape), total.registers.flat, strict=True):
            if isinstance(reg.type, ir.VectorType):
                reg = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
            memref.store(reg, out, [c])  # the lanes holding one candidate store the same value
        mgpu_utils.warpgroup_barrier()

    flush(tile_ref, out_ref)


def block_sums(x: jax.Array, *, parts: int, block: int) -> tuple[jax.Array, ...]:
    """``exp2(x)`` summed over each block of columns: ``parts`` float32 row vectors ``[64]`` (`ROW`) for a float32
    ``[64, parts * block]`` WGMMA tile (block p: columns ``[p * block, (p + 1) * block)``, register slices of the
    tile rather than masked copies of it)."""
    ret = tuple(plgpu.ShapeDtypeStruct((WG_ROWS,), jnp.float32, layout=ROW) for _ in range(parts))

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=ret)
    def sums(ctx, a):
        del ctx
        e = a.exp2(approx=True)
        return tuple(e[:, p * block:(p + 1) * block].reduce("add", 1) for p in range(parts))

    return sums(x)


def _kernel(q_ref, k_ref, cand_ref, ref_ref, hs_ref, qbs_ref, out_ref, *, block, stages, groups, kv_len, q_offset,
            query_block, stride, num_q_blocks, tiles_per_block, sm_scale, per_step):
    bk = block
    width = per_step * bk  # keys of one step: per_step candidates side by side in one stage
    nk = k_ref.shape[1] // bk
    n_cand = cand_ref.shape[-1]
    split = tiles_per_block == 1  # the two consumers work on two query blocks (two lists, two rings)
    rings = 2 if split else 1
    cta = lax.axis_index("q")
    head = lax.axis_index("heads")
    batch = lax.axis_index("batch")

    def where_is(w):
        """(query block, half of it, in range) of consumer w's tile."""
        tile = cta * 2 + w
        qb = tile // tiles_per_block
        return jnp.minimum(qb, num_q_blocks - 1), tile % tiles_per_block, qb < num_q_blocks

    def entry(w, j):
        """(first key row, id in range) of candidate j of consumer w's list."""
        raw = cand_ref[batch, head, where_is(w)[0], j]
        ok = (raw >= 0) & (raw < nk)
        return jnp.where(ok, raw, 0) * bk, ok

    def body(scoped):
        (q_smem, k_smem, m_smem, r_smem), (k_bar, q_bar), k_free = scoped

        def consumer(wg):
            qb, part, valid = where_is(wg)
            ring = wg if split else 0
            row0 = (cta * 2 + wg) * WG_ROWS  # the tile's first row in the kernel's row order

            @pl.when(valid)
            def _():
                plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, WG_ROWS), head], q_smem.at[wg], q_bar.at[wg])
                plgpu.copy_gmem_to_smem(ref_ref.at[batch, head, pl.ds(row0, WG_ROWS)], r_smem.at[wg], q_bar.at[wg + 2])
                plgpu.barrier_wait(q_bar.at[wg + 2])
                ref = plgpu.load(r_smem.at[wg], (), layout=ROW, optimized=False)  # base 2; +inf: counts nothing
                ref_b = lax.broadcast_in_dim(ref, (WG_ROWS, width), [0])
                cols = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, width), 1, layout=plgpu.Layout.WGMMA)
                plgpu.barrier_wait(q_bar.at[wg])
                scale = hs_ref[batch, head] * (sm_scale * LOG2E)  # hs: the head's fp8 scales (else 1)
                # the tile's first row (qbs: the query block each list belongs to)
                first_pos = qbs_ref[batch, head, qb] * query_block + part * WG_ROWS * stride + q_offset

                def mask(x, starts, limits):
                    """-inf where a key is after the row or past its candidate's limit (candidate p: columns
                    ``[p * bk, (p + 1) * bk)``)."""
                    rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA)
                    k_pos, limit = starts[0] + cols, limits[0]
                    for p in range(1, per_step):
                        k_pos = jnp.where(cols >= p * bk, starts[p] + cols - p * bk, k_pos)
                        limit = jnp.where(cols >= p * bk, limits[p], limit)
                    ok = (k_pos <= first_pos + rows * stride) & (k_pos < limit)
                    return jnp.where(ok, x, -jnp.inf)

                def step(i, carry):
                    slot = ring * stages + lax.rem(i, stages)
                    j = i * per_step  # the step's first candidate
                    starts, limits, need = [], [], False
                    for p in range(per_step):  # before the wait: these loads overlap it
                        start, in_range = entry(wg, j + p)
                        limit = jnp.where(in_range, kv_len, 0)  # an id out of range shows nothing
                        starts.append(start)
                        limits.append(limit)
                        need = need | (start + bk - 1 > first_pos) | (start + bk > limit)
                    plgpu.barrier_wait(k_bar.at[slot])

                    def scores(s_ref):
                        plgpu.wgmma(s_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                        return s_ref[...]

                    s = pl.run_scoped(scores, plgpu.ACC((WG_ROWS, width), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    x = s * scale - ref_b
                    x = lax.cond(need, lambda v: mask(v, starts, limits), lambda v: v, x)
                    c = lax.rem(j, CHUNK)
                    for p, row_mass in enumerate(block_sums(x, parts=per_step, block=bk)):
                        m_smem[wg, c + p] = row_mass

                    @pl.when(c == CHUNK - per_step)
                    def _():
                        _flush(m_smem.at[wg], out_ref.at[batch, head, qb, part, pl.ds(j - c, CHUNK)])

                    return carry

                lax.fori_loop(0, n_cand // per_step, step, jnp.int32(0))

        def producer():
            kv_head = lax.div(head, jnp.array(groups, head.dtype))

            def fetch(w, i, slot):
                """Step i's candidates into one stage (one TMA copy each, all on the stage's barrier)."""
                for p in range(per_step):
                    plgpu.copy_gmem_to_smem(k_ref.at[batch, pl.ds(entry(w, i * per_step + p)[0], bk), kv_head],
                                            k_smem.at[slot, pl.ds(p * bk, bk)], k_bar.at[slot])

            live = [where_is(w)[2] for w in range(rings)]
            for i in range(stages):
                for w in range(rings):
                    pl.when(live[w])(functools.partial(fetch, w, i, w * stages + i))

            @pl.loop(stages, n_cand // per_step)
            def _(j):
                for w in range(rings):
                    @pl.when(live[w])
                    def _():
                        slot = w * stages + lax.rem(j, stages)
                        plgpu.barrier_wait(k_free.at[slot])
                        fetch(w, j, slot)

        fa3.warp_specialized(consumer, producer)

    dp = q_ref.shape[-1]
    n_slots = rings * stages
    # 128-byte rows either way: 64 bf16 / fp16 or 128 fp8 elements per tile row
    transforms = fa3.SMEM_TRANSFORMS if jnp.dtype(q_ref.dtype).itemsize == 2 else (
        plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    pl.run_scoped(
        lambda *scoped: body(scoped),
        (
            plgpu.SMEM((2, WG_ROWS, dp), q_ref.dtype, transforms=transforms),
            plgpu.SMEM((n_slots, width, dp), q_ref.dtype, transforms=transforms),
            plgpu.SMEM((2, CHUNK, WG_ROWS), jnp.float32),
            plgpu.SMEM((2, WG_ROWS), jnp.float32),
        ),
        (plgpu.Barrier(num_arrivals=per_step, num_barriers=n_slots), plgpu.Barrier(num_barriers=4)),
        plgpu.Barrier(num_arrivals=1 if split else 2, num_barriers=n_slots),
        collective_axes="wg",
    )


@functools.partial(jax.jit, static_argnames=("query_block", "block", "stride", "gamma", "sm_scale", "stages",
                                             "sort", "heads_first", "per_step", "qk_fp8"))
def candidate_mass_mosaic_gpu(q: jax.Array, k: jax.Array, candidates: jax.Array, ref_lse: jax.Array, *,
                              query_block: int, block: int, stride: int, gamma: int, sm_scale: float,
                              stages: int | None = None, sort: bool = True, heads_first: bool = True,
                              per_step: int | None = None, qk_fp8: bool = False,
                              query_blocks: jax.Array | None = None) -> jax.Array:
    """Shapes and meaning as in `pallas_kernels.candidate_mass.api.candidate_mass`; inputs assumed validated and
    within `check_supported`. ``stages``: K stages per ring (default `stages_for`).

    ``sort`` (default): each list is walked in ascending id order (the masses are returned in the caller's order).
    The kernel reads a whole K block per candidate for 64 rows, so it is bound by those reads; in id order the CTAs
    that run at the same time (neighbouring query blocks of one head) read nearby blocks at about the same time,
    and most reads hit the L2 cache.

    ``heads_first`` (default): the grid's fastest dimension is the query head, so the CTAs of one query block for
    all heads run at the same time. The query heads of one key head read the same K, and their lists share about
    half their blocks (MOMO at 1M, `bench momo`'s ``union_saving``), which those CTAs then read from L2.

    ``per_step``: candidates per step, side by side in one K stage and one ``[64, per_step * block]`` score tile
    (default 2 for 64-key blocks, else 1): fewer, wider wgmma products (one H100 at 128k: 37.1 / 67.2 ms for every
    2nd row / every row against 38.6 / 71.8 with one per step).

    ``qk_fp8``: the scores from float8 (e4m3) copies of the taken query rows and the keys, each head scaled by its
    largest magnitude (to 448): half the bytes per K block, which is what bounds this kernel at every 2nd row (module
    docstring); head dim 128 only. Masses within 0.6% (median) / 2.4-2.9% (largest) of the bf16 kernel's on random
    inputs; MOMO's re-rank at 1M (`Momo(rerank_fp8=True)`) then captures 0.17 points less on the mixed family.

    ``query_blocks`` (int ``[B, N, M]``, as in the api): the lists are those of these query blocks only; the wrapper
    gathers their rows per head, so the grid runs M lists per head."""
    if per_step is None:
        per_step = 2 if block == 64 else 1
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    nq, c = candidates.shape[2], candidates.shape[3]  # lists (M with query_blocks)
    nq_all = cdiv(t, query_block)
    nk = cdiv(s, block)
    dp = fa3.padded_head_dim(d)
    rows = query_block // stride
    tiles_per_block = rows // WG_ROWS
    ctas = cdiv(nq * tiles_per_block, 2)
    rows_pad = ctas * 2 * WG_ROWS
    t_pad = nq_all * query_block
    if query_blocks is None:
        qbs = jnp.broadcast_to(jnp.arange(nq, dtype=jnp.int32), (b, n, nq))
        idx = jnp.arange(0, t_pad, stride, dtype=jnp.int32)[None, None]  # the rows taken, [1, 1, nq * rows]
        q_sub = _pad_to(q, 1, t_pad)[:, idx[0, 0]]
    else:  # each head's lists' rows, in list order
        qbs = jnp.clip(query_blocks.astype(jnp.int32), 0, nq_all - 1)
        idx = (qbs[..., None] * query_block + jnp.arange(0, query_block, stride, dtype=jnp.int32)).reshape(
            b, n, nq * rows)
        q_sub = _pad_to(q, 1, t_pad)[jnp.arange(b)[:, None, None], jnp.swapaxes(idx, 1, 2),
                                      jnp.arange(n)[None, None, :]]  # [B, nq * rows, N, D]
    q_sub = _pad_to(_pad_to(q_sub, 3, dp), 1, rows_pad)  # [B, rows_pad, N, Dp]
    k_in = _pad_to(_pad_to(k, 3, dp), 1, nk * block)
    ref = jnp.pad(ref_lse.astype(jnp.float32), ((0, 0), (0, 0), (0, t_pad // gamma + 1)), constant_values=-jnp.inf)
    ref = jnp.take_along_axis(ref, jnp.broadcast_to(idx // gamma, (b, n, idx.shape[-1])), axis=-1)  # [B, N, nq*rows]
    ref = jnp.where((ref == -jnp.inf) | (idx >= t), jnp.inf, ref * LOG2E)  # +inf: the row counts nothing
    ref = jnp.pad(ref, ((0, 0), (0, 0), (0, rows_pad - nq * rows)), constant_values=jnp.inf)
    c_pad = cdiv(c, CHUNK) * CHUNK
    cand = candidates.astype(jnp.int32)
    if sort:  # ids in range first, ascending; the rest (empty slots) after them
        order = jnp.argsort(jnp.where((cand >= 0) & (cand < nk), cand, nk), axis=-1)
        cand = jnp.take_along_axis(cand, order, axis=-1)
    cand = jnp.pad(cand, ((0, 0), (0, 0), (0, 0), (0, c_pad - c)), constant_values=-1)
    rings = 1 if tiles_per_block == 2 else 2
    kernel = plgpu.kernel(
        functools.partial(_kernel, block=block, stages=stages or stages_for(per_step * block, dp, rings),
                          groups=n // kh, per_step=per_step,
                          kv_len=s, q_offset=s - t, query_block=query_block, stride=stride, num_q_blocks=nq,
                          tiles_per_block=tiles_per_block, sm_scale=sm_scale),
        out_type=jax.ShapeDtypeStruct((b, n, nq, tiles_per_block, c_pad), jnp.float32),
        grid=(n, ctas, b) if heads_first else (ctas, n, b),
        grid_names=("heads", "q", "batch") if heads_first else ("q", "heads", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    hs = jnp.ones((b, n), jnp.float32)
    if qk_fp8:
        if dp != 128:
            raise ValueError(f"qk_fp8: expected head dim 128 (128-byte fp8 rows); received {d}")
        fmax = float(jnp.finfo(jnp.float8_e4m3fn).max)
        sq = jnp.max(jnp.abs(q_sub.astype(jnp.float32)), axis=(1, 3)) / fmax  # [B, N]
        sk = jnp.max(jnp.abs(k_in.astype(jnp.float32)), axis=(1, 3)) / fmax  # [B, K]
        sq, sk = jnp.where(sq > 0, sq, 1.0), jnp.where(sk > 0, sk, 1.0)
        q_sub = (q_sub.astype(jnp.float32) / sq[:, None, :, None]).astype(jnp.float8_e4m3fn)
        k_in = (k_in.astype(jnp.float32) / sk[:, None, :, None]).astype(jnp.float8_e4m3fn)
        hs = sq * jnp.repeat(sk, n // kh, axis=1)
    mass = kernel(q_sub, k_in, cand, ref, hs, qbs).sum(axis=3)[..., :c]
    if sort:  # back to the caller's order
        mass = jnp.put_along_axis(jnp.zeros_like(mass), order, mass, axis=-1, inplace=False)
    return mass
