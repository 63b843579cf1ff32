"""`block_sparse_attention`: validation and dispatch to an implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import nonfinite
from pallas_kernels.block_sparse import validation
from pallas_kernels.block_sparse.layout import BlockLayout
from pallas_kernels.block_sparse.merge import gather_rows, merge_attention, merge_onto
from pallas_kernels.block_sparse.mosaic_gpu import (
    block_sparse_attention_mosaic_gpu,
    block_sparse_attention_rows_mosaic_gpu,
    prior_in_launch,
    row_range_pass,
)
from pallas_kernels.block_sparse.mosaic_options import check_supported
from pallas_kernels.block_sparse.mosaic_options import preferred as mosaic_preferred
from pallas_kernels.block_sparse.reference import block_sparse_attention_reference
from pallas_kernels.block_sparse.triton import block_sparse_attention_triton
from pallas_kernels.checks import check_qkv, check_sm_scale
from pallas_kernels.platform import default_implementation, is_sm90

IMPLEMENTATIONS = ("reference", "triton", "mosaic_gpu")


def block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layout: BlockLayout,
    *,
    sm_scale: float | None = None,
    causal: bool = True,
    implementation: str | None = None,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    check_finite: bool = False,
    prior: tuple[jax.Array, jax.Array] | None = None,
    merge_in_launch: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Attention over the (query block, key block) pairs a `BlockLayout` lists.

    Args:
      q: ``[B, T, N, D]`` queries, the last T of S positions; bf16, fp16 or fp32.
      k, v: ``[B, S, K, D]`` keys and values, N % K == 0 (GQA: head n reads key head
        n // (N / K)). Any D; non powers of two are zero-padded.
      layout: a `BlockLayout` built for ``q_len=T, kv_len=S``.
      sm_scale: softmax scale, a finite float > 0; default ``D ** -0.5``.
      causal: mask keys after the query's original position (and, per ``layout.gap`` /
        ``layout.window``, keys too near / too far; those need ``causal=True``).
      implementation: ``"reference"`` (pure JAX), ``"triton"`` (Pallas Triton) or
        ``"mosaic_gpu"`` (Pallas Mosaic GPU, Hopper only: bf16 / fp16, ``block_q`` 64 or 128,
        ``block_k`` 32, 64 or 128 (not 128 with ``block_q`` 64 and D > 64), D <= 128); None picks mosaic_gpu on an
        sm90 GPU where it supports the inputs and the layout has no key windows off multiples of 8 and no single key
        columns permuted per query head over grouped heads (`mosaic_options.preferred`; and no Triton launch parameter
        is given), triton on other GPUs, reference on CPU unless ``interpret``.
      interpret: run the Pallas Triton kernel in interpret mode (CPU); not for mosaic_gpu.
      num_warps, num_stages: Triton launch parameters (defaults by head dim); for mosaic_gpu
        ``num_stages`` is the K/V shared-memory stages (default `mosaic_options.default_stages`, at most
        `mosaic_options.max_stages`) and ``num_warps`` must be None.
      check_finite: raise `NonFiniteError` (or, under ``jax.jit``, a ``checkify`` error) when
        q, k or v holds a NaN or an inf, instead of propagating it.
      prior: None, or (out ``[B, T, N, D]`` in q's dtype, lse float32 ``[B, N, T]``): attention of the same queries
        over keys the layout does not list; the result is `merge.merge_attention` of it with the layout's.
      merge_in_launch: on the Mosaic GPU kernel, merge the prior in before the kernel's store where its rows are
        the original rows (`block_sparse_attention_mosaic_gpu`; off by default: barely faster where measured); else,
        and on the other implementations, it is merged afterwards.

    Returns:
      out ``[B, T, N, D]`` in q's dtype and lse ``[B, N, T]`` float32 (natural log). Rows
      with no visible key give out 0 and lse -inf; a row that sees a non-finite q . k score or
      value gives NaN out and NaN lse; masked keys contribute nothing whatever they hold
      (`pallas_kernels.nonfinite`). Listed block ids outside ``[0, ceil(S / block_k))`` and
      columns outside ``[0, S)`` contribute nothing (checked when the layout is concrete);
      repeated ids must not occur (see `BlockLayout.check`).
    """
    implementation, sm_scale = _resolve(q, k, v, layout, sm_scale=sm_scale, causal=causal,
                                        implementation=implementation, interpret=interpret, num_warps=num_warps,
                                        num_stages=num_stages, check_finite=check_finite)
    _check_prior(prior, q)
    if not isinstance(merge_in_launch, bool):
        raise ValueError(f"merge_in_launch: expected True or False; received {merge_in_launch!r}")
    layout = _held(layout)
    return _run(implementation, q, k, v, layout, sm_scale=sm_scale, causal=causal, interpret=interpret,
                num_warps=num_warps, num_stages=num_stages, prior=prior, merge_in_launch=merge_in_launch)


