"""Small numerical building blocks shared by the model ports."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# XLA options of the programs that run the decoder over a prompt or a prompt chunk: cuBLAS GEMMs instead of XLA's
# Triton GEMM fusions. With the fp8 weights of `models.fp8_linear` the autotuner otherwise compiles Triton fp8 GEMM
# candidates: the 7B decoder program at 262k tokens took 96.5 s to compile instead of 2.6 s (bf16 weights: 5.1 -> 1.9
# s; one H200, 2026-11-26, `tools/fp8_compile_time.py`). With bf16 weights the warm prefill time did not change (one
# H100, 2026-11-25, README). Harmless on other backends.
PREFILL_XLA_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as in HF Qwen2: normalise in float32, cast back to ``x.dtype``, then scale.

    x: [..., H], weight: [H] -> [..., H] (dtype of ``x * weight``).
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def map_chunks(fn: Callable[..., Any], args: Sequence[jax.Array], axis: int, chunk: int | None, *,
               out: Any = None) -> Any:
    """Apply a position-wise ``fn(*slices) -> pytree`` to ``args`` in chunks of ``chunk`` along ``axis``.

    Bounds the working set to one chunk: full chunks run under ``lax.fori_loop`` (each slice is read
    with ``dynamic_slice`` and its result written into the output with ``dynamic_update_slice``),
    the remainder (``n % chunk`` positions) is one more static call; nothing is padded or copied
    whole. ``fn`` must act independently on every index of ``axis``. ``out`` (optional, a pytree
    shaped like the full result) is the buffer written into: pass the donated input that the
    result replaces (e.g. the residual stream) to update it in place. ``chunk=None`` or a chunk
    at least as long as the axis calls ``fn`` once.

    Under a mesh whose "sp" axis splits the tokens (``jax.set_mesh``, as `mmjax.parallel` prefills), the axis
    is viewed as [sp, n / sp] and the chunks run along the second part (in one call when n / sp fits a chunk),
    every device its own tokens at once:
    a dynamic slice along the split axis itself would make XLA gather it whole on every device.
    """
    n = args[0].shape[axis]
    if chunk is None or n <= chunk:
        return fn(*args)
    parts = token_split()
    if parts > 1 and n % parts == 0:  # each device's n / parts tokens: whole when they fit in one chunk
        return fn(*args) if n // parts <= chunk else _map_chunks_split(fn, args, axis, chunk, parts, out)
    return _map_chunks_plain(fn, args, axis, chunk, out)


def _map_chunks_plain(fn, args, axis: int, chunk: int, out):
    """`map_chunks`' loop: full chunks under ``lax.fori_loop``, then the remainder."""
    n = args[0].shape[axis]
    full, rest = divmod(n, chunk)

    def piece(start, size):
        return fn(*(jax.lax.dynamic_slice_in_dim(a, start, size, axis) for a in args))

    if out is None:
        shapes = jax.eval_shape(lambda *a: piece(0, chunk), *args)
        out = jax.tree.map(lambda s: jnp.zeros(s.shape[:axis] + (n,) + s.shape[axis + 1:], s.dtype), shapes)

    def write(buf, res, start):
        return jax.tree.map(lambda o, r: jax.lax.dynamic_update_slice_in_dim(o, r.astype(o.dtype), start, axis),
                            buf, res)

    out = jax.lax.fori_loop(0, full, lambda i, buf: write(buf, piece(i * chunk, chunk), i * chunk), out)
    if rest:
        out = write(out, piece(full * chunk, rest), full * chunk)
    return out


def context_axis_size(name: str) -> int:
    """Size of axis ``name`` of the mesh in context (``jax.set_mesh``), 1 without one or without that axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or name not in mesh.axis_names:
        return 1
    return int(dict(zip(mesh.axis_names, mesh.axis_sizes))[name])


def token_split() -> int:
    """Size of the "sp" (token) axis of the mesh in context (``jax.set_mesh``), 1 without one."""
    return context_axis_size("sp")  # "sp": models.sharding.SP (not imported: it imports this module)


def _map_chunks_split(fn, args, axis: int, chunk: int, parts: int, out):
    """`map_chunks` with ``axis`` viewed as [parts, n / parts]: the chunks run along the second part."""
    n = args[0].shape[axis]

    def split(x):
        return x.reshape(x.shape[:axis] + (parts, n // parts) + x.shape[axis + 1:])

    def merge(x):
        return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])

    def fn_parts(*xs):  # xs [..., parts, c, ...]: fn on the parts' chunks as one [..., parts * c, ...] slice
        res = fn(*(merge(x) for x in xs))
        return jax.tree.map(lambda r: r.reshape(r.shape[:axis] + (parts, -1) + r.shape[axis + 1:]), res)

    res = _map_chunks_plain(fn_parts, [split(a) for a in args], axis + 1, chunk,
                            None if out is None else jax.tree.map(split, out))
    return jax.tree.map(merge, res)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "std"))
def _scaled_normal(key: jax.Array, *, shape: tuple[int, ...], dtype, std: float) -> jax.Array:
    return std * jax.random.normal(key, shape, dtype)


def scaled_normal(key: jax.Array, shape: Sequence[int], dtype, std: float) -> jax.Array:
    """Random init ``std * N(0, 1)`` of ``shape`` in ``dtype`` (the values of ``std * jax.random.normal(key,
    shape, dtype)``) as one compiled program: the draw and the scaling fuse, so the device holds only the
    result (eagerly, the draw and the product were two arrays of the weight's size at once: 72 GiB for
    Qwen3-30B-A3B's stacked expert weights)."""
    shape = tuple(shape)
    if not all(isinstance(s, (int, np.integer)) and s >= 0 for s in shape):
        raise ValueError(f"shape: expected non-negative integers, got {shape}")
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"dtype: expected a floating dtype, got {jnp.dtype(dtype)}")
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"std: expected a finite number >= 0, got {std}")
    return _scaled_normal(key, shape=tuple(int(s) for s in shape), dtype=jnp.dtype(dtype), std=float(std))
