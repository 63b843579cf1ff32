"""`tree_decode_attention`: validation and dispatch to an implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import nonfinite
from pallas_kernels.checks import check_int, check_pow2, check_qkv, check_sm_scale, fmt_shape
from pallas_kernels.platform import chosen_implementation, num_cores
from pallas_kernels.tiling import cdiv
from pallas_kernels.tree_decode import triton as td_triton
from pallas_kernels.tree_decode.reference import tree_decode_attention_reference

IMPLEMENTATIONS = ("reference", "triton")

def check_masks(q, k, prefix_valid, block_start, block_mask) -> None:
    """prefix_valid bool ``[B, S]``, block_start an int32 scalar (or Python int), block_mask
    bool ``[B, T, W]`` with ``1 <= W <= S``; a concrete block_start must lie in [0, S - W]."""
    b, t = q.shape[0], q.shape[1]
    s = k.shape[1]
    if getattr(prefix_valid, "shape", None) != (b, s):
        raise ValueError(f"prefix_valid: expected shape [{b}, {s}] ([B, S] from q and k); "
                         f"received {fmt_shape(getattr(prefix_valid, 'shape', ()))}")
    if prefix_valid.dtype != jnp.bool_:
        raise ValueError(f"prefix_valid: expected dtype bool; received {prefix_valid.dtype}")
    shape = getattr(block_mask, "shape", None)
    if shape is None or len(shape) != 3 or shape[:2] != (b, t):
        raise ValueError(f"block_mask: expected shape [{b}, {t}, W] ([B, T, W] from q); "
                         f"received {fmt_shape(shape or ())}")
    if not 1 <= shape[2] <= s:
        raise ValueError(f"block_mask: expected 1 <= W <= S={s}; received W={shape[2]}")
    if block_mask.dtype != jnp.bool_:
        raise ValueError(f"block_mask: expected dtype bool; received {block_mask.dtype}")
    if isinstance(block_start, bool) or not (
        isinstance(block_start, int)
        or (getattr(block_start, "shape", None) == () and jnp.issubdtype(block_start.dtype, jnp.integer))
    ):
        raise ValueError(f"block_start: expected an int32 scalar; received "
                         f"{type(block_start).__name__} {getattr(block_start, 'shape', '')} "
                         f"{getattr(block_start, 'dtype', '')}".rstrip())
    if not isinstance(block_start, jax.core.Tracer):
        start = int(np.asarray(block_start))
        if not 0 <= start <= s - shape[2]:
            raise ValueError(f"block_start: expected 0 <= block_start <= S - W = {s - shape[2]}; "
                             f"received {start}")


def tree_decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    prefix_valid: jax.Array,
    block_start: jax.Array | int,
    block_mask: jax.Array,
    *,
    sm_scale: float | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
    block_k: int = 64,
    block_r: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    check_finite: bool = False,
    layer: int | None = None,
) -> jax.Array:
    """Attention of T new tokens over a long cache: one softmax over the prefix and a block.

    Args:
      q: ``[B, T, N, D]`` new-token queries (T small, e.g. <= 64 draft-tree nodes); bf16,
        fp16 or fp32.
      k, v: ``[B, S, K, D]`` the cache with the new tokens' keys already written; N % K == 0
        (GQA: head n reads key head n // (N / K)).
      prefix_valid: bool ``[B, S]``, the cache slots every query sees (must exclude the block).
      block_start: int32 scalar, first slot of the block.
      block_mask: bool ``[B, T, W]``, which of the slots ``block_start .. block_start + W - 1``
        each query sees (its ancestors and itself).
      sm_scale: softmax scale, a finite float > 0; default ``D ** -0.5``.
      implementation: ``"reference"`` (pure JAX) or ``"triton"`` (Pallas Triton split-K);
        None picks triton on a GPU, reference on CPU unless ``interpret``.
      interpret: run the Pallas kernel in interpret mode; None means True off GPU.
      block_k: keys per tile (a power of two >= 16). The last ``S % block_k`` keys are done
        in plain JAX with the block.
      block_r: query rows (of the ``G * T`` per key head) per program, a power of two >= 16;
        default ``G * T`` rounded up to a power of two, at most 128.
      num_splits: key slices per (batch, key head, row tile); default one program per SM,
        at least 2 key tiles per slice.
      num_warps, num_stages: Triton launch parameters (default 4 warps, 3 stages within
        the shared-memory budget).
      check_finite: raise `NonFiniteError` (under ``jax.jit`` a ``checkify`` error) when q,
        k or v holds a NaN or an inf (every slot, valid or not), instead of propagating it.
      layer: None, or a Python int: k and v are then a stacked cache ``[L, B, S, K, D]`` and the op
        attends to layer ``layer`` (the Triton kernel reads it where it lies; slicing it first would make
        XLA copy the layer's keys and values before the custom call).

    Returns:
      ``[B, T, N, D]`` in q's dtype; a query that sees no key gives 0; a query that sees a
      non-finite score or value gives NaN; invalid slots contribute nothing whatever they
      hold (`pallas_kernels.nonfinite`).
    """
    if layer is not None:
        check_int("layer", layer, 0)
        if getattr(k, "ndim", None) != 5 or layer >= k.shape[0] or getattr(v, "shape", None) != k.shape:
            raise ValueError(f"k / v: expected a stacked cache [L, B, S, K, D] with L > layer={layer}; received "
                             f"{fmt_shape(getattr(k, 'shape', ()))} / {fmt_shape(getattr(v, 'shape', ()))}")
        k_one = jax.ShapeDtypeStruct(k.shape[1:], k.dtype)
        check_qkv(q, k_one, k_one)
        check_masks(q, k_one, prefix_valid, block_start, block_mask)
    else:
        check_qkv(q, k, v)
        check_masks(q, k, prefix_valid, block_start, block_mask)
    b, t, n, d = q.shape
    s, kh = k.shape[-3], k.shape[-2]
    implementation = chosen_implementation(implementation, interpret, IMPLEMENTATIONS)
    check_pow2("block_k", block_k)
    if block_r is not None:
        check_pow2("block_r", block_r)
    if num_splits is not None:
        check_int("num_splits", num_splits, 1)
    if num_warps is not None:
        check_pow2("num_warps", num_warps, 1)
    if num_stages is not None:
        check_int("num_stages", num_stages, 1)
    sm_scale = check_sm_scale(sm_scale, d)
    if check_finite:
        nonfinite.check_finite(q=q, k=k if layer is None else k[layer], v=v if layer is None else v[layer])
    block_start = jnp.asarray(block_start, jnp.int32)
    if implementation == "reference":
        if layer is not None:
            k, v = k[layer], v[layer]
        return tree_decode_attention_reference(q, k, v, prefix_valid, block_start, block_mask,
                                               sm_scale=sm_scale)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    g = n // kh
    if block_r is None:
        block_r = td_triton.default_block_r(g * t)
    if num_splits is None:
        num_splits = td_triton.default_num_splits(b, kh, cdiv(g * t, block_r), s // block_k,
                                                  num_cores())
    return td_triton.tree_decode_attention_triton(
        q, k, v, prefix_valid, block_start, block_mask, sm_scale=sm_scale, block_k=block_k,
        block_r=block_r, num_splits=num_splits, interpret=bool(interpret), num_warps=num_warps,
        num_stages=num_stages, layer=layer,
    )
