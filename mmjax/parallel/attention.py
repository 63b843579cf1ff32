"""Attention over a device mesh (``jax.shard_map``): what each decoder layer's injected ``attn_fn``
becomes when ``mmjax.prefill`` / ``decode_step`` get a mesh (axes "tp" and / or "sp", `models.sharding`).

* Heads ("tp"): q [B, T, N, D] and k / v [B, S, K, D] arrive split by head, whole GQA groups per
  device; the wrapped ``attn_fn`` runs on the device's N / tp query heads and K / tp key heads alone, so
  every dense kernel, sparse pattern and layout is device-local. A `SparseModelAttention` (a
  `SparseConfig`) learns which global heads it holds (``head_axis``) and runs their patterns.
* Sequence, prefill ("sp", `SequenceHeads`): the residual stream is split by token; attention swaps the
  split (one ``all_to_all`` of q, k, v: tokens -> heads, DeepSpeed-Ulysses) so each device holds the
  whole sequence of K / (tp * sp) key heads and their query heads, runs the wrapped ``attn_fn`` on them
  (sparse patterns see exactly their single-device input, hence exact for their masks), and swaps back.
  Needs tp * sp to divide the key-value heads.
* Sequence, prefill, ring ("sp", `SequenceRing`, dense attention when tp * sp does not divide the
  key-value heads): queries stay split by token, in zigzag pairs of chunks (device j of sp computes
  chunks j and 2 sp - 1 - j of 2 sp, so the causal work is even), and the K / V chunks go round the
  ring (``ppermute``), each merged into an online softmax; chunks wholly in a query pair's future are
  skipped. No device holds more than one other device's K / V chunk at a time.
* Sequence, decode ("sp", `SequenceDecode`): the cache is split by slot; each device attends its slots
  (exact softmax, float32 statistics) and the partial results merge by their log-sum-exp (``pmax`` /
  ``psum`` over "sp"). Dense attention only.

Shapes as in ``models.attention``: q [B, T, N, D], k / v [B, S, K, D], q_positions int32 [B, T],
kv_valid bool [B, S] (or [B, T, S]), modality int32 [B, S] or None -> out [B, T, N, D].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mmjax.sparse.model_attention import SparseModelAttention
from models.attention import LayerAttention, dense_attention
from models.sharding import SP, TP, axis_size
from pallas_kernels.checks import check_sm_scale
from pallas_kernels.nonfinite import finish, poison_keys, score_poison


def _axis(mesh: Mesh, name: str) -> str | None:
    return name if axis_size(mesh, name) > 1 else None


def _local(fn: Callable, head_axis) -> Callable:
    """``fn`` told which heads it holds when it is a sparse config's hook."""
    if isinstance(fn, SparseModelAttention):
        return dataclasses.replace(fn, head_axis=head_axis)
    return fn


def _call(fn, q, k, v, layer, q_positions, kv_valid, modality):
    return fn(q, k, v, layer=layer, q_positions=q_positions, kv_valid=kv_valid, modality=modality)


