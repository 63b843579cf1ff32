"""Fused query-sparse attention + online block top-k for Hopper (sm90) in Pallas Mosaic GPU.

One CTA per (128 sampled rows, query head, batch), three warpgroups as in the block-sparse Mosaic kernel
(`pallas_kernels.block_sparse.mosaic_kernel`): a producer warpgroup brings every key block the CTA's last row
may see into a ring of K/V stages with TMA, in the scan order (the golden orders: the golden-ratio
permutation of `common.scan_table` with ``rows=128``, shared by the two consumers so each tile is loaded
once); two consumer warpgroups own 64 sampled rows each. Per tile a consumer computes ``S = Q K^T`` with
wgmma, masks it on positions where needed (row r of the CTA sits at ``(cta * 128 + r) * gamma + S - T``),
updates the online softmax, writes the block score ``S(j) = logsumexp`` of the block's scaled logits (from the
same ``P``: ``m + log2(sum P)``) to a shared-memory ring of ``stages + 1`` slots (a score row per block of the
tile), and issues ``O += P V``.

The top-k runs on the producer warpgroup, one sampled row per thread (`PRODUCER_TILE`: a row's slots sit in
its thread's registers, so `topk`'s row reductions need no shuffles): after it has issued the loads of step i
and seen the consumers release step ``i - stages`` (their V-stage arrival, which follows the score write), it
offers that step's 128 scores to the rows' "estimated" top-k (`topk.estimated_step`) and stores the accepted
items straight to the output (`scatter_rows`), as the Triton kernel does. A consumer is at most ``stages``
steps ahead of the producer (it waits for the K tile of its step), so the ring needs no barrier of its own.
Before, the consumers ran the top-k on their own rows between the softmax and ``P V``, four threads per row:
that work sat on the path between the two consumers' matrix products.

Key tiles: with ``scan="golden_pairs"`` (MOMO's default) or ``"natural"`` and 64-key blocks, a step reads 128
contiguous keys, two scored blocks (`tile_parts`): one ``S = Q K^T`` of 128 columns, one softmax rescale of O,
half the barriers; the softmax keeps each half's row max and sum (`mosaic_fa3.softmax_step(parts=2)`), the
consumers write two score rows per step and the producer offers both, in scan position order. With
``scan="golden"`` the blocks of a step are not neighbours and the tiles stay 64 keys.

Semantics: those of `qsa_topk_reference(..., topk="estimated", rows=128)` on finite inputs (the wrapper,
`qsa_topk(implementation="mosaic_gpu")`, hands inputs holding a NaN / inf to the Triton kernel with the same tiles).
The consumers run the FlashAttention-3 pieces of `pallas_kernels.mosaic_fa3`.

Measured (H100, 2026-11-26, 28 heads / 4 kv heads, D=128, gamma 16, k 128, `tools/qsa_topk_ablation.py --variants
base`, this kernel and the one before it in one call): 1.20 s at 1M tokens against 1.43 s with the top-k on the
consumers (Triton: 2.22 s), and 21.0 ms at 128k against 25.9 ms. 128-key tiles (another call, same tool and
card; "golden_pairs scan" / "natural scan" against "base" = "golden"): 1.029 / 1.000 s against 1.198 s at 1M,
18.1 / 18.0 ms against 20.8 ms at 128k. Tried and dropped (one call, H100): the grid with query heads fastest
(1.249 s against 1.208 s with row tiles fastest: the row tiles of a head that share one golden order read the same
tiles from L2 at the same time), 3 or 5 stages (with that grid: 1.330 / 1.277 s against 1.249 s). The attention
alone (no top-k) takes 1.10 s / 17 ms with 64-key tiles (`tools/qsa_mosaic_ceiling.py`). ptxas: no spills
(consumers 200 registers per thread, producer 104). CPU: the kernel lowers for CUDA
(tests/pallas_kernels/qsa_topk/test_qsa_topk_mosaic.py); it runs on a Hopper GPU only (test_qsa_topk_gpu.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, scf, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_fa3 as fa3
from pallas_kernels.block_sparse.mosaic_options import default_stages
from pallas_kernels.qsa_topk import topk as topk_lib
from pallas_kernels.qsa_topk.common import QSATopKResult, scan_table, scan_unit, scanned_block
from pallas_kernels.tiling import LN2, LOG2E, cdiv
from pallas_kernels.tiling import pad_to as _pad_to

TILE = 128  # sampled rows per CTA
WG_ROWS = fa3.WG_ROWS
ROW = fa3.ROW


BLOCK_KVS = (64, 128)
TILE_KEYS = 128  # keys per step where the scan order allows (contiguous neighbouring blocks)


def tile_parts(scan: str, block_kv: int) -> int:
    """Scored blocks per key tile (step): ``TILE_KEYS / block_kv`` where neighbouring blocks are offered one after
    the other ("natural", and "golden_pairs" with 64-key blocks), 1 with "golden" (module docstring)."""
    return 1 if scan == "golden" else TILE_KEYS // block_kv


def check_supported(q: jax.Array, *, topk: str, block_kv: int, k_exact: int, rows: int, scan: str) -> None:
    """The Mosaic GPU kernel's own limits, as ValueErrors naming the argument (before anything is traced)."""
    if topk != "estimated":
        raise ValueError(f"topk: expected 'estimated' for implementation='mosaic_gpu'; received {topk!r}")
    fa3.check_q(q)
    if block_kv not in BLOCK_KVS:
        raise ValueError(f"block_kv: expected one of {BLOCK_KVS} for implementation='mosaic_gpu'; received {block_kv}")
    if scan == "golden_pairs" and block_kv != TILE_KEYS // 2:
        raise ValueError(f"scan: 'golden_pairs' takes block_kv={TILE_KEYS // 2} for implementation='mosaic_gpu' (a "
                         f"pair is one {TILE_KEYS}-key tile); received block_kv={block_kv}")
    if k_exact < 8 or k_exact % 8:
        raise ValueError(f"k_exact: expected a positive multiple of 8 for implementation='mosaic_gpu' (its exact slots "
                         f"are a [64, k_exact] wgmma-layout array); received {k_exact}")
    if rows != TILE:
        raise ValueError(f"rows: expected {TILE} for implementation='mosaic_gpu' (its tile of sampled rows, which the "
                         f"golden scan order depends on); received {rows}")


