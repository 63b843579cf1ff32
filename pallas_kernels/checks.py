"""Argument checks shared by the kernel entry points (raised before anything is traced)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def fmt_shape(shape) -> str:
    """(2, 3) -> "[2, 3]" for error messages."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_int(name: str, value, lo: int) -> None:
    """``value`` must be a Python int (not a bool) >= ``lo``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name}: expected an int >= {lo}; received {value!r}")


def check_pow2(name: str, value, lo: int = 16) -> None:
    """``value`` must be a Python int power of two >= ``lo``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two >= {lo}; received {value!r}")


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