def _run_sharded(body, mesh, specs, out_spec, layer, arrays):
    """shard_map ``body(layer, *arrays)``; a Python-int ``layer`` stays static, a traced one is replicated,
    ``None`` arrays stay None."""
    static_layer = isinstance(layer, int)
    present = [i for i, a in enumerate(arrays) if a is not None]

    def inner(*xs):
        full = [None] * len(arrays)
        lay = layer if static_layer else xs[0]
        for i, x in zip(present, xs if static_layer else xs[1:]):
            full[i] = x
        return body(lay, *full)

    in_specs = tuple(specs[i] for i in present)
    args = tuple(arrays[i] for i in present)
    if not static_layer:
        in_specs, args = (P(),) + in_specs, (jnp.asarray(layer, jnp.int32),) + args
    return jax.shard_map(inner, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(*args)


@dataclasses.dataclass(frozen=True)
class HeadParallel:
    """``inner`` on each device's heads ("tp"); the sequence is whole on every device."""

    inner: Callable
    mesh: Mesh

    def __call__(self, q, k, v, *, layer=0, q_positions, kv_valid, modality=None):
        tp = _axis(self.mesh, TP)
        heads = P(None, None, tp, None)
        fn = _local(self.inner, tp)

        def body(layer, q, k, v, q_positions, kv_valid, modality):
            return _call(fn, q, k, v, layer, q_positions, kv_valid, modality)

        return _run_sharded(body, self.mesh, (heads, heads, heads, P(), P(), P()), heads, layer,
                            (q, k, v, q_positions, kv_valid, modality))


@dataclasses.dataclass(frozen=True)
class SequenceHeads:
    """Prefill with the tokens split over "sp" (and heads over "tp"): ``all_to_all`` to whole sequences of
    fewer heads, ``inner``, and back. q and k / v must have the same length (a prefill from an empty cache).
    ``tokens``: the prompt's own tokens when the sequence is right-padded past them (the cache's free slots,
    `mmjax.parallel.run.prefill_program`): ``inner`` sees exactly the first ``tokens`` queries and keys, as on
    one device (patterns that estimate from the last queries see the prompt's), the padding gets zeros."""

    inner: Callable
    mesh: Mesh
    tokens: int | None = None

    def __call__(self, q, k, v, *, layer=0, q_positions, kv_valid, modality=None):
        tp, sp = _axis(self.mesh, TP), SP
        n_sp = axis_size(self.mesh, SP)
        t = q.shape[1]
        if k.shape[1] != t:
            raise ValueError(f"k: sequence-parallel prefill attends the prompt's own keys (S == T = {t}); "
                             f"received k {tuple(k.shape)} (chunked prefill is not sequence-parallel)")
        pad = -t % n_sp
        real = t if self.tokens is None else self.tokens
        if not 1 <= real <= t:
            raise ValueError(f"tokens: expected None or 1 <= tokens <= the sequence length {t}; got {self.tokens}")
        padded = lambda x: jnp.pad(x, ((0, 0), (0, t + pad - x.shape[1]), (0, 0), (0, 0)))
        split = P(None, sp, tp, None)
        fn = _local(self.inner, tuple(a for a in (tp, sp) if a is not None))

        def cut(x):  # the prompt's own tokens of [B, T] / [B, T, S] per-token arrays
            if x is None or real == t:
                return x
            return x[:, :real, :real] if x.ndim == 3 else x[:, :real]

        def body(layer, q, k, v, q_positions, kv_valid, modality):
            # [B, Tp / sp, heads / tp, D] -> [B, real, heads / (tp * sp), D]
            whole = lambda x: jax.lax.all_to_all(x, sp, 2, 1, tiled=True)[:, :real]
            o = _call(fn, whole(q), whole(k), whole(v), layer, cut(q_positions), cut(kv_valid), cut(modality))
            return jax.lax.all_to_all(padded(o), sp, 1, 2, tiled=True)

        out = _run_sharded(body, self.mesh, (split, split, split, P(), P(), P()), split, layer,
                           (padded(q), padded(k), padded(v), q_positions, kv_valid, modality))
        return out[:, :t]


def _partial_attention(q, k, v, q_positions, kv_valid, offset, scale):
    """Exact attention of q [B, T, N, D] over one slice of keys k / v [B, s, K, D] starting at slot
    ``offset``: online-softmax state (m, l [B, K, G, T], acc [B, K, G, T, D]) in float32."""
    b, t, n, d = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, d)
    k, v = poison_keys(k, v)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    slots = offset + jnp.arange(s_len)
    valid = kv_valid[:, None, None, None, :] if kv_valid.ndim == 2 else kv_valid[:, None, None, :, :]
    ok = valid & (q_positions[:, None, None, :, None] >= slots[None, None, None, None, :])
    poison = jnp.sum(score_poison(s, ok), axis=-1)
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isneginf(m), 0.0, m)[..., None])
    l = jnp.sum(p, axis=-1) + poison
    acc = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, l, acc


