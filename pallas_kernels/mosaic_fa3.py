"""The skeleton of a FlashAttention-3 style Hopper kernel in Pallas Mosaic GPU, shared by the block-sparse
attention (`pallas_kernels.block_sparse.mosaic_kernel`) and the fused query-sparse attention + top-k
(`pallas_kernels.qsa_topk.mosaic_gpu`).

`warp_specialized` runs the kernel's consumer on warpgroups 0 and 1 and its TMA producer on warpgroup 2. Two
consumer warpgroups own 64 query rows each and alternate on a "schedule" barrier of two arrivals: one runs
its softmax while the other's matrix products use the tensor cores. Per key tile a consumer calls `qk` (``S = Q
K^T`` by wgmma, then the handshake that hands the tensor cores over), masks S itself, calls `softmax_step`
(online softmax in base 2 with float32 statistics in registers), arrives on the schedule barrier, waits for its
V tile and for the barrier, and calls `pv` (``O += P V`` with P from registers). `write_rows` normalises the rows
at the end and stores them with TMA. Shapes: S and P ``[64, block_k]``, O ``[64, Dp]`` (WGMMA layout), row
statistics ``[64]`` (layout `ROW`).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.tiling import LN2, cdiv

R = TypeVar("R")
WG_ROWS = 64  # query rows per consumer warpgroup
ROW = plgpu.Layout.WGMMA.reduce(1)  # a value per row of a WGMMA-layout tile
SMEM_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # Q / K / V / O tiles


DTYPES = (jnp.bfloat16, jnp.float16)  # of q / k / v in every Mosaic kernel
MAX_HEAD_DIM = 128  # larger D (acc registers, fewer stages) is not measured on a GPU yet


def check_q(q: jax.Array) -> None:
    """The dtype and head dim every Mosaic kernel takes, as ValueErrors naming ``q``."""
    if jnp.dtype(q.dtype) not in map(jnp.dtype, DTYPES):
        raise ValueError(f"q: expected dtype bfloat16 or float16 for implementation='mosaic_gpu'; received {q.dtype}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"q: expected head dim D <= {MAX_HEAD_DIM} for implementation='mosaic_gpu'; received shape "
                         f"{tuple(q.shape)}")


CONSUMER_REGISTERS = 232  # per thread of a consumer warpgroup (O, S / P and the row statistics live in registers)
PRODUCER_REGISTERS = 40  # per thread of the TMA producer warpgroup


def padded_head_dim(d: int) -> int:
    """The head dim zero-padded to a multiple of 64, at least 64: the width of the Q / K / V / O tiles (rows of
    128 bytes in bf16, the swizzle `SMEM_TRANSFORMS` names)."""
    return cdiv(max(d, 64), 64) * 64


def warp_specialized(consumer: Callable[[jax.Array], None], producer: Callable[[], None], *,
                     consumer_registers: int = CONSUMER_REGISTERS, producer_registers: int = PRODUCER_REGISTERS) -> None:
    """Run ``consumer(wg)`` on warpgroups 0 and 1 and ``producer()`` on warpgroup 2 (the kernel's ``thread_name`` is
    "wg", three threads), moving registers from the producer to the consumers first (per thread; multiples of 8
    with ``2 * consumer + producer <= 512``, the register file of a multiprocessor over 128 threads)."""
    if 2 * consumer_registers + producer_registers > 512:
        raise ValueError(f"registers: 2 * {consumer_registers} + {producer_registers} exceeds 512 per thread")
    wg = lax.axis_index("wg")

    @pl.when(wg < 2)
    def _():
        plgpu.set_max_registers(consumer_registers, action="increase")
        consumer(wg)

    @pl.when(wg == 2)
    def _():
        plgpu.set_max_registers(producer_registers, action="decrease")
        producer()


def schedule(sched) -> None:
    """Arrive on the schedule barrier and wait for the other consumer."""
    plgpu.barrier_arrive(sched)
    plgpu.barrier_wait(sched)


def init_rows(head_dim: int, sum_columns: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(O ``[64, head_dim]`` zeros, running max m ``[64]`` -inf, running sum l zeros), float32. l is ``[64]``, or
    with ``sum_columns`` (8) ``[64, 8]`` column partials (WGMMA layout) that `softmax_step` adds without reducing
    across threads; `row_sums` reduces them once at the end."""
    acc = plgpu.layout_cast(jnp.full((WG_ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), ROW)
    if sum_columns:
        l = plgpu.layout_cast(jnp.full((WG_ROWS, sum_columns), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    else:
        l = plgpu.layout_cast(jnp.full((WG_ROWS,), 0.0, jnp.float32), ROW)
    return acc, m, l


def row_sums(l: jax.Array) -> jax.Array:
    """The running sum ``[64]`` of l as `init_rows` made it (``[64]``, or ``[64, c]`` column partials)."""
    return l.sum(axis=1) if l.ndim == 2 else l


def qk(q_smem, k_tile, sched, block_k: int) -> jax.Array:
    """``S = Q K^T`` float32 ``[64, block_k]`` from the consumer's Q tile and a K tile ``[block_k, Dp]`` in shared
    memory; the schedule handshake (unless ``sched`` is None) runs while the product is in flight."""

    def scope(s_ref):
        plgpu.wgmma(s_ref, q_smem, k_tile.transpose((1, 0)))
        if sched is not None:
            with jax.named_scope("sched"):  # a profiler range when the kernel is profiled
                schedule(sched)
        return s_ref[...]

    return pl.run_scoped(scope, plgpu.ACC((WG_ROWS, block_k), jnp.float32))


class SoftmaxStep(NamedTuple):
    acc: jax.Array | None  # O rescaled to the new max (None when the step was given no O)
    m: jax.Array  # running max (base 2, scaled)
    l: jax.Array  # running sum relative to m_use
    p: jax.Array  # P = exp2(S * scale - m_use) in the kernel's dtype, for `pv`
    block_max: jax.Array  # the tile's own row max (base 2, scaled); -inf for a fully masked row
    block_sum: jax.Array | None  # the tile's row sum of P (relative to m_use); None with column partials l
    m_use: jax.Array  # the shift P is relative to (0 where every key so far is masked)
    part_max: tuple[jax.Array, ...]  # block_max of each of the ``parts`` equal key ranges of the tile
    part_sum: tuple[jax.Array, ...] | None  # block_sum of each of them
    alpha: jax.Array  # the factor O (and l) are rescaled by: exp2(m_old - m_use)


def softmax_step(s: jax.Array, m: jax.Array, l: jax.Array, acc: jax.Array | None, *, scale: float,
                 dtype, parts: int = 1) -> SoftmaxStep:
    """One tile of the online softmax: ``s`` the masked logits (``-inf`` where masked), ``scale`` = sm_scale *
    log2(e). ``parts``: the row max and sum are also kept per equal key range of the tile (``parts`` of
    ``block_k / parts >= 8`` keys, e.g. two 64-key blocks of a 128-key tile), reduced range by range.
    ``acc`` None: O is not rescaled here (it is in flight in a ``P V`` product, `qk_then_pv`); the caller
    multiplies it by ``alpha`` once the product is done."""
    width = s.shape[1] // parts

    def split(x):
        return [x[:, h * width:(h + 1) * width] for h in range(parts)] if parts > 1 else [x]

    with jax.named_scope("max"):  # named regions: profiler ranges when the kernel is profiled
        part_max = tuple(x.max(axis=1) * scale for x in split(s))
        block_max = functools.reduce(jnp.maximum, part_max)
        m_new = jnp.maximum(m, block_max)
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # fully masked so far: no shift
        alpha = jnp.exp2(m - m_use)
    with jax.named_scope("exp"):
        p = jnp.exp2(s * scale - by_row(m_use, s.shape))
    if acc is not None:
        with jax.named_scope("rescale"):
            acc = acc * by_row(alpha, acc.shape)
    with jax.named_scope("sum"):
        if l.ndim == 2:  # column partials (`init_rows`): P's column slices added, no reduction across threads
            c = l.shape[1]
            part_sum = block_sum = None
            l = l * by_row(alpha, l.shape) + functools.reduce(
                jnp.add, [p[:, i * c:(i + 1) * c] for i in range(p.shape[1] // c)])
        else:
            part_sum = tuple(x.sum(axis=1) for x in split(p))
            block_sum = functools.reduce(jnp.add, part_sum)
            l = l * alpha + block_sum
    with jax.named_scope("cvt"):
        p16 = p.astype(dtype)
    if acc is None:
        l, m_new, p16, alpha = lax.optimization_barrier((l, m_new, p16, alpha))
    else:
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
    return SoftmaxStep(acc, m_new, l, p16, block_max, block_sum, m_use, part_max, part_sum, alpha)


def by_row(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """A value per row, x ``[64]`` (layout `ROW`), broadcast to ``shape`` ``[64, n]`` (WGMMA layout)."""
    return lax.broadcast_in_dim(x, shape, [0])


def qk_then_pv(acc: jax.Array, p: jax.Array, v_tile, q_smem, k_tile, block_k: int, work: Callable[[jax.Array], R],
               sched=None, s_loaded: Callable[[], None] | None = None) -> tuple[jax.Array, R]:
    """FlashAttention-3's intra-warpgroup overlap in its paper's order (Algorithm 2): issue the next step's ``S = Q
    K^T`` (K tile ``[block_k, Dp]``), then this step's ``O += P V`` (P ``[64, keys]`` from registers, V tile ``[keys,
    Dp]``); wait for S alone and run ``work(S)`` (the next step's mask and softmax) while ``P V`` is on the tensor
    cores. ``s_loaded()`` runs once S is in registers (e.g. freeing the K stage), ``sched``: the schedule handshake
    once both products are issued. Returns (``O + P V``, ``work(S)``).

    LLVM does not know that wgmma reads its register operands asynchronously; ptxas serialises every wgmma of
    the kernel (note C7513) if an instruction writes a register of P (or of O) between the first product's issue
    and the wait. Two rules keep it asynchronous (`tools/mosaic_ptxas_report.py --ptx` finds such writes):
    P is not used after the wait (Mosaic's fence on a register operand then copies it in place of the product,
    after ``Q K^T`` was issued), and ``work``'s new P must not become the caller's P register: a loop carrying P
    runs two steps an iteration, and a step's P is not returned through a ``lax.cond`` (see the block-sparse
    kernel's ``overlapped``)."""

    def scope(acc_ref, s_ref):
        acc_ref[...] = acc
        plgpu.wgmma(s_ref, q_smem, k_tile.transpose((1, 0)))
        plgpu.wgmma(acc_ref, p, v_tile)
        if sched is not None:
            with jax.named_scope("sched"):
                schedule(sched)
        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S done; P V may still run
        if s_loaded is not None:
            s_loaded()
        out = work(s)
        o = acc_ref[...]  # waits for P V
        o, out = lax.optimization_barrier((o, out))
        return o, out

    return pl.run_scoped(scope, plgpu.ACC(acc.shape, jnp.float32), plgpu.ACC((WG_ROWS, block_k), jnp.float32))


def pv(acc: jax.Array, p: jax.Array, v_tile, while_running: Callable[[], None] | None = None) -> jax.Array:
    """``O += P V`` with P from registers and a V tile ``[block_k, Dp]`` in shared memory; ``while_running()``
    (e.g. waiting for the next K tile) runs while the product is in flight."""

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, p, v_tile)
        if while_running is not None:
            while_running()

    return pl.run_state(scope)(plgpu.ACC.init(acc))


def write_rows(acc: jax.Array, m: jax.Array, l: jax.Array, o_smem, lse_smem, out_view, lse_view, dtype) -> None:
    """Normalise O by l and store it (``[64, Dp]``, the kernel's dtype) and the rows' lse (``[64]`` float32,
    natural log; empty rows: O 0, lse -inf; a NaN l stays NaN) through shared memory with TMA. The caller waits
    (``plgpu.wait_smem_to_gmem``) before the kernel ends."""
    inv = jnp.where(l == 0.0, 0.0, 1.0 / l)
    o_smem[...] = (acc * by_row(inv, acc.shape)).astype(dtype)
    lse_smem[...] = (m + jnp.log2(l)) * LN2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_view)
    plgpu.copy_smem_to_gmem(lse_smem, lse_view)