# The producer warpgroup runs the top-k with one sampled row per thread: a ``[128, w]`` array holds a row's w slots
# in w registers of its thread (`PRODUCER_TILE`), a ``[128]`` vector one register (`PRODUCER_ROW`), so the row
# reductions of `topk` stay inside a thread.
PRODUCER_TILE = plgpu.Layout.TILED(plgpu.Tiling(((TILE, 1), (32, 1))), warp_dims=(-4,), lane_dims=(-2,),
                                   vector_dim=-1)
PRODUCER_ROW = PRODUCER_TILE.reduce(1)
# Registers per thread: the consumers hold no top-k state, the producer holds 128 rows' (exact slots, histogram,
# statistics: about 45 registers) next to its TMA loop.
CONSUMER_REGISTERS = 200
PRODUCER_REGISTERS = 104


def _first(reg):
    """The element of a one-element register (Mosaic GPU keeps row-vector registers as ``vector<1x...>``)."""
    if isinstance(reg.type, ir.VectorType):
        if ir.VectorType(reg.type).shape != [1]:
            raise NotImplementedError(f"scatter_rows: expected one element per register; got {reg.type}")
        return vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
    return reg


def scatter_rows(targets, slots, accept):
    """``ref[r, slots[r]] = values[r]`` where ``accept[r]``, for each ``(ref, values)`` of ``targets``: row vectors
    of the producer's 128 rows (`PRODUCER_ROW`, one per thread); each ``ref`` a ``[128, width]`` view (GMEM).
    A thread whose row accepts stores its items behind one branch."""
    refs = [r for r, _ in targets]
    n = len(refs)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * n + (PRODUCER_ROW,) * (n + 2))
    def store(ctx, *args):
        del ctx
        outs, vals, (s, a) = args[:n], args[n:2 * n], args[2 * n:]
        [(row,)] = list(s.layout.thread_idxs(s.shape))  # one row per thread
        ra = _first(a.registers.flat[0])
        branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ne, ra, arith.constant(ra.type, 0)))
        with ir.InsertionPoint(branch.then_block):
            col = arith.index_cast(ir.IndexType.get(), _first(s.registers.flat[0]))
            for out, v in zip(outs, vals, strict=True):
                memref.store(_first(v.registers.flat[0]), out, [row, col])
            scf.yield_([])

    # inline_mgpu takes the registers as they are: a splat (e.g. jnp.zeros) must be laid out first.
    row_vectors = [v for _, v in targets] + [slots, accept.astype(jnp.int32)]
    store(*refs, *(plgpu.layout_cast(x, PRODUCER_ROW) for x in row_vectors))


