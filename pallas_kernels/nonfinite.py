"""The NaN / inf contract every attention implementation follows, as small pure-JAX pieces
(they also lower inside the Pallas Triton kernels) and the opt-in ``check_finite`` check.

Contract, per query row (a query head at one position); a row's *visible* pairs are the
(row, key) pairs its mask lets through:

* a visible pair whose score ``q . k * sm_scale`` is not finite (a NaN or an inf anywhere in
  that query or that key), or whose key's value row ``v`` holds a NaN or an inf, makes the
  row's output NaN (every element) and its lse NaN;
* masked pairs contribute exactly nothing, whatever q, k or v hold there (a masked value is
  zeroed, never multiplied by a zero weight: 0 * inf is NaN);
* a row with no visible pair gives out 0 and lse -inf.

How the implementations carry the verdict: an online softmax adds `score_poison` (0, or NaN
for a visible non-finite score) to its normaliser ``l``; NaN stays NaN, so `finish` gives NaN
out and NaN lse without another carry. Non-finite values are moved onto their keys once
(`poison_keys`: the key becomes NaN, the value 0), so a visible bad value is a visible bad
score, and a masked one is nothing. Kernels that cannot afford the copy (the cache-streaming
tree-decode kernel) zero masked values in the tile and check the accumulator in `finish`.

The checks cost 15-22% of the block-sparse and QSA Triton kernels' time, so those run a copy
without them when `all_finite` says every input is finite (`checked_if_nonfinite`: a ``lax.cond`` on the device); the
contract is the same, except that a score which overflows from finite inputs is not flagged
(+inf still ends NaN in the exponent, -inf counts as weight 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from pallas_kernels.tiling import LN2


class NonFiniteError(ValueError):
    """An input of an attention call holds a NaN or an inf and ``check_finite=True`` was asked."""


def poison_keys(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k, v ``[..., D]`` (same shape) -> (k', v'): where a value row holds a NaN or an inf, the
    key row becomes NaN and the value row 0. Dtypes are kept."""
    bad = ~jnp.all(jnp.isfinite(v), axis=-1, keepdims=True)
    return jnp.where(bad, jnp.nan, k).astype(k.dtype), jnp.where(bad, 0, v).astype(v.dtype)


def value_poison(v: jax.Array, axis: int = -1) -> jax.Array:
    """float32 with ``axis`` of ``v`` reduced: 0 where that row of v is finite, NaN otherwise."""
    return jnp.sum(v.astype(jnp.float32) * 0.0, axis=axis)


def all_finite(*arrays: jax.Array) -> jax.Array:
    """bool scalar: no NaN or inf in any of the arrays."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in arrays]))


def checked_if_nonfinite(run: Callable[[bool], Any], *arrays: jax.Array) -> Any:
    """``run(poison)`` with ``poison=False`` (the kernel without its per-tile checks) when every array is finite,
    else ``run(True)``: one ``lax.cond`` on `all_finite`, decided on the device (both branches are compiled)."""
    return jax.lax.cond(all_finite(*arrays), lambda: run(False), lambda: run(True))


def score_poison(s: jax.Array, ok: jax.Array | None = None) -> jax.Array:
    """float32 scores ``[..., R, L]`` -> ``[..., R, L]``: NaN at visible non-finite scores, 0
    elsewhere. ``ok`` (broadcastable bool) marks visible pairs; None = all visible."""
    z = s * 0.0
    return z if ok is None else jnp.where(ok, z, 0.0)


def finish(m: jax.Array, l: jax.Array, acc: jax.Array, *, base2: bool = False,
           check_acc: bool = False) -> tuple[jax.Array, jax.Array]:
    """Online-softmax state -> (out ``[..., R, D]`` float32, lse ``[..., R]`` natural log).

    m ``[..., R]`` running max (base 2 when ``base2``), l ``[..., R]`` normaliser (NaN for a
    poisoned row), acc ``[..., R, D]``. ``l == 0`` (no visible key) gives 0 and -inf; a NaN l
    gives NaN and NaN. ``check_acc``: also poison rows whose accumulator is not finite (for
    kernels that leave visible non-finite values in place)."""
    if check_acc:
        l = l + jnp.sum(acc * 0.0, axis=-1)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = acc / l_safe[..., None]
    lse = (m + jnp.log2(l_safe)) * LN2 if base2 else m + jnp.log(l_safe)
    return out, jnp.where(empty, -jnp.inf, lse)


def check_finite(**arrays) -> None:
    """Raise `NonFiniteError` naming the first argument that holds a NaN or an inf.

    Concrete arrays are checked on the host. Traced arrays (inside ``jax.jit``) get a
    ``jax.experimental.checkify`` check: wrap the jitted function with
    ``checkify.checkify(f, errors=checkify.user_checks)`` and call ``err.throw()``."""
    for name, x in arrays.items():
        if x is None:
            continue
        if isinstance(x, jax.core.Tracer):
            checkify.check(jnp.all(jnp.isfinite(x)),
                           f"{name}: expected finite values (check_finite=True); received a NaN or an inf "
                           f"({{count}} non-finite)", count=jnp.sum(~jnp.isfinite(x)))
            continue
        finite = np.asarray(jnp.isfinite(x))
        if not finite.all():
            where = tuple(int(i) for i in np.argwhere(~finite)[0])
            value = np.asarray(x[where], np.float32)
            raise NonFiniteError(f"{name}: expected finite values (check_finite=True); received "
                                 f"{int((~finite).sum())} non-finite, the first {value} at index {list(where)}")