def _merge(state, part):
    """Two online-softmax states (m, l, acc) over disjoint keys -> one."""
    (m, l, acc), (m2, l2, acc2) = state, part
    big = jnp.maximum(m, m2)
    safe = jnp.where(jnp.isneginf(big), 0.0, big)
    a, b = jnp.exp(m - safe), jnp.exp(m2 - safe)
    return big, l * a + l2 * b, acc * a[..., None] + acc2 * b[..., None]


def zigzag_perms(n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(source, destination) device pairs sending each device's first / second chunk of 2 n to the device
    that computes it (device j computes chunks j and 2 n - 1 - j)."""
    home = lambda chunk: chunk if chunk < n else 2 * n - 1 - chunk
    return [(i, home(2 * i)) for i in range(n)], [(i, home(2 * i + 1)) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class SequenceRing:
    """Exact dense causal prefill with the tokens split over "sp" (heads over "tp"): zigzag query chunks,
    K / V chunks round the ring, online softmax (``sm_scale`` default D ** -0.5). q and k / v must have
    the same length (a prefill from an empty cache)."""

    mesh: Mesh
    sm_scale: float | None = None

    def __call__(self, q, k, v, *, layer=0, q_positions, kv_valid, modality=None):
        tp, sp = _axis(self.mesh, TP), SP
        n = axis_size(self.mesh, SP)
        b, t = q.shape[:2]
        if k.shape[1] != t or kv_valid.shape != (b, t):
            raise ValueError(f"k / kv_valid: ring attention attends the prompt's own keys (S == T = {t}, kv_valid "
                             f"[B, T]); received k {tuple(k.shape)}, kv_valid {tuple(kv_valid.shape)}")
        scale = check_sm_scale(self.sm_scale, q.shape[-1])
        c = -(-t // (2 * n))  # tokens per chunk; device j holds chunks 2j, 2j + 1
        pad = 2 * n * c - t
        padded = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        positions = jnp.concatenate([q_positions, jnp.broadcast_to(t + jnp.arange(pad, dtype=q_positions.dtype),
                                                                   (b, pad))], axis=1)
        send0, send1 = zigzag_perms(n)
        back0, back1 = [(d, s) for s, d in send0], [(d, s) for s, d in send1]
        ring = [(i, (i + 1) % n) for i in range(n)]

        def body(layer, q, k, v, positions, valid):
            j = jax.lax.axis_index(sp)
            first = jnp.where(j % 2 == 0, j, 2 * n - 1 - j)  # the chunk that arrives by send0
            second = jnp.where(j % 2 == 1, j, 2 * n - 1 - j)
            qz = jnp.concatenate([jax.lax.ppermute(q[:, :c], sp, send0), jax.lax.ppermute(q[:, c:], sp, send1)], 1)
            pos = jnp.concatenate([jax.lax.dynamic_slice_in_dim(positions, first * c, c, 1),
                                   jax.lax.dynamic_slice_in_dim(positions, second * c, c, 1)], 1)
            bq, tq, nq, d = qz.shape
            kh = k.shape[2]
            init = (jnp.full((bq, kh, nq // kh, tq), -jnp.inf, jnp.float32),
                    jnp.zeros((bq, kh, nq // kh, tq), jnp.float32), jnp.zeros((bq, kh, nq // kh, tq, d), jnp.float32))

            def step(s, carry):
                state, kc, vc = carry
                offset = ((j - s) % n) * 2 * c  # first slot of the visiting chunk
                ok = jax.lax.dynamic_slice_in_dim(valid, offset, 2 * c, 1)
                state = jax.lax.cond(offset > jnp.max(pos), lambda: state, lambda: _merge(
                    state, _partial_attention(qz, kc, vc, pos, ok, offset, scale)))
                return state, jax.lax.ppermute(kc, sp, ring), jax.lax.ppermute(vc, sp, ring)

            (m, l, acc), _, _ = jax.lax.fori_loop(0, n, step, (init, k, v))
            out, _ = finish(m, l, acc)
            out = jnp.einsum("bkgtd->btkgd", out).reshape(qz.shape).astype(q.dtype)
            return jnp.concatenate([jax.lax.ppermute(out[:, :c], sp, back0),
                                    jax.lax.ppermute(out[:, c:], sp, back1)], 1)

        split = P(None, sp, tp, None)
        out = _run_sharded(body, self.mesh, (split, split, split, P(), P()), split, layer,
                           (padded(q), padded(k), padded(v), positions, padded(kv_valid)))
        return out[:, :t]


@dataclasses.dataclass(frozen=True)
class SequenceDecode:
    """Decode against a cache split by slot over "sp" (heads over "tp"): each device attends its slots,
    partial results merge by log-sum-exp. Exact dense attention (``sm_scale`` default D ** -0.5)."""

    mesh: Mesh
    sm_scale: float | None = None

    def __call__(self, q, k, v, *, layer=0, q_positions, kv_valid, modality=None):
        tp, sp = _axis(self.mesh, TP), SP
        scale = check_sm_scale(self.sm_scale, q.shape[-1])
        s_local = k.shape[1] // axis_size(self.mesh, SP)

        def body(layer, q, k, v, q_positions, kv_valid, modality):
            m, l, acc = _partial_attention(q, k, v, q_positions, kv_valid, jax.lax.axis_index(sp) * s_local, scale)
            m_all = jax.lax.pmax(m, sp)
            w = jnp.exp(m - jnp.where(jnp.isneginf(m_all), 0.0, m_all))
            out, _ = finish(m_all, jax.lax.psum(l * w, sp), jax.lax.psum(acc * w[..., None], sp))
            return jnp.einsum("bkgtd->btkgd", out).reshape(q.shape).astype(q.dtype)

        valid = P(None, sp) if kv_valid.ndim == 2 else P(None, None, sp)
        heads, slots = P(None, None, tp, None), P(None, sp, tp, None)
        return _run_sharded(body, self.mesh, (heads, slots, slots, P(), valid, P()), heads, layer,
                            (q, k, v, q_positions, kv_valid, modality))


@dataclasses.dataclass(frozen=True)
class _Wrap:
    per_layer: Callable
    wrap: Callable

    def __call__(self, layer: int):
        return self.wrap(self.per_layer(layer))


def _each_layer(attention: LayerAttention, wrap: Callable) -> LayerAttention:
    if attention.scannable:
        return LayerAttention(uniform=wrap(attention.uniform))
    return LayerAttention(per_layer=_Wrap(attention.per_layer, wrap))


def prefill_attention(attention: LayerAttention, mesh: Mesh, kv_heads: int, tokens: int | None = None) -> LayerAttention:
    """Each layer's attention of a prefill on ``mesh`` for a decoder of ``kv_heads`` key-value heads:
    with an "sp" axis of size > 1, `SequenceHeads` (``tokens``: the prompt's length when the sequence is
    right-padded past it) when tp * sp divides ``kv_heads``, else `SequenceRing` (dense attention only, the
    padding masked: ValueError for any other); `HeadParallel` without one."""
    split = axis_size(mesh, TP) * axis_size(mesh, SP)
    if axis_size(mesh, SP) == 1:
        return _each_layer(attention, lambda fn: HeadParallel(fn, mesh))
    if kv_heads % split == 0:
        return _each_layer(attention, lambda fn: SequenceHeads(fn, mesh, tokens))
    if attention.scannable and attention.uniform is dense_attention:
        return LayerAttention(uniform=SequenceRing(mesh))
    raise ValueError(f"attention: with tp * sp = {split} devices not dividing the {kv_heads} key-value heads, "
                     "sequence-parallel prefill runs ring attention, which is dense; expected 'dense' (or a "
                     "mesh whose tp * sp divides the key-value heads, for sparse / cuDNN attention)")


def decode_attention(attention: LayerAttention, mesh: Mesh) -> LayerAttention:
    """Each layer's attention of a decode step (or a heads-only chunked prefill) on ``mesh``:
    `SequenceDecode` (dense) when it has an "sp" axis of size > 1, else `HeadParallel` around ``attention``."""
    if axis_size(mesh, SP) > 1:
        return LayerAttention(uniform=SequenceDecode(mesh))
    return _each_layer(attention, lambda fn: HeadParallel(fn, mesh))