def load_rows(ref):
    """``ref[...]`` of a ``[128]`` float32 SMEM view as a `PRODUCER_ROW` vector (each thread loads its row)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((TILE,), jnp.float32, PRODUCER_ROW))
    def load(ctx, src):
        del ctx
        layout = PRODUCER_ROW.to_mgpu()
        reg_type = ir.VectorType.get([1], ir.F32Type.get())
        regs = [vector.broadcast(reg_type, memref.load(src, [row])) for (row,) in layout.thread_idxs((TILE,))]
        return mgpu.FragmentedArray(_registers=np.array(regs, dtype=object).reshape(layout.registers_shape((TILE,))),
                                    _layout=layout, _is_signed=None)

    return load(ref)


def store_tile(ref, values):
    """``ref[...] = values`` for a ``[128, w]`` `PRODUCER_TILE` array (each thread stores its row)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), PRODUCER_TILE))
    def store(ctx, out, v):
        del ctx
        v.foreach(lambda val, idx: memref.store(val, out, list(idx)))

    store(ref, values)


def _kernel(q_ref, k_ref, v_ref, scan_ref, out_ref, lse_ref, ev_ref, ei_ref, sv_ref, si_ref, cnt_ref, *,
            gamma, block_kv, parts, stages, groups, kv_len, q_offset, tg, top_k, k_exact, sink_blocks, local,
            sm_scale, unit, quantile):
    bk = block_kv * parts  # keys per tile (step); each tile holds `parts` scored blocks of block_kv keys
    dp = q_ref.shape[-1]
    dtype = q_ref.dtype
    ctas = q_ref.shape[1] // TILE
    nk = k_ref.shape[1] // block_kv
    cta = ctas - 1 - lax.axis_index("q")  # longest causal rows start first
    head = lax.axis_index("heads")
    batch = lax.axis_index("batch")
    last_row = jnp.minimum((cta + 1) * TILE, tg) - 1
    n_blocks = jnp.minimum(nk, (last_row * gamma + q_offset) // block_kv + 1)  # scored blocks the CTA may see
    n_steps = (n_blocks + parts - 1) // parts  # tiles
    score_slots = stages + 1  # the score ring: a consumer can be at most `stages` steps ahead of the producer
    if unit:
        span, mult = scan_ref[cta, 0], scan_ref[cta, 1]

    def block_at(j):
        """Key block offered at scan position j (golden orders: a permutation of the first candidates in units of
        `unit` blocks, `common.py`); tile i holds the blocks of positions ``parts * i .. parts * i + parts - 1``,
        contiguous since a unit is ``parts`` blocks."""
        return scanned_block(j, span, mult, sink_blocks=sink_blocks, unit=unit) if unit else j

    def body(scoped):
        (qo_smem, k_smem, v_smem, lse_smem, score_smem), (k_bar, v_bar, q_bar), (k_free, v_free), sched = scoped
        schedule = functools.partial(fa3.schedule, sched)

        def consumer(wg):
            q_smem, l_smem = qo_smem.at[wg], lse_smem.at[wg]
            row0 = cta * TILE + wg * WG_ROWS
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, WG_ROWS), head], q_smem, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            scale = sm_scale * LOG2E
            first_pos = row0 * gamma + q_offset

            def mask(s, start):
                rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                k_pos = start + cols
                ok = (k_pos <= (row0 + rows) * gamma + q_offset) & (k_pos < kv_len)
                return jnp.where(ok, s, -jnp.inf)

            def step(i, carry):
                acc, m, l = carry
                slot = lax.rem(i, stages)
                start = block_at(parts * i) * block_kv

                s = fa3.qk(q_smem, k_smem.at[slot], sched, bk)
                plgpu.barrier_arrive(k_free.at[slot])
                need = (start + bk - 1 > first_pos) | (start + bk > kv_len)
                s = lax.cond(need, lambda x: mask(x, start), lambda x: x, s)
                sm = fa3.softmax_step(s, m, l, acc, scale=scale, dtype=dtype, parts=parts)
                plgpu.barrier_arrive(sched)  # softmax done
                # The blocks' scores (natural log) for the producer's top-k, released with this step's V stage.
                # A sum is relative to the running max; a block so far below it that the sum underflows
                # (> ~100 nats: no mass) scores its own max, a finite lower bound (the running statistics take
                # no -inf).
                for h in range(parts):
                    under = sm.part_sum[h] == 0.0
                    score = jnp.where(under, sm.part_max[h],
                                      sm.m_use + jnp.log2(jnp.where(under, 1.0, sm.part_sum[h]))) * LN2
                    score_smem.at[lax.rem(i, score_slots), h, pl.ds(wg * WG_ROWS, WG_ROWS)][...] = score
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_wait(sched)  # the tensor cores are ours

                def wait_next_k():
                    pl.when(i + 1 < n_steps)(lambda: plgpu.barrier_wait(k_bar.at[lax.rem(i + 1, stages)]))

                acc = fa3.pv(sm.acc, sm.p, v_smem.at[slot], wait_next_k)
                plgpu.barrier_arrive(v_free.at[slot])  # also releases this step's scores to the producer
                return acc, sm.m, sm.l

            acc, m, l = fa3.init_rows(dp)

            @pl.when(n_steps > 0)
            def _():
                plgpu.barrier_wait(k_bar.at[0])

            pl.when(wg == 1)(schedule)  # the two consumers run half a step apart
            acc, m, l = lax.fori_loop(0, n_steps, step, (acc, m, l))
            pl.when(wg == 0)(schedule)

            fa3.write_rows(acc, m, l, q_smem, l_smem, out_ref.at[batch, pl.ds(row0, WG_ROWS), head],
                           lse_ref.at[batch, head, pl.ds(row0, WG_ROWS)], dtype)
            plgpu.wait_smem_to_gmem(0)

        def producer():
            kv_head = lax.div(head, jnp.array(groups, head.dtype))
            row0 = cta * TILE
            rows_v = plgpu.broadcasted_iota(jnp.int32, (TILE,), 0, layout=PRODUCER_ROW)
            pos = (row0 + rows_v) * gamma + q_offset  # [128] positions of the rows
            lo = jnp.maximum(pos - local, 0) // block_kv  # candidates: sink_blocks <= j < lo (common.py)
            sv_view = sv_ref.at[batch, head, pl.ds(row0, TILE)]
            si_view = si_ref.at[batch, head, pl.ds(row0, TILE)]

            def fetch(ref, smem, bar, start, slot):
                """The K or V tile of the keys from ``start`` into stage ``slot``."""
                plgpu.copy_gmem_to_smem(ref.at[batch, pl.ds(start, bk), kv_head], smem.at[slot], bar.at[slot])

            def offer(i, state):
                """Step i's block scores (released by the consumers' v_free arrival) to the rows' top-k, in scan
                position order."""
                for h in range(parts):
                    j = parts * i + h
                    score = load_rows(score_smem.at[lax.rem(i, score_slots), h])
                    active = (j >= sink_blocks) & (j < lo)
                    state, (accept, sv, si, cnt) = topk_lib.estimated_step(
                        state, score, block_at(j), active, lo - j, k=top_k, k_exact=k_exact, step=j)
                    scatter_rows([(sv_view, sv), (si_view, si)], cnt, accept)
                return state

            for i in range(stages):
                @pl.when(i < n_steps)
                def _():
                    start = block_at(parts * i) * block_kv
                    fetch(k_ref, k_smem, k_bar, start, i)
                    fetch(v_ref, v_smem, v_bar, start, i)

            def fetch_and_offer(i, state):
                slot = lax.rem(i, stages)
                start = block_at(parts * i) * block_kv
                plgpu.barrier_wait(k_free.at[slot])
                fetch(k_ref, k_smem, k_bar, start, slot)
                plgpu.barrier_wait(v_free.at[slot])  # the consumers are done with step i - stages
                fetch(v_ref, v_smem, v_bar, start, slot)
                return offer(i - stages, state)

            def drain(i, state):
                plgpu.barrier_wait(v_free.at[lax.rem(i, stages)])
                return offer(i, state)

            state = topk_lib.estimated_init(TILE, top_k, k_exact, buffers=False, quantile=quantile)
            state = jax.tree.map(lambda x: plgpu.layout_cast(x, PRODUCER_ROW if x.ndim == 1 else PRODUCER_TILE),
                                 state)
            state = lax.fori_loop(stages, jnp.maximum(n_steps, stages), fetch_and_offer, state)
            state = lax.fori_loop(jnp.maximum(n_steps - stages, 0), n_steps, drain, state)

            (ev, ei), _ = topk_lib.estimated_result(state, k_exact)
            store_tile(ev_ref.at[batch, head, pl.ds(row0, TILE)], ev)
            store_tile(ei_ref.at[batch, head, pl.ds(row0, TILE)], ei)
            scatter_rows([(cnt_ref.at[batch, head, pl.ds(row0, TILE)], state.count)],
                         jnp.zeros((TILE,), jnp.int32), rows_v >= 0)

        fa3.warp_specialized(consumer, producer, consumer_registers=CONSUMER_REGISTERS,
                             producer_registers=PRODUCER_REGISTERS)

    transforms = fa3.SMEM_TRANSFORMS

    def traced(*scoped):
        # Rows are offered finite scores at every step from sink_blocks to their last candidate (finite inputs:
        # the wrapper hands other inputs to Triton), which lets the histogram count skip un-hashed blocks.
        with topk_lib.mosaic_tracing(lambda dtype, shape, dim: plgpu.broadcasted_iota(dtype, shape, dim,
                                                                                      layout=PRODUCER_TILE),
                                     first_active_step=sink_blocks):
            body(scoped)

    pl.run_scoped(
        traced,
        (
            plgpu.SMEM((2, WG_ROWS, dp), dtype, transforms=transforms),
            plgpu.SMEM((stages, bk, dp), dtype, transforms=transforms),
            plgpu.SMEM((stages, bk, dp), dtype, transforms=transforms),
            plgpu.SMEM((2, WG_ROWS), jnp.float32),
            plgpu.SMEM((score_slots, parts, TILE), jnp.float32),
        ),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=2)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg",
    )