def block_sparse_attention_parts(q: jax.Array, k: jax.Array, v: jax.Array, layouts, *, sm_scale: float | None = None,
                                 causal: bool = True, implementation: str | None = None, interpret: bool = False,
                                 check_finite: bool = False, prior: tuple[jax.Array, jax.Array] | None = None,
                                 row_mask: jax.Array | None = None, merge_in_launch: bool = False
                                 ) -> tuple[jax.Array, jax.Array]:
    """Attention over the union of several layouts whose key sets are disjoint for every row (the parts of a
    `LayoutSet`): `block_sparse_attention` of each, merged by lse in one pass with ``prior`` (`merge.merge_onto`,
    `merge_attention_all`: rounds to the out dtype once) -> out ``[B, T, N, D]`` (q's dtype), lse ``[B, N, T]``
    float32. ``row_mask``: None, or bool ``[B, T]``: the layouts are for those rows alone, the others keep the prior
    (or the empty result, out 0 / lse -inf, without one), whatever the layouts list there (a `RowSplit`'s kinds).

    ``merge_in_launch`` (off by default: barely faster where measured): the layouts that run on the Mosaic GPU
    kernel and can take a prior in their launch (`mosaic_gpu.prior_in_launch`: their rows are the original rows or
    strided boxes of them) run last, in turn, each merging the result so far in before its store, on the mask's
    rows, so no merge pass reads their outputs again; the others are merged first as above. Arguments as in
    `block_sparse_attention` (no Triton launch parameters); ``layouts`` a non-empty sequence of `BlockLayout`."""
    layouts = list(layouts)
    if not layouts:
        raise ValueError("layouts: expected at least one BlockLayout; received none")
    if not isinstance(merge_in_launch, bool):
        raise ValueError(f"merge_in_launch: expected True or False; received {merge_in_launch!r}")
    _check_prior(prior, q)
    _check_row_mask(row_mask, q)
    kw = dict(sm_scale=sm_scale, causal=causal, interpret=interpret, num_warps=None, num_stages=None)
    chosen = [_resolve(q, k, v, layout, implementation=implementation, check_finite=check_finite and i == 0, **kw)
              for i, layout in enumerate(layouts)]
    runs = [(layout, impl, scale, merge_in_launch and impl == "mosaic_gpu" and prior_in_launch(q, layout))
            for layout, (impl, scale) in zip(layouts, chosen, strict=True)]
    now = [_run(impl, q, k, v, _held(layout), sm_scale=scale, causal=causal, interpret=interpret, num_warps=None,
                num_stages=None) for layout, impl, scale, chained in runs if not chained]
    result = merge_onto(prior, now, row_mask)
    for layout, _, scale, chained in runs:
        if chained:
            result = block_sparse_attention_mosaic_gpu(q, k, v, _held(layout), sm_scale=scale, causal=causal,
                                                       prior=result, row_mask=row_mask, merge_in_launch=True)
    return result


def _check_prior(prior, q: jax.Array) -> None:
    """``prior``: None or (out shaped and typed like q, lse float32 ``[B, N, T]``)."""
    if prior is None:
        return
    b, t, n, _ = q.shape
    ok = isinstance(prior, (tuple, list)) and len(prior) == 2
    out, lse = prior if ok else (None, None)
    if not (ok and getattr(out, "shape", None) == q.shape and getattr(out, "dtype", None) == q.dtype
            and getattr(lse, "shape", None) == (b, n, t) and getattr(lse, "dtype", None) == jnp.float32):
        got = ([f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}" for x in prior]
               if isinstance(prior, (tuple, list)) else type(prior).__name__)
        raise ValueError(f"prior: expected None or (out {q.dtype}{list(q.shape)} as q, lse float32{[b, n, t]}); "
                         f"received {got}")


def _check_row_mask(row_mask, q: jax.Array) -> None:
    """``row_mask``: None or bool ``[B, T]`` of q's B and T."""
    if row_mask is None:
        return
    b, t = q.shape[0], q.shape[1]
    if getattr(row_mask, "shape", None) != (b, t) or getattr(row_mask, "dtype", None) != jnp.bool_:
        raise ValueError(f"row_mask: expected None or bool{[b, t]} ([B, T] of q); received "
                         f"{getattr(row_mask, 'dtype', type(row_mask).__name__)}"
                         f"{list(getattr(row_mask, 'shape', ()))}")


def _held(layout: BlockLayout) -> BlockLayout:
    """The layout with its arrays behind one ``lax.optimization_barrier`` (a no-op at run time), after the value
    checks. Under jit, a layout closed over as a constant would let XLA evaluate the passes' preparation (inverse
    permutations, item orders, list sorts) at compile time: with Grid's layout at 128k and the kernels stood in, 21.3 s
    on a CPU, 1.7 s with the barrier, 1.3 s with the layout as a jit argument (`tools/attend_compile_time.py`)."""
    leaves, tree = jax.tree.flatten(layout)
    return jax.tree.unflatten(tree, jax.lax.optimization_barrier(leaves))


