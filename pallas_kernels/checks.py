"""Argument checks shared by the kernel entry points (raised before anything is traced)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

# Upper bound of every integer size / count argument: positions and block ids are int32, and
# sums of two sizes must stay representable (so no hyper-parameter overflows inside JAX).
MAX_INT_ARG = 2**30


def fmt_shape(shape) -> str:
    """(2, 3) -> "[2, 3]" for error messages."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def concrete(x) -> np.ndarray | None:
    """``x`` on the host for value checks, or None where there is nothing to check yet (``x`` is None or traced
    inside ``jax.jit``)."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_int(name: str, value, lo: int, hi: int = MAX_INT_ARG) -> None:
    """``value`` must be a Python int (not a bool) in ``[lo, hi]``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name}: expected an int >= {lo}; received {value!r}")
    if value > hi:
        raise ValueError(f"{name}: expected an int <= {hi}"
                         f"{' (int32 positions)' if hi == MAX_INT_ARG else ''}; received {value!r}")


def check_pow2(name: str, value, lo: int = 16, hi: int = MAX_INT_ARG) -> None:
    """``value`` must be a Python int power of two in ``[lo, hi]``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two >= {lo}; received {value!r}")
    if value > hi:
        raise ValueError(f"{name}: expected a power of two <= {hi}; received {value!r}")


def check_sm_scale(sm_scale, head_dim: int) -> float:
    """``sm_scale`` as a Python float: ``head_dim ** -0.5`` when None, else a finite number > 0
    given on the host (a static argument, never a traced value)."""
    if sm_scale is None:
        return float(head_dim) ** -0.5
    if isinstance(sm_scale, jax.core.Tracer):
        raise ValueError("sm_scale: expected a finite positive Python float (static); received a traced value")
    if isinstance(sm_scale, (bool, np.bool_)) or not isinstance(sm_scale, (int, float, np.integer, np.floating)) \
            and not (isinstance(sm_scale, (np.ndarray, jax.Array)) and np.shape(sm_scale) == ()
                     and jnp.issubdtype(sm_scale.dtype, jnp.floating)):
        raise ValueError(f"sm_scale: expected a finite positive float; received {sm_scale!r} "
                         f"({type(sm_scale).__name__})")
    value = float(sm_scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"sm_scale: expected a finite positive float; received {value!r}")
    return value


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """q ``[B,T,N,D]``, k/v ``[B,S,K,D]`` with N % K == 0, T <= S, one float dtype."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name}: expected rank 4 {'[B, T, N, D]' if name == 'q' else '[B, S, K, D]'}; "
                f"received shape {fmt_shape(getattr(x, 'shape', ()))}"
            )
        if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
            raise ValueError(
                f"{name}: expected dtype bfloat16, float16 or float32; received {x.dtype}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k, v: expected one dtype; received q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    b, t, n, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {fmt_shape(k.shape)}; received {fmt_shape(v.shape)}")
    bk, s, kh, dk = k.shape
    if bk != b:
        raise ValueError(f"k: expected batch {b} (from q {fmt_shape(q.shape)}); received {fmt_shape(k.shape)}")
    if dk != d:
        raise ValueError(f"k: expected head dim {d} (from q {fmt_shape(q.shape)}); received {fmt_shape(k.shape)}")
    if kh < 1 or n % kh:
        raise ValueError(
            f"k: expected a number of key heads K dividing the query heads N={n} (GQA); "
            f"received K={kh} (k {fmt_shape(k.shape)})"
        )
    if t > s:
        raise ValueError(
            f"q: expected T <= S (queries are the last T of S positions); received T={t}, "
            f"S={s}"
        )
    if min(b, t, n, d, s) < 1:
        raise ValueError(f"q, k: expected non-empty arrays; received q {fmt_shape(q.shape)}, k {fmt_shape(k.shape)}")