@functools.partial(jax.jit, static_argnames=("gamma", "block_kv", "top_k", "k_exact", "sink_blocks", "local",
                                             "sm_scale", "scan", "quantile", "stages"))
def qsa_topk_mosaic_gpu(q, k, v, *, gamma: int, block_kv: int, top_k: int, k_exact: int, sink_blocks: int,
                        local: int, sm_scale: float, scan: str = "golden", quantile: str = "histogram",
                        stages: int | None = None) -> QSATopKResult:
    """`qsa_topk` with ``topk="estimated"`` on Hopper (see the module docstring); finite bf16 / fp16 inputs,
    ``D <= 128``, ``k_exact`` a multiple of 8 (its slots are a [64, k_exact] wgmma-layout array)."""
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    tg = cdiv(t, gamma)
    ctas = cdiv(tg, TILE)
    parts = tile_parts(scan, block_kv)
    keys = cdiv(s, block_kv * parts) * block_kv * parts  # whole tiles
    dp = fa3.padded_head_dim(d)
    qg = _pad_to(_pad_to(q[:, ::gamma], 3, dp), 1, ctas * TILE)
    k_in = _pad_to(_pad_to(k, 3, dp), 1, keys)
    v_in = _pad_to(_pad_to(v, 3, dp), 1, keys)
    table = jnp.asarray(scan_table(t, s, gamma=gamma, block_kv=block_kv, local=local, sink_blocks=sink_blocks,
                                   rows=TILE, order=scan))
    tgp = ctas * TILE
    stages = stages or default_stages(block_kv * parts, dp)
    ke = topk_lib.next_pow2(max(k_exact, 1))
    kest = topk_lib.next_pow2(max(top_k - k_exact, 1))
    kernel = plgpu.kernel(
        functools.partial(_kernel, gamma=gamma, block_kv=block_kv, parts=parts, stages=stages, groups=n // kh,
                          kv_len=s, q_offset=s - t, tg=tg, top_k=top_k, k_exact=k_exact, sink_blocks=sink_blocks,
                          local=local, sm_scale=sm_scale, unit=scan_unit(scan),
                          quantile=quantile),
        out_type=(jax.ShapeDtypeStruct(qg.shape, q.dtype), jax.ShapeDtypeStruct((b, n, tgp), jnp.float32),
                  jax.ShapeDtypeStruct((b, n, tgp, ke), jnp.float32), jax.ShapeDtypeStruct((b, n, tgp, ke), jnp.int32),
                  jax.ShapeDtypeStruct((b, n, tgp, kest), jnp.float32),
                  jax.ShapeDtypeStruct((b, n, tgp, kest), jnp.int32),
                  jax.ShapeDtypeStruct((b, n, tgp, 1), jnp.int32)),
        grid=(ctas, n, b),
        grid_names=("q", "heads", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    out, lse, ev, ei, sv, si, cnt = kernel(qg, k_in, v_in, table)
    slot = jnp.arange(kest, dtype=jnp.int32)
    filled = slot < cnt
    sv = jnp.where(filled, sv, jnp.where(slot < top_k - k_exact, -jnp.inf, jnp.inf))
    si = jnp.where(filled, si, -1 - slot)
    vals = jnp.concatenate([ev, sv], axis=-1)[:, :, :tg]
    ids = jnp.concatenate([ei, si], axis=-1)[:, :, :tg]
    vals, ids = topk_lib.finalize(vals, ids, top_k)
    return QSATopKResult(out[:, :tg, :, :d], lse[:, :, :tg], ids, vals)