def _run(implementation: str, q, k, v, layout: BlockLayout, *, sm_scale, causal, interpret, num_warps, num_stages,
         prior=None, merge_in_launch=False) -> tuple[jax.Array, jax.Array]:
    """The chosen implementation on checked arguments (`_resolve`, `_check_prior`)."""
    if implementation == "mosaic_gpu":
        return block_sparse_attention_mosaic_gpu(q, k, v, layout, sm_scale=sm_scale, causal=causal,
                                                 num_stages=num_stages, prior=prior, merge_in_launch=merge_in_launch)
    if implementation == "reference":
        out, lse = block_sparse_attention_reference(q, k, v, layout, sm_scale=sm_scale, causal=causal)
    else:
        out, lse = block_sparse_attention_triton(q, k, v, layout, sm_scale=sm_scale, causal=causal,
                                                 interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    return (out, lse) if prior is None else merge_attention(prior[0], prior[1], out, lse)


def _resolve(q, k, v, layout: BlockLayout, *, sm_scale, causal, implementation, interpret, num_warps, num_stages,
             check_finite) -> tuple[str, float]:
    """Checks of `block_sparse_attention`'s arguments (before anything is traced) and its implementation choice:
    (implementation, sm_scale)."""
    check_qkv(q, k, v)
    b, t, n, d = q.shape
    validation.check_layout_shapes(layout, b, n, t, k.shape[1])
    validation.check_layout_values(layout)
    if (layout.gap or layout.window) and not causal:
        raise ValueError(f"causal: expected True for a layout with a causal gap / window (layout.gap="
                         f"{layout.gap}, layout.window={layout.window}); received False")
    if implementation is None:
        implementation = default_implementation(interpret)
        if (implementation == "triton" and not interpret and num_warps is None and num_stages is None
                and is_sm90() and mosaic_preferred(q, layout, k.shape[2])):
            implementation = "mosaic_gpu"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation: expected one of {IMPLEMENTATIONS} or None; received {implementation!r}"
        )
    if implementation == "mosaic_gpu":
        check_supported(q, layout, num_stages)
        if num_warps is not None:
            raise ValueError(f"num_warps: expected None for implementation='mosaic_gpu' (three fixed "
                             f"warpgroups); received {num_warps!r}")
        if interpret:
            raise ValueError("interpret: expected False for implementation='mosaic_gpu' (Mosaic GPU's "
                             "interpret mode cannot run this kernel); received True")
    sm_scale = check_sm_scale(sm_scale, d)
    if check_finite:
        nonfinite.check_finite(q=q, k=k, v=v)
    return implementation, sm_scale


def block_sparse_attention_rows(q: jax.Array, k: jax.Array, v: jax.Array, layout: BlockLayout, *,
                                sm_scale: float | None = None, causal: bool = True, implementation: str | None = None,
                                interpret: bool = False, check_finite: bool = False
                                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`block_sparse_attention` of a layout with a ``q_block_range``, for the rows of those query blocks only:
    (rows int32 ``[B|1, N|1, R]``, `BlockLayout.range_rows`: the query index of each row, T for none; out ``[B, R,
    N, D]`` in q's dtype; lse ``[B, N, R]`` float32). `merge.merge_rows` merges them into a result over all rows.

    On the Mosaic GPU kernel (layouts of key blocks only) the rows are computed alone, each query block's list in
    chunks of `mosaic_lists.ROW_CHUNK` entries, one work item each, merged by lse; the other implementations compute
    the whole layout and return its rows. Arguments as in `block_sparse_attention` (no Triton launch parameters)."""
    implementation, sm_scale = _resolve(q, k, v, layout, sm_scale=sm_scale, causal=causal,
                                        implementation=implementation, interpret=interpret, num_warps=None,
                                        num_stages=None, check_finite=check_finite)
    if layout.q_block_range is None:
        raise ValueError("layout.q_block_range: expected (lo, hi) (the query blocks that list anything) for "
                         "block_sparse_attention_rows; received None")
    layout = _held(layout)
    if implementation == "mosaic_gpu" and row_range_pass(layout):
        return block_sparse_attention_rows_mosaic_gpu(q, k, v, layout, sm_scale=sm_scale, causal=causal)
    out, lse = _run(implementation, q, k, v, layout, sm_scale=sm_scale, causal=causal, interpret=interpret,
                    num_warps=None, num_stages=None)  # checked once, above
    rows = layout.range_rows()
    return (rows, *gather_rows(out, lse, rows))
